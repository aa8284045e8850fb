"""Adopting tiered tables from a plain torchrec DCP checkpoint (recpipe.pipeline.checkpoint.load).

torchrec users checkpoint a DistributedModelParallel with FUSED tables (torchrec's own
sharders, TABLE_WISE / ROW_WISE ShardedTensors) as
``torch.distributed.checkpoint.save({**model.state_dict(), "fused_optimizer":
model.fused_optimizer.state_dict()})``. A model whose tables recpipe's planner made tiered
(HYBRID / CACHING) loads such a checkpoint with ``recpipe.pipeline.checkpoint.load(..., verify=False)``:
each tiered table streams the torchrec table (one saved chunk at a time) and its row-wise Adagrad momentum. Reference:
the saving torchrec model trained on without interruption (every step's outputs and the final
tables must match with the tiered-vs-FUSED tolerance). Without the optimizer state
(``strict=False``) the run diverges, so the state is really carried; a table of another size,
or state of another optimizer, is refused on every rank and the model is unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import harness.dcp_models as dm
import harness.tiered_ebc_models as pooled
import numpy as np
import pytest
import torch
from harness.gloo import run_gloo

K, K2 = pooled.K, pooled.K2  # steps before / after the checkpoint
PLACEMENTS = {
    "t0": dict(mode="HYBRID", cache_load_factor=0.3, seed=3),
    "t1": dict(mode="CACHING", cache_load_factor=0.2, seed=3),
}


def _torchrec_model(world: int, dtensor: bool = False) -> Any:
    """Plain torchrec: t0 TABLE_WISE on rank 1, t1 ROW_WISE, FUSED row-wise Adagrad, torchrec's own sharder
    (``dtensor``: its state_dict gives DTensor weights, torchrec's ``output_dtensor`` option)."""
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    ebc = pooled.make_ebc()
    pooled.apply_optimizer(ebc, "rowwise_adagrad")
    sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        ebc,
        {"t0": table_wise(rank=1), "t1": row_wise()},
        sharder=sharder,
        local_size=world,
        world_size=world,
        device_type="cpu",
    )
    env = ShardingEnv(world, dist.get_rank(), dist.group.WORLD, output_dtensor=True) if dtensor else None
    model = DistributedModelParallel(
        ebc,
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],  # type: ignore[list-item]
        device=torch.device("cpu"),
        env=env,
    )
    if not dtensor:
        model.load_state_dict(pooled.initial_weights(), strict=False)
    return model


def _full(model: Any) -> Dict[str, Dict[str, np.ndarray]]:
    """Every table's full weight and optimizer state (collective)."""
    from recpipe.pipeline.tiered.migration import gather_full_optimizer_state, gather_full_weights

    return {
        "weights": {k: v.numpy() for k, v in gather_full_weights(model).items()},
        "state": {
            k: {n: t.numpy() for n, t in v.items() if n != "step"}
            for k, v in gather_full_optimizer_state(model).items()
        },
    }


def _same(a: Dict[str, Dict[str, Any]], b: Dict[str, Dict[str, Any]]) -> bool:
    return all(np.array_equal(a["weights"][k], b["weights"][k]) for k in a["weights"]) and all(
        np.array_equal(a["state"][k][n], b["state"][k][n]) for k in a["state"] for n in a["state"][k]
    )


def _save_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    """The torchrec job: trains K steps, saves as torchrec users do, trains K2 more (the reference)."""
    import torch.distributed.checkpoint as tdcp

    model = _torchrec_model(world)
    for step in range(K):
        pooled.train_step(model, step, rank)
    tdcp.save(
        {**model.state_dict(), "fused_optimizer": model.fused_optimizer.state_dict()},
        checkpoint_id=f"{root}/with_optimizer",
    )
    tdcp.save(model.state_dict(), checkpoint_id=f"{root}/weights_only")
    saved = _full(model)
    bad = _torchrec_model(world)  # a diverged run: one row of t1 (ROW_WISE) is NaN
    with torch.no_grad():
        bad.state_dict()["embedding_bags.t1.weight"].local_shards()[0].tensor[3, 1] = float("nan")
    tdcp.save({**bad.state_dict(), "fused_optimizer": bad.fused_optimizer.state_dict()}, checkpoint_id=f"{root}/nan")
    outputs = [pooled.train_step(model, step, rank) for step in range(K, K + K2)]
    return {"saved": saved, "outputs": outputs, "final": _full(model)["weights"]}


