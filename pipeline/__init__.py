"""recpipe.pipeline: the training runtime (fused pipeline, routing op, tiered tables, checkpoints).

The user-facing names below resolve lazily (PEP 562): ``import recpipe.pipeline`` loads
nothing else, and ``from recpipe.pipeline import route_ids`` loads the routing op without
the training pipeline. ``recpipe.pipeline.checkpoint`` (save / load / verify_checkpoint)
is a subpackage with lazy exports of its own.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List

# public name -> the module that defines it
_EXPORTS: Dict[str, str] = {
    # the fused pipeline
    "TrainPipelineFusedSparseDist": "recpipe.pipeline.train_pipeline.fused_pipeline",
    "PipelinedLookupUnavailableError": "recpipe.pipeline.train_pipeline.forward",
    # the semi-sync pipeline
    "TrainPipelineSemiSync": "recpipe.pipeline.train_pipeline.semi_sync_pipeline",
    "SemiSyncModelError": "recpipe.pipeline.train_pipeline.semi_sync_checks",
    # the prefetching eval pipeline
    "EvalPipelinePrefetch": "recpipe.pipeline.train_pipeline.eval_pipeline",
    # the plan -> runtime contract
    "CachePolicy": "recpipe.pipeline.placement.cache_policies",
    "DistType": "recpipe.pipeline.placement.values",
    "FusedOptimizerKind": "recpipe.pipeline.placement.values",
    "Mode": "recpipe.pipeline.placement.values",
    "DynamicInitializer": "recpipe.pipeline.placement.dynamic_options",
    "DynamicTableOptions": "recpipe.pipeline.placement.dynamic_options",
    "PlacementMismatchError": "recpipe.pipeline.placement.params",
    "PlacementParams": "recpipe.pipeline.placement.params",
    # the routing op and its inverse
    "ROUTING_VERSION": "recpipe.pipeline.routing.ops",
    "block_bucketize_sparse_features": "recpipe.pipeline.routing.ops",
    "bucketize_kjt": "recpipe.pipeline.routing.kjt",
    "bucketize_kjt_by": "recpipe.pipeline.routing.kjt",
    "global_row_ids": "recpipe.pipeline.routing.rows",
    "hash_roundrobin_global_ids": "recpipe.pipeline.routing.ops",
    "route_ids": "recpipe.pipeline.routing.ops",
    "shard_num_rows": "recpipe.pipeline.routing.rows",
    # row-wise sharding routed by the op
    "RoutedEmbeddingBagCollectionSharder": "recpipe.pipeline.routing.routed_sharders",
    "RoutedEmbeddingCollectionSharder": "recpipe.pipeline.routing.routed_sharders",
    "RowOrderMismatchError": "recpipe.pipeline.routing.row_order",
    "routed_sharders": "recpipe.pipeline.routing.routed_sharders",
    # tiered (HYBRID / CACHING) tables
    "TieredCheckpointError": "recpipe.pipeline.tiered.state",
    "TieredEmbeddingBagCollectionSharder": "recpipe.pipeline.tiered.tiered_sharders",
    "TieredEmbeddingCollectionSharder": "recpipe.pipeline.tiered.tiered_sharders",
    "gather_dynamic_table": "recpipe.pipeline.tiered.dynamic.dynamic_gather",
    "DynamicTableDump": "recpipe.pipeline.tiered.dynamic.dynamic_gather",
    "gather_full_optimizer_state": "recpipe.pipeline.tiered.migration",
    "gather_full_weights": "recpipe.pipeline.tiered.migration",
    "load_full_optimizer_state": "recpipe.pipeline.tiered.migration",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'recpipe.pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_EXPORTS))
