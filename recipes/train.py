"""Train entry point: ``python -m recpipe.recipes.train [--config default] [--flag value ...]``.

Run under torchrun (or ``torchx run recpipe.train``) for several ranks; alone it
trains on one rank. Steps: config -> data source -> model -> :func:`shard_model`
(DMP) -> :func:`make_pipeline` -> loop of ``pipeline.progress`` with periodic
evaluation (AUROC), TensorBoard on rank 0, checkpoints and exact resume.

Example::

    torchrun --nproc-per-node 2 -m recpipe.recipes.train --config default --tb-dir runs/x
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torchmetrics.classification import BinaryAUROC
from torchrec.distributed.types import ShardingEnv
from tqdm import tqdm

from recpipe.recipes.build import make_optimizer, make_pipeline, shard_model
from recpipe.pipeline.checkpoint.dcp import CheckpointLoadError
from recpipe.pipeline.tiered.shard import TieredCheckpointError
from recpipe.planner.types import PlannerError
from recpipe.recipes.checkpoint import (
    CheckpointError,
    NonFiniteStateError,
    load_checkpoint,
    resume_step_at_or_past,
    save_checkpoint,
    step_dir_name,
)
from recpipe.recipes.config import ConfigError, TrainConfig, parse_config, split_paths
from recpipe.recipes.data.base import EVAL_PAD_LABEL, BatchSource
from recpipe.recipes.data.criteo import CriteoDataChangedError, CriteoFormatError
from recpipe.recipes.data.registry import make_data_source
from recpipe.recipes.models import build_model
from recpipe.recipes.tb_logging import RunLogger, gather_tier_stats

logger: logging.Logger = logging.getLogger("recpipe.recipes.train")


@dataclass(kw_only=True)
class TrainResult:
    """What a run reports (rank 0 also writes it to ``metrics_file`` as JSON)."""

    start_step: int
    """First step this process trained (non-zero after resume)."""
    steps: int
    """Total steps completed (including those before a resume)."""
    losses: list[float] = field(default_factory=list)
    """This rank's batch loss of every step it trained, in order."""
    evals: list[tuple[int, float]] = field(default_factory=list)
    """``(step, auroc)`` of every evaluation."""
    logged_losses: list[tuple[int, float]] = field(default_factory=list)
    """``(step, loss)`` of every logging interval: the mean over ranks and steps."""
    samples_per_s: float = float("nan")
    """Global training throughput, excluding the first logging interval (warm-up); a
    run (or resumed segment) of one interval reports that interval, warm-up included."""
    train_seconds: float = 0.0
    """Wall time of the training loop."""
    world_size: int = 1
    """Number of ranks."""
    pipeline: str = ""
    """``fused`` or ``sparse``."""
    plan_text: str = ""
    """The placement table."""
    tb_dir: str | None = None
    """TensorBoard directory (rank 0)."""

    @property
    def final_auroc(self) -> float:
        """AUROC of the last evaluation (NaN if none ran)."""
        return self.evals[-1][1] if self.evals else float("nan")

    def to_json(self) -> dict[str, Any]:
        """Strict-JSON dict including ``final_auroc``; a value not measured (NaN) is None."""
        d = dict(self.__dict__)
        d["final_auroc"] = self.final_auroc
        d["final_loss"] = self.logged_losses[-1][1] if self.logged_losses else float("nan")
        return _json_safe(d)


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN: not measured) as None, lists for tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _setup_distributed(config: TrainConfig) -> tuple[torch.device, bool]:
    """Joins (or creates) the process group; returns the device and whether we own the group.

    Raises:
        ConfigError: ``device="cuda"`` on a machine without a visible CUDA device.
    """
    want_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():  # a user error: one line, exit 2 (main)
        raise ConfigError(
            f"invalid config value device={config.device!r}: no CUDA device is visible on this machine "
            "(torch.cuda.is_available() is False). Fix: pass --device cpu (or --device auto)"
        )
    if want_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if want_cuda else "gloo"
    if dist.is_initialized():
        return device, False
    # Every collective of the group (gloo: each all-to-all, all-reduce and barrier,
    # sync or async) fails after timeout_s instead of waiting on a dead rank forever.
    timeout = datetime.timedelta(seconds=config.timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return device, True


class CollectiveFailureError(RuntimeError):
    """A collective timed out or lost its peer: another rank is dead, frozen or far behind."""


# Backend messages of a collective that waited past the group timeout (gloo:
# "Timed out waiting 10000ms for recv operation to complete", or, when the timeout
# fires while the pair is mid-operation, "Application timeout caused pair closure";
# store: "wait timeout after ...", "Socket Timeout"; NCCL's watchdog: "... collective
# operation timeout").
_TIMEOUT_MESSAGE = re.compile(
    r"timed out waiting|application timeout caused pair closure|wait timeout after|socket timeout"
    r"|collective operation timeout",
    re.IGNORECASE,
)
# gloo's messages when the peer's socket went away (the peer process died).
_PEER_LOST_MESSAGE = re.compile(r"connection (closed|reset) by peer|broken pipe", re.IGNORECASE)


def explain_collective_failure(error: BaseException, config: TrainConfig) -> CollectiveFailureError | None:
    """Turns a backend's collective timeout / lost-peer error into one that says what to do.

    Args:
        error: the exception that ended :func:`run`.
        config: the run's config (``timeout_s``).

    Returns:
        A :class:`CollectiveFailureError` naming the timeout and the likely cause, or
        ``None`` when ``error`` is not a collective timeout or a lost peer.
    """
    if not isinstance(error, RuntimeError) or isinstance(error, CollectiveFailureError):
        return None
    rank = os.environ.get("RANK", "0")
    text = str(error).strip()
    if _TIMEOUT_MESSAGE.search(text):
        return CollectiveFailureError(
            f"rank {rank}: a collective did not complete within the timeout "
            f"(--timeout-s {config.timeout_s:g}, {config.timeout_s:g} s): another rank is probably dead "
            "or frozen (stopped, swapping, stuck in a debugger or in I/O) or far slower than this one. "
            "Fix: check the other ranks' processes and logs (torchrun lists every failed rank); if a "
            f"step legitimately takes longer, raise --timeout-s. Backend error: {text}"
        )
    if _PEER_LOST_MESSAGE.search(text):
        return CollectiveFailureError(
            f"rank {rank}: a collective lost its connection to another rank, which probably crashed or "
            "was killed. Fix: read that rank's own error in its log (torchrun lists every failed rank). "
            f"Backend error: {text}"
        )
    return None


def _chunk_end(step: int, total: int, config: TrainConfig) -> int:
    """End of the training chunk that starts at ``step``: the next eval/checkpoint step."""
    end = total
    for every in (config.eval_every, config.checkpoint_every if config.checkpoint_dir else 0):
        if every:
            end = min(end, (step // every + 1) * every)
    return end


class NonFiniteLossError(FloatingPointError):
    """A training loss was NaN or inf: every rank stops, before any checkpoint of those weights."""


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def describe_batch(config: TrainConfig, source: BatchSource, index: int, rank: int, world: int) -> str:
    """Where the training batch of global step ``index`` (0-based) of ``rank`` came from.

    Args:
        config: the run's config.
        source: the run's data source (its epoch length).
        index: the batch's global step, 0-based (the batch of training step ``index + 1``).
        rank: the rank that trained it.
        world: number of ranks.

    Returns:
        The dataset, epoch and, for ``criteo_tsv``, the file(s) and line numbers of the
        rank's rows (the files are read to count lines: meant for error messages).
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
        spans, offset = [], 0
        for path in split_paths(config.data_path):
            n = _count_lines(path)
            lo, hi = max(first, offset), min(first + b, offset + n)
            if lo < hi:
                spans.append(f"{path} lines {lo - offset + 1}-{hi - offset}")
            offset += n
            if offset >= first + b:
                break
        where += f", rows {first}-{first + b - 1} of data_path: " + ", ".join(spans or ["(past the files' end)"])
    return where


class _NonFiniteGuard:
    """Stops every rank when any rank's training loss is NaN or inf.

    Each rank notes its first non-finite step from the losses the loop reads on the
    host once per logging interval (no extra sync); the ranks compare notes by an
    all-reduce at every logging interval (inside the loss reduction) and before
    every evaluation and checkpoint, so all ranks raise :class:`NonFiniteLossError`
    together and no checkpoint of bad weights is written.

    Args:
        config: the run's config.
        source: the data source (to name the bad batch).
        rank: this rank.
        world: number of ranks.
        last_checkpoint: the step of the checkpoint this run resumed from, if any.
    """

    def __init__(
        self, config: TrainConfig, source: BatchSource, rank: int, world: int, last_checkpoint: int | None
    ) -> None:
        self.config, self.source, self.rank, self.world = config, source, rank, world
        self.last_checkpoint = last_checkpoint
        self.bad_step = 0
        self.bad_loss = 0.0

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
        """Raises :class:`NonFiniteLossError` if the summed ``reduced`` slots name a bad step.

        Args:
            reduced: :meth:`slots` summed over ranks.
            now: the step training has reached.
        """
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
        if self.config.checkpoint_dir:
            saved = (
                f"the newest checkpoint in {self.config.checkpoint_dir} is step {self.last_checkpoint}"
                if self.last_checkpoint is not None
                else f"no checkpoint was written to {self.config.checkpoint_dir}"
            )
        else:
            saved = "no checkpoint directory is set"
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
    """The error of a ``--resume`` whose checkpoint is already at or past the run's last step.

    Args:
        config: the run's config.
        step: the step of the checkpoint the run would continue from.
        total: the run's last step (``max_steps``, or ``epochs`` x steps per epoch).

    Returns:
        A :class:`ConfigError` naming ``--max-steps``, the checkpoint and the fix.
    """
    assert config.checkpoint_dir is not None
    last = f"{total}" if config.max_steps is not None else f"{total} (--epochs {config.epochs})"
    more = "" if config.max_steps is not None else " (or more --epochs)"
    return ConfigError(
        f"invalid config value max_steps={config.max_steps!r}: --resume would continue from step {step} "
        f"({Path(config.checkpoint_dir) / step_dir_name(step)}), at or past the run's last step {last}, "
        f"so it would train nothing. Fix: pass --max-steps greater than {step}{more} to train further, "
        "or drop --resume"
    )


def check_batch_counts(
    config: TrainConfig, source: BatchSource, total: int, eval_count: int | None, rank: int, world: int
) -> None:
    """Refuses a run whose ranks would take different numbers of batches (one all-reduce).

    Every step runs collectives that pair the ranks' batches (the embedding all-to-alls, the
    loss reduction), so a rank that runs out of batches first leaves the others waiting in a
    collective that another one answers (gloo aborted with "Received data size doesn't match
    expected size"; torchrec's pipeline waits until the timeout). Each rank's counts come from
    its own data source: e.g. ``criteo_tsv`` counts the files each rank reads, which on several
    machines are each node's own copy of ``--data-path``.

    Args:
        config: the run's config.
        source: this rank's data source.
        total: this rank's training steps (:meth:`BatchSource.total_steps`).
        eval_count: this rank's evaluation batches (:meth:`BatchSource.eval_batch_count`).
        rank: this rank.
        world: number of ranks.

    Raises:
        ConfigError: (on every rank) the ranks' training steps or evaluation batches differ;
            the message names each rank's counts and the fix.
    """
    if world == 1:
        return
    spe = source.steps_per_epoch
    mine = (total, -1 if eval_count is None else eval_count, -1 if spe is None else spe)
    slots = torch.zeros(3 * world, dtype=torch.int64)
    for k, value in enumerate(mine):
        slots[k * world + rank] = value
    dist.all_reduce(slots)
    totals, evals, spes = (slots[k * world : (k + 1) * world].tolist() for k in range(3))
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
    fix_text = "; or ".join(dict.fromkeys(fixes))
    raise ConfigError(
        f"the {world} ranks' data (dataset {config.dataset}) give them different numbers of batches: "
        + "; ".join(problems)
        + f"{files}. Every step pairs the ranks' batches in collectives, so a rank that runs out first would "
        f"leave the others waiting. Fix: {fix_text}"
    )


class BatchCountError(RuntimeError):
    """A data source gave fewer batches than the steps it was asked for (or than the eval
    batches it announced): this rank stops before the pipeline runs a collective the other
    ranks do not."""


def exactly(batches: Iterator[Any], count: int, what: str) -> Iterator[Any]:
    """``batches``, checked to hold at least ``count`` items (at most ``count`` are taken).

    The check is local (no collective): it raises when the pipeline asks for the missing
    batch, so this rank stops with an error naming its count instead of draining its
    in-flight batches through collectives that the other ranks, which still have batches,
    answer with the next step's (the other ranks then fail with :class:`CollectiveFailureError`).

    Args:
        batches: a data source's batches.
        count: how many it must give.
        what: the batches' description for the error (rank, steps).

    Raises:
        BatchCountError: ``batches`` ended early.
    """
    n = 0
    if count > 0:
        for batch in batches:
            yield batch
            n += 1
            if n == count:
                return
    if n < count:
        raise BatchCountError(
            f"{what}: the data source gave {n} batches, not {count}; every rank must take a batch at every "
            "step (the ranks' batches are paired in collectives). Fix: make the data source give each rank "
            "the same number of batches (its train_batches(start, stop) one per step)"
        )


def evaluate(pipeline: Any, model: torch.nn.Module, batches: Iterator[Any]) -> float:
    """AUROC over ``batches`` through the pipeline in eval mode, synced across ranks.

    Args:
        pipeline: the train pipeline (its ``progress`` skips backward in eval mode).
        model: the DMP model (switched to eval and back).
        batches: this rank's eval batches (same count and size on every rank); samples
            labelled ``EVAL_PAD_LABEL`` (padding of a short last batch) are left out.

    Returns:
        The global AUROC (NaN when there were no eval batches).
    """
    metric = BinaryAUROC()
    seen = torch.zeros(1)
    model.eval()
    try:
        with torch.no_grad():
            while True:
                try:
                    _, logits, labels = pipeline.progress(batches)
                except StopIteration:
                    break
                real = labels != EVAL_PAD_LABEL  # a short last batch's padding is not evaluated
                metric.update(torch.sigmoid(logits.float())[real].cpu(), labels[real].long().cpu())
                seen += int(real.sum())
    finally:
        model.train()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(seen)
    if seen.item() == 0:
        return float("nan")
    return float(metric.compute())


class _WarningsAboveBar:
    """Routes Python warnings through ``tqdm.write`` while a drawn progress bar is open.

    A warning printed by the default handler while the bar is drawn continued the bar's
    line on the terminal (the bar has no newline until it closes). While open, this puts
    a handler in ``warnings.showwarning`` that prints the usual warning text through
    ``tqdm.write``, which clears the bar, prints the text on lines of its own and draws
    the bar again below it. :meth:`close` puts the previous handler back (unless another
    replaced this one meanwhile). A disabled bar (other ranks, ``--no-progress-bar``)
    changes nothing.

    Args:
        bar (tqdm): the progress bar (drawn on ``sys.stderr``).
    """

    def __init__(self, bar: tqdm) -> None:
        self._previous: Any = None
        self._installed = False
        if not bar.disable:
            self._previous = warnings.showwarning
            warnings.showwarning = self._show
            self._installed = True

    @staticmethod
    def _show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        text = warnings.formatwarning(message, category, filename, lineno, line)
        tqdm.write(text.rstrip("\n"), file=sys.stderr if file is None else file)

    def close(self) -> None:
        """Puts the previous ``warnings.showwarning`` back (idempotent)."""
        if self._installed:
            self._installed = False
            if warnings.showwarning is self._show:
                warnings.showwarning = self._previous


def run(config: TrainConfig) -> TrainResult:
    """Trains with ``config`` on this process's rank.

    Args:
        config: validated config.

    Returns:
        This rank's :class:`TrainResult`.

    Raises:
        ConfigError: found once the run starts, before the model is built: ``--device
            cuda`` without a CUDA device, Criteo files or MovieLens splits smaller than one
            global batch, ranks whose data give different numbers of training steps or
            evaluation batches (:func:`check_batch_counts`), or ``--resume`` from a
            checkpoint at or past the run's last step.
        BatchCountError: the data source gave this rank fewer batches than asked for.
    """
    torch.set_num_threads(config.num_threads)
    device, own_group = _setup_distributed(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    tb = RunLogger(None)  # opened once the first step is known (a resume purges what follows it)
    bar: tqdm | None = None  # closed on every exit path, so an error line starts on a line of its own
    above_bar: _WarningsAboveBar | None = None  # warnings printed through the open bar, closed with it
    try:
        source = make_data_source(config, rank, world)
        total = source.total_steps()
        eval_count = source.eval_batch_count()
        check_batch_counts(config, source, total, eval_count, rank, world)  # a collective, once
        if config.resume:  # before building anything: a run past its end would train nothing
            assert config.checkpoint_dir is not None
            saved = resume_step_at_or_past(config.checkpoint_dir, total)
            if saved is not None:
                raise nothing_to_train(config, saved, total)
        torch.manual_seed(config.seed)  # same dense init and table init on every rank
        model = build_model(config, source.spec, dense_device=device)
        sharded = shard_model(config, model, ShardingEnv.from_process_group(dist.group.WORLD), device)
        dmp = sharded.model
        optimizer = make_optimizer(config, dmp)
        start = 0
        if config.resume:
            assert config.checkpoint_dir is not None
            start = load_checkpoint(config.checkpoint_dir, dmp, optimizer, config, sharded.table_ranks)
        pipeline = make_pipeline(config, dmp, optimizer, device)
        # rank 0 only; after a resume, events an earlier run logged past the checkpoint
        # (it failed or was stopped later) are dropped: steps stay increasing, no duplicates
        tb = RunLogger(config.tb_dir if rank == 0 else None, purge_step=start + 1 if config.resume else None)
        guard = _NonFiniteGuard(config, source, rank, world, start if config.resume else None)
        result = TrainResult(
            start_step=start,
            steps=start,
            world_size=world,
            pipeline=config.pipeline,
            plan_text=sharded.plan_text,
            tb_dir=config.tb_dir,
        )
        tb.text("placement/plan", sharded.plan_text, step=start)
        if rank == 0:
            plan_lines = "\n".join(f"[recpipe]   {line}" for line in sharded.plan_text.splitlines())
            print(f"[recpipe] placement plan ({world} ranks):\n{plan_lines}", flush=True)
        global_batch = config.batch_size * world
        bar = tqdm(
            total=total,
            initial=start,
            disable=rank != 0 or not config.progress_bar,
            desc="train",
            unit="step",
            mininterval=1.0,
            file=sys.stderr,
        )
        above_bar = _WarningsAboveBar(bar)
        step = start
        pending: list[torch.Tensor] = []  # losses of the steps up to ``step`` not yet read

        def say(line: str) -> None:
            """Prints a line of rank 0's log on stdout; while the bar is drawn, through
            ``tqdm.write``, which clears the bar first and redraws it below the line (a plain
            print on a terminal continued the bar's line)."""
            if bar is not None and not bar.disable:
                tqdm.write(line, file=sys.stdout)
                sys.stdout.flush()
            else:
                print(line, flush=True)

        def read_losses(last: int, total_loss: float) -> float:
            """Reads the pending losses (steps up to ``last``) on the host in one transfer,
            records them, notes a non-finite one for the guard; returns ``total_loss`` plus
            them (added one by one, in step order)."""
            values = torch.stack(pending).tolist() if pending else []
            for k, value in enumerate(values):
                result.losses.append(value)
                guard.observe(last - len(values) + 1 + k, value)
                total_loss += value
            pending.clear()
            return total_loss

        loop_t0 = time.perf_counter()
        interval_t0, interval_loss, interval_n = loop_t0, 0.0, 0
        timed_steps, timed_seconds, first_interval = 0, 0.0, True
        warm_steps, warm_seconds = 0, 0.0  # the first logging interval (warm-up)

        def log_interval() -> None:
            """Ends the logging interval at ``step``: the mean loss over ranks and its
            steps, throughput and tier stats to TensorBoard and the console (collectives:
            every rank calls it at the same step)."""
            nonlocal interval_t0, interval_loss, interval_n, timed_steps, timed_seconds
            nonlocal first_interval, warm_steps, warm_seconds
            interval_loss = read_losses(step, interval_loss)
            now = time.perf_counter()
            stats = torch.tensor([interval_loss, float(interval_n), *guard.slots()], dtype=torch.float64)
            if world > 1:
                dist.all_reduce(stats)
            guard.check(stats[2:].tolist(), step)
            dt = now - interval_t0
            mean_loss = float(stats[0] / stats[1])
            result.logged_losses.append((step, mean_loss))
            sps = global_batch * interval_n / dt
            if not first_interval:
                timed_steps += interval_n
                timed_seconds += dt
            else:
                warm_steps, warm_seconds = interval_n, dt
            first_interval = False
            tb.scalars(
                step,
                {
                    "train/loss": mean_loss,
                    "train/samples_per_s": sps,
                    "train/step_ms": 1000.0 * dt / interval_n,
                },
            )
            if config.tb_dir:  # a collective: every rank has the same config
                tb.tier_stats(step, gather_tier_stats(dmp))
            if bar is not None:
                bar.set_postfix(loss=f"{mean_loss:.4f}", sps=f"{sps:.0f}")
            if rank == 0:
                say(
                    f"[recpipe] step {step}/{total} loss {mean_loss:.4f} "
                    f"{sps:.0f} samples/s {1000.0 * dt / interval_n:.1f} ms/step"
                )
            interval_t0, interval_loss, interval_n = time.perf_counter(), 0.0, 0

        while step < total:
            end = _chunk_end(step, total, config)
            batches = exactly(
                source.train_batches(step, end), end - step, f"rank {rank}, training steps {step + 1}..{end}"
            )
            while True:
                try:
                    loss, _, _ = pipeline.progress(batches)
                except StopIteration:
                    break
                # read on the host once per logging interval, not every step (on CUDA a read
                # waits for the step's kernels and stops the host from running ahead)
                pending.append(loss.detach())
                step += 1
                bar.update(1)
                interval_n += 1
                if step % config.log_every == 0 or step == total:
                    log_interval()
            is_last = step >= total
            saves = bool(config.checkpoint_dir) and (
                is_last or bool(config.checkpoint_every and step % config.checkpoint_every == 0)
            )
            if saves and interval_n:
                # a checkpoint ends a logging interval: a run resumed from it logs the steps
                # and values an uninterrupted run logs (not one interval split in two)
                log_interval()
            interval_loss = read_losses(step, interval_loss)
            result.steps = step
            # evaluation and checkpointing are not training time: the logging interval's
            # clock pauses here (they may fall mid-interval) and resumes after them
            paused_at = time.perf_counter()
            guard.sync_and_check(step)  # before evaluating or checkpointing these weights
            if (config.eval_every and step % config.eval_every == 0) or is_last:
                eval_batches = source.eval_batches()
                if eval_count is not None:  # the count every rank announced at start
                    eval_batches = exactly(eval_batches, eval_count, f"rank {rank}, evaluation at step {step}")
                auroc = evaluate(pipeline, dmp, eval_batches)
                result.evals.append((step, auroc))
                if auroc == auroc:  # not NaN
                    tb.scalars(step, {"eval/auroc": auroc})
                if rank == 0:
                    say(f"[recpipe] eval at step {step}: auroc {auroc:.4f}")
            if saves:
                assert config.checkpoint_dir is not None
                save_checkpoint(
                    config.checkpoint_dir, step, dmp, optimizer, config, sharded.table_ranks
                )
                guard.last_checkpoint = step
            tb.flush()
            interval_t0 += time.perf_counter() - paused_at
        above_bar.close()  # warnings print as usual again
        bar.close()  # before the final lines below (closing again in ``finally`` is a no-op)
        result.train_seconds = time.perf_counter() - loop_t0
        if timed_steps:
            result.samples_per_s = global_batch * timed_steps / timed_seconds
        elif warm_steps:  # one logging interval only: its time, warm-up included
            result.samples_per_s = global_batch * warm_steps / warm_seconds
        if rank == 0 and config.metrics_file:
            Path(config.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            Path(config.metrics_file).write_text(json.dumps(result.to_json(), indent=1, allow_nan=False))
        return result
    finally:
        if above_bar is not None:
            above_bar.close()
        if bar is not None:
            bar.close()
        tb.close()
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


# Failures a user acts on from the message alone (the README's "Faults and bad input"
# table): the entry point prints them as one line and exits 1; anything else is a bug
# and keeps its traceback.
USER_FACING_ERRORS: tuple[type[BaseException], ...] = (
    CheckpointError,  # corrupt / mismatched / no intact checkpoint, a failed write
    NonFiniteLossError,
    NonFiniteStateError,
    CriteoFormatError,
    CriteoDataChangedError,  # a Criteo file shrank or vanished while the run read it
    TieredCheckpointError,
    CheckpointLoadError,  # DCP refused a dcp checkpoint's regular state (see recpipe.pipeline.checkpoint.dcp)
    PlannerError,  # the planned placement does not fit the budgets (--fast-tier-mb / --slow-tier-mb)
    BatchCountError,  # a data source gave a rank fewer batches than the steps asked for
)


def _print_error(e: BaseException) -> None:
    """One ``error:`` line on stderr; under torchrun also torchelastic's error file
    (``TORCHELASTIC_ERROR_FILE``, the JSON ``@record`` writes), so torchrun / torchx
    report the message as the job's failure, with the message in place of a call stack."""
    message = f"{type(e).__name__}: {e}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        info = {"py_callstack": message, "timestamp": str(int(time.time()))}
        Path(error_file).write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    rank = os.environ.get("RANK")
    where = f"rank {rank}: " if rank is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    print(f"error: {where}{message}", file=sys.stderr, flush=True)


class _DropPrefix(logging.Filter):
    """Drops log records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def _quiet_upstream_notices() -> None:
    """Drops two upstream notices every run printed once per rank, which a recipe user
    cannot act on: torchrec 1.9.2's DMP passes DDP the ``broadcast_buffers`` argument
    that torch 2.14 deprecates (a FutureWarning), and torchrec's modules call torch's
    ``is_fx_tracing`` (a logged warning). Only these exact messages, and only in the
    recipe's entry point: library users of recpipe keep every upstream warning."""
    warnings.filterwarnings("ignore", message=re.escape("`broadcast_buffers` is deprecated"), category=FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").addFilter(_DropPrefix("is_fx_tracing will return true"))


@record
def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (errors are recorded for torchrun / torchx to surface).

    Args:
        argv: CLI arguments (default ``sys.argv[1:]``).

    Returns:
        Process exit code (0 on success, 2 for a bad command line or config, also one
        found once the data or checkpoint is read, 1 for a failure of
        ``USER_FACING_ERRORS`` or a collective (printed as one line)).
    """
    _quiet_upstream_notices()
    try:
        config = parse_config(argv)
    except ConfigError as e:  # a user error: one message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run(config)
    except ConfigError as e:  # e.g. a data file smaller than one global batch: one line, no traceback
        _print_error(e)
        return 2
    except USER_FACING_ERRORS as e:  # their message names the cause and the fix: no traceback
        _print_error(e)
        return 1
    except RuntimeError as e:
        explained = explain_collective_failure(e, config)
        if explained is None:
            raise
        _print_error(explained)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"[recpipe] done: {result.steps} steps, final auroc {result.final_auroc:.4f}, "
            f"{result.samples_per_s:.0f} samples/s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
