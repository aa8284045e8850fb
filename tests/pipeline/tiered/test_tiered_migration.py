"""Migrating the fused optimizer state between torchrec FUSED tables and tiered tables.

A user moving a model trained with torchrec's FUSED tables onto tiered tables (and back)
migrates its weights as full tables (``gather_full_weights``) and its fused optimizer state
(row-wise Adagrad momentum, Adam moments and step) with ``gather_full_optimizer_state`` /
``load_full_optimizer_state``. Reference: the uninterrupted run of the saving model
(torchrec's own TABLE_WISE FUSED tables for row-wise Adagrad; fbgemm's CPU TBE runs no Adam,
so for Adam the uninterrupted tiered run, whose updates are tested against fbgemm's formula
in ``test_tiered_optim.py``); after the migration both train on the same batches and must
agree step by step, with the tolerance of the tiered-vs-FUSED tests. Without the optimizer
state (from zero) the run diverges, which the tests assert too, so they cannot pass without
the migration.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import harness.tiered_ebc_models as pooled
import harness.tiered_ec_models as seq
import numpy as np
import pytest
import torch
from harness.gloo import run_gloo
from harness.tiered_ebc_models import (
    ATOL,
    K2,
    RTOL,
    K,
    apply_optimizer,
    fused_model,
    max_divergence,
    tiered_model,
    train_step,
)

SOURCE = {
    "t0": dict(mode="HYBRID", cache_load_factor=0.3, seed=3),
    "t1": dict(mode="CACHING", cache_load_factor=0.2, seed=3),
}
TARGET = {
    "t0": dict(mode="CACHING", cache_load_factor=0.5, seed=7, cache_policy="lru"),
    "t1": dict(mode="HYBRID", cache_load_factor=0.5, seed=7),
}


def _migrated(make: Any, weights: Dict[str, torch.Tensor], opt: Any) -> Any:
    """A fresh model from ``make()`` given the full weights, then (unless None) the optimizer state."""
    from recpipe.pipeline.tiered.migration import load_full_optimizer_state

    model = make()
    model.load_state_dict(weights, strict=False)
    if opt is not None:
        load_full_optimizer_state(model, opt)
    return model


def _continue(models: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """Trains every model K2 more steps on the same batches: outputs per step, final full tables."""
    from recpipe.pipeline.tiered.migration import gather_full_weights

    outs: Dict[str, List[np.ndarray]] = {name: [] for name in models}
    for step in range(K, K + K2):
        for name, model in models.items():
            outs[name].append(train_step(model, step, rank))
    final = {name: {k: v.numpy() for k, v in gather_full_weights(m).items()} for name, m in models.items()}
    return {"outputs": outs, "weights": final}


def _adagrad_body(rank: int, world: int, fused: str, backend: str) -> Dict[str, Any]:
    from recpipe.pipeline.tiered.migration import gather_full_optimizer_state, gather_full_weights

    opt = "rowwise_adagrad"
    ref, src = fused_model(world, opt, fused), tiered_model(world, opt, SOURCE, backend)
    for step in range(K):
        train_step(ref, step, rank)
        train_step(src, step, rank)
    w_ref, o_ref = gather_full_weights(ref), gather_full_optimizer_state(ref)
    w_src, o_src = gather_full_weights(src), gather_full_optimizer_state(src)
    models = {
        "ref": ref,  # torchrec, uninterrupted
        "to_tiered": _migrated(lambda: tiered_model(world, opt, TARGET, backend), w_ref, o_ref),
        "to_tiered_no_state": _migrated(lambda: tiered_model(world, opt, TARGET, backend), w_ref, None),
        "to_fused": _migrated(lambda: fused_model(world, opt, fused), w_src, o_src),
        "to_fused_no_state": _migrated(lambda: fused_model(world, opt, fused), w_src, None),
    }
    res = _continue(models, rank)
    res["states"] = {k: {n: t.numpy() for n, t in v.items()} for k, v in o_ref.items()}
    res["tiered_states"] = {k: {n: t.numpy() for n, t in v.items()} for k, v in o_src.items()}
    return res


def _assert_run_matches(res: Dict[str, Any], name: str, ref: str, rank: int) -> None:
    for step, (got, want) in enumerate(zip(res["outputs"][name], res["outputs"][ref])):
        torch.testing.assert_close(
            torch.from_numpy(got),
            torch.from_numpy(want),
            atol=ATOL,
            rtol=RTOL,
            msg=lambda m: f"rank {rank} {name} step {K + step}: {m}",
        )
    for key, want in res["weights"][ref].items():
        torch.testing.assert_close(
            torch.from_numpy(res["weights"][name][key]),
            torch.from_numpy(want),
            atol=ATOL,
            rtol=RTOL,
            msg=lambda m: f"rank {rank} {name} {key}: {m}",
        )


@pytest.mark.parametrize("fused,backend", [("table_wise", "native"), ("row_wise_routed", "fbgemm")])
def test_rowwise_adagrad_state_migrates_fused_to_tiered_and_back_as_uninterrupted_torchrec(
    fused: str, backend: str
) -> None:
    """torchrec FUSED tables (row-wise Adagrad; TABLE_WISE, or ROW_WISE with routed rows) ->
    tiered HYBRID / CACHING tables (recpipe's kernel, or fbgemm's TBE holding the state in its
    layout), and tiered -> FUSED: after the migration of weights and momentum, every step's
    outputs and the final tables equal torchrec's uninterrupted run; with the weights alone
    (momentum from zero) they do not (the loss spike the migration removes)."""
    for rank, res in enumerate(run_gloo(2, _adagrad_body, fused, backend)):
        # the gathered state: torchrec's names, one momentum per row, every row that trained nonzero
        assert set(res["states"]) == {"embedding_bags.t0", "embedding_bags.t1"}
        for key, (rows, name) in {"embedding_bags.t0": (97, "t0"), "embedding_bags.t1": (50, "t1")}.items():
            for which in ("states", "tiered_states"):
                st = res[which][key]
                assert set(st) == {f"{name}.momentum1", "step"}, st.keys()
                assert st[f"{name}.momentum1"].shape == (rows,) and (st[f"{name}.momentum1"] > 0).sum() > 5
                assert int(st["step"]) == K, (which, key, st["step"])
            # the tiered run trained on the same batches as torchrec's: the same momentum
            np.testing.assert_allclose(
                res["tiered_states"][key][f"{name}.momentum1"],
                res["states"][key][f"{name}.momentum1"],
                rtol=RTOL,
                atol=ATOL,
            )
        _assert_run_matches(res, "to_tiered", "ref", rank)
        _assert_run_matches(res, "to_fused", "ref", rank)
        for name in ("to_tiered_no_state", "to_fused_no_state"):
            gap = max_divergence(res["outputs"][name], res["outputs"]["ref"])
            assert gap > 1e-3, f"rank {rank}: {name} matches torchrec without the optimizer state ({gap})"


def _adam_body(rank: int, world: int) -> Dict[str, Any]:
    from recpipe.pipeline.tiered.migration import (
        gather_full_optimizer_state,
        gather_full_weights,
        load_full_optimizer_state,
    )

    src = tiered_model(world, "adam", SOURCE)
    adagrad = tiered_model(world, "rowwise_adagrad", SOURCE)
    for step in range(K):
        train_step(src, step, rank)
        train_step(adagrad, step, rank)
    w_src, o_src = gather_full_weights(src), gather_full_optimizer_state(src)
    res: Dict[str, Any] = {"state": {k: {n: t.numpy() for n, t in v.items()} for k, v in o_src.items()}}

    target = _migrated(lambda: tiered_model(world, "adam", TARGET), w_src, o_src)
    # refused: row-wise Adagrad state into the Adam tables, and a state without its step;
    # nothing changes (the state and the weights, and the run below continues as the source's)
    before = (gather_full_weights(target), gather_full_optimizer_state(target))
    errors: List[Tuple[str, str]] = []
    no_step = {k: {n: t for n, t in v.items() if n != "step"} for k, v in o_src.items()}
    unknown = {**o_src, "embedding_bags.t9": {}}
    missing = {"embedding_bags.t0": o_src["embedding_bags.t0"]}
    for bad in (gather_full_optimizer_state(adagrad), no_step, unknown, missing):
        try:
            load_full_optimizer_state(target, bad)
            errors.append(("", "loaded"))
        except ValueError as e:
            errors.append((type(e).__name__, str(e)))
    after = (gather_full_weights(target), gather_full_optimizer_state(target))
    res["errors"] = errors
    res["unchanged"] = all(torch.equal(before[0][k], after[0][k]) for k in before[0]) and all(
        torch.equal(before[1][k][n], after[1][k][n]) for k in before[1] for n in before[1][k]
    )

    zero_step = {k: {**v, "step": torch.tensor(0)} for k, v in o_src.items()}
    models = {
        "ref": src,  # uninterrupted
        "migrated": target,
        "no_state": _migrated(lambda: tiered_model(world, "adam", TARGET), w_src, None),
        "step_0": _migrated(lambda: tiered_model(world, "adam", TARGET), w_src, zero_step),
    }
    res.update(_continue(models, rank))
    return res


def test_adam_moments_and_step_migrate_between_tiered_placements_as_uninterrupted_run() -> None:
    """Adam's two moments per element and its step (bias correction) migrate through the full
    state into tables of another placement: every step equals the uninterrupted run; without
    the moments, or with step 0, it diverges. Row-wise Adagrad state given to the Adam tables is
    refused before anything changes, naming the table, both optimizers and shapes and the fixes."""
    for rank, res in enumerate(run_gloo(2, _adam_body)):
        st = res["state"]["embedding_bags.t0"]
        assert set(st) == {"t0.momentum1", "t0.exp_avg_sq", "step"}, st.keys()
        assert st["t0.momentum1"].shape == st["t0.exp_avg_sq"].shape == (97, 8) and int(st["step"]) == K
        assert (st["t0.exp_avg_sq"] > 0).any(axis=1).sum() > 5

        (kind, msg), (kind2, msg2), (kind3, msg3), (kind4, msg4) = res["errors"]
        assert kind == "ValueError", msg
        assert (
            "load_full_optimizer_state: table 'embedding_bags.t0' of the model trains with adam ([97, 8], "
            "optimizer state {'t0.momentum1': [97, 8], 't0.exp_avg_sq': [97, 8], 'step': 'int >= 0'}), but "
            "states['embedding_bags.t0'] holds rowwise_adagrad state {'t0.momentum1': [97], 'step': []}"
        ) in msg, msg
        assert "Possible solutions:\n  1. load the state gathered (gather_full_optimizer_state)" in msg, msg
        assert kind2 == "ValueError" and "holds adam state {'t0.momentum1': [97, 8], 't0.exp_avg_sq': [97, 8]}" in msg2
        assert kind3 == "ValueError" and "states has ['embedding_bags.t9'], which are no table of the model" in msg3
        assert "(its tables: ['embedding_bags.t0', 'embedding_bags.t1'])" in msg3, msg3
        assert kind4 == "ValueError" and "states has no entry for tables ['embedding_bags.t1']" in msg4, msg4
        assert "strict=False" in msg4, msg4
        assert res["unchanged"], f"rank {rank}: a refused load changed the model"

        _assert_run_matches(res, "migrated", "ref", rank)
        for name in ("no_state", "step_0"):
            gap = max_divergence(res["outputs"][name], res["outputs"]["ref"])
            assert gap > 1e-4, f"rank {rank}: {name} matches the uninterrupted run ({gap})"


def _ec_model(world: int, tiered: bool) -> Any:
    """The EC of ``test_tiered_sequence`` (row-wise Adagrad): torchrec's TABLE_WISE FUSED tables,
    or tiered tables planned by recpipe's planner (its CACHING / HYBRID placements)."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner.types import Topology
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingCollectionSharder
    from recpipe.planner import PlacementPlanner
    from recpipe.planner.specs import PlacementConstraints

    ec = seq.make_ec()
    weights = {f"embeddings.{t}.weight": ec.embeddings[t].weight.detach().clone() for t, _, _ in seq.TABLES}
    apply_optimizer(ec, "rowwise_adagrad")
    if tiered:
        sharder: Any = TieredEmbeddingCollectionSharder()
        topo = Topology(
            world_size=world, local_world_size=world, compute_device="cuda", hbm_cap=1 << 30, ddr_cap=1 << 32
        )
        constraints = {t: PlacementConstraints(mode=m, cache_load_factor=x) for t, (m, x) in seq.PLACEMENT.items()}
        plan = (
            PlacementPlanner(topo, constraints=constraints, optimizer="rowwise_adagrad", backend="native")
            .plan(ec)
            .to_sharding_plan(compute_device="cpu")
        )
    else:
        sharder = EmbeddingCollectionSharder()
        per = {t: table_wise(rank=i % world) for i, (t, _, _) in enumerate(seq.TABLES)}
        plan = ShardingPlan(
            {
                "": construct_module_sharding_plan(
                    ec, per, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
                )
            }
        )
    model = DistributedModelParallel(ec, plan=plan, sharders=[sharder], device=torch.device("cpu"))
    model.load_state_dict(weights, strict=False)
    return model


