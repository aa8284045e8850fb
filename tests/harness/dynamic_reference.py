"""A pure-Python reference of a dynamic table shard's key index: dicts and lists, one key at a time.

It follows ``docs/dynamic.md`` (buckets of ``BUCKET_SLOTS`` slots, eviction of the lowest score
among the slots a batch does not use, admission counters, on_full) written independently of
``recpipe.pipeline.tiered.dynamic``: Python ints, no torch in the index, so the tests compare the native
kernel and the torch implementation against plain loops.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["ReferenceIndex", "mix64", "reference_bucket", "reference_init_row", "reference_salt"]

MASK64 = (1 << 64) - 1
BUCKET_TAG = 0x64796E2D62756B74
ADMIT_TAG = 0x64796E2D61646D74
INIT_TAG = 0x64796E2D696E6974
GOLDEN = 0x9E3779B97F4A7C15


def mix64(x: int) -> int:
    """splitmix64's finalizer on a uint64."""
    x &= MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def reference_salt(seed: int, tag: int) -> int:
    return mix64((seed & MASK64) ^ tag)


def reference_bucket(key: int, salt: int, num_buckets: int) -> int:
    return (mix64((key & MASK64) ^ salt) >> 1) % num_buckets


def _fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & MASK64
    return h


def reference_init_row(
    key: int,
    dim: int,
    seed: int,
    table: str,
    mode: str,
    lower: float,
    upper: float,
    mean: float = 0.0,
    std: float = 1.0,
    value: float = 0.0,
    clamp: bool = False,
) -> List[float]:
    """Row ``key`` of a new slot (float64 values; the table stores them as float32)."""
    salt = mix64((seed & MASK64) ^ INIT_TAG ^ _fnv1a64(table.encode()))
    base = mix64((key & MASK64) ^ salt)

    def u(j: int) -> float:
        return (mix64((base + (j + 1) * GOLDEN) & MASK64) >> 11) * 2.0**-53

    if mode == "constant":
        return [value] * dim
    if mode == "uniform":
        return [lower + (upper - lower) * u(c) for c in range(dim)]
    out = []
    for c in range(dim):
        z = math.sqrt(-2.0 * math.log1p(-u(2 * c))) * math.cos(2.0 * math.pi * u(2 * c + 1))
        v = mean + std * z
        out.append(min(max(v, lower), upper) if clamp else v)
    return out


