"""TrainPipelineFusedSparseDist over tiered tables: bit-identical to torchrec's TrainPipelineSparseDist.

The pipeline tests' two-module model (tests/test_pipeline_common.py: an EBC with
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

from typing import Any, Dict, List, Tuple

import numpy as np
import torch
from gloo_harness import run_gloo
from test_pipeline_common import EMB_DIM, N_BATCHES, TwoModuleModel, make_batches, run_pipeline, run_reference

# table -> (module, rows, placement mode, cache load factor)
TIERED = {"t0": ("ebc", 300, "CACHING", 0.2), "t1": ("ebc", 200, "HYBRID", 0.5), "s0": ("ec", 100, "CACHING", 0.3)}
SEED = 5  # model init seed (same for every copy)


def _build(world: int) -> Tuple[Any, Any]:
    """A DMP of TwoModuleModel with all tables tiered, its dense optimizer."""
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan, ShardingType
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from recpipe.pipeline.sharders import TieredEmbeddingBagCollectionSharder, TieredEmbeddingCollectionSharder
    from recpipe.planner.sharding import PlacementParameterSharding, row_wise_sharding_spec

    torch.manual_seed(SEED)
    model = TwoModuleModel()
    ebc_weights = {t: model.ebc.embedding_bags[t].weight.detach().clone() for t in ("t0", "t1")}
    apply_optimizer_in_backward(
        torch.optim.Adam,
        [model.ebc.embedding_bags[t].weight for t in ("t0", "t1")] + [model.ec.embeddings["s0"].weight],
        {"lr": 0.02},
    )
    plan: Dict[str, Dict[str, Any]] = {"ebc": {}, "ec": {}}
    for table, (module, rows, mode, x) in TIERED.items():
        plan[module][table] = PlacementParameterSharding(
            sharding_type=ShardingType.ROW_WISE.value,
            compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
            ranks=list(range(world)),
            sharding_spec=row_wise_sharding_spec(rows, EMB_DIM, world, world, "cpu"),
            mode=mode, cache_load_factor=x, dist_type="hash_roundrobin", seed=7,
        )
    dmp = DistributedModelParallel(
        module=model,
        device=torch.device("cpu"),
        plan=ShardingPlan({k: EmbeddingModuleShardingPlan(v) for k, v in plan.items()}),
        sharders=[TieredEmbeddingBagCollectionSharder(), TieredEmbeddingCollectionSharder()],  # type: ignore[list-item]
    )
    # EC tiered tables were set from the module's weights when sharded; set the EBC's too
    for t, w in ebc_weights.items():
        dmp.module.ebc.tiered_tables()[t].load_global_weights(w)
    opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=0.01),
    )
    return dmp, opt


def _numpy(trace: Tuple[List[torch.Tensor], ...]) -> List[List[np.ndarray]]:
    return [[t.detach().cpu().numpy() for t in part] for part in trace]


def _stats(dmp: Any) -> Dict[str, Any]:
    tables = {**dmp.module.ebc.tiered_tables(), **dmp.module.ec.tiered_tables()}
    return {n: (s.mode.name, s.step, s.tier_stats()["cumulative_hit_rate"]) for n, s in sorted(tables.items())}


def _body(rank: int, world: int) -> Dict[str, Any]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline.train_pipeline import TrainPipelineFusedSparseDist

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
            f"{name}: loss differs at step {step}: {got[0][step]!r} vs {want[0][step]!r}")
        assert np.array_equal(got[1][step], want[1][step]), (
            f"{name}: predictions differ at step {step}, max |diff| "
            f"{np.abs(got[1][step] - want[1][step]).max()}")


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
    from recpipe.pipeline.train_pipeline import TrainPipelineFusedSparseDist

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
