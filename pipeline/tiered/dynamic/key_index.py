"""One shard's key index: raw int64 keys -> slots, with scores, eviction, admission and counters.

``find_or_insert`` follows ``docs/dynamic.md``: a plan (:mod:`recpipe.pipeline.tiered.dynamic.plan`, or the
native kernel's) says where each key is or goes, then the index applies it, recording the values it
overwrites so the fused pipeline can take a discarded lookup back (:meth:`DynamicKeyIndex.undo`).
Imports ``recpipe.pipeline.placement`` and ``recpipe.pipeline.tiered.dynamic`` modules.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from recpipe.pipeline.placement import BUCKET_SLOTS, DynamicTableOptions
from recpipe.pipeline.tiered.dynamic.key_hashing import ADMIT_TAG, BUCKET_TAG, bucket_of, salt_of
from recpipe.pipeline.tiered.fixed_shape import Selection, device_counts, fixed_unique, select

__all__ = [
    "DYNAMIC_COUNTERS",
    "DynamicKeyIndex",
    "HashPlan",
    "IndexJournal",
    "KeyUnique",
    "LookupSlots",
    "torch_unique",
]

#: Cumulative counters of an index, in the order of :attr:`DynamicKeyIndex.counters`.
DYNAMIC_COUNTERS: Tuple[str, ...] = ("inserted", "evicted", "not_admitted", "failed")

#: ``(uniq, want_insert, keys, scores, sizes, bucket_slots, salt) -> (found, slot)``.
HashPlan = Callable[
    [torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, int, int],
    Tuple[torch.Tensor, torch.Tensor],
]
#: ``keys -> (uniq ascending, inverse, counts)``, as ``torch.unique(sorted=True, return_inverse=True,
#: return_counts=True)``.
KeyUnique = Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def torch_unique(keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(uniq, inverse, counts)`` of int64 ``keys`` by ``torch.unique`` (any device)."""
    uniq, inverse, counts = torch.unique(keys, sorted=True, return_inverse=True, return_counts=True)
    return uniq, inverse, counts


@dataclass
class IndexJournal:
    """What one ``find_or_insert`` overwrote: ``(tensor, positions, old values)`` and the clock."""

    writes: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    clock: int = 0

    def record(self, tensor: torch.Tensor, positions: torch.Tensor) -> None:
        self.writes.append((tensor, positions, tensor.index_select(0, positions)))


@dataclass
class LookupSlots:
    """A lookup's result: ``slots`` per input key (-1: no row) and the ``(new_slots, new_keys)`` whose rows
    must be initialized; ``journal`` undoes it; ``complete``: every key has a slot, known without reading
    ``slots`` (False: some key may have none). ``live``: None when ``new_slots`` are exactly the new ones;
    else they are a fixed-shape selection (``recpipe.pipeline.tiered.fixed_shape``) and ``live`` a 0-d bool,
    whether it holds any (False: the writes must rewrite what the slots hold)."""

    slots: torch.Tensor
    new_slots: torch.Tensor
    new_keys: torch.Tensor
    journal: Optional[IndexJournal]
    complete: bool = False
    live: Optional[torch.Tensor] = None


