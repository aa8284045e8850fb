"""recpipe.pipeline.checkpoint: the one DCP checkpoint path (save and load through
``torch.distributed.checkpoint``, digests, key layout, tiered exports, dynamic tables, tables
loaded from and into torchrec tables).

Modules by concern: ``api`` (save / load / verify_checkpoint), ``layout`` (files, keys, reading
exports), ``integrity`` (digests record, atomic writes, save lock, ``FileSystemStorage``),
``torchrec_interop`` (tiered tables from torchrec tables and into them), ``dynamic_tables`` (dynamic
tables by raw key), ``collectives`` (every rank learns a refusal) and ``checkpoint_errors``
(``CheckpointError``, the root of every failure).
May import every other part of ``recpipe.pipeline`` except ``train_pipeline``. Public names
resolve lazily (PEP 562), so importing the error types does not import the DCP machinery.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    name: f"recpipe.pipeline.{module}"
    for module, names in (
        ("checkpoint.api", "load load_dcp_state_dict save verify_checkpoint"),
        ("checkpoint.integrity", "FileSystemStorage remove_rank_files write_digests"),
        ("checkpoint.checkpoint_errors", "CheckpointError CheckpointIntegrityError CheckpointLoadError"),
        ("checkpoint.checkpoint_errors", "CheckpointNotADirectoryError CheckpointNotFoundError"),
        ("checkpoint.checkpoint_errors", "CheckpointRowOrderError CheckpointSaveError CheckpointTableError"),
        ("checkpoint.checkpoint_errors", "dcp_failures describe_failures"),
        ("checkpoint.layout", "DCP_METADATA_NAME DIGESTS_NAME SAVE_LOCK_NAME"),
        ("checkpoint.layout", "ExtraState FUSED_OPTIMIZER_KEY TIERED_DCP_PREFIX tiered_dcp_key"),
        ("checkpoint.layout", "DYNAMIC_DCP_PREFIX dynamic_dcp_key"),
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
