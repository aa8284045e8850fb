"""Dry-run CLI: ``python -m recpipe.planner --tables tables.yaml --world-size 16
--local-world-size 8 --hbm 80GiB --ddr 1TiB`` prints the placement plan.

``--hbm`` is per device, ``--ddr`` host memory per machine (shared by its ranks); bytes are those of
fbgemm's CUDA tables unless ``--backend native``. No GPU is needed. The tables file format: ``--help``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import yaml

from recpipe.pipeline.placement import SUPPORTED_OPTIMIZERS, FusedOptimizerKind, check_load_factors
from recpipe.planner.communication import PLANNED_SHARDING_TYPES
from recpipe.planner.errors import PlacementPlannerError
from recpipe.planner.planners import (
    COMMUNICATION_CONSTANTS,
    DEFAULT_DDR_RESERVATION,
    DEFAULT_HBM_RESERVATION,
    PlacementPlanner,
)
from recpipe.planner.specs import (
    DEFAULT_LOAD_FACTORS,
    DEFAULT_ZIPF_ALPHA,
    STORAGE_BACKENDS,
    TableSpec,
    check_topology_args,
    make_topology,
)

_UNITS = {"": 1, "b": 1}  # lower-case unit -> bytes: decimal kB..PB, binary KiB..PiB
_UNITS.update({f"{prefix}b": 10 ** (3 * k) for k, prefix in enumerate("kmgtp", 1)})
_UNITS.update({f"{prefix}ib": 2 ** (10 * k) for k, prefix in enumerate("kmgtp", 1)})
_TABLES_HELP = f"""tables file (--tables): a YAML list, one mapping per table:
  - {{name: user_id, rows: 100000000, dim: 128, dtype: float32, optimizer: adam,
     lookups_per_step: 65536, zipf_alpha: 1.1}}
  name, rows, dim are required; dtype (float32, the only one tiered tables run),
  optimizer (sgd, rowwise_adagrad, adam; default --optimizer), lookups_per_step
  (ids per step per rank, default 512) and zipf_alpha (access skew, default {DEFAULT_ZIPF_ALPHA})
  are optional. Pins, dynamic tables included (PlacementConstraints(dynamic=DynamicTableOptions(...))),
  are given through the Python API: PlacementPlanner(topology, constraints=...)."""
_TABLE_KEYS = {"name", "rows", "dim", "dtype", "optimizer", "lookups_per_step", "zipf_alpha"}
# Words of the planner's messages that name a Python argument -> the flag that sets it here.
_FLAG_OF = (
    ("hbm_cap", "--hbm (HBM per device)"),
    ("DDR per machine", "--ddr (host DDR per machine)"),
    ("hbm_reservation", "--hbm-reservation"),
    ("load_factors", "--load-factors"),
    ("load factors", "--load-factors"),
    ("bins=", "--bins HBM DDR"),
    ("backend='native'", "--backend native"),
    ("world_size", "--world-size"),
    ("local_world_size", "--local-world-size"),
    ("sharding_types", "--sharding-types"),
)
_REQUIRED_KEYS = ("name", "rows", "dim")


# A bare number below this many bytes is taken for a forgotten unit (``--hbm 80`` meant 80 GiB). Bytes.
MIN_BARE_SIZE: int = 2**20


def parse_size(text: str, flag: Optional[str] = None) -> int:
    """Bytes from a size such as ``80GiB``, ``1TiB``, ``512MB``, ``80B`` or ``1073741824``.

    Raises:
        argparse.ArgumentTypeError: not a size, or a bare number other than 0 below ``MIN_BARE_SIZE``;
            ``flag`` (e.g. ``--hbm``) is named in the fix.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: use a number with an optional unit B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB."
        )
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if not m.group(2) and 0 < float(m.group(1)) < MIN_BARE_SIZE:
        number = m.group(1)
        raise argparse.ArgumentTypeError(
            f"size {text!r} has no unit, so it means {number} bytes, too small for a memory budget (a number "
            f"without a unit must be at least {MIN_BARE_SIZE} bytes = 1 MiB): write {flag + ' ' if flag else ''}"
            f"{number}GiB, or {number}B if you mean bytes."
        )
    return size


def _size_of(flag: str) -> Callable[[str], int]:
    """The argparse ``type`` of size flag ``flag``: :func:`parse_size` naming the flag."""

    def parse(text: str) -> int:
        return parse_size(text, flag)

    parse.__name__ = "size"  # argparse names the type in its "invalid size value" fallback
    return parse


