"""Training configuration for ``python -m recpipe.recipes.train``.

One kw-only dataclass (torchtitan style): every field has a docstring, every value
is checked in ``__post_init__`` (numbers finite and in range, output paths
writable), and a bad value raises :class:`ConfigError` naming the field and the fix.
The CLI is generated from the fields (``--batch-size 512``; ``--help`` shows each
field's docstring, default, choices and unit), a bad command line raises
:class:`ConfigError` quoting it, and ``--config FILE.yaml`` (or the name of a
packaged config such as ``default``) supplies values that later CLI flags override.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.resources
import inspect
import math
import os
import re
import shlex
import sys
import tempfile
import textwrap
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

MODELS: tuple[str, ...] = ("dlrm", "micro_dlrm_dram")
DATASETS: tuple[str, ...] = ("movielens100k", "synthetic", "criteo_tsv")
PIPELINES: tuple[str, ...] = ("fused", "sparse")
PLACEMENTS: tuple[str, ...] = ("planned", "table_wise")
CHECKPOINT_FORMATS: tuple[str, ...] = ("pt", "dcp")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
# Largest id space the synthetic stream and hashing accept: ids stay below 2**31 so
# the 32-bit hash arithmetic never overflows int64 (see recipes/data/hashing.py).
MAX_ID_SPACE: int = 2**31 - 1
# Longest collective timeout accepted (7 days): far beyond any step, and far below
# where gloo's millisecond deadlines (steady clock + timeout, int64 ns) overflow.
MAX_TIMEOUT_S: float = 7 * 24 * 3600.0
# Largest tier budget accepted, exclusive, in MiB: 2**53 bytes, the range in which the
# planner's DP kernel (csrc/placement_dp.cpp, kExactBytes) carries bytes exactly as doubles
# (the planner plans a larger budget as unbounded); far larger values would overflow int64
# on the way to it. No machine comes near it.
MAX_TIER_MB: float = float(2**53 // 2**20)

# String fields with a fixed set of values.
CHOICES: dict[str, tuple[str, ...]] = {
    "model": MODELS,
    "dataset": DATASETS,
    "pipeline": PIPELINES,
    "device": DEVICES,
    "placement": PLACEMENTS,
    "checkpoint_format": CHECKPOINT_FORMATS,
}
# Units of the fields that have one (shown by --help).
UNITS: dict[str, str] = {
    "fast_tier_mb": "MiB",
    "slow_tier_mb": "MiB",
    "timeout_s": "seconds",
}
# Integer-list fields (``--dense-arch 64,64``; a YAML list) -> a valid example.
INT_LISTS: dict[str, str] = {
    "dense_arch": "64,64",
    "over_arch": "64,1",
}
# Output paths checked writable at validation: field -> is a directory.
OUTPUT_PATHS: dict[str, bool] = {
    "tb_dir": True,
    "checkpoint_dir": True,
    "metrics_file": False,
}


@dataclass(frozen=True, kw_only=True)
class FloatRule:
    """The accepted range of a float field: always finite, bounded below (and maybe above).

    Example::

        FloatRule(low=0.0, low_inclusive=False, example="0.01").accepts(float("nan"))  # False
    """

    low: float
    """Lower bound."""
    low_inclusive: bool
    """Whether ``low`` itself is accepted."""
    high: float | None = None
    """Upper bound (``None``: any finite value)."""
    high_inclusive: bool = True
    """Whether ``high`` itself is accepted."""
    example: str
    """A valid value for the error's fix."""
    note: str = ""
    """Why the range ends where it does, appended to the error (empty: nothing)."""

    def accepts(self, value: object) -> bool:
        """True when ``value`` is a finite int/float (not bool) inside the range."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        v = float(value)
        if not math.isfinite(v) or v < self.low or (v == self.low and not self.low_inclusive):
            return False
        if self.high is not None and (v > self.high or (v == self.high and not self.high_inclusive)):
            return False
        return True

    def bounds(self) -> str:
        """The range, e.g. ``> 0`` or ``in (0, 1)`` (whole numbers written out in full)."""
        if self.high is None:
            return f"{'>=' if self.low_inclusive else '>'} {_number(self.low)}"
        lo, hi = "[" if self.low_inclusive else "(", "]" if self.high_inclusive else ")"
        return f"in {lo}{_number(self.low)}, {_number(self.high)}{hi}"

    def describe(self, name: str) -> str:
        """The rule in words for field ``name``, e.g. ``must be a finite number > 0``."""
        unit = f" {UNITS[name]}" if name in UNITS else ""
        note = f"; {self.note}" if self.note else ""
        return f"must be a finite number {self.bounds()}{unit} (not nan or inf){note}"


def _number(value: float) -> str:
    """``value`` for a message: whole numbers in full (``8589934592``, not ``8.58993e+09``)."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


