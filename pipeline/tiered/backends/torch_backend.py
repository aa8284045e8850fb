"""The ``torch`` tier backend: placement, cache and optimizer rules in device-generic torch ops.

The bit-for-bit reference of the compiled kernel; its backward applies the shard's
``RowOptimizer.update``, so any row optimizer plugs in. An all-fast table (every row in the fast tier)
steps in fixed shapes (``recpipe.pipeline.tiered.fixed_shape``): no host read, so a CUDA step queues
without waiting. A layout with a host tier moves rows through the host and reads the device for it.
CACHING loads a batch's missing rows before the lookup (LFU: when their count beats the coldest slot;
LRU: always); rows left without a slot are used in the slow tier directly (fbgemm's UVM-cache
behaviour). Ids past the last offset belong to no bag (the dynamic shard moves the keys it drops
there, all-fast only). May import ``recpipe.pipeline.placement``, ``recpipe.pipeline.interfaces``,
``recpipe.pipeline.tiered.native_ops`` and ``recpipe.pipeline.tiered.fixed_shape``.
"""

from __future__ import annotations

from typing import ClassVar, Dict, FrozenSet, Optional, Union

import torch
import torch.nn.functional as F

from recpipe.pipeline.interfaces import InputCheck, RowOptimizer
from recpipe.pipeline.placement import CachePolicy
from recpipe.pipeline.tiered.backends.buffers import BufferedTier, Lookup
from recpipe.pipeline.tiered.backends.common import bag_lengths_and_ids
from recpipe.pipeline.tiered.fixed_shape import device_counts, fixed_unique, last_valid
from recpipe.pipeline.tiered.native_ops import TIERED_STATS

__all__ = ["TorchBackend"]


