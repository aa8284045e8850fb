"""TrainPipelineSemiSync against a plain-torch semi-sync loop, step by step, on 2 gloo ranks.

torchrec's own semi-sync test (``EmbeddingTrainPipelineTest.test_equal_to_non_pipelined``: CUDA only,
as torchrec's pipeline fails on CPU in ``batch.record_stream``) adapted to CPU: identically initialised
copies of the pipeline tests' two-module model (an EBC and an EC) train on the same batches through
``TrainPipelineSemiSync`` and through ``harness.semi_sync_reference`` (the schedule's steps written
out in plain torch), and every step's loss and predictions, then the final weights, must be equal
bit for bit (torch.equal). Pinned as well: before ``start_batch`` the pipeline equals torchrec's
``TrainPipelineSparseDist`` and after it does not (the staleness is real); FUSED tables under
table-, column- and row-wise sharding, tiered (HYBRID / CACHING) and dynamic tables; the models
refused on attach; a failed step, ``reset()`` and ``detach()`` / ``attach()``; ``number_next_batch``'s
refusals; the errors of a module called twice and of a retried step name ``TrainPipelineSemiSync``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
from harness.dynamic_models import build_dynamic, dynamic_shards, raw_key_batches
from harness.gloo import run_gloo
from harness.pipelines import EMB_DIM, TwoModuleModel, build_dmp, make_batches, on_cpu, run_pipeline
from harness.semi_sync_reference import run_semi_sync_reference, semi_sync_reference_steps, two_module_lookups

N = 8  # batches per run

#: (start_batch, stash_gradients, recpipe / torchrec schedule arguments): every argument is covered
VARIANTS: Tuple[Tuple[int, bool, Dict[str, Any]], ...] = (
    (0, False, {}),
    (0, True, {"use_emb_lookup_stream": True, "embedding_lookup_after_opt": False}),
    (2, False, {"emb_lookup_stream": "new", "embedding_lookup_after_opt": False}),
    (3, True, {"emb_lookup_stream": "data_dist", "embedding_lookup_after_opt": True}),
)

Trace = Tuple[List[np.ndarray], List[np.ndarray]]


def _semi_sync(model: Any, opt: Any, device: torch.device, **kwargs: Any) -> Any:
    from recpipe.pipeline import TrainPipelineSemiSync

    return TrainPipelineSemiSync(model, opt, device, **kwargs)


def _weights(dmp: Any) -> List[np.ndarray]:
    """This rank's final weights: the dense parameters and the local shards of every table."""
    out: List[np.ndarray] = []
    for _, value in sorted(dmp.state_dict().items()):
        shards = value.local_shards() if hasattr(value, "local_shards") else None
        for t in [s.tensor for s in shards] if shards is not None else [value]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                out.append(t.detach().cpu().numpy().copy())
    return out


def _drive(pipe: Any, batches: Sequence[Any]) -> Tuple[Trace, List[bool], bool]:
    """``run_pipeline`` recording ``is_semi_sync()`` before each step of batch 1 .. N-1 (before
    batch 0 the pipeline is not filled yet)."""
    it: Iterator[Any] = iter(batches)
    losses, logits, semi = [], [], []
    while True:
        semi.append(pipe.is_semi_sync())
        try:
            loss, out = pipe.progress(it)
        except StopIteration:
            break
        losses.append(loss.clone())
        logits.append(out.clone())
    _, _, again = run_pipeline(pipe, [])
    return on_cpu((losses, logits)), semi[1:-1], again


def assert_equal_traces(label: str, got: Trace, want: Trace) -> None:
    """Same number of steps and, step by step, bit-identical losses and predictions."""
    assert len(got[0]) == len(want[0]), f"{label}: {len(got[0])} steps, reference {len(want[0])}"
    for part, what in ((0, "loss"), (1, "predictions")):
        for step, (a, b) in enumerate(zip(got[part], want[part])):
            assert np.array_equal(a, b), f"{label}: {what} differ at step {step}"


# ------------------------------------------------------------------------------------ FUSED tables


