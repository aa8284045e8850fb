"""TrainPipelineFusedSparseDist over tiered tables: bit-identical to torchrec's TrainPipelineSparseDist.

The pipeline tests' two-module model (``pipeline_harness``: an EBC with
tables t0, t1 and an EC with table s0) with every table a recpipe tiered table,
ROW_WISE + CUSTOMIZED_KERNEL, hash_roundrobin routing: t0 CACHING 0.2, t1 HYBRID
0.5 (TieredEmbeddingBagCollectionSharder) and s0 CACHING 0.3
(TieredEmbeddingCollectionSharder), fused Adam in the backward, dense Adam.

The fused pipeline issues batch i+1's lookup (which loads and evicts CACHING rows)
right after batch i's backward, before or after the dense optimizer step
(``embedding_lookup_after_opt``); torchrec's pipeline looks batch i+1 up inside
its forward. Losses and predictions must be equal bit for bit (torch.equal) over
10 batches on 2 gloo ranks, and both must equal a non-pipelined loop.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from harness.gloo import run_gloo
from harness.pipelines import EMB_DIM, N_BATCHES, TwoModuleModel, make_batches, run_pipeline, run_reference

# table -> (module, rows, placement mode, cache load factor)
TIERED = {"t0": ("ebc", 300, "CACHING", 0.2), "t1": ("ebc", 200, "HYBRID", 0.5), "s0": ("ec", 100, "CACHING", 0.3)}
SEED = 5  # model init seed (same for every copy)


def _build(
    world: int, backend: Optional[str] = None, fused: Optional[Dict[str, str]] = None, combined: bool = False
) -> Tuple[Any, Any]:
    """A DMP of TwoModuleModel with all tables tiered, its dense optimizer.

    ``backend``: the tiered sharders' ``backend=`` (None: the device's default, native
    on CPU). ``fused``: table -> fused optimizer (``"sgd"`` lr 0.1 / ``"rowwise_adagrad"``
    lr 0.05; default fused Adam lr 0.02 for every table). ``combined``: the optimizer is
    ``CombinedOptimizer([model.fused_optimizer, dense])``, so the pipelines' ``zero_grad()``
    pushes the fused param groups' ``lr`` to the tiered tables (an LR schedule's path)."""
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan, ShardingType
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.tiered_sharders import (
        TieredEmbeddingBagCollectionSharder,
        TieredEmbeddingCollectionSharder,
    )
    from recpipe.planner.torchrec_plan import PlacementParameterSharding, row_wise_sharding_spec

    torch.manual_seed(SEED)
    model = TwoModuleModel()
    ebc_weights = {t: model.ebc.embedding_bags[t].weight.detach().clone() for t in ("t0", "t1")}
    weights = {
        "t0": model.ebc.embedding_bags["t0"].weight,
        "t1": model.ebc.embedding_bags["t1"].weight,
        "s0": model.ec.embeddings["s0"].weight,
    }
    if fused is None:
        apply_optimizer_in_backward(torch.optim.Adam, list(weights.values()), {"lr": 0.02})
    else:
        optimizers = {"sgd": (torch.optim.SGD, {"lr": 0.1}), "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.05})}
        for table, name in fused.items():
            cls, kwargs = optimizers[name]
            apply_optimizer_in_backward(cls, [weights[table]], dict(kwargs))
    plan: Dict[str, Dict[str, Any]] = {"ebc": {}, "ec": {}}
    for table, (module, rows, mode, x) in TIERED.items():
        plan[module][table] = PlacementParameterSharding(
            sharding_type=ShardingType.ROW_WISE.value,
            compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
            ranks=list(range(world)),
            sharding_spec=row_wise_sharding_spec(rows, EMB_DIM, world, world, "cpu"),
            mode=mode,
            cache_load_factor=x,
            dist_type="hash_roundrobin",
            seed=7,
        )
    dmp = DistributedModelParallel(
        module=model,
        device=torch.device("cpu"),
        plan=ShardingPlan({k: EmbeddingModuleShardingPlan(v) for k, v in plan.items()}),
        sharders=[
            TieredEmbeddingBagCollectionSharder(backend=backend),  # type: ignore[list-item]
            TieredEmbeddingCollectionSharder(backend=backend),
        ],
    )
    # EC tiered tables were set from the module's weights when sharded; set the EBC's too
    for t, w in ebc_weights.items():
        dmp.module.ebc.tiered_tables()[t].load_global_weights(w)
    opt: Any = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: torch.optim.Adam(params, lr=0.01)
    )
    if combined:
        opt = CombinedOptimizer([dmp.fused_optimizer, opt])
    return dmp, opt


def _numpy(trace: Tuple[List[torch.Tensor], ...]) -> List[List[np.ndarray]]:
    return [[t.detach().cpu().numpy() for t in part] for part in trace]


def _stats(dmp: Any) -> Dict[str, Any]:
    tables = {**dmp.module.ebc.tiered_tables(), **dmp.module.ec.tiered_tables()}
    return {n: (s.mode.name, s.step, s.tier_stats()["cumulative_hit_rate"]) for n, s in sorted(tables.items())}


def _body(rank: int, world: int) -> Dict[str, Any]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    batches = make_batches(rank, n=N_BATCHES, seed=3)
    device = torch.device("cpu")
    out: Dict[str, Any] = {}
    loaded: Dict[str, float] = {}

    model, opt = _build(world)
    out["reference"] = _numpy(run_reference(model, opt, batches))
    out["reference stats"] = _stats(model)

    model, opt = _build(world)
    losses, preds, again = run_pipeline(TrainPipelineSparseDist(model, opt, device), batches)
    out["torchrec"] = _numpy((losses, preds))
    out["torchrec stats"] = _stats(model)
    for after_opt in (True, False):
        model, opt = _build(world)
        pipe = TrainPipelineFusedSparseDist(model, opt, device, embedding_lookup_after_opt=after_opt)
        tables = {**model.module.ebc.tiered_tables(), **model.module.ec.tiered_tables()}
        rows_loaded = {n: 0.0 for n in tables}
        it = iter(batches)
        losses, preds = [], []
        while True:
            try:
                loss, logits = pipe.progress(it)
            except StopIteration:
                break
            losses.append(loss.clone())
            preds.append(logits.clone())
            for n, s in tables.items():
                rows_loaded[n] += s.tier_stats()["rows_loaded"]
        key = f"fused after_opt={after_opt}"
        out[key] = _numpy((losses, preds))
        out[key + " stats"] = _stats(model)
        out[key + " pipelined"] = sorted(m.forward.name for m in pipe._pipelined_modules)
        out[key + " relookups"] = pipe.stats.relookups
        loaded = rows_loaded
    out["rows_loaded"] = loaded
    return out


def _equal(name: str, got: List[List[np.ndarray]], want: List[List[np.ndarray]]) -> None:
    assert len(got[0]) == len(want[0]) == N_BATCHES, f"{name}: {len(got[0])} steps, want {len(want[0])}"
    for step in range(N_BATCHES):
        assert np.array_equal(got[0][step], want[0][step]), (
            f"{name}: loss differs at step {step}: {got[0][step]!r} vs {want[0][step]!r}"
        )
        assert np.array_equal(got[1][step], want[1][step]), (
            f"{name}: predictions differ at step {step}, max |diff| {np.abs(got[1][step] - want[1][step]).max()}"
        )


def test_fused_pipeline_over_tiered_tables_bit_identical_to_torchrec() -> None:
    results = run_gloo(2, _body)
    for rank, res in enumerate(results):
        ref_losses = [float(x) for x in res["reference"][0]]
        assert len(set(ref_losses)) > 1, "constant losses: the comparison has no teeth"
        _equal(f"rank {rank} torchrec TrainPipelineSparseDist vs loop", res["torchrec"], res["reference"])
        for after_opt in (True, False):
            key = f"fused after_opt={after_opt}"
            _equal(f"rank {rank} {key} vs torchrec", res[key], res["torchrec"])
            assert res[key + " pipelined"] == ["ebc", "ec"], res[key + " pipelined"]
            assert res[key + " relookups"] == 0, "a tiered lookup was redone without a write"
            # same placement, every fused Adam step applied once per batch, same cache hit history
            assert res[key + " stats"] == res["torchrec stats"], (res[key + " stats"], res["torchrec stats"])
        for table, (_, _, mode, _) in TIERED.items():
            assert res["torchrec stats"][table][:2] == (mode, N_BATCHES)
        # the CACHING tables really loaded and evicted rows during the pipelined run
        assert res["rows_loaded"]["t0"] > 0 and res["rows_loaded"]["s0"] > 0, res["rows_loaded"]


WRITES = ("detach_load_attach", "load_state_dict", "load_global_weights")
"""Table writes between steps 3 and 4: through detach()/attach(), or on the attached
model (torchrec's load_state_dict; the tiered tables' own load_global_weights)."""


def _write(kind: str, model: Any, other: Any) -> None:
    if kind == "load_global_weights":
        g = torch.Generator().manual_seed(17)
        tables = {**model.module.ebc.tiered_tables(), **model.module.ec.tiered_tables()}
        for name in sorted(tables):
            shard = tables[name]
            shard.load_global_weights(torch.randn(shard.num_embeddings, shard.embedding_dim, generator=g))
    else:
        model.load_state_dict(other.state_dict())


def _detach_body(rank: int, world: int) -> Dict[str, Any]:
    """Reference and fused pipelines, each writing the tables between steps 3 and 4."""
    global SEED
    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    batches = make_batches(rank, n=N_BATCHES, seed=3)
    device = torch.device("cpu")
    SEED = 11
    try:
        other, _ = _build(world)
    finally:
        SEED = 5
    pause_at = 4
    out: Dict[str, Any] = {}
    for kind in WRITES:
        model, opt = _build(world)

        def write(step: int, model: Any = model, kind: str = kind) -> None:
            if step == pause_at:
                _write(kind, model, other)

        out[f"{kind} reference"] = _numpy(run_reference(model, opt, batches, before_step=write))
        for after_opt in (True, False):
            model, opt = _build(world)
            pipe = TrainPipelineFusedSparseDist(model, opt, device, embedding_lookup_after_opt=after_opt)
            it = iter(batches)
            losses, preds = [], []
            for step in range(N_BATCHES):
                if step == pause_at:
                    if kind == "detach_load_attach":
                        detached = pipe.detach()
                        _write(kind, detached, other)
                        pipe.attach(detached)
                    else:
                        _write(kind, model, other)
                loss, logits = pipe.progress(it)
                losses.append(loss.clone())
                preds.append(logits.clone())
            out[f"{kind} fused after_opt={after_opt}"] = _numpy((losses, preds))
            out[f"{kind} fused after_opt={after_opt} relookups"] = pipe.stats.relookups
    return out


def test_fused_pipeline_over_tiered_tables_written_between_steps() -> None:
    """Tiered tables written between two steps, through detach()/attach() or on the
    attached model: the batch looked up early is looked up again (once) and reads
    the new rows, bit for bit as the loop."""
    for rank, res in enumerate(run_gloo(2, _detach_body)):
        for kind in WRITES:
            for after_opt in (True, False):
                key = f"{kind} fused after_opt={after_opt}"
                _equal(f"rank {rank} {key}", res[key], res[f"{kind} reference"])
                assert res[key + " relookups"] == 1, (key, res[key + " relookups"])


# --- fbgemm-backed tiered tables (the CUDA kernel, as fbgemm HOST tables on CPU) ----------
FBGEMM_FUSED = {"t0": "rowwise_adagrad", "t1": "sgd", "s0": "rowwise_adagrad"}
"""fbgemm-gpu-cpu has no CPU Adam: row-wise Adagrad (advances the TBE's ``iter``) and SGD (does not)."""
ATTACH_AT, WRITE_AT, LR_AT = 3, 5, 7
"""Before these steps: ``pipeline.attach()`` (fused pipeline only: drops the issued lookup),
``load_global_weights`` of t1 and s0 (resets their step counters), the fused param groups'
``lr`` halved (pushed by the pipelines' ``zero_grad()``). Each makes the fused pipeline redo
the early lookup of the next batch: 3 relookups."""


def _between_steps(step: int, model: Any, pipe: Any = None) -> None:
    if step == ATTACH_AT and pipe is not None:
        pipe.attach()
    if step == WRITE_AT:
        tables = {**model.module.ebc.tiered_tables(), **model.module.ec.tiered_tables()}
        for name in ("t1", "s0"):
            shard = tables[name]
            g = torch.Generator().manual_seed(len(name) * 31 + int(name[1]))  # the same table on every rank
            shard.load_global_weights(torch.randn(shard.num_embeddings, shard.embedding_dim, generator=g))
    if step == LR_AT:
        for group in model.fused_optimizer.param_groups:
            group["lr"] = group["lr"] * 0.5


def _counters(model: Any) -> Dict[str, Tuple[str, int, int, Any]]:
    """Per tiered table: backend, the shard's ``step``, its exported step, and for the fbgemm
    backend (FbgemmTier.step, the TBE's ``step``, ``iter``, ``iter_cpu``)."""
    tables = {**model.module.ebc.tiered_tables(), **model.module.ec.tiered_tables()}
    out = {}
    for name, shard in sorted(tables.items()):
        fb = getattr(shard.tiers, "fbgemm", None)  # the fbgemm backend's FbgemmTier (None: another backend)
        tbe = (fb.step, fb.tbe.step, int(fb.tbe.iter), int(fb.tbe.iter_cpu)) if fb is not None else None
        out[name] = (shard.backend, shard.step, shard.export_state().step, tbe)
    return out


def _full_rows(model: Any) -> Dict[str, np.ndarray]:
    """Every tiered table gathered on every rank (rows by global id)."""
    import torch.distributed as dist

    out = {}
    for module in (model.module.ebc, model.module.ec):
        for name, st in module.tiered_state().items():
            full = torch.zeros(st.metadata["num_embeddings"], st.weights.shape[1])
            full[st.global_ids] = st.weights
            dist.all_reduce(full)
            out[name] = full.numpy().copy()
    return out


def _fbgemm_body(rank: int, world: int) -> Dict[str, Any]:
    """torchrec's TrainPipelineSparseDist (native and fbgemm backends) and
    TrainPipelineFusedSparseDist (fbgemm backend, both lookup orders), every run with the
    interventions of :func:`_between_steps`."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    batches = make_batches(rank, n=N_BATCHES, seed=3)
    device = torch.device("cpu")
    out: Dict[str, Any] = {}
    runs = [
        ("torchrec native", "native", None),
        ("torchrec fbgemm", "fbgemm", None),
        ("fused fbgemm after_opt=True", "fbgemm", True),
        ("fused fbgemm after_opt=False", "fbgemm", False),
    ]
    for key, backend, after_opt in runs:
        model, opt = _build(world, backend=backend, fused=FBGEMM_FUSED, combined=True)
        if after_opt is None:
            pipe: Any = TrainPipelineSparseDist(model, opt, device)
        else:
            pipe = TrainPipelineFusedSparseDist(model, opt, device, embedding_lookup_after_opt=after_opt)
        it = iter(batches)
        losses, preds = [], []
        for step in range(N_BATCHES):
            _between_steps(step, model, pipe if after_opt is not None else None)
            loss, logits = pipe.progress(it)
            losses.append(loss.clone())
            preds.append(logits.clone())
        out[key] = _numpy((losses, preds))
        out[key + " counters"] = _counters(model)
        out[key + " rows"] = _full_rows(model)
        out[key + " lrs"] = [g["lr"] for g in model.fused_optimizer.param_groups]
        if after_opt is not None:
            out[key + " relookups"] = pipe.stats.relookups
    return out


@functools.lru_cache(maxsize=1)
def _fbgemm_runs() -> Tuple[Dict[str, Any], ...]:
    """The runs of :func:`_fbgemm_body` on 2 gloo ranks (shared by the tests below)."""
    return tuple(run_gloo(2, _fbgemm_body))


def test_fused_pipeline_over_fbgemm_tiered_tables_equals_torchrec_with_relookups() -> None:
    """Tiered tables on the fbgemm backend (``backend="fbgemm"`` on the sharders: fbgemm
    HOST tables on CPU; the CUDA path's kernel), row-wise Adagrad and SGD, under
    TrainPipelineFusedSparseDist with three forced relookups (``attach()``, a table write
    that resets the step, an lr change through ``model.fused_optimizer``): every step's loss
    and predictions equal torchrec's TrainPipelineSparseDist on the same model bit for bit,
    and so do the counters the discarded lookups advanced: each shard's ``step`` and
    exported step, FbgemmTier.step, the TBE's ``step``, ``iter`` and ``iter_cpu`` (a tiered
    shard's TBE, kept outside the module tree, included)."""
    for rank, res in enumerate(_fbgemm_runs()):
        ref = res["torchrec fbgemm"]
        assert len({float(x) for x in ref[0]}) > 1, "constant losses: the comparison has no teeth"
        counters = res["torchrec fbgemm counters"]
        assert {n: c[0] for n, c in counters.items()} == {"s0": "fbgemm", "t0": "fbgemm", "t1": "fbgemm"}
        # t1 / s0 were reset to step 0 before step WRITE_AT; t0 (Adagrad) counts every batch in iter
        assert counters["t0"][1:] == (N_BATCHES, N_BATCHES, (N_BATCHES, N_BATCHES, N_BATCHES, N_BATCHES)), counters
        assert counters["t1"][3][2] == 0, counters  # SGD: fbgemm does not advance iter
        for after_opt in (True, False):
            key = f"fused fbgemm after_opt={after_opt}"
            _equal(f"rank {rank} {key} vs torchrec", res[key], ref)
            assert res[key + " relookups"] == 3, (key, res[key + " relookups"])
            assert res[key + " counters"] == counters, (f"rank {rank} {key}", res[key + " counters"], counters)
            assert res[key + " lrs"] == res["torchrec fbgemm lrs"]
            for name, rows in res["torchrec fbgemm rows"].items():
                assert np.array_equal(res[key + " rows"][name], rows), f"rank {rank} {key} table {name}"


def test_fbgemm_backend_tiered_tables_equal_native_backend() -> None:
    """The same model and runs as above with the sharders' ``backend="native"`` (recpipe's
    compiled CPU kernel) under torchrec's pipeline: the fbgemm runs' losses, predictions and
    final rows equal the native run's within float rounding (fbgemm's HOST TBE sums a bag
    in another order than the native kernel, and a HYBRID bag as two pooled halves), and
    every shard's step counter equals the native shard's exactly, in every fbgemm run
    (the fused pipeline's included: its discarded lookups are not counted)."""
    for rank, res in enumerate(_fbgemm_runs()):
        native = res["torchrec native"]
        native_counters = res["torchrec native counters"]
        assert {c[0] for c in native_counters.values()} == {"native"}
        for key in ("torchrec fbgemm", "fused fbgemm after_opt=True", "fused fbgemm after_opt=False"):
            for part, what in ((0, "loss"), (1, "predictions")):
                for step in range(N_BATCHES):
                    np.testing.assert_allclose(
                        res[key][part][step],
                        native[part][step],
                        rtol=1e-5,
                        atol=1e-6,
                        err_msg=f"rank {rank} {key} {what} step {step}",
                    )
            for name, rows in res["torchrec native rows"].items():
                np.testing.assert_allclose(
                    res[key + " rows"][name], rows, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank} {key} table {name}"
                )
            steps = {n: c[1:3] for n, c in res[key + " counters"].items()}
            assert steps == {n: c[1:3] for n, c in native_counters.items()}, (f"rank {rank} {key}", steps)
