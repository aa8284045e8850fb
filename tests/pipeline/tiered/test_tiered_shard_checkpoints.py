"""A tiered shard's exports and loads: resharding by global id, validation, streaming.

* exports of W = 2 shards load into a W = 1 shard of another mode and train identically;
  a whole-table routing holds every row at its global id and reshards both ways;
* ``state_dict`` round trips; missing, duplicate, short, non-finite and newer-routing
  exports are refused naming what is wrong; version 1 hash exports still load;
* loads stream exports and row blocks in chunks with the same result as whole.

References are the exported rows themselves (by global id) and the routing of
``recpipe.pipeline.routing`` (``route_ids`` / ``global_row_ids``).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import pytest
import torch
from harness.tiered_shards import ATOL, LR, RTOL, B, D, N, global_table, roundrobin_shard, skewed_batch

from recpipe.pipeline.routing.ops import ROUTING_VERSION, route_ids
from recpipe.pipeline.routing.rows import global_row_ids
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig
from recpipe.pipeline.tiered.state import TieredCheckpointError, TieredShardState


def _route_batch(
    ids: torch.Tensor, offsets: torch.Tensor, world: int, seed: int
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    owner, local = route_ids(ids, N, world, "hash_roundrobin", seed=seed)
    lengths = offsets[1:] - offsets[:-1]
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    out = []
    for r in range(world):
        m = owner == r
        ln = torch.bincount(bag[m], minlength=lengths.numel())
        out.append((local[m], torch.cat([torch.zeros(1, dtype=torch.long), ln.cumsum(0)])))
    return out


def test_checkpoint_reshards_w2_hybrid_to_w1_caching() -> None:
    torch.manual_seed(0)
    w0 = torch.randn(N, D)
    cfg = TieredOptimizerConfig(optimizer="adam", learning_rate=LR)
    src = [
        TieredEmbeddingShard(
            num_embeddings=N,
            embedding_dim=D,
            mode="HYBRID",
            cache_load_factor=0.3,
            optimizer=cfg,
            rank=r,
            world_size=2,
            routing_seed=5,
            split_seed=r,
        )
        for r in range(2)
    ]
    for s in src:
        s.load_global_weights(w0)
    gen = torch.Generator().manual_seed(6)
    for _ in range(4):
        ids, offsets = skewed_batch(gen)
        parts = _route_batch(ids, offsets, 2, 5)
        outs = [s(i, o) for s, (i, o) in zip(src, parts)]
        sum(o.sum() for o in outs).backward()  # type: ignore[union-attr]
    exports = [s.export_state() for s in src]
    assert {e.metadata["placement"]["mode"] for e in exports} == {"HYBRID"}
    dst = TieredEmbeddingShard(
        num_embeddings=N, embedding_dim=D, mode="CACHING", cache_load_factor=0.5, optimizer=cfg, routing_seed=99
    )
    dst.load_states(exports)
    assert dst.step == src[0].step == 4
    for _ in range(3):  # identical lookups AND identical training afterwards
        ids, offsets = skewed_batch(gen)
        grad = torch.randn(B, D, generator=gen)
        parts = _route_batch(ids, offsets, 2, 5)
        ref = sum(s(i, o) for s, (i, o) in zip(src, parts))
        _, local = route_ids(ids, N, 1, "hash_roundrobin", seed=99)
        out = dst(local, offsets)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
        ref.backward(grad)  # type: ignore[union-attr]
        out.backward(grad)
    a, sa = global_table(dst)
    b = torch.empty_like(a)
    sb = torch.empty_like(sa)
    for e in (s.export_state() for s in src):
        b[e.global_ids] = e.weights
        sb[e.global_ids] = e.optimizer_state
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(sa, sb, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("backend", ["native", "torch", "fbgemm"])
def test_whole_table_routing_holds_every_row_as_its_global_id(backend: str) -> None:
    """A shard given ``WholeTableRouting`` (a table-wise shard) holds every row at local id =
    global id: it looks global ids up directly, equals a W = 1 roundrobin shard step by step, and
    its export reshards into W = 2 hash_roundrobin shards and back by global id."""
    from recpipe.pipeline.tiered.shard_routing import WholeTableRouting

    def make(**kw: object) -> TieredEmbeddingShard:
        torch.manual_seed(4)
        return TieredEmbeddingShard(
            num_embeddings=N,
            embedding_dim=D,
            mode="CACHING",
            cache_load_factor=0.3,
            optimizer=TieredOptimizerConfig(optimizer="rowwise_adagrad", learning_rate=LR),
            backend=backend,
            **kw,
        )  # type: ignore[arg-type]

    whole, rr = make(routing=WholeTableRouting(N)), make(dist_type="roundrobin")
    assert (whole.num_rows, whole.rank, whole.world_size) == (N, 0, 1)
    assert torch.equal(whole.global_ids(), torch.arange(N))
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        ids, offsets = skewed_batch(gen)
        out_w, out_r = whole(ids, offsets), rr(ids, offsets)
        torch.testing.assert_close(out_w, out_r, atol=0, rtol=0)
        out_w.sum().backward()
        out_r.sum().backward()
    st = whole.export_state()
    assert torch.equal(st.weights, rr.export_state().weights) and st.step == 3
    split = [
        TieredEmbeddingShard(
            num_embeddings=N,
            embedding_dim=D,
            mode="HYBRID",
            cache_load_factor=0.5,
            optimizer=TieredOptimizerConfig(optimizer="rowwise_adagrad"),
            rank=r,
            world_size=2,
            routing_seed=3,
        )
        for r in range(2)
    ]
    for shard in split:
        shard.load_states([st])
    back = make(routing=WholeTableRouting(N))
    back.load_states([shard.export_state() for shard in split])
    again = back.export_state()
    assert torch.equal(again.weights, st.weights) and torch.equal(again.optimizer_state, st.optimizer_state)
    with pytest.raises(ValueError, match="routing is of a table of 7 rows"):
        make(routing=WholeTableRouting(7))


def test_state_dict_round_trip_and_validation() -> None:
    torch.manual_seed(0)
    a = roundrobin_shard("CACHING", 0.2, "rowwise_adagrad")
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        ids, offsets = skewed_batch(gen)
        a(ids, offsets).sum().backward()
    sd = a.state_dict()
    assert sd["_extra_state"]["dist_type"] == "roundrobin"
    assert sd["_extra_state"]["placement"] == {
        "mode": "CACHING",
        "cache_load_factor": 0.2,
        "cache_policy": "lfu",
        "split_seed": 0,
    }
    b = roundrobin_shard("HYBRID", 0.7, "rowwise_adagrad")
    b.load_state_dict(sd)
    ids, offsets = skewed_batch(gen)
    torch.testing.assert_close(b(ids, offsets), a(ids, offsets))

    with pytest.raises(TieredCheckpointError, match="embedding_dim"):
        TieredEmbeddingShard(
            num_embeddings=N,
            embedding_dim=D + 1,
            mode="HYBRID",
            cache_load_factor=1.0,
            optimizer=TieredOptimizerConfig(optimizer="rowwise_adagrad"),
        ).load_state_dict(sd)
    with pytest.raises(TieredCheckpointError, match="optimizer"):
        roundrobin_shard("HYBRID", 1.0, "sgd").load_state_dict(sd)
    bad = dict(sd)
    bad["_extra_state"] = dict(sd["_extra_state"], dist_type="hash_roundrobin", routing_seed=3)
    with pytest.raises(TieredCheckpointError, match="disagree with its metadata"):
        b.load_state_dict(bad)


def test_checkpoint_refuses_missing_or_duplicate_rows() -> None:
    src = [
        TieredEmbeddingShard(
            num_embeddings=N, embedding_dim=D, mode="HYBRID", cache_load_factor=0.3, rank=r, world_size=2
        )
        for r in range(2)
    ]
    exports = [s.export_state() for s in src]
    dst = TieredEmbeddingShard(num_embeddings=N, embedding_dim=D, mode="CACHING", cache_load_factor=0.5)
    with pytest.raises(TieredCheckpointError, match=r"120 of its 240 rows are missing"):
        dst.load_states(exports[:1])
    with pytest.raises(TieredCheckpointError, match="more than once"):
        dst.load_states([exports[0], exports[0], exports[1]])
    dst.load_states(exports)  # complete: fine
    # a W=2 shard loading the full W=1 export keeps only its own rows, none lost
    half = TieredEmbeddingShard(
        num_embeddings=N, embedding_dim=D, mode="HYBRID", cache_load_factor=0.5, rank=1, world_size=2, routing_seed=1
    )
    half.load_states([dst.export_state()])
    w_dst, _ = global_table(dst)
    st = half.export_state()
    torch.testing.assert_close(st.weights, w_dst[st.global_ids])


@pytest.mark.parametrize("field", ["weights", "optimizer_state", "global_ids"])
def test_checkpoint_refusal_names_the_short_tensor_of_an_export(field: str) -> None:
    """An export with one tensor a row short is refused naming that tensor and its row count
    against the rows its routing gives the rank."""
    src = [
        TieredEmbeddingShard(
            num_embeddings=N,
            embedding_dim=D,
            mode="HYBRID",
            cache_load_factor=0.3,
            optimizer=TieredOptimizerConfig(optimizer="rowwise_adagrad", learning_rate=LR),
            rank=r,
            world_size=2,
        )
        for r in range(2)
    ]
    exports = [s.export_state() for s in src]
    rows = exports[1].global_ids.numel()
    setattr(exports[1], field, getattr(exports[1], field)[:-1])
    dst = TieredEmbeddingShard(
        num_embeddings=N,
        embedding_dim=D,
        mode="CACHING",
        cache_load_factor=0.5,
        optimizer=TieredOptimizerConfig(optimizer="rowwise_adagrad", learning_rate=LR),
    )
    with pytest.raises(
        TieredCheckpointError,
        match=rf"export of rank 1/2 \(hash_roundrobin\) must hold {rows} "
        rf"rows \(its routing of {N} rows\), but {field} has {rows - 1}\. Possible",
    ):
        dst.load_states(exports)


def test_checkpoint_loads_exports_of_the_version_1_hash() -> None:
    """Exports written under hash_roundrobin routing version 1 (no ``routing_version``
    key) hold other rows per rank than version 2 routes there. They still load, row by
    global id; damaged ones and ones from a newer routing are refused."""
    torch.manual_seed(0)
    w0 = torch.randn(N, D)
    full = TieredEmbeddingShard(num_embeddings=N, embedding_dim=D, mode="HYBRID", cache_load_factor=1.0)
    full.load_global_weights(w0)
    st = full.export_state()
    # What version 1 exported at W = 2: each rank a (different) half of the global ids,
    # in an order today's routing does not produce.
    order = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    v1 = []
    for r, rows in enumerate((order[: N // 2], order[N // 2 :])):
        md = {k: v for k, v in st.metadata.items() if k != "routing_version"}
        md.update(version=1, world_size=2, rank=r, num_rows=N // 2, routing_seed=5)
        v1.append(
            TieredShardState(
                global_ids=st.global_ids[rows],
                weights=st.weights[rows],
                optimizer_state=st.optimizer_state[rows],
                step=st.step,
                metadata=md,
            )
        )
    assert not torch.equal(
        v1[0].global_ids.sort().values,
        global_row_ids(torch.arange(N // 2), N, 2, 0, "hash_roundrobin", 5).sort().values,
    )
    for rank in range(2):  # today's W = 2 shards pick their rows out of the version 1 exports
        dst = TieredEmbeddingShard(
            num_embeddings=N,
            embedding_dim=D,
            mode="CACHING",
            cache_load_factor=0.5,
            rank=rank,
            world_size=2,
            routing_seed=5,
        )
        dst.load_states(v1)
        got = dst.export_state()
        assert got.metadata["routing_version"] == ROUTING_VERSION
        torch.testing.assert_close(got.weights, w0[got.global_ids], atol=0, rtol=0)
    dup = TieredShardState(
        global_ids=v1[0].global_ids.clone(),
        weights=v1[0].weights,
        optimizer_state=v1[0].optimizer_state,
        step=st.step,
        metadata=v1[0].metadata,
    )
    dup.global_ids[1] = dup.global_ids[0]
    with pytest.raises(TieredCheckpointError, match="1 repeated"):
        dst.load_states([dup, v1[1]])
    newer = TieredShardState(
        global_ids=v1[0].global_ids,
        weights=v1[0].weights,
        optimizer_state=v1[0].optimizer_state,
        step=st.step,
        metadata=dict(v1[0].metadata, routing_version=ROUTING_VERSION + 1),
    )
    with pytest.raises(TieredCheckpointError, match="newer than this recpipe"):
        dst.load_states([newer, v1[1]])


def test_load_refuses_non_finite_rows() -> None:
    """An export holding NaN / inf values or optimizer state is refused, naming the count."""
    src = roundrobin_shard("HYBRID", 0.5, "rowwise_adagrad")
    for bad in ("weights", "optimizer_state"):
        st = src.export_state()
        getattr(st, bad)[3, 0] = float("nan") if bad == "weights" else float("inf")
        dst = roundrobin_shard("CACHING", 0.3, "rowwise_adagrad")
        with pytest.raises(TieredCheckpointError, match=r"1 of the rows it would load hold NaN or inf"):
            dst.load_states([st])


def test_load_streams_exports_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading W = 3 exports into W = 2 shards gives the same rows whether each export
    is routed whole or 7 rows at a time (the chunked path, crossing export boundaries)."""
    import recpipe.pipeline.tiered.state as tiered

    N = 101
    srcs = [
        TieredEmbeddingShard(
            num_embeddings=N,
            embedding_dim=D,
            mode="HYBRID",
            cache_load_factor=0.4,
            optimizer=TieredOptimizerConfig(optimizer="adam"),
            rank=r,
            world_size=3,
        )
        for r in range(3)
    ]
    states = [s.export_state() for s in srcs]
    results = []
    for chunk in (tiered.LOAD_CHUNK_ROWS, 7):
        monkeypatch.setattr(tiered, "LOAD_CHUNK_ROWS", chunk)
        got = []
        for r in range(2):
            dst = TieredEmbeddingShard(
                num_embeddings=N,
                embedding_dim=D,
                mode="CACHING",
                cache_load_factor=0.3,
                optimizer=TieredOptimizerConfig(optimizer="adam"),
                rank=r,
                world_size=2,
            )
            dst.load_states(states)
            got.append(dst.export_state())
        results.append(got)
    for a, b in zip(*results):
        assert torch.equal(a.global_ids, b.global_ids)
        assert torch.equal(a.weights, b.weights) and torch.equal(a.optimizer_state, b.optimizer_state)
    every = torch.cat([s.global_ids for s in results[1]])
    assert sorted(every.tolist()) == list(range(N))
    src_rows = {int(g): w for s in states for g, w in zip(s.global_ids, s.weights)}
    for s in results[1]:
        for g, w in zip(s.global_ids, s.weights):
            assert torch.equal(w, src_rows[int(g)])


