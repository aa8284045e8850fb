"""What the planner is given: table specs, per-table pins, placement options, and the
topology's shape and budgets."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torchrec.distributed.planner.types import KernelConfig, Topology, TopologyFactory, TrainerConfig
from torchrec.distributed.types import CacheStatistics

from recpipe.pipeline.placement import (
    DynamicTableOptions,
    FusedOptimizerKind,
    Mode,
    ShardStorage,
    check_load_factor,
    check_load_factors,
    fbgemm_shard_storage,
    resolve_dtype,
    row_bytes,
    shard_storage,
)

#: Zipf exponent of a table's access when no measurement is given (TorchEasyRec PR #508's sweep).
DEFAULT_ZIPF_ALPHA: float = 1.05
#: Default cache load factor grid (PR #508): 0.1, 0.2, ..., 1.0.
DEFAULT_LOAD_FACTORS: Tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(1, 11))

#: Tiered-table backend -> byte formula of its layout: ``native`` (recpipe's own: the CPU kernel and the
#: torch backend) and ``fbgemm`` (fbgemm's TBE on CUDA).
BACKEND_SHARD_STORAGE: Dict[str, Callable[..., ShardStorage]] = {
    "native": shard_storage,
    "fbgemm": fbgemm_shard_storage,
}
#: Tiered-table backends whose byte layouts the planner budgets.
STORAGE_BACKENDS: Tuple[str, ...] = tuple(BACKEND_SHARD_STORAGE)

#: Largest table the planner accepts, in bytes (values + optimizer state): keeps its int64 byte
#: arithmetic clear of overflow after sums over a few tables.
MAX_TABLE_BYTES: int = 2**62


@dataclass(kw_only=True)
class TableSpec:
    """One embedding table to place."""

    name: str
    """Table name (unique within a module)."""
    rows: int
    """Rows of the whole table (``num_embeddings``)."""
    dim: int
    """Embedding dimension."""
    dtype: Union[torch.dtype, str] = torch.float32
    """Dtype of the embedding values (or its name); the planner plans only ``TIERED_DTYPES``."""
    optimizer: Union[FusedOptimizerKind, str] = FusedOptimizerKind.ADAM
    """Fused optimizer (sets state bytes); the planner plans only ``SUPPORTED_OPTIMIZERS``."""
    lookups_per_step: float = 512.0
    """Expected rows looked up per rank per training step (batch x pooling factor)."""
    bags_per_step: Optional[float] = None
    """Bags (samples x features) of this rank's batch per step: pooled rows the table returns.
    None: ``lookups_per_step`` (one id per bag)."""
    zipf_alpha: float = DEFAULT_ZIPF_ALPHA
    """Skew of the access distribution (Zipf exponent) when no measurement is given."""
    access_counts: Optional[Sequence[float]] = None
    """Measured per-row access counts; overrides ``zipf_alpha`` when given."""
    cache_stats: Optional[CacheStatistics] = None
    """torchrec ``CacheStatistics``; overrides the other access models when given."""
    module_path: str = ""
    """FQN of the embedding module holding the table ("" for a bare EBC/EC)."""
    feature_names: Tuple[str, ...] = ()
    """Features looking the table up (informational)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableSpec.name must be a non-empty string (the table's name), got {self.name!r}.")
        if not isinstance(self.module_path, str):
            raise ValueError(
                f"TableSpec({self.name}).module_path must be a string (the FQN of the embedding module, "
                f"'' for a bare EBC / EC), got {self.module_path!r}."
            )
        if (
            isinstance(self.feature_names, (str, bytes))
            or not hasattr(self.feature_names, "__iter__")
            or not all(isinstance(f, str) for f in self.feature_names)
        ):
            raise ValueError(
                f"TableSpec({self.name}).feature_names must be a list of feature names (str), got "
                f"{self.feature_names!r}; e.g. ['f0'] for one feature."
            )
        for field_name in ("rows", "dim"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"TableSpec({self.name}).{field_name} must be a positive int, got {value!r} "
                    f"({type(value).__name__}); write a whole number, without a decimal point or quotes."
                )
        self.dtype = resolve_dtype(self.dtype, f"TableSpec({self.name}).dtype")
        self.optimizer = FusedOptimizerKind.parse(self.optimizer, f"TableSpec({self.name}).optimizer")
        table_bytes = self.rows * row_bytes(self.dim, self.dtype, self.optimizer)
        if table_bytes > MAX_TABLE_BYTES:
            raise ValueError(
                f"TableSpec({self.name}) needs {table_bytes} bytes ({self.rows} rows x "
                f"{row_bytes(self.dim, self.dtype, self.optimizer)} bytes per row), above the planner's "
                f"limit of 2^62 bytes per table; check rows={self.rows} (a typo?) or split the table."
            )
        if self.bags_per_step is None:
            self.bags_per_step = self.lookups_per_step
        numbers_ = ("lookups_per_step", "bags_per_step", "zipf_alpha")
        for field_name in numbers_:
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"TableSpec({self.name}).{field_name} must be a number, got {value!r}.")
        for field_name in numbers_:
            value = getattr(self, field_name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"TableSpec({self.name}).{field_name} must be a finite number >= 0, got {value!r}.")
        if self.access_counts is not None:
            if len(self.access_counts) == 0:
                raise ValueError(f"TableSpec({self.name}).access_counts is empty: pass per-row counts or None.")
            self._check_access_counts()
        self.feature_names = tuple(self.feature_names)

    def _check_access_counts(self) -> None:
        """Refuses ``access_counts`` that are not one finite count >= 0 per row, not all 0."""
        fix = "pass one measured count per row (row i's lookups), or access_counts=None to model access by zipf_alpha"
        try:
            counts = np.asarray(self.access_counts, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(
                f"TableSpec({self.name}).access_counts must be numbers, got {type(self.access_counts).__name__}; {fix}."
            ) from None
        if counts.ndim != 1 or counts.size != self.rows:
            raise ValueError(
                f"TableSpec({self.name}).access_counts has {counts.size} entries (shape {tuple(counts.shape)}) for "
                f"rows={self.rows}; {fix}."
            )
        bad = np.flatnonzero(~(np.isfinite(counts) & (counts >= 0)))
        if bad.size:
            raise ValueError(
                f"TableSpec({self.name}).access_counts must be finite numbers >= 0, got {float(counts[bad[0]])!r} at row "
                f"{int(bad[0])} ({bad.size} such rows); {fix}."
            )
        if not counts.any():
            raise ValueError(
                f"TableSpec({self.name}).access_counts are all 0: they measure no lookup, so they give no hit rate; {fix}."
            )

    @property
    def fqn(self) -> str:
        """``module_path.name`` (or ``name`` for a bare module)."""
        return f"{self.module_path}.{self.name}" if self.module_path else self.name


def per_row_format(
    tables: Sequence[TableSpec], formula: Callable[[int, torch.dtype, FusedOptimizerKind], int]
) -> np.ndarray:
    """``formula(dim, dtype, optimizer)`` of every table as an int64 array, evaluated once per distinct row
    format (a model's thousands of tables share a handful)."""
    memo: Dict[Tuple[int, torch.dtype, FusedOptimizerKind], int] = {}
    out = np.empty(len(tables), dtype=np.int64)
    for i, t in enumerate(tables):
        key = (t.dim, resolve_dtype(t.dtype), FusedOptimizerKind.parse(t.optimizer))  # as __post_init__ resolved them
        value = memo.get(key)
        if value is None:
            value = memo[key] = formula(*key)
        out[i] = value
    return out


@dataclass(kw_only=True)
class PlacementConstraints:
    """User pins for one table; unset fields are chosen by the planner."""

    mode: Optional[Union[Mode, str]] = None
    """Pin the placement mode (x = 1.0 stays allowed: all rows in HBM, planned as HYBRID x = 1.0)."""
    cache_load_factor: Optional[float] = None
    """Pin the cache load factor x in (0, 1]."""
    load_factors: Optional[Sequence[float]] = None
    """Restrict this table's x grid (instead of the planner-wide grid)."""
    sharding_type: Optional[str] = None
    """Pin the sharding type: ``table_wise`` (the whole table on one rank: torchrec's FUSED table when all in
    the fast tier, else a tiered table), ``row_wise`` (a tiered table over every rank) or ``column_wise``
    (torchrec's FUSED table in column shards of at least 128 columns, each whole on one rank); one of the
    planner's ``sharding_types`` (a pin chooses within them, and one they rule out is refused)."""
    fused: Optional[bool] = None
    """Pin torchrec's FUSED table (True: table- or column-wise, all in the fast tier) or a recpipe tiered table
    (False)."""
    dynamic: Optional[DynamicTableOptions] = None
    """Marks the table dynamic (raw int64 keys given rows on first sight, ``docs/dynamic.md``): a recpipe tiered
    table, row- or table-wise, whose shards hold ``dynamic_local_slots(capacity, shards)`` rows plus a hash
    index in the fast tier; the planner chooses its sharding type, mode and x as for a static tiered table."""
    distinct_keys: Optional[int] = None
    """Distinct keys a dynamic table is expected to see (None: its capacity). Beyond the capacity, lookups of keys
    without a row cost an insert and lower the modelled hit rate (``cost_models.dynamic_lookup_costs``)."""

    def __post_init__(self) -> None:
        if self.sharding_type is not None:
            self.sharding_type = getattr(self.sharding_type, "value", self.sharding_type)
            if self.sharding_type not in ("table_wise", "row_wise", "column_wise"):
                raise ValueError(
                    "PlacementConstraints.sharding_type must be 'table_wise', 'row_wise' or 'column_wise', got "
                    f"{self.sharding_type!r}."
                )
        if self.fused is not None and not isinstance(self.fused, bool):
            raise ValueError(f"PlacementConstraints.fused must be True, False or None, got {self.fused!r}.")
        self._check_dynamic()
        if self.fused is False and self.sharding_type == "column_wise":
            raise ValueError(
                "PlacementConstraints(sharding_type='column_wise') is torchrec's FUSED table in column shards; "
                "fused=False (a recpipe tiered table) runs table_wise or row_wise: drop one of the two pins."
            )
        if self.sharding_type == "column_wise" and (
            self.mode is not None or (self.cache_load_factor is not None and float(self.cache_load_factor) < 1.0)
        ):
            raise ValueError(
                "PlacementConstraints(sharding_type='column_wise') is torchrec's FUSED table, all in the fast tier; "
                "it takes no mode or cache_load_factor < 1: drop those, or pin 'table_wise' / 'row_wise'."
            )
        if self.fused and (
            self.sharding_type == "row_wise"
            or self.mode is not None
            or (self.cache_load_factor is not None and float(self.cache_load_factor) < 1.0)
        ):
            raise ValueError(
                "PlacementConstraints(fused=True) is torchrec's FUSED table: table-wise, all in the fast tier; it "
                "takes no sharding_type='row_wise', mode or cache_load_factor < 1: drop those, or pin fused=False."
            )
        if self.mode is not None:
            self.mode = Mode.parse(self.mode)
        if self.cache_load_factor is not None:
            check_load_factor(self.cache_load_factor, "PlacementConstraints.cache_load_factor")
        if self.load_factors is not None:
            check_load_factors(self.load_factors, "PlacementConstraints.load_factors")

    def _check_dynamic(self) -> None:
        """Refuses ``dynamic`` that is not ``DynamicTableOptions`` or beside a pin of torchrec's FUSED table, and
        ``distinct_keys`` that is not a positive int or is given without ``dynamic``."""
        if self.dynamic is not None and not isinstance(self.dynamic, DynamicTableOptions):
            raise ValueError(
                f"PlacementConstraints.dynamic must be a DynamicTableOptions (or None), got {type(self.dynamic).__name__}"
                "; e.g. PlacementConstraints(dynamic=DynamicTableOptions(capacity=1_000_000)) (from "
                "recpipe.pipeline.placement)."
            )
        if self.dynamic is not None and (self.sharding_type == "column_wise" or self.fused):
            pin = "sharding_type='column_wise'" if self.sharding_type == "column_wise" else "fused=True"
            raise ValueError(
                f"PlacementConstraints(dynamic=..., {pin}): a dynamic table is a recpipe tiered table, row- or "
                f"table-wise only, never torchrec's FUSED table: drop {pin}, or pin sharding_type 'row_wise' or "
                "'table_wise'."
            )
        if self.distinct_keys is None:
            return
        if isinstance(self.distinct_keys, bool) or not isinstance(self.distinct_keys, int) or self.distinct_keys < 1:
            raise ValueError(
                f"PlacementConstraints.distinct_keys must be a positive int (the distinct keys the dynamic table "
                f"will see), got {self.distinct_keys!r}; or None for the table's capacity."
            )
        if self.dynamic is None:
            raise ValueError(
                "PlacementConstraints.distinct_keys describes a dynamic table, and dynamic is None: set "
                "dynamic=DynamicTableOptions(...), or drop distinct_keys."
            )


@dataclass(frozen=True)
class PlacementOption:
    """One (sharding type, mode, x) candidate for a table, with its bytes (most loaded rank / machine) and
    modelled ms (``cost = lookup_cost + comm_cost``). A table-wise option's ``hbm_bytes_per_rank`` and
    ``ddr_bytes_per_machine`` are its shares of the knapsack; ``owner_bytes`` / ``owner_slow_bytes`` are what
    the rank holding it holds."""

    mode: Mode
    cache_load_factor: float
    hbm_bytes_per_rank: int
    ddr_bytes_per_rank: int
    hbm_bytes_per_machine: int
    ddr_bytes_per_machine: int
    cost: float = 0.0
    sharding_type: str = "row_wise"
    fused: bool = False
    owner_bytes: int = 0
    owner_slow_bytes: int = 0
    lookup_cost: float = 0.0
    comm_cost: float = 0.0


def check_topology_args(
    world_size: int,
    local_world_size: int,
    hbm_cap: float,
    ddr_cap: float,
    *,
    names: Tuple[str, str, str, str] = ("world_size", "local_world_size", "hbm_cap", "ddr_cap"),
    positive_sizes: bool = False,
) -> None:
    """The checks a topology's shape and sizes must pass (shared by the CLI, :func:`make_topology` and
    ``PlacementPlanner``).

    Args:
        ddr_cap: DDR bytes, per rank or per machine as ``names`` says.
        names: how the caller spells the four arguments in messages (e.g. the CLI's ``--world-size``).
        positive_sizes: refuse a size of 0 too (the CLI); else 0 bytes is a tier of no memory.
    """
    ws_name, lws_name, hbm_name, ddr_name = names
    for name, value in ((ws_name, world_size), (lws_name, local_world_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(
                f"{name} must be an int (a number of ranks), got {type(value).__name__} {value!r}; pass a whole number."
            )
    if world_size < 1:
        raise ValueError(f"{ws_name} must be >= 1 (the number of ranks), got {world_size}.")
    if local_world_size < 1:
        raise ValueError(f"{lws_name} must be >= 1 (ranks per machine), got {local_world_size}.")
    if local_world_size > world_size or world_size % local_world_size:
        raise ValueError(
            f"{lws_name} ({local_world_size}) must divide {ws_name} ({world_size}): every machine has "
            f"the same number of ranks (e.g. {lws_name}={math.gcd(world_size, local_world_size)})."
        )
    for name, size in ((hbm_name, hbm_cap), (ddr_name, ddr_cap)):
        if isinstance(size, bool) or not isinstance(size, numbers.Real):
            raise ValueError(
                f"{name} must be a number of bytes, got {type(size).__name__} {size!r}; "
                "give the memory in bytes, e.g. 80 * 2**30."
            )
        if positive_sizes and not size > 0:
            raise ValueError(f"{name} must be a positive size such as 80GiB, got {size} bytes.")
        if not size >= 0:  # also refuses nan
            raise ValueError(
                f"{name} must be a size >= 0 bytes, got {size}; give the memory in bytes, e.g. 80 * 2**30."
            )
        if size == math.inf:  # the budgets are whole bytes: int(inf) would raise OverflowError when planning
            raise ValueError(
                f"{name} must be a finite size in bytes, got {size}; for memory that never binds, give "
                "a size past every table's bytes, e.g. 2**60."
            )


def make_topology(
    *, world_size: int, local_world_size: int, hbm_cap: int, ddr_cap: int, compute_device: str = "cuda"
) -> Topology:
    """A torchrec ``Topology`` built by ``TopologyFactory`` (a directly constructed one warns on every
    construction), with torchrec's default bandwidths; ``ddr_cap`` is bytes per rank."""
    check_topology_args(world_size, local_world_size, hbm_cap, ddr_cap)
    return TopologyFactory.create_topology(
        TrainerConfig(
            world_size=world_size, local_world_size=local_world_size, hbm_cap_bytes=hbm_cap, ddr_cap_bytes=ddr_cap
        ),
        kernel_config=KernelConfig(compute_device=compute_device),
    )


__all__ = [
    "BACKEND_SHARD_STORAGE",
    "DEFAULT_LOAD_FACTORS",
    "DEFAULT_ZIPF_ALPHA",
    "MAX_TABLE_BYTES",
    "STORAGE_BACKENDS",
    "PlacementConstraints",
    "PlacementOption",
    "TableSpec",
    "check_topology_args",
    "make_topology",
    "per_row_format",
]
