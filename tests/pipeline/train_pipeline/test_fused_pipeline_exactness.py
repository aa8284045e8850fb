"""TrainPipelineFusedSparseDist: exactness against a non-pipelined loop and torchrec.

Every gloo run trains several identically initialised copies of a small sharded
model (an EBC and an EC: two pipelined modules) on the same batches and returns
the per-step losses and predictions; the parent compares them bit for bit with
the non-pipelined reference (forward, backward, optimizer per batch). The same
bodies run on CUDA (NCCL for torchrec, 2 GPUs) when present.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
from harness.gloo import run_gloo
from harness.pipelines import (
    FLAG_COMBOS,
    N_BATCHES,
    SHARDING_TYPES,
    assert_same,
    build_dmp,
    copy_state,
    make_batches,
    on_cpu,
    run_pipeline,
    run_reference,
)

Trace = Tuple[List[torch.Tensor], List[torch.Tensor]]


def _device(rank: int, use_cuda: bool) -> Tuple[torch.device, Optional[dist.ProcessGroup]]:
    if not use_cuda:
        return torch.device("cpu"), None
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank), dist.new_group(backend="nccl")


def _parity_body(rank: int, world_size: int, sharding: str, use_cuda: bool) -> Dict[str, Any]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    device, pg = _device(rank, use_cuda)
    batches = make_batches(rank)
    ref, ref_opt = build_dmp(sharding, device, pg=pg)
    out: Dict[str, Any] = {"reference": on_cpu(run_reference(ref, ref_opt, [b.to(device) for b in batches]))}

    def fresh() -> Tuple[Any, Any]:
        model, opt = build_dmp(sharding, device, pg=pg)
        src, _ = build_dmp(sharding, device, pg=pg)
        copy_state(model, src)
        return model, opt

    model, opt = fresh()
    losses, preds, again = run_pipeline(TrainPipelineSparseDist(model, opt, device), batches)
    out["torchrec"] = on_cpu((losses, preds))
    out["torchrec_stops_again"] = again
    for stream, after_opt in FLAG_COMBOS:
        model, opt = fresh()
        pipe = TrainPipelineFusedSparseDist(
            model, opt, device, use_emb_lookup_stream=stream, embedding_lookup_after_opt=after_opt
        )
        losses, preds, again = run_pipeline(pipe, batches)
        key = f"recpipe stream={stream} after_opt={after_opt}"
        out[key] = on_cpu((losses, preds))
        out[key + " stops_again"] = again
        out[key + " pipelined"] = sorted(m.forward.name for m in pipe._pipelined_modules)
        out[key + " steps"] = pipe.stats.steps
        out[key + " wait_s"] = pipe.stats.seconds["output_dist_wait"]
        out[key + " relookups"] = pipe.stats.relookups
    # On CPU the pipeline must make no CUDA call at all (torch would initialise CUDA).
    out["cuda_initialized"] = torch.cuda.is_initialized()
    out["use_cuda"] = use_cuda
    return out


def _check_parity(results: Sequence[Dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        ref = res["reference"]
        if not res["use_cuda"]:
            assert not res["cuda_initialized"], f"rank {rank}: a CPU run initialised CUDA"
        assert len(ref[0]) == N_BATCHES
        # The reference must not be trivially constant (the comparison has teeth).
        assert len({float(x) for x in ref[0]}) > 1
        assert_same(f"rank {rank} torchrec SparseDist", res["torchrec"], ref)
        assert res["torchrec_stops_again"]
        for stream, after_opt in FLAG_COMBOS:
            key = f"recpipe stream={stream} after_opt={after_opt}"
            assert_same(f"rank {rank} {key}", res[key], ref)
            # bit-identical to torchrec's own pipeline too
            assert_same(f"rank {rank} {key} vs torchrec", res[key], res["torchrec"])
            assert res[key + " stops_again"], f"{key}: progress after the end did not raise StopIteration"
            assert res[key + " pipelined"] == ["ebc", "ec"], res[key + " pipelined"]
            assert res[key + " steps"] == N_BATCHES
            assert res[key + " wait_s"] > 0.0
            # No early lookup is ever redone in uninterrupted training.
            assert res[key + " relookups"] == 0, res[key + " relookups"]


@pytest.mark.parametrize("sharding", SHARDING_TYPES)
def test_fused_pipeline_matches_non_pipelined_and_torchrec(sharding: str) -> None:
    """EBC + EC, all four flag combinations, 10 batches, StopIteration at the end."""
    _check_parity(run_gloo(2, _parity_body, sharding, False, timeout_s=300))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("sharding", SHARDING_TYPES)
def test_fused_pipeline_parity_cuda(sharding: str) -> None:
    """The same parity on CUDA: streams, events and record_stream are exercised."""
    _check_parity(run_gloo(2, _parity_body, sharding, True, timeout_s=300))


def _overlap_body(rank: int, world_size: int, use_emb_lookup_stream: bool) -> List[bool]:
    """Per step: whether batch i+1's lookup had finished while the optimizer of batch i
    (a 0.5 s GPU sleep on the default stream) still ran."""
    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    device, pg = _device(rank, True)
    model, opt = build_dmp("table_wise", device, pg=pg)
    step = opt.step
    ends: List[torch.cuda.Event] = []

    def slow_step(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        torch.cuda._sleep(int(0.5 * torch.cuda.get_device_properties(device).clock_rate * 1000))
        ends.append(torch.cuda.current_stream().record_event())
        return out

    opt.step = slow_step  # this instance only
    pipe = TrainPipelineFusedSparseDist(
        model, opt, device, use_emb_lookup_stream=use_emb_lookup_stream, embedding_lookup_after_opt=True
    )
    it = iter([b.to(device) for b in make_batches(rank)])
    overlapped: List[bool] = []
    for _ in range(3):
        pipe.progress(it)
        events = pipe.contexts[0].lookup_events  # batch i+1's, on the lookup stream
        for ev in events.values():
            ev.synchronize()
        overlapped.append(bool(events) and not ends[-1].query())
        torch.cuda.synchronize()
    return overlapped


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("use_emb_lookup_stream", [False, True])
def test_next_lookup_overlaps_the_optimizer_cuda(use_emb_lookup_stream: bool) -> None:
    """With the CUDA defaults (``embedding_lookup_after_opt=True``) batch i+1's lookup waits
    for batch i's backward only, not for the dense optimizer kernels: it finishes while a
    0.5 s optimizer is still running."""
    assert run_gloo(1, _overlap_body, use_emb_lookup_stream, timeout_s=300) == [[True, True, True]]


def _edge_body(rank: int, world_size: int) -> Dict[str, Any]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    device = torch.device("cpu")
    out: Dict[str, Any] = {}
    all_batches = make_batches(rank, seed=1)
    for n in (0, 1, 2, 4):
        batches = all_batches[:n]
        ref, ref_opt = build_dmp("table_wise", device)
        out[f"reference n={n}"] = on_cpu(run_reference(ref, ref_opt, batches))
        for execute_all in (True, False):
            for name, cls, kwargs in (
                ("torchrec", TrainPipelineSparseDist, {}),
                ("recpipe", TrainPipelineFusedSparseDist, {"embedding_lookup_after_opt": False}),
            ):
                model, opt = build_dmp("table_wise", device)
                pipe = cls(model, opt, device, execute_all_batches=execute_all, **kwargs)
                losses, preds, again = run_pipeline(pipe, batches)
                out[f"{name} n={n} all={execute_all}"] = on_cpu((losses, preds)) + (again,)
    # eval mode: no backward; lookups of batch i+1 issued after the forward of batch i.
    ref, _ = build_dmp("table_wise", device)
    ref.eval()
    with torch.no_grad():
        out["reference eval"] = [ref(b)[1][1].numpy() for b in all_batches[:4]]
    model, opt = build_dmp("table_wise", device)
    model.eval()
    pipe = TrainPipelineFusedSparseDist(model, opt, device)
    with torch.no_grad():
        out["recpipe eval"] = [p.numpy() for p in run_pipeline(pipe, all_batches[:4])[1]]
    return out


def test_short_dataloaders_execute_all_batches_and_eval() -> None:
    """0, 1, 2 and 4 batches (shorter than / equal to the pipeline depth), with and
    without execute_all_batches: same steps and values as torchrec's pipeline and
    the reference; eval mode matches a plain forward."""
    for rank, res in enumerate(run_gloo(2, _edge_body, timeout_s=300)):
        for n in (0, 1, 2, 4):
            ref = res[f"reference n={n}"]
            for execute_all in (True, False):
                t_losses, t_preds, t_again = res[f"torchrec n={n} all={execute_all}"]
                r_losses, r_preds, r_again = res[f"recpipe n={n} all={execute_all}"]
                label = f"rank {rank} n={n} execute_all_batches={execute_all}"
                assert len(r_losses) == len(t_losses), f"{label}: {len(r_losses)} vs torchrec {len(t_losses)}"
                if execute_all:
                    assert len(r_losses) == n, label
                assert r_again and t_again, label
                assert_same(label, (r_losses, r_preds), (ref[0][: len(r_losses)], ref[1][: len(r_losses)]))
        assert len(res["recpipe eval"]) == 4
        for step, (a, b) in enumerate(zip(res["recpipe eval"], res["reference eval"])):
            assert (a == b).all(), f"rank {rank}: eval predictions differ at step {step}"


TORCHREC_OPTIONS: Tuple[Dict[str, Any], ...] = (
    {"enqueue_batch_after_forward": True},
    {"enable_inplace_copy_batch": True},
    {"enable_inplace_copy_batch": True, "async_inplace_copy": True},
    {"clear_data_dist_inputs": True},
    {"free_features_storage_early": True},
    {"apply_jit": True},
    {"pipeline_postproc": True},
    {"dmp_collection_sync_interval_batches": None},
)
"""torchrec's own pipeline options, passed through by TrainPipelineFusedSparseDist."""


