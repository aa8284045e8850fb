"""The torchrec side of a placement plan: the ``ParameterSharding`` that carries a table's placement,
and the row-, table- and column-wise sharding specs ``PlacementPlan.to_sharding_plan`` builds with."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torchrec.distributed.planner.constants import MIN_CW_DIM
from torchrec.distributed.sharding_plan import placement
from torchrec.distributed.types import EnumerableShardingSpec, ParameterSharding, ShardingPlan, ShardMetadata

from recpipe.pipeline.placement import (
    FUSED_PARAM_DTYPE,
    FUSED_PARAM_OPTIMIZER,
    CachePolicy,
    DistType,
    DynamicTableOptions,
    FusedOptimizerKind,
    Mode,
    PlacementParams,
    check_int,
    local_rows,
)

# The placement fields, shared with ``PlacementParams``.
_FIELDS = ("mode", "cache_load_factor", "dist_type", "seed", "cache_policy", "optimizer", "dtype")


@dataclass
class PlacementParameterSharding(ParameterSharding):
    """torchrec ``ParameterSharding`` carrying a recpipe tiered placement (a ``PlacementParams``).

    torchrec merges :meth:`get_additional_fused_params` into the table's fused params, where the tiered
    sharders read it back. ``optimizer`` / ``dtype`` left None (a hand-written placement not sized for one)
    are not written: the sharders then take the table's own; planner-made plans always set both.
    """

    mode: Mode = Mode.HYBRID
    cache_load_factor: float = 1.0
    dist_type: DistType = DistType.HASH_ROUNDROBIN
    seed: int = 0
    cache_policy: CachePolicy = CachePolicy.LFU
    optimizer: Optional[FusedOptimizerKind] = None
    dtype: Optional[torch.dtype] = None
    dynamic: Optional[DynamicTableOptions] = None

    def __post_init__(self) -> None:
        full = self._complete()  # validates and normalizes every field
        for name in _FIELDS:
            if getattr(self, name) is not None:
                setattr(self, name, getattr(full, name))

    def _complete(self) -> PlacementParams:
        # Unset optimizer / dtype are stood in for (and left out of the fused params).
        return PlacementParams(
            **{name: getattr(self, name) for name in _FIELDS[:5]},
            optimizer=self.optimizer if self.optimizer is not None else FusedOptimizerKind.SGD,
            dtype=self.dtype if self.dtype is not None else torch.float32,
            dynamic=self.dynamic,
        )

    @classmethod
    def from_params(cls, params: PlacementParams, **parameter_sharding: Any) -> "PlacementParameterSharding":
        """A parameter sharding carrying ``params``; ``parameter_sharding`` are torchrec's own fields."""
        return cls(**parameter_sharding, **{name: getattr(params, name) for name in _FIELDS}, dynamic=params.dynamic)

    @property
    def params(self) -> PlacementParams:
        """The placement as a ``PlacementParams`` (needs ``optimizer`` and ``dtype``)."""
        unset = [name for name in ("optimizer", "dtype") if getattr(self, name) is None]
        if unset:
            raise ValueError(
                f"PlacementParameterSharding.{' and '.join(unset)} is not set, so it holds no complete "
                "PlacementParams: set it, or build the sharding with PlacementParameterSharding.from_params."
            )
        return self._complete()

    def get_additional_fused_params(self) -> Dict[str, Any]:
        """Fused params torchrec merges into the table's kernel config (unset optimizer / dtype left out)."""
        fused = self._complete().to_fused_params()
        if self.optimizer is None:
            del fused[FUSED_PARAM_OPTIMIZER]
        if self.dtype is None:
            del fused[FUSED_PARAM_DTYPE]
        return fused