_TIER_NOTE: str = "the placement planner takes budgets below 2^53 bytes (8 PiB)"
# Every float field of TrainConfig and its range (tests check none is missing).
FLOAT_RULES: dict[str, FloatRule] = {
    "embedding_lr": FloatRule(low=0.0, low_inclusive=False, example="0.05"),
    "dense_lr": FloatRule(low=0.0, low_inclusive=False, example="0.01"),
    "eval_fraction": FloatRule(low=0.0, low_inclusive=False, high=1.0, high_inclusive=False, example="0.1"),
    "zipf_alpha": FloatRule(low=0.0, low_inclusive=False, high=3.0, example="1.1"),
    "fast_tier_mb": FloatRule(
        low=0.0, low_inclusive=True, high=MAX_TIER_MB, high_inclusive=False, example="512", note=_TIER_NOTE
    ),
    "slow_tier_mb": FloatRule(
        low=0.0, low_inclusive=True, high=MAX_TIER_MB, high_inclusive=False, example="16384", note=_TIER_NOTE
    ),
    "timeout_s": FloatRule(low=1.0, low_inclusive=True, high=MAX_TIMEOUT_S, example="600"),
}


def output_path_problem(path: str, *, is_dir: bool) -> str | None:
    """Why ``path`` cannot be written as an output (``None`` when it can).

    Leaves nothing behind: an existing path must have the right kind and be
    writable; a missing one needs its nearest existing ancestor to be a writable
    directory (the run creates the missing directories). Writability is probed
    with an unnamed temporary file, so it also holds for root and read-only mounts.

    Args:
        path: the output path (file or directory).
        is_dir: whether the run writes a directory at ``path`` (else a file).

    Returns:
        A short reason, or ``None``.
    """
    p = Path(path)
    if p.exists():
        if is_dir and not p.is_dir():
            return f"{path!r} exists and is not a directory"
        if not is_dir and p.is_dir():
            return f"{path!r} is a directory, expected a file path"
        if not os.access(p, os.W_OK | (os.X_OK if is_dir else 0)):
            return f"{path!r} is not writable"
        if not is_dir:
            try:
                with open(p, "ab"):  # appends nothing: content and mtime stay
                    pass
            except OSError as e:
                return f"{path!r} cannot be opened for writing ({e.strerror})"
            return None
        directory = p
    else:
        directory = p.absolute().parent
        while not directory.exists():
            directory = directory.parent
        if not directory.is_dir():
            return f"cannot create {path!r}: {str(directory)!r} is not a directory"
        if not os.access(directory, os.W_OK | os.X_OK):
            return f"cannot create {path!r}: directory {str(directory)!r} is not writable"
    # os.access trusts permission bits (always true for root): a real, unnamed
    # temporary file also catches read-only mounts and pseudo file systems.
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return f"cannot write into directory {str(directory)!r} ({e.strerror or e})"
    return None


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


# A checkpoint step directory's name (``recipes.checkpoint.step_dir_name``: ``step_00000040``).
STEP_DIR_PATTERN: re.Pattern[str] = re.compile(r"^step_(\d{8,})$")


