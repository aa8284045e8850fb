"""EvalPipelinePrefetch: outputs bit-identical to a plain eval loop, on 2 gloo ranks.

The plain loop is ``model.eval(); with torch.no_grad(): model(batch)`` per batch. The pipeline
looks batch B+1 up (and starts B+2's and B+3's input dists) before B's forward; every output
must be ``torch.equal`` to the loop's, with every batch evaluated (the last too, also for
iterators shorter than the pipeline's depth), the tables, the TBE lookup counters and the
modules' training flags as the loop leaves them. Covered: torchrec FUSED tables (table-,
column-, row-wise, plus a DATA_PARALLEL table), recpipe tiered tables (CACHING / HYBRID,
row- and table-wise) and dynamic tables (occupancy unchanged: eval inserts nothing);
``reset()``, ``detach()`` / ``attach()`` and a table write in the middle of an evaluation;
a model in training mode refused.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
from harness.dynamic_models import build_dynamic, dynamic_shards, raw_key_batches
from harness.gloo import run_gloo
from harness.pipelines import EMB_DIM, TwoModuleModel, build_dmp, make_batches, run_reference

CPU = torch.device("cpu")
N_EVAL = 7  # batches per evaluation: more than the pipeline's 4 in flight, odd
TIERED = {"t0": ("ebc", 300, "CACHING", 0.2), "t1": ("ebc", 200, "HYBRID", 0.5), "s0": ("ec", 100, "CACHING", 0.3)}


def _plain(model: Any, batches: Sequence[Any]) -> List[torch.Tensor]:
    """The reference: the model called on each batch, in eval mode, without grad."""
    with torch.no_grad():
        return [model(b)[1][1].clone() for b in batches]


def _drive(pipe: Any, it: Iterator[Any], n: Optional[int] = None) -> List[torch.Tensor]:
    """``n`` progress() calls (None: until StopIteration); the logits of each."""
    out: List[torch.Tensor] = []
    while n is None or len(out) < n:
        try:
            out.append(pipe.progress(it)[1].clone())
        except StopIteration:
            break
    return out


def _numpy(ts: Sequence[torch.Tensor]) -> List[np.ndarray]:
    return [t.numpy() for t in ts]


def _tbe_steps(model: Any) -> List[int]:
    from recpipe.pipeline.train_pipeline.take_back import fused_tbes

    return [int(t.step) for t in fused_tbes(model)]


def _tables(model: Any) -> Dict[str, np.ndarray]:
    """This rank's table shards (local tensors of the sharded state dict)."""
    out = {}
    for name, t in model.state_dict().items():
        if hasattr(t, "local_shards"):
            for k, shard in enumerate(t.local_shards()):
                out[f"{name}/{k}"] = shard.tensor.detach().clone().numpy()
    return out


def _assert_equal(rank: int, what: str, got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> None:
    assert len(got) == len(want), f"rank {rank} {what}: {len(got)} outputs, the plain loop {len(want)}"
    for step, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), f"rank {rank} {what}: batch {step} differs, max |diff| {np.abs(a - b).max()}"