@dataclass
class _Table:
    """Buckets of ``[key, score]`` lists (used slots in slot order)."""

    num_buckets: int
    slots: int
    salt: int
    buckets: List[List[List[int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.buckets = [[] for _ in range(self.num_buckets)]

    def bucket(self, key: int) -> int:
        return reference_bucket(key, self.salt, self.num_buckets)

    def find(self, key: int) -> Optional[int]:
        b = self.bucket(key)
        for j, (k, _) in enumerate(self.buckets[b]):
            if k == key:
                return b * self.slots + j
        return None

    def plan_inserts(self, keys: Sequence[int], protected: set) -> Dict[int, Optional[int]]:
        """key -> slot (None: no slot) for missing ``keys`` in ascending order, per the spec."""
        out: Dict[int, Optional[int]] = {}
        rank: Dict[int, int] = {}
        for key in sorted(keys):
            b = self.bucket(key)
            r = rank.get(b, 0)
            rank[b] = r + 1
            used = len(self.buckets[b])
            free = self.slots - used
            if r < free:
                out[key] = b * self.slots + used + r
                continue
            victims = sorted(
                (score, j) for j, (_, score) in enumerate(self.buckets[b]) if b * self.slots + j not in protected
            )
            v = r - free
            out[key] = b * self.slots + victims[v][1] if v < len(victims) else None
        return out

    def put(self, slot: int, key: int, score: int) -> Optional[int]:
        """Stores ``key`` at ``slot``; returns the key it evicted (None: a free slot)."""
        b, j = divmod(slot, self.slots)
        if j < len(self.buckets[b]):
            old = self.buckets[b][j][0]
            self.buckets[b][j] = [key, score]
            return old
        assert j == len(self.buckets[b]), "free slots fill in order"
        self.buckets[b].append([key, score])
        return None

    def get_score(self, slot: int) -> int:
        b, j = divmod(slot, self.slots)
        return self.buckets[b][j][1]

    def set_score(self, slot: int, score: int) -> None:
        b, j = divmod(slot, self.slots)
        self.buckets[b][j][1] = score


class ReferenceIndex:
    """One shard's key index: ``find_or_insert`` per the spec, with the stats counters."""

    def __init__(
        self,
        num_buckets: int,
        slots: int,
        seed: int,
        eviction: str,
        admit_after: int = 1,
        on_full: str = "ignore",
        counter_buckets: Optional[int] = None,
    ) -> None:
        self.main = _Table(num_buckets, slots, reference_salt(seed, BUCKET_TAG))
        counter = num_buckets if counter_buckets is None else counter_buckets
        self.counter = _Table(counter, slots, reference_salt(seed, ADMIT_TAG))
        self.eviction = eviction
        self.admit_after = admit_after
        self.on_full = on_full
        self.clock = 0
        self.custom_score = 0
        self.stats = dict(inserted=0, evicted=0, not_admitted=0, failed=0)

    @property
    def occupancy(self) -> int:
        return sum(len(b) for b in self.main.buckets)

    def key_slots(self) -> Dict[int, int]:
        """Every stored key -> its slot."""
        s = self.main.slots
        return {k: b * s + j for b, bucket in enumerate(self.main.buckets) for j, (k, _) in enumerate(bucket)}

    def find_or_insert(
        self, keys: Sequence[int], train: bool, step: int = 0
    ) -> Tuple[List[int], List[Tuple[int, int]]]:
        """``(slot per key (-1: no row), [(slot, key) inserted])``."""
        counts: Dict[int, int] = {}
        for k in keys:
            counts[k] = counts.get(k, 0) + 1
        uniq = sorted(counts)
        if not train:
            found = {k: self.main.find(k) for k in uniq}
            return [found[k] if found[k] is not None else -1 for k in keys], []
        self.clock += 1
        found = {k: self.main.find(k) for k in uniq}
        misses = [k for k in uniq if found[k] is None]
        admitted = set(misses)
        counter_ops: List[Tuple[int, int, int]] = []  # (slot, key, new count) or updates
        if self.admit_after > 1:
            admitted = set()
            cfound = {k: self.counter.find(k) for k in misses}
            protected = {s for s in cfound.values() if s is not None}
            cplan = self.counter.plan_inserts([k for k in misses if cfound[k] is None], protected)
            for k in misses:
                prev = self.counter.get_score(cfound[k]) if cfound[k] is not None else 0
                total = prev + counts[k]
                ok = total >= self.admit_after
                slot = cfound[k] if cfound[k] is not None else cplan[k]
                if slot is not None:
                    counter_ops.append((slot, k, 0 if ok else total))
                if ok:
                    admitted.add(k)
        protected = {s for s in found.values() if s is not None}
        plan = self.main.plan_inserts([k for k in misses if k in admitted], protected)
        failed = [k for k, s in plan.items() if s is None]
        if failed:
            if self.on_full == "error":
                raise ValueError(f"{len(failed)} keys found no slot")
            if self.on_full == "warning":
                warnings.warn(f"{len(failed)} keys found no slot", stacklevel=2)
        # apply
        for slot, k, c in counter_ops:
            self.counter.put(slot, k, c)
        self.stats["not_admitted"] += len(misses) - len(admitted)
        self.stats["failed"] += len(failed)

        def value(k: int, old: Optional[int]) -> int:
            if self.eviction == "lru":
                return self.clock
            if self.eviction == "step":
                return step
            if self.eviction == "custom":
                return self.custom_score
            return (old or 0) + counts[k]

        for k in uniq:
            if found[k] is not None:
                self.main.set_score(found[k], value(k, self.main.get_score(found[k])))
        inserted: List[Tuple[int, int]] = []
        for k, slot in sorted(plan.items()):
            if slot is None:
                continue
            if self.main.put(slot, k, value(k, None)) is not None:
                self.stats["evicted"] += 1
            self.stats["inserted"] += 1
            inserted.append((slot, k))
        final = {k: (found[k] if found[k] is not None else plan.get(k)) for k in uniq}
        return [final[k] if final[k] is not None else -1 for k in keys], inserted
