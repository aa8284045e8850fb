"""recpipe.pipeline.checkpoint: the one DCP checkpoint path (save and load through
``torch.distributed.checkpoint``, digests, key layout, tiered exports, adoption both ways).

May import every other part of ``recpipe.pipeline`` except ``train``. Public names resolve
lazily (PEP 562), so importing the integrity helpers does not import the DCP machinery.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "CheckpointIntegrityError": "recpipe.pipeline.checkpoint.errors",
    "CheckpointLoadError": "recpipe.pipeline.checkpoint.errors",
    "CheckpointSaveError": "recpipe.pipeline.checkpoint.errors",
    "DCP_METADATA_NAME": "recpipe.pipeline.checkpoint.digests",
    "DIGESTS_NAME": "recpipe.pipeline.checkpoint.digests",
    "ExtraState": "recpipe.pipeline.checkpoint.layout",
    "FUSED_OPTIMIZER_KEY": "recpipe.pipeline.checkpoint.layout",
    "SAVE_LOCK_NAME": "recpipe.pipeline.checkpoint.integrity",
    "TIERED_DCP_PREFIX": "recpipe.pipeline.checkpoint.layout",
    "TieredCheckpointError": "recpipe.pipeline.tiered.state",
    "dcp_failures": "recpipe.pipeline.checkpoint.errors",
    "dcp_state_dict": "recpipe.pipeline.checkpoint.layout",
    "describe_failures": "recpipe.pipeline.checkpoint.errors",
    "load": "recpipe.pipeline.checkpoint.dcp",
    "load_dcp_state_dict": "recpipe.pipeline.checkpoint.dcp",
    "read_extra_state": "recpipe.pipeline.checkpoint.layout",
    "remove_rank_files": "recpipe.pipeline.checkpoint.digests",
    "save": "recpipe.pipeline.checkpoint.dcp",
    "tiered_dcp_key": "recpipe.pipeline.checkpoint.layout",
    "verify_checkpoint": "recpipe.pipeline.checkpoint.digests",
    "write_digests": "recpipe.pipeline.checkpoint.digests",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'recpipe.pipeline.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
