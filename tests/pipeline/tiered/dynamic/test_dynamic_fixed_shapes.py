"""The torch implementation of a dynamic table (fixed-shape index, all-fast ``torch`` tier backend) reads
nothing back from the device in a step, and equals the CPU kernels (``native``, exact shapes) bit for bit.

The CPU kernels sum in another order, so against them floats agree within the tiered tolerance; against
the same torch backend in exact shapes they agree bit for bit. A step here is what the fused pipeline runs per batch: ``lookup_counters()``, the training lookup (inserts,
admission, evictions, keys that find no slot), its backward (the fused optimizer), and eval lookups of
unknown keys. ``harness.host_reads`` records the ops that would wait for a CUDA device; run on the CPU, it
shows the torch path would not.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import pytest
import torch
from harness.host_reads import HostReads
from harness.tiered_shards import ATOL, RTOL

from recpipe.pipeline.placement import DynamicTableOptions
from recpipe.pipeline.tiered.dynamic.dynamic_shard import DynamicEmbeddingShard
from recpipe.pipeline.tiered.fixed_shape import fixed_unique, select
from recpipe.pipeline.tiered.optim import TieredOptimizerConfig

DIM = 8
BAGS = 12
Case = Dict[str, object]
CASES: List[Case] = [
    dict(optimizer="adam", pooling="sum", psw=True, admit_after=1, eviction="lru", keys=300),
    dict(optimizer="rowwise_adagrad", pooling="mean", psw=False, admit_after=3, eviction="lfu", keys=40),
    dict(optimizer="sgd", pooling="sum", psw=False, admit_after=2, eviction="step", keys=60),
]
Batch = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]


def _shard(backend: str, case: Case, x: float = 1.0) -> DynamicEmbeddingShard:
    options = DynamicTableOptions(
        capacity=64,
        eviction=str(case["eviction"]),
        admit_after=int(case["admit_after"]),  # type: ignore[call-overload]
        on_full="ignore",
        seed=3,
    )
    return DynamicEmbeddingShard(
        num_embeddings=64,
        embedding_dim=DIM,
        options=options,
        pooling=str(case["pooling"]),
        cache_load_factor=x,
        backend=backend,
        optimizer=TieredOptimizerConfig(optimizer=str(case["optimizer"]), learning_rate=0.05, eps=1e-8),
    )


def _batches(case: Case, steps: int) -> Iterator[Batch]:
    """Random bags (some empty) of keys from ``2 * case["keys"]`` values over 64 slots: inserts, evictions,
    admission, full buckets."""
    pool = int(case["keys"])  # type: ignore[call-overload]
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        lengths = torch.randint(0, 10, (BAGS,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        keys = torch.randint(-pool, pool, (int(offsets[-1]),), generator=gen) * 1000003
        psw = torch.rand(keys.numel(), generator=gen) if case["psw"] else None
        yield keys, offsets, psw, torch.randn(BAGS, DIM, generator=gen)


def _step(shard: DynamicEmbeddingShard, batch: Batch) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    keys, offsets, psw, grad = batch
    psw = psw.clone().requires_grad_() if psw is not None else None
    shard.lookup_counters()  # as the fused pipeline, before a lookup it may take back
    out = shard(keys, offsets, psw)
    out.backward(grad)
    return out.detach(), (psw.grad if psw is not None else None)


UNKNOWN = torch.tensor([5, 2**62 + 1, -(2**61), 7]), torch.tensor([0, 1, 1, 4])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['optimizer']}-{c['pooling']}-admit{c['admit_after']}")
def test_a_torch_step_reads_nothing_back_from_the_device(case: Case) -> None:
    shard = _shard("torch", case)
    batches = list(_batches(case, 12))
    with HostReads() as reads:
        for batch in batches:
            _step(shard, batch)
        shard.eval()
        with torch.no_grad():
            shard(*UNKNOWN)
    assert reads.ops == []
    stats = shard.tier_stats()  # the steps covered inserts, evictions, admission and keys without a slot
    assert stats["evicted"] > 0 and (stats["failed"] > 0 if case["admit_after"] == 1 else stats["not_admitted"] > 0)


def test_the_detector_sees_the_host_reads_of_exact_shapes() -> None:
    """The same step on the CPU kernels (exact shapes) reads the device: the detector is not blind."""
    case = CASES[1]
    shard = _shard("native", case)
    batch = next(_batches(case, 1))
    with HostReads() as reads:
        _step(shard, batch)
    assert "aten.nonzero.default" in reads.ops and "aten._local_scalar_dense.default" in reads.ops
    with HostReads() as reads:
        torch.unique(torch.tensor([3, 1, 3]))
        torch.ones(3)[torch.tensor([True, False, True])]
    assert len(reads.ops) == 2


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['optimizer']}-{c['pooling']}-admit{c['admit_after']}")
def test_fixed_shapes_equal_exact_shapes_and_the_cpu_kernels(case: Case) -> None:
    """Step by step, a lookup taken back (as the fused pipeline discards one) midway: the fixed-shape table
    equals the same torch backend in exact shapes (a layout with a host tier: ``torch.unique``, dropped keys
    removed, host reads) bit for bit, and the CPU kernels in keys, scores and counters exactly and in floats
    within the tiered kernels' tolerance (their sums run in another order)."""
    fixed, exact, native = _shard("torch", case), _shard("torch", case, x=0.5), _shard("native", case)
    shards = (fixed, exact, native)
    for step, batch in enumerate(_batches(case, 12)):
        if step == 5:
            for shard in shards:
                before = shard.lookup_counters()
                shard(batch[0], batch[1], batch[2])
                shard.undo_lookup(before, shard.lookup_counters())
        (a, ga), (b, gb), (c, gc) = (_step(shard, batch) for shard in shards)
        assert torch.equal(a, b), f"output of step {step}"
        torch.testing.assert_close(a, c, atol=ATOL, rtol=RTOL)
        if ga is not None:
            assert gb is not None and gc is not None and torch.equal(ga, gb), f"psw grads of step {step}"
            torch.testing.assert_close(ga, gc, atol=ATOL, rtol=RTOL)
    rows = [shard.dynamic_rows() for shard in shards]
    for i, (x, y, z) in enumerate(zip(*rows)):
        assert torch.equal(x, y)
        if i in (0, 3):  # keys, scores
            assert torch.equal(x, z)
        else:
            torch.testing.assert_close(x, z, atol=ATOL, rtol=RTOL)
    for shard in shards:
        shard.eval()
    a, b, c = (shard(*UNKNOWN) for shard in shards)
    assert torch.equal(a, b)
    torch.testing.assert_close(a, c, atol=ATOL, rtol=RTOL)
    counters = ("occupancy", "inserted", "evicted", "not_admitted", "failed")
    stats = [{k: shard.tier_stats()[k] for k in counters} for shard in shards]
    assert stats[0] == stats[1] == stats[2] and stats[0]["evicted"] > 0
    assert stats[0]["failed"] > 0 if case["admit_after"] == 1 else stats[0]["not_admitted"] > 0


