"""The ``fbgemm`` tier backend: a shard's rows in fbgemm's TBE (``SplitTableBatchedEmbeddingBagsCodegen``).

:class:`FbgemmTier` runs a lookup with no host sync: HYBRID keeps each row's hashed position in a
device map and partitions each bag's ids between the two tables on the device; ``mean`` divides
fbgemm's SUM by the bag lengths; statistics are device ops (CACHING: ``lxu_cache_lookup`` before,
``lxu_cache_locations`` / ``lxu_cache_state`` changes after). :class:`FbgemmBackend` is the
``TierBackend`` over it. May import ``recpipe.pipeline.placement``, ``.types``, ``.tiered.fbgemm``,
``.tiered.ops`` and ``.tiered.optim``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, FrozenSet, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from recpipe.pipeline.interfaces import InputCheck, RowOptimizer, TierBackend, TierSpec, TierTensors
from recpipe.pipeline.placement import FusedOptimizerKind, dtype_itemsize
from recpipe.pipeline.tiered.backends.common import check_psw_pooling, new_stats, split_hash, split_tier
from recpipe.pipeline.tiered.native_ops import TIERED_STATS
from recpipe.pipeline.tiered.optim import TieredOptimizerConfig
from recpipe.pipeline.tiered.tbe_tables import (
    FbgemmTierPlan,
    Layout,
    TbeCounters,
    fbgemm_tbe_kwargs,
    plan_fbgemm_tier,
    tbe_counters,
    undo_tbe_lookup,
)

__all__ = ["FbgemmBackend", "FbgemmTier"]

# TBE buffers per tier (the names fbgemm registers; absent or empty ones count 0 bytes).
_FAST_BUFFERS: Tuple[str, ...] = ("weights_dev", "momentum1_dev", "momentum2_dev")
_CACHE_BUFFERS: Tuple[str, ...] = ("lxu_cache_weights", "lxu_cache_state", "lxu_state", "cache_index_table_map")
_SLOW_BUFFERS: Tuple[str, ...] = (
    "weights_uvm",
    "momentum1_uvm",
    "momentum2_uvm",
    "weights_host",
    "momentum1_host",
    "momentum2_host",
)


class FbgemmTier(nn.Module):
    """The rows of one shard in an fbgemm TBE of ``plan`` on ``device``, with device-side statistics:
    every lookup updates the shard's int64 counters ``stats`` in place. ``split_pos`` (HYBRID only)
    is the hashed position of every local row."""

    def __init__(
        self,
        plan: FbgemmTierPlan,
        *,
        split_pos: Optional[torch.Tensor],
        pooling: str,
        device: torch.device,
        stats: torch.Tensor,
    ) -> None:
        super().__init__()
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

        self.plan = plan
        self.pooling = pooling
        self.device = device
        self._stats = stats
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(**fbgemm_tbe_kwargs(plan, device))
        self._has_cache: bool = self.tbe.lxu_cache_weights.numel() > 0
        self._two_tables = len(plan.tables) == 2
        # HYBRID: the hashed positions on the device (computing them there would sync on CUDA)
        self.split_pos: Optional[torch.Tensor] = None
        if split_pos is not None:
            self.split_pos = split_pos.to(torch.int32 if plan.num_rows < 2**31 else torch.int64).to(device)
        self.step = 0  # SGD steps (fbgemm counts only the other optimizers' steps)
        self._step_sets = 0  # set_step() calls: a lookup's counters set since are not taken back

    def locate(self, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(table, index)`` (int64) of local rows."""
        if self.split_pos is None:
            return torch.zeros_like(rows), rows
        pos = self.split_pos.index_select(0, rows).to(torch.int64)
        in_fast, idx = split_tier(pos, self.plan.fast_rows)
        if not self._two_tables:
            return torch.zeros_like(rows), idx
        return (~in_fast).to(torch.int64), idx

    def _states(self) -> List[List[torch.Tensor]]:
        """Per table: ``[weights [rows, D], state [rows] or [rows, D] ...]`` (views)."""
        weights = self.tbe.split_embedding_weights()
        states = self.tbe.split_optimizer_states() if self.plan.optimizer is not FusedOptimizerKind.SGD else []
        return [[weights[t]] + (list(states[t]) if states else []) for t in range(len(self.plan.tables))]

    def _table_rows(
        self, rows: Optional[torch.Tensor] = None
    ) -> Iterator[Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]]:
        """Per table: positions in ``rows`` (None: all) of the rows it holds, their index, its views."""
        if rows is None:
            rows = torch.arange(self.plan.num_rows, dtype=torch.int64, device=self.device)
        table, idx = self.locate(rows)
        for t, parts in enumerate(self._states()):
            sel = (table == t).nonzero().squeeze(1)
            yield sel, idx.index_select(0, sel), parts

    @torch.no_grad()
    def read_rows(self, state_cols: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every row's value and fp32 state in recpipe's layout, local-id order (reads the UVM
        store: the caller flushes first)."""
        R, D = self.plan.num_rows, self.plan.embedding_dim
        w = torch.empty((R, D), dtype=torch.float32, device=self.device)
        s = torch.empty((R, state_cols), dtype=torch.float32, device=self.device)
        for sel, src, parts in self._table_rows():
            w.index_copy_(0, sel, parts[0].index_select(0, src).to(torch.float32))
            if state_cols:
                cols = [p.index_select(0, src).reshape(src.numel(), -1).to(torch.float32) for p in parts[1:]]
                s.index_copy_(0, sel, torch.cat(cols, dim=1))
        return w, s

    @torch.no_grad()
    def write_rows(
        self, weights: torch.Tensor, state: Optional[torch.Tensor], rows: Optional[torch.Tensor] = None
    ) -> None:
        """Sets local ``rows``' (None: all) values and state (None: zeros); empties the cache
        without writing it back (a caller setting only some rows flushes first)."""
        weights = weights.to(self.device)
        if state is not None:
            state = state.to(self.device)
        if rows is not None:
            rows = rows.to(self.device)
        for sel, dst, parts in self._table_rows(rows):
            parts[0].index_copy_(0, dst, weights.index_select(0, sel).to(parts[0].dtype))
            table_state = state.index_select(0, sel) if state is not None else None
            col = 0
            for p in parts[1:]:
                width = 1 if p.dim() == 1 else p.shape[1]
                if table_state is None:
                    p.index_fill_(0, dst, 0)
                else:
                    v = table_state[:, col : col + width]
                    p.index_copy_(0, dst, v.reshape((-1,) + tuple(p.shape[1:])).to(p.dtype))
                col += width
        self.tbe.reset_cache_states()

    @torch.no_grad()
    def flush(self) -> int:
        """Writes the HBM cache back; returns every occupied slot (fbgemm keeps no dirty bit)."""
        if not self._has_cache:
            return 0
        n = int((self.tbe.lxu_cache_state >= 0).sum())
        self.tbe.flush()
        return n

    def get_step(self) -> int:
        """The recorded step: fbgemm's ``iter`` (a device read on CUDA), or recpipe's for SGD."""
        if self.plan.optimizer is FusedOptimizerKind.SGD:
            return self.step
        return int(self.tbe.iter.item())

    @torch.no_grad()
    def set_optimizer_step(self, step: int) -> None:
        """fbgemm's ``set_optimizer_step``, and this tier's SGD step count."""
        self.tbe.set_optimizer_step(step)
        self.step = step

    @torch.no_grad()
    def set_step(self, step: int) -> None:
        """Sets the step of loaded rows: ``iter``, with ``iter_cpu`` reset to 0 so the next update
        re-reads it, as after fbgemm's own checkpoint load."""
        self.step = step
        self._step_sets += 1
        self.tbe.iter.fill_(step)
        self.tbe.iter_cpu.fill_(0)

    def lookup_counters(self) -> Tuple[int, int, TbeCounters]:
        """``(SGD step, set_step count, tbe_counters)``: host values, no device sync."""
        return self.step, self._step_sets, tbe_counters(self.tbe)

    def undo_lookup(self, before: Tuple[int, int, TbeCounters], after: Tuple[int, int, TbeCounters]) -> None:
        """Takes back one discarded lookup's counters; a :meth:`set_step` since keeps the step counts."""
        step_before, _, tbe_before = before
        step_after, sets_after, tbe_after = after
        if self._step_sets == sets_after:
            self.step -= step_after - step_before
            undo_tbe_lookup(self.tbe, tbe_before, tbe_after)
        else:  # only fbgemm's own lookup count survived the set
            undo_tbe_lookup(self.tbe, tbe_before, (tbe_after[0], None))

    def tier_tensors(self) -> Dict[str, List[Tuple[str, torch.Tensor]]]:
        """The TBE's row and cache buffers per tier (a ``cpu`` plan's HOST buffers are slow)."""

        def held(names: Tuple[str, ...], rows: bool) -> List[Tuple[str, torch.Tensor]]:
            out = []
            for name in names:
                t = getattr(self.tbe, name, None)
                # fbgemm registers unused optimizer-state buffers as 1-element int64 placeholders
                if isinstance(t, torch.Tensor) and t.numel() and (t.is_floating_point() or not rows):
                    out.append((name, t))
            return out

        fast = held(_FAST_BUFFERS, True) + (held(_CACHE_BUFFERS, False) if self._has_cache else [])
        if self.split_pos is not None:
            fast.append(("split_pos", self.split_pos))
        return {"fast": fast, "slow": held(_SLOW_BUFFERS, True)}

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor]) -> torch.Tensor:
        """Pooled lookup of local ids; fbgemm's backward applies the fused optimizer."""
        R, D, k = self.plan.num_rows, self.plan.embedding_dim, self.plan.fast_rows
        ids = ids.to(torch.int64)
        offsets = offsets.to(torch.int64)
        n = ids.numel()
        B = offsets.numel() - 1
        if n:
            torch._assert_async(
                ((ids >= 0) & (ids < R)).all(), f"tiered table: local ids outside [0, {R}) (route global ids first)"
            )
        if torch.is_grad_enabled():
            self.step += 1
        lengths = offsets[1:] - offsets[:-1]
        with torch.no_grad():
            uniq = ids.sort().values
            unique_rows = (uniq[1:] != uniq[:-1]).sum() + (1 if n else 0)
        hits = fast = loaded = evicted = ids.new_zeros(())
        if self.split_pos is not None:
            pos = self.split_pos.index_select(0, ids).to(torch.int64)
            in_fast, idx = split_tier(pos, k)
            with torch.no_grad():
                hits = fast = in_fast.sum()
            if self._two_tables:
                perm = torch.argsort((~in_fast).to(torch.int32), stable=True)
                idx = idx.index_select(0, perm)
                bag = torch.searchsorted(offsets, torch.arange(n, device=ids.device), right=True) - 1
                fast_per_bag = torch.zeros(B, dtype=torch.int64, device=ids.device).index_add_(
                    0, bag, in_fast.to(torch.int64)
                )
                counts = torch.cat([fast_per_bag, lengths - fast_per_bag])
                tbe_offsets = torch.cat([offsets.new_zeros(1), counts.cumsum(0)])
                w = psw.index_select(0, perm) if psw is not None else None
                both = self.tbe(idx, tbe_offsets, w)  # [B, 2D]: fast-tier bags, then slow-tier bags
                out = both[:, :D] + both[:, D:]
            else:
                out = self.tbe(idx, offsets, psw)  # the slow table alone: k == 0, idx == pos
        elif self._has_cache:
            with torch.no_grad():
                lin = torch.ops.fbgemm.linearize_cache_indices(self.tbe.cache_hash_size_cumsum, ids, offsets)
                before = torch.ops.fbgemm.lxu_cache_lookup(
                    lin, self.tbe.lxu_cache_state, self.tbe.total_cache_hash_size
                )
                hits = (before >= 0).sum()
                state_before = self.tbe.lxu_cache_state.clone()
            out = self.tbe(ids, offsets, psw)
            with torch.no_grad():
                fast = (self.tbe.lxu_cache_locations >= 0).sum()
                changed = self.tbe.lxu_cache_state != state_before
                loaded = changed.sum()
                evicted = (changed & (state_before >= 0)).sum()
        else:
            out = self.tbe(ids, offsets, psw)
            if self.plan.layout is Layout.ALL_FAST:
                hits = fast = ids.new_full((), n)
        if self.pooling == "mean":
            out = out / lengths.clamp(min=1).to(out.dtype).unsqueeze(1)
        with torch.no_grad():
            last = torch.stack([ids.new_full((), n), unique_rows, hits, fast, loaded, evicted, evicted])
            K = len(TIERED_STATS)
            self._stats[:K].copy_(last)
            self._stats[K:].add_(last)
        return out


