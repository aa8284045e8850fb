"""recpipe.planner: the embedded placement planner (HYBRID / CACHING per table).

``PlacementPlanner(topology).plan(ebc) -> PlacementPlan``; ``plan.report()`` and
``plan.to_sharding_plan()`` (torchrec ``ShardingPlan``, ROW_WISE +
CUSTOMIZED_KERNEL), each table's ``ParameterSharding`` carrying its
``PlacementParams``. The placement contract (enums, fused-param keys,
``PlacementParams``) and the byte formulas shared with the tiered-storage runtime
live in ``recpipe.pipeline.placement``; ``recpipe.planner.storage`` re-exports the
formulas.
"""

from recpipe.pipeline.placement import CachePolicy, DistType, FusedOptimizer, PlacementParams
from recpipe.planner.cost_models import (
    AnalyticCostModel,
    CostModel,
    EmpiricalCostModel,
    fast_tier_hit_rate,
)
from recpipe.planner.enumerators import GridPlacementEnumerator
from recpipe.planner.planners import PlacementPlanner, table_fused_optimizer, tables_from_module
from recpipe.planner.proposers import BruteForceProposer, DynamicProgrammingProposer, Proposer
from recpipe.planner.sharding import PlacementParameterSharding, placements_from_sharding_plan
from recpipe.planner.storage import (
    CACHE_ROW_MAP_BYTES,
    CACHE_SLOT_BYTES,
    ShardStorage,
    local_rows,
    machine_storage,
    max_local_rows,
    optimizer_state_bytes_per_row,
    row_bytes,
    shard_storage,
    tier_rows,
)
from recpipe.planner.types import (
    DEFAULT_LOAD_FACTORS,
    STORAGE_BACKENDS,
    Mode,
    PlacementConstraints,
    PlacementOption,
    PlacementPlan,
    PlannerError,
    PlannerErrorType,
    PlannerInputError,
    TablePlacement,
    TableSpec,
    make_topology,
    to_sharding_plan,
)

__all__ = [
    "AnalyticCostModel",
    "BruteForceProposer",
    "CACHE_ROW_MAP_BYTES",
    "CACHE_SLOT_BYTES",
    "CachePolicy",
    "CostModel",
    "DEFAULT_LOAD_FACTORS",
    "DistType",
    "DynamicProgrammingProposer",
    "EmpiricalCostModel",
    "FusedOptimizer",
    "GridPlacementEnumerator",
    "Mode",
    "PlacementConstraints",
    "PlacementOption",
    "PlacementParameterSharding",
    "PlacementParams",
    "PlacementPlan",
    "PlacementPlanner",
    "PlannerError",
    "PlannerErrorType",
    "PlannerInputError",
    "Proposer",
    "STORAGE_BACKENDS",
    "ShardStorage",
    "TablePlacement",
    "TableSpec",
    "fast_tier_hit_rate",
    "local_rows",
    "machine_storage",
    "make_topology",
    "max_local_rows",
    "optimizer_state_bytes_per_row",
    "placements_from_sharding_plan",
    "row_bytes",
    "shard_storage",
    "table_fused_optimizer",
    "tables_from_module",
    "tier_rows",
    "to_sharding_plan",
]
