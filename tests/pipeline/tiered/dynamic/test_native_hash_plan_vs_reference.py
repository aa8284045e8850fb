"""The compiled plan of the dynamic key index (csrc/dynamic_table.cpp) against the pure-Python reference.

``tests/harness/dynamic_reference.py`` computes buckets and plans with Python ints and lists, one key at
a time. Here the kernel's bucket function, its ``found`` and its insert ``slot`` (free slots in key
order, then victims by ``(score, slot)`` among the slots the call does not hold) must match it exactly on
tables filled by applying plans step after step (lru and lfu scores, full buckets, many keys per bucket,
negative and extreme keys, one bucket); then the op's purity, ``torch.library.opcheck``, the fake
kernel's shapes and the errors of bad input.
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from harness.dynamic_reference import ReferenceIndex, reference_bucket
from torch._subclasses.fake_tensor import FakeTensorMode

from recpipe.pipeline.tiered.dynamic.native_plan import native_hash_plan

S = 16  # BUCKET_SLOTS
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
EXTREMES = [I64_MIN, I64_MIN + 1, -(2**62), -1, 0, 1, 2**62, I64_MAX - 1, I64_MAX]


def _state(ref: ReferenceIndex) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keys, scores, sizes)`` tensors of the reference's main table (unused slots hold junk)."""
    table = ref.main
    keys = torch.full((table.num_buckets * table.slots,), 0x5EED, dtype=torch.int64)
    scores = torch.full_like(keys, -7)
    for b, bucket in enumerate(table.buckets):
        for j, (key, score) in enumerate(bucket):
            keys[b * table.slots + j] = key
            scores[b * table.slots + j] = score
    sizes = torch.tensor([len(bucket) for bucket in table.buckets], dtype=torch.int64)
    return keys, scores, sizes


def _expected(ref: ReferenceIndex, uniq: Sequence[int], want: Sequence[bool]) -> Tuple[List[int], List[int]]:
    """The reference's ``(found, slot)`` of one plan call."""
    found = {k: ref.main.find(k) for k in uniq}
    protected = {s for s in found.values() if s is not None}
    plan = ref.main.plan_inserts([k for k, w in zip(uniq, want) if w and found[k] is None], protected)
    slots = [-1 if plan.get(k) is None else plan[k] for k in uniq]
    return [-1 if found[k] is None else found[k] for k in uniq], slots


def _plan(ref: ReferenceIndex, uniq: Sequence[int], want: Optional[Sequence[bool]]) -> Tuple[List[int], List[int]]:
    keys, scores, sizes = _state(ref)
    want_t = None if want is None else torch.tensor(list(want), dtype=torch.bool)
    found, slot = native_hash_plan(
        torch.tensor(list(uniq), dtype=torch.int64), want_t, keys, scores, sizes, ref.main.slots, ref.main.salt
    )
    assert found.dtype == slot.dtype == torch.int64
    return found.tolist(), slot.tolist()


def _key_pool(rng: random.Random, size: int) -> List[int]:
    pool = set(EXTREMES)
    while len(pool) < size:
        pool.add(rng.choice([rng.randint(-1000, 1000), rng.randint(I64_MIN, I64_MAX)]))
    return sorted(pool)


@pytest.mark.parametrize(
    "eviction,buckets,slots,pool_size,batch,seed",
    [
        ("lru", 4, S, 300, 48, 0),  # buckets fill within a few steps, then evict
        ("lfu", 4, S, 300, 48, 1),
        ("lru", 1, S, 60, 24, 2),  # one bucket: more misses than slots, -1 past the victims
        ("lfu", 1, S, 40, 30, 3),
        ("lru", 7, 3, 120, 40, 4),  # small buckets, many keys per bucket
        ("lfu", 32, S, 900, 200, 5),
    ],
)
def test_plan_matches_reference_while_filling(
    eviction: str, buckets: int, slots: int, pool_size: int, batch: int, seed: int
) -> None:
    rng = random.Random(seed)
    ref = ReferenceIndex(buckets, slots, seed=seed * 7919 - 3, eviction=eviction)
    pool = _key_pool(rng, pool_size)
    evicted_any = failed_any = False
    for _ in range(14):
        batch_keys = [rng.choice(pool) for _ in range(batch)]
        uniq = sorted(set(batch_keys))
        want = [rng.random() < 0.7 for _ in uniq]
        assert _plan(ref, uniq, want) == _expected(ref, uniq, want)
        # the train step's plan (every miss wants a slot) against the reference's find_or_insert
        found, slot = _plan(ref, uniq, [True] * len(uniq))
        failed_any |= any(f < 0 and s < 0 for f, s in zip(found, slot))
        final = {k: f if f >= 0 else s for k, f, s in zip(uniq, found, slot)}
        before = ref.stats["evicted"]
        out, _ = ref.find_or_insert(batch_keys, train=True)
        evicted_any |= ref.stats["evicted"] > before
        assert out == [final[k] for k in batch_keys]
        # no key wants a slot: found only
        assert _plan(ref, uniq, None) == (_plan(ref, uniq, [False] * len(uniq))[0], [-1] * len(uniq))
    assert evicted_any, "the schedule must reach full buckets"
    if buckets == 1:
        assert failed_any, "one bucket must run out of victims"