def _refused(model: Any, root: str, error: type, **kwargs: Any) -> str:
    """The message of a load that must be refused, checking that it changed nothing."""
    from recpipe.pipeline import checkpoint as recpipe_dcp

    before = _full(model)
    with pytest.raises(error) as err:
        recpipe_dcp.load(model, root, verify=False, **kwargs)
    assert _same(before, _full(model)), f"a refused load changed the model: {err.value}"
    return str(err.value)


def _reads_of(load: Any) -> List[List[Any]]:
    """Runs ``load()`` and returns every read of a row block it made: ``[key, rows]`` of each
    tensor recpipe's loader asked DCP to fill (its ``layout.read_here``, wrapped for the call)."""
    from recpipe.pipeline.checkpoint import layout

    reads: List[List[Any]] = []
    read_here = layout.read_here

    def spy(state: Dict[str, Any], *args: Any, **kwargs: Any) -> None:
        reads.extend([key, int(t.shape[0])] for key, t in state.items() if isinstance(t, torch.Tensor) and t.dim())
        read_here(state, *args, **kwargs)

    layout.read_here = spy  # type: ignore[assignment]
    try:
        load()
    finally:
        layout.read_here = read_here  # type: ignore[assignment]
    return reads


def _load_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    out: Dict[str, Any] = {"errors": {}}
    adopted = pooled.tiered_model(world, "rowwise_adagrad", PLACEMENTS)
    assert set(adopted.module.tiered_tables()) == {"t0", "t1"}
    import recpipe.pipeline.tiered.backends.buffers as tiered

    write_rows, tiered.WRITE_CHUNK_ROWS = tiered.WRITE_CHUNK_ROWS, 5  # each block's rows written 5 at a time
    try:
        out["reads"] = _reads_of(lambda: recpipe_dcp.load(adopted, f"{root}/with_optimizer", verify=False))
    finally:
        tiered.WRITE_CHUNK_ROWS = write_rows
    out["loaded"] = _full(adopted)
    out["steps"] = {n: s.step for n, s in adopted.module.tiered_tables().items()}

    weights_only = pooled.tiered_model(world, "rowwise_adagrad", PLACEMENTS)
    out["errors"]["no_state_strict"] = _refused(weights_only, f"{root}/weights_only", recpipe_dcp.CheckpointLoadError)
    recpipe_dcp.load(weights_only, f"{root}/weights_only", verify=False, strict=False)
    out["weights_only"] = _full(weights_only)

    out["errors"]["nan"] = _refused(
        pooled.tiered_model(world, "rowwise_adagrad", PLACEMENTS), f"{root}/nan", recpipe_dcp.CheckpointTableError
    )
    adam = pooled.tiered_model(world, "adam", PLACEMENTS)
    out["errors"]["optimizer"] = _refused(adam, f"{root}/with_optimizer", recpipe_dcp.CheckpointTableError)
    saved_tables = list(pooled.TABLES)
    pooled.TABLES = [("t0", 98, 8, ["f0", "f1"])] + saved_tables[1:]  # one row more than saved
    try:
        bigger = pooled.tiered_model(world, "rowwise_adagrad", PLACEMENTS)
        out["errors"]["size"] = _refused(bigger, f"{root}/with_optimizer", recpipe_dcp.CheckpointTableError)
    finally:
        pooled.TABLES = saved_tables

    models = {"adopted": adopted, "weights_only": weights_only}
    out["outputs"] = {
        name: [pooled.train_step(m, step, rank) for step in range(K, K + K2)] for name, m in models.items()
    }
    out["final"] = {name: _full(m)["weights"] for name, m in models.items()}
    return out


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    torch.testing.assert_close(
        torch.from_numpy(np.asarray(got)),
        torch.from_numpy(np.asarray(want)),
        atol=pooled.ATOL,
        rtol=pooled.RTOL,
        msg=lambda m: f"{what}: {m}",
    )