def _fused_body(rank: int, world: int, sharding: str, use_cuda: bool) -> Dict[str, Any]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    device, pg = torch.device("cpu"), None
    if use_cuda:
        torch.cuda.set_device(rank)
        device, pg = torch.device("cuda", rank), dist.new_group(backend="nccl")
    batches = make_batches(rank, n=N)
    out: Dict[str, Any] = {}
    model, opt = build_dmp(sharding, device, pg=pg)
    out["sparse_dist"] = on_cpu(run_pipeline(TrainPipelineSparseDist(model, opt, device), batches)[:2])
    for v, (start, stash, kwargs) in enumerate(VARIANTS):
        ref, ref_opt = build_dmp(sharding, device, pg=pg)
        on_device = [b.to(device) for b in batches]
        want = run_semi_sync_reference(
            ref, ref_opt, on_device, two_module_lookups(ref), start_batch=start, stash_gradients=stash
        )
        out[f"{v} reference"] = (on_cpu(want), _weights(ref))
        model, opt = build_dmp(sharding, device, pg=pg)
        pipe = _semi_sync(model, opt, device, start_batch=start, stash_gradients=stash, **kwargs)
        trace, semi, again = _drive(pipe, batches)
        out[f"{v} pipeline"] = (trace, _weights(model), semi, again, pipe.stats.steps, pipe.stats.relookups)
        if use_cuda:
            from torchrec.distributed.train_pipeline import TrainPipelineSemiSync

            model, opt = build_dmp(sharding, device, pg=pg)
            theirs = TrainPipelineSemiSync(model, opt, device, start_batch=start, stash_gradients=stash)
            out[f"{v} torchrec"] = on_cpu(run_pipeline(theirs, batches)[:2])
    return out


def _check_fused(results: Sequence[Dict[str, Any]], use_cuda: bool) -> None:
    for rank, res in enumerate(results):
        sync = res["sparse_dist"]
        for v, (start, _, kwargs) in enumerate(VARIANTS):
            label = f"rank {rank} variant {v} {kwargs}"
            want, want_weights = res[f"{v} reference"]
            trace, weights, semi, again, steps, relookups = res[f"{v} pipeline"]
            assert_equal_traces(label, trace, want)
            assert len(weights) == len(want_weights) > 0
            assert all(np.array_equal(a, b) for a, b in zip(weights, want_weights)), f"{label}: final weights"
            assert semi == [i >= start for i in range(1, N)], f"{label}: is_semi_sync() per step {semi}"
            assert again and steps == N and relookups == 0, label
            # synchronous until start_batch: batches 0..start_batch equal TrainPipelineSparseDist
            head = (sync[0][: start + 1], sync[1][: start + 1])
            assert_equal_traces(
                label + " vs TrainPipelineSparseDist", (trace[0][: start + 1], trace[1][: start + 1]), head
            )
            # from batch start_batch + 1 on the tables are one step stale: predictions differ
            assert not np.array_equal(trace[1][start + 1], sync[1][start + 1]), f"{label}: no staleness"
            if use_cuda:
                assert_equal_traces(label + " vs torchrec TrainPipelineSemiSync", trace, res[f"{v} torchrec"])


@pytest.mark.parametrize("sharding", ("table_wise", "column_wise", "row_wise"))
def test_semi_sync_equals_plain_reference_step_by_step(sharding: str) -> None:
    """FUSED tables, start_batch 0 / 2 / 3, stash_gradients on and off, every schedule argument."""
    _check_fused(run_gloo(2, _fused_body, sharding, False, timeout_s=300), False)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
def test_semi_sync_equals_torchrec_semi_sync_cuda() -> None:
    """On CUDA, where torchrec's TrainPipelineSemiSync runs: recpipe's, torchrec's and the plain
    reference give the same numbers (one rank, NCCL; streams and events exercised)."""
    _check_fused(run_gloo(1, _fused_body, "table_wise", True, timeout_s=300), True)


# ------------------------------------------------------------------------ tiered and dynamic tables

#: table -> (module, rows, placement mode, cache load factor)
TIERED = {"t0": ("ebc", 300, "CACHING", 0.2), "t1": ("ebc", 200, "HYBRID", 0.5), "s0": ("ec", 100, "CACHING", 0.3)}