def test_plan_victims_ordered_by_score_then_slot() -> None:
    """Full buckets with tied, negative and extreme scores: victims by (score, slot), held slots skipped."""
    rng = random.Random(11)
    ref = ReferenceIndex(5, S, seed=2**64 - 5, eviction="custom")
    stored = _key_pool(rng, 5 * S * 3)
    rng.shuffle(stored)
    for key in stored:
        b = ref.main.bucket(key)
        if len(ref.main.buckets[b]) < S - (b == 3):  # bucket 3 keeps one free slot
            ref.main.buckets[b].append([key, rng.choice([I64_MIN, -5, 0, 0, 3, 3, I64_MAX])])
    held = [k for b in ref.main.buckets for k, _ in b]
    new = [k for k in _key_pool(random.Random(12), 400) if k not in set(held)]
    for trial in range(6):
        uniq = sorted(set(rng.sample(held, 20) + rng.sample(new, 40 + 10 * trial)))
        want = [rng.random() < 0.9 for _ in uniq]
        found, slot = _plan(ref, uniq, want)
        assert (found, slot) == _expected(ref, uniq, want)
        assert any(0 <= s < 5 * S for s in slot) and -1 in slot


@pytest.mark.parametrize("buckets", [1, 3, 1000, 65537, 2**20 + 3])
@pytest.mark.parametrize("salt", [0, 0x64796E2D62756B74, 2**63, 2**64 - 1])
def test_bucket_function_matches_reference(buckets: int, salt: int) -> None:
    rng = random.Random(buckets ^ salt)
    uniq = sorted(set(EXTREMES + [rng.randint(I64_MIN, I64_MAX) for _ in range(300)]))
    expect = [reference_bucket(k, salt, buckets) for k in uniq]
    per_bucket: Dict[int, int] = {}
    for b in expect:
        per_bucket[b] = per_bucket.get(b, 0) + 1
    slots = max(per_bucket.values())
    empty = torch.zeros(buckets * slots, dtype=torch.int64)
    sizes = torch.zeros(buckets, dtype=torch.int64)
    found, slot = native_hash_plan(torch.tensor(uniq), None, empty, empty, sizes, slots, salt)
    assert found.eq(-1).all() and slot.eq(-1).all()
    # an empty index: each key takes a free slot of its own bucket
    _, slot = native_hash_plan(
        torch.tensor(uniq), torch.ones(len(uniq), dtype=torch.bool), empty, empty, sizes, slots, salt
    )
    assert (slot // slots).tolist() == expect
    # each key stored in its reference bucket is found there
    keys = empty.clone()
    for k, b in zip(uniq, expect):
        keys[b * slots + sizes[b]] = k
        sizes[b] += 1
    found, _ = native_hash_plan(torch.tensor(uniq), None, keys, empty, sizes, slots, salt)
    assert (found // slots).tolist() == expect and found.unique().numel() == len(uniq)


def test_plan_is_pure_and_parallel_chunks_agree() -> None:
    """A plan larger than one parallel chunk mutates nothing and matches the reference."""
    rng = random.Random(5)
    ref = ReferenceIndex(64, S, seed=9, eviction="lru")
    for step in range(3):
        ref.find_or_insert([rng.randint(I64_MIN, I64_MAX) for _ in range(700)], train=True)
    uniq = sorted({rng.randint(I64_MIN, I64_MAX) for _ in range(5000)} | {k for b in ref.main.buckets for k, _ in b})
    want = [rng.random() < 0.5 for _ in uniq]
    keys, scores, sizes = _state(ref)
    args = (torch.tensor(uniq), torch.tensor(want), keys, scores, sizes)
    copies = [a.clone() for a in args]
    found, slot = native_hash_plan(*args, S, ref.main.salt)
    assert (found.tolist(), slot.tolist()) == _expected(ref, uniq, want)
    for a, c in zip(args, copies):
        assert torch.equal(a, c)


def test_plan_with_many_misses_is_independent_of_threads() -> None:
    """Over 8192 keys wanting slots split the buckets over parallel partitions: same plan as one thread."""
    rng = random.Random(21)
    ref = ReferenceIndex(2048, S, seed=77, eviction="custom")
    target = [rng.choice([S, S, S, S - 1, 3, 0]) for _ in ref.main.buckets]
    stored = []
    for key in sorted({rng.randint(I64_MIN, I64_MAX) for _ in range(60_000)}):
        b = ref.main.bucket(key)
        if len(ref.main.buckets[b]) < target[b]:
            ref.main.buckets[b].append([key, rng.randint(-3, 3)])
            stored.append(key)
    uniq = sorted(set(rng.sample(stored, 6000)) | {rng.randint(I64_MIN, I64_MAX) for _ in range(12_000)})
    want = [rng.random() < 0.9 for _ in uniq]
    keys, scores, sizes = _state(ref)
    args = (torch.tensor(uniq), torch.tensor(want), keys, scores, sizes, S, ref.main.salt)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        many = native_hash_plan(*args)
        torch.set_num_threads(1)
        one = native_hash_plan(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(many[0], one[0]) and torch.equal(many[1], one[1])
    assert (many[0].tolist(), many[1].tolist()) == _expected(ref, uniq, want)


def _small_call() -> Tuple[torch.Tensor, ...]:
    ref = ReferenceIndex(4, S, seed=1, eviction="lru")
    ref.find_or_insert(list(range(-40, 40)), train=True)
    keys, scores, sizes = _state(ref)
    uniq = torch.arange(-50, 50, 3, dtype=torch.int64)
    return uniq, uniq.remainder(2).eq(0), keys, scores, sizes


def test_opcheck() -> None:
    uniq, want, keys, scores, sizes = _small_call()
    for w in (want, None):
        torch.library.opcheck(torch.ops.recpipe.dynamic_hash_plan.default, (uniq, w, keys, scores, sizes, S, -12345))


def test_fake_kernel_shapes() -> None:
    uniq, want, keys, scores, sizes = _small_call()
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (uniq, want, keys, scores, sizes)]
        found, slot = torch.ops.recpipe.dynamic_hash_plan(*fakes, S, 7)
        for out in (found, slot):
            assert out.shape == uniq.shape and out.dtype == torch.int64
        with pytest.raises(RuntimeError, match="bucket_slots"):
            torch.ops.recpipe.dynamic_hash_plan(*fakes, 5, 7)


def _call(**override: object) -> None:
    uniq, want, keys, scores, sizes = _small_call()
    args = dict(uniq=uniq, want_insert=want, keys=keys, scores=scores, sizes=sizes, bucket_slots=S, salt=3)
    args.update(override)
    native_hash_plan(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "override,error,match",
    [
        (dict(uniq=torch.arange(4, dtype=torch.int32), want_insert=None), RuntimeError, "`uniq` must be Long"),
        (dict(uniq=torch.arange(8).view(2, 4), want_insert=None), RuntimeError, "`uniq` must be 1-D"),
        (dict(uniq=torch.arange(8)[::2], want_insert=None), RuntimeError, "`uniq` must be contiguous"),
        (dict(uniq=torch.tensor([1, 5, 5, 9]), want_insert=None), RuntimeError, r"ascend strictly.*uniq\[1\] = 5"),
        (dict(uniq=torch.tensor([3, 2]), want_insert=None), RuntimeError, "`uniq` must ascend strictly"),
        (dict(want_insert=torch.ones(2, dtype=torch.bool)), RuntimeError, "`want_insert` has 2 entries"),
        (dict(want_insert=torch.ones(34, dtype=torch.int64)), RuntimeError, "`want_insert` must be Bool"),
        (dict(keys=torch.zeros(4 * S + 1, dtype=torch.int64)), RuntimeError, "`keys` has 65 slots"),
        (dict(scores=torch.zeros(3, dtype=torch.int64)), RuntimeError, "`scores` has 3 entries"),
        (dict(sizes=torch.tensor([0, 17, 0, 0])), RuntimeError, r"`sizes\[1\]` = 17 is outside \[0, 16\]"),
        (dict(sizes=torch.tensor([0, -1, 0, 0])), RuntimeError, r"`sizes\[1\]` = -1"),
        (dict(sizes=torch.zeros(0, dtype=torch.int64)), RuntimeError, "`sizes` is empty"),
        (dict(bucket_slots=0), ValueError, "`bucket_slots` must be >= 1"),
        (dict(bucket_slots=8), RuntimeError, "buckets of `bucket_slots` = 8"),
        (dict(salt=-1), ValueError, "`salt` must be >= 0"),
        (dict(salt=2**64), ValueError, "`salt` must be <="),
        (dict(salt=1.0), ValueError, "`salt` must be an int"),
    ],
)
def test_bad_input_names_the_argument(override: Dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _call(**override)


def test_unsorted_uniq_across_parallel_chunks() -> None:
    uniq = torch.arange(10_000, dtype=torch.int64)
    uniq[2048], uniq[2047] = 2047, 2048  # past the kernel's parallel grain (2048 keys)
    zeros = torch.zeros(S, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"uniq\[2048\] = 2047"):
        native_hash_plan(uniq, None, zeros, zeros, torch.zeros(1, dtype=torch.int64), S, 0)


def test_empty_uniq() -> None:
    zeros = torch.zeros(S, dtype=torch.int64)
    found, slot = native_hash_plan(
        torch.zeros(0, dtype=torch.int64), None, zeros, zeros, torch.zeros(1, dtype=torch.int64), S, 0
    )
    assert found.shape == slot.shape == (0,)
