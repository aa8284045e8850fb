"""Train entry point: ``python -m recpipe.recipes.train [--config default] [--flag value ...]``.

Run under torchrun (or ``torchx run recpipe.train``) for several ranks; alone it
trains on one rank. Steps: config -> data source -> model -> :func:`shard_model`
(DMP) -> :func:`make_pipeline` -> loop of ``pipeline.progress`` with periodic
evaluation (AUROC), TensorBoard on rank 0, checkpoints and exact resume.

Example::

    torchrun --nproc-per-node 2 -m recpipe.recipes.train --config default --tb-dir runs/x
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
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
from recpipe.recipes.checkpoint import load_checkpoint, save_checkpoint
from recpipe.recipes.config import TrainConfig, parse_config
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
    """Global training throughput, excluding the first logging interval (warm-up)."""
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
        """JSON-friendly dict including ``final_auroc``."""
        d = dict(self.__dict__)
        d["final_auroc"] = self.final_auroc
        d["final_loss"] = self.logged_losses[-1][1] if self.logged_losses else float("nan")
        return d


def _setup_distributed(config: TrainConfig) -> tuple[torch.device, bool]:
    """Joins (or creates) the process group; returns the device and whether we own the group."""
    want_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but no CUDA device is visible. Fix: pass --device cpu")
    if want_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if want_cuda else "gloo"
    if dist.is_initialized():
        return device, False
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return device, True


def _chunk_end(step: int, total: int, config: TrainConfig) -> int:
    """End of the training chunk that starts at ``step``: the next eval/checkpoint step."""
    end = total
    for every in (config.eval_every, config.checkpoint_every if config.checkpoint_dir else 0):
        if every:
            end = min(end, (step // every + 1) * every)
    return end


def evaluate(pipeline: Any, model: torch.nn.Module, batches: Iterator[Any]) -> float:
    """AUROC over ``batches`` through the pipeline in eval mode, synced across ranks.

    Args:
        pipeline: the train pipeline (its ``progress`` skips backward in eval mode).
        model: the DMP model (switched to eval and back).
        batches: this rank's eval batches (same count on every rank).

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
                metric.update(torch.sigmoid(logits.float()).cpu(), labels.long().cpu())
                seen += labels.numel()
    finally:
        model.train()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(seen)
    if seen.item() == 0:
        return float("nan")
    return float(metric.compute())


def run(config: TrainConfig) -> TrainResult:
    """Trains with ``config`` on this process's rank.

    Args:
        config: validated config.

    Returns:
        This rank's :class:`TrainResult`.
    """
    torch.set_num_threads(config.num_threads)
    device, own_group = _setup_distributed(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    tb = RunLogger(config.tb_dir if rank == 0 else None)
    try:
        source = make_data_source(config, rank, world)
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
        total = source.total_steps()
        result = TrainResult(
            start_step=start,
            steps=start,
            world_size=world,
            pipeline=config.pipeline,
            plan_text=sharded.plan_text,
            tb_dir=config.tb_dir,
        )
        tb.text("placement/plan", sharded.plan_text)
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
        step = start
        loop_t0 = time.perf_counter()
        interval_t0, interval_loss, interval_n = loop_t0, 0.0, 0
        timed_steps, timed_seconds, first_interval = 0, 0.0, True
        while step < total:
            end = _chunk_end(step, total, config)
            batches = source.train_batches(step, end)
            while True:
                try:
                    loss, _, _ = pipeline.progress(batches)
                except StopIteration:
                    break
                value = float(loss)
                result.losses.append(value)
                step += 1
                bar.update(1)
                interval_loss += value
                interval_n += 1
                if step % config.log_every == 0 or step == total:
                    now = time.perf_counter()
                    stats = torch.tensor([interval_loss, float(interval_n)], dtype=torch.float64)
                    if world > 1:
                        dist.all_reduce(stats)
                    dt = now - interval_t0
                    mean_loss = float(stats[0] / stats[1])
                    result.logged_losses.append((step, mean_loss))
                    sps = global_batch * interval_n / dt
                    if not first_interval:
                        timed_steps += interval_n
                        timed_seconds += dt
                    first_interval = False
                    tb.scalars(
                        step,
                        {
                            "train/loss": mean_loss,
                            "train/samples_per_s": sps,
                            "train/step_ms": 1000.0 * dt / interval_n,
                        },
                    )
                    tb.tier_stats(step, gather_tier_stats(dmp))
                    bar.set_postfix(loss=f"{mean_loss:.4f}", sps=f"{sps:.0f}")
                    if rank == 0:
                        print(
                            f"[recpipe] step {step}/{total} loss {mean_loss:.4f} "
                            f"{sps:.0f} samples/s {1000.0 * dt / interval_n:.1f} ms/step",
                            flush=True,
                        )
                    interval_t0, interval_loss, interval_n = time.perf_counter(), 0.0, 0
            result.steps = step
            is_last = step >= total
            if (config.eval_every and step % config.eval_every == 0) or is_last:
                auroc = evaluate(pipeline, dmp, source.eval_batches())
                result.evals.append((step, auroc))
                if auroc == auroc:  # not NaN
                    tb.scalars(step, {"eval/auroc": auroc})
                if rank == 0:
                    print(f"[recpipe] eval at step {step}: auroc {auroc:.4f}", flush=True)
                # eval intervals are not training time
                interval_t0 = time.perf_counter()
            if config.checkpoint_dir and (
                is_last or (config.checkpoint_every and step % config.checkpoint_every == 0)
            ):
                save_checkpoint(
                    config.checkpoint_dir, step, dmp, optimizer, config, sharded.table_ranks
                )
            tb.flush()
        bar.close()
        result.train_seconds = time.perf_counter() - loop_t0
        if timed_steps:
            result.samples_per_s = global_batch * timed_steps / timed_seconds
        if rank == 0 and config.metrics_file:
            Path(config.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            Path(config.metrics_file).write_text(json.dumps(result.to_json(), indent=1))
        return result
    finally:
        tb.close()
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


@record
def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (errors are recorded for torchrun / torchx to surface).

    Args:
        argv: CLI arguments (default ``sys.argv[1:]``).

    Returns:
        Process exit code (0 on success).
    """
    config = parse_config(argv)
    result = run(config)
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"[recpipe] done: {result.steps} steps, final auroc {result.final_auroc:.4f}, "
            f"{result.samples_per_s:.0f} samples/s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