def _build_tiered(world: int, sharding: str) -> Tuple[Any, Any]:
    """TwoModuleModel with every table tiered (``TIERED``), fused Adam, ``sharding`` row_wise or
    table_wise (t0, s0 on rank 0, t1 on rank 1), and its dense Adam."""
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan, ShardingType
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

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
            kind, ranks = ShardingType.ROW_WISE.value, list(range(world))
            spec = row_wise_sharding_spec(rows, EMB_DIM, world, world, "cpu")
        else:
            owner = i % world if table != "s0" else 0
            kind, ranks, spec = (
                ShardingType.TABLE_WISE.value,
                [owner],
                table_wise_sharding_spec(rows, EMB_DIM, owner, world, "cpu"),
            )
        plan[module][table] = PlacementParameterSharding(
            sharding_type=kind,
            compute_kernel="customized_kernel",
            ranks=ranks,
            sharding_spec=spec,
            mode=mode,
            cache_load_factor=x,
            dist_type="hash_roundrobin",
            seed=7,
        )
    dmp = DistributedModelParallel(
        module=model,
        device=torch.device("cpu"),
        plan=ShardingPlan({k: EmbeddingModuleShardingPlan(v) for k, v in plan.items()}),
        sharders=[TieredEmbeddingBagCollectionSharder(), TieredEmbeddingCollectionSharder()],  # type: ignore[list-item]
    )
    for t, w in ebc_weights.items():  # the EC's tiered tables took the module's weights when sharded
        if t in dmp.module.ebc.tiered_tables():
            dmp.module.ebc.tiered_tables()[t].load_global_weights(w)
    opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: torch.optim.Adam(params, lr=0.01)
    )
    return dmp, opt


def _tables_body(rank: int, world: int, kind: str, sharding: str) -> Dict[str, Any]:
    device = torch.device("cpu")
    if kind == "dynamic":
        batches = raw_key_batches(rank, N, 3)

        def build() -> Tuple[Any, Any]:
            return build_dynamic(world, sharding, eviction="lfu")
    else:
        batches = make_batches(rank, n=N, seed=3)

        def build() -> Tuple[Any, Any]:
            return _build_tiered(world, sharding)

    out: Dict[str, Any] = {}
    for start, stash, kwargs in ((0, True, {}), (1, False, {"embedding_lookup_after_opt": False})):
        model, opt = build()
        pipe = _semi_sync(model, opt, device, start_batch=start, stash_gradients=stash, **kwargs)
        trace, _, _ = _drive(pipe, batches)
        ref, ref_opt = build()
        want = run_semi_sync_reference(
            ref,
            ref_opt,
            batches,
            two_module_lookups(ref),
            start_batch=start,
            stash_gradients=stash,
            after_backward={"ebc", "ec"} if kind == "dynamic" else set(),
        )
        late = list(pipe.after_backward_modules)
        out[f"{start} {stash}"] = (trace, on_cpu(want), _weights(model), _weights(ref), late)
    if kind == "dynamic":
        out["evicted"] = sum(s.tier_stats()["evicted"] for s in dynamic_shards(model).values())
    return out


@pytest.mark.parametrize("kind,sharding", [("tiered", "row_wise"), ("tiered", "table_wise"), ("dynamic", "row_wise")])
def test_semi_sync_tiered_and_dynamic_tables_equal_reference(kind: str, sharding: str) -> None:
    """Tiered CACHING / HYBRID tables are looked up early like FUSED ones; dynamic tables, whose
    inserts for batch i+1 may evict a key batch i looked up, are looked up after batch i's backward
    (``after_backward_modules``), here with LFU eviction and capacities the batches overflow."""
    results = run_gloo(2, _tables_body, kind, sharding, timeout_s=300)
    for rank, res in enumerate(results):
        for key in ("0 True", "1 False"):
            trace, want, weights, want_weights, late = res[key]
            assert_equal_traces(f"rank {rank} {kind} {sharding} start/stash {key}", trace, want)
            assert all(np.array_equal(a, b) for a, b in zip(weights, want_weights)), f"rank {rank} {key}: weights"
            assert late == (["ebc", "ec"] if kind == "dynamic" else []), late
    if kind == "dynamic":
        assert sum(r["evicted"] for r in results) > 0, "no key was evicted: the eviction path is untested"


def _new_key_row(order: str) -> torch.Tensor:
    """One dynamic shard of one full 16-slot bucket (LFU): batch A looks up 16 keys, batch B one new
    key (evicting one of A's); ``order``: B's lookup before A's backward (``stale``), after it, or
    B alone (``fresh``). Returns the new key's row."""
    from recpipe.pipeline.placement import DynamicTableOptions
    from recpipe.pipeline.tiered.dynamic.dynamic_shard import DynamicEmbeddingShard

    options = DynamicTableOptions(capacity=16, eviction="lfu", on_full="ignore", seed=3)
    shard = DynamicEmbeddingShard(num_embeddings=16, embedding_dim=4, options=options)
    new_key, one_bag = torch.tensor([777]), torch.tensor([0, 1])
    if order == "fresh":
        shard(new_key, one_bag)
    else:
        out_a = shard(torch.arange(1, 17) * 1000003, torch.arange(0, 17))
        if order == "stale":
            shard(new_key, one_bag)
        out_a.sum().backward()
        if order != "stale":
            shard(new_key, one_bag)
        assert shard.tier_stats()["evicted"] == 1  # the new key took a slot of batch A's
    keys, weights, *_ = shard.dynamic_rows()
    return weights[int((keys == 777).nonzero()[0, 0])].clone()


