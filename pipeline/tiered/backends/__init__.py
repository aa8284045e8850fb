"""Tier backends of the tiered shard (``recpipe.pipeline.interfaces.TierBackend``) and their registry.

``native`` (``native.NativeBackend``: the compiled CPU kernel), ``fbgemm`` (``fbgemm.FbgemmBackend``:
fbgemm's TBE, the CUDA default), ``torch`` (``torch_backend.TorchBackend``: the device-generic
reference). A new backend is one module and one line in :data:`BACKENDS`, or, outside recpipe,
a :func:`register_backend` call.
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

__all__ = ["BACKENDS", "register_backend", "resolve_backend"]

#: The tier backends by name (``TieredEmbeddingShard(backend=name)``).
BACKENDS: Dict[str, Type[TierBackend]] = {
    NativeBackend.name: NativeBackend,
    FbgemmBackend.name: FbgemmBackend,
    TorchBackend.name: TorchBackend,
}


def register_backend(cls: Type[TierBackend]) -> Type[TierBackend]:
    """Registers a ``TierBackend`` subclass under its ``name``, so ``TieredEmbeddingShard(backend=name)``
    and the tiered sharders' ``backend=`` reach it; returns ``cls`` (usable as a class decorator).

    Raises:
        ValueError: ``cls`` is not a ``TierBackend`` subclass, its ``name`` is not a non-empty str, or
            another class holds that name.
    """
    if not (isinstance(cls, type) and issubclass(cls, TierBackend)):
        raise ValueError(
            f"register_backend: cls must be a subclass of recpipe.pipeline.interfaces.TierBackend, got {cls!r}; "
            "derive the backend from TierBackend and implement its abstract methods."
        )
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"register_backend: {cls.__qualname__}.name must be a non-empty str, got {name!r}; set the class "
            "attribute name = '<registry name>'."
        )
    if BACKENDS.get(name, cls) is not cls:
        raise ValueError(
            f"register_backend: the name {name!r} is taken by {BACKENDS[name].__qualname__}; give "
            f"{cls.__qualname__} another name (registered: {sorted(BACKENDS)})."
        )
    BACKENDS[name] = cls
    return cls


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
