"""recpipe.pipeline.checkpoint: the one DCP checkpoint path (save and load through
``torch.distributed.checkpoint``, digests, key layout, tiered exports, adoption both ways).

May import every other part of ``recpipe.pipeline`` except ``train``. Public names resolve
lazily (PEP 562), so importing the integrity helpers does not import the DCP machinery.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    name: f"recpipe.pipeline.{module}"
    for module, names in (
        ("checkpoint.dcp", "load load_dcp_state_dict save"),
        ("checkpoint.digests", "DCP_METADATA_NAME DIGESTS_NAME remove_rank_files verify_checkpoint write_digests"),
        ("checkpoint.errors", "CheckpointIntegrityError CheckpointLoadError CheckpointSaveError"),
        ("checkpoint.errors", "dcp_failures describe_failures"),
        ("checkpoint.integrity", "SAVE_LOCK_NAME"),
        ("checkpoint.layout", "ExtraState FUSED_OPTIMIZER_KEY TIERED_DCP_PREFIX tiered_dcp_key"),
        ("checkpoint.layout", "dcp_state_dict read_extra_state"),
        ("tiered.state", "TieredCheckpointError"),
    )
    for name in names.split()
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'recpipe.pipeline.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
