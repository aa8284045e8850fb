"""TrainPipelineFusedSparseDist refuses models it cannot pipeline exactly.

A table stepped by the dense optimizer (compute kernel ``dense`` or sharding
``data_parallel``) or a feature processor inside a pipelined module makes a
lookup issued before the optimizer read stale weights. The pipeline refuses
them when the model is attached; ``allow_dense_tables=True`` orders those
lookups after the optimizer and stays exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import pytest
import torch
from harness.gloo import run_gloo
from harness.pipelines import TwoModuleModel, TwoSparseBatch, build_dmp, make_batches, run_pipeline, run_reference
from torchrec.streamable import Pipelineable

from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist
from recpipe.pipeline.train_pipeline.stats import STAGE_OUTPUT_DIST_WAIT, PipelineStageStats, TimedLazyAwaitable

DENSE_T1 = {"t1": ("table_wise", "dense")}  # table t1 of module "ebc": dense kernel
DP_T1 = {"t1": ("data_parallel", None)}  # table t1 of module "ebc": replicated


def _np(xs: Sequence[torch.Tensor]) -> List[np.ndarray]:
    return [x.detach().cpu().numpy() for x in xs]


class _EbcTwiceModel(TwoModuleModel):
    """``TwoModuleModel`` whose forward calls its EBC twice (a pipelined module may be called once)."""

    def forward(self, batch: TwoSparseBatch) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        again = self.ebc(batch.ebc_features).values()
        loss, out = super().forward(batch)
        return loss + 0.0 * again.sum(), out


def _refusal_body(rank: int, world_size: int) -> Dict[str, Any]:
    from recpipe.pipeline.train_pipeline.validation import FusedLookupExactnessError

    device = torch.device("cpu")
    batches = make_batches(rank, seed=2)
    out: Dict[str, Any] = {}

    for label, kwargs in (
        ("dense", {"overrides": DENSE_T1}),
        ("dp", {"overrides": DP_T1}),
        ("fp", {"position_weighted": True}),
    ):
        model, opt = build_dmp("table_wise", device, **kwargs)
        pipe = TrainPipelineFusedSparseDist(model, opt, device)
        try:
            pipe.progress(iter(batches))
            out[label] = None
        except FusedLookupExactnessError as e:
            out[label] = str(e)
            # refused before any step; the model's original forwards are restored
            out[label + " restored"] = not any(
                type(m.forward).__name__ == "FusedLookupPipelinedForward"
                for m in model.modules()
                if hasattr(m, "forward") and not isinstance(m.forward, type(model.forward))
            )

    model, opt = build_dmp("table_wise", device)
    model.module.__class__ = _EbcTwiceModel  # the sharded model, its forward now calling "ebc" twice
    try:
        TrainPipelineFusedSparseDist(model, opt, device).progress(iter(batches))
        out["twice"] = None
    except RuntimeError as e:
        out["twice"] = str(e)

    for label, overrides in (("dense", DENSE_T1), ("dp", DP_T1)):
        ref, ref_opt = build_dmp("table_wise", device, overrides=overrides)
        out[f"{label} reference"] = _np(run_reference(ref, ref_opt, batches)[0])
        for after_opt in (False, True):
            model, opt = build_dmp("table_wise", device, overrides=overrides)
            pipe = TrainPipelineFusedSparseDist(
                model, opt, device, embedding_lookup_after_opt=after_opt, allow_dense_tables=True
            )
            out[f"{label} allowed after_opt={after_opt}"] = _np(run_pipeline(pipe, batches)[0])
            out[f"{label} allowed after_opt={after_opt} late"] = list(pipe.after_optimizer_modules)
            out[f"{label} allowed after_opt={after_opt} relookups"] = pipe.stats.relookups
    return out


@pytest.fixture(scope="module")
def refusal_results() -> List[Dict[str, Any]]:
    return run_gloo(2, _refusal_body, timeout_s=300)


def test_dense_kernel_table_is_refused_naming_module_and_table(refusal_results: List[Dict[str, Any]]) -> None:
    for res in refusal_results:
        msg = res["dense"]
        assert msg is not None, "a dense-kernel table was accepted"
        assert "module 'ebc' table 't1' (compute_kernel='dense')" in msg
        assert "1 table(s) in 1 pipelined module(s)" in msg
        assert "Possible solutions" in msg and "allow_dense_tables=True" in msg
        assert "'t0'" not in msg  # the fused table is not blamed
        assert res["dense restored"]


def test_data_parallel_table_is_refused(refusal_results: List[Dict[str, Any]]) -> None:
    for res in refusal_results:
        msg = res["dp"]
        assert msg is not None, "a data_parallel table was accepted"
        assert "module 'ebc' table 't1'" in msg and "sharding_type='data_parallel'" in msg


def test_feature_processor_is_refused(refusal_results: List[Dict[str, Any]]) -> None:
    for res in refusal_results:
        msg = res["fp"]
        assert msg is not None, "a feature-processed module was accepted"
        assert "['ebc']" in msg and "feature processor" in msg and "Possible solutions" in msg


@pytest.mark.parametrize("label", ["dense", "dp"])
def test_allow_dense_tables_stays_exact(refusal_results: List[Dict[str, Any]], label: str) -> None:
    for rank, res in enumerate(refusal_results):
        ref = res[f"{label} reference"]
        assert len(ref) == 10
        for after_opt in (False, True):
            got = res[f"{label} allowed after_opt={after_opt}"]
            assert res[f"{label} allowed after_opt={after_opt} late"] == ["ebc"]
            # ordered after the optimizer, the dense-updated tables' lookup is never redone
            assert res[f"{label} allowed after_opt={after_opt} relookups"] == 0
            assert len(got) == len(ref)
            for step, (a, b) in enumerate(zip(got, ref)):
                assert np.array_equal(a, b), f"rank {rank} {label} after_opt={after_opt}: step {step} {a} vs {b}"


def test_module_called_twice_in_forward_names_the_cause(refusal_results: List[Dict[str, Any]]) -> None:
    for res in refusal_results:
        msg = res["twice"]
        assert msg is not None and "module 'ebc'" in msg, msg
        assert "'ebc' is called more than once in the model's forward" in msg and "Call it once" in msg, msg


def test_bad_arguments_name_the_argument() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="device must be a torch.device.*torch.device\\('cpu'\\)"):
        TrainPipelineFusedSparseDist(model, opt, "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="embedding_lookup_after_opt must be a bool"):
        TrainPipelineFusedSparseDist(model, opt, torch.device("cpu"), embedding_lookup_after_opt=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="context_type must subclass FusedLookupPipelineContext"):
        from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext

        TrainPipelineFusedSparseDist(model, opt, torch.device("cpu"), context_type=TrainPipelineContext)
    with pytest.raises(TypeError):
        # the new options are keyword-only
        TrainPipelineFusedSparseDist(model, opt, torch.device("cpu"), True, False, *([None] * 9), True)  # type: ignore[misc]


def test_timed_lazy_awaitable_is_lazy_and_times_the_wait() -> None:
    from torchrec.distributed.types import Awaitable

    calls: List[float] = []

    class Slow(Awaitable[torch.Tensor]):
        def _wait_impl(self) -> torch.Tensor:
            calls.append(time.perf_counter())
            time.sleep(0.05)
            return torch.arange(3.0)

    stats = PipelineStageStats()
    lazy = TimedLazyAwaitable(Slow(), stats, "## test wait ##")
    assert calls == []  # wrapping does not wait
    total = torch.sum(lazy)  # first use waits (via __torch_function__)
    assert len(calls) == 1 and float(total) == 3.0
    assert 0.05 <= stats.seconds[STAGE_OUTPUT_DIST_WAIT] < 1.0
    stats.steps = 2
    assert stats.per_step_ms()[STAGE_OUTPUT_DIST_WAIT] == pytest.approx(1e3 * stats.seconds[STAGE_OUTPUT_DIST_WAIT] / 2)
    with pytest.raises(KeyError, match="unknown pipeline stage"):
        stats.add("nope", 1.0)


@dataclass
class _DenseBatch(Pipelineable):
    """A batch without sparse features (the context check runs before any lookup)."""

    x: torch.Tensor
    y: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "_DenseBatch":
        return _DenseBatch(self.x.to(device, non_blocking=non_blocking), self.y.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: torch.Stream) -> None:
        self.x.record_stream(stream)
        self.y.record_stream(stream)


class _DenseModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, batch: _DenseBatch) -> Tuple[torch.Tensor, torch.Tensor]:
        pred = self.lin(batch.x).squeeze(1)
        return torch.nn.functional.mse_loss(pred, batch.y), pred.detach()


def _dense_pipeline() -> Tuple[TrainPipelineFusedSparseDist, _DenseModel, List[_DenseBatch]]:
    torch.manual_seed(0)
    model = _DenseModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [_DenseBatch(torch.randn(8, 4), torch.randn(8)) for _ in range(3)]
    return TrainPipelineFusedSparseDist(model, opt, torch.device("cpu")), model, batches


def test_foreign_pipeline_context_raises_type_error_naming_the_fix() -> None:
    """torchrec's 2-D sharding tests append plain TrainPipelineContext objects to
    pipeline.contexts; the fused pipeline names the expected class, the class it
    got and the extension point, before running anything of the step."""
    from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext

    for bad_position in (0, 1):
        pipe, model, batches = _dense_pipeline()
        before = [p.detach().clone() for p in model.parameters()]
        for i, b in enumerate(batches):
            context = pipe._create_context()
            if i == bad_position:
                context = TrainPipelineContext(index=10 + i)
            pipe.batches.append(b)
            pipe.contexts.append(context)
        with pytest.raises(TypeError) as info:
            pipe.progress(iter([]))
        msg = str(info.value)
        assert (
            f"pipeline.contexts[{bad_position}] (batch {10 + bad_position}) is a "
            "torchrec.distributed.train_pipeline.pipeline_context.TrainPipelineContext" in msg
        ), msg
        assert "expected a recpipe.pipeline.train_pipeline.context.FusedLookupPipelineContext" in msg
        assert "pipeline._create_context()" in msg
        # nothing of the step ran
        assert len(pipe.batches) == 3 and pipe.stats.steps == 0
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    # Positive control: the same queue built with _create_context() trains.
    pipe, model, batches = _dense_pipeline()
    before = [p.detach().clone() for p in model.parameters()]
    for b in batches:
        pipe.batches.append(b)
        pipe.contexts.append(pipe._create_context())
    pred = pipe.progress(iter([]))  # the model returns (loss, pred); the pipeline returns pred
    assert pipe.stats.steps == 1 and pred.shape == (8,)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_create_context_override_returning_a_foreign_context_is_refused() -> None:
    """A subclass whose _create_context() returns a non-fused context is refused
    on the first progress() (the batch's context comes from the extension point)."""
    from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext

    class PlainContexts(TrainPipelineFusedSparseDist):
        def _create_context(self) -> TrainPipelineContext:
            context = TrainPipelineContext(index=self._next_index, version=1)
            self._next_index += 1
            return context

    torch.manual_seed(0)
    model = _DenseModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pipe = PlainContexts(model, opt, torch.device("cpu"))
    batches = [_DenseBatch(torch.randn(8, 4), torch.randn(8)) for _ in range(3)]
    with pytest.raises(TypeError, match=r"contexts\[0\] \(batch 0\) is a .*TrainPipelineContext; expected"):
        pipe.progress(iter(batches))
    assert pipe.stats.steps == 0