def test_tiered_tables_adopt_a_plain_torchrec_checkpoint_and_train_on_as_torchrec(tmp_path: Path) -> None:
    """A plain torchrec checkpoint (TABLE_WISE and ROW_WISE FUSED row-wise Adagrad tables, torchrec's
    own sharder, torch.distributed.checkpoint.save of state_dict + fused_optimizer) loads into HYBRID /
    CACHING tiered tables: weights and momentum equal torchrec's, and every following step's outputs
    and the final tables equal the uninterrupted torchrec run. Weights only (strict=False): loaded, momentum
    zero, the run diverges; strict refuses it. Another size or optimizer: refused on every rank, naming
    the table and both, the model unchanged."""
    src = run_gloo(2, _save_body, str(tmp_path))
    out = run_gloo(2, _load_body, str(tmp_path))
    saved = src[0]["saved"]
    assert set(saved["state"]) == {"embedding_bags.t0", "embedding_bags.t1"}
    for rank, res in enumerate(out):
        for key, want in saved["weights"].items():
            np.testing.assert_array_equal(res["loaded"]["weights"][key], want, err_msg=f"rank {rank} {key}")
            np.testing.assert_array_equal(res["weights_only"]["weights"][key], want, err_msg=f"rank {rank} {key}")
        for key, states in saved["state"].items():
            for name, want in states.items():
                assert (want > 0).sum() > 5, (key, name)  # trained: a nonzero momentum to carry
                np.testing.assert_array_equal(res["loaded"]["state"][key][name], want, err_msg=f"rank {rank} {name}")
                assert not res["weights_only"]["state"][key][name].any(), f"rank {rank}: weights-only {name} not zero"
        assert res["steps"] == {"t0": 0, "t1": 0}  # torchrec's checkpoint records no step: the table keeps its own
        for step, (got, want) in enumerate(zip(res["outputs"]["adopted"], src[rank]["outputs"])):
            _close(got, want, f"rank {rank} adopted step {K + step}")
        for key, want in src[rank]["final"].items():
            _close(res["final"]["adopted"][key], want, f"rank {rank} final {key}")
        gap = pooled.max_divergence(res["outputs"]["weights_only"], src[rank]["outputs"])
        assert gap > 1e-3, f"rank {rank}: the weights-only load matches torchrec without the momentum ({gap})"
        # each rank streams the torchrec tables one saved chunk at a time (checked, then loaded), never
        # a whole ROW_WISE table: t0 was saved TABLE_WISE (one chunk, 97 rows), t1 ROW_WISE (2 x 25 rows)
        reads = {}
        for key, rows in res["reads"]:
            reads.setdefault(key, []).append(rows)
        assert reads == {
            "embedding_bags.t0.weight": [97, 97],
            "fused_optimizer.state.embedding_bags.t0.weight.t0.momentum1": [97, 97],
            "embedding_bags.t1.weight": [25, 25, 25, 25],
            "fused_optimizer.state.embedding_bags.t1.weight.t1.momentum1": [25, 25, 25, 25],
        }, reads
    errors = out[0]["errors"]
    assert errors == out[1]["errors"], "every rank gives the same refusal"
    msg = errors["no_state_strict"]
    assert "holds no fused optimizer state" in msg and "strict=False" in msg and "(ranks 0, 1)" in msg, msg
    msg = errors["size"]
    assert (
        "table 'embedding_bags.t0': the checkpoint holds a torchrec table of [num_embeddings, dim] = [97, 8], "
        "this model a tiered table of [98, 8]"
    ) in msg, msg
    assert "the model is unchanged" in msg and "Possible solutions:" in msg and "embedding_dim" in msg, msg
    assert "'embedding_bags.t1'" not in msg, msg
    msg = errors["optimizer"]
    for t, rows in (("t0", 97), ("t1", 50)):
        assert (
            f"table 'embedding_bags.{t}': the checkpoint holds fused optimizer state of rowwise_adagrad state "
            f"{{'momentum1': [{rows}]}} (under fused_optimizer.state.embedding_bags.{t}.weight.{t}.*), this "
            "model's tiered table trains with adam"
        ) in msg, msg
    assert "RowWiseAdagrad" in msg, msg
    msg = errors["nan"]
    assert (
        "2 of the 50 rows of the torchrec table it would load from checkpoint" in msg  # one per rank's shard
        and "(table 'embedding_bags.t1', embedding_bags.t1.weight) hold NaN or inf values" in msg
    ), msg
    assert "Nothing was loaded" in msg and "embedding_bags.t0" not in msg, msg


