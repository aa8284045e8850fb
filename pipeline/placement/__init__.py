"""The placement contract between the planner (writer) and the tiered runtime (reader).

The planner writes one :class:`PlacementParams` per tiered table into its ``ParameterSharding``; the
sharders read it back from the fused params. Enums, ``FUSED_PARAM_*`` keys, cache policies and byte
formulas live here once: the runtime allocates exactly what ``shard_storage`` / ``fbgemm_shard_storage``
(``dynamic_shard_storage`` for a dynamic table) budget. Fast tier: HBM (host buffer on CPU); slow tier: host
DDR; local rows: a rank's rows under roundrobin routing. Imports nothing of recpipe outside this package (not even the extension).
"""

# ruff: noqa: F401 - every import is a re-export (__all__ below lists them)
import types as _types

from recpipe.pipeline.placement.cache_policies import (
    CACHE_POLICIES,
    CACHE_SLOT_BYTES,
    CachePolicy,
    CachePolicySpec,
    cache_policy_spec,
)
from recpipe.pipeline.placement.dynamic_options import (
    ADMISSION_CAPACITY_DIVISOR,
    BUCKET_SLOTS,
    DYNAMIC_EVICTIONS,
    DYNAMIC_INIT_MODES,
    DYNAMIC_ON_FULL,
    INDEX_BYTES_PER_SLOT,
    DynamicInitializer,
    DynamicTableOptions,
    dynamic_counter_slots,
    dynamic_index_bytes,
    dynamic_local_slots,
)
from recpipe.pipeline.placement.params import (
    FUSED_PARAM_BACKEND,
    FUSED_PARAM_CACHE_LOAD_FACTOR,
    FUSED_PARAM_CACHE_POLICY,
    FUSED_PARAM_DIST_TYPE,
    FUSED_PARAM_DTYPE,
    FUSED_PARAM_DYNAMIC,
    FUSED_PARAM_KEYS,
    FUSED_PARAM_MODE,
    FUSED_PARAM_OPTIMIZER,
    FUSED_PARAM_PREFIX,
    FUSED_PARAM_RUNTIME_KEYS,
    FUSED_PARAM_SEED,
    PlacementContractError,
    PlacementMismatchError,
    PlacementParams,
)
from recpipe.pipeline.placement.sizing import (
    CACHE_ROW_MAP_BYTES,
    FBGEMM_CACHE_ASSOC,
    SPLIT_MAP_BYTES,
    FbgemmTierLayout,
    ShardStorage,
    decimal_ratio,
    dynamic_shard_storage,
    fbgemm_bytes,
    fbgemm_cache_sets,
    fbgemm_shard_storage,
    fbgemm_tier_bytes,
    floor_fraction,
    machine_split,
    machine_storage,
    machine_sum,
    max_local_rows,
    native_tier_bytes,
    optimizer_state_bytes_per_row,
    row_bytes,
    shard_storage,
    tier_rows,
    tier_split,
)
from recpipe.pipeline.placement.values import (
    DIST_TYPES,
    ROUTED_DIST_TYPES,
    SUPPORTED_OPTIMIZERS,
    TIERED_DTYPES,
    DistType,
    FusedOptimizerKind,
    Mode,
    check_int,
    check_load_factor,
    check_load_factors,
    dtype_itemsize,
    dtype_name,
    local_rows,
    parse_enum,
    resolve_dtype,
)

#: Every name imported above (the submodules excluded).
__all__ = sorted(n for n, v in globals().items() if not n.startswith("_") and not isinstance(v, _types.ModuleType))