class TorchBackend(BufferedTier):
    """Tiers in tensors, stepped by torch ops (any device)."""

    name: ClassVar[str] = "torch"
    default_devices: ClassVar[FrozenSet[str]] = frozenset({"*"})
    calls_optimizer_update: ClassVar[bool] = True

    # The current lookup's counters: host ints or 0-d device tensors (stacked into ``stats``).
    _last: Dict[str, Union[int, torch.Tensor]]

    def forward_lookup(
        self, ids: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor], check: InputCheck
    ) -> Lookup:
        check(ids, offsets, psw)
        self.flushed_rows = 0
        self._last = dict.fromkeys(TIERED_STATS, 0)
        self._clock += 1
        ids = ids.to(torch.int64)
        offsets = offsets.to(torch.int64)
        n = ids.numel()
        self._last["lookups"] = n
        mode = self.spec.pooling
        if self.all_fast:  # fixed shapes: nothing read back from the device
            # mean as the sum over the bag size, which is what F.embedding_bag's mean computes, except that it
            # counts ids past the last offset into the last bag
            out = F.embedding_bag(
                ids, self.fast_weights, offsets, mode="sum", per_sample_weights=psw, include_last_offset=True
            )
            if mode == "mean":
                sizes = (offsets[1:] - offsets[:-1]).clamp(min=1)
                out = out / sizes.to(out.dtype).unsqueeze(1)
            uniq, inverse, _, _ = fixed_unique(ids)
            real = torch.arange(n, device=ids.device) < offsets[-1]
            lookups = real.sum()
            touched = self._touched(inverse, real, uniq.numel())
            self._last.update(unique_rows=touched.sum(), hits=lookups, fast_lookups=lookups, lookups=lookups)
        else:
            uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
            self._last["unique_rows"] = uniq.numel()
            if self.caching:
                self._prefetch(uniq, counts)
            in_fast, idx = self.locate(uniq)
            assert in_fast is not None
            fast_lookups = (counts * in_fast).sum()
            self._last["fast_lookups"] = fast_lookups
            if not self.caching:
                self._last["hits"] = fast_lookups
            rows = self.read(in_fast, idx, state=False)
            out = F.embedding_bag(inverse, rows, offsets, mode=mode, per_sample_weights=psw, include_last_offset=True)
        last = device_counts([self._last[k] for k in TIERED_STATS], self.spec.device)
        k = len(TIERED_STATS)
        self.stats[:k] = last
        self.stats[k:] += last
        return out, uniq, inverse

    @torch.no_grad()
    def backward_update(
        self,
        grad_out: torch.Tensor,
        uniq: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        psw: Optional[torch.Tensor],
        opt: RowOptimizer,
    ) -> None:
        n = inverse.numel()
        if n == 0 or offsets.numel() < 2:
            self.next_optimizer_step()
            return
        lengths, bags, real = bag_lengths_and_ids(offsets, n)
        g = grad_out.index_select(0, bags)
        if psw is not None:
            g = g * psw.unsqueeze(1)
        elif self.spec.pooling == "mean":
            g = g / lengths.clamp(min=1).to(g.dtype).index_select(0, bags).unsqueeze(1)
        g = torch.where(real.unsqueeze(1), g, 0.0)
        grad_u = torch.zeros((uniq.numel(), self.spec.embedding_dim), dtype=g.dtype, device=g.device)
        grad_u.index_add_(0, inverse, g)
        step = self.next_optimizer_step()
        # re-resolve: a later forward may have moved rows since this batch's lookup
        in_fast, idx = self.locate(uniq)
        w = self.read(in_fast, idx, state=False)
        s = self.read(in_fast, idx, state=True)
        w_old, s_old = w.clone(), s.clone()
        opt.update(w, s, grad_u, step)
        # rows no id of a bag reached (padding of the fixed-shape dedupe, or only past the last offset) keep
        # their values; the dedupe's padding then takes its last row's result, so repeated targets write alike
        touched = self._touched(inverse, real, uniq.numel()).unsqueeze(1)
        valid = torch.arange(uniq.numel(), device=uniq.device) <= inverse.max()
        w = last_valid(torch.where(touched, w, w_old), valid)
        s = last_valid(torch.where(touched, s, s_old), valid)
        self.write(in_fast, idx, w, state=False)
        self.write(in_fast, idx, s, state=True)
        if self.caching and in_fast is not None:
            assert self.slot_score is not None
            slots = idx[in_fast]
            self.slot_score.index_copy_(0, slots, self.slot_score.index_select(0, slots) | 1)

    @staticmethod
    def _touched(inverse: torch.Tensor, real: torch.Tensor, rows: int) -> torch.Tensor:
        """Which of the ``rows`` unique rows an id of a bag (``real``) reaches."""
        hits = torch.zeros(rows, dtype=torch.int64, device=inverse.device)
        return hits.index_add_(0, inverse, real.to(torch.int64)) > 0

    def _prefetch(self, uniq: torch.Tensor, counts: torch.Tensor) -> None:
        """Loads the batch's missing rows into slots it does not use; updates counts / recency."""
        assert self.row_map is not None and self.slot_row is not None and self.slot_score is not None
        lfu = self.spec.cache_policy is CachePolicy.LFU
        rm = self.row_map.index_select(0, uniq)
        cached = rm >= 0
        hit_slots = rm[cached]
        if lfu:
            self.slot_score.index_add_(0, hit_slots, counts[cached] << 1)
        else:
            dirty = self.slot_score.index_select(0, hit_slots) & 1
            self.slot_score.index_copy_(0, hit_slots, (self._clock << 1) | dirty)
        miss_mask = ~cached
        misses = uniq[miss_mask]
        self._last["hits"] = (counts * cached).sum()  # no mask indexing: no host sync
        if misses.numel() == 0:
            return
        miss_key = (-rm[miss_mask] - 1) + counts[miss_mask] if lfu else torch.full_like(misses, self._clock)
        if self.cache_slots == 0:
            if lfu:
                self.row_map.index_copy_(0, misses, -(miss_key + 1))
            return
        # victims: free slots first, then slots unused by this batch, coldest first
        usable = torch.ones(self.cache_slots, dtype=torch.bool, device=self.spec.device)
        usable[hit_slots] = False
        v_slots = usable.nonzero().squeeze(1)
        v_rows = self.slot_row.index_select(0, v_slots)
        v_key = torch.where(v_rows >= 0, self.slot_score.index_select(0, v_slots) >> 1, -1)
        v_sel = torch.argsort(v_key, stable=True)
        m_sel = torch.argsort(miss_key, descending=True, stable=True)
        n = min(v_slots.numel(), misses.numel())
        v_sel, m_sel = v_sel[:n], m_sel[:n]
        if lfu:
            admit = miss_key.index_select(0, m_sel) > v_key.index_select(0, v_sel)
            n = int(admit.sum().item())  # a prefix: miss keys descend, victim keys ascend
            v_sel, m_sel = v_sel[:n], m_sel[:n]
            # misses that stay in the slow tier keep their access count
            self.row_map.index_copy_(0, misses, -(miss_key + 1))
        if n:
            self._load_slots(
                v_slots.index_select(0, v_sel),
                v_rows.index_select(0, v_sel),
                misses.index_select(0, m_sel),
                miss_key.index_select(0, m_sel),
                lfu,
            )

    def _load_slots(
        self, slots: torch.Tensor, old_rows: torch.Tensor, new_rows: torch.Tensor, new_key: torch.Tensor, lfu: bool
    ) -> None:
        """Evicts ``old_rows`` from ``slots`` (writing dirty ones back) and loads ``new_rows`` keyed ``new_key``."""
        assert self.row_map is not None and self.slot_row is not None and self.slot_score is not None
        old_score = self.slot_score.index_select(0, slots)
        occupied = old_rows >= 0
        wb = occupied & ((old_score & 1) == 1)
        wb_rows = old_rows[wb]
        if wb_rows.numel():
            self.write_back(slots[wb], wb_rows)
        ev_rows = old_rows[occupied]
        if ev_rows.numel():
            self.row_map.index_copy_(
                0, ev_rows, -((old_score[occupied] >> 1) + 1) if lfu else torch.full_like(ev_rows, -1)
            )
        src = new_rows.to(self.slow_weights.device)
        for fast, slow in self.tier_pairs():
            fast.index_copy_(0, slots, slow.index_select(0, src).to(self.spec.device))
        self.row_map.index_copy_(0, new_rows, slots)
        self.slot_row.index_copy_(0, slots, new_rows)
        self.slot_score.index_copy_(0, slots, new_key << 1)
        self._last["rows_loaded"] = int(slots.numel())
        self._last["rows_evicted"] = ev_rows.numel()
        self._last["rows_written_back"] = wb_rows.numel()
