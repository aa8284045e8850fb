"""Training configuration of ``python -m recpipe.recipes.train``.

One kw-only dataclass: every field has a docstring (its ``--help``), every value is
checked in ``__post_init__`` and a bad one raises :class:`ConfigError` naming the field
and the fix. The command line and YAML live in :mod:`recpipe.recipes.cli`. Imports
only the dataset names of recpipe (:func:`recpipe.recipes.data.dataset_names`; that package imports nothing).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recpipe.recipes.data import dataset_names

# Synchronous steps of ``--pipeline semi_sync`` before its semi-synchronous phase (torchrec's start_batch
# defaults to 900, longer than most recipe runs).
DEFAULT_SEMI_SYNC_START_BATCH: int = 20
# Largest id space accepted: ids below 2**31 keep the 32-bit hash arithmetic within int64.
MAX_ID_SPACE: int = 2**31 - 1
# Longest collective timeout accepted (7 days): far below where gloo's int64 ns deadlines overflow.
MAX_TIMEOUT_S: float = 7 * 24 * 3600.0
# Largest tier budget accepted, exclusive, in MiB: 2**53 bytes, the range in which the
# planner's DP kernel carries bytes exactly as doubles.
MAX_TIER_MB: float = float(2**53 // 2**20)

# The string fields and their values (and ``dataset``: see field_choices).
CHOICES: dict[str, tuple[str, ...]] = {
    "model": ("dlrm", "micro_dlrm_dram"),
    "pipeline": ("fused", "sparse", "semi_sync"),
    "device": ("auto", "cpu", "cuda"),
    "placement": ("planned", "table_wise", "torchrec_planner"),
    "eval_pipeline": ("prefetch", "plain"),
}
PLACEMENTS: tuple[str, ...] = CHOICES["placement"]
# The sharding types ``--placement planned`` chooses from, in the planner's spelling and order
# (``recpipe.planner.communication.PLANNED_SHARDING_TYPES``; tests check they agree).
SHARDING_TYPES: tuple[str, ...] = ("table_wise", "row_wise", "column_wise")
# Comma-separated subset fields -> their names: any non-empty subset, in any order.
SUBSETS: dict[str, tuple[str, ...]] = {"sharding_types": SHARDING_TYPES}
# Units of the fields that have one (shown by --help).
UNITS: dict[str, str] = {"fast_tier_mb": "MiB", "slow_tier_mb": "MiB", "timeout_s": "seconds"}
# Integer-list fields (``--dense-arch 64,64``; a YAML list) -> a valid example.
INT_LISTS: dict[str, str] = {"dense_arch": "64,64", "over_arch": "64,1"}
# The built-in endless datasets (generated streams): they need ``max_steps``.
ENDLESS_DATASETS: tuple[str, ...] = ("synthetic", "synthetic_raw_keys")
# Output paths checked writable at validation: field -> is a directory.
OUTPUT_PATHS: dict[str, bool] = {"tb_dir": True, "checkpoint_dir": True, "metrics_file": False}


@dataclass(frozen=True, kw_only=True)
class FloatRule:
    """The accepted range of a float field: always finite, bounded below (and maybe above)."""

    low: float
    low_inclusive: bool
    high: float | None = None  # None: any finite value
    high_inclusive: bool = True
    example: str  # a valid value for the error's fix
    note: str = ""  # why the range ends where it does, appended to the error

    def accepts(self, value: object) -> bool:
        """True when ``value`` is a finite int/float (not bool) inside the range."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(v := float(value)):
            return False
        above_low = v > self.low or (v == self.low and self.low_inclusive)
        return above_low and (self.high is None or v < self.high or (v == self.high and self.high_inclusive))

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
    """Why ``path`` (a directory if ``is_dir``) cannot be written as an output; ``None`` when it can.

    Leaves nothing behind. A missing path needs its nearest existing ancestor to be a
    writable directory (the run creates the rest).
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
    """Steps of every ``step_*`` directory in ``directory``, newest first (none verified)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR_PATTERN.match(p.name))]
    return sorted(steps, reverse=True)


class ConfigPathError(ConfigError):
    """An input file is missing or an output path cannot be written on this machine."""


