"""TrainPipelineFusedSparseDist takes torchrec 1.9.2's own TrainPipelineFusedSparseDist arguments.

torchrec's ``emb_lookup_stream`` ('new' / 'current' / 'data_dist') and
``embedding_lookup_after_data_dist`` are accepted with torchrec's meaning, mapped onto
recpipe's ``use_emb_lookup_stream`` / ``embedding_lookup_after_opt``; a recpipe flag
contradicting its torchrec counterpart is refused naming both.

The reference schedule is written here from torchrec's ``progress()`` (train_pipelines.py):
``fill_pipeline`` starts batch 0's input dist; then each ``progress()`` on batch i issues
batch i's lookup first (``embedding_lookup_after_data_dist=False``) or after batch i+1's
input dist started (True), then steps the optimizer of batch i. torchrec's own class cannot
be run on CPU (its lookup records a CPU stream's ``.device``, which does not exist), so the
2-rank gloo runs compare recpipe's order of input dists, lookups and optimizer steps with
that schedule, and its losses, predictions, final weights, fused optimizer state and TBE
counters bit for bit with torchrec's ``TrainPipelineSparseDist``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
from harness.breadth_model import final_state
from harness.gloo import run_gloo
from harness.pipelines import (
    N_BATCHES,
    TORCHREC_FLAG_COMBOS,
    assert_same,
    build_dmp,
    make_batches,
    on_cpu,
    run_pipeline,
)

from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist
from recpipe.pipeline.train_pipeline.lookup_schedule import LookupIssuePoint

Event = Tuple[str, int]


def torchrec_events(n: int, after_data_dist: bool) -> List[Event]:
    """torchrec's TrainPipelineFusedSparseDist order of input dists, lookups and optimizer
    steps over ``n`` batches."""
    events: List[Event] = [("input_dist", 0)]
    for i in range(n):
        if not after_data_dist:
            events.append(("lookup", i))
        if i + 1 < n:
            events.append(("input_dist", i + 1))
        if after_data_dist:
            events.append(("lookup", i))
        events.append(("optimizer", i))
    return events


def lookup_after_backward_events(n: int) -> List[Event]:
    """recpipe's ``embedding_lookup_after_opt=False``: batch i+1's lookup precedes batch i's
    optimizer step (torchrec has no such schedule; the recorder must tell it apart)."""
    events: List[Event] = [("input_dist", 0), ("lookup", 0)]
    for i in range(n):
        if i + 1 < n:
            events += [("input_dist", i + 1), ("lookup", i + 1)]
        events.append(("optimizer", i))
    return events


def _pipe(**kwargs: Any) -> TrainPipelineFusedSparseDist:
    model = torch.nn.Linear(2, 2)
    return TrainPipelineFusedSparseDist(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), **kwargs
    )


# torchrec's arguments -> (stream, issue point) by torchrec's semantics
TORCHREC_MEANING: List[Tuple[Dict[str, Any], str, LookupIssuePoint]] = [
    ({}, "data_dist", LookupIssuePoint.AFTER_OPTIMIZER),  # both libraries' defaults
    ({"emb_lookup_stream": "new"}, "new", LookupIssuePoint.AFTER_OPTIMIZER),
    ({"emb_lookup_stream": "current"}, "current", LookupIssuePoint.AFTER_OPTIMIZER),
    ({"emb_lookup_stream": "data_dist"}, "data_dist", LookupIssuePoint.AFTER_OPTIMIZER),
    ({"embedding_lookup_after_data_dist": False}, "data_dist", LookupIssuePoint.AFTER_OPTIMIZER),
    ({"embedding_lookup_after_data_dist": True}, "data_dist", LookupIssuePoint.AFTER_DATA_DIST),
    (
        {"emb_lookup_stream": "current", "embedding_lookup_after_data_dist": True},
        "current",
        LookupIssuePoint.AFTER_DATA_DIST,
    ),
    # recpipe's flags alone, and each with the torchrec value meaning the same
    ({"use_emb_lookup_stream": True}, "new", LookupIssuePoint.AFTER_OPTIMIZER),
    ({"use_emb_lookup_stream": False}, "data_dist", LookupIssuePoint.AFTER_OPTIMIZER),
    ({"embedding_lookup_after_opt": False}, "data_dist", LookupIssuePoint.AFTER_BACKWARD),
    ({"use_emb_lookup_stream": True, "emb_lookup_stream": "new"}, "new", LookupIssuePoint.AFTER_OPTIMIZER),
    ({"use_emb_lookup_stream": False, "emb_lookup_stream": "data_dist"}, "data_dist", LookupIssuePoint.AFTER_OPTIMIZER),
    (
        {"embedding_lookup_after_opt": True, "embedding_lookup_after_data_dist": False},
        "data_dist",
        LookupIssuePoint.AFTER_OPTIMIZER,
    ),
]


@pytest.mark.parametrize("kwargs, stream, point", TORCHREC_MEANING, ids=[str(k) for k, _, _ in TORCHREC_MEANING])
def test_torchrec_arguments_map_onto_recpipe_flags(
    kwargs: Dict[str, Any], stream: str, point: LookupIssuePoint
) -> None:
    schedule = _pipe(**kwargs).lookup_schedule
    assert schedule.emb_lookup_stream == stream
    assert schedule.issue_point is point
    # the flags of both libraries, read back from the one schedule
    assert schedule.use_emb_lookup_stream is (stream == "new")
    assert schedule.embedding_lookup_after_opt is (point is not LookupIssuePoint.AFTER_BACKWARD)
    assert schedule.embedding_lookup_after_data_dist is (point is LookupIssuePoint.AFTER_DATA_DIST)


CONTRADICTIONS: List[Tuple[Dict[str, Any], Tuple[str, str]]] = [
    ({"use_emb_lookup_stream": True, "emb_lookup_stream": "current"}, ("use_emb_lookup_stream", "emb_lookup_stream")),
    ({"use_emb_lookup_stream": True, "emb_lookup_stream": "data_dist"}, ("use_emb_lookup_stream", "emb_lookup_stream")),
    ({"use_emb_lookup_stream": False, "emb_lookup_stream": "new"}, ("use_emb_lookup_stream", "emb_lookup_stream")),
    ({"use_emb_lookup_stream": False, "emb_lookup_stream": "current"}, ("use_emb_lookup_stream", "emb_lookup_stream")),
    (
        {"embedding_lookup_after_opt": False, "embedding_lookup_after_data_dist": True},
        ("embedding_lookup_after_opt", "embedding_lookup_after_data_dist"),
    ),
    (
        {"embedding_lookup_after_opt": False, "embedding_lookup_after_data_dist": False},
        ("embedding_lookup_after_opt", "embedding_lookup_after_data_dist"),
    ),
    (
        {"embedding_lookup_after_opt": True, "embedding_lookup_after_data_dist": True},
        ("embedding_lookup_after_opt", "embedding_lookup_after_data_dist"),
    ),
]


@pytest.mark.parametrize("kwargs, names", CONTRADICTIONS, ids=[str(k) for k, _ in CONTRADICTIONS])
def test_contradictory_combination_is_refused_naming_both(kwargs: Dict[str, Any], names: Tuple[str, str]) -> None:
    with pytest.raises(ValueError) as info:
        _pipe(**kwargs)
    msg = str(info.value)
    for name in names:
        assert f"{name}={kwargs[name]!r}" in msg, msg
    assert "Pass only one of them" in msg, msg


@pytest.mark.parametrize("value", ["default", "New", "cuda", "", True, 1])
def test_emb_lookup_stream_outside_torchrecs_values_is_refused(value: Any) -> None:
    with pytest.raises(ValueError) as info:
        _pipe(emb_lookup_stream=value)
    msg = str(info.value)
    assert "emb_lookup_stream must be one of ['new', 'current', 'data_dist']" in msg, msg
    assert f"got {type(value).__name__} {value!r}" in msg, msg
    # the recpipe counterpart and what its values mean
    assert "use_emb_lookup_stream=True is emb_lookup_stream='new'" in msg, msg


def test_embedding_lookup_after_data_dist_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="embedding_lookup_after_data_dist must be a bool, got int 1"):
        _pipe(embedding_lookup_after_data_dist=1)


class _RecordingPipeline(TrainPipelineFusedSparseDist):
    """Records (event, batch index) of every input dist and lookup it starts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: List[Event] = []

    def start_sparse_data_dist(self, batch: Optional[Any], context: Any) -> None:
        if batch is not None:
            self.events.append(("input_dist", context.index))
        super().start_sparse_data_dist(batch, context)

    def start_embedding_lookup(self, context: Any, modules: Sequence[Any], tables_updated: Any = None) -> None:
        if modules:
            self.events.append(("lookup", context.index))
        super().start_embedding_lookup(context, modules, tables_updated)