def test_dynamic_insert_before_the_previous_backward_would_update_the_new_keys_row() -> None:
    """Why dynamic tables are ``after_backward_modules``: a lookup of batch i+1 issued before batch
    i's backward evicts a key batch i looked up and gives its slot to a new key, and batch i's
    backward then updates the new key's row. Issued after the backward, the new row is its
    initial value."""
    fresh = _new_key_row("fresh")
    assert torch.equal(_new_key_row("after_backward"), fresh)
    assert not torch.equal(_new_key_row("stale"), fresh)


def test_semi_sync_dynamic_table_wise_equals_reference() -> None:
    """Dynamic tables sharded table-wise (each table's keys on one rank)."""
    for rank, res in enumerate(run_gloo(2, _tables_body, "dynamic", "table_wise", timeout_s=300)):
        for key in ("0 True", "1 False"):
            trace, want, _, _, late = res[key]
            assert_equal_traces(f"rank {rank} dynamic table_wise {key}", trace, want)
            assert late == ["ebc", "ec"]


# ----------------------------------------------------------------------------------------- refusals

DENSE_T1 = {"t1": ("table_wise", "dense")}  # table t1 of the EBC: dense kernel, its weight in the dense optimizer
DP_T1 = {"t1": ("data_parallel", None)}  # table t1 of the EBC: replicated, stepped by the dense optimizer
# (a DENSE-kernel EC table is not used: torchrec's sharded EC with it corrupts the heap on CPU, plain loop too)
REFUSED: Dict[str, Tuple[Dict[str, Any], str]] = {
    "fp": ({"position_weighted": True}, "ebc"),
    "dp": ({"overrides": DP_T1}, "ebc"),
    "dense": ({"overrides": DENSE_T1}, "ebc"),
}
"""label -> (build_dmp arguments, the module holding dense-stepped weights)"""


def _refusal_body(rank: int, world: int) -> Dict[str, Any]:
    from recpipe.pipeline import SemiSyncModelError
    from recpipe.pipeline.train_pipeline.forward import FusedLookupPipelinedForward

    device = torch.device("cpu")
    batches = make_batches(rank, n=5, seed=2)
    out: Dict[str, Any] = {}
    for label, (kwargs, module) in REFUSED.items():
        model, opt = build_dmp("table_wise", device, **kwargs)
        try:
            _semi_sync(model, opt, device, start_batch=0).progress(iter(batches))
            out[label] = None
        except SemiSyncModelError as e:
            out[label] = str(e)
            out[label + " restored"] = not any(
                isinstance(getattr(model.module, m).forward, FusedLookupPipelinedForward) for m in ("ebc", "ec")
            )
        # accepted with allow_dense_tables=True: that module looks up after the optimizer step
        model, opt = build_dmp("table_wise", device, **kwargs)
        pipe = _semi_sync(model, opt, device, start_batch=0, stash_gradients=True, allow_dense_tables=True)
        trace, _, _ = _drive(pipe, batches)
        ref, ref_opt = build_dmp("table_wise", device, **kwargs)
        want = run_semi_sync_reference(
            ref,
            ref_opt,
            batches,
            two_module_lookups(ref),
            start_batch=0,
            stash_gradients=True,
            after_optimizer={module},
        )
        out[label + " allowed"] = (trace, on_cpu(want), list(pipe.after_optimizer_modules))
    return out


