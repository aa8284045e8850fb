"""How every rank of a checkpoint call learns one rank's refusal.

A refusal found on one rank is gathered so that every rank raises together, instead of one
raising while the others wait in the next collective. Without torch.distributed (or with one
rank) nothing is gathered. Imports ``checkpoint.checkpoint_errors`` and ``tiered.state``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch.distributed as dist

from recpipe.pipeline.checkpoint.checkpoint_errors import CheckpointError, CheckpointTableError
from recpipe.pipeline.tiered.state import TieredCheckpointError


def rank_world(process_group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    """This process's rank and the group's size (``(0, 1)`` without torch.distributed)."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def all_gather(obj: Any, world: int, process_group: Optional[dist.ProcessGroup]) -> List[Any]:
    """``obj`` of every rank of the group, in rank order (small picklable values only)."""
    if world == 1:
        return [obj]
    out: List[Any] = [None] * world
    dist.all_gather_object(out, obj, group=process_group)
    return out


def refusals(action: Callable[[], Any], process_group: Optional[dist.ProcessGroup]) -> List[Tuple[int, str]]:
    """Runs ``action`` on this rank; returns every rank's ``(rank, message)`` of a
    ``CheckpointError`` or a tiered shard's ``TieredCheckpointError``."""
    problem: Optional[str] = None
    try:
        action()
    except (CheckpointError, TieredCheckpointError) as e:
        problem = str(e)
    world = rank_world(process_group)[1]
    return [(r, p) for r, p in enumerate(all_gather(problem, world, process_group)) if p is not None]


def raise_refusals(problems: List[Tuple[int, str]], outcome: str) -> None:
    """Raises every rank's refusal of :func:`refusals` as one :class:`CheckpointTableError`, one
    line each, then ``outcome``, when any."""
    if problems:
        raise CheckpointTableError("\n".join([f"rank {r}: {p}" for r, p in problems] + [outcome]))


def raise_first_refusal(problems: List[Tuple[int, str]], process_group: Optional[dist.ProcessGroup]) -> None:
    """Raises this rank's refusal of :func:`refusals` (else the first rank's) as a
    :class:`CheckpointTableError`, when any."""
    if problems:
        mine = dict(problems).get(rank_world(process_group)[0])
        raise CheckpointTableError(mine if mine is not None else f"on rank {problems[0][0]}: {problems[0][1]}")