def _recorded_run(pipe: _RecordingPipeline, opt: Any, batches: Sequence[Any], model: Any) -> Dict[str, Any]:
    step = opt.step

    def recorded_step(*args: Any, **kwargs: Any) -> Any:
        pipe.events.append(("optimizer", pipe.contexts[0].index))
        return step(*args, **kwargs)

    opt.step = recorded_step  # this instance only
    losses, preds, again = run_pipeline(pipe, batches)
    return {
        "trace": on_cpu((losses, preds)),
        "state": final_state(model),
        "events": list(pipe.events),
        "stops_again": again,
        "relookups": pipe.stats.relookups,
    }


def _schedule_body(rank: int, world_size: int, sharding: str) -> Dict[Any, Any]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    device = torch.device("cpu")
    batches = make_batches(rank, seed=3)
    model, opt = build_dmp(sharding, device)
    losses, preds, _ = run_pipeline(TrainPipelineSparseDist(model, opt, device), batches)
    out: Dict[Any, Any] = {"torchrec": {"trace": on_cpu((losses, preds)), "state": final_state(model)}}
    runs: List[Tuple[Any, Dict[str, Any]]] = [
        ((stream, after_dd), {"emb_lookup_stream": stream, "embedding_lookup_after_data_dist": after_dd})
        for stream, after_dd in TORCHREC_FLAG_COMBOS
    ]
    runs.append(("recpipe after_opt=False", {"embedding_lookup_after_opt": False}))
    for key, kwargs in runs:
        model, opt = build_dmp(sharding, device)
        out[key] = _recorded_run(_RecordingPipeline(model, opt, device, **kwargs), opt, batches, model)
    out["cuda_initialized"] = torch.cuda.is_initialized()
    return out


