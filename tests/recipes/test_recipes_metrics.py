"""What a run reports, checked against independent references.

* the eval AUROC of a 2-rank run = a hand-written AUROC (and torchmetrics') of the
  saved model's predictions over both ranks' eval batches, through plain DMP forward;
* the logged train loss = the mean over ranks and steps of each logging interval;
* TensorBoard after ``--resume`` (from a run that went on past its last checkpoint)
  holds exactly the steps and values of an uninterrupted run;
* ``train/step_ms`` / ``train/samples_per_s`` count every training step of the
  interval, also when an evaluation falls inside it (evaluation time excluded).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from harness.gloo import run_gloo
from harness.recipe_configs import SYNTHETIC, scalars
from torchmetrics.functional.classification import binary_auroc
from torchrec.distributed.types import ShardingEnv

import recpipe.recipes.train as train_module
from recpipe.recipes.build import make_optimizer, shard_model
from recpipe.recipes.checkpoint_policy import load_checkpoint
from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data.base import BatchSource
from recpipe.recipes.data.registry import make_data_source
from recpipe.recipes.models import build_model
from recpipe.recipes.train import run

MOVIELENS: dict[str, Any] = dict(
    dataset="movielens100k",
    model="micro_dlrm_dram",
    virtual_rows=1 << 12,
    hash_k=2,
    embedding_dim=8,
    dense_arch=(16, 8),
    over_arch=(16, 1),
    batch_size=100,
    progress_bar=False,
)


def hand_auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """AUROC as the Mann-Whitney U statistic (tied scores share their mean rank)."""
    s = scores.double()
    ranks_in_order = torch.arange(1, s.numel() + 1, dtype=torch.float64)
    order = torch.argsort(s)
    uniq, inverse, counts = torch.unique(s[order], return_inverse=True, return_counts=True)
    mean_rank = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, ranks_in_order) / counts
    ranks = mean_rank[inverse]
    y = labels[order]
    pos = float(y.sum())
    neg = float(y.numel()) - pos
    return float((ranks[y == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def _auroc_body(rank: int, world: int, root: str) -> dict[str, Any]:
    # placement planned, fused pipeline (the defaults); the eval split holds 1050
    # ratings: 5 global batches of 200 and a short one of 50 (all of them rank 0's)
    cfg = TrainConfig(
        **MOVIELENS,
        max_steps=12,
        eval_every=6,
        eval_batches=20,
        eval_fraction=0.0105,
        log_every=4,
        checkpoint_dir=f"{root}/ck",
        tb_dir=f"{root}/tb",
    )
    result = run(cfg)
    # the reference: the saved model loaded into a fresh DMP, plain forward (no pipeline)
    # over every eval rating, each rank taking one half in batches of 105
    torch.manual_seed(cfg.seed)
    source = make_data_source(cfg, rank, world)
    model = build_model(cfg, source.spec, torch.device("cpu"))
    sharded = shard_model(cfg, model, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    load_checkpoint(cfg.checkpoint_dir, sharded.model, make_optimizer(cfg, sharded.model), cfg)
    sharded.model.eval()
    ratings = source._eval_idx  # noqa: SLF001 - the held-out ratings
    assert ratings.numel() == 1050
    half = ratings[rank * 525 : (rank + 1) * 525]
    scores, labels = [], []
    with torch.no_grad():
        for i in range(5):
            _, (_, logits, y) = sharded.model(source._batch(half[i * 105 : (i + 1) * 105]))  # noqa: SLF001
            scores.append(torch.sigmoid(logits.float()))
            labels.append(y.long())
    mine = torch.stack([torch.cat(scores), torch.cat(labels).float()])
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    both = torch.cat(every, dim=1)
    return {
        "evals": result.evals,
        "logged": result.logged_losses,
        "losses": result.losses,
        "scores": both[0].tolist(),  # plain lists: tensors do not cross the harness' queue
        "labels": both[1].long().tolist(),
    }


def test_eval_auroc_and_train_loss_match_references_on_2_ranks(tmp_path: Path) -> None:
    out = run_gloo(2, _auroc_body, str(tmp_path), timeout_s=300)
    scores, labels = torch.tensor(out[0]["scores"]), torch.tensor(out[0]["labels"])
    assert scores.numel() == 1050 and set(labels.tolist()) == {0, 1}
    expected = hand_auroc(scores, labels)
    assert float(binary_auroc(scores, labels)) == pytest.approx(expected, abs=1e-6)
    for o in out:
        assert [s for s, _ in o["evals"]] == [6, 12]
        assert o["evals"][-1][1] == pytest.approx(expected, abs=1e-5)
        # train/loss: the mean over both ranks and the interval's steps
        means = [
            (end, sum(out[0]["losses"][end - 4 : end] + out[1]["losses"][end - 4 : end]) / 8) for end in (4, 8, 12)
        ]
        assert [s for s, _ in o["logged"]] == [4, 8, 12]
        assert [v for _, v in o["logged"]] == pytest.approx([v for _, v in means], rel=1e-9)
    # one writer: rank 0's event file only, holding the same numbers
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    logged = scalars(tmp_path / "tb")
    assert [s for s, _ in logged["eval/auroc"]] == [6, 12]
    assert logged["eval/auroc"][-1][1] == pytest.approx(expected, abs=1e-5)
    assert [s for s, _ in logged["train/loss"]] == [s for s, _ in out[0]["logged"]]
    # samples/s counts the global batch (2 ranks x 100) per step_ms, not one rank's
    for (_, sps), (_, ms) in zip(logged["train/samples_per_s"], logged["train/step_ms"]):
        assert sps * ms / 1000 == pytest.approx(2 * 100, rel=1e-4)
    assert [v for _, v in logged["train/loss"]] == pytest.approx([v for _, v in out[0]["logged"]], rel=1e-6)


def test_resumed_tensorboard_has_the_steps_and_values_of_an_uninterrupted_run(tmp_path: Path) -> None:
    cfg = dict(SYNTHETIC, log_every=2, eval_every=4, checkpoint_every=4)
    run(TrainConfig(**cfg, max_steps=12, checkpoint_dir=str(tmp_path / "ck_a"), tb_dir=str(tmp_path / "tb_a")))
    # a run that logged up to step 10 past its step-8 checkpoint, then died (its final
    # checkpoint lost), resumed into the same TensorBoard directory
    ck, tb = tmp_path / "ck_b", tmp_path / "tb_b"
    run(TrainConfig(**cfg, max_steps=10, checkpoint_dir=str(ck), tb_dir=str(tb)))
    shutil.rmtree(ck / "step_00000010")
    (ck / "latest").unlink()
    run(TrainConfig(**cfg, max_steps=12, checkpoint_dir=str(ck), tb_dir=str(tb), resume=True))
    whole, resumed = scalars(tmp_path / "tb_a"), scalars(tb)
    assert whole.keys() == resumed.keys()
    assert [s for s, _ in whole["train/loss"]] == [2, 4, 6, 8, 10, 12]
    assert [s for s, _ in whole["eval/auroc"]] == [4, 8, 12]
    for tag in ("train/loss", "eval/auroc"):
        assert [s for s, _ in resumed[tag]] == [s for s, _ in whole[tag]], tag  # no duplicate, no stale step
        assert [v for _, v in resumed[tag]] == pytest.approx([v for _, v in whole[tag]], rel=1e-6), tag
    for tag, events in resumed.items():
        steps = [s for s, _ in events]
        assert steps == sorted(set(steps)), (tag, steps)


SLEEP_S = 0.1


def _slow_train_source(config: TrainConfig, rank: int, world_size: int) -> BatchSource:
    """The real source, except that producing each training batch takes SLEEP_S longer."""
    source = make_data_source(config, rank, world_size)
    clean = source.train_batches

    def train_batches(start: int, stop: int) -> Iterator[Any]:
        for batch in clean(start, stop):
            time.sleep(SLEEP_S)
            yield batch

    source.train_batches = train_batches  # type: ignore[method-assign]
    return source


def test_throughput_counts_every_step_of_an_interval_an_eval_falls_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(train_module, "make_data_source", _slow_train_source)
    # intervals of 8 steps; the eval at step 15 falls inside the interval 9..16
    result = run(
        TrainConfig(**dict(SYNTHETIC, eval_batches=1), max_steps=16, log_every=8, eval_every=15, tb_dir=str(tmp_path))
    )
    assert [s for s, _ in result.evals] == [15, 16]
    logged = scalars(tmp_path)
    # steps 9..16 are 8 steps that each waited SLEEP_S for their batch (at most 2 of
    # them prefetched before the interval began): at least 6 sleeps over 8 steps
    ((step, step_ms),) = [e for e in logged["train/step_ms"] if e[0] == 16]
    assert step_ms >= 1000 * SLEEP_S * 6 / 8, step_ms
    ((_, sps),) = [e for e in logged["train/samples_per_s"] if e[0] == 16]
    assert sps <= SYNTHETIC["batch_size"] / (SLEEP_S * 6 / 8)
    # the run's throughput excludes the first (warm-up) interval: it is this interval's
    assert result.samples_per_s == pytest.approx(sps, rel=1e-4)


def test_an_eval_split_smaller_than_a_global_batch_is_evaluated_whole(tmp_path: Path) -> None:
    """An eval split of less than one global batch is evaluated (a finite final AUROC); a
    training split smaller than one global batch is one error line, not a traceback."""
    from recpipe.recipes.data.movielens import MovieLens100kSource, load_movielens100k

    ratings = load_movielens100k()["rating"].numel()
    small_eval = dict(dataset="movielens100k", eval_fraction=0.01, max_steps=2)  # 1000 held out
    for batch, world, real in ((1024, 1, [1000]), (512, 2, [512, 488]), (600, 2, [600, 400])):
        held_out = []
        for rank in range(world):
            source = MovieLens100kSource(TrainConfig(**small_eval, batch_size=batch), rank, world)
            batches = list(source.eval_batches())
            assert [b.labels.numel() for b in batches] == [batch], (batch, world)  # same size on every rank
            labels = batches[0].labels
            assert int((labels >= 0).sum()) == real[rank]
            assert set(labels[real[rank] :].tolist()) <= {-1.0}
            held_out.append(labels[: real[rank]])
        # each held-out rating once: the labels are the split's own
        assert torch.equal(torch.cat(held_out), source._labels[source._eval_idx])  # noqa: SLF001
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recpipe.recipes.train",
            "--dataset",
            "movielens100k",
            "--batch-size",
            str(ratings),
            "--no-progress-bar",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert f"batch_size={ratings}" in proc.stderr and "training split holds 90000 ratings" in proc.stderr


def test_criteo_eval_covers_every_row_of_a_file_not_divisible_by_the_global_batch(tmp_path: Path) -> None:
    import csv

    from harness.criteo_files import write_criteo

    from recpipe.recipes.data.criteo import CriteoTsvSource

    path = tmp_path / "eval.tsv"
    write_criteo(path, 100)  # 3 global batches of 32 and 4 rows
    with open(path, newline="") as f:
        file_labels = [float(row[0]) for row in csv.reader(f, delimiter="\t")]
    cfg = TrainConfig(
        dataset="criteo_tsv",
        model="dlrm",
        num_embeddings=500,
        data_path=str(path),
        batch_size=16,
        eval_batches=10,
        max_steps=1,
    )
    per_rank = [list(CriteoTsvSource(cfg, rank, 2).eval_batches()) for rank in range(2)]
    assert [[b.labels.numel() for b in batches] for batches in per_rank] == [[16] * 4, [16] * 4]
    seen = []
    for i in range(4):
        for rank in range(2):
            labels = per_rank[rank][i].labels
            seen += [v for v in labels.tolist() if v >= 0]
            assert set(labels[(labels >= 0).sum() :].tolist()) <= {-1.0}
    assert seen == file_labels
    # --eval-batches still caps the evaluation, in whole global batches first
    capped = dict(cfg.to_dict(), eval_batches=2)
    assert len(list(CriteoTsvSource(TrainConfig(**capped), 1, 2).eval_batches())) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_one_error_line_and_exit_2(tmp_path: Path) -> None:
    """One ``error:`` line naming the fix and exit 2, not a RuntimeError traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recpipe.recipes.train",
            "--dataset",
            "synthetic",
            "--max-steps",
            "1",
            "--device",
            "cuda",
            "--no-progress-bar",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "device='cuda'" in proc.stderr and "--device cpu" in proc.stderr