def _ec_step(model: Any, step: int, rank: int) -> np.ndarray:
    kjt, grads = seq.kjt_and_grads(step, rank)
    emb = model(kjt)
    loss = sum((emb[f].values() * grads[f]).sum() for f in seq.FEATURES)
    loss.backward()  # type: ignore[union-attr]
    return torch.cat([emb[f].values().detach() for f in seq.FEATURES]).numpy().copy()


def _ec_body(rank: int, world: int) -> Dict[str, List[np.ndarray]]:
    from recpipe.pipeline.tiered.migration import gather_full_optimizer_state, gather_full_weights

    ref = _ec_model(world, tiered=False)
    for step in range(K):
        _ec_step(ref, step, rank)
    w, o = gather_full_weights(ref), gather_full_optimizer_state(ref)
    models = {
        "ref": ref,
        "migrated": _migrated(lambda: _ec_model(world, True), w, o),
        "no_state": _migrated(lambda: _ec_model(world, True), w, None),
    }
    outs: Dict[str, List[np.ndarray]] = {name: [] for name in models}
    for step in range(K, K + K2):
        for name, model in models.items():
            outs[name].append(_ec_step(model, step, rank))
    return outs


def test_rowwise_adagrad_state_migrates_from_fused_ec_to_tiered_ec_as_uninterrupted_torchrec() -> None:
    """Sequence tables: torchrec's TABLE_WISE FUSED EmbeddingCollection -> tiered EC tables
    (collection ``embeddings``): every step after the migration equals torchrec's uninterrupted
    run, and diverges from it without the momentum."""
    for rank, outs in enumerate(run_gloo(2, _ec_body)):
        for step, (got, want) in enumerate(zip(outs["migrated"], outs["ref"])):
            torch.testing.assert_close(
                torch.from_numpy(got),
                torch.from_numpy(want),
                atol=ATOL,
                rtol=RTOL,
                msg=lambda m: f"rank {rank} step {K + step}: {m}",
            )
        gap = max_divergence(outs["no_state"], outs["ref"])
        assert gap > 1e-3, f"rank {rank}: the EC matches torchrec without the optimizer state ({gap})"


