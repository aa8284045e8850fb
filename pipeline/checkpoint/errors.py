"""The checkpoint errors of recpipe.pipeline.checkpoint, and how every rank learns them.

A refusal found on one rank is gathered so that every rank raises together, instead of one
raising while the others wait in the next collective. Imports only ``tiered.state``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from recpipe.pipeline.tiered.state import TieredCheckpointError

# fixes of a checkpoint whose files changed after the save
CORRUPT_FIXES: Tuple[str, ...] = (
    "restore the checkpoint directory from a copy taken before the damage",
    "load an older checkpoint",
)
# fixes of tiered rows holding NaN / inf in a checkpoint
NON_FINITE_FIXES: Tuple[str, ...] = (
    "the saving run diverged (or the rows were set so) and the checkpoint was written without "
    "recpipe.pipeline.checkpoint.save's check: load an earlier checkpoint",
    "re-save the table from a healthy run",
)


def numbered(fixes: Sequence[str]) -> List[str]:
    """The "Possible solutions" lines of an error message."""
    return ["Possible solutions:"] + [f"  {i}. {fix}" for i, fix in enumerate(fixes, 1)]


class CheckpointIntegrityError(RuntimeError):
    """Files of a DCP checkpoint differ from its digests record, or the record is missing or
    damaged (``problems``: ``(path, problem)`` of each bad file; ``fixes`` numbered in the
    message). Raised on every rank before anything is loaded."""

    def __init__(self, problems: Sequence[Tuple[str, str]], fixes: Sequence[str]) -> None:
        self.problems: List[Tuple[str, str]] = list(problems)
        self.fixes: Tuple[str, ...] = tuple(fixes)
        super().__init__("\n".join([f"{path}: {problem}" for path, problem in self.problems] + numbered(fixes)))


def dcp_failures(error: CheckpointException) -> List[Tuple[str, List[int]]]:
    """The distinct failures of a DCP ``CheckpointException``: ``("<type>: <message>", ranks)`` in rank order."""
    ranks: Dict[str, List[int]] = {}
    for rank, failure in sorted(error.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        ranks.setdefault(f"{type(exc).__name__}: {exc}", []).append(rank)
    return list(ranks.items())


def describe_failures(problems: Sequence[Tuple[str, Sequence[int]]]) -> List[str]:
    """One line per distinct failure of :func:`dcp_failures`, naming its ranks."""
    return [f"{p} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})" for p, r in problems]


class DCPFailure(RuntimeError):
    """DCP's ``CheckpointException`` (a ``BaseException`` holding a traceback per rank) as an
    ordinary exception: :attr:`HEADER` naming the checkpoint ``where``, each distinct problem of
    ``problems`` (``(problem, ranks)``, :func:`dcp_failures`) once with the ranks that hit it, then
    the possible solutions (``fixes``, by default :attr:`FIXES`)."""

    HEADER: str = "{where}"
    FIXES: Tuple[str, ...] = ()

    def __init__(
        self, where: str, problems: Sequence[Tuple[str, Sequence[int]]], fixes: Optional[Sequence[str]] = None
    ) -> None:
        self.problems: List[Tuple[str, List[int]]] = [(p, list(r)) for p, r in problems]
        lines = [self.HEADER.format(where=where)] + [f"  - {line}" for line in describe_failures(self.problems)]
        super().__init__("\n".join(lines + numbered(self.FIXES if fixes is None else fixes)))


class CheckpointLoadError(DCPFailure):
    """DCP's load refused the regular part of a checkpoint (another shape, a missing entry).
    DCP finds these while planning, so the model is unchanged."""

    HEADER = "{where} could not be loaded into this model (torch.distributed.checkpoint.load failed):"
    FIXES = (
        "build the model as the saving job did: the same table sizes and dims, dense layers, module names "
        "and optimizer (each line above names the entry; a size mismatch quotes both shapes)",
        "load a checkpoint saved from this model's configuration",
        "start from fresh weights instead of this checkpoint",
    )


class CheckpointSaveError(DCPFailure):
    """A save failed (e.g. a full disk); no digests record was written, so ``load`` refuses the
    partial checkpoint. Raised on every rank."""

    HEADER = "{where} was not saved:"
    FIXES = (
        "check the free space and permissions of the checkpoint directory, then save again",
        "save into another directory",
    )


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
    ``TieredCheckpointError`` / ``CheckpointLoadError``."""
    problem: Optional[str] = None
    try:
        action()
    except (TieredCheckpointError, CheckpointLoadError) as e:
        problem = str(e)
    world = rank_world(process_group)[1]
    return [(r, p) for r, p in enumerate(all_gather(problem, world, process_group)) if p is not None]


def raise_refusals(problems: List[Tuple[int, str]], outcome: str) -> None:
    """Raises every rank's refusal of :func:`refusals`, one line each, then ``outcome``, when any."""
    if problems:
        raise TieredCheckpointError("\n".join([f"rank {r}: {p}" for r, p in problems] + [outcome]))


def raise_first_refusal(problems: List[Tuple[int, str]], process_group: Optional[dist.ProcessGroup]) -> None:
    """Raises this rank's refusal of :func:`refusals` (else the first rank's), when any."""
    if problems:
        mine = dict(problems).get(rank_world(process_group)[0])
        raise TieredCheckpointError(mine if mine is not None else f"on rank {problems[0][0]}: {problems[0][1]}")