class ConfigMachineError(ConfigPathError):
    """A value this machine cannot run (e.g. more threads than it has CPUs)."""


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one training run needs. Validated on construction."""

    model: str = "micro_dlrm_dram"
    """``dlrm`` (torchrec DLRM, one table per feature) or ``micro_dlrm_dram`` (hashed virtual tables, wide rows)."""

    dataset: str = "movielens100k"
    """``movielens100k`` (recbole wheel), ``synthetic`` (Criteo-like stream), ``criteo_tsv`` (``data_path``) or
    ``synthetic_raw_keys`` (a CTR stream of raw int64 keys over a 40-bit space, negatives included)."""

    data_path: str | None = None
    """Comma-separated Criteo TSV files (label, 13 ints, 26 hex). Only for ``criteo_tsv``; every
    rank reads all of them (each node's copy must hold the same rows)."""

    eval_data_path: str | None = None
    """Comma-separated Criteo TSV files for evaluation (>= one global batch); default: the training files."""

    batch_size: int = 256
    """Samples per rank per step (the global batch is ``batch_size * world_size``)."""

    epochs: int = 1
    """Passes over the training split (MovieLens / Criteo); ignored when ``max_steps`` is set."""

    max_steps: int | None = None
    """Total training steps (wrapping into further epochs); required for the endless ``synthetic`` and
    ``synthetic_raw_keys`` streams."""

    embedding_dim: int = 64
    """Width of every embedding row (DLRM needs one width for all tables)."""

    num_embeddings: int = 100_000
    """Rows per table for ``dlrm`` on synthetic / Criteo data (ids are taken modulo; with ``dynamic_tables``,
    each table's capacity in rows)."""

    virtual_rows: int = 262_144
    """Rows of each virtual table of ``micro_dlrm_dram`` (2**18 by default; with ``dynamic_tables``, each
    table's capacity in rows)."""

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

    eval_pipeline: str = "prefetch"
    """How evaluation runs the batches: ``prefetch`` (recpipe's EvalPipelinePrefetch: the next batches' input
    dist and embedding lookup run ahead of the current batch's dense forward) or ``plain`` (``model(batch)`` per
    batch, nothing prefetched, for comparison). Both give the same AUROC bit for bit."""

    synthetic_id_space: int = 10_000_000
    """Largest per-feature id space of the synthetic stream (ids in ``[0, n)``); for ``synthetic_raw_keys``,
    the distinct keys of every feature."""

    zipf_alpha: float = 1.1
    """Zipf exponent of the synthetic streams' first feature (later features steepen)."""

    pipeline: str = "fused"
    """The train pipeline: ``fused`` (recpipe's TrainPipelineFusedSparseDist: exact, the next batch's lookup
    overlaps the dense optimizer step), ``sparse`` (torchrec's TrainPipelineSparseDist: exact, for comparison;
    same losses as ``fused``) or ``semi_sync`` (recpipe's TrainPipelineSemiSync: from step
    ``semi_sync_start_batch`` on, each batch is looked up before the previous batch's backward, from tables one
    step stale, so its all-to-all overlaps that backward; faster, losses differ from the exact pipelines)."""

    semi_sync_start_batch: int = DEFAULT_SEMI_SYNC_START_BATCH
    """``--pipeline semi_sync`` only: the number of synchronous (exact) steps before the semi-synchronous phase
    (torchrec's ``start_batch``; its default is 900, longer than most recipe runs, so the recipes start after 20
    steps: the first steps, which move the tables most, train exactly). Counted from step 0 across a resume."""

    device: str = "auto"
    """``cpu``, ``cuda`` or ``auto`` (cuda when available); gloo on CPU, nccl on CUDA."""

    placement: str = "planned"
    """``planned``: recpipe.planner picks per table a sharding type (of ``sharding_types``) and a
    storage (all in the fast tier, or tiered HYBRID / CACHING); ``table_wise``: torchrec's own sharder,
    whole tables placed greedily; ``torchrec_planner``: torchrec's EmbeddingShardingPlanner (both for comparison)."""

    sharding_types: str = "table_wise,row_wise,column_wise"
    """Sharding types the planner chooses from (only ``--placement planned``): a comma-separated subset,
    in any order, of ``table_wise`` (each table whole on one rank), ``row_wise`` (tiered over every rank)
    and ``column_wise`` (torchrec's FUSED table in column shards of >= 128 columns, offered for tables
    at least 256 wide); stored in that order."""

    fast_tier_mb: float = 0.0
    """Fast-tier budget per device in MiB (HBM on CUDA, a host buffer on CPU) given
    to the planner; 0 = half the tables' per-rank bytes, so placements are tiered."""

    slow_tier_mb: float = 16384.0
    """Slow-tier (host DDR) budget per machine in MiB given to the planner."""

    dynamic_tables: bool = False
    """Dynamic embedding tables: every table takes its feature's raw int64 ids as keys (Criteo's hex values,
    MovieLens' ids, the keys of ``synthetic_raw_keys``; no modulo into ``num_embeddings`` rows; ``micro_dlrm_dram``
    takes ``hash_k`` distinct int64 keys per id) and gives a key a row when training first sees it, evicting the
    least recently used key of its bucket when the bucket is full. Each table's capacity is its rows. Needs
    ``--placement planned`` with ``table_wise`` or ``row_wise`` among ``sharding_types``."""

    num_threads: int = 1
    """``torch.set_num_threads`` per rank, at most the machine's logical CPUs."""

    seed: int = 0
    """Seed of model initialisation, data order and the synthetic stream."""

    tb_dir: str | None = None
    """TensorBoard log directory written by rank 0 (none when unset)."""

    metrics_file: str | None = None
    """JSON file rank 0 writes at the end: losses, logged means, evaluations, AUROC, throughput."""

    checkpoint_dir: str | None = None
    """Directory for checkpoints (one per saved step; resumable under another world size)."""

    checkpoint_every: int = 0
    """Save a checkpoint every this many steps into ``checkpoint_dir`` (0: only at the end,
    if a directory is set; a positive value needs the directory)."""

    resume: bool = False
    """Resume from the latest checkpoint in ``checkpoint_dir`` (exact: same losses)."""

    log_every: int = 10
    """Write train scalars and a log line every this many steps (and at the last and checkpoint steps)."""

    progress_bar: bool = True
    """Show a tqdm bar on rank 0."""

    timeout_s: float = 600.0
    """Seconds a collective (all-to-all, all-reduce, barrier) may wait for the other ranks before this
    rank fails; raise it when a legitimate step (e.g. a large checkpoint) takes longer."""

    check_paths: dataclasses.InitVar[bool] = True
    """Not a field (no flag): whether construction also checks this machine's input files,
    output paths and CPUs (False when the paths exist only on the cluster)."""

    def __post_init__(self, check_paths: bool = True) -> None:
        # the values, then this machine's file system and CPUs; the first problem is reported
        _check_choices(self)
        _check_sharding_types(self)
        _check_numbers(self)
        _check_semi_sync(self)
        _check_id_spaces(self)
        _check_architecture(self)
        _check_dataset(self)
        _check_switches_and_checkpoints(self)
        _check_dynamic_tables(self)
        _check_path_values(self)
        if check_paths:
            _check_threads(self)
            _check_input_files(self)
            _check_output_paths(self)
            _check_resumable(self)

    def to_dict(self) -> dict[str, Any]:
        """Returns the config as plain YAML/JSON-friendly values."""
        return dataclasses.asdict(self) | {name: list(getattr(self, name)) for name in INT_LISTS}


def split_paths(value: str | None) -> list[str]:
    """Splits a comma-separated path list; ``None`` gives ``[]``."""
    return [p for p in (value or "").split(",") if p]


def cli_flag(name: str) -> str:
    """The command-line flag of field ``name`` without its dashes (``batch_size`` -> ``batch-size``)."""
    return name.replace("_", "-")


def _invalid(config: TrainConfig, name: str, why: str, fix: str, error: type[ConfigError] = ConfigError) -> ConfigError:
    """The error of field ``name``'s value: what is wrong (``why``) and the ``fix``."""
    return error(f"invalid config value {name}={getattr(config, name)!r}: {why}. Fix: {fix}")


def _is_int(value: object) -> bool:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


# Integer fields that must be > 0, and those that must be >= 0.
_POSITIVE_INTS: tuple[str, ...] = tuple(
    "batch_size epochs embedding_dim num_embeddings virtual_rows hash_k eval_batches num_threads log_every".split()
)
_NON_NEGATIVE_INTS: tuple[str, ...] = ("eval_every", "checkpoint_every", "seed", "semi_sync_start_batch")


def field_choices() -> dict[str, tuple[str, ...]]:
    """Every string field with a fixed set of values -> its values: :data:`CHOICES`, and ``dataset`` ->
    the datasets registered now (:func:`recpipe.recipes.data.dataset_names`)."""
    return {**CHOICES, "dataset": dataset_names()}


def _check_choices(config: TrainConfig) -> None:
    """String fields hold one of their :func:`field_choices`."""
    for name, choices in field_choices().items():
        if getattr(config, name) not in choices:
            raise _invalid(
                config, name, "unknown choice", f"use one of {', '.join(choices)}, e.g. --{cli_flag(name)} {choices[0]}"
            )


def subset_names(value: object) -> list[str] | None:
    """The names of a comma-separated subset value (a string, or a YAML list of strings), stripped,
    empty ones dropped; ``None`` when ``value`` is neither."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        return None
    return [name.strip() for name in value if name.strip()]


# What each placement other than ``planned`` does instead of honouring --sharding-types.
_IGNORES_SHARDING_TYPES: dict[str, str] = {
    "table_wise": "torchrec's sharder places every table whole on one rank",
    "torchrec_planner": "torchrec's EmbeddingShardingPlanner picks the sharding types itself",
}


def _check_sharding_types(config: TrainConfig) -> None:
    """``sharding_types`` is a non-empty subset of :data:`SHARDING_TYPES` (any order, repeats
    dropped; stored in that order) and is restricted only where ``placement`` reads it."""
    names = subset_names(config.sharding_types)
    valid = ", ".join(SHARDING_TYPES)
    example = "--sharding-types table_wise,row_wise"
    if names is None or not names:
        raise _invalid(
            config,
            "sharding_types",
            "must name at least one sharding type, comma-separated",
            f"pass a subset of {valid} in any order, e.g. {example}",
        )
    unknown = [n for n in dict.fromkeys(names) if n not in SHARDING_TYPES]
    if unknown:
        raise _invalid(
            config,
            "sharding_types",
            f"unknown sharding type(s) {', '.join(map(repr, unknown))}",
            f"pass a comma-separated subset of {valid} in any order, e.g. {example}",
        )
    canonical = ",".join(t for t in SHARDING_TYPES if t in names)
    if config.placement in _IGNORES_SHARDING_TYPES and canonical != ",".join(SHARDING_TYPES):
        raise _invalid(
            config,
            "sharding_types",
            f"--sharding-types restricts the planner of --placement planned, but --placement is "
            f"{config.placement}, where {_IGNORES_SHARDING_TYPES[config.placement]}, so it would be ignored",
            "pass --placement planned to plan with these sharding types, or drop --sharding-types",
        )
    config.sharding_types = canonical


def _check_numbers(config: TrainConfig) -> None:
    """Integer fields are in range, float fields obey their :data:`FLOAT_RULES`."""
    for names, low, why in ((_POSITIVE_INTS, 1, "a positive integer"), (_NON_NEGATIVE_INTS, 0, "an integer >= 0")):
        for name in names:
            if not _is_int(getattr(config, name)) or getattr(config, name) < low:
                raise _invalid(config, name, f"must be {why}", f"pass e.g. --{cli_flag(name)} {low}")
    if config.max_steps is not None and (not _is_int(config.max_steps) or config.max_steps <= 0):
        raise _invalid(config, "max_steps", "must be a positive integer or unset", "pass e.g. --max-steps 100")
    for name, rule in FLOAT_RULES.items():
        if not rule.accepts(getattr(config, name)):
            raise _invalid(config, name, rule.describe(name), f"pass e.g. --{cli_flag(name)} {rule.example}")


def _check_semi_sync(config: TrainConfig) -> None:
    """``semi_sync_start_batch`` is changed from its default only where ``--pipeline semi_sync`` reads it."""
    if config.pipeline != "semi_sync" and config.semi_sync_start_batch != DEFAULT_SEMI_SYNC_START_BATCH:
        raise _invalid(
            config,
            "semi_sync_start_batch",
            f"it is read only by --pipeline semi_sync, but --pipeline is {config.pipeline}, so it would be ignored",
            "pass --pipeline semi_sync, or drop --semi-sync-start-batch",
        )


def _check_id_spaces(config: TrainConfig) -> None:
    """Table sizes and the synthetic id space stay within :data:`MAX_ID_SPACE`."""
    if config.virtual_rows > MAX_ID_SPACE or config.num_embeddings > MAX_ID_SPACE:
        raise ConfigError(
            f"invalid table size virtual_rows={config.virtual_rows}, num_embeddings="
            f"{config.num_embeddings}: must be <= {MAX_ID_SPACE}. Fix: use fewer rows"
        )
    if not _is_int(config.synthetic_id_space) or not 2 <= config.synthetic_id_space <= MAX_ID_SPACE:
        raise _invalid(
            config,
            "synthetic_id_space",
            f"must be an integer in [2, {MAX_ID_SPACE}]",
            "pass e.g. --synthetic-id-space 10000000",
        )


def _check_architecture(config: TrainConfig) -> None:
    """The MLP widths are positive integer lists (stored as tuples) that DLRM can connect."""
    for name, example in INT_LISTS.items():
        value = getattr(config, name)
        if not isinstance(value, (list, tuple)) or not value or any(not _is_int(w) or w <= 0 for w in value):
            raise _invalid(
                config,
                name,
                "must be a non-empty list of positive integers",
                f"pass e.g. --{cli_flag(name)} {example} (in YAML: {name}: [{example.replace(',', ', ')}])",
            )
        setattr(config, name, tuple(value))
    if config.dense_arch[-1] != config.embedding_dim:
        raise _invalid(
            config,
            "dense_arch",
            f"its last width {config.dense_arch[-1]} must equal embedding_dim={config.embedding_dim} (DLRM)",
            f"pass --dense-arch {','.join(map(str, config.dense_arch[:-1] + (config.embedding_dim,)))}",
        )
    if config.over_arch[-1] != 1:
        raise _invalid(
            config, "over_arch", "needs positive widths ending in 1 (one logit)", "pass e.g. --over-arch 64,1"
        )


def _check_dataset(config: TrainConfig) -> None:
    """The dataset has what it needs: a step count for the endless stream, input files for Criteo."""
    if config.dataset in ENDLESS_DATASETS and config.max_steps is None:
        raise _invalid(config, "max_steps", f"the {config.dataset} stream is endless", "pass --max-steps N")
    if config.dataset == "criteo_tsv" and not config.data_path:
        raise _invalid(config, "data_path", "criteo_tsv needs input files", "pass --data-path a.tsv[,b.tsv]")


def _check_switches_and_checkpoints(config: TrainConfig) -> None:
    """Boolean fields are booleans; resuming and periodic saving have a checkpoint directory."""
    for name in ("resume", "progress_bar", "dynamic_tables"):
        if not isinstance(getattr(config, name), bool):
            raise _invalid(config, name, "must be true or false", f"pass --{cli_flag(name)} or --no-{cli_flag(name)}")
    if config.resume and not config.checkpoint_dir:
        raise _invalid(
            config, "checkpoint_dir", "resume=True needs a checkpoint directory", "pass --checkpoint-dir DIR"
        )
    if config.checkpoint_every and not config.checkpoint_dir:
        raise _invalid(
            config,
            "checkpoint_every",
            "checkpoints are saved into --checkpoint-dir, which is unset, so none would be written",
            "pass --checkpoint-dir DIR, or drop --checkpoint-every",
        )


# What each placement other than ``planned`` shards with instead of recpipe's tiered sharders.
_STATIC_PLACEMENTS: dict[str, str] = {
    "table_wise": "torchrec's own sharder places torchrec's FUSED tables",
    "torchrec_planner": "torchrec's EmbeddingShardingPlanner plans torchrec's FUSED tables",
}


def _check_dynamic_tables(config: TrainConfig) -> None:
    """``dynamic_tables`` goes only with the settings that build dynamic tables: ``--placement planned``
    (dynamic tables are recpipe's tiered tables, built by its tiered sharders; the other placements build
    torchrec's FUSED tables, whose rows are fixed) and a table-wise or row-wise sharding type (column-wise
    shards are FUSED tables too). Both models take them (``micro_dlrm_dram`` keys ``hash_k`` keys per id)."""
    if not config.dynamic_tables:
        return
    if config.placement != "planned":
        raise _invalid(
            config,
            "dynamic_tables",
            f"it contradicts placement={config.placement!r}, where {_STATIC_PLACEMENTS[config.placement]}, whose "
            "rows are fixed ids in [0, num_embeddings); dynamic tables are recpipe's tiered tables, placed by "
            "--placement planned",
            "pass --placement planned (with --sharding-types table_wise for whole tables on one rank each), "
            "or drop --dynamic-tables",
        )
    if "table_wise" not in config.sharding_types and "row_wise" not in config.sharding_types:
        raise _invalid(
            config,
            "dynamic_tables",
            f"it contradicts sharding_types={config.sharding_types!r}: column-wise shards are torchrec's FUSED "
            "tables, whose rows are fixed, and a dynamic table is sharded table-wise or row-wise",
            "add table_wise or row_wise to --sharding-types (e.g. --sharding-types table_wise,row_wise), "
            "or drop --dynamic-tables",
        )


def _check_path_values(config: TrainConfig) -> None:
    """Path fields are strings; the input paths are given only for ``criteo_tsv``."""
    for name in ("data_path", "eval_data_path", *OUTPUT_PATHS):
        path = getattr(config, name)
        if path is not None and not isinstance(path, str):
            raise _invalid(config, name, "must be a path (a string)", f"pass --{cli_flag(name)} PATH")
    for name in ("data_path", "eval_data_path"):
        if getattr(config, name) and config.dataset != "criteo_tsv":
            raise _invalid(
                config,
                name,
                f"is read only by --dataset criteo_tsv, not {config.dataset}",
                f"drop --{cli_flag(name)}, or pass --dataset criteo_tsv",
            )


def _check_threads(config: TrainConfig) -> None:
    """At most one intra-op thread per logical CPU (far past them, torch fails creating threads)."""
    cpus = os.cpu_count() or 1
    if config.num_threads > cpus:
        raise _invalid(
            config,
            "num_threads",
            f"more intra-op threads per rank than this machine's {cpus} logical CPU(s) (os.cpu_count()); torch "
            "would start that many OS threads per rank and fail creating them or run slower",
            f"pass --num-threads between 1 and {cpus} (ranks x threads <= CPUs is fastest)",
            ConfigMachineError,
        )


def _check_input_files(config: TrainConfig) -> None:
    """Every input file exists on this machine (:func:`_check_path_values` allows them only for ``criteo_tsv``)."""
    for name in ("data_path", "eval_data_path"):
        for path in split_paths(getattr(config, name)):
            if os.path.isdir(path):
                raise ConfigPathError(
                    f"invalid config value {name}: {path!r} is a directory, not a file. "
                    "Fix: pass the Criteo TSV files in it, comma-separated (e.g. DIR/day_0.tsv,DIR/day_1.tsv)"
                )
            if not os.path.isfile(path):
                raise ConfigPathError(
                    f"invalid config value {name}: file {path!r} does not exist. "
                    "Fix: pass existing Criteo TSV files, comma-separated"
                )


def _check_output_paths(config: TrainConfig) -> None:
    """Every output path set (an empty string is unset) can be written on this machine."""
    for name, is_dir in OUTPUT_PATHS.items():
        path = getattr(config, name)
        problem = output_path_problem(path, is_dir=is_dir) if path else None
        if problem:
            raise _invalid(
                config,
                name,
                f"this output path is not writable ({problem})",
                f"pass --{cli_flag(name)} with a {'directory' if is_dir else 'file'} path you can write, "
                "or fix the permissions",
                ConfigPathError,
            )


def _check_resumable(config: TrainConfig) -> None:
    """``--resume`` finds at least one ``step_*`` directory to try (an unreadable one: none)."""
    directory = config.checkpoint_dir  # set whenever resume is (_check_switches_and_checkpoints)
    try:
        resumable = not config.resume or (directory is not None and bool(checkpoint_steps(directory)))
    except OSError:
        resumable = False
    if not resumable:
        raise _invalid(
            config,
            "checkpoint_dir",
            "resume=True but this directory holds no checkpoint (no step_* directory)",
            "point --checkpoint-dir at the directory a previous run saved into, or drop --resume",
            ConfigPathError,
        )