def checkpoint_steps(directory: str) -> list[int]:
    """Steps of every ``step_*`` directory in ``directory``, newest first (none verified).

    What ``--resume`` can try (``recipes.checkpoint`` verifies each and falls back past
    damaged ones); the config refuses ``--resume`` when there is none.
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR_PATTERN.match(p.name))]
    return sorted(steps, reverse=True)


class ConfigPathError(ConfigError):
    """An input file is missing or an output path cannot be written on this machine.

    Checked where the config is built: the workers' machine for ``train``, the
    launching machine for the torchx components (unless ``check_paths=False``).
    """


class ConfigMachineError(ConfigPathError):
    """A value this machine cannot run (e.g. more threads than it has CPUs).

    Checked with the paths (``check_paths``): on the workers' machine for ``train``,
    on the launching machine for the torchx components unless ``check_paths=False``.
    """


def machine_cpus() -> int:
    """Logical CPUs of this machine (``os.cpu_count()``; 1 when it is unknown)."""
    return os.cpu_count() or 1


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one training run needs. Validated on construction.

    Example::

        cfg = TrainConfig(dataset="synthetic", max_steps=40, batch_size=128)
        cfg = parse_config(["--config", "default", "--max-steps", "40"])
    """

    model: str = "micro_dlrm_dram"
    """``dlrm`` (torchrec DLRM, one table per feature sized to its vocabulary) or
    ``micro_dlrm_dram`` (each feature hashed into a large virtual table with wide rows)."""

    dataset: str = "movielens100k"
    """``movielens100k`` (from the recbole wheel), ``synthetic`` (Criteo-like stream)
    or ``criteo_tsv`` (files given by ``data_path``)."""

    data_path: str | None = None
    """Comma-separated Criteo TSV files (label, 13 ints, 26 hex). Only for ``criteo_tsv``.
    Every rank reads all of them (each its slice of every global batch): on several
    machines, each node's copy must hold the same rows. Do not change them during a run."""

    eval_data_path: str | None = None
    """Comma-separated Criteo TSV files for evaluation (at least one global batch of rows);
    default: the training files."""

    batch_size: int = 256
    """Samples per rank per step (the global batch is ``batch_size * world_size``)."""

    epochs: int = 1
    """Passes over the training split (MovieLens / Criteo); ignored when ``max_steps`` is set."""

    max_steps: int | None = None
    """Total training steps (MovieLens and Criteo wrap into further epochs); required for
    the endless ``synthetic`` stream."""

    embedding_dim: int = 64
    """Width of every embedding row (DLRM needs one width for all tables)."""

    num_embeddings: int = 100_000
    """Rows per table for ``dlrm`` on synthetic / Criteo data (ids are taken modulo)."""

    virtual_rows: int = 262_144
    """Rows of each virtual table of ``micro_dlrm_dram`` (2**18 by default)."""

    hash_k: int = 4
    """Rows each id is hashed to in ``micro_dlrm_dram`` (its pooling factor)."""

    dense_arch: tuple[int, ...] = (64, 64)
    """Dense MLP widths; the last must equal ``embedding_dim``."""

    over_arch: tuple[int, ...] = (64, 1)
    """Over-arch MLP widths; the last must be 1 (one logit)."""

    embedding_lr: float = 0.05
    """Learning rate of the fused row-wise Adagrad applied to the tables in backward."""

    dense_lr: float = 0.01
    """Learning rate of the dense Adagrad optimizer."""

    eval_fraction: float = 0.1
    """Share of MovieLens ratings held out for evaluation."""

    eval_every: int = 0
    """Evaluate every this many steps (0: only at the end)."""

    eval_batches: int = 20
    """Batches per rank per evaluation (capped by the eval split's size; a short last
    batch of the split is evaluated too)."""

    synthetic_id_space: int = 10_000_000
    """Largest per-feature id space of the synthetic stream (ids in ``[0, n)``)."""

    zipf_alpha: float = 1.1
    """Zipf exponent of the synthetic stream's first feature (later features steepen)."""

    pipeline: str = "fused"
    """``fused`` (recpipe TrainPipelineFusedSparseDist) or ``sparse`` (torchrec
    TrainPipelineSparseDist, for comparison)."""

    device: str = "auto"
    """``cpu``, ``cuda`` or ``auto`` (cuda when available); gloo on CPU, nccl on CUDA."""

    placement: str = "planned"
    """``planned``: recpipe.planner picks HYBRID / CACHING and a cache load factor per
    table, tables are sharded row-wise with hash routing into tiered storage
    (recpipe's sharders); ``table_wise``: torchrec's own sharder, whole tables
    placed greedily (for comparison)."""

    fast_tier_mb: float = 0.0
    """Fast-tier budget per device in MiB (HBM on CUDA, a host buffer on CPU) given
    to the planner; 0 = half the tables' per-rank bytes, so placements are tiered."""

    slow_tier_mb: float = 16384.0
    """Slow-tier (host DDR) budget per machine in MiB given to the planner."""

    num_threads: int = 1
    """``torch.set_num_threads`` per rank, at most the machine's logical CPUs (keep
    ranks x threads <= cores)."""

    seed: int = 0
    """Seed of model initialisation, data order and the synthetic stream."""

    tb_dir: str | None = None
    """TensorBoard log directory written by rank 0 (none when unset)."""

    metrics_file: str | None = None
    """JSON file rank 0 writes at the end: rank 0's loss of every step (``losses``), the
    logged means over all ranks (``logged_losses``), evaluations, final AUROC, throughput."""

    checkpoint_dir: str | None = None
    """Directory for checkpoints (one file per rank per saved step)."""

    checkpoint_every: int = 0
    """Save a checkpoint every this many steps into ``checkpoint_dir`` (0: only at the end,
    if a directory is set; a positive value needs the directory)."""

    checkpoint_format: str = "pt"
    """How checkpoints are written: ``pt`` (one ``rankR.pt`` per rank; resume needs the
    same world size and placement) or ``dcp`` (torch.distributed.checkpoint files via
    ``recpipe.pipeline.checkpoint.dcp`` plus a small ``rankR.pt`` per rank; resumable under another
    world size). Both are verified by the same sha256 manifest and resume exactly;
    ``--resume`` reads whichever format the checkpoint was written in."""

    resume: bool = False
    """Resume from the latest checkpoint in ``checkpoint_dir`` (exact: same losses)."""

    log_every: int = 10
    """Write train scalars and a log line every this many steps (and at the last step and
    every checkpoint step, so a resumed run logs the same intervals)."""

    progress_bar: bool = True
    """Show a tqdm bar on rank 0."""

    timeout_s: float = 600.0
    """Seconds a collective (all-to-all, all-reduce, barrier) may wait for the other
    ranks before this rank fails with an error naming the timeout; passed to
    ``torch.distributed.init_process_group``. A dead or frozen rank then stops the
    job within about this time instead of hanging it (gloo's default is 30 minutes).
    Raise it when a legitimate step (e.g. a large checkpoint) takes longer."""

    check_paths: dataclasses.InitVar[bool] = True
    """Not a field (no flag): whether construction also checks the file system, i.e.
    that the ``criteo_tsv`` input files exist and the output paths can be written
    (:class:`ConfigPathError`). The torchx components pass False when the paths exist
    only on the cluster; the workers check them again at start."""

    def __post_init__(self, check_paths: bool = True) -> None:
        def bad(name: str, why: str, fix: str, error: type[ConfigError] = ConfigError) -> ConfigError:
            return error(
                f"invalid config value {name}={getattr(self, name)!r}: {why}. Fix: {fix}"
            )

        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise bad(name, "unknown choice", f"use one of {', '.join(choices)}")
        positive = (
            "batch_size",
            "epochs",
            "embedding_dim",
            "num_embeddings",
            "virtual_rows",
            "hash_k",
            "eval_batches",
            "num_threads",
            "log_every",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise bad(name, "must be a positive integer", f"pass e.g. --{_flag(name)} 1")
        for name in ("eval_every", "checkpoint_every", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(name, "must be an integer >= 0", f"pass e.g. --{_flag(name)} 0")
        if self.max_steps is not None and (
            isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps <= 0
        ):
            raise bad("max_steps", "must be a positive integer or unset", "pass e.g. --max-steps 100")
        for name, rule in FLOAT_RULES.items():
            value = getattr(self, name)
            if not rule.accepts(value):
                raise bad(name, rule.describe(name), f"pass e.g. --{_flag(name)} {rule.example}")
        if self.virtual_rows > MAX_ID_SPACE or self.num_embeddings > MAX_ID_SPACE:
            raise ConfigError(
                f"invalid table size virtual_rows={self.virtual_rows}, num_embeddings="
                f"{self.num_embeddings}: must be <= {MAX_ID_SPACE}. Fix: use fewer rows"
            )
        if (
            isinstance(self.synthetic_id_space, bool)
            or not isinstance(self.synthetic_id_space, int)
            or not 2 <= self.synthetic_id_space <= MAX_ID_SPACE
        ):
            raise bad("synthetic_id_space", f"must be an integer in [2, {MAX_ID_SPACE}]", "pass e.g. --synthetic-id-space 10000000")
        for name, example in INT_LISTS.items():
            value = getattr(self, name)
            if (
                not isinstance(value, (list, tuple))
                or not value
                or any(isinstance(w, bool) or not isinstance(w, int) or w <= 0 for w in value)
            ):
                raise bad(
                    name,
                    "must be a non-empty list of positive integers",
                    f"pass e.g. --{_flag(name)} {example} (in YAML: {name}: [{example.replace(',', ', ')}])",
                )
            setattr(self, name, tuple(value))
        if self.dense_arch[-1] != self.embedding_dim:
            raise bad(
                "dense_arch",
                f"its last width {self.dense_arch[-1]} must equal embedding_dim={self.embedding_dim} (DLRM)",
                f"pass --dense-arch {','.join(map(str, self.dense_arch[:-1] + (self.embedding_dim,)))}",
            )
        if self.over_arch[-1] != 1:
            raise bad("over_arch", "needs positive widths ending in 1 (one logit)", "pass e.g. --over-arch 64,1")
        if self.dataset == "synthetic" and self.max_steps is None:
            raise bad("max_steps", "the synthetic stream is endless", "pass --max-steps N")
        if self.dataset == "criteo_tsv" and not self.data_path:
            raise bad("data_path", "criteo_tsv needs input files", "pass --data-path a.tsv[,b.tsv]")
        for name in ("resume", "progress_bar"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false", f"pass --{_flag(name)} or --no-{_flag(name)}")
        if self.resume and not self.checkpoint_dir:
            raise bad("checkpoint_dir", "resume=True needs a checkpoint directory", "pass --checkpoint-dir DIR")
        if self.checkpoint_every and not self.checkpoint_dir:  # it used to save nothing, silently
            raise bad(
                "checkpoint_every",
                "checkpoints are saved into --checkpoint-dir, which is unset, so none would be written",
                "pass --checkpoint-dir DIR, or drop --checkpoint-every",
            )
        for name in ("data_path", "eval_data_path", *OUTPUT_PATHS):
            path = getattr(self, name)
            if path is not None and not isinstance(path, str):
                raise bad(name, "must be a path (a string)", f"pass --{_flag(name)} PATH")
        for name in ("data_path", "eval_data_path"):
            if getattr(self, name) and self.dataset != "criteo_tsv":
                raise bad(name, f"is read only by --dataset criteo_tsv, not {self.dataset}",
                          f"drop --{_flag(name)}, or pass --dataset criteo_tsv")
        if not check_paths:
            return
        cpus = machine_cpus()
        if self.num_threads > cpus:
            # torch.set_num_threads accepts any count, and each intra-op thread is an OS
            # thread: far past the cores, thread creation fails later inside torch / gloo
            # ("Resource temporarily unavailable"); a few past them only slow each step.
            raise bad(
                "num_threads",
                f"more intra-op threads per rank than this machine's {cpus} logical CPU(s) "
                "(os.cpu_count()); torch would start that many OS threads per rank and fail "
                "creating them or run slower",
                f"pass --num-threads between 1 and {cpus} (ranks x threads <= CPUs is fastest)",
                ConfigMachineError,
            )
        if self.dataset == "criteo_tsv":
            for name in ("data_path", "eval_data_path"):
                for path in split_paths(getattr(self, name)):
                    if not os.path.isfile(path):
                        raise ConfigPathError(
                            f"invalid config value {name}: file {path!r} does not exist. "
                            "Fix: pass existing Criteo TSV files, comma-separated"
                        )
        for name, is_dir in OUTPUT_PATHS.items():
            path = getattr(self, name)
            if path is None or path == "":  # "" means unset, as in train.py
                continue
            problem = output_path_problem(path, is_dir=is_dir)
            if problem:
                raise bad(
                    name,
                    f"this output path is not writable ({problem})",
                    f"pass --{_flag(name)} with a {'directory' if is_dir else 'file'} path you can write, "
                    "or fix the permissions",
                    ConfigPathError,
                )
        try:
            resumable = not self.resume or bool(checkpoint_steps(self.checkpoint_dir))  # type: ignore[arg-type]
        except OSError:  # unreadable
            resumable = False
        if not resumable:
            raise bad(
                "checkpoint_dir",
                "resume=True but this directory holds no checkpoint (no step_* directory)",
                "point --checkpoint-dir at the directory a previous run saved into, or drop --resume",
                ConfigPathError,
            )

    def to_dict(self) -> dict[str, Any]:
        """Returns the config as plain YAML/JSON-friendly values."""
        out = dataclasses.asdict(self)
        out["dense_arch"] = list(self.dense_arch)
        out["over_arch"] = list(self.over_arch)
        return out


def split_paths(value: str | None) -> list[str]:
    """Splits a comma-separated path list; ``None`` gives ``[]``."""
    return [p for p in (value or "").split(",") if p]


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def packaged_config_path(name: str) -> Path:
    """Path of a YAML config shipped in ``recpipe.recipes/configs``.

    Args:
        name: file stem, e.g. ``"default"``.

    Returns:
        The file path (inside the installed package).
    """
    res = importlib.resources.files("recpipe.recipes") / "configs" / f"{name}.yaml"
    return Path(str(res))


def load_yaml(path_or_name: str) -> dict[str, Any]:
    """Reads a YAML config: a file path, or the name of a packaged config.

    Args:
        path_or_name: ``"configs/x.yaml"`` or ``"default"``.

    Returns:
        The mapping of field names to values (unknown names raise ConfigError).
    """
    path = Path(path_or_name)
    if not path.is_file():
        packaged = packaged_config_path(path_or_name)
        if not packaged.is_file():
            raise ConfigError(
                f"config file {path_or_name!r} not found (neither a file nor a packaged config). "
                "Fix: pass an existing YAML path or one of: "
                + ", ".join(sorted(p.stem for p in packaged.parent.glob("*.yaml")))
            )
        path = packaged
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read ({e}). Fix: pass a readable YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML: {_yaml_problem(e)}. Fix: correct the YAML syntax there"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of field: value")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"config file {str(path)!r} has unknown keys {unknown}. Fix: use only {sorted(known)}"
        )
    return data


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML parse error on one line: what is wrong and where (1-based line and column)."""
    if not isinstance(error, yaml.MarkedYAMLError):
        return " ".join(str(error).split())
    parts = [p for p in (error.context, error.problem) if p]
    where = error.problem_mark or error.context_mark
    at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
    return ", ".join(parts) + at


def _parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def field_docs() -> dict[str, str]:
    """The docstring under each :class:`TrainConfig` field, read from the class source.

    The source is parsed with :mod:`ast` (the module's ``.py`` file ships next to it
    in the installed package); without a readable source the result is empty and
    ``--help`` lists the flags without descriptions.

    Returns:
        Field name -> docstring (whitespace-normalised, reST markup removed).
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(TrainConfig)))
    except (OSError, TypeError, SyntaxError):
        return {}
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
    if cls is None:
        return {}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}  # not the InitVar check_paths
    docs: dict[str, str] = {}
    for node, nxt in zip(cls.body, cls.body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id in fields
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            text = " ".join(nxt.value.value.split())
            text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)  # :class:`X` -> X
            docs[node.target.id] = text.replace("``", "")
    return docs