def load_tables(path: Path, default_optimizer: str) -> List[TableSpec]:
    """Read the YAML table list; values keep their YAML types (``rows: 10.7`` is an error, never 10).

    Raises:
        ValueError: the file cannot be read or parsed, or a table is malformed; names the file and table.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(
            f"--tables: expected the path of a YAML table list, got {type(path).__name__} {path!r}; "
            "pass e.g. Path('tables.yaml')."
        )
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--tables {path}: cannot read the file ({e.strerror or e}).") from e
    except yaml.YAMLError as e:
        raise ValueError(f"--tables {path}: not valid YAML ({str(e).splitlines()[0]}).") from e
    if data is None or data == []:
        raise ValueError(f"--tables {path}: the file lists no tables; give a YAML list of tables (see --help).")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a YAML list of tables, got {type(data).__name__}.")
    defaults = dict(dtype="float32", optimizer=default_optimizer, lookups_per_step=512, zipf_alpha=DEFAULT_ZIPF_ALPHA)
    specs: List[TableSpec] = []
    index_of: Dict[str, int] = {}  # table name -> its entry number (repeated names are refused)
    for k, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"{path}: table #{k} must be a mapping with keys {sorted(_TABLE_KEYS)}.")
        extra = set(item) - _TABLE_KEYS
        if extra:
            raise ValueError(f"{path}: table #{k} has unknown keys {sorted(extra)}; allowed: {sorted(_TABLE_KEYS)}.")
        missing = [key for key in _REQUIRED_KEYS if key not in item]
        if missing:
            raise ValueError(
                f"{path}: table #{k} ({item.get('name', 'unnamed')}) lacks {missing}; every table "
                f"needs {list(_REQUIRED_KEYS)}."
            )
        for key in ("name", "dtype", "optimizer"):
            value = item.get(key, "")
            if not isinstance(value, str) or (key == "name" and not value.strip()):
                example = {"name": "user_id", "dtype": "float32", "optimizer": "adam"}[key]
                raise ValueError(
                    f"{path}: table #{k}: {key} is {value!r} ({type(value).__name__}); it must be a "
                    f'non-empty string (YAML: quote it, e.g. {key}: "{example}").'
                )
        for key in ("rows", "dim", "lookups_per_step"):
            value = item.get(key)
            if isinstance(value, str) and re.fullmatch(r"\s*[0-9.]+[eE][+-]?[0-9]+\s*", value):
                # YAML 1.1 reads 1e6 (no dot, no sign) as a string: say so rather than "got '1e6' (str)"
                number = float(value)
                digits = str(round(number)) if math.isfinite(number) else "1000000"  # for the example
                raise ValueError(
                    f"{path}: table #{k} ({item['name']}): {key}: {value} is a string to YAML (YAML 1.1 "
                    f"reads an exponent as a number only with a decimal point and a sign, 1.0e+6); "
                    f"write the whole number, e.g. {key}: {digits}."
                )
        try:
            specs.append(TableSpec(**{**defaults, **item}))
        except ValueError as e:
            raise ValueError(f"{path}: table #{k}: {e}") from e
        first = index_of.setdefault(specs[-1].name, k)
        if first != k:
            raise ValueError(
                f"{path}: table #{k} is named {specs[-1].name!r} like table #{first}; every table "
                "needs its own name (rename one, or drop the duplicate entry)."
            )
    return specs


def _attach_negative_sizes(argv: Sequence[str]) -> List[str]:
    """``--hbm -1GiB`` -> ``--hbm=-1GiB``: argparse takes a detached ``-`` value for a flag; attached, it
    reaches the size checks, which name the fix."""
    out: List[str] = []
    for arg in argv:
        if out and out[-1] in ("--hbm", "--ddr") and re.fullmatch(r"-[0-9.].*", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    ap = argparse.ArgumentParser(
        prog="python -m recpipe.planner",
        description=__doc__.split("\n\n")[0],
        epilog=_TABLES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--tables", type=Path, required=True, help="YAML list of tables")
    ap.add_argument("--world-size", type=int, required=True, help="ranks (devices) of the job")
    ap.add_argument("--local-world-size", type=int, default=None, help="ranks per machine (default world size)")
    ap.add_argument("--hbm", type=_size_of("--hbm"), required=True, help="HBM per device, e.g. 80GiB")
    ap.add_argument("--ddr", type=_size_of("--ddr"), required=True, help="host DDR per machine, e.g. 1TiB")
    ap.add_argument(
        "--cost-model",
        choices=("analytic", "empirical"),
        default="analytic",
        help="analytic (torchrec's bandwidths, default) or empirical (TorchEasyRec's fitted hit rates)",
    )
    ap.add_argument(
        "--optimizer",
        default=FusedOptimizerKind.ADAM.value,
        choices=sorted(o.value for o in SUPPORTED_OPTIMIZERS),
        help="optimizer of tables that do not name one (the ones tiered tables run; default adam)",
    )
    for tier, default in (("hbm", DEFAULT_HBM_RESERVATION), ("ddr", DEFAULT_DDR_RESERVATION)):
        help_text = f"fraction of --{tier} kept free, in [0, 1) (default {default:g})"
        ap.add_argument(f"--{tier}-reservation", type=float, default=default, help=help_text)
    ap.add_argument(
        "--backend",
        choices=STORAGE_BACKENDS,
        default="fbgemm",
        help="tiered-table layout whose bytes are budgeted: fbgemm (CUDA, default) or native (recpipe's CPU layout)",
    )
    ap.add_argument(
        "--load-factors",
        type=float,
        nargs="+",
        default=None,
        metavar="X",
        help="cache load factors to choose from, each in (0, 1] (default "
        f"{' '.join(f'{x:g}' for x in DEFAULT_LOAD_FACTORS)}); smaller ones need less HBM",
    )
    ap.add_argument(
        "--bins",
        type=int,
        nargs=2,
        default=None,
        metavar=("HBM", "DDR"),
        help="DP grid: HBM and DDR bins, each >= 1 (default: sized by the planner)",
    )
    ap.add_argument(
        "--sharding-types",
        nargs="+",
        choices=PLANNED_SHARDING_TYPES,
        default=list(PLANNED_SHARDING_TYPES),
        help="sharding types to choose from per table: table_wise (whole on one rank: torchrec FUSED or recpipe "
        "tiered), row_wise (recpipe tiered over every rank) and column_wise (torchrec FUSED in column shards of "
        ">= 128 columns); default all",
    )
    ap.add_argument(
        "--communication",
        choices=("topology", *COMMUNICATION_CONSTANTS),
        default="topology",
        help="constants of the communication cost: topology (torchrec's CUDA bandwidths, default) or gloo_cpu "
        "(measured for gloo on CPU by scripts/calibrate_comm.py)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the plan as JSON here")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; returns the exit code (0 ok, 2 planner error)."""
    ap = build_parser()
    args = ap.parse_args(_attach_negative_sizes(sys.argv[1:] if argv is None else argv))
    lws = args.world_size if args.local_world_size is None else args.local_world_size
    try:
        flags = ("--world-size", "--local-world-size", "--hbm", "--ddr")
        check_topology_args(args.world_size, lws, args.hbm, args.ddr, names=flags, positive_sizes=True)
    except ValueError as e:
        # only --local-world-size may be omitted (--world-size is required)
        omit = args.world_size >= 1 and args.local_world_size is not None and args.local_world_size < 1
        ap.error(f"{e}{' Omit it for one machine.' if omit else ''}")
    for flag, value in (("--hbm-reservation", args.hbm_reservation), ("--ddr-reservation", args.ddr_reservation)):
        if not 0.0 <= value < 1.0:  # also refuses nan
            ap.error(f"{flag} must be a fraction in [0, 1), got {value}.")
    if args.load_factors is not None:
        try:
            check_load_factors(args.load_factors, "--load-factors")
        except ValueError as e:
            ap.error(str(e).replace("[...]", ""))
    if args.bins is not None and min(args.bins) < 1:
        ap.error(f"--bins must be two positive ints (HBM and DDR bins), got {args.bins}.")
    if args.json is not None and (
        args.json.is_dir() or not args.json.parent.is_dir() or not os.access(args.json.parent, os.W_OK)
    ):
        ap.error(f"--json {args.json}: not a writable file path (its directory must exist and be writable).")
    # torchrec Topology.ddr_cap is per rank
    topology = make_topology(
        world_size=args.world_size, local_world_size=lws, hbm_cap=args.hbm, ddr_cap=args.ddr // lws
    )
    planner = PlacementPlanner(
        topology,
        cost_model=args.cost_model,
        load_factors=tuple(args.load_factors) if args.load_factors else DEFAULT_LOAD_FACTORS,
        bins=tuple(args.bins) if args.bins else None,
        hbm_reservation=args.hbm_reservation,
        ddr_reservation=args.ddr_reservation,
        optimizer=args.optimizer,
        backend=args.backend,
        sharding_types=tuple(args.sharding_types),
        communication=args.communication,
    )
    try:
        plan = planner.plan(load_tables(args.tables, args.optimizer))
    except PlacementPlannerError as e:
        print(f"PlacementPlannerError[{e.planner_error_type.value}]: {e}", file=sys.stderr)
        named: Dict[str, str] = {}  # flag -> the first of its words the message uses
        for word, flag in _FLAG_OF:
            if word in str(e):
                named.setdefault(flag, word)
        if named:
            pairs = "; ".join(f"{word} = {flag}" for flag, word in named.items())
            print(f"(set here by flags: {pairs})", file=sys.stderr)
        return 2
    except ValueError as e:  # bad tables file: one message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(plan.report())
    if args.json:
        try:
            plan.save(args.json)
        except OSError as e:
            print(f"error: --json {args.json}: cannot write the plan ({e.strerror or e}).", file=sys.stderr)
            return 2
        print(f"plan written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