IO_PLACEMENTS = {
    "a1": dict(mode="CACHING", cache_load_factor=0.4, seed=5),
    "a2": dict(mode="HYBRID", cache_load_factor=0.5, seed=5),
}


def _mixed_model(world: int) -> Any:
    """dcp_models' model of IO_TABLES with a dense head (DDP): a0 TABLE_WISE FUSED on rank 0 (rank 1
    holds no FUSED shard), a1 / a2 tiered; recpipe's tiered sharder."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan, ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder
    from recpipe.planner.torchrec_plan import PlacementParameterSharding, row_wise_sharding_spec

    ebc = dm.make_ebc(dm.IO_TABLES, seed=9)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": dm.LR})
    sharder = TieredEmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        ebc,
        {"a0": table_wise(rank=0), "a1": row_wise(), "a2": row_wise()},
        sharder=sharder,
        local_size=world,
        world_size=world,  # type: ignore[arg-type]
        device_type="cpu",
    )
    shapes = {name: (rows, dim) for name, rows, dim, _ in dm.IO_TABLES}
    for name, placement in IO_PLACEMENTS.items():
        plan[name] = PlacementParameterSharding(
            sharding_type=ShardingType.ROW_WISE.value,
            compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
            ranks=list(range(world)),
            sharding_spec=row_wise_sharding_spec(*shapes[name], world, world, "cpu"),
            dist_type="hash_roundrobin",
            **placement,
        )
    return DistributedModelParallel(
        dm.Model(ebc, sum(d * len(f) for _, _, d, f in dm.IO_TABLES)),
        plan=ShardingPlan({"ebc": plan}),
        sharders=[sharder],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )


def _mixed_save_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    import torch.distributed.checkpoint as tdcp

    model = dm.plain_torchrec_model(world, {"a0": 0, "a1": 0}, recpipe_sharder=False, seed=2)
    opt = dm.dense_opt(model)
    for step in range(dm.TRAIN_STEPS):
        dm.train_step(model, opt, dm.IO_TABLES, step, [rank])
    tdcp.save(
        {**model.state_dict(), "fused_optimizer": model.fused_optimizer.state_dict()},
        checkpoint_id=f"{root}/with_optimizer",
    )
    tdcp.save(model.state_dict(), checkpoint_id=f"{root}/weights_only")
    return {
        "next": [dm.train_step(model, opt, dm.IO_TABLES, s, [rank]) for s in range(dm.TRAIN_STEPS, dm.TRAIN_STEPS + 2)]
    }


def _mixed_load_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    out: Dict[str, Any] = {}
    model = _mixed_model(world)
    assert set(model.module.ebc.tiered_tables()) == {"a1", "a2"}
    fresh = model.state_dict()["head.weight"].clone()
    with pytest.raises(recpipe_dcp.CheckpointLoadError) as err:
        recpipe_dcp.load(model, f"{root}/weights_only", verify=False)
    out["no_state"] = str(err.value)
    assert torch.equal(model.state_dict()["head.weight"], fresh)
    recpipe_dcp.load(model, f"{root}/with_optimizer", verify=False)  # strict: every entry is the model's
    opt = dm.dense_opt(model)
    out["next"] = [
        dm.train_step(model, opt, dm.IO_TABLES, s, [rank]) for s in range(dm.TRAIN_STEPS, dm.TRAIN_STEPS + 2)
    ]
    return out


def test_mixed_model_adopts_torchrec_tables_beside_fused_ones_under_strict(tmp_path: Path) -> None:
    """A wrapped model (dense head, DMP prefix ``module.``) keeping one torchrec TABLE_WISE FUSED table
    on rank 0 and tiering the others loads a plain torchrec checkpoint with strict=True (the torchrec
    tables' optimizer entries are the tiered tables' now): the next steps equal the torchrec source's.
    Without optimizer state, strict refuses on every rank (rank 1, holding no FUSED shard, included:
    none goes on alone into the next collective)."""
    src = run_gloo(2, _mixed_save_body, str(tmp_path))
    out = run_gloo(2, _mixed_load_body, str(tmp_path))
    assert out[0]["no_state"] == out[1]["no_state"] and "holds no fused optimizer state" in out[0]["no_state"]
    for rank in range(2):
        for s, (got, want) in enumerate(zip(out[rank]["next"], src[rank]["next"])):
            for key in ("emb", "pred"):
                _close(got[key], want[key], f"rank {rank} step {s} {key}")


def _no_fused_shard_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    """The mixed model (rank 1 holds no FUSED shard) saved by recpipe.pipeline.checkpoint.save, and without
    its fused optimizer state; loaded into a fresh model built alike."""
    import torch.distributed.checkpoint as tdcp

    from recpipe.pipeline import checkpoint as recpipe_dcp

    model = _mixed_model(world)
    opt = dm.dense_opt(model)
    for step in range(dm.TRAIN_STEPS):
        dm.train_step(model, opt, dm.IO_TABLES, step, [rank])
    recpipe_dcp.save(model, f"{root}/recpipe")
    state = recpipe_dcp.dcp_state_dict(model)
    del state[recpipe_dcp.FUSED_OPTIMIZER_KEY]
    tdcp.save(state, checkpoint_id=f"{root}/no_optimizer")
    tdcp.save(
        {k: v for k, v in state.items() if not k.startswith(recpipe_dcp.TIERED_DCP_PREFIX + ".")},
        checkpoint_id=f"{root}/no_rows",
    )  # the tiered tables' empty placeholders only
    out: Dict[str, Any] = {
        "next": [dm.train_step(model, opt, dm.IO_TABLES, s, [rank]) for s in range(dm.TRAIN_STEPS, dm.TRAIN_STEPS + 2)]
    }
    fresh = _mixed_model(world)
    recpipe_dcp.load(fresh, f"{root}/recpipe")
    opt = dm.dense_opt(fresh)
    out["loaded_next"] = [
        dm.train_step(fresh, opt, dm.IO_TABLES, s, [rank]) for s in range(dm.TRAIN_STEPS, dm.TRAIN_STEPS + 2)
    ]
    out["no_state"] = _refused(_mixed_model(world), f"{root}/no_optimizer", recpipe_dcp.CheckpointLoadError)
    out["no_rows"] = _refused(_mixed_model(world), f"{root}/no_rows", recpipe_dcp.CheckpointTableError, strict=False)
    return out


def test_dcp_round_trip_of_a_model_with_a_rank_holding_no_fused_shard(tmp_path: Path) -> None:
    """A model whose only torchrec FUSED table is TABLE_WISE on rank 0 (rank 1's fused optimizer state
    is empty) loads its own recpipe.pipeline.checkpoint.save (rank 1's empty state is not looked up as
    an entry); the next steps equal the saving model's. A checkpoint without fused optimizer state is
    refused under strict on every rank, the model unchanged (rank 1, expecting no state, included);
    one holding no rows of the tiered tables (their placeholders only) is refused naming them."""
    # a rank going on alone would wait in the next collective: fail instead of waiting 600 s
    out = run_gloo(2, _no_fused_shard_body, str(tmp_path), timeout_s=180.0)
    assert out[0]["no_state"] == out[1]["no_state"], "every rank gives the same refusal"
    assert "holds no fused optimizer state" in out[0]["no_state"], out[0]["no_state"]
    msg = out[0]["no_rows"]  # still refused, even with strict=False: the table is there, without rows
    assert msg == out[1]["no_rows"], "every rank gives the same refusal"
    for t in ("a1", "a2"):
        assert f"table 'module.ebc.embedding_bags.{t}' is tiered in this model, but the checkpoint holds no rows" in msg
    for rank in range(2):
        for s, (got, want) in enumerate(zip(out[rank]["loaded_next"], out[rank]["next"])):
            for key in ("emb", "pred"):
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"rank {rank} step {s} {key}")


def _routed_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    """recpipe's routed ROW_WISE FUSED tables (t0 hash_roundrobin, t1 roundrobin: each shard holds
    routed rows, recorded beside the weight) saved with plain DCP, adopted by tiered tables."""
    import torch.distributed.checkpoint as tdcp

    from recpipe.pipeline import checkpoint as recpipe_dcp

    ref = pooled.fused_model(world, "rowwise_adagrad", "row_wise_routed")
    for step in range(K):
        pooled.train_step(ref, step, rank)
    tdcp.save({**ref.state_dict(), "fused_optimizer": ref.fused_optimizer.state_dict()}, checkpoint_id=root)
    adopted = pooled.tiered_model(
        world, "rowwise_adagrad", PLACEMENTS, backend="fbgemm"
    )  # fbgemm's CPU TBE holds the rows
    # strict: the row-order records are the tables' own
    reads = _reads_of(lambda: recpipe_dcp.load(adopted, root, verify=False))
    out: Dict[str, Any] = {"saved": _full(ref), "loaded": _full(adopted), "reads": reads}
    out["outputs"] = {
        name: [pooled.train_step(m, step, rank) for step in range(K, K + K2)]
        for name, m in (("ref", ref), ("adopted", adopted))
    }
    return out


def test_tiered_tables_adopt_routed_fused_tables_of_recpipe_sharders(tmp_path: Path) -> None:
    """A routed FUSED table's shards hold hash_roundrobin / roundrobin rows, not their offsets' range:
    each saved block (a saving rank's shard) is read in turn and its rows placed by the checkpoint's
    row-order record, so the adopted tiered tables (on the fbgemm backend) hold the saved rows and
    momentum and train on as the uninterrupted run."""
    for rank, res in enumerate(run_gloo(2, _routed_body, str(tmp_path))):
        assert _same(res["saved"], res["loaded"]), f"rank {rank}: adopted rows differ from the saved tables"
        # one saving rank's routed block at a time (t0: 97 rows, t1: 50, over 2 ranks), checked then loaded
        weight_reads = sorted(rows for key, rows in res["reads"] if key.endswith(".weight"))
        assert weight_reads == sorted([49, 48] * 2 + [25, 25] * 2), res["reads"]
        for step, (got, want) in enumerate(zip(res["outputs"]["adopted"], res["outputs"]["ref"])):
            _close(got, want, f"rank {rank} adopted step {K + step}")


def _reverse_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    """The reverse: recpipe's checkpoint of HYBRID / CACHING tiered tables loaded into torchrec FUSED
    tables (torchrec's TABLE_WISE / ROW_WISE, and recpipe's routed ROW_WISE)."""
    from recpipe.pipeline import checkpoint as recpipe_dcp

    src = pooled.tiered_model(world, "rowwise_adagrad", PLACEMENTS)
    for step in range(K):
        pooled.train_step(src, step, rank)
    recpipe_dcp.save(src, root)
    targets = {
        "torchrec": _torchrec_model(world),
        "routed": pooled.fused_model(world, "rowwise_adagrad", "row_wise_routed"),
    }
    for model in targets.values():
        recpipe_dcp.load(model, root)
    out: Dict[str, Any] = {"saved": _full(src), "loaded": {n: _full(m) for n, m in targets.items()}}
    saved_tables = list(pooled.TABLES)
    pooled.TABLES = [("t0", 98, 8, ["f0", "f1"])] + saved_tables[1:]  # one row more than saved
    try:
        out["size_error"] = _refused(_torchrec_model(world), root, recpipe_dcp.CheckpointTableError)
    finally:
        pooled.TABLES = saved_tables
    dtensor = _torchrec_model(world, dtensor=True)
    before = {k: v.full_tensor().clone() for k, v in dtensor.state_dict().items() if k.endswith(".weight")}
    with pytest.raises(recpipe_dcp.CheckpointTableError) as err:
        recpipe_dcp.load(dtensor, root)
    out["dtensor_error"] = str(err.value)
    out["dtensor_unchanged"] = all(
        torch.equal(before[k], v.full_tensor()) for k, v in dtensor.state_dict().items() if k.endswith(".weight")
    )
    # checkpoints damaged past save's checks (torch's dcp.save of dcp_state_dict, rank 0's export of t1 edited)
    import torch.distributed.checkpoint as tdcp

    out["damaged"] = {}
    for damage in ("nan", "repeated", "outside"):
        state = recpipe_dcp.dcp_state_dict(src)
        if rank == 0:
            ids_key, rows_key = (
                recpipe_dcp.tiered_dcp_key("embedding_bags.t1", 0, f) for f in ("global_ids", "weights")
            )
            ids, rows = state[ids_key].clone(), state[rows_key].clone()
            if damage == "nan":
                rows[2, 0] = float("nan")
            else:
                ids[0] = ids[1] if damage == "repeated" else 10**6
            state[ids_key], state[rows_key] = ids, rows
        tdcp.save(state, checkpoint_id=f"{root}_{damage}")
        out["damaged"][damage] = _refused(_torchrec_model(world), f"{root}_{damage}", recpipe_dcp.CheckpointTableError)
    models = {"src": src, **targets}
    out["outputs"] = {
        name: [pooled.train_step(m, step, rank) for step in range(K, K + K2)] for name, m in models.items()
    }
    return out


def test_fused_tables_load_a_recpipe_checkpoint_of_tiered_tables(tmp_path: Path) -> None:
    """A user dropping recpipe's tiered plan: the tiered exports of a recpipe checkpoint load into torchrec
    FUSED tables (rows and momentum by global id), which then train on as the uninterrupted tiered run.
    A table of another size
    is refused on every rank naming both, and exports with a NaN row, a repeated row or a global id past
    the table are refused on every rank naming the table and the problem, as is a model whose torchrec
    weights are DTensors (torchrec's output_dtensor); the model unchanged."""
    out = run_gloo(2, _reverse_body, str(tmp_path))
    msg = out[0]["size_error"]
    assert msg == out[1]["size_error"], "every rank gives the same refusal"
    assert (
        "table 'embedding_bags.t0' was tiered when saved ([97, 8] trained with rowwise_adagrad), and this "
        "model's torchrec table is [98, 8] trained with rowwise_adagrad"
    ) in msg, msg
    assert "the model is unchanged" in msg and "Possible solutions:" in msg, msg
    msg = out[0]["dtensor_error"]
    assert msg == out[1]["dtensor_error"] and out[0]["dtensor_unchanged"] and out[1]["dtensor_unchanged"], out
    # a DTensor weight (torchrec's output_dtensor) is not taken for a torchrec table here: refused before any read
    assert "table 'embedding_bags.t0' was tiered when saved, but this model does not tier it" in msg, msg
    damaged = out[0]["damaged"]
    assert damaged == out[1]["damaged"], "every rank gives the same refusal"
    assert "table 'embedding_bags.t1': 1 rows of its tiered exports hold NaN or inf values" in damaged["nan"], damaged
    assert (
        "table 'embedding_bags.t1': 1 rows are missing from its tiered exports and 1 appear more than once"
        in damaged["repeated"]
    ), damaged
    assert (
        "table 'embedding_bags.t1': the tiered export of rank 0 holds global ids outside [0, 50)" in damaged["outside"]
    ), damaged
    assert all("the model is unchanged" in m for m in damaged.values()), damaged
    for rank, res in enumerate(out):
        for name in ("torchrec", "routed"):
            assert _same(res["saved"], res["loaded"][name]), f"rank {rank} {name}: loaded tables differ"
            for step, (got, want) in enumerate(zip(res["outputs"][name], res["outputs"]["src"])):
                _close(got, want, f"rank {rank} {name} step {K + step}")