def _column_wise_body(rank: int, world: int) -> Tuple[str, str]:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    from recpipe.pipeline.tiered.migration import gather_full_optimizer_state

    ebc = pooled.make_ebc()
    apply_optimizer(ebc, "rowwise_adagrad")
    sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        ebc,
        {"t0": column_wise(ranks=[0, 1]), "t1": table_wise(rank=1)},
        sharder=sharder,
        local_size=world,
        world_size=world,
        device_type="cpu",
    )
    model = DistributedModelParallel(
        ebc,
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )
    try:
        gather_full_optimizer_state(model)
    except ValueError as e:
        return type(e).__name__, str(e)
    return "", "gathered"


def test_column_wise_fused_table_refused_on_every_rank_naming_table() -> None:
    """torchrec keeps a column-wise table's row-wise Adagrad momentum per column shard, which a
    table of one momentum per row cannot take: refused on every rank (none waits in a
    collective), naming the table and the fix."""
    for rank, (kind, msg) in enumerate(run_gloo(2, _column_wise_body, timeout_s=120)):
        assert kind == "ValueError", (rank, msg)
        assert "the fused optimizer state of tables 'embedding_bags.t0' (rowwise_adagrad, column-wise sharded" in msg
        assert "plan it TABLE_WISE or ROW_WISE" in msg and "'embedding_bags.t1'" not in msg, msg


