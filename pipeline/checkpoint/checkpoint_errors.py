"""What recpipe.pipeline.checkpoint raises: one root, :class:`CheckpointError`, under which every
checkpoint failure falls, and the ``ValueError`` of a bad argument.

The refusals of the layers below (``TieredCheckpointError`` of a tiered shard,
``RowOrderMismatchError`` of a routed table, ``FileNotFoundError`` / ``NotADirectoryError``) are
raised here as subclasses of both :class:`CheckpointError` and that type, so ``except
CheckpointError`` catches every failure of a save, load or verify and the narrower type still
names the cause. Imports ``tiered.state`` and ``routing.row_order`` only.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from recpipe.pipeline.routing.row_order import RowOrderMismatchError
from recpipe.pipeline.tiered.state import TieredCheckpointError

PathLike = Union[str, "os.PathLike[str]"]

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


class CheckpointError(RuntimeError):
    """The root of every failure of a checkpoint save, load or verify: the message names the
    cause and the possible solutions. Raised on every rank of a collective call alike."""


class CheckpointIntegrityError(CheckpointError):
    """Files of a DCP checkpoint differ from its digests record, or the record is missing or
    damaged, or the directory holds a data file the record does not list (``problems``:
    ``(path, problem)`` of each bad file; ``fixes`` numbered in the message). Raised on every rank
    before anything is loaded."""

    def __init__(self, problems: Sequence[Tuple[str, str]], fixes: Sequence[str]) -> None:
        self.problems: List[Tuple[str, str]] = list(problems)
        self.fixes: Tuple[str, ...] = tuple(fixes)
        super().__init__("\n".join([f"{path}: {problem}" for path, problem in self.problems] + numbered(fixes)))


class CheckpointTableError(CheckpointError, TieredCheckpointError):
    """The checkpoint's tables do not fit this model's (kind, size, dim, optimizer), or their rows
    cannot be loaded (incomplete exports, missing, repeated or NaN / inf rows). Also a
    ``TieredCheckpointError``: the tiered layer's refusal of the same rows, raised here under the root."""


class CheckpointRowOrderError(CheckpointError, RowOrderMismatchError):
    """A routed FUSED table saved in another routing, world size or seed than this model's
    (DCP cannot reshard routed rows). Also the routing layer's ``RowOrderMismatchError``."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory does not exist (on some rank)."""


class CheckpointNotADirectoryError(CheckpointError, NotADirectoryError):
    """The checkpoint path names a file, not the directory ``save`` wrote."""


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


class DCPFailure(CheckpointError):
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
    """DCP's load refused the regular part of a checkpoint (another shape, a missing entry), or a
    strict load found entries or fused optimizer state one side lacks. Found while planning, so
    the model is unchanged."""

    HEADER = "{where} could not be loaded into this model (torch.distributed.checkpoint.load failed):"
    FIXES = (
        "build the model as the saving job did: the same table sizes and dims, dense layers, module names "
        "and optimizer (each line above names the entry; a size mismatch quotes both shapes)",
        "load a checkpoint saved from this model's configuration",
        "start from fresh weights instead of this checkpoint",
    )


class CheckpointSaveError(DCPFailure):
    """A save failed or was refused (a full disk, another save holding the directory, NaN / inf
    tiered rows); no digests record was written, so ``load`` refuses the partial checkpoint.
    Raised on every rank."""

    HEADER = "{where} was not saved:"
    FIXES = (
        "check the free space and permissions of the checkpoint directory, then save again",
        "save into another directory",
    )


def check_path(value: Any, argument: str) -> None:
    """Raises ``ValueError`` naming ``argument`` unless ``value`` is a path (str or os.PathLike)."""
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
        raise ValueError(
            f"`{argument}` must be a checkpoint directory path (str or os.PathLike), got "
            f"{type(value).__name__} {value!r}; e.g. 'ckpt/step_100'."
        )


def check_model(model: Any, where: str) -> None:
    """Raises ``ValueError`` unless ``model`` is an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"{where}: `model` must be a torch.nn.Module (e.g. the DistributedModelParallel), got "
            f"{type(model).__name__}."
        )
