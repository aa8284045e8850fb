"""recpipe.pipeline: the training runtime (fused pipeline, routing op, tiered tables, checkpoints).

The user-facing names below resolve lazily (PEP 562): ``import recpipe.pipeline`` loads
nothing else, and ``from recpipe.pipeline import route_ids`` loads the routing op without
the training pipeline. ``recpipe.pipeline.checkpoint`` (save / load / verify_checkpoint)
is a subpackage with lazy exports of its own.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List

_PLACEMENT_VALUES = "recpipe.pipeline.placement.values"
_PLACEMENT_PARAMS = "recpipe.pipeline.placement.params"
_ROUTING_OPS = "recpipe.pipeline.routing.ops"
_ROUTING_KJT = "recpipe.pipeline.routing.kjt"
_ROUTING_ROWS = "recpipe.pipeline.routing.rows"
_ROUTING_SHARDERS = "recpipe.pipeline.routing.sharders"
_TIERED_SHARDERS = "recpipe.pipeline.tiered.sharders"
_TIERED_MIGRATION = "recpipe.pipeline.tiered.migration"

# public name -> the module that defines it
_EXPORTS: Dict[str, str] = {
    # the fused pipeline
    "TrainPipelineFusedSparseDist": "recpipe.pipeline.train.pipeline",
    "PipelinedLookupUnavailableError": "recpipe.pipeline.train.forward",
    # the plan -> runtime contract
    "CachePolicy": "recpipe.pipeline.placement.cache_policies",
    "DistType": _PLACEMENT_VALUES,
    "FusedOptimizer": _PLACEMENT_VALUES,
    "Mode": _PLACEMENT_VALUES,
    "PlacementMismatchError": _PLACEMENT_PARAMS,
    "PlacementParams": _PLACEMENT_PARAMS,
    # the routing op and its inverse
    "ROUTING_VERSION": _ROUTING_OPS,
    "block_bucketize_sparse_features": _ROUTING_OPS,
    "bucketize_kjt": _ROUTING_KJT,
    "bucketize_kjt_by": _ROUTING_KJT,
    "global_row_ids": _ROUTING_ROWS,
    "hash_roundrobin_global_ids": _ROUTING_OPS,
    "route_ids": _ROUTING_OPS,
    "shard_num_rows": _ROUTING_ROWS,
    # row-wise sharding routed by the op
    "RecpipeEmbeddingBagCollectionSharder": _ROUTING_SHARDERS,
    "RecpipeEmbeddingCollectionSharder": _ROUTING_SHARDERS,
    "RowOrderMismatchError": "recpipe.pipeline.routing.row_order",
    "recpipe_sharders": _ROUTING_SHARDERS,
    # tiered (HYBRID / CACHING) tables
    "TieredCheckpointError": "recpipe.pipeline.tiered.state",
    "TieredEmbeddingBagCollectionSharder": _TIERED_SHARDERS,
    "TieredEmbeddingCollectionSharder": _TIERED_SHARDERS,
    "gather_full_optimizer_state": _TIERED_MIGRATION,
    "gather_full_weights": _TIERED_MIGRATION,
    "load_full_optimizer_state": _TIERED_MIGRATION,
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'recpipe.pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_EXPORTS))
