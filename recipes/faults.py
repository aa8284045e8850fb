"""Run-time refusals of :mod:`recpipe.recipes.train`, with messages naming cause and fix, and
which failures the entry point prints as one line (:func:`user_facing_error`).

Collective timeouts / lost peers, non-finite losses, unequal batch counts across ranks,
data sources that end early, a ``--resume`` with nothing left to train. May import
recipes' config, data and checkpoint modules, ``recpipe.pipeline.checkpoint`` and the
planner's errors.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from recpipe.pipeline.checkpoint import CheckpointError
from recpipe.planner.errors import PlacementPlannerError
from recpipe.recipes.checkpoint_policy import step_dir_name
from recpipe.recipes.config import ConfigError, TrainConfig, split_paths
from recpipe.recipes.data.base import BatchSource, DataFormatError
from recpipe.recipes.data.criteo import CriteoDataChangedError, count_file_rows


class CollectiveFailureError(RuntimeError):
    """A collective timed out or lost its peer: another rank is dead, frozen or far behind."""


# Backend messages of a collective that waited past the group timeout (gloo, store, NCCL watchdog).
_TIMEOUT_MESSAGE = re.compile(
    r"timed out waiting|application timeout caused pair closure|wait timeout after|socket timeout"
    r"|collective operation timeout",
    re.IGNORECASE,
)
# gloo's messages when the peer's socket went away (the peer process died).
_PEER_LOST_MESSAGE = re.compile(r"connection (closed|reset) by peer|broken pipe", re.IGNORECASE)


def explain_collective_failure(error: BaseException, config: TrainConfig) -> CollectiveFailureError | None:
    """A :class:`CollectiveFailureError` saying what to do for a collective timeout / lost peer, else None."""
    if not isinstance(error, RuntimeError) or isinstance(error, CollectiveFailureError):
        return None
    rank = os.environ.get("RANK", "0")
    text = str(error).strip()
    if _TIMEOUT_MESSAGE.search(text):
        return CollectiveFailureError(
            f"rank {rank}: a collective did not complete within the timeout (--timeout-s {config.timeout_s:g}, "
            f"{config.timeout_s:g} s): another rank is probably dead or frozen (stopped, swapping, stuck in a debugger "
            "or in I/O) or far slower than this one. Fix: check the other ranks' processes and logs (torchrun lists "
            f"every failed rank); if a step legitimately takes longer, raise --timeout-s. Backend error: {text}"
        )
    if _PEER_LOST_MESSAGE.search(text):
        return CollectiveFailureError(
            f"rank {rank}: a collective lost its connection to another rank, which probably crashed or was killed. "
            f"Fix: read that rank's own error in its log (torchrun lists every failed rank). Backend error: {text}"
        )
    return None


class NonFiniteLossError(FloatingPointError):
    """A training loss was NaN or inf: every rank stops, before any checkpoint of those weights."""


def describe_batch(config: TrainConfig, source: BatchSource, index: int, rank: int, world: int) -> str:
    """Where ``rank``'s batch of global step ``index`` (0-based) came from, for error messages.

    Names the dataset, epoch and, for ``criteo_tsv``, the files and lines (read to count them).
    """
    spe = source.steps_per_epoch
    where = f"dataset {config.dataset}, rank {rank}'s slice of global batch {index} (0-based)"
    if spe:
        where += f" = batch {index % spe} of epoch {index // spe}"
    if config.dataset == "synthetic":
        where += f", stream seed {config.seed}"
    if config.dataset == "criteo_tsv" and config.data_path:
        b = config.batch_size
        first = ((index % spe) if spe else index) * b * world + rank * b  # 0-based row over data_path
        spans, offset, paths = [], 0, split_paths(config.data_path)
        for path, n in zip(paths, count_file_rows(paths, first + b)):  # the files up to the batch's last row
            lo, hi = max(first, offset), min(first + b, offset + n)
            if lo < hi:
                spans.append(f"{path} lines {lo - offset + 1}-{hi - offset}")
            offset += n
        where += f", rows {first}-{first + b - 1} of data_path: " + ", ".join(spans or ["(past the files' end)"])
    return where


class NonFiniteGuard:
    """Stops every rank when any rank's training loss is NaN or inf.

    Each rank notes its first non-finite step from the losses read once per logging
    interval; the ranks compare notes in an all-reduce at every interval and before every
    evaluation and checkpoint, so all raise :class:`NonFiniteLossError` together and no
    checkpoint of bad weights is written.
    """

    def __init__(
        self, config: TrainConfig, source: BatchSource, rank: int, world: int, last_checkpoint: int | None
    ) -> None:
        self.config, self.source, self.rank, self.world = config, source, rank, world
        self.last_checkpoint = last_checkpoint  # the newest checkpoint's step: resumed from or saved (None: none)
        self.bad_step, self.bad_loss = 0, 0.0  # this rank's first non-finite step (0: none) and its loss

    def observe(self, step: int, loss: float) -> None:
        """Notes ``loss`` of training step ``step`` (1-based)."""
        if not self.bad_step and not math.isfinite(loss):
            self.bad_step, self.bad_loss = step, loss

    def slots(self) -> list[float]:
        """This rank's note as ``2 * world`` floats to sum over ranks (steps, then losses)."""
        out = [0.0] * (2 * self.world)
        if self.bad_step:
            out[self.rank], out[self.world + self.rank] = float(self.bad_step), self.bad_loss
        return out

    def sync_and_check(self, now: int) -> None:
        """All-reduces the notes (a collective) and raises if any rank saw a non-finite loss."""
        slots = torch.tensor(self.slots(), dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(slots)
        self.check(slots.tolist(), now)

    def check(self, reduced: list[float], now: int) -> None:
        """Raises :class:`NonFiniteLossError` if ``reduced`` (:meth:`slots` summed over ranks) names a bad step."""
        w = self.world
        bad = sorted((int(s), r) for r, s in enumerate(reduced[:w]) if s)
        if not bad:
            return
        lines = [
            f"  rank {r}: loss {reduced[w + r]} first at step {s}; batch: "
            f"{describe_batch(self.config, self.source, s - 1, r, w)}"
            + (" (later than the first: NaN may have spread through the shared weights)" if s > bad[0][0] else "")
            for s, r in bad[:4]
        ]
        saved = "no checkpoint directory is set"
        if self.config.checkpoint_dir and self.last_checkpoint is not None:
            saved = f"the newest checkpoint in {self.config.checkpoint_dir} is step {self.last_checkpoint}"
        elif self.config.checkpoint_dir:
            saved = f"no checkpoint was written to {self.config.checkpoint_dir}"
        raise NonFiniteLossError(
            f"non-finite training loss at step {bad[0][0]} on rank {bad[0][1]} (dataset {self.config.dataset}); "
            f"all {w} rank(s) stopped at step {now}, before any checkpoint of these weights ({saved}):\n"
            + "\n".join(lines)
            + "\nPossible solutions:\n"
            "  1. check the batch's rows for huge or malformed values (a dense value that overflows float32)\n"
            "  2. if the loss diverged, lower --dense-lr / --embedding-lr\n"
            "  3. then resume from the last good checkpoint (--resume)"
        )


def nothing_to_train(config: TrainConfig, step: int, total: int) -> ConfigError:
    """The error of a ``--resume`` whose checkpoint ``step`` is at or past the run's last step ``total``."""
    assert config.checkpoint_dir is not None
    last = f"{total}" if config.max_steps is not None else f"{total} (--epochs {config.epochs})"
    more = "" if config.max_steps is not None else " (or more --epochs)"
    return ConfigError(
        f"invalid config value max_steps={config.max_steps!r}: --resume would continue from step {step} "
        f"({Path(config.checkpoint_dir) / step_dir_name(step)}), at or past the run's last step {last}, so it "
        f"would train nothing. Fix: pass --max-steps greater than {step}{more} to train further, or drop --resume"
    )


def check_batch_counts(
    config: TrainConfig, source: BatchSource, total: int, eval_count: int | None, rank: int, world: int
) -> None:
    """Refuses (on every rank) a run whose ranks would take different numbers of batches.

    Every step pairs the ranks' batches in collectives, so a rank that runs out first leaves
    the others waiting (gloo aborts with a size mismatch; torchrec waits for the timeout).
    Each rank counts its own source (e.g. each node's copy of ``--data-path``).
    """
    if world == 1:
        return
    spe = source.steps_per_epoch
    mine = (total, -1 if eval_count is None else eval_count, -1 if spe is None else spe)
    slots = torch.zeros(3, world, dtype=torch.int64)  # every rank fills its column
    slots[:, rank] = torch.tensor(mine)
    dist.all_reduce(slots)
    totals, evals, spes = slots.tolist()
    known_evals = [n for n in evals if n >= 0]
    if len(set(totals)) == 1 and len(set(known_evals)) <= 1:
        return

    def per_rank(counts: list[int]) -> str:
        return ", ".join(f"rank {r}: {'unknown' if n < 0 else n}" for r, n in enumerate(counts))

    problems, fixes = [], []
    files = ""
    if config.dataset == "criteo_tsv":
        files = (
            " (each rank counts the rows of the files it reads: on several machines each node reads its "
            "own copy of the files, which must be identical)"
        )
    if len(set(totals)) > 1:
        what = f"training steps {per_rank(totals)}"
        if config.max_steps is None and min(spes) >= 0:
            what += f" (--epochs {config.epochs} x steps per epoch {per_rank(spes)})"
        problems.append(what)
        if config.dataset == "criteo_tsv":
            fixes.append("give every rank the same --data-path rows")
        if config.max_steps is None:
            fixes.append(f"pass --max-steps {min(totals)} (every rank then trains that many steps)")
    if len(set(known_evals)) > 1:
        problems.append(f"evaluation batches {per_rank(evals)}")
        if config.dataset == "criteo_tsv":
            fixes.append(f"give every rank the same --{'eval-' if config.eval_data_path else ''}data-path rows")
        fixes.append(f"pass --eval-batches {min(known_evals)}")
    if not fixes:
        fixes.append(f"make dataset {config.dataset}'s source give every rank the same number of batches")
    raise ConfigError(
        f"the {world} ranks' data (dataset {config.dataset}) give them different numbers of batches: "
        + "; ".join(problems)
        + f"{files}. Every step pairs the ranks' batches in collectives, so a rank that runs out first would "
        f"leave the others waiting. Fix: {'; or '.join(dict.fromkeys(fixes))}"
    )


class BatchCountError(RuntimeError):
    """A data source gave fewer batches than asked for: this rank stops before an unmatched collective."""


def exactly(batches: Iterator[Any], count: int, what: str) -> Iterator[Any]:
    """The first ``count`` of ``batches``; raises :class:`BatchCountError` (no collective) if they end early.

    Raising locally names this rank's count, instead of draining in-flight batches through
    collectives the other ranks answer with their next step's.
    """
    n = 0
    for batch in itertools.islice(batches, max(count, 0)):  # never pulls a batch past the count
        yield batch
        n += 1
    if n < count:
        raise BatchCountError(
            f"{what}: the data source gave {n} batches, not {count}; every rank must take a batch at every "
            "step (the ranks' batches are paired in collectives). Fix: make the data source give each rank "
            "the same number of batches (its train_batches(start, stop) one per step)"
        )


# Failures a user acts on from the message alone: printed as one line, exit 1 (others keep
# their traceback).
USER_FACING_ERRORS: tuple[type[BaseException], ...] = (
    CheckpointError,  # every checkpoint failure: damaged, mismatched, refused, not written, none intact
    NonFiniteLossError,
    DataFormatError,  # a Criteo or MovieLens row that breaks its format (file, line, column, value)
    CriteoDataChangedError,  # a Criteo file shrank or vanished while the run read it
    PlacementPlannerError,  # the planned placement does not fit the budgets (--fast-tier-mb / --slow-tier-mb)
    BatchCountError,  # a data source gave a rank fewer batches than the steps asked for
)


def user_facing_error(error: BaseException, config: TrainConfig) -> BaseException | None:
    """What the entry point prints as one ``error:`` line for a failed run: ``error`` itself when it
    is one of :data:`USER_FACING_ERRORS`, a :class:`CollectiveFailureError` explaining a collective
    timeout or lost peer, else None (the failure keeps its traceback)."""
    if isinstance(error, USER_FACING_ERRORS):
        return error
    return explain_collective_failure(error, config)
