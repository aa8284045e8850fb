"""The key index's plan in device-generic torch ops: where a batch's keys are, and where new ones go.

A plan mutates nothing (``docs/dynamic.md``, "The plan"): ``found`` is each key's slot (-1: absent);
``slot`` is the slot a missing key that wants a row takes: per bucket, missing keys in ascending order
take the free slots in order, then the victims (used slots no key of the batch found), lowest score
first, ties by slot. The native kernel (``recpipe.pipeline.tiered.dynamic.native_plan``) computes the same
plan on the CPU. No host synchronization. Imports only ``recpipe.pipeline.tiered.dynamic.key_hashing``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from recpipe.pipeline.tiered.dynamic.key_hashing import bucket_of

__all__ = ["torch_hash_plan"]


def torch_hash_plan(
    uniq: torch.Tensor,
    want_insert: Optional[torch.Tensor],
    keys: torch.Tensor,
    scores: torch.Tensor,
    sizes: torch.Tensor,
    bucket_slots: int,
    salt: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(found, slot)`` (int64 ``[n]``, -1 for none) of ascending unique keys ``uniq``.

    Args:
        uniq (torch.Tensor): ascending unique int64 keys ``[n]``.
        want_insert (Optional[torch.Tensor]): bool ``[n]``: which missing keys take a slot (None: none).
        keys, scores (torch.Tensor): int64 ``[T]`` per slot, ``T = B * bucket_slots``.
        sizes (torch.Tensor): int64 ``[B]`` used slots per bucket (a prefix of the bucket).
        bucket_slots (int): slots per bucket ``S``.
        salt (int): the bucket hash's salt (uint64).
    """
    device = uniq.device
    n = uniq.numel()
    num_buckets = sizes.numel()
    s = bucket_slots
    b = bucket_of(uniq, salt, num_buckets)
    base = b * s
    lane = torch.arange(s, dtype=torch.int64, device=device)
    slot_ids = base.unsqueeze(1) + lane.unsqueeze(0)  # [n, S]
    size_b = sizes.index_select(0, b)
    used = lane.unsqueeze(0) < size_b.unsqueeze(1)
    match = (keys[slot_ids] == uniq.unsqueeze(1)) & used
    has = match.any(1)
    found = torch.where(has, base + match.to(torch.int8).argmax(1), -1)
    none = torch.full((n,), -1, dtype=torch.int64, device=device)
    if want_insert is None:
        return found, none
    ins = want_insert & ~has
    # rank of each inserting key among its bucket's inserting keys (keys ascend in uniq)
    group = torch.where(ins, b, num_buckets)
    order = torch.argsort(group, stable=True)
    grouped = group.index_select(0, order)
    rank_sorted = torch.arange(n, dtype=torch.int64, device=device) - torch.searchsorted(grouped, grouped)
    rank = torch.empty_like(rank_sorted).index_copy_(0, order, rank_sorted)
    free = s - size_b
    slot = torch.where(ins & (rank < free), base + size_b + rank, none)
    # victims: used slots no key of this plan found, by (score, slot)
    found_slots = torch.sort(torch.where(found >= 0, found, -1)).values
    at = torch.searchsorted(found_slots, slot_ids.reshape(-1)).clamp(max=max(n - 1, 0))
    protected = (found_slots.index_select(0, at) == slot_ids.reshape(-1)).reshape(n, s) if n else used
    usable = used & ~protected
    by_score = torch.argsort(scores[slot_ids], dim=1, stable=True)
    by_use = torch.argsort((~usable).gather(1, by_score).to(torch.int8), dim=1, stable=True)
    victims = by_score.gather(1, by_use)  # lanes: usable first, each group by (score, lane)
    v = rank - free
    take = ins & (v >= 0) & (v < usable.sum(1))
    lane_v = victims.gather(1, v.clamp(0, s - 1).unsqueeze(1)).squeeze(1)
    return found, torch.where(take, base + lane_v, slot)