# ---------------------------------------------------------------- torchrec FUSED tables
def _fused_body(rank: int, world: int, sharding: str) -> Dict[str, Any]:
    from recpipe.pipeline import EvalPipelinePrefetch

    overrides = {"t1": ("data_parallel", None)} if sharding == "table_wise" else None
    model, _ = build_dmp(sharding, CPU, overrides=overrides)
    batches = make_batches(rank, n=N_EVAL, seed=4)
    model.eval()
    tables, steps0 = _tables(model), _tbe_steps(model)
    out: Dict[str, Any] = {"plain": _numpy(_plain(model, batches))}
    steps1 = _tbe_steps(model)
    pipe = EvalPipelinePrefetch(model, CPU)
    it = iter(batches)
    out["pipeline"] = _numpy(_drive(pipe, it))
    out["stops_again"] = _drive(pipe, it) == []
    out["lookups"] = ([b - a for a, b in zip(steps0, steps1)], [b - a for a, b in zip(steps1, _tbe_steps(model))])
    out["tables_unchanged"] = all(np.array_equal(v, _tables(model)[k]) for k, v in tables.items())
    out["short"] = {n: _numpy(_drive(pipe, iter(batches[:n]))) for n in (1, 2, 3)}  # fewer than in flight
    out["training"] = [m.training for m in model.modules()]
    out["pipelined"] = sorted(m.forward.name for m in pipe._pipelined_modules)
    return out


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise", "row_wise"])
def test_eval_pipeline_equals_plain_loop_on_fused_tables(sharding: str) -> None:
    for rank, res in enumerate(run_gloo(2, _fused_body, sharding)):
        assert len({a.tobytes() for a in res["plain"]}) == N_EVAL, "equal outputs: the comparison has no teeth"
        _assert_equal(rank, "pipeline", res["pipeline"], res["plain"])
        assert res["stops_again"], "progress() after the end must raise StopIteration again"
        for n, got in res["short"].items():
            _assert_equal(rank, f"{n}-batch evaluation", got, res["plain"][:n])
        plain_lookups, pipe_lookups = res["lookups"]
        assert plain_lookups == pipe_lookups and all(n == N_EVAL for n in plain_lookups), res["lookups"]
        assert res["tables_unchanged"]
        assert not any(res["training"]), "the pipeline changed a module's training flag"
        assert res["pipelined"] == ["ebc", "ec"], res["pipelined"]


# ---------------------------------------------------------------- recpipe tiered tables
def _build_tiered(world: int, sharding: str) -> Any:
    """TwoModuleModel with every table tiered (``TIERED``), row- or table-wise."""
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan, ShardingType

    from recpipe.pipeline import TieredEmbeddingBagCollectionSharder, TieredEmbeddingCollectionSharder
    from recpipe.planner.torchrec_plan import (
        PlacementParameterSharding,
        row_wise_sharding_spec,
        table_wise_sharding_spec,
    )

    torch.manual_seed(5)
    model = TwoModuleModel()
    ebc_weights = {t: model.ebc.embedding_bags[t].weight.detach().clone() for t in ("t0", "t1")}
    weights = [model.ebc.embedding_bags["t0"].weight, model.ebc.embedding_bags["t1"].weight]
    apply_optimizer_in_backward(torch.optim.Adam, weights + [model.ec.embeddings["s0"].weight], {"lr": 0.02})
    plan: Dict[str, Dict[str, Any]] = {"ebc": {}, "ec": {}}
    for i, (table, (module, rows, mode, x)) in enumerate(TIERED.items()):
        if sharding == "row_wise":
            where: Dict[str, Any] = dict(
                sharding_type=ShardingType.ROW_WISE.value,
                ranks=list(range(world)),
                sharding_spec=row_wise_sharding_spec(rows, EMB_DIM, world, world, "cpu"),
                dist_type="hash_roundrobin",
                seed=7,
            )
        else:
            where = dict(
                sharding_type=ShardingType.TABLE_WISE.value,
                ranks=[i % world],
                sharding_spec=table_wise_sharding_spec(rows, EMB_DIM, i % world, world, "cpu"),
            )
        plan[module][table] = PlacementParameterSharding(
            compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value, mode=mode, cache_load_factor=x, **where
        )
    dmp = DistributedModelParallel(
        module=model,
        device=CPU,
        plan=ShardingPlan({k: EmbeddingModuleShardingPlan(v) for k, v in plan.items()}),
        sharders=[TieredEmbeddingBagCollectionSharder(), TieredEmbeddingCollectionSharder()],  # type: ignore[list-item]
    )
    for table, shard in dmp.module.ebc.tiered_tables().items():  # EC tables start from the module's weights
        shard.load_global_weights(ebc_weights[table])
    return dmp


def _tiered_shards(model: Any) -> Dict[str, Any]:
    return {**model.module.ebc.tiered_tables(), **model.module.ec.tiered_tables()}


