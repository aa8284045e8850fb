"""Non-finite losses stop the run: every rank raises, naming step, rank and batch source,
before any checkpoint of the bad weights is written, and the CLI exits non-zero.

Two causes: a diverging dense learning rate (the real path, end to end through the
CLI), and a batch whose dense features hold inf on one rank only (the Criteo reader
refuses the 45-digit integers that would become one, so the test puts the inf into
rank 1's batch of step 3 as the source yields it) to
show that the other rank stops too and the error names the right rank, step and rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness.criteo_files import CRITEO, write_criteo
from harness.gloo import run_gloo

import recpipe.recipes.train as train_module
from recpipe.pipeline.checkpoint import verify_checkpoint
from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data import registry
from recpipe.recipes.data.base import BatchSource
from recpipe.recipes.faults import NonFiniteLossError
from recpipe.recipes.train import run


def _steps_saved(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step_*"))


def _source_with_inf(config: TrainConfig, rank: int, world_size: int) -> BatchSource:
    """The real Criteo source, except that rank 1's batch of global step 2 (step 3) has
    an inf dense value in its sample 5 (file row 85)."""
    source = registry.make_data_source(config, rank, world_size)
    clean = source.train_batches

    def train_batches(start: int, stop: int) -> Any:
        for index, batch in zip(range(start, stop), clean(start, stop)):
            if rank == 1 and index == 2:
                batch.dense_features[5, 4] = float("inf")
            yield batch

    source.train_batches = train_batches  # type: ignore[method-assign]
    return source


def _inf_on_rank1_body(rank: int, world_size: int, data: str, ckpt: str | None, log_every: int) -> dict[str, Any]:
    train_module.make_data_source = _source_with_inf  # this spawned process only
    cfg = TrainConfig(
        **CRITEO, data_path=data, log_every=log_every, checkpoint_dir=ckpt, checkpoint_every=1 if ckpt else 0
    )
    try:
        result = run(cfg)
    except NonFiniteLossError as e:
        return {"error": str(e)}
    return {"error": None, "losses": result.losses}


@pytest.mark.parametrize(
    "checkpoints, log_every, stop",
    [
        (True, 10, 3),  # caught before the step-3 checkpoint
        (False, 2, 4),  # no checkpoints: caught at the step-4 logging interval
    ],
)
def test_inf_on_one_rank_stops_every_rank(tmp_path: Path, checkpoints: bool, log_every: int, stop: int) -> None:
    # global batch 32 rows: step 3 (batch 2) holds rows 64-95, rank 1's slice rows 80-95
    data = tmp_path / "day_0.tsv"
    write_criteo(data, 320)
    ckpt = tmp_path / "ckpt" if checkpoints else None
    outs = run_gloo(2, _inf_on_rank1_body, str(data), str(ckpt) if ckpt else None, log_every, timeout_s=300)
    for rank, out in enumerate(outs):
        error = out["error"]
        assert error is not None, f"rank {rank} finished: {out['losses']}"
        assert error.startswith("non-finite training loss at step 3 on rank 1 (dataset criteo_tsv)"), error
        assert f"stopped at step {stop}, before any checkpoint" in error
        assert "rank 1: loss nan first at step 3; batch: dataset criteo_tsv, rank 1's slice of global batch 2" in error
        assert f"{data} lines 81-96" in error
    if ckpt is not None:
        assert "the newest checkpoint in" in outs[0]["error"] and "is step 2" in outs[0]["error"]
        assert _steps_saved(ckpt) == [1, 2]
        assert (ckpt / "latest").read_text() == "2\n"
        verify_checkpoint(ckpt / "step_00000002")


def test_cli_exits_non_zero_on_divergence_without_saving_bad_weights(tmp_path: Path) -> None:
    data = tmp_path / "day_0.tsv"
    write_criteo(data, 320)
    ckpt = tmp_path / "ckpt"
    flags = [
        f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
        for k, v in CRITEO.items()
        if k != "progress_bar"
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recpipe.recipes.train",
            *flags,
            "--no-progress-bar",
            f"--data-path={data}",
            "--dense-lr=1e30",
            "--log-every=10",
            f"--checkpoint-dir={ckpt}",
            "--checkpoint-every=1",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=600,
    )
    assert proc.returncode == 1, proc.stdout[-2000:]
    err = proc.stderr
    assert "NonFiniteLossError: non-finite training loss at step 2 on rank 0 (dataset criteo_tsv)" in err, err[-3000:]
    assert "Traceback" not in err and "error: NonFiniteLossError: " in err  # one message, no traceback
    assert f"{data} lines 17-32" in err  # step 2 = rows 16-31
    assert "[recpipe] done" not in proc.stdout
    assert _steps_saved(ckpt) == [1]  # weights after the first (finite) step only
    assert (ckpt / "latest").read_text() == "1\n"