def test_semi_sync_refuses_dense_stepped_weights_and_allows_them_after_the_optimizer() -> None:
    """A feature processor, a DATA_PARALLEL table and a DENSE-kernel table (whose weight the dense
    optimizer holds) are refused on attach, naming module and table, the model restored; with
    ``allow_dense_tables=True`` that module looks up after the optimizer step and training equals
    the reference doing the same."""
    wording = {
        "fp": ["module 'ebc': feature processor", "position_weights"],
        "dp": ["module 'ebc': table 't1'", "sharding_type='data_parallel'"],
        "dense": ["module 'ebc': table 't1' (compute_kernel='dense')", "held by the dense optimizer"],
    }
    for rank, res in enumerate(run_gloo(2, _refusal_body, timeout_s=300)):
        for label, (_, module) in REFUSED.items():
            msg = res[label]
            assert msg is not None, f"rank {rank}: {label} was accepted"
            assert msg.startswith("TrainPipelineSemiSync: pipelined module(s) ['" + module + "']"), msg
            assert all(w in msg for w in wording[label]), msg
            assert "allow_dense_tables=True" in msg and "Possible solutions" in msg
            assert res[label + " restored"], f"{label}: the pipelined forwards were left on the model"
            trace, want, late = res[label + " allowed"]
            assert late == [module]
            assert_equal_traces(f"rank {rank} {label} allowed", trace, want)


