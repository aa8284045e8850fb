"""The torchrec side of a placement plan: ParameterSharding carrying the placement, row-wise specs.

``PlacementPlan.to_sharding_plan()`` (``recpipe.planner.types``) builds the
``ShardingPlan`` from these pieces; this module does not import the plan types,
so the two modules form no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torchrec.distributed.sharding_plan import placement
from torchrec.distributed.types import (
    EnumerableShardingSpec,
    ParameterSharding,
    ShardingPlan,
    ShardMetadata,
)

from recpipe.pipeline.routing.ops import check_int
from recpipe.pipeline.placement import (
    FUSED_PARAM_CACHE_LOAD_FACTOR,
    FUSED_PARAM_CACHE_POLICY,
    FUSED_PARAM_DIST_TYPE,
    FUSED_PARAM_DTYPE,
    FUSED_PARAM_MODE,
    FUSED_PARAM_OPTIMIZER,
    FUSED_PARAM_SEED,
    CachePolicy,
    DistType,
    FusedOptimizer,
    Mode,
    PlacementParams,
    local_rows,
)


@dataclass
class PlacementParameterSharding(ParameterSharding):
    """torchrec ``ParameterSharding`` carrying a recpipe tiered placement (a ``PlacementParams``).

    torchrec merges :meth:`get_additional_fused_params` into the table's fused
    params (CUSTOMIZED_KERNEL tables), where the tiered sharders read it back with
    ``PlacementParams.from_fused_params``. Build it with :meth:`from_params` (as
    the planner does), or field by field.

    ``optimizer`` / ``dtype`` left None (a hand-written placement that was not sized
    for one) are not written: the tiered sharders then take the table's own fused
    optimizer and dtype. Plans made by ``PlacementPlanner`` always set both, and the
    sharders refuse a table whose model disagrees with them.

    Args:
        mode (Mode | str): ``HYBRID`` or ``CACHING``.
        cache_load_factor (float): x in (0, 1].
        dist_type (DistType | str): id routing, ``hash_roundrobin`` (default) or ``roundrobin``.
        seed (int): hash seed of the routing.
        cache_policy (CachePolicy | str): ``lfu`` (default) or ``lru``.
        optimizer (Optional[FusedOptimizer | str]): fused optimizer the table was sized for.
        dtype (Optional[torch.dtype | str]): row dtype the table was sized for.

    Example::

        ps.get_additional_fused_params()
        # {"recpipe_mode": "CACHING", "recpipe_cache_load_factor": 0.2, ...}
    """

    mode: Mode = Mode.HYBRID
    cache_load_factor: float = 1.0
    dist_type: DistType = DistType.HASH_ROUNDROBIN
    seed: int = 0
    cache_policy: CachePolicy = CachePolicy.LFU
    optimizer: Optional[FusedOptimizer] = None
    dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        full = self._complete()  # validates and normalizes every field
        self.mode = full.mode
        self.cache_load_factor = full.cache_load_factor
        self.dist_type = full.dist_type
        self.seed = full.seed
        self.cache_policy = full.cache_policy
        if self.optimizer is not None:
            self.optimizer = full.optimizer
        if self.dtype is not None:
            self.dtype = full.dtype

    def _complete(self) -> PlacementParams:
        # Unset optimizer / dtype are stood in for (and left out of the fused params).
        return PlacementParams(
            mode=self.mode,
            cache_load_factor=self.cache_load_factor,
            dist_type=self.dist_type,
            seed=self.seed,
            cache_policy=self.cache_policy,
            optimizer=self.optimizer if self.optimizer is not None else FusedOptimizer.SGD,
            dtype=self.dtype if self.dtype is not None else torch.float32,
        )

    @classmethod
    def from_params(cls, params: PlacementParams, **parameter_sharding: Any) -> "PlacementParameterSharding":
        """A parameter sharding carrying ``params``.

        Args:
            params (PlacementParams): the placement.
            **parameter_sharding: torchrec ``ParameterSharding`` fields
                (``sharding_type``, ``compute_kernel``, ``ranks``, ``sharding_spec``, ...).

        Returns:
            PlacementParameterSharding: with every placement field set.
        """
        return cls(
            **parameter_sharding,
            mode=params.mode,
            cache_load_factor=params.cache_load_factor,
            dist_type=params.dist_type,
            seed=params.seed,
            cache_policy=params.cache_policy,
            optimizer=params.optimizer,
            dtype=params.dtype,
        )

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
        """Fused params merged by torchrec into the table's kernel config.

        Returns:
            Dict[str, Any]: ``PlacementParams.to_fused_params()``: ``recpipe_mode``,
            ``recpipe_cache_load_factor``, ``recpipe_dist_type``, ``recpipe_seed``,
            ``recpipe_cache_policy``, ``recpipe_optimizer``, ``recpipe_dtype`` (the
            last two only when set).
        """
        fused = self._complete().to_fused_params()
        if self.optimizer is None:
            del fused[FUSED_PARAM_OPTIMIZER]
        if self.dtype is None:
            del fused[FUSED_PARAM_DTYPE]
        return fused


def row_wise_sharding_spec(
    num_embeddings: int, dim: int, world_size: int, local_world_size: int, compute_device: str
) -> EnumerableShardingSpec:
    """Shard ``r`` holds ``local_rows(N, W, r)`` rows at contiguous offsets.

    Args:
        num_embeddings (int): rows of the table.
        dim (int): embedding dimension.
        world_size (int): ranks.
        local_world_size (int): ranks per machine.
        compute_device (str): device written in each shard's placement.

    Returns:
        EnumerableShardingSpec: one ``ShardMetadata`` per rank, sizes summing to N.
    """
    num_embeddings = check_int(num_embeddings, "num_embeddings", 0)
    dim = check_int(dim, "dim", 1)
    world_size = check_int(world_size, "world_size", 1)
    local_world_size = check_int(local_world_size, "local_world_size", 1, world_size)
    if compute_device not in ("cuda", "cpu"):
        raise ValueError(f"compute_device must be 'cuda' or 'cpu' (a torchrec Topology's compute_device), got "
                         f"{compute_device!r}.")
    shards = []
    offset = 0
    for r in range(world_size):
        n = local_rows(num_embeddings, world_size, r)
        shards.append(
            ShardMetadata(
                shard_offsets=[offset, 0],
                shard_sizes=[n, dim],
                placement=placement(compute_device, r, local_world_size),
            )
        )
        offset += n
    return EnumerableShardingSpec(shards)


def placements_from_sharding_plan(sharding_plan: ShardingPlan) -> Dict[Tuple[str, str], Tuple[Mode, float]]:
    """Read placements back from a plan made by ``to_sharding_plan``.

    Args:
        sharding_plan (ShardingPlan): the torchrec plan.

    Returns:
        Dict[Tuple[str, str], Tuple[Mode, float]]: ``(module_path, table) -> (mode, x)``
        for every ``PlacementParameterSharding`` in the plan.
    """
    out: Dict[Tuple[str, str], Tuple[Mode, float]] = {}
    for path, module_plan in sharding_plan.plan.items():
        for table, ps in module_plan.items():  # type: ignore[union-attr]
            if isinstance(ps, PlacementParameterSharding):
                out[(path, table)] = (Mode.parse(ps.mode), float(ps.cache_load_factor))
    return out


__all__ = [
    "FUSED_PARAM_CACHE_LOAD_FACTOR",
    "FUSED_PARAM_CACHE_POLICY",
    "FUSED_PARAM_DIST_TYPE",
    "FUSED_PARAM_DTYPE",
    "FUSED_PARAM_MODE",
    "FUSED_PARAM_OPTIMIZER",
    "FUSED_PARAM_SEED",
    "PlacementParameterSharding",
    "placements_from_sharding_plan",
    "row_wise_sharding_spec",
]