def test_shard_load_global_optimizer_state_updates_as_rowwise_adagrad_from_the_loaded_momentum() -> None:
    """``TieredEmbeddingShard.load_global_optimizer_state`` (a CACHING shard, rows cached before
    the load): the next update is row-wise Adagrad's (plain torch math) from the loaded momentum,
    the values kept, the step the loaded one + 1; a state of another width is refused naming the
    table, nothing changed."""
    from recpipe.pipeline.tiered.optim import TieredOptimizerConfig
    from recpipe.pipeline.tiered.shard import TieredEmbeddingShard

    n, dim, lr, eps = 20, 4, 0.1, 1e-8
    shard = TieredEmbeddingShard(
        num_embeddings=n,
        embedding_dim=dim,
        mode="CACHING",
        cache_load_factor=0.25,
        optimizer=TieredOptimizerConfig(optimizer="rowwise_adagrad", learning_rate=lr, eps=eps),
        dist_type="continuous",
        table_name="t",
    )
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, dim, generator=gen)
    shard.load_global_weights(w)
    ids, offsets = torch.tensor([1, 3, 3, 7, 19, 1]), torch.tensor([0, 2, 4, 6])
    with torch.no_grad():
        shard(ids, offsets)  # caches rows: the load must reach the cached copies too
    m = torch.rand(n, generator=gen) + 0.5
    before = shard.export_state()
    try:
        shard.load_global_optimizer_state(torch.zeros(n, 2), 5)
        raise AssertionError("a [20, 2] state loaded into a row-wise Adagrad shard")
    except ValueError as e:
        assert "tiered table 't': optimizer state must be a float tensor of shape [20, 1]" in str(e), str(e)
        assert "got a torch.float32 tensor of shape [20, 2]" in str(e), str(e)
    after = shard.export_state()
    assert torch.equal(before.weights, after.weights) and torch.equal(before.optimizer_state, after.optimizer_state)

    shard.load_global_optimizer_state(m.unsqueeze(1), 5)
    g = torch.randn(3, dim, generator=gen)
    shard(ids, offsets).backward(g)
    grad = torch.zeros(n, dim).index_add_(0, ids, g.repeat_interleave(torch.diff(offsets), dim=0))
    touched = grad.abs().sum(1) > 0
    m_ref = m + torch.where(touched, grad.square().mean(1), torch.zeros(n))
    w_ref = w - lr * grad / (m_ref.sqrt() + eps).unsqueeze(1)
    st = shard.export_state()
    torch.testing.assert_close(st.weights, w_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(st.optimizer_state[:, 0], m_ref, atol=1e-6, rtol=1e-5)
    assert st.step == 6
