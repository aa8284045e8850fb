"""Train entry point: ``python -m recpipe.recipes.train [--config default] [--flag value ...]``.

Run under torchrun for several ranks; alone it trains on one rank. :func:`run`
orchestrates process group -> data -> model -> sharding -> optimizer (and resume) ->
pipeline -> :class:`~recpipe.recipes.loop.TrainLoop` -> metrics file; :func:`main`
turns the failures a user can act on into one ``error:`` line. May import any public
name of recpipe.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.keyed import CombinedOptimizer

from recpipe.recipes.build import ShardedModel, describe_pipeline, make_optimizer, make_pipeline, shard_model
from recpipe.recipes.checkpoint_policy import (
    check_checkpoint_dir,
    load_checkpoint,
    resume_step_at_or_past,
    save_checkpoint,
)
from recpipe.recipes.cli import parse_config
from recpipe.recipes.config import ConfigError, TrainConfig
from recpipe.recipes.data.base import BatchSource
from recpipe.recipes.data.registry import make_data_source
from recpipe.recipes.faults import NonFiniteGuard, check_batch_counts, nothing_to_train, user_facing_error
from recpipe.recipes.loop import TrainLoop, TrainResult
from recpipe.recipes.models import build_model
from recpipe.recipes.shutdown import run_main
from recpipe.recipes.tb_logging import RunLogger


def _setup_distributed(config: TrainConfig) -> tuple[torch.device, bool]:
    """Joins (or creates) the process group; returns the device and whether we own the group."""
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
    # Every collective of the group fails after timeout_s instead of waiting on a dead rank forever.
    timeout = datetime.timedelta(seconds=config.timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device, True


def _prepare_data(config: TrainConfig, rank: int, world: int) -> tuple[BatchSource, int, int | None]:
    """``(source, total steps, eval batches or None)``, checked to agree over ranks and leave steps to train."""
    if config.checkpoint_dir:  # a collective: every save would fail to commit into a bad directory
        check_checkpoint_dir(config.checkpoint_dir)
    source = make_data_source(config, rank, world)
    total = source.total_steps()
    eval_count = source.eval_batch_count()
    check_batch_counts(config, source, total, eval_count, rank, world)  # a collective, once
    if config.resume:  # before building anything: a run past its end would train nothing
        assert config.checkpoint_dir is not None
        saved = resume_step_at_or_past(config.checkpoint_dir, total)
        if saved is not None:
            raise nothing_to_train(config, saved, total)
    return source, total, eval_count


def _build(
    config: TrainConfig, source: BatchSource, device: torch.device
) -> tuple[ShardedModel, CombinedOptimizer, int]:
    """``(sharded model, optimizer, first step)``, restored from the latest checkpoint on ``--resume``."""
    torch.manual_seed(config.seed)  # same dense init and table init on every rank
    model = build_model(config, source.spec, dense_device=device)
    sharded = shard_model(config, model, ShardingEnv.from_process_group(dist.group.WORLD), device)
    dmp = sharded.model
    optimizer = make_optimizer(config, dmp)
    start = 0
    if config.resume:
        assert config.checkpoint_dir is not None
        start = load_checkpoint(config.checkpoint_dir, dmp, optimizer, config)
    return sharded, optimizer, start


def _announce_plan(tb: RunLogger, config: TrainConfig, plan_text: str, start: int, rank: int, world: int) -> None:
    """The placement table and the train pipeline to TensorBoard and (rank 0) the console."""
    tb.text("placement/plan", plan_text, step=start)
    tb.text("run/pipeline", describe_pipeline(config), step=start)
    if rank == 0:
        plan_lines = "\n".join(f"[recpipe]   {line}" for line in plan_text.splitlines())
        print(f"[recpipe] placement plan ({world} ranks):\n{plan_lines}", flush=True)
        print(f"[recpipe] pipeline {describe_pipeline(config)}", flush=True)


def _write_metrics(config: TrainConfig, result: TrainResult, rank: int) -> None:
    """Rank 0 writes ``result`` as JSON to ``config.metrics_file`` (if set)."""
    if rank == 0 and config.metrics_file:
        Path(config.metrics_file).parent.mkdir(parents=True, exist_ok=True)
        Path(config.metrics_file).write_text(json.dumps(result.to_json(), indent=1, allow_nan=False))


def run(config: TrainConfig) -> TrainResult:
    """Trains with ``config`` on this process's rank; returns this rank's :class:`TrainResult`.

    Raises:
        ConfigError: a problem found once the run starts, before the model is built.
        CheckpointError: a checkpoint could not be saved, loaded or resumed from, or
            ``--checkpoint-dir`` cannot take saves (refused before the model is built).
        BatchCountError: the data source gave this rank fewer batches than asked for.
    """
    torch.set_num_threads(config.num_threads)
    device, own_group = _setup_distributed(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    tb = RunLogger(None)  # opened once the first step is known (a resume purges what follows it)
    loop: TrainLoop | None = None  # closed on every exit path, so an error line starts on a line of its own
    try:
        source, total, eval_count = _prepare_data(config, rank, world)
        sharded, optimizer, start = _build(config, source, device)
        dmp = sharded.model
        pipeline = make_pipeline(config, dmp, optimizer, device)
        # rank 0 only; a resume drops events an earlier run logged past the checkpoint
        tb = RunLogger(config.tb_dir if rank == 0 else None, purge_step=start + 1 if config.resume else None)
        result = TrainResult(
            start_step=start,
            steps=start,
            world_size=world,
            pipeline=config.pipeline,
            plan_text=sharded.plan_text,
            tb_dir=config.tb_dir,
        )
        _announce_plan(tb, config, sharded.plan_text, start, rank, world)

        def save(step: int) -> None:
            assert config.checkpoint_dir is not None
            save_checkpoint(config.checkpoint_dir, step, dmp, optimizer, config, sharded.table_ranks)

        guard = NonFiniteGuard(config, source, rank, world, start if config.resume else None)
        loop = TrainLoop(
            config=config,
            source=source,
            pipeline=pipeline,
            model=dmp,
            result=result,
            tb=tb,
            guard=guard,
            total=total,
            eval_count=eval_count,
            save=save,
        )
        loop.run()
        _write_metrics(config, result, rank)
        return result
    finally:
        if loop is not None:
            loop.close()
        tb.close()
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


def _print_error(e: BaseException) -> None:
    """One ``error:`` line on stderr, and under torchrun torchelastic's error file (the job's failure)."""
    message = f"{type(e).__name__}: {e}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        info = {"py_callstack": message, "timestamp": str(int(time.time()))}
        Path(error_file).write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    rank = os.environ.get("RANK")
    where = f"rank {rank}: " if rank is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    print(f"error: {where}{message}", file=sys.stderr, flush=True)


def _quiet_upstream_notices() -> None:
    """Drops two per-rank upstream notices a recipe user cannot act on (entry point only).

    torchrec's DMP passes DDP the deprecated ``broadcast_buffers``, and torchrec calls
    ``is_fx_tracing`` (a logged warning). Library users keep every upstream warning.
    """
    warnings.filterwarnings("ignore", message=re.escape("`broadcast_buffers` is deprecated"), category=FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").addFilter(
        lambda record: not record.getMessage().startswith("is_fx_tracing will return true")
    )


def _quiet_raw_key_range_notices() -> None:
    """Drops torchrec's first-batch notice that a feature's ids fall outside ``[0, num_embeddings)`` (entry point
    only, ``--dynamic-tables``): every table is dynamic and takes raw int64 keys, which it is meant to."""
    logging.getLogger("torchrec.sparse.jagged_tensor_validator").addFilter(
        lambda record: "which is out of range" not in record.getMessage()
    )


@record
def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 0, 2 (bad config) or 1 (a failure :func:`~recpipe.recipes.faults.user_facing_error`
    prints as one line: ``faults.USER_FACING_ERRORS``, every checkpoint failure among them, or a collective failure)."""
    _quiet_upstream_notices()
    try:
        config = parse_config(argv)
    except ConfigError as e:  # a user error: one message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    if config.dynamic_tables:
        _quiet_raw_key_range_notices()
    try:
        result = run(config)
    except ConfigError as e:  # e.g. a data file smaller than one global batch: one line, no traceback
        _print_error(e)
        return 2
    except Exception as e:  # noqa: BLE001 - re-raised with its traceback unless its message names cause and fix
        shown = user_facing_error(e, config)
        if shown is None:
            raise
        _print_error(shown)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"[recpipe] done: {result.steps} steps, final auroc {result.final_auroc:.4f}, "
            f"{result.samples_per_s:.0f} samples/s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    run_main(main)
