"""Tier backends of the tiered shard (``recpipe.pipeline.interfaces.TierBackend``) and their registry.

``native`` (compiled CPU kernel), ``fbgemm`` (fbgemm's TBE, the CUDA default), ``torch``
(device-generic reference). A new backend is one module and one line in :data:`BACKENDS`.
May import ``recpipe.pipeline.placement``, ``recpipe.pipeline.interfaces``, ``recpipe.pipeline.routing``
and the tiered modules below the shard (``ops``, ``fbgemm``, ``optim``).
"""

from __future__ import annotations

from typing import Dict, Optional, Type

import torch

from recpipe.pipeline.interfaces import TierBackend
from recpipe.pipeline.tiered.backends.fbgemm import FbgemmBackend
from recpipe.pipeline.tiered.backends.native import NativeBackend
from recpipe.pipeline.tiered.backends.torch_backend import TorchBackend

__all__ = ["BACKENDS", "resolve_backend"]

#: The tier backends by name (``TieredEmbeddingShard(backend=name)``).
BACKENDS: Dict[str, Type[TierBackend]] = {
    NativeBackend.name: NativeBackend,
    FbgemmBackend.name: FbgemmBackend,
    TorchBackend.name: TorchBackend,
}


def resolve_backend(backend: Optional[str], device: torch.device) -> str:
    """``backend`` (checked against ``device``), or the default of the device's type, else of ``"*"``."""
    if backend is None:
        for wanted in (device.type, "*"):
            for name, cls in BACKENDS.items():
                if wanted in cls.default_devices:
                    return name
        raise ValueError(f"no tier backend runs on {device} by default: pass backend= one of {list(BACKENDS)}.")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)} or None (the device's default), got {backend!r}.")
    BACKENDS[backend].check_device(device)
    return backend
