"""The gloo harness itself: results come back per rank, failures surface, and calls that
share the pooled workers do not see each other's process state."""

import os
import time
import warnings
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
from harness import gloo
from harness.gloo import run_gloo

PROBE_ENV = "RECPIPE_HARNESS_PROBE"


def _allreduce_rank(rank: int, world_size: int, scale: int) -> int:
    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return int(t.item())


def _fail_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")


def _exit_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()  # rank 0 waits in a collective for the rank that is gone


def _sleep_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(120)
    dist.barrier()


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def _observe(rank: int, world_size: int, probe: str) -> Dict[str, Any]:
    """What a body sees of the process state that other bodies may change."""
    return {
        "probe": os.environ.get(probe),
        "rank_env": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "cwd": os.getcwd(),
        "dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "grad": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        "rand": torch.rand(3).tolist(),
        "filters": len(warnings.filters),
        "group_ranks": dist.get_world_size(),
    }


def _pollute(rank: int, world_size: int, probe: str, elsewhere: str) -> int:
    """Changes every piece of state :func:`_observe` reports; returns the pid."""
    os.environ[probe] = "leaked"
    os.chdir(elsewhere)
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    torch.set_grad_enabled(False)
    torch.rand(100)
    warnings.filterwarnings("ignore", message="a filter the harness must remove")
    return os.getpid()


def _patch_module(rank: int, world_size: int) -> int:
    """Binds a function of this file to a torch.distributed attribute (a monkeypatch left behind)."""

    from torch.distributed.checkpoint import FileSystemWriter

    def replacement(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a leaked monkeypatch ran")

    FileSystemWriter.write_data = replacement  # type: ignore[method-assign]
    return os.getpid()


def _write_data_is_torch_s(rank: int, world_size: int) -> bool:
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter.write_data.__module__ == "torch.distributed.checkpoint.filesystem"


def test_run_gloo_returns_per_rank_results() -> None:
    assert run_gloo(2, _allreduce_rank, 3) == [3, 3]


def test_run_gloo_reuses_its_workers_across_calls() -> None:
    first = run_gloo(2, _pid)
    assert len(set(first)) == 2 and os.getpid() not in first
    assert run_gloo(2, _pid) == first


def test_run_gloo_surfaces_rank_failure() -> None:
    """A rank's exception comes back with its traceback; the next call runs on new workers."""
    before = run_gloo(2, _pid)
    with pytest.raises(RuntimeError, match=r"(?s)--- rank 1 ---.*ValueError: boom on rank 1"):
        run_gloo(2, _fail_on_rank1, timeout_s=60)
    after = run_gloo(2, _pid)
    assert set(after).isdisjoint(before)  # the failed pool was killed, a new one answers
    assert run_gloo(2, _allreduce_rank, 5) == [5, 5]


def test_a_worker_that_exits_is_an_error_not_a_hang() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3"):
        run_gloo(2, _exit_on_rank1, timeout_s=120)
    assert time.monotonic() - start < 60
    assert run_gloo(2, _allreduce_rank, 2) == [2, 2]


def test_a_rank_past_the_timeout_fails_the_call_and_the_next_call_runs() -> None:
    run_gloo(2, _pid)  # the workers are up: the timeout is the body's
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"timed out after 2\.0 s .*ranks \[0, 1\] did not answer"):
        run_gloo(2, _sleep_on_rank1, timeout_s=2.0)
    assert time.monotonic() - start < 60
    assert run_gloo(2, _allreduce_rank, 1) == [1, 1]


def test_state_one_body_changes_does_not_reach_the_next_call(tmp_path: Any) -> None:
    """Env vars, cwd, default dtype, deterministic flag, grad mode, RNG state and warning
    filters come back as a first call saw them; the rank variables, the thread count and
    the group are set per call."""
    before = run_gloo(2, _observe, PROBE_ENV, threads_per_rank=2)
    pids = run_gloo(2, _pollute, PROBE_ENV, str(tmp_path))
    after = run_gloo(2, _observe, PROBE_ENV, threads_per_rank=2)
    assert run_gloo(2, _pid) == pids  # the same workers ran all three calls
    assert after == before
    assert [b["rank_env"] for b in before] == [("0", "2"), ("1", "2")]
    assert before[0]["probe"] is None and before[0]["cwd"] == os.getcwd()
    assert before[0]["dtype"] == "torch.float32" and before[0]["grad"] and before[0]["threads"] == 2


def test_the_callers_environment_reaches_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    run_gloo(2, _pid)  # the pool exists before the variable does
    monkeypatch.setenv(PROBE_ENV, "from the caller")
    assert [o["probe"] for o in run_gloo(2, _observe, PROBE_ENV)] == ["from the caller"] * 2


def test_a_body_that_leaves_a_monkeypatch_retires_its_workers() -> None:
    pids = run_gloo(2, _patch_module)
    assert set(run_gloo(2, _pid)).isdisjoint(pids)
    assert run_gloo(2, _write_data_is_torch_s) == [True, True]


def test_fresh_runs_on_processes_that_end_with_the_call() -> None:
    pooled = run_gloo(2, _pid)
    fresh = run_gloo(2, _pid, fresh=True)
    assert set(fresh).isdisjoint(pooled)
    for pid in fresh:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert run_gloo(2, _pid) == pooled


def test_shutdown_pools_ends_every_worker() -> None:
    pids = run_gloo(2, _pid) + run_gloo(1, _pid)
    assert len(set(pids)) == 3  # one pool per world size
    gloo.shutdown_pools()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert run_gloo(2, _allreduce_rank, 4) == [4, 4]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
        ({"threads_per_rank": 0}, "threads_per_rank must be an int >= 1, got 0"),
        ({"timeout_s": 0}, "timeout_s must be > 0 seconds, got 0"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: Dict[str, Any], message: str) -> None:
    world_size = kwargs.pop("world_size", 2)
    with pytest.raises(ValueError, match=message):
        run_gloo(world_size, _pid, **kwargs)
