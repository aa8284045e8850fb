"""The gloo harness itself: results come back per rank and failures surface."""

import pytest
import torch
import torch.distributed as dist
from harness.gloo import run_gloo


def _allreduce_rank(rank: int, world_size: int, scale: int) -> int:
    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return int(t.item())


def _fail_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")


def test_run_gloo_returns_per_rank_results() -> None:
    assert run_gloo(2, _allreduce_rank, 3) == [3, 3]


def test_run_gloo_surfaces_rank_failure() -> None:
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_gloo(2, _fail_on_rank1, timeout_s=60)