@pytest.mark.parametrize("values", [[], [4], [3, -1, 3, 3, 7, -1], list(range(9, 0, -1))])
def test_fixed_unique_pads_torch_unique_with_its_last_value(values: List[int]) -> None:
    x = torch.tensor(values, dtype=torch.int64)
    uniq, inverse, counts, valid = fixed_unique(x)
    want_u, want_i, want_c = torch.unique(x, sorted=True, return_inverse=True, return_counts=True)
    u = want_u.numel()
    assert uniq.numel() == counts.numel() == valid.numel() == x.numel()
    assert torch.equal(uniq[:u], want_u) and torch.equal(inverse, want_i) and torch.equal(counts[:u], want_c)
    assert valid.tolist() == [i < u for i in range(x.numel())]
    assert all(v == int(want_u[-1]) for v in uniq[u:].tolist())
    assert not counts[u:].any()


@pytest.mark.parametrize("mask", [[], [False, False], [True], [False, True, False, True, True]])
def test_a_fixed_selection_writes_what_the_exact_one_writes(mask: List[bool]) -> None:
    m = torch.tensor(mask, dtype=torch.bool)
    targets = torch.tensor([(5 - i) if held else -1 for i, held in enumerate(mask)], dtype=torch.int64)
    values = torch.arange(len(mask), dtype=torch.float32) + 100
    out = {}
    for fixed in (False, True):
        sel = select(m, fixed)
        t = torch.zeros(6)
        sel.copy_(t, sel.targets(targets), sel.take(values))
        out[fixed] = t
        assert int(sel.count) == sum(mask) and int(sel.count_of(sel.take(m))) == sum(mask)
    want = torch.zeros(6)
    for i, held in enumerate(mask):
        if held:
            want[5 - i] = 100.0 + i
    assert torch.equal(out[False], want) and torch.equal(out[True], want)
