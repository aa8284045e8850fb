"""Dynamic tables through recpipe's DCP checkpoints and ``state_dict()``, keyed by raw key.

The pipeline tests' two-module model with every table dynamic (``harness.dynamic_models``) trains
``K`` steps on 2 gloo ranks (row-wise, capacities small enough that keys are evicted), is saved,
and is loaded into 2 ranks (continued training bit-identical to the uninterrupted run: losses and
tables), into 1 rank and into table-wise sharding (every saved key with its row, optimizer state
and score, compared key for key with ``gather_dynamic_table`` of the saving model). A run trained
at 2 ranks then resumed at 1 is compared, with capacities above the distinct keys so that no key
is evicted at either world size, against a 1-rank model restored by hand from the gathered table
(bit for bit) and against an uninterrupted 1-rank run of the same global batches (the keys and
their lfu scores: the rows themselves differ, since torchrec's row-wise sparse gradients are each
rank's loss's, not the global batch's). Bad checkpoints are refused naming the table and the fix;
shard-level loads are checked against the pure-Python bucket hash (``harness.dynamic_reference``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from harness.dynamic_models import build_dynamic, dynamic_shards, raw_key_batches
from harness.dynamic_reference import BUCKET_TAG, reference_bucket, reference_salt
from harness.gloo import run_gloo
from harness.pipelines import TwoSparseBatch, run_reference
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.pipeline.placement import BUCKET_SLOTS, DynamicTableOptions
from recpipe.pipeline.tiered.dynamic.dynamic_shard import DynamicEmbeddingShard
from recpipe.pipeline.tiered.dynamic.dynamic_state import export_dynamic_state, load_dynamic_states
from recpipe.pipeline.tiered.optim import TieredOptimizerConfig
from recpipe.pipeline.tiered.state import TieredCheckpointError

K, M, SEED = 4, 4, 3  # steps before the save, steps after it, the batches' seed
TABLES = ("t0", "t1", "s0")
ROOMY = 16  # capacity scale at which every key of K + M steps fits at 1 and 2 ranks (asserted)
LARGER = 4  # capacity scale of the loading models that must hold every key of the small tables
Rows = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _dump(dmp: Any) -> Dict[str, Rows]:
    """Every table's ``(keys, weights, optimizer state, scores)`` gathered over the ranks, by ascending key."""
    from recpipe.pipeline import gather_dynamic_table

    out: Dict[str, Rows] = {}
    for table in TABLES:
        d = gather_dynamic_table(dmp, table)
        order = torch.argsort(d.keys)
        out[table] = (d.keys[order], d.weights[order], d.optimizer_state[order], d.scores[order])
    return out


def _admission_counters(dmp: Any) -> Dict[str, Dict[int, int]]:
    """This rank's admission counters per table: key -> sightings."""
    return {
        table: dict(zip(*(t.tolist() for t in shard.index.export_admission())))
        for table, shard in dynamic_shards(dmp).items()
    }


def _train(dmp: Any, opt: Any, batches: List[TwoSparseBatch]) -> List[float]:
    return [float(loss) for loss in run_reference(dmp, opt, batches)[0]]


def _load_dense_optimizer(opt: Any, state: Dict[str, Any]) -> None:
    """Loads the dense Adam's saved state (a KeyedOptimizer loads only into initialized state: its zero-grad
    step leaves the weights as they are)."""
    opt.init_state()
    opt.load_state_dict(state)


def _clocks_and_steps(dmp: Any) -> Dict[str, Tuple[int, int]]:
    return {t: (s.index.clock, s.tiers.export_step()) for t, s in dynamic_shards(dmp).items()}


def _lost_keys(dmp: Any) -> int:
    """Keys evicted or refused a slot on this rank, over every table."""
    return sum(int(s.tier_stats()["evicted"] + s.tier_stats()["failed"]) for s in dynamic_shards(dmp).values())


def _merged(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> KeyedJaggedTensor:
    da, db = a.to_dict(), b.to_dict()
    keys = a.keys()
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.cat([torch.cat([da[k].values(), db[k].values()]) for k in keys]),
        lengths=torch.cat([torch.cat([da[k].lengths(), db[k].lengths()]) for k in keys]),
    )