def _options_body(rank: int, world_size: int, sharding: str) -> Dict[str, Any]:
    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    device = torch.device("cpu")
    batches = make_batches(rank)
    ref, ref_opt = build_dmp(sharding, device)
    out: Dict[str, Any] = {"reference": on_cpu(run_reference(ref, ref_opt, batches))}
    for i, options in enumerate(TORCHREC_OPTIONS):
        for after_opt in (False, True):
            model, opt = build_dmp(sharding, device)
            pipe = TrainPipelineFusedSparseDist(model, opt, device, embedding_lookup_after_opt=after_opt, **options)
            losses, preds, _ = run_pipeline(pipe, batches)
            out[f"{i} {after_opt}"] = on_cpu((losses, preds))
    return out


@pytest.mark.parametrize("sharding", ("table_wise", "row_wise"))
def test_torchrec_pipeline_options_keep_parity(sharding: str) -> None:
    """Each of torchrec's pipeline options (in-place and async batch copy, early
    release of the input dist and of the features, jit, postproc pipelining, ...)
    keeps the fused pipeline equal to the non-pipelined loop, both lookup orders.
    (torchrec 1.9.2's own pipeline fails with clear_data_dist_inputs=True on a
    TABLE_WISE EC on CPU: the EC's output dist reads lengths it has freed.)"""
    for rank, res in enumerate(run_gloo(2, _options_body, sharding, timeout_s=300)):
        for i, options in enumerate(TORCHREC_OPTIONS):
            for after_opt in (False, True):
                assert_same(
                    f"rank {rank} {sharding} {options} after_opt={after_opt}", res[f"{i} {after_opt}"], res["reference"]
                )
