"""Training configuration for ``python -m recpipe.recipes.train``.

One kw-only dataclass (torchtitan style): every field has a docstring, every value
is checked in ``__post_init__``, and a bad value raises :class:`ConfigError` naming
the field and the fix. The CLI is generated from the fields (``--batch-size 512``),
and ``--config FILE.yaml`` (or the name of a packaged config such as ``default``)
supplies values that later CLI flags override.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

MODELS: tuple[str, ...] = ("dlrm", "micro_dlrm_dram")
DATASETS: tuple[str, ...] = ("movielens100k", "synthetic", "criteo_tsv")
PIPELINES: tuple[str, ...] = ("fused", "sparse")
PLACEMENTS: tuple[str, ...] = ("planned", "table_wise")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
# Largest id space the synthetic stream and hashing accept: ids stay below 2**31 so
# the 32-bit hash arithmetic never overflows int64 (see recipes/data/hashing.py).
MAX_ID_SPACE: int = 2**31 - 1


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


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
    """Comma-separated Criteo TSV files (label, 13 ints, 26 hex). Only for ``criteo_tsv``."""

    eval_data_path: str | None = None
    """Comma-separated Criteo TSV files for evaluation; default: the training files."""

    batch_size: int = 256
    """Samples per rank per step (the global batch is ``batch_size * world_size``)."""

    epochs: int = 1
    """Passes over the training split (MovieLens / Criteo); ignored when ``max_steps`` is set."""

    max_steps: int | None = None
    """Total training steps; required for the endless ``synthetic`` stream."""

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
    """Batches per rank per evaluation (capped by the eval split's size)."""

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
    """``torch.set_num_threads`` per rank (keep ranks x threads <= cores)."""

    seed: int = 0
    """Seed of model initialisation, data order and the synthetic stream."""

    tb_dir: str | None = None
    """TensorBoard log directory written by rank 0 (none when unset)."""

    metrics_file: str | None = None
    """JSON file rank 0 writes at the end: per-step losses, final AUROC, throughput."""

    checkpoint_dir: str | None = None
    """Directory for checkpoints (one file per rank per saved step)."""

    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end, if a directory is set)."""

    resume: bool = False
    """Resume from the latest checkpoint in ``checkpoint_dir`` (exact: same losses)."""

    log_every: int = 10
    """Write train scalars and a log line every this many steps."""

    progress_bar: bool = True
    """Show a tqdm bar on rank 0."""

    def __post_init__(self) -> None:
        def bad(name: str, why: str, fix: str) -> ConfigError:
            return ConfigError(
                f"invalid config value {name}={getattr(self, name)!r}: {why}. Fix: {fix}"
            )

        for name, choices in (
            ("model", MODELS),
            ("dataset", DATASETS),
            ("pipeline", PIPELINES),
            ("device", DEVICES),
            ("placement", PLACEMENTS),
        ):
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
        for name in ("fast_tier_mb", "slow_tier_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise bad(name, "must be a number of MiB >= 0", f"pass e.g. --{_flag(name)} 512")
        for name in ("eval_every", "checkpoint_every", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(name, "must be an integer >= 0", f"pass e.g. --{_flag(name)} 0")
        if self.max_steps is not None and (
            isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps <= 0
        ):
            raise bad("max_steps", "must be a positive integer or unset", "pass e.g. --max-steps 100")
        for name in ("embedding_lr", "dense_lr"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise bad(name, "must be > 0", f"pass e.g. --{_flag(name)} 0.01")
        if not 0.0 < self.eval_fraction < 1.0:
            raise bad("eval_fraction", "must lie strictly between 0 and 1", "pass e.g. --eval-fraction 0.1")
        if not 0.0 < self.zipf_alpha <= 3.0:
            raise bad("zipf_alpha", "must lie in (0, 3]", "pass e.g. --zipf-alpha 1.1")
        if self.virtual_rows > MAX_ID_SPACE or self.num_embeddings > MAX_ID_SPACE:
            raise ConfigError(
                f"invalid table size virtual_rows={self.virtual_rows}, num_embeddings="
                f"{self.num_embeddings}: must be <= {MAX_ID_SPACE}. Fix: use fewer rows"
            )
        if not 2 <= self.synthetic_id_space <= MAX_ID_SPACE:
            raise bad("synthetic_id_space", f"must lie in [2, {MAX_ID_SPACE}]", "pass e.g. --synthetic-id-space 10000000")
        self.dense_arch = tuple(self.dense_arch)
        self.over_arch = tuple(self.over_arch)
        if not self.dense_arch or any(int(w) <= 0 for w in self.dense_arch):
            raise bad("dense_arch", "needs positive widths", "pass e.g. --dense-arch 64,64")
        if self.dense_arch[-1] != self.embedding_dim:
            raise bad(
                "dense_arch",
                f"its last width {self.dense_arch[-1]} must equal embedding_dim={self.embedding_dim} (DLRM)",
                f"pass --dense-arch {','.join(map(str, self.dense_arch[:-1] + (self.embedding_dim,)))}",
            )
        if not self.over_arch or any(int(w) <= 0 for w in self.over_arch) or self.over_arch[-1] != 1:
            raise bad("over_arch", "needs positive widths ending in 1 (one logit)", "pass e.g. --over-arch 64,1")
        if self.dataset == "synthetic" and self.max_steps is None:
            raise bad("max_steps", "the synthetic stream is endless", "pass --max-steps N")
        if self.dataset == "criteo_tsv":
            if not self.data_path:
                raise bad("data_path", "criteo_tsv needs input files", "pass --data-path a.tsv[,b.tsv]")
            for name in ("data_path", "eval_data_path"):
                for path in split_paths(getattr(self, name)):
                    if not os.path.isfile(path):
                        raise ConfigError(
                            f"invalid config value {name}: file {path!r} does not exist. "
                            "Fix: pass existing Criteo TSV files, comma-separated"
                        )
        if self.resume and not self.checkpoint_dir:
            raise bad("checkpoint_dir", "resume=True needs a checkpoint directory", "pass --checkpoint-dir DIR")

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
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of field: value")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"config file {str(path)!r} has unknown keys {unknown}. Fix: use only {sorted(known)}"
        )
    return data


def _parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def build_arg_parser() -> argparse.ArgumentParser:
    """The CLI: one flag per TrainConfig field plus ``--config``."""
    parser = argparse.ArgumentParser(
        prog="python -m recpipe.recipes.train",
        description="Train DLRM / micro-DLRM-DRAM with recpipe (run under torchrun for >1 rank).",
    )
    parser.add_argument("--config", default=None, help="YAML file or packaged config name (e.g. default)")
    hints = _field_types()
    for f in dataclasses.fields(TrainConfig):
        hint = hints[f.name]
        flag = f"--{_flag(f.name)}"
        if hint is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        elif hint == tuple[int, ...]:
            parser.add_argument(flag, dest=f.name, type=_parse_ints, default=None)
        else:
            base = {int: int, float: float, str: str, int | None: int, str | None: str}.get(hint, str)
            parser.add_argument(flag, dest=f.name, type=base, default=None)
    return parser


def parse_config(argv: Sequence[str] | None = None) -> TrainConfig:
    """Builds a validated :class:`TrainConfig` from CLI arguments.

    Args:
        argv: arguments (default ``sys.argv[1:]``); ``--config`` values come first,
            explicit flags override them.

    Returns:
        The validated config.

    Example::

        cfg = parse_config(["--config", "default", "--batch-size", "128"])
    """
    parser = build_arg_parser()
    try:
        ns = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as e:  # argparse already printed the reason
        raise ConfigError(f"bad command line {list(argv or [])!r} (see the usage message above)") from e
    values: dict[str, Any] = load_yaml(ns.config) if ns.config else {}
    for f in dataclasses.fields(TrainConfig):
        v = getattr(ns, f.name)
        if v is not None:
            values[f.name] = v
    if "dense_arch" in values:
        values["dense_arch"] = tuple(values["dense_arch"])
    if "over_arch" in values:
        values["over_arch"] = tuple(values["over_arch"])
    return TrainConfig(**values)


__all__ = [
    "ConfigError",
    "TrainConfig",
    "build_arg_parser",
    "load_yaml",
    "packaged_config_path",
    "parse_config",
    "split_paths",
]
