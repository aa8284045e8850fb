"""2-rank gloo tests of the train loop: exact resume, and fused vs sparse pipelines."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.gloo import run_gloo
from harness.recipe_configs import SMALL_SYNTHETIC

from recpipe.pipeline.routing.ops import ROUTING_VERSION
from recpipe.recipes import checkpoint_policy as recipe_checkpoint
from recpipe.recipes.checkpoint_policy import CheckpointMismatchError
from recpipe.recipes.config import ConfigPathError, TrainConfig
from recpipe.recipes.train import run


def _resume_body(rank: int, world_size: int, root: str) -> dict[str, list[float]]:
    base = dict(SMALL_SYNTHETIC, pipeline="sparse")
    whole = run(TrainConfig(**base, max_steps=16, checkpoint_dir=f"{root}/a", checkpoint_every=8))
    first = run(TrainConfig(**base, max_steps=8, checkpoint_dir=f"{root}/b"))
    second = run(TrainConfig(**base, max_steps=16, checkpoint_dir=f"{root}/b", resume=True))
    return {
        "whole": whole.losses,
        "first": first.losses,
        "second": second.losses,
        "second_start": [float(second.start_step)],
    }


def test_resume_gives_the_same_losses(tmp_path: Path) -> None:
    for rank, out in enumerate(run_gloo(2, _resume_body, str(tmp_path), timeout_s=300)):
        assert out["second_start"] == [8.0]
        assert len(out["whole"]) == 16 and len(out["second"]) == 8
        assert out["first"] == out["whole"][:8], f"rank {rank}"
        # bit-identical after restoring tables, fused row-wise Adagrad state and dense Adagrad
        assert out["second"] == out["whole"][8:], f"rank {rank}"
    assert (tmp_path / "b" / "step_00000016" / "__1_0.distcp").is_file()


def test_resume_rejects_a_different_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = dict(SMALL_SYNTHETIC, pipeline="sparse")
    run(TrainConfig(**base, max_steps=2, checkpoint_dir=str(tmp_path)))
    changed = dict(base, embedding_dim=16, dense_arch=(16, 16))
    with pytest.raises(CheckpointMismatchError, match="embedding_dim"):
        run(TrainConfig(**changed, max_steps=4, checkpoint_dir=str(tmp_path), resume=True))
    # a checkpoint of the version 1 hash_roundrobin routing: its row-wise shards are in
    # another local-id order, so resuming is refused
    assert ROUTING_VERSION == 2
    with monkeypatch.context() as m:
        m.setattr(recipe_checkpoint, "ROUTING_VERSION", 1)
        run(TrainConfig(**base, max_steps=2, checkpoint_dir=str(tmp_path / "v1")))
    with pytest.raises(CheckpointMismatchError, match=r"routing version 1 \(checkpoint\) != 2"):
        run(TrainConfig(**base, max_steps=4, checkpoint_dir=str(tmp_path / "v1"), resume=True))
    # a directory with no checkpoint: refused with the config (before any process starts),
    # and by the loader when the paths were not checked (check_paths=False)
    with pytest.raises(
        ConfigPathError, match=r"checkpoint_dir=.*empty.*holds no checkpoint \(no step_\* directory\).*drop --resume"
    ):
        TrainConfig(**base, max_steps=4, checkpoint_dir=str(tmp_path / "empty"), resume=True)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "latest").write_text("4\n")  # a marker without its step directory: the loader's rule
    with pytest.raises(ConfigPathError, match="holds no checkpoint"):
        TrainConfig(**base, max_steps=4, checkpoint_dir=str(tmp_path / "empty"), resume=True)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run(TrainConfig(**base, max_steps=4, checkpoint_dir=str(tmp_path / "empty"), resume=True, check_paths=False))


def _pipelines_body(rank: int, world_size: int) -> dict[str, list[float]]:
    cfg = dict(
        model="micro_dlrm_dram",
        dataset="movielens100k",
        virtual_rows=1 << 14,
        hash_k=4,
        batch_size=128,
        max_steps=24,
        eval_every=12,
        eval_batches=3,
        log_every=6,
        progress_bar=False,
    )
    sparse = run(TrainConfig(**cfg, pipeline="sparse"))
    fused = run(TrainConfig(**cfg, pipeline="fused"))
    return {
        "sparse": sparse.losses,
        "fused": fused.losses,
        "sparse_auroc": [a for _, a in sparse.evals],
        "fused_auroc": [a for _, a in fused.evals],
    }


def test_fused_pipeline_matches_torchrec_sparse_dist() -> None:
    try:
        from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist  # noqa: F401
    except ImportError as e:
        pytest.skip(f"recpipe.pipeline.train_pipeline.fused_pipeline does not import yet: {e}")
    for out in run_gloo(2, _pipelines_body, timeout_s=300):
        assert len(out["sparse"]) == 24
        assert out["fused"] == out["sparse"]
        assert out["fused_auroc"] == out["sparse_auroc"] and len(out["sparse_auroc"]) == 2
