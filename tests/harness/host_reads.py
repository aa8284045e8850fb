"""A dispatch mode that records the ops whose result needs a host read of device data.

On an accelerator such an op waits for the device (its output's shape or value is data): ``nonzero``,
``unique``, ``masked_select``, ``.item()`` / ``bool()`` / ``int()`` (``_local_scalar_dense``), a boolean
index or boolean index put. torch tags them itself (``Tag.data_dependent_output``,
``Tag.dynamic_output_shape``); ``aten.index`` carries the tag for any index, so it counts only with a
boolean one. Run on the CPU, the mode shows what a step would read back on CUDA.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReads"]

_aten = torch.ops.aten
_INDEXING = (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default)


def _boolean(indices: Sequence[Optional[torch.Tensor]]) -> bool:
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


class HostReads(TorchDispatchMode):
    """Records (``ops``) the data-dependent ops run inside it, by name, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _INDEXING:
            if _boolean(args[1]):
                self.ops.append(str(func))
        elif torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags:
            self.ops.append(str(func))
        return func(*args, **kwargs)
