"""A dynamic shard's key index, initial rows and training against independent references.

References: ``harness.dynamic_reference`` (a pure-Python index: dicts, lists and the policy, one key at a
time) for the plan, eviction, admission and counters; fbgemm's CPU TBE (torchrec's FUSED kernel) over the
keys remapped to dense ids for training (capacity >= distinct keys, constant initializer).
"""

from __future__ import annotations

import random
import warnings
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from harness.dynamic_reference import BUCKET_TAG, ReferenceIndex, reference_bucket, reference_init_row, reference_salt
from harness.tiered_shards import ATOL, RTOL

from recpipe.pipeline.placement import BUCKET_SLOTS, DynamicInitializer, DynamicTableOptions
from recpipe.pipeline.tiered.dynamic.dynamic_shard import DynamicEmbeddingShard
from recpipe.pipeline.tiered.dynamic.key_hashing import bucket_of, init_rows, init_salt, salt_of
from recpipe.pipeline.tiered.dynamic.key_index import DynamicKeyIndex, torch_unique
from recpipe.pipeline.tiered.dynamic.plan import torch_hash_plan
from recpipe.pipeline.tiered.optim import TieredOptimizerConfig
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard
from recpipe.pipeline.tiered.shard_routing import WholeTableRouting
from recpipe.pipeline.tiered.state import TieredCheckpointError

LR = 0.05
DIM = 8
EXTREME_KEYS = [0, -1, 1, 2**63 - 1, -(2**63), 2**40 + 3, -(2**40) - 3]


def _keys(rng: random.Random, n: int) -> List[int]:
    return [rng.randrange(-(2**63), 2**63) for _ in range(n)] + EXTREME_KEYS


def test_bucket_hash_and_initial_rows_match_the_reference() -> None:
    keys = _keys(random.Random(0), 500)
    salt = salt_of(7, 0x64796E2D62756B74)
    assert salt == reference_salt(7, BUCKET_TAG)
    assert bucket_of(torch.tensor(keys), salt, 37).tolist() == [reference_bucket(k, salt, 37) for k in keys]
    uniform = DynamicInitializer()
    got = init_rows(torch.tensor(keys), 4, uniform, uniform.bounds(100), init_salt(3, "t"), torch.float64)
    want = [reference_init_row(k, 4, 3, "t", "uniform", -0.1, 0.1) for k in keys]
    assert got.tolist() == want
    normal = DynamicInitializer(mode="normal", std=0.1, lower=-0.2, upper=0.2)
    got = init_rows(torch.tensor(keys), 4, normal, normal.bounds(100), init_salt(3, "t"), torch.float64)
    want = [reference_init_row(k, 4, 3, "t", "normal", -0.2, 0.2, 0.0, 0.1, clamp=True) for k in keys]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=0, rtol=1e-14)
    assert (
        init_rows(torch.tensor(keys), 4, uniform, (-1, 1), init_salt(3, "u"), torch.float64)
        .ne(init_rows(torch.tensor(keys), 4, uniform, (-1, 1), init_salt(3, "t"), torch.float64))
        .any()
    ), "another table name draws other rows"


