"""recpipe.planner: the embedded placement planner (HYBRID / CACHING per table).

``PlacementPlanner(topology).plan(ebc) -> PlacementPlan``; ``plan.to_sharding_plan()`` gives the torchrec
``ShardingPlan``. Its stages are extension points (``recpipe.planner.types``: ``PlacementEnumerator``,
``CostModel``, ``PlacementProposer``, ``PlacementPartitioner``). The contract and byte formulas shared with the runtime live in
``recpipe.pipeline.placement`` (re-exported here). May import ``recpipe.pipeline.placement`` and public
names of the pipeline packages (never ``recpipe.pipeline.train_pipeline``, never a private name).
"""

from recpipe.pipeline.placement import (
    CACHE_ROW_MAP_BYTES,
    CACHE_SLOT_BYTES,
    CachePolicy,
    DistType,
    FusedOptimizerKind,
    Mode,
    PlacementParams,
    ShardStorage,
    local_rows,
    machine_storage,
    max_local_rows,
    optimizer_state_bytes_per_row,
    row_bytes,
    shard_storage,
    tier_rows,
)
from recpipe.planner.brute_force import BruteForceProposer
from recpipe.planner.cost_models import AnalyticCostModel, EmpiricalCostModel, fast_tier_hit_rate
from recpipe.planner.enumerators import GridPlacementEnumerator
from recpipe.planner.errors import PlacementErrorType, PlacementPlannerError, PlannerInputError
from recpipe.planner.option_arrays import OptionArrays
from recpipe.planner.partitioners import GreedyTableWisePartitioner, Partition
from recpipe.planner.placement_plan import PlacementPlan, TablePlacement, to_torchrec_sharding_plan
from recpipe.planner.planners import PlacementPlanner
from recpipe.planner.proposers import KnapsackProposer
from recpipe.planner.specs import (
    DEFAULT_LOAD_FACTORS,
    STORAGE_BACKENDS,
    PlacementConstraints,
    PlacementOption,
    TableSpec,
    make_topology,
)
from recpipe.planner.tables import table_fused_optimizer, tables_from_module
from recpipe.planner.torchrec_plan import PlacementParameterSharding, placements_from_sharding_plan
from recpipe.planner.types import CostModel, PlacementEnumerator, PlacementPartitioner, PlacementProposer

__all__ = [
    "AnalyticCostModel",
    "BruteForceProposer",
    "CACHE_ROW_MAP_BYTES",
    "CACHE_SLOT_BYTES",
    "CachePolicy",
    "CostModel",
    "DEFAULT_LOAD_FACTORS",
    "DistType",
    "KnapsackProposer",
    "EmpiricalCostModel",
    "FusedOptimizerKind",
    "GreedyTableWisePartitioner",
    "GridPlacementEnumerator",
    "Mode",
    "OptionArrays",
    "Partition",
    "PlacementConstraints",
    "PlacementOption",
    "PlacementParameterSharding",
    "PlacementParams",
    "PlacementPlan",
    "PlacementPlanner",
    "PlacementPlannerError",
    "PlacementErrorType",
    "PlannerInputError",
    "PlacementEnumerator",
    "PlacementPartitioner",
    "PlacementProposer",
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
    "to_torchrec_sharding_plan",
]