def _tiered_body(rank: int, world: int, sharding: str) -> Dict[str, Any]:
    from recpipe.pipeline import EvalPipelinePrefetch

    batches = make_batches(rank, n=N_EVAL, seed=6)
    out: Dict[str, Any] = {}
    for kind in ("plain", "pipeline"):
        model = _build_tiered(world, sharding)
        model.eval()
        rows = {n: s.export_state().weights.numpy() for n, s in _tiered_shards(model).items()}
        logits = _plain(model, batches) if kind == "plain" else _drive(EvalPipelinePrefetch(model, CPU), iter(batches))
        out[kind] = _numpy(logits)
        out[kind + " stats"] = {n: s.tier_stats() for n, s in _tiered_shards(model).items()}
        out[kind + " rows unchanged"] = all(
            np.array_equal(rows[n], s.export_state().weights.numpy()) for n, s in _tiered_shards(model).items()
        )
    return out


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_eval_pipeline_equals_plain_loop_on_tiered_tables(sharding: str) -> None:
    missed = []
    for rank, res in enumerate(run_gloo(2, _tiered_body, sharding)):
        assert len({a.tobytes() for a in res["plain"]}) == N_EVAL
        _assert_equal(rank, "pipeline", res["pipeline"], res["plain"])
        # the same lookups in the same order: the same cache hits, loads and evictions
        assert res["pipeline stats"] == res["plain stats"], (res["pipeline stats"], res["plain stats"])
        assert res["plain rows unchanged"] and res["pipeline rows unchanged"]
        missed += [
            s["cumulative_hit_rate"] < 1.0 for n, s in res["pipeline stats"].items() if TIERED[n][2] == "CACHING"
        ]
    assert any(missed), "no CACHING table missed its cache: the caches were not exercised"


# ---------------------------------------------------------------- dynamic tables
def _dynamic_body(rank: int, world: int, sharding: str) -> Dict[str, Any]:
    from recpipe.pipeline import EvalPipelinePrefetch

    trained = raw_key_batches(rank, 4, 3)
    batches = trained[:3] + raw_key_batches(rank, N_EVAL - 3, 99)  # keys held, then mostly unseen keys
    out: Dict[str, Any] = {}
    for kind in ("plain", "pipeline"):
        model, opt = build_dynamic(world, sharding)
        run_reference(model, opt, trained)  # fills the tables (training inserts)
        model.eval()
        before = {n: (s.tier_stats()["occupancy"], s.dynamic_rows()) for n, s in dynamic_shards(model).items()}
        logits = _plain(model, batches) if kind == "plain" else _drive(EvalPipelinePrefetch(model, CPU), iter(batches))
        out[kind] = _numpy(logits)
        after = {n: (s.tier_stats()["occupancy"], s.dynamic_rows()) for n, s in dynamic_shards(model).items()}
        out[kind + " occupancy"] = {n: (before[n][0], after[n][0]) for n in before}
        out[kind + " rows unchanged"] = all(
            all(torch.equal(a, b) for a, b in zip(before[n][1], after[n][1])) for n in before
        )
    return out


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_eval_pipeline_equals_plain_loop_on_dynamic_tables(sharding: str) -> None:
    held = 0.0
    for rank, res in enumerate(run_gloo(2, _dynamic_body, sharding)):
        assert len({a.tobytes() for a in res["plain"]}) == N_EVAL
        _assert_equal(rank, "pipeline", res["pipeline"], res["plain"])
        for kind in ("plain", "pipeline"):
            assert all(a == b for a, b in res[kind + " occupancy"].values()), (kind, res[kind + " occupancy"])
            assert res[kind + " rows unchanged"], f"rank {rank} {kind}: an eval lookup changed a dynamic table"
        held += sum(a for a, _ in res["pipeline occupancy"].values())
    assert held > 0, "the tables hold no key: the comparison has no teeth"