def _state_of(ref: ReferenceIndex, slots: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    keys, scores = torch.zeros(slots, dtype=torch.int64), torch.zeros(slots, dtype=torch.int64)
    sizes = torch.zeros(len(ref.main.buckets), dtype=torch.int64)
    for b, bucket in enumerate(ref.main.buckets):
        sizes[b] = len(bucket)
        for j, (k, s) in enumerate(bucket):
            keys[b * BUCKET_SLOTS + j], scores[b * BUCKET_SLOTS + j] = k, s
    return keys, scores, sizes


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_torch_plan_matches_the_reference_plan(eviction: str) -> None:
    rng = random.Random(1)
    ref = ReferenceIndex(num_buckets=4, slots=BUCKET_SLOTS, seed=5, eviction=eviction)
    for step in range(60):
        batch = [rng.randrange(-50, 200) for _ in range(rng.randrange(1, 40))]
        uniq = sorted(set(batch))
        keys, scores, sizes = _state_of(ref, 4 * BUCKET_SLOTS)
        want_insert = torch.ones(len(uniq), dtype=torch.bool)
        found, slot = torch_hash_plan(torch.tensor(uniq), want_insert, keys, scores, sizes, BUCKET_SLOTS, ref.main.salt)
        ref_found = [ref.main.find(k) for k in uniq]
        assert found.tolist() == [-1 if f is None else f for f in ref_found], step
        plan = ref.main.plan_inserts(
            [k for k, f in zip(uniq, ref_found) if f is None], {f for f in ref_found if f is not None}
        )
        want = [-1 if f is not None or plan[k] is None else plan[k] for k, f in zip(uniq, ref_found)]
        assert slot.tolist() == want, step
        ref.find_or_insert(batch, True)


@pytest.mark.parametrize("shapes", ["exact", "fixed"])
@pytest.mark.parametrize("admit_after", [1, 3])
@pytest.mark.parametrize("eviction", ["lru", "lfu", "step", "custom"])
def test_index_eviction_admission_and_counters_match_the_reference(
    eviction: str, admit_after: int, shapes: str
) -> None:
    """The index in exact shapes (``torch.unique``, as the CPU kernels) and in fixed shapes (padded dedupe
    and selections, the torch implementation) against the pure-Python reference."""
    rng = random.Random(2)
    # a counter table of 2 buckets beside 4 of rows: full counter buckets forget their lowest counts
    ref = ReferenceIndex(
        num_buckets=4, slots=BUCKET_SLOTS, seed=5, eviction=eviction, admit_after=admit_after, counter_buckets=2
    )
    options = DynamicTableOptions(eviction=eviction, admit_after=admit_after, seed=5, on_full="ignore")
    index = DynamicKeyIndex(
        4 * BUCKET_SLOTS,
        options,
        "t",
        torch.device("cpu"),
        torch_hash_plan,
        unique=torch_unique if shapes == "exact" else None,
        counter_slots=2 * BUCKET_SLOTS,
    )
    for step in range(80):
        batch = [rng.randrange(-60, 200) for _ in range(rng.randrange(1, 50))]
        if eviction == "custom":
            ref.custom_score = index.custom_score = rng.randrange(0, 5)
        failed_before = ref.stats["failed"]
        want, inserted = ref.find_or_insert(batch, True, step=step)
        got = index.find_or_insert(torch.tensor(batch), step=step, journal=False)
        assert got.slots.tolist() == want, step
        new = list(zip(got.new_slots.tolist(), got.new_keys.tolist()))
        if shapes == "exact":
            # complete: every key has a slot, claimed only when no key can lack one (no admission, none failed)
            assert got.complete == (admit_after == 1 and ref.stats["failed"] == failed_before)
            assert not got.complete or min(want) >= 0
            assert sorted(new) == sorted(inserted)
        else:  # the new rows, then the last repeated; none when the selection holds nothing
            assert not got.complete and got.live is not None and bool(got.live) == bool(inserted)
            assert (sorted(set(new)) if inserted else []) == sorted(inserted)
            assert new[: len(inserted)] == sorted(new[: len(inserted)], key=new.index) and len(new) == len(batch)
        assert dict(zip(ref.stats, index.counters.tolist())) == ref.stats
        assert int(index.occupancy()) == ref.occupancy
    assert index.find(torch.tensor(batch)).tolist() == ref.find_or_insert(batch, False)[0]
    assert ref.stats["evicted"] > 0 and (admit_after == 1 or ref.stats["not_admitted"] > 0)
    if admit_after > 1:  # the counter table filled, so the comparison covered its forgetting
        assert sum(len(b) for b in ref.counter.buckets) == 2 * BUCKET_SLOTS


def _dense_ids(batches: List[torch.Tensor]) -> Dict[int, int]:
    order: Dict[int, int] = {}
    for b in batches:
        for k in b.tolist():
            order.setdefault(k, len(order))
    return order


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("mode,x", [("HYBRID", 1.0), ("HYBRID", 0.5), ("CACHING", 0.25)])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_dynamic_table_equals_static_tables_over_remapped_keys(
    backend: str, mode: str, x: float, optimizer: str
) -> None:
    """Capacity >= distinct keys and a constant initializer: step by step the dynamic table equals a static
    tiered table of the same kernel over the keys remapped to dense ids (first sight order) bit for bit,
    and fbgemm's FUSED table over them within the tiered kernels' tolerance of fbgemm (``harness.tiered_shards``:
    the tiered kernels sum a row's gradients in another order than fbgemm's CPU TBE; fbgemm-gpu-cpu has no
    CPU Adam, so Adam is compared with the static tiered table only)."""
    gen = torch.Generator().manual_seed(3)
    pool = torch.tensor(_keys(random.Random(3), 150))
    batches = [pool[torch.randint(0, pool.numel(), (60,), generator=gen)] for _ in range(6)]
    offsets = torch.arange(0, 61, 5)
    dense = _dense_ids(batches)
    opt = TieredOptimizerConfig(optimizer=optimizer, learning_rate=LR, eps=1e-8)
    placement: Dict[str, object] = dict(mode=mode, cache_load_factor=x, backend=backend, optimizer=opt)
    options = DynamicTableOptions(capacity=512, initializer=DynamicInitializer(mode="constant", value=0.125))
    shard = DynamicEmbeddingShard(num_embeddings=512, embedding_dim=DIM, options=options, **placement)  # type: ignore[arg-type]
    static = TieredEmbeddingShard(
        num_embeddings=len(dense),
        embedding_dim=DIM,
        routing=WholeTableRouting(len(dense)),
        weight_init_min=0.125,
        weight_init_max=0.125,
        **placement,  # type: ignore[arg-type]
    )
    fbgemm_optim = {"sgd": OptimType.EXACT_SGD, "rowwise_adagrad": OptimType.EXACT_ROWWISE_ADAGRAD}
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(len(dense), DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=fbgemm_optim.get(optimizer, OptimType.EXACT_SGD),
        learning_rate=LR,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
    )
    with torch.no_grad():
        tbe.split_embedding_weights()[0].fill_(0.125)
    for step, keys in enumerate(batches):
        grad = torch.randn(12, DIM, generator=gen)
        ids = torch.tensor([dense[k] for k in keys.tolist()])
        out, want, fused = shard(keys, offsets), static(ids, offsets), tbe(ids, offsets)
        assert torch.equal(out, want), f"forward of step {step}"
        if optimizer in fbgemm_optim:
            torch.testing.assert_close(out, fused, atol=ATOL, rtol=RTOL)
        for t in (out, want, fused):
            t.backward(grad)
    keys_held, weights, state, _ = shard.dynamic_rows()
    rows = torch.tensor([dense[k] for k in keys_held.tolist()])
    static_w, static_s = (
        static.tiers.read_rows() if mode != "CACHING" else (static.flush(), *static.tiers.read_rows())[1:]
    )
    assert torch.equal(weights, static_w.index_select(0, rows))
    assert torch.equal(state, static_s.index_select(0, rows))
    if optimizer in fbgemm_optim:
        fused_w = tbe.split_embedding_weights()[0].index_select(0, rows)
        torch.testing.assert_close(weights, fused_w, atol=ATOL, rtol=RTOL)
    assert shard.tier_stats()["occupancy"] == len(dense) == shard.tier_stats()["inserted"]


def _shard(**kw: object) -> DynamicEmbeddingShard:
    args: Dict[str, object] = dict(num_embeddings=64, embedding_dim=4, options=DynamicTableOptions(seed=1))
    args.update(kw)
    return DynamicEmbeddingShard(**args)  # type: ignore[arg-type]


def test_eval_lookups_insert_nothing_and_unknown_keys_pool_as_nothing() -> None:
    shard = _shard()
    offsets = torch.tensor([0, 2, 3])
    shard(torch.tensor([5, 9]), torch.tensor([0, 1, 2]))
    before = shard.tier_stats()
    shard.eval()
    out = shard(torch.tensor([5, 123456789, 77]), offsets)
    with torch.no_grad():
        shard.train()
        out_nograd = shard(torch.tensor([5, 123456789, 77]), offsets)
    assert shard.tier_stats()["occupancy"] == before["occupancy"] == 2
    assert shard.tier_stats()["inserted"] == 2
    assert torch.equal(out[1], torch.zeros(4)), "a bag of only unknown keys pools to zeros"
    assert torch.equal(out, out_nograd)
    _, w, _, _ = shard.dynamic_rows()
    assert torch.equal(out[0], w[shard.dynamic_rows()[0].tolist().index(5)])


def test_new_rows_depend_only_on_seed_table_and_key() -> None:
    """The same key gets the same initial row whatever the shard count, capacity or arrival order."""
    keys = torch.tensor(EXTREME_KEYS + [10, 20, 30])
    a = _shard(options=DynamicTableOptions(seed=4, capacity=64))
    b = _shard(options=DynamicTableOptions(seed=4, capacity=4096), shards=3, key_rank=2)
    with torch.no_grad():
        a(keys, torch.arange(keys.numel() + 1))
        b(keys.flip(0), torch.arange(keys.numel() + 1))
    ka, wa, _, _ = a.dynamic_rows()
    kb, wb, _, _ = b.dynamic_rows()
    assert ka.numel() == 0 and kb.numel() == 0, "no-grad lookups insert nothing"
    a(keys, torch.arange(keys.numel() + 1))
    b(keys.flip(0), torch.arange(keys.numel() + 1))
    ka, wa, _, _ = a.dynamic_rows()
    kb, wb, _, _ = b.dynamic_rows()
    assert torch.equal(wa[torch.argsort(ka)], wb[torch.argsort(kb)])
    bound = (1.0 / 64) ** 0.5
    want = torch.tensor([reference_init_row(k, 4, 4, "table", "uniform", -bound, bound) for k in sorted(ka.tolist())])
    assert torch.equal(wa[torch.argsort(ka)], want.to(torch.float32))


def test_an_evicted_key_returns_fresh() -> None:
    """One bucket (16 slots), LRU: the 17th key evicts the oldest; its row and optimizer state are
    dropped, so when it returns its row is the initial one again."""
    shard = _shard(
        num_embeddings=16,
        options=DynamicTableOptions(seed=2, capacity=16, eviction="lru"),
        optimizer=TieredOptimizerConfig(optimizer="rowwise_adagrad", learning_rate=0.5),
    )
    one = torch.tensor([0, 1])
    shard(torch.tensor([1000]), one).sum().backward()
    trained = shard.dynamic_rows()
    assert trained[2].abs().sum() > 0, "the update left optimizer state"
    for k in range(16):
        shard(torch.tensor([k]), one).sum().backward()
    assert 1000 not in shard.dynamic_rows()[0].tolist()
    assert shard.tier_stats()["evicted"] == 1
    out = shard(torch.tensor([1000]), one)
    bound = 0.25
    want = torch.tensor(reference_init_row(1000, 4, 2, "table", "uniform", -bound, bound), dtype=torch.float32)
    assert torch.equal(out[0].detach(), want)
    keys, _, state, _ = shard.dynamic_rows()
    assert torch.equal(state[keys.tolist().index(1000)], torch.zeros_like(state[0]))


def test_on_full_error_refuses_the_batch_and_changes_nothing() -> None:
    shard = _shard(num_embeddings=16, options=DynamicTableOptions(capacity=16, on_full="error"))
    keys = torch.arange(17) * 7919
    with pytest.raises(ValueError, match="(?s)found no slot.*Nothing was changed"):
        shard(keys, torch.tensor([0, 17]))
    assert shard.tier_stats()["occupancy"] == 0 and shard.tier_stats()["failed"] == 0
    warn = _shard(num_embeddings=16, options=DynamicTableOptions(capacity=16, on_full="warning"))
    with pytest.warns(RuntimeWarning, match="found no slot"):
        warn(keys, torch.tensor([0, 17]))
    assert warn.tier_stats()["failed"] == 1 and warn.tier_stats()["occupancy"] == 16


@pytest.mark.parametrize("mode,x", [("HYBRID", 1.0), ("CACHING", 0.25)])
def test_undo_lookup_takes_back_inserts_evictions_and_rows(mode: str, x: float) -> None:
    shard = _shard(
        num_embeddings=32, options=DynamicTableOptions(capacity=32, on_full="ignore"), mode=mode, cache_load_factor=x
    )
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        shard(torch.randint(0, 200, (40,), generator=gen), torch.tensor([0, 40])).sum().backward()
    before_rows = shard.dynamic_rows()
    before_stats = shard.tier_stats()
    token = shard.lookup_counters()
    out = shard(torch.randint(0, 200, (40,), generator=gen), torch.tensor([0, 40]))
    shard.undo_lookup(token, shard.lookup_counters())
    del out
    after_rows = shard.dynamic_rows()
    for a, b in zip(before_rows, after_rows):
        assert torch.equal(a, b)
    for k in ("occupancy", "inserted", "evicted"):
        assert shard.tier_stats()[k] == before_stats[k]


def test_rows_round_trip_through_a_load_at_another_capacity() -> None:
    src = _shard(options=DynamicTableOptions(capacity=64, eviction="lfu"))
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        src(torch.randint(-100, 100, (30,), generator=gen), torch.tensor([0, 30])).sum().backward()
    keys, w, s, scores = src.dynamic_rows()
    dst = _shard(options=DynamicTableOptions(capacity=256, eviction="lfu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dst.load_dynamic_rows(keys, w, s, scores, step=3)
    k2, w2, s2, sc2 = dst.dynamic_rows()
    o1, o2 = torch.argsort(keys), torch.argsort(k2)
    assert torch.equal(keys[o1], k2[o2]) and torch.equal(w[o1], w2[o2]) and torch.equal(scores[o1], sc2[o2])
    probe = keys[:5]
    dst.eval()
    src.eval()
    assert torch.equal(dst(probe, torch.arange(6)), src(probe, torch.arange(6)))


def test_the_id_keyed_export_is_refused_and_state_dict_carries_the_raw_keys() -> None:
    """The id-keyed tiered export cannot carry raw keys: ``export_state`` refuses, naming the ways to save;
    ``state_dict()`` carries the keys with their rows, state and scores, the step and the lru clock."""
    shard = _shard()
    shard(torch.tensor([3, -4]), torch.tensor([0, 2])).sum().backward()
    with pytest.raises(TieredCheckpointError, match="(?s)recpipe.pipeline.checkpoint.save.*export_dynamic_state"):
        shard.export_state()
    state = shard.state_dict()
    assert sorted(state["keys"].tolist()) == [-4, 3] and state["_extra_state"]["clock"] == 1
    fresh = _shard()
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(shard.dynamic_rows(), fresh.dynamic_rows()))
    assert (fresh.tier_stats()["occupancy"], fresh.tiers.export_step(), fresh.index.clock) == (2, 1, 1)


@pytest.mark.parametrize("admission_capacity, counter_keys", [(None, 250), (48, 48)])
def test_the_admission_counter_table_holds_admission_capacity_keys_split_over_the_shards(
    admission_capacity: Optional[int], counter_keys: int
) -> None:
    options = DynamicTableOptions(capacity=1_000, admit_after=2, admission_capacity=admission_capacity)
    shard = DynamicEmbeddingShard(num_embeddings=1_000, embedding_dim=8, options=options, shards=2, backend="native")
    per_shard = -(-(-(-counter_keys // 2)) // BUCKET_SLOTS) * BUCKET_SLOTS  # ceil(keys / 2), whole buckets
    assert shard.index.counter_slots == per_shard
    assert shard.index.admission is not None and shard.index.admission.keys.numel() == per_shard
    no_admission = DynamicEmbeddingShard(
        num_embeddings=1_000, embedding_dim=8, options=DynamicTableOptions(capacity=1_000), backend="native"
    )
    assert no_admission.index.counter_slots == 0 and no_admission.index.admission is None