class FbgemmBackend(TierBackend):
    """A shard's tiers in fbgemm's TBE (:class:`FbgemmTier`; none for a shard without rows).

    ``embedding_dim`` must be a multiple of 4, checked on every rank (also one without rows,
    so no rank goes on while another refuses the table).
    """

    name: ClassVar[str] = "fbgemm"
    default_devices: ClassVar[FrozenSet[str]] = frozenset({"cuda"})

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend 'fbgemm' runs on cpu or cuda, not {device}: use backend='torch'.")

    def __init__(self, spec: TierSpec) -> None:
        if spec.embedding_dim % 4:
            raise ValueError(
                f"tiered table {spec.table_name!r}: embedding_dim={spec.embedding_dim} is not a multiple of 4, "
                "which fbgemm's TBE (backend 'fbgemm') needs, as torchrec's FUSED tables do. Possible solutions:\n"
                "  1. use a dim that is a multiple of 4 in the table's config;\n"
                "  2. run the table on another backend: backend='native' on CPU (the tiered sharders' backend= "
                "argument), or 'torch' on other devices."
            )
        if not isinstance(spec.optimizer, TieredOptimizerConfig):
            raise ValueError(
                f"tiered table {spec.table_name!r}: backend 'fbgemm' runs fbgemm's own optimizers and takes a "
                f"TieredOptimizerConfig, got {type(spec.optimizer).__name__}; use backend='torch', which applies "
                "RowOptimizer.update."
            )
        self.spec = spec
        self.stats = new_stats(spec.device)
        self.step = 0
        self._step_sets: int = 0  # load_step() calls, for undo_lookup of a shard without rows
        self.flushed_rows = 0
        # Not a submodule of the shard: the TBE's tensors must not appear in its state_dict()
        # (the shard exports its rows itself) nor in parameters() (fbgemm updates them in backward).
        self.fbgemm: Optional[FbgemmTier] = None
        R = spec.num_rows
        if R > 0:
            plan = plan_fbgemm_tier(
                num_rows=R,
                embedding_dim=spec.embedding_dim,
                mode=spec.mode,
                cache_load_factor=spec.cache_load_factor,
                cache_policy=spec.cache_policy,
                optimizer=spec.optimizer,  # a TieredOptimizerConfig (checked above)
                compute_device=spec.device.type,
            )
            split_pos = split_hash(torch.arange(R, dtype=torch.int64), R, spec.split_seed) if plan.split_map else None
            self.fbgemm = FbgemmTier(
                plan, split_pos=split_pos, pooling=spec.pooling, device=spec.device, stats=self.stats
            )

    @property
    def moved_row_bytes(self) -> int:
        """Values only: fbgemm's cache holds no optimizer state (it stays in UVM)."""
        return self.spec.embedding_dim * dtype_itemsize(self.spec.dtype)

    def tier_tensors(self) -> TierTensors:
        tiers = self.fbgemm.tier_tensors() if self.fbgemm is not None else {"fast": [], "slow": []}
        return {"fast": tiers["fast"], "slow": tiers["slow"], "counters": [("stats", self.stats)]}

    def lookup(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor],
        optimizer: RowOptimizer,
        check: InputCheck,
    ) -> torch.Tensor:
        """fbgemm's lookup; no host sync on CUDA (on CPU the host checks run too, for their errors)."""
        if self.spec.device.type == "cpu":
            check(ids, offsets, per_sample_weights)
        check_psw_pooling(self.spec.pooling, per_sample_weights)
        self.flushed_rows = 0
        if self.fbgemm is None:
            return self._empty_lookup(offsets, optimizer)
        out = self.fbgemm(ids, offsets, per_sample_weights)
        self.step = self.fbgemm.step  # training lookups; export_step reads fbgemm's own counter
        return out

    def _empty_lookup(self, offsets: torch.Tensor, optimizer: RowOptimizer) -> torch.Tensor:
        """A lookup of a shard without rows (only empty bags): zeros."""
        # counted as the table's other shards' TBEs count, so every rank exports the same step
        if torch.is_grad_enabled() or optimizer.name != FusedOptimizerKind.SGD.value:
            self.step += 1
        self.stats[: len(TIERED_STATS)].zero_()
        # requires grad so this rank's backward joins the output dist's backward collective
        return torch.zeros(
            (offsets.numel() - 1, self.spec.embedding_dim),
            dtype=self.spec.dtype,
            device=self.spec.device,
            requires_grad=torch.is_grad_enabled(),
        )

    def read_rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.fbgemm is not None:
            return self.fbgemm.read_rows(self.spec.state_cols)
        return (
            torch.empty((0, self.spec.embedding_dim), dtype=self.spec.dtype),
            torch.empty((0, self.spec.state_cols), dtype=torch.float32),
        )

    def write_rows(
        self, weights: torch.Tensor, state: Optional[torch.Tensor], rows: Optional[torch.Tensor] = None
    ) -> None:
        """Writes the rows at once and empties fbgemm's cache."""
        if self.fbgemm is not None:
            self.fbgemm.write_rows(weights, state, rows)

    def empty_cache(self) -> None:
        if self.fbgemm is not None:
            self.fbgemm.tbe.reset_cache_states()

    def flush(self) -> int:
        if self.fbgemm is None:
            return 0
        n = self.fbgemm.flush()
        self.flushed_rows += n
        return n

    def set_optimizer_step(self, step: int) -> None:
        self.step = step
        if self.fbgemm is not None:
            self.fbgemm.set_optimizer_step(step)

    def load_step(self, step: int) -> None:
        self.step = step
        self._step_sets += 1  # undo_lookup of a shard without rows keeps a step set since the lookup
        if self.fbgemm is not None:
            self.fbgemm.set_step(step)

    def export_step(self) -> int:
        """fbgemm's recorded step (:meth:`FbgemmTier.get_step`)."""
        if self.fbgemm is not None:
            self.step = self.fbgemm.get_step()
        return self.step

    def set_learning_rate(self, lr: float) -> None:
        if self.fbgemm is not None:
            self.fbgemm.tbe.set_learning_rate(lr)

    def update_hyper_parameters(self, params: Mapping[str, float]) -> None:
        if self.fbgemm is not None:
            self.fbgemm.tbe.update_hyper_parameters(dict(params))

    def lookup_counters(self) -> Any:
        """fbgemm counts optimizer steps in the lookup; a shard without rows counts its ``step`` alike."""
        if self.fbgemm is not None:
            return self.fbgemm.lookup_counters()
        return self.step, self._step_sets

    def undo_lookup(self, before: Optional[Any], after: Optional[Any]) -> None:
        if before is None or after is None:
            return
        if self.fbgemm is None:  # a shard without rows: its own count, unless a load set the step since
            if self._step_sets == after[1]:
                self.step -= after[0] - before[0]
            return
        self.fbgemm.undo_lookup(before, after)
        self.step = self.fbgemm.step  # as lookup() sets it