def row_wise_sharding_spec(
    num_embeddings: int, dim: int, world_size: int, local_world_size: int, compute_device: str
) -> EnumerableShardingSpec:
    """Shard ``r`` holds ``local_rows(N, W, r)`` rows at contiguous offsets, placed on ``compute_device``."""
    num_embeddings = check_int(num_embeddings, "num_embeddings", 0)
    dim = check_int(dim, "dim", 1)
    world_size = check_int(world_size, "world_size", 1)
    L = check_int(local_world_size, "local_world_size", 1, world_size)
    if compute_device not in ("cuda", "cpu"):
        raise ValueError(
            f"compute_device must be 'cuda' or 'cpu' (a torchrec Topology's compute_device), got {compute_device!r}."
        )
    sizes = [local_rows(num_embeddings, world_size, r) for r in range(world_size)]
    offsets = itertools.accumulate(sizes, initial=0)
    return EnumerableShardingSpec(
        [
            ShardMetadata(shard_offsets=[offset, 0], shard_sizes=[n, dim], placement=placement(compute_device, r, L))
            for r, (offset, n) in enumerate(zip(offsets, sizes))
        ]
    )


def table_wise_sharding_spec(
    num_embeddings: int, dim: int, rank: int, local_world_size: int, compute_device: str
) -> EnumerableShardingSpec:
    """The whole table as one shard on ``rank``, placed on ``compute_device``."""
    rank = check_int(rank, "rank", 0)
    L = check_int(local_world_size, "local_world_size", 1)
    shard = ShardMetadata(
        shard_offsets=[0, 0],
        shard_sizes=[check_int(num_embeddings, "num_embeddings", 0), check_int(dim, "dim", 1)],
        placement=placement(compute_device, rank, L),
    )
    return EnumerableShardingSpec([shard])


def column_shard_dim(dim: int) -> int:
    """Columns per shard of a COLUMN_WISE table of width ``dim``, torchrec's default block: the smallest divisor
    of ``dim`` that is at least ``MIN_CW_DIM`` (128) and a multiple of 4, else ``dim`` (one shard)."""
    dim = check_int(dim, "dim", 1)
    return next((d for d in range(MIN_CW_DIM, dim) if dim % d == 0 and d % 4 == 0), dim)


def column_shards(dim: int) -> int:
    """Shards of a COLUMN_WISE table of width ``dim`` (``dim // column_shard_dim(dim)``; 1: not splittable)."""
    return dim // column_shard_dim(dim)


def column_wise_sharding_spec(
    num_embeddings: int, dim: int, ranks: Sequence[int], local_world_size: int, compute_device: str
) -> EnumerableShardingSpec:
    """Shard ``j`` holds columns ``[j * c, (j + 1) * c)`` (``c = column_shard_dim(dim)``) of every row on
    ``ranks[j]``, placed on ``compute_device``."""
    rows, c, k = check_int(num_embeddings, "num_embeddings", 0), column_shard_dim(dim), column_shards(dim)
    L = check_int(local_world_size, "local_world_size", 1)
    if len(ranks) != k:
        raise ValueError(
            f"ranks must name one rank per column shard: a table of dim {dim} has {k} shards of {c} columns, got "
            f"{len(ranks)} ranks {list(ranks)}."
        )
    return EnumerableShardingSpec(
        [
            ShardMetadata(
                shard_offsets=[0, j * c],
                shard_sizes=[rows, c],
                placement=placement(compute_device, check_int(r, f"ranks[{j}]", 0), L),
            )
            for j, r in enumerate(ranks)
        ]
    )


def placements_from_sharding_plan(sharding_plan: ShardingPlan) -> Dict[Tuple[str, str], Tuple[Mode, float]]:
    """``(module_path, table) -> (mode, x)`` of every ``PlacementParameterSharding`` in a torchrec plan."""
    out: Dict[Tuple[str, str], Tuple[Mode, float]] = {}
    for path, module_plan in sharding_plan.plan.items():
        for table, ps in module_plan.items():
            if isinstance(ps, PlacementParameterSharding):
                out[(path, table)] = (Mode.parse(ps.mode), float(ps.cache_load_factor))
    return out


__all__ = [
    "PlacementParameterSharding",
    "column_shard_dim",
    "column_shards",
    "column_wise_sharding_spec",
    "placements_from_sharding_plan",
    "row_wise_sharding_spec",
    "table_wise_sharding_spec",
]
