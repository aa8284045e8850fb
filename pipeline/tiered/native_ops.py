"""Codes, stats layout and fake kernels of the ``torch.ops.recpipe.tiered_*`` ops.

Importing it loads ``recpipe._C`` (kernels in ``csrc/tiered.cpp``) and registers the fake kernels
used by ``torch.compile`` / FakeTensor. May import ``recpipe._C`` and ``recpipe.pipeline.placement``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import recpipe._C  # noqa: F401  (registers torch.ops.recpipe.tiered_*)

__all__ = ["TIERED_MODES", "TIERED_OPTIMIZERS", "TIERED_POOLINGS", "TIERED_STATS"]

#: ``mode`` argument of the tiered ops.
TIERED_MODES: dict[str, int] = {"ALL_FAST": 0, "HYBRID": 1, "CACHING": 2}
#: ``pooling`` argument.
TIERED_POOLINGS: dict[str, int] = {"sum": 0, "mean": 1}
#: ``optimizer`` argument (fused optimizer applied by ``tiered_backward``).
TIERED_OPTIMIZERS: dict[str, int] = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2}
#: Counters of the ``stats`` tensor: the last lookup's at ``[0, 7)``, running totals at ``[7, 14)``.
TIERED_STATS: tuple[str, ...] = (
    "lookups",
    "unique_rows",
    "hits",
    "fast_lookups",
    "rows_loaded",
    "rows_evicted",
    "rows_written_back",
)


# The fake kernels take the ops' arguments positionally (schemas in csrc/tiered.cpp); they read the leading ones.
@torch.library.register_fake("recpipe::tiered_lookup")
def _tiered_lookup_fake(
    ids: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor], fast_weights: torch.Tensor, *_: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._check(ids.dim() == 1, lambda: f"`ids` must be 1-D, got shape {list(ids.shape)}")
    torch._check(ids.dtype in (torch.int32, torch.int64), lambda: f"`ids` must be int32/int64, got {ids.dtype}")
    torch._check(offsets.dim() == 1 and offsets.numel() >= 1, lambda: "`offsets` must be 1-D with B + 1 entries")
    torch._check(
        fast_weights.dtype == torch.float32 and fast_weights.dim() == 2,
        lambda: "`fast_weights` must be a float32 [rows, dim] tensor",
    )
    unique = torch.library.get_ctx().new_dynamic_size()
    out = fast_weights.new_empty((offsets.numel() - 1, fast_weights.shape[1]))
    return out, ids.new_empty((unique,), dtype=torch.int64), ids.new_empty(ids.shape, dtype=torch.int64)


@torch.library.register_fake("recpipe::tiered_backward")
def _tiered_backward_fake(
    grad_out: torch.Tensor, uniq: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor, *rest: Any
) -> None:
    step = rest[-1]
    torch._check(
        grad_out.dim() == 2 and grad_out.shape[0] == offsets.numel() - 1,
        lambda: "`grad_out` must be [B, dim] with B = len(offsets) - 1",
    )
    torch._check(step >= 1, lambda: f"`step` must be >= 1, got {step}")
