"""Row placement and lookup helpers every tier backend shares.

HYBRID split: a seeded bijective hash ``H`` of ``[0, R)`` puts local row ``r`` in the fast
tier at ``H(r)`` when ``H(r) < k``, else in the slow tier at ``H(r) - k``. May import
``recpipe.pipeline.placement``, ``recpipe.pipeline.routing`` and ``recpipe.pipeline.tiered.native_ops``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from recpipe.pipeline.routing.ops import route_ids
from recpipe.pipeline.tiered.native_ops import TIERED_STATS

__all__ = ["bag_lengths_and_ids", "check_psw_pooling", "new_stats", "split_hash", "split_tier"]


def split_hash(rows: torch.Tensor, num_rows: int, seed: int) -> torch.Tensor:
    """Hashed positions ``H(r)`` of local rows: a seeded bijection of ``[0, num_rows)``."""
    return route_ids(rows, max(num_rows, 1), 1, "hash_roundrobin", seed)[1]


def split_tier(pos: torch.Tensor, fast_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(in_fast, index in its tier)`` of HYBRID rows from their hashed positions ``H(r)``."""
    in_fast = pos < fast_rows
    return in_fast, torch.where(in_fast, pos, pos - fast_rows)


def check_psw_pooling(pooling: str, psw: Optional[torch.Tensor]) -> None:
    """Per-sample weights only with sum pooling (a host check: no tensor is read)."""
    if psw is not None and pooling != "sum":
        raise ValueError("per_sample_weights need pooling='sum' (as in torch.nn.EmbeddingBag).")


def bag_lengths_and_ids(offsets: torch.Tensor, n: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lengths [B], bag [n], real [n])`` of ``n`` ids in ``B + 1`` bag offsets (int64, offsets' device), in
    fixed shapes (no host read): ``real`` marks the ids before ``offsets[-1]``; the ids past it (a lookup that
    moved its dropped keys there) belong to no bag (``bag`` says the last; ``real`` is False)."""
    offsets = offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    pos = torch.arange(n, dtype=torch.int64, device=offsets.device)
    bags = torch.searchsorted(offsets[1:], pos, right=True).clamp(max=max(lengths.numel() - 1, 0))
    return lengths, bags, pos < offsets[-1]


def new_stats(device: torch.device) -> torch.Tensor:
    """Zeroed int64 counters: the last lookup's :data:`TIERED_STATS`, then their running totals."""
    return torch.zeros(2 * len(TIERED_STATS), dtype=torch.int64, device=device)
