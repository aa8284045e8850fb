"""recpipe.pipeline.checkpoint: the one DCP checkpoint path.

Owns save and load through ``torch.distributed.checkpoint``, file digests and the
atomic ``latest`` record, adoption of torchrec tables into tiered tables and back,
and tiered-table exports. May import every other part of ``recpipe.pipeline``
except ``train``. Public names resolve lazily (PEP 562), so importing the
integrity helpers does not import the DCP machinery.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "CheckpointIntegrityError": "recpipe.pipeline.checkpoint.dcp",
    "CheckpointLoadError": "recpipe.pipeline.checkpoint.dcp",
    "CheckpointSaveError": "recpipe.pipeline.checkpoint.dcp",
    "dcp_state_dict": "recpipe.pipeline.checkpoint.dcp",
    "load": "recpipe.pipeline.checkpoint.dcp",
    "load_dcp_state_dict": "recpipe.pipeline.checkpoint.dcp",
    "save": "recpipe.pipeline.checkpoint.dcp",
    "verify_checkpoint": "recpipe.pipeline.checkpoint.dcp",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'recpipe.pipeline.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
