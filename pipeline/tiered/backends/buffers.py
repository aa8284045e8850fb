"""Tiers held in tensors the backend allocates: the layout the ``native`` and ``torch`` backends share.

Fast tier on the shard's device, slow tier in host DDR (pinned under CUDA); HYBRID rows sit at
their split-hash position. CACHING keeps ``row_map[r]`` (``>= 0``: slot; ``-(c + 1)``: uncached,
``c`` accesses under LFU, ``-1`` under LRU), ``slot_row[s]`` (``-1``: free) and ``slot_score[s] =
(key << 1) | dirty`` (key: access count (LFU) or last step used (LRU)). A row's optimizer state
moves with it. May import ``recpipe.pipeline.placement``, ``.types``, ``.routing`` and ``.tiered.ops``.
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from typing import Any, Optional, Tuple

import torch

from recpipe.pipeline.interfaces import InputCheck, RowOptimizer, TierBackend, TierSpec, TierTensors
from recpipe.pipeline.placement import row_bytes
from recpipe.pipeline.tiered.backends.common import bag_lengths_and_ids, new_stats, split_hash, split_tier

__all__ = ["BufferedTier", "WRITE_CHUNK_ROWS"]

#: Rows written to the tiers at a time by bulk writes (loads), bounding temporaries.
WRITE_CHUNK_ROWS: int = 1 << 16

Lookup = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class _TieredLookup(torch.autograd.Function):
    """Pooled lookup whose backward applies the fused optimizer to the tiers."""

    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        tier: "BufferedTier",
        ids: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor],
        optimizer: RowOptimizer,
        check: InputCheck,
    ) -> torch.Tensor:
        out, uniq, inverse = tier.forward_lookup(ids, offsets, per_sample_weights, check)
        ctx.tier = tier
        # the lookup's hyper-parameters, as fbgemm's TBE: a change before the backward applies next time
        ctx.optimizer = copy.copy(optimizer)
        ctx.save_for_backward(uniq, inverse, offsets, per_sample_weights)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        uniq, inverse, offsets, psw = ctx.saved_tensors
        tier: BufferedTier = ctx.tier
        # per-sample weights' gradient reads the rows before this backward updates them, as fbgemm
        grad_psw = tier.psw_grad(grad_out, uniq, inverse, offsets) if ctx.needs_input_grad[4] else None
        tier.backward_update(grad_out, uniq, inverse, offsets, psw, ctx.optimizer)
        return None, None, None, None, grad_psw, None, None


class BufferedTier(TierBackend):
    """Fast / slow tier buffers and cache maps of one shard; subclasses implement
    :meth:`forward_lookup` and :meth:`backward_update`."""

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.fast_rows, self.slow_rows, self.cache_slots = spec.tiers
        self.all_fast: bool = spec.all_fast
        self.caching: bool = spec.caching
        device, dim, cols = spec.device, spec.embedding_dim, spec.state_cols
        n_fast = self.fast_rows + self.cache_slots
        pin = device.type == "cuda" and torch.cuda.is_available()
        self.fast_weights = torch.zeros((n_fast, dim), dtype=spec.dtype, device=device)
        self.fast_state = torch.zeros((n_fast, cols), dtype=torch.float32, device=device)
        self.slow_weights = torch.zeros((self.slow_rows, dim), dtype=spec.dtype, device="cpu", pin_memory=pin)
        self.slow_state = torch.zeros((self.slow_rows, cols), dtype=torch.float32, device="cpu", pin_memory=pin)
        self.row_map: Optional[torch.Tensor] = None
        self.slot_row: Optional[torch.Tensor] = None
        self.slot_score: Optional[torch.Tensor] = None
        if self.caching:
            self.row_map = torch.full((spec.num_rows,), -1, dtype=torch.int64, device=device)
            self.slot_row = torch.full((self.cache_slots,), -1, dtype=torch.int64, device=device)
            self.slot_score = torch.zeros((self.cache_slots,), dtype=torch.int64, device=device)
        self.no_cache = torch.empty(0, dtype=torch.int64, device=device)  # the kernel's cache maps without a cache
        self.stats = new_stats(device)
        self.step = 0
        # Adam's bias-correction step: fbgemm's iter_cpu, which re-reads step only while 0
        self._opt_iter = 0
        self._clock = 0  # lookups so far; the LRU recency key
        self.flushed_rows = 0
        self._row_bytes = row_bytes(dim, spec.dtype, spec.optimizer.name)

    @property
    def moved_row_bytes(self) -> int:
        """Values plus optimizer state: a row's state moves with it."""
        return self._row_bytes

    def tier_tensors(self) -> TierTensors:
        fast = [("fast_weights", self.fast_weights), ("fast_state", self.fast_state)]
        counters = [("stats", self.stats)]
        if self.caching:
            assert self.row_map is not None and self.slot_row is not None and self.slot_score is not None
            fast += [("row_map", self.row_map), ("slot_row", self.slot_row), ("slot_score", self.slot_score)]
        else:
            counters.append(("no_cache", self.no_cache))
        return {
            "fast": fast,
            "slow": [("slow_weights", self.slow_weights), ("slow_state", self.slow_state)],
            "counters": counters,
        }

    def locate(self, rows: torch.Tensor) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """Tier and index of local rows: ``(in_fast mask or None if all fast, index)``."""
        if self.all_fast:
            return None, rows
        if self.caching:
            assert self.row_map is not None
            slot = self.row_map.index_select(0, rows)
            in_fast = slot >= 0
            return in_fast, torch.where(in_fast, slot, rows)
        return split_tier(split_hash(rows, self.spec.num_rows, self.spec.split_seed), self.fast_rows)

    def read(self, in_fast: Optional[torch.Tensor], idx: torch.Tensor, state: bool) -> torch.Tensor:
        """Values (or optimizer state) of rows located by :meth:`locate`, on the device."""
        fast, slow = self.tier_pairs()[state]
        if in_fast is None:
            return fast.index_select(0, idx)
        out = torch.empty((idx.numel(), fast.shape[1]), dtype=fast.dtype, device=self.spec.device)
        f_pos = in_fast.nonzero().squeeze(1)
        s_pos = (~in_fast).nonzero().squeeze(1)
        out.index_copy_(0, f_pos, fast.index_select(0, idx.index_select(0, f_pos)))
        if s_pos.numel():
            s_idx = idx.index_select(0, s_pos).to(slow.device)
            out.index_copy_(0, s_pos, slow.index_select(0, s_idx).to(self.spec.device, non_blocking=True))
        return out

    def write(self, in_fast: Optional[torch.Tensor], idx: torch.Tensor, values: torch.Tensor, state: bool) -> None:
        """Writes values (or optimizer state) of rows located by :meth:`locate`."""
        fast, slow = self.tier_pairs()[state]
        if in_fast is None:
            fast.index_copy_(0, idx, values)
            return
        f_pos = in_fast.nonzero().squeeze(1)
        s_pos = (~in_fast).nonzero().squeeze(1)
        fast.index_copy_(0, idx.index_select(0, f_pos), values.index_select(0, f_pos))
        if s_pos.numel():
            s_idx = idx.index_select(0, s_pos).to(slow.device)
            slow.index_copy_(0, s_idx, values.index_select(0, s_pos).to(slow.device))

    @torch.no_grad()
    def read_rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        in_fast, idx = self.locate(torch.arange(self.spec.num_rows, dtype=torch.int64, device=self.spec.device))
        return self.read(in_fast, idx, state=False), self.read(in_fast, idx, state=True)

    @torch.no_grad()
    def write_rows(
        self, weights: torch.Tensor, state: Optional[torch.Tensor], rows: Optional[torch.Tensor] = None
    ) -> None:
        """Writes :data:`WRITE_CHUNK_ROWS` rows at a time (bounded temporaries)."""
        device = self.spec.device
        n = self.spec.num_rows if rows is None else int(rows.numel())
        for lo in range(0, n, WRITE_CHUNK_ROWS):
            hi = min(lo + WRITE_CHUNK_ROWS, n)
            part_rows = (
                torch.arange(lo, hi, dtype=torch.int64, device=device) if rows is None else rows[lo:hi].to(device)
            )
            in_fast, idx = self.locate(part_rows)
            self.write(in_fast, idx, weights[lo:hi], state=False)
            part = (
                state[lo:hi]
                if state is not None
                else torch.zeros((hi - lo, self.fast_state.shape[1]), dtype=torch.float32, device=device)
            )
            self.write(in_fast, idx, part, state=True)

    def empty_cache(self) -> None:
        if self.caching:
            assert self.row_map is not None and self.slot_row is not None and self.slot_score is not None
            self.row_map.fill_(-1)
            self.slot_row.fill_(-1)
            self.slot_score.zero_()

    @torch.no_grad()
    def flush(self) -> int:
        if not self.caching:
            return 0
        assert self.slot_row is not None and self.slot_score is not None
        dirty = (self.slot_row >= 0) & ((self.slot_score & 1) == 1)
        slots = dirty.nonzero().squeeze(1)
        if slots.numel():
            self.write_back(slots, self.slot_row.index_select(0, slots))
            self.slot_score.index_copy_(0, slots, self.slot_score.index_select(0, slots) & ~1)
        self.flushed_rows += int(slots.numel())
        return int(slots.numel())

    def tier_pairs(self) -> Tuple[Tuple[torch.Tensor, torch.Tensor], ...]:
        """``(fast, slow)`` tensors of the values, then of the optimizer state."""
        return (self.fast_weights, self.slow_weights), (self.fast_state, self.slow_state)

    def write_back(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Copies cache ``slots`` (values and state) to slow-tier ``rows``."""
        rows = rows.to(self.slow_weights.device)
        for fast, slow in self.tier_pairs():
            slow.index_copy_(0, rows, fast.index_select(0, slots).to(slow.device))

    def set_optimizer_step(self, step: int) -> None:
        self.step = step

    def load_step(self, step: int) -> None:
        self.step = step
        self._opt_iter = 0  # the next update re-reads step, as a restored fbgemm TBE

    def next_optimizer_step(self) -> int:
        """Counts one update; returns the step Adam's bias correction uses (fbgemm's rule)."""
        if self._opt_iter == 0:
            self._opt_iter = self.step
        self._opt_iter += 1
        self.step += 1
        return self._opt_iter

    def lookup(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor],
        optimizer: RowOptimizer,
        check: InputCheck,
    ) -> torch.Tensor:
        anchor = torch.empty(0, device=self.spec.device, requires_grad=torch.is_grad_enabled())
        return _TieredLookup.apply(anchor, self, ids, offsets, per_sample_weights, optimizer, check)

    @abstractmethod
    def forward_lookup(
        self, ids: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor], check: InputCheck
    ) -> Lookup:
        """Checks, cache loads, pooling and stats; returns ``(out [B, dim], unique rows, inverse)``."""

    @abstractmethod
    def backward_update(
        self,
        grad_out: torch.Tensor,
        uniq: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        psw: Optional[torch.Tensor],
        opt: RowOptimizer,
    ) -> None:
        """The fused optimizer step of one lookup's rows, with that lookup's hyper-parameters ``opt``."""

    @torch.no_grad()
    def psw_grad(
        self, grad_out: torch.Tensor, uniq: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Per-sample weights' gradient: ``<grad_out[b], row(ids[i])>`` for id ``i`` of bag ``b`` (0 for the ids
        past the last offset, which no bag holds)."""
        _, bags, real = bag_lengths_and_ids(offsets, inverse.numel())
        rows = self.read(*self.locate(uniq.to(torch.int64)), state=False)
        dots = (grad_out.index_select(0, bags) * rows.index_select(0, inverse.to(torch.int64))).sum(1)
        return torch.where(real, dots, 0.0)
