"""One shard of a dynamic table: a key index in front of a tiered shard of slots.

Raw int64 keys map to local slots through :class:`~recpipe.pipeline.tiered.dynamic.key_index.DynamicKeyIndex`;
the slots' rows live in the tiered storage this class extends (``TieredEmbeddingShard`` over the slots,
so HYBRID / CACHING, the fused optimizers and the backends apply unchanged). A training lookup inserts
missing keys (after admission) and initializes their rows from ``(seed, table, key)`` with zeroed
optimizer state; an eval lookup (``model.eval()`` or no grad) inserts nothing, and a key without a row
pools as nothing. Imports ``recpipe.pipeline.placement``, ``recpipe.pipeline.tiered`` and this package.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from recpipe.pipeline.interfaces import RowOptimizer
from recpipe.pipeline.placement import (
    CachePolicy,
    DynamicTableOptions,
    Mode,
    dynamic_counter_slots,
    dynamic_local_slots,
)
from recpipe.pipeline.routing.ops import route_ids
from recpipe.pipeline.tiered.backends.buffers import BufferedTier
from recpipe.pipeline.tiered.backends.common import check_psw_pooling
from recpipe.pipeline.tiered.dynamic.dynamic_state import (
    DYNAMIC_STATE_FIELDS,
    dynamic_state_entries,
    load_dynamic_entries,
)
from recpipe.pipeline.tiered.dynamic.key_hashing import init_rows, init_salt
from recpipe.pipeline.tiered.dynamic.key_index import (
    DYNAMIC_COUNTERS,
    DynamicKeyIndex,
    HashPlan,
    IndexJournal,
    KeyUnique,
)
from recpipe.pipeline.tiered.dynamic.native_plan import native_hash_plan, native_unique
from recpipe.pipeline.tiered.dynamic.plan import torch_hash_plan
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard
from recpipe.pipeline.tiered.shard_routing import WholeTableRouting
from recpipe.pipeline.tiered.state import TieredShardState

__all__ = ["DynamicEmbeddingShard", "DynamicRows"]

#: What one lookup overwrote: ``(index journal, slots, their old values, their old state)``.
_LookupUndo = Tuple[IndexJournal, torch.Tensor, torch.Tensor, torch.Tensor]
DynamicRows = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _index_kernels(backend: str) -> Tuple[HashPlan, Optional[KeyUnique]]:
    """The index's plan and exact deduplication: the compiled CPU kernels on the ``native`` backend; else torch
    ops in fixed shapes (no exact dedupe: ``DynamicKeyIndex`` pads it)."""
    return (native_hash_plan, native_unique) if backend == "native" else (torch_hash_plan, None)


class DynamicEmbeddingShard(TieredEmbeddingShard):
    """A dynamic table's shard: raw int64 keys in, pooled rows out; rows inserted, evicted and scored
    per ``options`` (``docs/dynamic.md``).

    Args:
        num_embeddings (int): the table config's rows (the default capacity and the uniform init range).
        embedding_dim (int): row width.
        options (DynamicTableOptions): capacity, eviction, admission, initializer, on_full, seed.
        shards (int): shards the capacity is split over (world size row-wise, 1 table-wise).
        key_rank (int): this shard's rank among them (the keys it owns: ``hash_roundrobin`` raw-key routing).
        key_routing_seed (int): the seed of that routing (the table's placement seed).
        mode, cache_load_factor, optimizer, pooling, cache_policy, dtype, device, table_name, backend,
            split_seed: as ``TieredEmbeddingShard``, over the shard's slots. ``backend`` must keep rows in
            buffers (``native``, ``torch``).

    Raises:
        ValueError: a bad argument, named with the fix.
    """

    def __init__(
        self,
        *,
        num_embeddings: int,
        embedding_dim: int,
        options: DynamicTableOptions,
        shards: int = 1,
        key_rank: int = 0,
        key_routing_seed: int = 0,
        mode: Union[Mode, str] = Mode.HYBRID,
        cache_load_factor: float = 1.0,
        optimizer: Optional[RowOptimizer] = None,
        pooling: str = "sum",
        cache_policy: Union[CachePolicy, str] = CachePolicy.LFU,
        split_seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: Optional[Union[torch.device, str]] = None,
        table_name: str = "table",
        backend: Optional[str] = None,
    ) -> None:
        if not isinstance(options, DynamicTableOptions):
            raise ValueError(
                f"dynamic table {table_name!r}: options must be a recpipe.pipeline.DynamicTableOptions, got "
                f"{type(options).__name__}."
            )
        if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int) or num_embeddings <= 0:
            raise ValueError(
                f"dynamic table {table_name!r}: num_embeddings must be a positive int, got {num_embeddings!r}."
            )
        slots = dynamic_local_slots(options.table_capacity(num_embeddings), shards)
        self._index_ready = False
        super().__init__(
            num_embeddings=slots,
            embedding_dim=embedding_dim,
            mode=mode,
            cache_load_factor=cache_load_factor,
            optimizer=optimizer,
            pooling=pooling,
            cache_policy=cache_policy,
            split_seed=split_seed,
            dtype=dtype,
            device=device,
            table_name=table_name,
            backend=backend,
            routing=WholeTableRouting(slots),
        )
        if not isinstance(self.tiers, BufferedTier):
            raise ValueError(
                f"dynamic table {table_name!r}: backend {self.backend!r} does not keep its rows in buffers a key "
                "index can re-initialize; use backend='native' (CPU) or 'torch' (any device, CUDA included)."
            )
        self.options: DynamicTableOptions = options
        self.table_num_embeddings: int = num_embeddings
        self.key_shards: int = shards
        self.key_rank: int = key_rank
        self.key_routing_seed: int = key_routing_seed
        self.init_bounds: Tuple[float, float] = options.initializer.bounds(num_embeddings)
        self._init_salt: int = init_salt(options.seed, table_name)
        plan, unique = _index_kernels(self.backend)
        self.index: DynamicKeyIndex = DynamicKeyIndex(
            slots,
            options,
            table_name,
            self.device,
            plan,
            unique,
            counter_slots=dynamic_counter_slots(options, num_embeddings, shards),
        )
        self._index_ready = True
        # the torch backend over an all-fast layout steps in fixed shapes end to end: no host read per lookup
        self._fixed_lookup: bool = self.backend == "torch" and self.tiers.all_fast
        # the last training lookup's undo record and its sequence number (lookup_counters / undo_lookup)
        self._lookups: int = 0
        self._last_undo: Optional[_LookupUndo] = None
        self._journal_next: bool = False

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Drops every key (rows are initialized when keys arrive)."""
        if getattr(self, "_index_ready", False):
            self.index.clear()
            self._last_undo = None
        self.write_local_rows(
            torch.zeros((self.num_rows, self.embedding_dim), dtype=self.dtype, device=self.device), None, True
        )

    def owned(self, keys: torch.Tensor) -> torch.Tensor:
        """Which of ``keys`` this shard holds: every key table-wise, else those the raw-key ``hash_roundrobin``
        routing sends to ``key_rank`` (what a load re-routes saved keys by)."""
        keys = keys.to(torch.int64)
        if self.key_shards == 1:
            return torch.ones_like(keys, dtype=torch.bool)
        owner, _ = route_ids(keys.cpu(), 0, self.key_shards, "hash_roundrobin", self.key_routing_seed)
        return (owner == self.key_rank).to(keys.device)

    def set_custom_score(self, score: int) -> None:
        """The score ``eviction='custom'`` gives the keys of the following training lookups."""
        if isinstance(score, bool) or not isinstance(score, int) or not -(2**63) <= score < 2**63:
            raise ValueError(f"dynamic table {self.table_name!r}: score must be an int64, got {score!r}.")
        self.index.custom_score = score

    def forward(
        self, ids: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Pooled ``[B, embedding_dim]`` lookup of raw keys ``ids`` (``B + 1`` offsets)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"dynamic table {self.table_name!r}: ids must be a 1-D int32/int64 tensor of raw keys, got "
                f"{getattr(ids, 'dtype', type(ids).__name__)}."
            )
        keys = ids.to(torch.int64)
        complete = False
        if self.training and torch.is_grad_enabled():
            slots, complete = self._insert(keys)
        else:
            slots = self.index.find(keys)
        if self._fixed_lookup:
            return self._lookup_fixed(slots, offsets, per_sample_weights)
        valid = slots >= 0
        if not complete and slots.numel() and not bool(valid.all()):
            slots, offsets, per_sample_weights = self._drop_missing(slots, valid, offsets, per_sample_weights)
        return super().forward(slots, offsets, per_sample_weights)

    def _lookup_fixed(self, slots: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor]) -> torch.Tensor:
        """The lookup in fixed shapes: keys without a row move past the last offset, where no bag holds them,
        and the offsets count the kept ones; the checks of values run on the device (``torch._assert_async``)."""
        if (
            not isinstance(offsets, torch.Tensor)
            or offsets.dim() != 1
            or offsets.numel() < 1
            or offsets.dtype not in (torch.int32, torch.int64)
        ):
            raise ValueError(
                f"dynamic table {self.table_name!r}: offsets must be a 1-D int tensor of B + 1 bag offsets "
                f"(include_last_offset), got {getattr(offsets, 'dtype', type(offsets).__name__)} of shape "
                f"{list(getattr(offsets, 'shape', []))}."
            )
        if psw is not None:
            psw = psw.float()  # as fbgemm's TBE (autograd sees the cast)
        n = slots.numel()
        offsets = offsets.to(torch.int64)
        ordered = (offsets[0] == 0) & (offsets[-1] == n) & (offsets[1:] >= offsets[:-1]).all()
        torch._assert_async(
            ordered,
            f"dynamic table {self.table_name!r}: offsets must start at 0, be non-decreasing and end at len(ids)={n}.",
        )
        if n:
            valid = slots >= 0
            order = torch.argsort((~valid).to(torch.int8), stable=True)  # kept keys first, in order
            kept = valid.sum()
            moved = slots.index_select(0, order)
            slots = torch.where(torch.arange(n, device=slots.device) < kept, moved, moved[:1].clamp(min=0))
            offsets = torch.cat([offsets.new_zeros(1), valid.to(torch.int64).cumsum(0)]).index_select(0, offsets)
            psw = psw.index_select(0, order) if psw is not None else None
        return self.tiers.lookup(slots, offsets, psw, self.optimizer, self._check_slot_lookup)

    def _check_slot_lookup(self, ids: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor]) -> None:
        """Host checks of a fixed-shape lookup (its slots are the index's, in range by construction)."""
        check_psw_pooling(self.pooling, psw)
        if psw is not None and psw.shape != ids.shape:
            raise ValueError(
                f"dynamic table {self.table_name!r}: per_sample_weights must have the shape of ids "
                f"{list(ids.shape)}, got {list(psw.shape)}."
            )

    @torch.no_grad()
    def _insert(self, keys: torch.Tensor) -> Tuple[torch.Tensor, bool]:
        """A training lookup's slots and whether every key got one (known without a device read); new keys'
        rows initialized. What it overwrites is kept for
        :meth:`undo_lookup` when :meth:`lookup_counters` was read since the last lookup (the fused pipeline
        reads it before every lookup it may take back); other lookups skip that copy."""
        journal, self._journal_next = self._journal_next, False
        res = self.index.find_or_insert(keys, step=self.tiers.step, journal=journal)
        tiers = self.tiers
        assert isinstance(tiers, BufferedTier)
        self._lookups += 1
        self._last_undo = None
        if res.journal is not None:
            where = tiers.locate(res.new_slots)
            self._last_undo = (
                res.journal,
                res.new_slots,
                tiers.read(*where, state=False),
                tiers.read(*where, state=True),
            )
        if res.new_slots.numel():
            rows = init_rows(
                res.new_keys,
                self.embedding_dim,
                self.options.initializer,
                self.init_bounds,
                self._init_salt,
                self.dtype,
            )
            zeros = torch.zeros((res.new_slots.numel(), self.state_cols), dtype=torch.float32, device=self.device)
            self._write_slots(res.new_slots, rows, zeros, res.live)
        return res.slots, res.complete

    def _write_slots(
        self, slots: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, live: Optional[torch.Tensor] = None
    ) -> None:
        """Sets slot rows in whichever tier holds them; a cached slot's slow copy too (it may be clean).
        ``live`` (a fixed-shape selection's, ``LookupSlots.live``): where False, every write rewrites what the
        slot holds."""
        tiers = self.tiers
        assert isinstance(tiers, BufferedTier)
        in_fast, idx = tiers.locate(slots)
        for values, is_state in ((weights, False), (state, True)):
            if live is not None:
                values = torch.where(live, values, tiers.read(in_fast, idx, state=is_state))
            tiers.write(in_fast, idx, values, state=is_state)
        if tiers.caching:
            cpu = slots.to(tiers.slow_weights.device)
            for slow, values in ((tiers.slow_weights, weights), (tiers.slow_state, state)):
                values = values.to(slow.device)
                if live is not None:
                    values = torch.where(live.to(slow.device), values, slow.index_select(0, cpu))
                slow.index_copy_(0, cpu, values)

    @staticmethod
    def _drop_missing(
        slots: torch.Tensor, valid: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Leaves keys without a row out of their bags (they pool as nothing)."""
        offsets = offsets.to(torch.int64)
        kept = torch.cat([valid.new_zeros(1, dtype=torch.int64), valid.to(torch.int64).cumsum(0)])
        return slots[valid], kept.index_select(0, offsets), (psw[valid] if psw is not None else None)

    def lookup_counters(self) -> Optional[Any]:
        """``(training lookups so far, the tiers' counters)``: a discarded lookup is taken back by :meth:`undo_lookup`."""
        self._journal_next = True  # the next lookup may be taken back: keep what it overwrites
        return (self._lookups, super().lookup_counters())

    @torch.no_grad()
    def undo_lookup(self, before: Optional[Any], after: Optional[Any]) -> None:
        """Takes back the last training lookup (its inserts, evictions, scores and new rows).

        Raises:
            RuntimeError: a later lookup ran since (only the last one can be taken back), or the lookup was not
                preceded by :meth:`lookup_counters` (it kept no undo record).
        """
        assert isinstance(before, tuple) and isinstance(after, tuple)
        super().undo_lookup(before[1], after[1])
        if before[0] == after[0]:
            return
        if after[0] != self._lookups or after[0] != before[0] + 1:
            raise RuntimeError(
                f"dynamic table {self.table_name!r}: only the last training lookup can be taken back, and "
                f"{self._lookups - after[0]} ran after the one discarded."
            )
        if self._last_undo is None:
            raise RuntimeError(
                f"dynamic table {self.table_name!r}: the lookup to take back kept no undo record: read "
                "lookup_counters() right before a lookup that may be taken back (the fused pipeline does)."
            )
        journal, slots, old_w, old_s = self._last_undo
        self._write_slots(slots, old_w, old_s)
        self.index.undo(journal)
        self._lookups -= 1
        self._last_undo = None

    def tier_stats(self) -> Dict[str, float]:
        """``TieredEmbeddingShard.tier_stats`` plus ``occupancy`` (keys held now) and the cumulative
        ``inserted``, ``evicted``, ``not_admitted`` and ``failed`` since the shard was built or loaded."""
        stats = super().tier_stats()
        counts = torch.cat([self.index.occupancy().reshape(1), self.index.counters]).tolist()
        stats.update(zip(("occupancy",) + DYNAMIC_COUNTERS, (float(c) for c in counts)))
        return stats

    @torch.no_grad()
    def dynamic_rows(self) -> DynamicRows:
        """``(keys, weights, optimizer state, scores)`` of every key held, in slot order, on the CPU."""
        self.flush()
        keys, scores, slots = self.index.export()
        tiers = self.tiers
        assert isinstance(tiers, BufferedTier)
        where = tiers.locate(slots)
        return keys.cpu(), tiers.read(*where, state=False).cpu(), tiers.read(*where, state=True).cpu(), scores.cpu()

    @torch.no_grad()
    def load_dynamic_rows(
        self, keys: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, scores: torch.Tensor, step: int
    ) -> None:
        """Replaces the shard's keys and rows by ``keys`` with their rows, state and scores (this shard's own
        keys: route them first), placed as ``DynamicKeyIndex.placement`` places them (a bucket's keys in the
        order given; a bucket given more keys than its slots keeps those of highest score, the rest follow
        ``on_full``); the counters restart at zero.

        Raises:
            ValueError: ``keys`` repeat, or ``on_full='error'`` and a key found no slot (nothing changed).
        """
        # the index first: a refusal leaves the shard unchanged
        slots, kept = self.index.load(keys.to(self.device, torch.int64), scores.to(self.device, torch.int64))
        self._last_undo = None
        self.write_local_rows(
            torch.zeros((self.num_rows, self.embedding_dim), dtype=self.dtype, device=self.device), None, True
        )
        sel = kept.nonzero().squeeze(1)
        self._write_slots(
            slots.index_select(0, sel),
            weights.to(self.device, self.dtype).index_select(0, sel),
            state.to(self.device, torch.float32).index_select(0, sel),
        )
        self.index.counters.zero_()
        self.tiers.load_step(int(step))

    def export_state(self) -> TieredShardState:
        """Refused: a dynamic table's rows are keyed by raw keys, which the id-keyed tiered export cannot carry
        (``state_dict()`` and ``recpipe.pipeline.checkpoint`` save them keyed by raw key instead).

        Raises:
            TieredCheckpointError: always, with the ways to save the table.
        """
        raise self.checkpoint_error(
            "a dynamic table has no id-keyed export (its rows are keyed by raw keys, the tiered export by row id)",
            [
                "save and load the model with recpipe.pipeline.checkpoint.save / load (any world size and sharding), "
                "or model.state_dict() / load_state_dict() (the same sharding): both carry the keys",
                "take one shard's keys, rows, optimizer state and scores with "
                "recpipe.pipeline.tiered.dynamic.dynamic_state.export_dynamic_state(shard) (or every rank's with "
                "recpipe.pipeline.gather_dynamic_table) and load them with load_dynamic_states",
            ],
        )

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        destination.update(dynamic_state_entries(self, prefix))

    def _load_from_state_dict(
        self,
        state_dict: Dict[str, Any],
        prefix: str,
        local_metadata: Dict[str, Any],
        strict: bool,
        missing_keys: List[str],
        unexpected_keys: List[str],
        error_msgs: List[str],
    ) -> None:
        absent = [prefix + k for k in DYNAMIC_STATE_FIELDS if prefix + k not in state_dict]
        if absent:
            missing_keys.extend(absent)
            return
        load_dynamic_entries(self, lambda k: state_dict.get(prefix + k), f"the state dict under {prefix!r}")

    def extra_repr(self) -> str:
        return (
            f"table={self.table_name!r}, dynamic capacity={self.options.table_capacity(self.table_num_embeddings)}, "
            f"slots={self.num_rows}, dim={self.embedding_dim}, eviction={self.options.eviction}, "
            f"mode={self.mode.name}, x={self.cache_load_factor}, optimizer={self.optimizer.name}, "
            f"shard={self.key_rank}/{self.key_shards}"
        )