# ---------------------------------------------------------------- reset / detach / table writes
def _interrupted_body(rank: int, world: int) -> Dict[str, Any]:
    from recpipe.pipeline import EvalPipelinePrefetch

    model, _ = build_dmp("row_wise", CPU)
    batches = make_batches(rank, n=N_EVAL + 3, seed=8)
    model.eval()
    want = _numpy(_plain(model, batches))
    out: Dict[str, Any] = {"plain": want}

    # reset() after 3 batches drops the 3 in flight (3, 4, 5); evaluation goes on from batch 6
    pipe = EvalPipelinePrefetch(model, CPU)
    steps0, it = _tbe_steps(model), iter(batches)
    first = _drive(pipe, it, 3)
    pipe.reset()
    out["reset"] = _numpy(first + _drive(pipe, it))
    out["reset lookups"] = [b - a for a, b in zip(steps0, _tbe_steps(model))]
    pipe.detach()  # one pipeline attached to a model at a time

    # detach() after 2 batches: the model is plain again; the next progress() re-attaches
    pipe = EvalPipelinePrefetch(model, CPU)
    steps0, it = _tbe_steps(model), iter(batches)
    first = _drive(pipe, it, 2)
    detached = pipe.detach()
    out["detached call"] = _numpy(_plain(detached, batches[:1]))
    out["detach"] = _numpy(first + _drive(pipe, it))
    out["detach lookups"] = [b - a for a, b in zip(steps0, _tbe_steps(model))]
    pipe.detach()

    # a table write while lookups are in flight is refused; attach() looks them up again
    pipe = EvalPipelinePrefetch(model, CPU)
    it = iter(batches)
    first = _drive(pipe, it, 2)
    with torch.no_grad():
        for t in model.state_dict().values():
            for shard in getattr(t, "local_shards", list)():
                shard.tensor.mul_(0.5)
    try:
        pipe.progress(it)
        out["write refused"] = None
    except RuntimeError as e:
        out["write refused"] = str(e)
    pipe.detach()
    out["after write plain"] = _numpy(_plain(model, batches[2:]))
    pipe.attach()
    out["after write"] = _numpy(first + _drive(pipe, it))
    return out


def test_eval_pipeline_reset_detach_and_table_writes_midway() -> None:
    for rank, res in enumerate(run_gloo(2, _interrupted_body)):
        want = res["plain"]
        _assert_equal(rank, "reset after 3", res["reset"], want[:3] + want[6:])
        assert all(n == len(want) - 3 for n in res["reset lookups"]), res["reset lookups"]  # in-flight taken back
        _assert_equal(rank, "model called while detached", res["detached call"], want[:1])
        _assert_equal(rank, "detach after 2", res["detach"], want)
        assert all(n == len(want) + 1 for n in res["detach lookups"]), res["detach lookups"]
        assert res["write refused"] is not None and "pipeline.attach()" in res["write refused"], res["write refused"]
        new = res["after write plain"]
        assert not any(np.array_equal(a, b) for a, b in zip(new, want[2:])), "the write changed no output"
        _assert_equal(rank, "attach after a write", res["after write"], want[:2] + new)


# ---------------------------------------------------------------- refusals and arguments
def _training_mode_body(rank: int, world: int) -> Tuple[str, bool, bool, bool]:
    from recpipe.pipeline import EvalPipelinePrefetch

    model, _ = build_dmp("table_wise", CPU)
    batches = make_batches(rank, n=2, seed=1)
    it = iter(batches)
    pipe = EvalPipelinePrefetch(model, CPU)
    try:
        pipe.progress(it)
        message = ""
    except ValueError as e:
        message = str(e)
    untouched = next(it) is batches[0]  # the refusal read no batch
    model.eval()
    model.module.over.train()  # one dense submodule left in training mode is refused too
    try:
        pipe.progress(iter(batches))
        sub_refused = False
    except ValueError as e:
        sub_refused = "module.over' (Sequential) is in training mode" in str(e)
    return message, model.training is False and model.module.over.training, untouched, sub_refused


def test_eval_pipeline_refuses_a_model_in_training_mode() -> None:
    for message, modes_kept, untouched, sub_refused in run_gloo(2, _training_mode_body):
        assert "training mode" in message and "model.eval()" in message, message
        assert modes_kept and untouched and sub_refused


def test_eval_pipeline_refuses_bad_arguments_and_is_exported() -> None:
    import recpipe.pipeline
    from recpipe.pipeline.train_pipeline.eval_pipeline import EvalPipelinePrefetch

    assert recpipe.pipeline.EvalPipelinePrefetch is EvalPipelinePrefetch
    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"device must be a torch.device.*torch.device\('cpu'\)"):
        EvalPipelinePrefetch(model, "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="use_emb_lookup_stream must be a bool, got int 1"):
        EvalPipelinePrefetch(model, CPU, use_emb_lookup_stream=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        EvalPipelinePrefetch({}, CPU)  # type: ignore[arg-type]
