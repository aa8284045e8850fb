"""PlacementPlan -> torchrec ShardingPlan, and back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding_plan import placement
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)

from recpipe.planner.storage import _check_load_factor, local_rows
from recpipe.planner.types import Mode, PlacementPlan

# Keys under which the placement reaches the sharders' fused params (torchrec
# calls ``get_additional_fused_params`` for CUSTOMIZED_KERNEL tables).
FUSED_PARAM_MODE: str = "recpipe_mode"
FUSED_PARAM_CACHE_LOAD_FACTOR: str = "recpipe_cache_load_factor"
FUSED_PARAM_DIST_TYPE: str = "recpipe_dist_type"
FUSED_PARAM_SEED: str = "recpipe_seed"


@dataclass
class PlacementParameterSharding(ParameterSharding):
    """torchrec ``ParameterSharding`` carrying a recpipe tiered placement.

    Args:
        mode (str): ``"HYBRID"`` or ``"CACHING"``.
        cache_load_factor (float): x in (0, 1].
        dist_type (str): id routing, ``"hash_roundrobin"`` (default) or ``"roundrobin"``.
        seed (int): hash seed of the routing.

    Example::

        ps.get_additional_fused_params()
        # {"recpipe_mode": "CACHING", "recpipe_cache_load_factor": 0.2, ...}
    """

    mode: str = Mode.HYBRID.value
    cache_load_factor: float = 1.0
    dist_type: str = "hash_roundrobin"
    seed: int = 0

    def __post_init__(self) -> None:
        self.mode = Mode.parse(self.mode).value
        _check_load_factor(self.cache_load_factor)

    def get_additional_fused_params(self) -> Dict[str, Any]:
        """Fused params merged by torchrec into the table's kernel config.

        Returns:
            Dict[str, Any]: ``recpipe_mode``, ``recpipe_cache_load_factor``,
            ``recpipe_dist_type``, ``recpipe_seed``.
        """
        return {
            FUSED_PARAM_MODE: self.mode,
            FUSED_PARAM_CACHE_LOAD_FACTOR: float(self.cache_load_factor),
            FUSED_PARAM_DIST_TYPE: self.dist_type,
            FUSED_PARAM_SEED: int(self.seed),
        }


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


def to_sharding_plan(plan: PlacementPlan, compute_device: Optional[str] = None) -> ShardingPlan:
    """torchrec ``ShardingPlan`` for a placement plan (ROW_WISE, CUSTOMIZED_KERNEL).

    Args:
        plan (PlacementPlan): the placement plan.
        compute_device (Optional[str]): device for shard placements (default the
            plan's compute device).

    Returns:
        ShardingPlan: ``{module_path: {table: PlacementParameterSharding}}``.
    """
    device = compute_device or plan.compute_device
    modules: Dict[str, EmbeddingModuleShardingPlan] = {}
    for p in plan.placements:
        module_plan = modules.setdefault(p.module_path, EmbeddingModuleShardingPlan())
        module_plan[p.table] = PlacementParameterSharding(
            sharding_type=ShardingType.ROW_WISE.value,
            compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
            ranks=list(range(plan.world_size)),
            sharding_spec=row_wise_sharding_spec(p.rows, p.dim, plan.world_size, plan.local_world_size, device),
            mode=p.mode.value,
            cache_load_factor=p.cache_load_factor,
            dist_type=plan.dist_type,
            seed=plan.seed,
        )
    return ShardingPlan(plan=dict(modules))


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
    "FUSED_PARAM_DIST_TYPE",
    "FUSED_PARAM_MODE",
    "FUSED_PARAM_SEED",
    "PlacementParameterSharding",
    "placements_from_sharding_plan",
    "row_wise_sharding_spec",
    "to_sharding_plan",
]