@pytest.mark.parametrize("mode,x", [("HYBRID", 0.4), ("CACHING", 0.3), ("HYBRID", 1.0)])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_own_export_loads_whole_in_write_chunks(
    monkeypatch: pytest.MonkeyPatch, mode: str, x: float, optimizer: str, chunk: Optional[int]
) -> None:
    """A shard's own export (one export, this rank's routing) loads as it is, written to the tiers
    7 rows at a time or in one chunk: the shard then exports exactly those rows, state and step; a
    NaN row in it is refused naming the count, and the shard keeps its rows."""
    import recpipe.pipeline.tiered.backends.buffers as tiered

    if chunk is not None:
        monkeypatch.setattr(tiered, "WRITE_CHUNK_ROWS", chunk)
    g = torch.Generator().manual_seed(7)
    for rank in range(2):
        shard = TieredEmbeddingShard(
            num_embeddings=101,
            embedding_dim=D,
            mode=mode,
            cache_load_factor=x,
            optimizer=TieredOptimizerConfig(optimizer=optimizer),
            rank=rank,
            world_size=2,
            dist_type="hash_roundrobin",
            routing_seed=5,
        )
        st = shard.export_state()
        want = TieredShardState(
            global_ids=st.global_ids,
            weights=torch.randn(st.weights.shape, generator=g),
            optimizer_state=torch.rand(st.optimizer_state.shape, generator=g),
            step=11,
            metadata=st.metadata,
        )
        shard.load_states([want])
        got = shard.export_state()
        assert torch.equal(got.global_ids, want.global_ids) and got.step == 11
        assert torch.equal(got.weights, want.weights) and torch.equal(got.optimizer_state, want.optimizer_state)
        bad = TieredShardState(
            global_ids=want.global_ids,
            weights=want.weights.clone(),
            optimizer_state=want.optimizer_state,
            step=12,
            metadata=want.metadata,
        )
        bad.weights[3, 1] = float("nan")
        bad.weights[5, 0] = float("inf")
        with pytest.raises(TieredCheckpointError, match="2 of the rows it would load hold NaN or inf"):
            shard.load_states([bad])
        kept = shard.export_state()
        assert torch.equal(kept.weights, want.weights) and kept.step == 11


