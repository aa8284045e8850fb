"""recpipe.pipeline: TrainPipelineFusedSparseDist, op wrappers, tiered storage, sharders.

Public names are resolved lazily (PEP 562) so ``import recpipe.pipeline.routing.ops``
does not pull in the training pipeline and vice versa.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "TrainPipelineFusedSparseDist": "recpipe.pipeline.train.pipeline",
    "block_bucketize_sparse_features": "recpipe.pipeline.routing.ops",
    "bucketize_kjt": "recpipe.pipeline.routing.ops",
    "hash_roundrobin_global_ids": "recpipe.pipeline.routing.ops",
    "route_ids": "recpipe.pipeline.routing.ops",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'recpipe.pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
