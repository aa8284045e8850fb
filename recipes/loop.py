"""The training loop of one run (:class:`TrainLoop`) and what it reports (:class:`TrainResult`).

May import recipes' config, data, faults and tb_logging modules, and recpipe.pipeline's public names.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torchmetrics.classification import BinaryAUROC
from tqdm import tqdm

from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data.base import EVAL_PAD_LABEL, BatchSource
from recpipe.recipes.faults import NonFiniteGuard, exactly
from recpipe.recipes.tb_logging import RunLogger, gather_tier_stats


@dataclass(kw_only=True)
class TrainResult:
    """What a run reports (rank 0 also writes it to ``metrics_file`` as JSON)."""

    start_step: int  # first step this process trained (non-zero after resume)
    steps: int  # total steps completed, including those before a resume
    losses: list[float] = field(default_factory=list)  # this rank's loss of every step it trained
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, auroc)
    logged_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, mean over ranks and interval)
    samples_per_s: float = float("nan")
    """Global training throughput without the first (warm-up) logging interval, unless it is the only one."""
    train_seconds: float = 0.0  # wall time of the training loop
    eval_samples_per_s: float = float("nan")
    """Global evaluation throughput: every evaluation's samples on all ranks (padding left out) over the wall
    seconds spent in :func:`evaluate` (NaN: no evaluation, or none had samples)."""
    world_size: int = 1
    pipeline: str = ""
    plan_text: str = ""  # the placement table
    tb_dir: str | None = None

    @property
    def final_auroc(self) -> float:
        """AUROC of the last evaluation (NaN if none ran)."""
        return self.evals[-1][1] if self.evals else float("nan")

    def to_json(self) -> dict[str, Any]:
        """Strict-JSON dict including ``final_auroc``; a value not measured (NaN) is None."""
        final_loss = self.logged_losses[-1][1] if self.logged_losses else float("nan")
        return _json_safe(self.__dict__ | {"final_auroc": self.final_auroc, "final_loss": final_loss})


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN: not measured) as None, lists for tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def pipeline_staleness(pipeline: Any) -> int:
    """Steps by which the tables the next ``pipeline.progress()`` batch was looked up from lag the exact
    pipelines': 1 when ``TrainPipelineSemiSync`` looked it up before the previous batch's backward (its
    context's ``semi_sync_lookup``), else 0 (every batch of the exact pipelines; the synchronous phase; the
    first batch after an evaluation or checkpoint, looked up once the previous batch's update is done)."""
    contexts = getattr(pipeline, "contexts", None)
    if not contexts:
        return 0
    return int(bool(getattr(contexts[0], "semi_sync_lookup", False)))


def number_batches_from(pipeline: Any, step: int) -> None:
    """Numbers the next batch of a drained ``TrainPipelineSemiSync`` ``step`` (its global step, 0-based).

    Its ``start_batch`` compares a batch's index, which torchrec's pipelines number per context created;
    draining at an evaluation or checkpoint step skips numbers, and a resumed run starts
    from 0. Renumbering each chunk from the global step starts the semi-sync phase at step
    ``semi_sync_start_batch`` in every run, resumed or not. Other pipelines ignore the index.
    """
    from recpipe.pipeline import TrainPipelineSemiSync

    if isinstance(pipeline, TrainPipelineSemiSync) and not pipeline.contexts:
        pipeline.number_next_batch(step)


def _chunk_end(step: int, total: int, config: TrainConfig) -> int:
    """End of the training chunk that starts at ``step``: the next eval/checkpoint step."""
    periods = (config.eval_every, config.checkpoint_every if config.checkpoint_dir else 0)
    return min([total] + [(step // every + 1) * every for every in periods if every])


def evaluate(pipeline: Any, eval_pipeline: Any, model: torch.nn.Module, batches: Iterator[Any]) -> tuple[float, int]:
    """Global AUROC over ``batches`` through ``eval_pipeline`` in eval mode, and the samples it covered.

    Args:
        pipeline: the train pipeline, detached from ``model`` while ``eval_pipeline`` evaluates
            (its next ``progress()`` attaches it again).
        eval_pipeline: ``EvalPipelinePrefetch`` or :class:`PlainEvalLoop` (:func:`make_eval_pipeline`): its
            ``progress(batches)`` gives a batch's ``(loss, logits, labels)``; detached at the end.
        batches: this rank's eval batches (same count and size on every rank); samples
            labelled ``EVAL_PAD_LABEL`` are left out.

    Returns:
        ``(auroc, samples)``: the AUROC (NaN without samples) and the samples of all ranks it covered.
    """
    metric = BinaryAUROC()
    seen = torch.zeros(1)
    model.eval()
    pipeline.detach()
    try:
        while True:
            try:
                _, logits, labels = eval_pipeline.progress(batches)
            except StopIteration:
                break
            real = labels != EVAL_PAD_LABEL
            metric.update(torch.sigmoid(logits.float())[real].cpu(), labels[real].long().cpu())
            seen += int(real.sum())
    finally:
        eval_pipeline.detach()
        model.train()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(seen)
    samples = int(seen.item())
    return (float(metric.compute()) if samples else float("nan")), samples


class PlainEvalLoop:
    """``--eval-pipeline plain``: ``model(batch)`` per batch under ``torch.no_grad()``, nothing prefetched.

    Has the two methods :func:`evaluate` calls on an ``EvalPipelinePrefetch`` and gives the same outputs
    bit for bit (that pipeline runs the model's own forward on lookups it issued early).

    Args:
        model: the sharded model; its forward returns ``(loss, output)`` (``DLRMTrain``'s output:
            ``(loss, logits, labels)``).
        device: the compute device the batches are copied to.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device

    def progress(self, batches: Iterator[Any]) -> Any:
        """The model's output for the next batch of ``batches``.

        Raises:
            StopIteration: ``batches`` is exhausted.
        """
        batch = next(batches).to(self.device, non_blocking=True)
        with torch.no_grad():
            _, output = self.model(batch)
        return output

    def detach(self) -> torch.nn.Module:
        """The model (nothing was rewritten to give back)."""
        return self.model


def make_eval_pipeline(config: TrainConfig, model: torch.nn.Module) -> Any:
    """The ``config.eval_pipeline`` of ``model`` on its compute device: ``EvalPipelinePrefetch`` or
    :class:`PlainEvalLoop`."""
    device = getattr(model, "device", None)  # DistributedModelParallel's compute device
    if not isinstance(device, torch.device):
        device = next(model.parameters()).device
    if config.eval_pipeline == "plain":
        return PlainEvalLoop(model, device)
    from recpipe.pipeline import EvalPipelinePrefetch

    return EvalPipelinePrefetch(model, device)


class _WarningsAboveBar:
    """Routes Python warnings through ``tqdm.write`` while a drawn progress bar is open.

    A plain warning would continue the bar's line on the terminal; ``tqdm.write`` prints it
    above the bar. A disabled bar changes nothing.
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


@dataclass(kw_only=True, eq=False)
class TrainLoop:
    """Trains from ``result.start_step`` to ``total``, logging, evaluating and saving.

    Losses stay on the device until the end of a logging interval (a read on CUDA would
    stall the host); every rank runs the interval's collectives at the same step.
    Evaluation and checkpointing pause the interval's clock.
    """

    config: TrainConfig
    source: BatchSource
    pipeline: Any
    model: torch.nn.Module
    result: TrainResult
    tb: RunLogger
    guard: NonFiniteGuard
    total: int
    eval_count: int | None  # evaluation batches every rank announced (None: unknown)
    save: Callable[[int], None]  # writes the checkpoint of a step (called on every rank)
    eval_pipeline: Any = None  # make_eval_pipeline's; None: built at the first evaluation

    def __post_init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.global_batch = self.config.batch_size * self.world
        self.step = self.result.start_step
        self.pending: list[torch.Tensor] = []  # losses of the steps up to ``step`` not yet read
        self.bar = tqdm(
            total=self.total,
            initial=self.step,
            disable=self.rank != 0 or not self.config.progress_bar,
            desc="train",
            unit="step",
            mininterval=1.0,
            file=sys.stderr,
        )
        self.above_bar = _WarningsAboveBar(self.bar)
        # the open logging interval: start time (s), summed loss and steps
        self.interval_t0, self.interval_loss, self.interval_n = 0.0, 0.0, 0
        # throughput: every interval after the first (timed), and the first (warm-up)
        self.timed_steps, self.timed_seconds = 0, 0.0
        self.warm_steps, self.warm_seconds = 0, 0.0
        # evaluation throughput: samples (all ranks) and wall seconds of every evaluate()
        self.eval_samples, self.eval_seconds = 0, 0.0

    def run(self) -> None:
        """Trains every remaining step, then fills in the result's time and throughput."""
        loop_t0 = time.perf_counter()
        self.interval_t0 = loop_t0
        while self.step < self.total:
            self._train_chunk(_chunk_end(self.step, self.total, self.config))
            self._end_chunk()
        self.close()  # before the final lines of the run
        self.result.train_seconds = time.perf_counter() - loop_t0
        if self.timed_steps:
            self.result.samples_per_s = self.global_batch * self.timed_steps / self.timed_seconds
        elif self.warm_steps:  # one logging interval only: its time, warm-up included
            self.result.samples_per_s = self.global_batch * self.warm_steps / self.warm_seconds

    def close(self) -> None:
        """Closes the progress bar and restores the warning handler (idempotent)."""
        self.above_bar.close()
        self.bar.close()

    def say(self, line: str) -> None:
        """Prints a line of rank 0's log on stdout (above the bar while it is drawn)."""
        if not self.bar.disable:
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def _train_chunk(self, end: int) -> None:
        """Runs the steps up to ``end``, ending a logging interval where one is due."""
        batches = exactly(
            self.source.train_batches(self.step, end),
            end - self.step,
            f"rank {self.rank}, training steps {self.step + 1}..{end}",
        )
        number_batches_from(self.pipeline, self.step)
        while True:
            staleness = pipeline_staleness(self.pipeline)  # of the batch the next progress() trains
            try:
                loss, _, _ = self.pipeline.progress(batches)
            except StopIteration:
                break
            self.pending.append(loss.detach())
            self.step += 1
            self.tb.scalars(self.step, {"train/staleness": float(staleness)})
            self.bar.update(1)
            self.interval_n += 1
            if self.step % self.config.log_every == 0 or self.step == self.total:
                self._log_interval()

    def _end_chunk(self) -> None:
        """At an evaluation / checkpoint step (or the last): checks the losses, evaluates, saves."""
        config, step = self.config, self.step
        is_last = step >= self.total
        saves = bool(config.checkpoint_dir) and (
            is_last or bool(config.checkpoint_every and step % config.checkpoint_every == 0)
        )
        if saves and self.interval_n:
            # a checkpoint ends a logging interval: a run resumed from it logs the steps
            # and values an uninterrupted run logs (not one interval split in two)
            self._log_interval()
        self._read_losses()
        self.result.steps = step
        paused_at = time.perf_counter()  # the interval's clock pauses until training goes on
        self.guard.sync_and_check(step)  # before evaluating or checkpointing these weights
        if (config.eval_every and step % config.eval_every == 0) or is_last:
            self._evaluate(step)
        if saves:
            self.save(step)
            self.guard.last_checkpoint = step
        self.tb.flush()
        self.interval_t0 += time.perf_counter() - paused_at

    def _read_losses(self) -> None:
        """Reads the pending losses (steps up to ``step``) in one transfer into the result and the interval."""
        values = torch.stack(self.pending).tolist() if self.pending else []
        for k, value in enumerate(values):
            self.guard.observe(self.step - len(values) + 1 + k, value)
            self.interval_loss += value
        self.result.losses += values
        self.pending.clear()

    def _log_interval(self) -> None:
        """Ends the logging interval at ``step`` (collectives: every rank calls it at the same step)."""
        self._read_losses()
        now = time.perf_counter()
        stats = torch.tensor([self.interval_loss, float(self.interval_n), *self.guard.slots()], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(stats)
        self.guard.check(stats[2:].tolist(), self.step)
        dt = now - self.interval_t0
        mean_loss = float(stats[0] / stats[1])
        self.result.logged_losses.append((self.step, mean_loss))
        if self.warm_steps:  # every interval has a step: the first is past
            self.timed_steps += self.interval_n
            self.timed_seconds += dt
        else:
            self.warm_steps, self.warm_seconds = self.interval_n, dt
        self._report_interval(mean_loss, dt)
        self.interval_t0, self.interval_loss, self.interval_n = time.perf_counter(), 0.0, 0

    def _report_interval(self, mean_loss: float, dt: float) -> None:
        """Writes an interval's loss, throughput and tier stats (a collective) to TensorBoard and the console."""
        sps = self.global_batch * self.interval_n / dt
        step_ms = 1000.0 * dt / self.interval_n
        self.tb.scalars(self.step, {"train/loss": mean_loss, "train/samples_per_s": sps, "train/step_ms": step_ms})
        if self.config.tb_dir:
            self.tb.tier_stats(self.step, gather_tier_stats(self.model))
        self.bar.set_postfix(loss=f"{mean_loss:.4f}", sps=f"{sps:.0f}")
        if self.rank == 0:
            self.say(
                f"[recpipe] step {self.step}/{self.total} loss {mean_loss:.4f} "
                f"{sps:.0f} samples/s {step_ms:.1f} ms/step"
            )

    def _evaluate(self, step: int) -> None:
        """Evaluates at ``step``, logs the AUROC (NaN, not logged, without eval batches) and updates the
        result's eval throughput."""
        batches = self.source.eval_batches()
        if self.eval_count is not None:  # the count every rank announced at start
            batches = exactly(batches, self.eval_count, f"rank {self.rank}, evaluation at step {step}")
        if self.eval_pipeline is None:
            self.eval_pipeline = make_eval_pipeline(self.config, self.model)
        t0 = time.perf_counter()
        auroc, samples = evaluate(self.pipeline, self.eval_pipeline, self.model, batches)
        self.eval_seconds += time.perf_counter() - t0
        self.eval_samples += samples
        if self.eval_samples:
            self.result.eval_samples_per_s = self.eval_samples / self.eval_seconds
        self.result.evals.append((step, auroc))
        if auroc == auroc:  # not NaN
            self.tb.scalars(step, {"eval/auroc": auroc})
        if self.rank == 0:
            self.say(f"[recpipe] eval at step {step}: auroc {auroc:.4f}")