def _show_default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


class _CommandLineError(Exception):
    """argparse rejected the command line (raised instead of printing and exiting)."""


class _ArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise (``--help`` still prints and exits 0)."""

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        raise _CommandLineError(message)


def build_arg_parser() -> argparse.ArgumentParser:
    """The CLI: one flag per TrainConfig field plus ``--config``.

    Each flag's help is the field's docstring, its default, its choices and its unit.
    Errors raise instead of exiting; :func:`parse_config` turns them into
    :class:`ConfigError`.
    """
    parser = _ArgumentParser(
        prog="python -m recpipe.recipes.train",
        allow_abbrev=False,  # "--epoch 3" is an error, not a guess
        description=(
            "Train DLRM / micro-DLRM-DRAM with recpipe (run under torchrun or "
            "'torchx run recpipe.train' for more than one rank). Every flag is a field of "
            "recpipe.recipes.config.TrainConfig; values are checked before training starts."
        ),
        epilog=(
            "--config FILE.yaml (or a packaged name: default) supplies field: value defaults; "
            "flags given on the command line override them."
        ),
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="YAML",
        help="YAML file of field: value pairs, or a packaged config name (default); "
        "later flags override its values",
    )
    hints = _field_types()
    docs = field_docs()
    for f in dataclasses.fields(TrainConfig):
        hint = hints[f.name]
        flag = f"--{_flag(f.name)}"
        extras = []
        if f.name in CHOICES:
            extras.append("choices: " + ", ".join(CHOICES[f.name]))
        if f.name in UNITS:
            extras.append(f"unit: {UNITS[f.name]}")
        if f.name in FLOAT_RULES:
            extras.append(f"range: {FLOAT_RULES[f.name].bounds()}")
        if f.default is not dataclasses.MISSING:
            extras.append(f"default: {_show_default(f.default)}")
        text = docs.get(f.name, "")
        help_text = (f"{text} [{'; '.join(extras)}]" if text else f"[{'; '.join(extras)}]").replace("%", "%%")
        if hint is bool:
            parser.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
            continue
        if hint == tuple[int, ...]:
            kind, metavar = _parse_ints, "W1,W2,..."
        elif hint in (int, int | None):
            kind, metavar = int, "N"
        elif hint is float:
            kind, metavar = float, UNITS.get(f.name, "X").upper()
        else:
            kind = str
            metavar = "{" + ",".join(CHOICES[f.name]) + "}" if f.name in CHOICES else "VALUE"
            if f.name in OUTPUT_PATHS or f.name.endswith("_path"):
                metavar = "PATH"
        parser.add_argument(flag, dest=f.name, type=kind, default=None, metavar=metavar, help=help_text)
    return parser


def parse_config(argv: Sequence[str] | None = None, *, check_paths: bool = True) -> TrainConfig:
    """Builds a validated :class:`TrainConfig` from CLI arguments.

    ``--help`` prints every flag (described by its field's docstring) and exits 0.

    Args:
        argv: arguments (default ``sys.argv[1:]``); ``--config`` values come first,
            explicit flags override them.
        check_paths: also check the file system on this machine (input files exist,
            output paths writable: :class:`ConfigPathError`); False checks the values only.

    Returns:
        The validated config.

    Raises:
        ConfigError: an unknown flag, a value of the wrong type, or an invalid value;
            the message quotes the command line.

    Example::

        cfg = parse_config(["--config", "default", "--batch-size", "128"])
    """
    args = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    parser = build_arg_parser()
    try:
        ns = parser.parse_args(args)
    except _CommandLineError as e:
        raise ConfigError(
            f"bad command line {shlex.join(args)!r}: {e}. "
            f"Fix: see '{parser.prog} --help' for the flags and their values"
        ) from None
    values: dict[str, Any] = load_yaml(ns.config) if ns.config else {}
    hints = _field_types()
    for name, value in values.items():
        # YAML 1.1 reads 1e-3 (no dot) as a string: accept it for float fields
        if hints[name] is float and isinstance(value, str):
            try:
                values[name] = float(value)
            except ValueError:
                pass  # TrainConfig reports the field
    for f in dataclasses.fields(TrainConfig):
        v = getattr(ns, f.name)
        if v is not None:
            values[f.name] = v
    return TrainConfig(**values, check_paths=check_paths)


__all__ = [
    "CHOICES",
    "FLOAT_RULES",
    "INT_LISTS",
    "MAX_TIER_MB",
    "OUTPUT_PATHS",
    "STEP_DIR_PATTERN",
    "UNITS",
    "ConfigError",
    "ConfigMachineError",
    "ConfigPathError",
    "FloatRule",
    "TrainConfig",
    "build_arg_parser",
    "checkpoint_steps",
    "field_docs",
    "load_yaml",
    "machine_cpus",
    "output_path_problem",
    "packaged_config_path",
    "parse_config",
    "split_paths",
]