def _assert_same_state(label: str, got: Dict[str, Any], want: Dict[str, Any]) -> None:
    assert sorted(got) == sorted(want), label
    for key, value in want.items():
        assert np.array_equal(np.asarray(got[key]), np.asarray(value)), f"{label}: {key} differs"


def test_torchrec_arguments_follow_torchrecs_schedule_and_stay_exact() -> None:
    """Each torchrec argument combination on 2 gloo ranks (TABLE_WISE; the schedule does not
    depend on the sharding, which test_fused_pipeline_exactness.py varies): torchrec's order of
    input dists, lookups and optimizer steps; losses, predictions, weights, optimizer state
    and TBE counters bit-identical to TrainPipelineSparseDist."""
    for rank, res in enumerate(run_gloo(2, _schedule_body, "table_wise", timeout_s=600)):
        assert not res["cuda_initialized"], f"rank {rank}: a CPU run initialised CUDA"
        want = res["torchrec"]
        assert len({float(x) for x in want["trace"][0]}) > 1  # the comparison has teeth
        for stream, after_dd in TORCHREC_FLAG_COMBOS:
            label = f"rank {rank} emb_lookup_stream={stream!r} embedding_lookup_after_data_dist={after_dd}"
            got = res[(stream, after_dd)]
            assert got["events"] == torchrec_events(N_BATCHES, after_dd), f"{label}: {got['events']}"
            assert_same(label, got["trace"], want["trace"])
            _assert_same_state(label, got["state"], want["state"])
            assert got["stops_again"] and got["relookups"] == 0, label
        # recpipe's own earlier issue point is told apart by the recorder, and exact too
        got = res["recpipe after_opt=False"]
        assert got["events"] == lookup_after_backward_events(N_BATCHES), got["events"]
        assert got["events"] != torchrec_events(N_BATCHES, False)
        assert_same(f"rank {rank} after_opt=False", got["trace"], want["trace"])
        _assert_same_state(f"rank {rank} after_opt=False", got["state"], want["state"])