class _Table:
    """Bucketed slots: ``keys``, ``scores`` (``[B * S]``) and ``sizes`` (``[B]``) on one device."""

    def __init__(self, num_buckets: int, device: torch.device, salt: int) -> None:
        slots = num_buckets * BUCKET_SLOTS
        self.keys = torch.zeros(slots, dtype=torch.int64, device=device)
        self.scores = torch.zeros(slots, dtype=torch.int64, device=device)
        self.sizes = torch.zeros(num_buckets, dtype=torch.int64, device=device)
        self.salt = salt

    def tensors(self) -> List[Tuple[str, torch.Tensor]]:
        return [("keys", self.keys), ("scores", self.scores), ("sizes", self.sizes)]

    def plan(self, fn: HashPlan, uniq: torch.Tensor, want: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        return fn(uniq, want, self.keys, self.scores, self.sizes, BUCKET_SLOTS, self.salt)

    def store(
        self,
        sel: Optional[Selection],
        slots: torch.Tensor,
        keys: torch.Tensor,
        scores: torch.Tensor,
        journal: Optional[IndexJournal],
    ) -> Union[int, torch.Tensor]:
        """Writes ``keys`` / ``scores`` at ``slots`` (>= 0; taken through ``sel``, None: every entry),
        growing bucket sizes; returns how many of the written slots held a key."""
        bucket = torch.div(slots, BUCKET_SLOTS, rounding_mode="floor")
        lane = slots - bucket * BUCKET_SLOTS
        was_used = lane < self.sizes.index_select(0, bucket)
        if journal is not None:
            journal.record(self.keys, slots)
            journal.record(self.scores, slots)
            journal.record(self.sizes, bucket)
        if sel is None:
            sel = Selection.every(slots.numel(), slots.device)
        sel.copy_(self.keys, slots, keys)
        sel.copy_(self.scores, slots, scores)
        self.sizes.scatter_reduce_(0, bucket, sel.keep(lane + 1, 0), reduce="amax")
        return sel.count_of(was_used)

    def clear(self) -> None:
        self.sizes.zero_()

    def export(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, scores, slots)`` of every used slot, in slot order."""
        n = self.keys.numel()
        lane = torch.arange(n, device=self.keys.device) % BUCKET_SLOTS
        bucket = torch.arange(n, device=self.keys.device) // BUCKET_SLOTS
        slots = (lane < self.sizes.index_select(0, bucket)).nonzero().squeeze(1)
        return self.keys.index_select(0, slots), self.scores.index_select(0, slots), slots


def _placement(table: _Table, keys: torch.Tensor, scores: torch.Tensor, table_name: str) -> torch.Tensor:
    """The slot of ``table`` each of ``keys`` (distinct, int64, on its device) takes when loaded into it empty
    (-1: none), as :meth:`DynamicKeyIndex.placement` describes.

    Raises:
        ValueError: ``keys`` repeat.
    """
    device = table.keys.device
    n = keys.numel()
    ordered = torch.sort(keys).values
    if n > 1 and bool((ordered[1:] == ordered[:-1]).any()):
        raise ValueError(f"dynamic table {table_name!r}: the loaded keys repeat; load one row per key.")
    num_buckets = table.sizes.numel()
    bucket = bucket_of(keys, table.salt, num_buckets)

    def rank_in_bucket(order: torch.Tensor) -> torch.Tensor:
        # order: positions grouped by bucket (stable), so a position's rank is its place in its group
        grouped = bucket.index_select(0, order)
        rank = torch.arange(order.numel(), device=device) - torch.searchsorted(grouped, grouped)
        return torch.empty_like(rank).index_copy_(0, order, rank)

    by_score = torch.argsort(scores, descending=True, stable=True)
    keep = rank_in_bucket(by_score.index_select(0, torch.argsort(bucket.index_select(0, by_score), stable=True)))
    kept = keep < BUCKET_SLOTS
    # lanes of the kept keys in the order given (dropped keys grouped past every bucket)
    group = torch.where(kept, bucket, num_buckets)
    lane = torch.empty_like(keep)
    order = torch.argsort(group, stable=True)
    grouped = group.index_select(0, order)
    lane.index_copy_(0, order, torch.arange(n, device=device) - torch.searchsorted(grouped, grouped))
    return torch.where(kept, bucket * BUCKET_SLOTS + lane, -1)


class DynamicKeyIndex:
    """The key index of one dynamic shard of ``slots`` slots (a multiple of ``BUCKET_SLOTS``).

    Args:
        slots (int): local slots.
        options (DynamicTableOptions): eviction, admission, on_full, seed.
        table_name (str): named in errors and warnings.
        device (torch.device): where the index lives (the shard's fast tier).
        plan (HashPlan): the plan implementation (torch ops, or the native kernel on CPU).
        unique (Optional[KeyUnique]): the exact deduplication of a batch's keys (``torch_unique`` or the
            native kernel's, which returns the same tensors), for the CPU kernels; None: fixed shapes
            (``recpipe.pipeline.tiered.fixed_shape``): the padded dedupe and fixed-shape selections, so a
            lookup reads nothing back from the device unless ``on_full`` is ``error`` or ``warning`` (one
            count).
        counter_slots (int): slots of the admission counter table (a multiple of ``BUCKET_SLOTS``; needed
            when ``options.admit_after > 1``, else ignored): a key not yet admitted keeps its sightings there;
            a full counter bucket gives a new key the counter of the lowest count.
    """

    def __init__(
        self,
        slots: int,
        options: DynamicTableOptions,
        table_name: str,
        device: torch.device,
        plan: HashPlan,
        unique: Optional[KeyUnique] = None,
        counter_slots: int = 0,
    ) -> None:
        if slots <= 0 or slots % BUCKET_SLOTS:
            raise ValueError(f"dynamic table {table_name!r}: slots must be a positive multiple of {BUCKET_SLOTS}.")
        if options.admit_after > 1 and (counter_slots <= 0 or counter_slots % BUCKET_SLOTS):
            raise ValueError(
                f"dynamic table {table_name!r}: counter_slots must be a positive multiple of {BUCKET_SLOTS} when "
                f"admit_after > 1 (recpipe.pipeline.placement.dynamic_counter_slots gives it), got {counter_slots}."
            )
        self.options = options
        self.table_name = table_name
        self.device = device
        self.num_slots = slots
        self._plan = plan
        self._unique = unique
        buckets = slots // BUCKET_SLOTS
        self.main = _Table(buckets, device, salt_of(options.seed, BUCKET_TAG))
        self.counter_slots = counter_slots if options.admit_after > 1 else 0
        self.admission: Optional[_Table] = (
            _Table(self.counter_slots // BUCKET_SLOTS, device, salt_of(options.seed, ADMIT_TAG))
            if self.counter_slots
            else None
        )
        self.counters = torch.zeros(len(DYNAMIC_COUNTERS), dtype=torch.int64, device=device)
        #: Training lookups so far (the ``lru`` score).
        self.clock = 0
        #: The score ``custom`` eviction gives keys a lookup touches (:meth:`set_custom_score`).
        self.custom_score = 0

    def tensors(self) -> Dict[str, List[Tuple[str, torch.Tensor]]]:
        """The index's tensors (``index``: main table; ``admission``: counters table)."""
        out = {"index": self.main.tensors()}
        if self.admission is not None:
            out["admission"] = self.admission.tensors()
        return out

    def occupancy(self) -> torch.Tensor:
        """Keys held (0-d int64 on the device)."""
        return self.main.sizes.sum()

    def clear(self) -> None:
        """Drops every key and admission count (the counters stay)."""
        self.main.clear()
        if self.admission is not None:
            self.admission.clear()

    def _dedupe(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``(uniq, inverse, counts, valid)``: exact (``valid`` None) or padded to the batch (fixed shapes)."""
        keys = keys.to(torch.int64)
        if self._unique is None:
            return fixed_unique(keys)
        uniq, inverse, counts = self._unique(keys)
        return uniq, inverse, counts, None

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slot of each key (-1: absent); changes nothing (eval lookups)."""
        uniq, inverse, _, _ = self._dedupe(keys)
        found, _ = self.main.plan(self._plan, uniq, None)
        return found.index_select(0, inverse)

    def find_or_insert(self, keys: torch.Tensor, step: int, journal: bool) -> LookupSlots:
        """A training lookup: finds ``keys``, admits and inserts missing ones, updates scores.

        Args:
            keys (torch.Tensor): int64 keys (any order, repeats allowed).
            step (int): the table's optimizer step (the ``step`` score).
            journal (bool): record the overwritten values for :meth:`undo`.

        Raises:
            ValueError: ``on_full='error'`` and a key found no slot (nothing changed).
        """
        uniq, inverse, counts, valid = self._dedupe(keys)
        fixed = valid is not None
        if self.admission is None:  # every missing key wants a slot: one plan finds and places
            found, slot = self.main.plan(self._plan, uniq, valid if fixed else torch.ones_like(uniq, dtype=torch.bool))
            miss = found < 0 if valid is None else (found < 0) & valid
            admitted, admission_write, wanted = torch.ones_like(miss), None, miss
        else:  # the missing keys are counted first; only the admitted ones are placed
            found, _ = self.main.plan(self._plan, uniq, None)
            miss = found < 0 if valid is None else (found < 0) & valid
            admitted, admission_write = self._admit(uniq, counts, miss, fixed)
            wanted = miss & admitted
            if not fixed and not bool(wanted.any()):  # exact shapes on the CPU: a host check, no second probe
                slot = torch.full_like(found, -1)
            else:
                _, slot = self.main.plan(self._plan, uniq, wanted)
        failed = wanted & (slot < 0)
        n_failed: Union[int, torch.Tensor] = failed.sum()
        if not fixed or self.options.on_full != "ignore":  # a host read only where it costs none, or is asked
            n_failed = int(n_failed)
            if n_failed:
                self._on_full(n_failed)
        rec = IndexJournal(clock=self.clock) if journal else None
        if rec is not None:
            rec.record(self.counters, torch.arange(self.counters.numel(), device=self.device))
        self.clock += 1
        if admission_write is not None:
            admission_write(rec)
        hit = found >= 0 if valid is None else (found >= 0) & valid
        puts, new_scores = self._write_scores(uniq, counts, hit, found, slot, step, fixed, rec)
        new_slots, new_keys = puts.targets(slot), puts.take(uniq)
        # inserted, evicted, not admitted, failed: host ints, or 0-d tensors where only the device knows
        counts_now: List[Union[int, torch.Tensor]] = [puts.count, 0, 0, n_failed]
        if new_slots.numel():  # a shape, known without reading the device
            counts_now[1] = self.main.store(puts, new_slots, new_keys, puts.take(new_scores), rec)
        if admission_write is not None:
            counts_now[2] = (miss & ~admitted).sum()
        self.counters += device_counts(counts_now, self.device)
        final = torch.where(found >= 0, found, slot)
        # every missing key was placed (known on the host only in exact shapes, where n_failed is an int)
        complete = isinstance(n_failed, int) and not fixed and admission_write is None and n_failed == 0
        return LookupSlots(final.index_select(0, inverse), new_slots, new_keys, rec, complete, puts.live)

    def _write_scores(
        self,
        uniq: torch.Tensor,
        counts: torch.Tensor,
        hit: torch.Tensor,
        found: torch.Tensor,
        slot: torch.Tensor,
        step: int,
        fixed: bool,
        rec: Optional[IndexJournal],
    ) -> Tuple[Selection, torch.Tensor]:
        """Writes the found keys' new scores; returns the selection of the placed keys and the scores they
        take (per unique key), for the store."""
        hits = select(hit, fixed)
        hit_slots = hits.targets(found)
        puts = select(slot >= 0, fixed)
        if self.options.eviction == "lfu":
            new_hit_scores = self.main.scores.index_select(0, hit_slots) + hits.take(counts)
            new_scores = counts
        else:
            value = self._score(step)
            new_hit_scores = torch.full_like(hit_slots, value)
            new_scores = torch.full_like(uniq, value)
        if rec is not None:
            rec.record(self.main.scores, hit_slots)
        hits.copy_(self.main.scores, hit_slots, new_hit_scores)
        return puts, new_scores

    def _score(self, step: int) -> int:
        eviction = self.options.eviction
        if eviction == "lru":
            return self.clock
        if eviction == "step":
            return step
        return self.custom_score  # custom (lfu scores by counts)

    def _admit(
        self, uniq: torch.Tensor, counts: torch.Tensor, miss: torch.Tensor, fixed: bool
    ) -> Tuple[torch.Tensor, Optional[Callable[[Optional[IndexJournal]], None]]]:
        """``(admitted mask over uniq, the admission table's write)`` (planned now, written after the on_full
        check so a refused lookup changes nothing)."""
        table = self.admission
        if table is None:
            return torch.ones_like(miss), None
        misses = select(miss, fixed)
        mk, mc = misses.take(uniq), misses.take(counts)
        want = torch.ones_like(mk, dtype=torch.bool) if misses.held is None else misses.held
        cf, cs = table.plan(self._plan, mk, want)
        prev = torch.where(cf >= 0, table.scores.index_select(0, cf.clamp(min=0)), 0)
        total = prev + mc
        ok = total >= self.options.admit_after
        stored = torch.where(ok, 0, total)
        admitted = torch.zeros_like(miss)
        misses.copy_(admitted, misses.at, ok)

        def write(rec: Optional[IndexJournal]) -> None:
            where = torch.where(cf >= 0, cf, cs)
            kept = select(want & (where >= 0), fixed)
            if kept.at.numel():
                table.store(kept, kept.targets(where), kept.take(mk), kept.take(stored), rec)

        return admitted, write

    def _on_full(self, n_failed: int) -> None:
        mode = self.options.on_full
        if mode == "ignore":
            return
        message = (
            f"dynamic table {self.table_name!r}: {n_failed} key(s) of this batch found no slot: every slot of "
            f"their bucket holds a key the same batch uses ({self.num_slots} slots on this shard, buckets of "
            f"{BUCKET_SLOTS}). Possible solutions:\n  1) raise DynamicTableOptions.capacity;\n"
            "  2) use smaller batches;\n  3) set on_full='ignore' (or 'warning') to look such keys up as nothing."
        )
        if mode == "error":
            raise ValueError(message + " Nothing was changed by this batch.")
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def undo(self, journal: IndexJournal) -> None:
        """Restores what ``find_or_insert`` overwrote (the last lookup's journal first)."""
        for tensor, positions, old in reversed(journal.writes):
            tensor.index_copy_(0, positions, old)
        self.clock = journal.clock

    def export(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, scores, slots)`` of every held key, in slot order."""
        return self.main.export()

    def export_admission(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(keys, counts)`` of the admission counter table (slot order): the sightings of keys not yet
        admitted; empty without admission."""
        if self.admission is None:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return empty, empty.clone()
        keys, counts, _ = self.admission.export()
        return keys, counts

    def load_admission(self, keys: torch.Tensor, counts: torch.Tensor) -> None:
        """Replaces the admission counter table by ``keys`` (distinct) with their sightings ``counts``, placed
        as :meth:`placement` places keys (a bucket given more keys than its slots keeps the highest counts;
        the others start again from zero). Without admission it does nothing.

        Raises:
            ValueError: ``keys`` repeat.
        """
        if self.admission is None:
            return
        keys, counts = keys.to(self.device, torch.int64), counts.to(self.device, torch.int64)
        slots = _placement(self.admission, keys, counts, self.table_name)
        kept = slots >= 0
        self.admission.clear()
        self.admission.store(None, slots[kept], keys[kept], counts[kept], None)

    def placement(self, keys: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The slot each of ``keys`` (distinct) takes when loaded into an empty index (-1: none); changes
        nothing. A bucket's keys take its slots in the order given (a shard's export, in slot order, loaded
        into the same layout keeps every key's slot, so eviction ties still break alike); a bucket given more
        keys than its :data:`BUCKET_SLOTS` slots keeps those of highest score (the ones its eviction keeps;
        ties: the first given).

        Raises:
            ValueError: ``keys`` repeat.
        """
        return _placement(
            self.main, keys.to(self.device, torch.int64), scores.to(self.device, torch.int64), self.table_name
        )

    def load(self, keys: torch.Tensor, scores: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Replaces the index's keys by ``keys`` (distinct) with ``scores``, placed by :meth:`placement`;
        returns ``(slots, kept)``: each loaded key's slot and whether it found one. Keys a full bucket
        drops follow ``on_full``: ``error`` raises before the index changes, ``warning`` warns.

        Raises:
            ValueError: ``keys`` repeat, or ``on_full='error'`` and a key found no slot (nothing changed).
        """
        slots = self.placement(keys, scores)
        kept = slots >= 0
        dropped = int((~kept).sum())
        if dropped:
            self.on_full_at_load(dropped, int(keys.numel()))
        self.clear()
        self.main.store(
            None, slots[kept], keys.to(self.device, torch.int64)[kept], scores.to(self.device, torch.int64)[kept], None
        )
        return slots, kept

    def on_full_at_load(self, dropped: int, loaded: int) -> None:
        """What ``on_full`` does with ``dropped`` of ``loaded`` keys that find no slot at a load."""
        mode = self.options.on_full
        if mode == "ignore":
            return
        message = (
            f"dynamic table {self.table_name!r}: {dropped} of the {loaded} loaded keys found no slot: their buckets "
            f"were given more than {BUCKET_SLOTS} keys ({self.num_slots} slots on this shard), so each keeps its "
            f"{BUCKET_SLOTS} of highest score. Possible solutions:\n  1) raise DynamicTableOptions.capacity (of "
            "the loading table) to hold every saved key;\n  2) set on_full='warning' or 'ignore' to drop them."
        )
        if mode == "error":
            raise ValueError(message + " Nothing was loaded.")
        warnings.warn(message, RuntimeWarning, stacklevel=3)