@pytest.mark.parametrize("backend", ["native", "fbgemm"])
@pytest.mark.parametrize("mode,x", [("HYBRID", 0.4), ("CACHING", 0.3), ("HYBRID", 1.0)])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_load_row_blocks_streams_a_table_in_blocks(
    monkeypatch: pytest.MonkeyPatch, backend: str, mode: str, x: float, optimizer: str
) -> None:
    """Every shard of a W = 2 hash_roundrobin table loads a global table given as blocks of rows in
    shuffled order (each block mixes both shards' rows; written 7 rows at a time): each then exports
    exactly its rows of the table and their state, and the step; a block without state gives zero
    state. Missing rows, a NaN row of the shard and a block of another shape are refused naming the
    table."""
    import recpipe.pipeline.tiered.backends.buffers as tiered

    monkeypatch.setattr(tiered, "WRITE_CHUNK_ROWS", 7)
    n = 101
    g = torch.Generator().manual_seed(3)
    table = torch.randn((n, D), generator=g)
    cols = TieredOptimizerConfig(optimizer=optimizer).state_cols(D)
    state = torch.rand((n, cols), generator=g)
    order = torch.randperm(n, generator=g)
    cuts = [0, 13, 14, 60, n]  # uneven blocks, one of a single row

    def blocks(with_state: bool = True, drop: int = -1) -> Any:
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            if i != drop:
                ids = order[a:b]
                yield ids, table.index_select(0, ids), state.index_select(0, ids) if with_state else None

    for rank in range(2):

        def make() -> TieredEmbeddingShard:
            shard = TieredEmbeddingShard(
                num_embeddings=n,
                embedding_dim=D,
                mode=mode,
                cache_load_factor=x,
                optimizer=TieredOptimizerConfig(optimizer=optimizer),
                rank=rank,
                world_size=2,
                dist_type="hash_roundrobin",
                routing_seed=5,
                backend=backend,
                table_name="tb",
            )
            shard.load_states([shard.export_state()])  # a loaded shard (its step set)
            return shard

        shard = make()
        shard.load_row_blocks(blocks(), 9)
        got = shard.export_state()
        assert got.step == 9
        assert torch.equal(got.weights, table.index_select(0, got.global_ids))
        assert torch.equal(got.optimizer_state, state.index_select(0, got.global_ids))
        shard.load_row_blocks(blocks(with_state=False), 4)
        got = shard.export_state()
        assert torch.equal(got.weights, table.index_select(0, got.global_ids)) and not got.optimizer_state.any()
        assert got.step == 4
        with pytest.raises(
            TieredCheckpointError, match=r"cannot load table 'tb' into shard rank .* rows are missing from the blocks"
        ):
            make().load_row_blocks(blocks(drop=2), 1)
        mine = make().global_ids()
        table[mine[3], 1] = float("nan")
        with pytest.raises(TieredCheckpointError, match="1 of the rows it would load hold NaN or inf"):
            make().load_row_blocks(blocks(), 1)
        table[mine[3], 1] = 0.5
        with pytest.raises(TieredCheckpointError, match=r"a block of rows has shapes .* expected \[3\]"):
            make().load_row_blocks(iter([(order[:3], table[:3, :2], None)]), 1)