def test_semi_sync_arguments_are_checked() -> None:
    """Bad arguments are refused in the constructor, naming the argument (no model is needed)."""
    from recpipe.pipeline import TrainPipelineSemiSync

    cpu = torch.device("cpu")
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="start_batch must be an int >= 0"):
        TrainPipelineSemiSync(model, opt, cpu, start_batch=-1)
    with pytest.raises(ValueError, match="start_batch"):
        TrainPipelineSemiSync(model, opt, cpu, start_batch=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stash_gradients must be a bool"):
        TrainPipelineSemiSync(model, opt, cpu, stash_gradients=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="device must be a torch.device"):
        TrainPipelineSemiSync(model, opt, "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="TrainPipelineSemiSync: use_emb_lookup_stream=True .* contradicts"):
        TrainPipelineSemiSync(model, opt, cpu, use_emb_lookup_stream=True, emb_lookup_stream="current")
    default = TrainPipelineSemiSync(model, opt, cpu)
    assert default.lookup_schedule.emb_lookup_stream == "current"  # torchrec's semi-sync lookup stream
    assert default.lookup_schedule.embedding_lookup_after_opt


@pytest.mark.parametrize("index", [-1, 2.0, "3", True, None])
def test_number_next_batch_refuses_an_index_that_is_not_an_int_at_least_0(index: Any) -> None:
    """A negative, float, string, bool or None index is refused naming ``index`` and the value (no model needed)."""
    from recpipe.pipeline import TrainPipelineSemiSync

    model = torch.nn.Linear(1, 1)
    pipe = TrainPipelineSemiSync(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))
    with pytest.raises(ValueError) as info:
        pipe.number_next_batch(index)
    assert str(info.value) == (f"TrainPipelineSemiSync.number_next_batch: index must be an int >= 0, got {index!r}.")


def _numbering_body(rank: int, world: int) -> Dict[str, Any]:
    device = torch.device("cpu")
    model, opt = build_dmp("table_wise", device)
    pipe = _semi_sync(model, opt, device, start_batch=4)
    it = iter(make_batches(rank, n=6, seed=3))
    pipe.progress(it)  # batches 1..3 stay queued
    out: Dict[str, Any] = {"in flight": len(pipe.contexts)}
    try:
        pipe.number_next_batch(4)
        out["refusal"] = None
    except ValueError as e:
        out["refusal"] = str(e)
    out["queued after refusal"] = [c.index for c in pipe.contexts]
    pipe.reset()
    pipe.number_next_batch(4)  # drained: accepted
    out["semi before"] = pipe.is_semi_sync()
    pipe.progress(it)
    out["queued after numbering"] = [c.index for c in pipe.contexts]
    return out


def test_number_next_batch_refuses_a_pipeline_with_batches_in_flight_and_numbers_a_drained_one() -> None:
    """With batches queued the call is refused naming ``index`` and the fix (drain or ``reset()``), and the
    queued batches keep their numbers; after ``reset()`` the next batches read are numbered from ``index``."""
    for res in run_gloo(2, _numbering_body, timeout_s=300):
        n = res["in flight"]
        assert n > 0 and res["queued after refusal"] == list(range(1, n + 1))
        msg = res["refusal"]
        assert msg is not None, "number_next_batch was accepted with batches in flight"
        assert msg.startswith("TrainPipelineSemiSync.number_next_batch: index=4 cannot number the next batch"), msg
        assert f"{n} batch(es) are in flight" in msg and "reset()" in msg and "StopIteration" in msg, msg
        assert res["semi before"] is False  # nothing queued after reset()
        # batch 4 trained (read after the numbering); batches 5.. are queued
        assert res["queued after numbering"][0] == 5, res["queued after numbering"]


class _EbcTwiceModel(TwoModuleModel):
    """``TwoModuleModel`` whose forward calls its EBC twice (a pipelined module may be called once)."""

    def forward(self, batch: Any) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        again = self.ebc(batch.ebc_features).values()
        loss, out = super().forward(batch)
        return loss + 0.0 * again.sum(), out


def _twice_body(rank: int, world: int) -> Optional[str]:
    device = torch.device("cpu")
    model, opt = build_dmp("table_wise", device)
    model.module.__class__ = _EbcTwiceModel  # the sharded model, its forward now calling "ebc" twice
    try:
        _semi_sync(model, opt, device, start_batch=0).progress(iter(make_batches(rank, n=4, seed=2)))
    except RuntimeError as e:
        return str(e)
    return None


def test_module_called_twice_in_forward_names_the_semi_sync_pipeline_and_the_cause() -> None:
    """As ``TrainPipelineFusedSparseDist`` (test_fused_pipeline_refusal), but the message names the pipeline
    that runs: ``TrainPipelineSemiSync``."""
    for msg in run_gloo(2, _twice_body, timeout_s=300):
        assert msg is not None, "a module called twice in the forward was accepted"
        assert msg.startswith("TrainPipelineSemiSync: the input dist of module 'ebc'"), msg
        assert "'ebc' is called more than once in the model's forward" in msg and "Call it once" in msg, msg
        assert "TrainPipelineFusedSparseDist" not in msg, msg


# -------------------------------------------------------------------------- failures, reset, detach


class InjectedFailure(ValueError):
    """The failure the optimizer injects."""


class FlakyOptimizer:
    """A dense optimizer whose ``fail_on``-th ``step()`` call raises ``InjectedFailure`` (once)."""

    def __init__(self, optimizer: Any, fail_on: int) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self._calls = 0
        self._fail_on = fail_on

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self._calls += 1
        if self._calls == self._fail_on:
            raise InjectedFailure("optimizer step failed")
        self.optimizer.step()


def _counters(dmp: Any) -> List[Any]:
    """(step, iter) of every fbgemm TBE of the two sharded modules."""
    from recpipe.pipeline.tiered.tbe_tables import tbe_counters
    from recpipe.pipeline.train_pipeline.take_back import fused_tbes

    return [tbe_counters(t) for m in (dmp.module.ebc, dmp.module.ec) for t in fused_tbes(m)]


def _steps(pipe: Any, it: Iterator[Any], n: Optional[int], into: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``n`` progress() calls (None: until StopIteration), their outputs appended to ``into``."""
    while n is None or n > 0:
        try:
            loss, logits = pipe.progress(it)
        except StopIteration:
            return
        into.append((loss.clone(), logits.clone()))
        n = None if n is None else n - 1


def _failure_body(rank: int, world: int) -> Dict[str, Any]:
    from recpipe.pipeline import PipelinedLookupUnavailableError

    device = torch.device("cpu")
    batches = make_batches(rank, n=12, seed=4)
    extra = make_batches(rank, n=1, seed=9)[0]
    kw: Dict[str, Any] = {"start_batch": 1, "stash_gradients": True}
    out: Dict[str, Any] = {}

    # A: the optimizer of step 4 raises; a retry raises as torchrec's; reset(); training goes on
    # from batch 9 (batches 4-8 were queued: 4 failed, the retry queued 8)
    model, opt = build_dmp("table_wise", device)
    pipe = _semi_sync(model, FlakyOptimizer(opt, fail_on=4), device, **kw)  # step 1 skips the optimizer
    it, got = iter(batches), []
    _steps(pipe, it, 4, got)
    for name, error in (("failure", InjectedFailure), ("retry", PipelinedLookupUnavailableError)):
        try:
            pipe.progress(it)
        except error as e:
            out[name], out[name + " message"] = type(e).__name__, str(e)
    pipe.reset()
    _steps(pipe, it, None, got)
    ref, ref_opt = build_dmp("table_wise", device)
    want: List[Tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for step in semi_sync_reference_steps(
            ref, FlakyOptimizer(ref_opt, 4), batches[:5], two_module_lookups(ref), **kw
        ):
            want.append(step)
    except InjectedFailure:
        pass
    want += list(semi_sync_reference_steps(ref, ref_opt, batches[9:], two_module_lookups(ref), **kw))
    out["A"] = _compare(got, want, model, ref)

    # B: detach() after step 2, the detached model evaluated, attach(); reset() after step 5
    model, opt = build_dmp("table_wise", device)
    pipe = _semi_sync(model, opt, device, **kw)
    it, got = iter(batches), []
    _steps(pipe, it, 3, got)

    def evaluate(dmp: Any) -> None:
        dmp.eval()
        with torch.no_grad():
            dmp(extra)
        dmp.train()

    evaluate(pipe.detach())
    pipe.attach()
    _steps(pipe, it, 3, got)
    pipe.reset()
    _steps(pipe, it, None, got)
    out["B relookups"] = pipe.stats.relookups
    ref, ref_opt = build_dmp("table_wise", device)
    lookups = two_module_lookups(ref)
    want = list(
        semi_sync_reference_steps(
            ref,
            ref_opt,
            batches[:6],
            lookups,
            look_up_at_step={3},
            before_step=lambda i: i == 3 and evaluate(ref),
            **kw,
        )
    )
    want += list(semi_sync_reference_steps(ref, ref_opt, batches[9:], lookups, **kw))
    out["B"] = _compare(got, want, model, ref)

    # C: eval mode through the pipeline equals a plain eval forward
    model, opt = build_dmp("table_wise", device)
    model.eval()
    with torch.no_grad():
        plain = [model(b)[1][1].numpy() for b in batches[:4]]
        trace, _, _ = _drive(_semi_sync(model, opt, device, start_batch=0), batches[:4])
    out["C"] = (trace[1], plain)

    # D: execute_all_batches=False ends when batch i+3 cannot be loaded: 3 of 6 batches trained
    model, opt = build_dmp("table_wise", device)
    got = []
    _steps(_semi_sync(model, opt, device, execute_all_batches=False, **kw), iter(batches[:6]), None, got)
    ref, ref_opt = build_dmp("table_wise", device)
    want = list(semi_sync_reference_steps(ref, ref_opt, batches[:3], two_module_lookups(ref), **kw))
    out["D"] = _compare(got, want, model, ref)
    return out


def _compare(got: List[Any], want: List[Any], model: Any, ref: Any) -> Tuple[Any, ...]:
    """Both runs' per-step outputs, final weights and TBE counters, as numpy."""
    steps = on_cpu(([g[0] for g in got], [g[1] for g in got])), on_cpu(([w[0] for w in want], [w[1] for w in want]))
    return steps + (_weights(model), _weights(ref), _counters(model), _counters(ref))


def test_semi_sync_failed_step_reset_and_detach_match_the_reference() -> None:
    """A failed optimizer step: the lookup issued for the next batch is taken back (TBE counters as if
    never run), a retried ``progress()`` raises ``PipelinedLookupUnavailableError`` as torchrec's, and
    after ``reset()`` (stash dropped, synchronous again until ``start_batch``) training equals the
    reference restarted on the next dataloader batch. ``detach()`` / ``attach()`` issues the next
    batch's lookup again from the tables as they are then; eval mode equals a plain forward;
    ``execute_all_batches=False`` trains all but the last 3 batches (torchrec's semi-sync too)."""
    for rank, res in enumerate(run_gloo(2, _failure_body, timeout_s=300)):
        assert res["failure"] == "InjectedFailure" and res["retry"] == "PipelinedLookupUnavailableError", res
        # the pipelined forward's refusal names the pipeline that runs
        assert res["retry message"].startswith("TrainPipelineSemiSync: the embedding lookup of module"), res
        for name, n_steps in (("A", 7), ("B", 9), ("D", 3)):
            got, want, weights, want_weights, counters, want_counters = res[name]
            assert len(got[0]) == n_steps, f"{name}: {len(got[0])} steps"
            assert_equal_traces(f"rank {rank} scenario {name}", got, want)
            assert all(np.array_equal(a, b) for a, b in zip(weights, want_weights)), f"{name}: weights"
            assert counters == want_counters, f"rank {rank} {name}: TBE counters {counters} vs {want_counters}"
        assert res["B relookups"] == 1
        got_eval, plain = res["C"]
        assert all(np.array_equal(a, b) for a, b in zip(got_eval, plain)) and len(got_eval) == 4