def _global_batches() -> List[TwoSparseBatch]:
    """Both ranks' batches of each step as one batch (rank 0's samples, then rank 1's)."""
    r0, r1 = raw_key_batches(0, K + M, SEED), raw_key_batches(1, K + M, SEED)
    return [
        TwoSparseBatch(
            torch.cat([a.dense, b.dense]),
            _merged(a.ebc_features, b.ebc_features),
            _merged(a.ec_features, b.ec_features),
            torch.cat([a.labels, b.labels]),
        )
        for a, b in zip(r0, r1)
    ]


def _save_runs(rank: int, world: int, root: str) -> Dict[str, Any]:
    """Trains K steps and saves (small capacities: ``evict``; roomy lfu tables: ``roomy``); then the
    small model goes on M steps uninterrupted."""
    from recpipe.pipeline import checkpoint

    batches = raw_key_batches(rank, K + M, SEED)
    out: Dict[str, Any] = {}
    dmp, opt = build_dynamic(world, "row_wise")
    _train(dmp, opt, batches[:K])
    checkpoint.save(dmp, f"{root}/evict", extra_state=opt.state_dict())
    out["evict_saved"], out["evict_clocks"] = _dump(dmp), _clocks_and_steps(dmp)
    out["evict_lost"] = _lost_keys(dmp)
    out["evict_losses"] = _train(dmp, opt, batches[K:])
    out["evict_final"] = _dump(dmp)
    dmp, opt = build_dynamic(world, "row_wise", eviction="lfu", capacity_scale=ROOMY)
    _train(dmp, opt, batches[:K])
    checkpoint.save(dmp, f"{root}/roomy", extra_state=opt.state_dict())
    out["roomy_saved"], out["roomy_clocks"] = _dump(dmp), _clocks_and_steps(dmp)
    out["roomy_dense"] = {k: v.clone() for k, v in dmp.state_dict().items() if k.startswith(("bottom.", "over."))}
    _train(dmp, opt, batches[K:])
    out["roomy_lost"] = _lost_keys(dmp)
    dmp, opt = build_dynamic(world, "row_wise", admit_after=2)
    _train(dmp, opt, batches[:K])
    checkpoint.save(dmp, f"{root}/admit", extra_state=opt.state_dict())
    out["admit_counters"] = _admission_counters(dmp)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Tuple[str, List[Dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("dynamic_ckpt"))
    return root, run_gloo(2, _save_runs, root)


def _assert_same(got: Dict[str, Rows], want: Dict[str, Rows], what: str) -> None:
    for table in TABLES:
        for name, a, b in zip(("keys", "weights", "optimizer state", "scores"), got[table], want[table]):
            assert torch.equal(a, b), f"{what}: table {table} {name}"


def _resume_at_two_ranks(rank: int, world: int, root: str) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint

    out: Dict[str, Any] = {}
    checkpoint.verify_checkpoint(f"{root}/evict")
    dmp, opt = build_dynamic(world, "row_wise")
    checkpoint.load(dmp, f"{root}/evict")
    _load_dense_optimizer(opt, checkpoint.read_extra_state(f"{root}/evict", rank).value)
    out["loaded"] = _dump(dmp)
    # model.state_dict() / load_state_dict of the same sharding: every key at its slot, rows and clock alike
    twin, _ = build_dynamic(world, "row_wise")
    twin.load_state_dict(dmp.state_dict())
    pairs = [(dynamic_shards(twin)[t], s) for t, s in dynamic_shards(dmp).items()]
    out["twin"] = all(
        all(torch.equal(x, y) for x, y in zip(a.index.export() + a.dynamic_rows(), b.index.export() + b.dynamic_rows()))
        and a.index.clock == b.index.clock
        for a, b in pairs
    )
    out["losses"] = _train(dmp, opt, raw_key_batches(rank, K + M, SEED)[K:])
    out["final"] = _dump(dmp)
    tw, _ = build_dynamic(world, "table_wise", capacity_scale=LARGER)
    checkpoint.load(tw, f"{root}/evict")
    out["table_wise"] = _dump(tw)
    checkpoint.save(tw, f"{root}/table_wise")
    rw, _ = build_dynamic(world, "row_wise", capacity_scale=LARGER)
    checkpoint.load(rw, f"{root}/table_wise")
    out["row_wise_again"] = _dump(rw)
    return out


def test_two_rank_resume_with_evictions_is_bit_identical_and_reshards_table_wise(
    saved: Tuple[str, List[Dict[str, Any]]],
) -> None:
    """Saved after evictions at 2 ranks row-wise: verified, loaded into 2 ranks, the next M steps' losses
    and tables equal the uninterrupted run's; ``state_dict()`` keeps every key at its slot; row-wise ->
    table-wise -> row-wise loads keep every saved key with its row, state and score."""
    root, runs = saved
    assert all(r["evict_lost"] > 0 for r in runs), "the small tables evict keys before the save"
    got = run_gloo(2, _resume_at_two_ranks, root)
    for rank in range(2):
        _assert_same(got[rank]["loaded"], runs[0]["evict_saved"], "loaded at 2 ranks")
        assert got[rank]["twin"], "state_dict() round trip"
        assert got[rank]["losses"] == runs[rank]["evict_losses"], f"losses of rank {rank} after the resume"
        _assert_same(got[rank]["final"], runs[0]["evict_final"], "tables after the resumed steps")
        _assert_same(got[rank]["table_wise"], runs[0]["evict_saved"], "loaded table-wise")
        _assert_same(got[rank]["row_wise_again"], runs[0]["evict_saved"], "table-wise checkpoint loaded row-wise")


def _resume_at_one_rank(rank: int, world: int, root: str, saved: Dict[str, Any]) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint

    out: Dict[str, Any] = {}
    dmp, _ = build_dynamic(world, "row_wise", capacity_scale=LARGER)
    checkpoint.load(dmp, f"{root}/evict")
    out["evict_loaded"], out["evict_clocks"] = _dump(dmp), _clocks_and_steps(dmp)
    # counters for every saved key (a full counter bucket would keep only its highest counts)
    dmp, _ = build_dynamic(world, "row_wise", admit_after=2, admission_capacity=4096)
    checkpoint.load(dmp, f"{root}/admit")
    out["admit_counters"] = _admission_counters(dmp)
    batches = _global_batches()
    dense_opt = checkpoint.read_extra_state(f"{root}/roomy", 0).value
    resumed, opt_r = build_dynamic(world, "row_wise", eviction="lfu", capacity_scale=ROOMY)
    checkpoint.load(resumed, f"{root}/roomy")
    _load_dense_optimizer(opt_r, dense_opt)
    # by hand: the gathered table, the dense weights, the step and the clock the saving shards had
    by_hand, opt_h = build_dynamic(world, "row_wise", eviction="lfu", capacity_scale=ROOMY)
    by_hand.load_state_dict(saved["dense"], strict=False)
    for table, shard in dynamic_shards(by_hand).items():
        clock, step = saved["clocks"][table]
        shard.load_dynamic_rows(*saved["rows"][table], step=step)
        shard.index.clock = clock
    _load_dense_optimizer(opt_h, dense_opt)
    alone, opt_a = build_dynamic(world, "row_wise", eviction="lfu", capacity_scale=ROOMY)
    _train(alone, opt_a, batches[:K])
    for name, (model, opt) in {
        "resumed": (resumed, opt_r),
        "by_hand": (by_hand, opt_h),
        "alone": (alone, opt_a),
    }.items():
        out[f"{name}_losses"] = _train(model, opt, batches[K:])
        out[name], out[f"{name}_lost"] = _dump(model), _lost_keys(model)
    return out


def test_two_rank_checkpoint_resumes_at_one_rank(saved: Tuple[str, List[Dict[str, Any]]]) -> None:
    """A 2-rank checkpoint loads into 1 rank holding every saved key (row, state, score), the clock, the step and
    the admission counters;
    resumed at 1 rank, training equals a 1-rank model given the saved table by hand, bit for bit; with no key
    evicted at either world size, the keys and lfu scores equal an uninterrupted 1-rank run's."""
    root, runs = saved
    by_hand = {
        "dense": runs[0]["roomy_dense"],
        "rows": runs[0]["roomy_saved"],
        "clocks": {t: (max(r["roomy_clocks"][t][0] for r in runs), runs[0]["roomy_clocks"][t][1]) for t in TABLES},
    }
    got = run_gloo(1, _resume_at_one_rank, root, by_hand)[0]
    _assert_same(got["evict_loaded"], runs[0]["evict_saved"], "loaded at 1 rank")
    for table in TABLES:  # every saving rank's admission counters, re-routed into the one shard
        saved_counters = {k: c for r in runs for k, c in r["admit_counters"][table].items()}
        assert got["admit_counters"][table] == saved_counters and len(saved_counters) > 5, table
    for table, (clock, step) in got["evict_clocks"].items():
        assert clock == max(r["evict_clocks"][table][0] for r in runs) and step == runs[0]["evict_clocks"][table][1]
    assert got["resumed_losses"] == got["by_hand_losses"]
    _assert_same(got["resumed"], got["by_hand"], "resumed at 1 rank vs restored by hand")
    assert got["resumed_lost"] == got["alone_lost"] == 0 and all(r["roomy_lost"] == 0 for r in runs)
    for table in TABLES:
        resumed, alone = got["resumed"][table], got["alone"][table]
        assert torch.equal(resumed[0], alone[0]) and torch.equal(resumed[3], alone[3]), table
        assert resumed[0].numel() > 20, "the table holds keys"


def _dcp_key(keys: Any, table: str, rank: int, field: str) -> str:
    """The checkpoint key of a field of key shard ``rank``'s rows of ``table`` (``ebc.embedding_bags.t0``; the
    fqn may carry a wrapper's prefix such as DDP's ``module.``)."""
    found = [k for k in keys if k.startswith("dynamic.") and k.endswith(f"{table}.rank{rank}.{field}")]
    assert len(found) == 1, (table, rank, field, found)
    return found[0]


def _refused(call: Callable[..., Any], *args: Any) -> str:
    """``call(*args)``'s ``CheckpointError`` as ``"<type>: <message>"`` ("" when it returns)."""
    from recpipe.pipeline.checkpoint import CheckpointError

    try:
        call(*args)
    except CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _bad_checkpoints(rank: int, world: int, root: str) -> Dict[str, Any]:
    import torch.distributed.checkpoint as torch_dcp

    from recpipe.pipeline import checkpoint

    out: Dict[str, Any] = {}
    evict = f"{root}/evict"
    for name, kwargs in {"optimizer": dict(fused="sgd"), "eviction": dict(eviction="lfu")}.items():
        model, _ = build_dynamic(world, "row_wise", capacity_scale=LARGER, **kwargs)  # type: ignore[arg-type]
        out[name] = _refused(checkpoint.load, model, evict)
        out[f"{name}_unchanged"] = all(_dump(model)[t][0].numel() == 0 for t in TABLES)
    static, _ = build_dynamic(world, "row_wise", static=True)
    out["static_loads_dynamic"] = _refused(checkpoint.load, static, evict)
    checkpoint.save(static, f"{root}/static")
    dyn, opt = build_dynamic(world, "row_wise", capacity_scale=LARGER)
    out["dynamic_loads_static"] = _refused(checkpoint.load, dyn, f"{root}/static")
    _train(dyn, opt, raw_key_batches(0, 2, SEED))
    shard = dynamic_shards(dyn)["t1"]
    good = shard.dynamic_rows()
    for name in ("repeated", "nan"):  # written by hand: save itself refuses NaN rows
        state = checkpoint.dcp_state_dict(dyn)
        keys = state[_dcp_key(state, "ebc.embedding_bags.t1", 0, "keys")]
        if name == "repeated":
            keys[1] = keys[0]
        else:
            state[_dcp_key(state, "ebc.embedding_bags.t1", 0, "weights")][2, 1] = float("nan")
        torch_dcp.save(state, checkpoint_id=f"{root}/{name}")
        checkpoint.write_digests(f"{root}/{name}")
        out[name] = _refused(checkpoint.load, dyn, f"{root}/{name}")
    out["bad_unchanged"] = all(torch.equal(a, b) for a, b in zip(good, shard.dynamic_rows()))
    keys, weights, state, scores = good
    weights = weights.clone()
    weights[0, 0] = float("inf")
    shard.load_dynamic_rows(keys, weights, state, scores, step=shard.tiers.export_step())
    out["save_non_finite"] = _refused(checkpoint.save, dyn, f"{root}/inf")
    return out


def test_bad_dynamic_checkpoints_are_refused_naming_the_table_and_the_fix(
    saved: Tuple[str, List[Dict[str, Any]]],
) -> None:
    """Another optimizer or eviction, a table static on one side and dynamic on the other, repeated keys and
    NaN rows are refused before the model changes; a save of inf rows is refused."""
    root, _ = saved
    got = run_gloo(1, _bad_checkpoints, root)[0]
    table = "ebc.embedding_bags.t0'"  # its fqn (DDP's wrapper prefix before it)
    assert "CheckpointTableError" in got["optimizer"] and "optimizer='rowwise_adagrad'" in got["optimizer"]
    assert "dynamic table 't0'" in got["optimizer"] and got["optimizer_unchanged"]
    assert "eviction='lru'" in got["eviction"] and got["eviction_unchanged"]
    static = got["static_loads_dynamic"]
    assert f"{table} was saved dynamic, but this model plans it as a static tiered table" in static
    assert f"{table} is dynamic in this model, but checkpoint" in got["dynamic_loads_static"]
    assert "PlacementConstraints(dynamic=...)" in got["dynamic_loads_static"]
    assert "appear more than once" in got["repeated"] and "dynamic table 't1'" in got["repeated"]
    assert "hold NaN or inf" in got["nan"] and "dynamic table 't1'" in got["nan"]
    assert got["bad_unchanged"], "a refused load leaves the table as it was"
    assert got["save_non_finite"].startswith("CheckpointSaveError") and "dynamic table" in got["save_non_finite"]


def _shard(**kw: Any) -> DynamicEmbeddingShard:
    args: Dict[str, Any] = dict(
        num_embeddings=64,
        embedding_dim=4,
        options=DynamicTableOptions(capacity=64, seed=1, on_full="ignore"),
        optimizer=TieredOptimizerConfig(optimizer="rowwise_adagrad", learning_rate=0.3),
    )
    args.update(kw)
    return DynamicEmbeddingShard(**args)


def _trained(shard: DynamicEmbeddingShard, steps: int = 5) -> DynamicEmbeddingShard:
    """``shard`` after ``steps`` training lookups of the keys it owns among 40 random ones."""
    gen = torch.Generator().manual_seed(4)
    for _ in range(steps):
        keys = torch.randint(-300, 300, (40,), generator=gen)
        keys = keys[shard.owned(keys)]
        shard(keys, torch.tensor([0, keys.numel()])).sum().backward()
    return shard


@pytest.mark.parametrize("admit_after", [1, 3])
def test_shard_state_dict_round_trip_keeps_slots_and_continues_alike(admit_after: int) -> None:
    """``shard.state_dict()`` into a fresh shard: the same keys at the same slots, rows, state, scores, step,
    clock and admission counters; the next lookups (with evictions, whose score ties break by slot, and keys
    admitted on the sightings counted before the save) give the same rows."""
    options = DynamicTableOptions(capacity=64, seed=1, on_full="ignore", admit_after=admit_after)
    src = _trained(_shard(options=options))
    dst = _shard(options=options)
    dst.load_state_dict(src.state_dict())
    for a, b in zip(src.index.export() + src.dynamic_rows(), dst.index.export() + dst.dynamic_rows()):
        assert torch.equal(a, b)
    for a, b in zip(src.index.export_admission(), dst.index.export_admission()):
        assert torch.equal(a, b)
    assert (src.index.export_admission()[0].numel() > 0) == (admit_after > 1)
    assert (dst.index.clock, dst.tiers.export_step()) == (src.index.clock, src.tiers.export_step()) == (5, 5)
    gen = torch.Generator().manual_seed(9)
    for _ in range(4):
        keys = torch.randint(-300, 300, (40,), generator=gen)
        a, b = src(keys, torch.tensor([0, 40])), dst(keys, torch.tensor([0, 40]))
        assert torch.equal(a, b)
        a.sum().backward()
        b.sum().backward()
    assert src.tier_stats()["evicted" if admit_after == 1 else "not_admitted"] > 0
    for a, b in zip(src.dynamic_rows(), dst.dynamic_rows()):
        assert torch.equal(a, b)
    src_stats, dst_stats = src.tier_stats(), dst.tier_stats()
    assert dst_stats["inserted"] == src_stats["inserted"] - _trained_stats(options)["inserted"]


def _trained_stats(options: DynamicTableOptions) -> Dict[str, float]:
    return _trained(_shard(options=options)).tier_stats()


def test_admission_counters_load_re_routed_from_two_key_shards_into_one() -> None:
    """The admission counters of two key shards' exports load into one shard of the whole table: each key with
    its sightings (the union of the exports'), and a key then admitted on its summed sightings."""
    options = DynamicTableOptions(capacity=256, seed=1, on_full="ignore", admit_after=3, admission_capacity=256)
    parts = [_trained(_shard(options=options, num_embeddings=256, shards=2, key_rank=r)) for r in (0, 1)]
    whole = _shard(options=options, num_embeddings=256)
    load_dynamic_states(whole, [export_dynamic_state(p) for p in parts])
    want = {k: c for p in parts for k, c in zip(*(t.tolist() for t in p.index.export_admission()))}
    got = dict(zip(*(t.tolist() for t in whole.index.export_admission())))
    assert got == want and len(want) > 10
    key, count = next((k, c) for k, c in want.items() if c == 2)  # one more sighting admits it
    whole(torch.tensor([key]), torch.tensor([0, 1])).sum().backward()
    assert key in whole.index.export()[0].tolist()
    assert dict(zip(*(t.tolist() for t in whole.index.export_admission())))[key] == 0  # admitted: count reset


@pytest.mark.parametrize(
    "kw,saved_as,named",
    [
        (dict(embedding_dim=8), {}, "embedding_dim=4"),
        ({}, {"dtype": "float16"}, "dtype='float16'"),  # the tiered kernels hold float32 rows only
        (dict(optimizer=TieredOptimizerConfig(optimizer="sgd", learning_rate=0.3)), {}, "optimizer='rowwise_adagrad'"),
        (dict(options=DynamicTableOptions(capacity=64, seed=1, eviction="lfu")), {}, "eviction='lru'"),
    ],
)
def test_an_export_of_another_dim_dtype_optimizer_or_eviction_is_refused(
    kw: Dict[str, Any], saved_as: Dict[str, Any], named: str
) -> None:
    src = export_dynamic_state(_trained(_shard()))
    src.metadata.update(saved_as)
    dst = _trained(_shard(**kw), steps=1)
    before = dst.dynamic_rows()
    with pytest.raises(TieredCheckpointError, match=f"(?s)dynamic table 'table'.*build the table with {named}"):
        load_dynamic_states(dst, [src])
    assert all(torch.equal(a, b) for a, b in zip(before, dst.dynamic_rows()))


def test_a_state_dict_of_another_key_shard_is_refused_naming_checkpoint_load() -> None:
    """One rank's ``state_dict()`` holds only its keys: a shard of another key routing refuses it (the other
    ranks' keys would be lost), while ``load_dynamic_states`` of every saving shard keeps its own keys."""
    saving = [_trained(_shard(shards=2, key_rank=r, key_routing_seed=7)) for r in range(2)]
    dst = _shard(options=DynamicTableOptions(capacity=256, seed=1))
    with pytest.raises(TieredCheckpointError, match="(?s)key shard 0 of 2.*recpipe.pipeline.checkpoint.load"):
        dst.load_state_dict(saving[0].state_dict())
    load_dynamic_states(dst, [export_dynamic_state(s) for s in saving])
    got, want = dst.dynamic_rows(), [torch.cat(t) for t in zip(*(s.dynamic_rows() for s in saving))]
    order = torch.argsort(got[0])
    assert all(torch.equal(g[order], w[torch.argsort(want[0])]) for g, w in zip(got, want))
    assert want[0].numel() > 20


def test_keys_beyond_the_loading_capacity_follow_on_full() -> None:
    """Loaded at a smaller capacity, each bucket keeps its 16 keys of highest score (reference: the
    pure-Python bucket hash); ``on_full='error'`` refuses with the shard unchanged, ``warning`` warns."""
    src = export_dynamic_state(_trained(_shard(options=DynamicTableOptions(capacity=256, seed=1, eviction="lfu"))))
    small = DynamicTableOptions(capacity=32, seed=1, eviction="lfu")
    strict = _shard(options=DynamicTableOptions(capacity=32, seed=1, eviction="lfu", on_full="error"))
    before = strict.dynamic_rows()
    with pytest.raises(TieredCheckpointError, match="(?s)find no slot.*raise DynamicTableOptions.capacity"):
        load_dynamic_states(strict, [src])
    assert all(torch.equal(a, b) for a, b in zip(before, strict.dynamic_rows()))
    warn = _shard(options=small)
    with pytest.warns(RuntimeWarning, match="found no slot"):
        load_dynamic_states(warn, [src])
    salt = reference_salt(1, BUCKET_TAG)
    buckets: Dict[int, List[Tuple[int, int, int]]] = {}
    for pos, (key, score) in enumerate(zip(src.keys.tolist(), src.scores.tolist())):
        buckets.setdefault(reference_bucket(key, salt, 32 // BUCKET_SLOTS), []).append((-score, pos, key))
    kept = sorted(k for entries in buckets.values() for _, _, k in sorted(entries)[:BUCKET_SLOTS])
    assert len(kept) < src.keys.numel()
    assert warn.dynamic_rows()[0].sort().values.tolist() == kept


def test_repeated_keys_and_non_finite_rows_are_refused_before_anything_changes() -> None:
    src = export_dynamic_state(_trained(_shard()))
    dst = _trained(_shard(), steps=2)
    before = dst.dynamic_rows()
    twice = export_dynamic_state(_trained(_shard()))
    with pytest.raises(TieredCheckpointError, match="appear more than once"):
        load_dynamic_states(dst, [src, twice])
    src.weights[3, 0] = float("nan")
    with pytest.raises(TieredCheckpointError, match=f"1 of the {src.keys.numel()} rows it would load hold NaN"):
        load_dynamic_states(dst, [src])
    assert all(torch.equal(a, b) for a, b in zip(before, dst.dynamic_rows()))


def test_checkpoint_files_hold_one_key_set_per_saving_rank(saved: Tuple[str, List[Dict[str, Any]]]) -> None:
    """Every saving rank's rows of each table under its own ``dynamic.<fqn>.rank<r>.*`` keys, sized by
    that rank's key count (which differ), listed in the digests record."""
    from torch.distributed.checkpoint import FileSystemReader

    from recpipe.pipeline.checkpoint import verify_checkpoint

    root, runs = saved
    verify_checkpoint(f"{root}/roomy", collective=False)
    md = FileSystemReader(f"{root}/roomy").read_metadata().state_dict_metadata
    sizes = {
        (t, r): int(md[_dcp_key(md, fqn, r, "keys")].size[0])
        for t, fqn in (("t0", "ebc.embedding_bags.t0"), ("t1", "ebc.embedding_bags.t1"), ("s0", "ec.embeddings.s0"))
        for r in range(2)
    }
    for t in TABLES:
        assert sizes[(t, 0)] + sizes[(t, 1)] == runs[0]["roomy_saved"][t][0].numel()
    assert len({sizes[(t, 0)] - sizes[(t, 1)] for t in TABLES} - {0}) > 0, "the ranks hold different key counts"
    assert Path(root, "roomy", "recpipe_digests.json").is_file()
