"""``--pipeline`` of the recipes: sparse, fused and semi_sync train and evaluate on 2 gloo ranks.

Pins: ``sparse`` (torchrec's TrainPipelineSparseDist) and ``fused`` give bit-identical losses and
AUROCs; ``semi_sync`` equals ``fused`` bit for bit through step ``semi_sync_start_batch + 1`` and
differs from the next step on (its first stale lookup); its resume starts the semi-sync phase at
the same global step as an uninterrupted run (same losses); TensorBoard holds ``run/pipeline``
(text) and ``train/staleness`` (0 before the stale phase, 1 in it); ``--eval-pipeline plain`` and
``prefetch`` give the same AUROCs bit for bit and the metrics file records their eval throughput; bad
values are refused naming the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from harness.gloo import run_gloo
from harness.recipe_configs import SMALL_SYNTHETIC, scalars

from recpipe.recipes.checkpoint_policy import RESUME_NOTED_FIELDS
from recpipe.recipes.cli import parse_config
from recpipe.recipes.config import DEFAULT_SEMI_SYNC_START_BATCH, ConfigError, TrainConfig

STEPS = 12
START = 5  # semi_sync_start_batch of the tests: steps 1..START+1 are exact, the later ones stale


def _pipelines_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from recpipe.recipes.train import run

    cfg = dict(SMALL_SYNTHETIC, max_steps=STEPS)
    out: dict[str, Any] = {}
    for name in ("sparse", "fused", "semi_sync"):
        extra = {"semi_sync_start_batch": START} if name == "semi_sync" else {}
        result = run(TrainConfig(**cfg, pipeline=name, tb_dir=f"{root}/tb_{name}", **extra))
        out[name] = result.losses
        out[f"{name}_auroc"] = [a for _, a in result.evals]
        out[f"{name}_pipeline"] = result.pipeline
    return out


def _pipeline_text(tb_dir: Path) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors("run/pipeline/text_summary")
    return b"".join(v for e in events for v in e.tensor_proto.string_val).decode()


def test_each_pipeline_trains_and_evaluates_sparse_equals_fused_semi_sync_stale_after_start(tmp_path: Path) -> None:
    outs = run_gloo(2, _pipelines_body, str(tmp_path), timeout_s=400)
    for out in outs:
        for name in ("sparse", "fused", "semi_sync"):
            assert len(out[name]) == STEPS and all(math.isfinite(v) for v in out[name])
            assert len(out[f"{name}_auroc"]) == 1 and 0.0 <= out[f"{name}_auroc"][0] <= 1.0
            assert out[f"{name}_pipeline"] == name
        assert out["fused"] == out["sparse"]  # exact pipelines: bit for bit
        assert out["fused_auroc"] == out["sparse_auroc"]
        exact = START + 1  # batches 0..START were looked up after their predecessor's update
        assert out["semi_sync"][:exact] == out["fused"][:exact]
        assert all(s != f for s, f in zip(out["semi_sync"][exact:], out["fused"][exact:]))
    for name, stale_from in (("sparse", None), ("fused", None), ("semi_sync", START + 2)):
        tags = scalars(tmp_path / f"tb_{name}")
        staleness = tags["train/staleness"]
        assert [s for s, _ in staleness] == list(range(1, STEPS + 1))
        assert [v for _, v in staleness] == [float(stale_from is not None and s >= stale_from) for s, _ in staleness]
        assert _pipeline_text(tmp_path / f"tb_{name}").split(":")[0].strip() == name


def _resume_body(rank: int, world_size: int, root: str, start: int) -> dict[str, list[float]]:
    from recpipe.recipes.train import run

    cfg = dict(SMALL_SYNTHETIC, pipeline="semi_sync", semi_sync_start_batch=start, checkpoint_every=6)
    whole = run(TrainConfig(**cfg, max_steps=STEPS, checkpoint_dir=f"{root}/whole"))
    run(TrainConfig(**cfg, max_steps=6, checkpoint_dir=f"{root}/split"))
    resumed = run(TrainConfig(**cfg, max_steps=STEPS, checkpoint_dir=f"{root}/split", resume=True))
    return {"whole": whole.losses, "resumed": resumed.losses}


def test_semi_sync_resume_starts_its_stale_phase_at_the_same_global_step(tmp_path: Path) -> None:
    # start 8 > the checkpoint step 6: a resumed pipeline numbering its batches from 0 would stay exact to step 15,
    # and an uninterrupted one numbering past the drain at step 6 would go stale before step 10
    for out in run_gloo(2, _resume_body, str(tmp_path), 8, timeout_s=400):
        assert len(out["resumed"]) == STEPS - 6
        assert out["resumed"] == out["whole"][6:]


def _eval_pipelines_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from recpipe.recipes.train import run

    cfg = dict(SMALL_SYNTHETIC, max_steps=8, eval_every=3, eval_batches=3)  # evaluations at steps 3, 6 and 8
    out: dict[str, Any] = {}
    for name in ("plain", "prefetch"):
        result = run(TrainConfig(**cfg, eval_pipeline=name, metrics_file=f"{root}/{name}.json"))
        out[name] = result.evals
        out[f"{name}_losses"] = result.losses
    return out


def test_plain_and_prefetch_eval_pipelines_give_identical_aurocs_and_record_eval_throughput(tmp_path: Path) -> None:
    outs = run_gloo(2, _eval_pipelines_body, str(tmp_path), timeout_s=400)
    for out in outs:
        assert [step for step, _ in out["plain"]] == [3, 6, 8]
        assert all(0.0 <= auroc <= 1.0 for _, auroc in out["plain"])
        assert out["prefetch"] == out["plain"]  # bit for bit, every evaluation
        assert out["prefetch_losses"] == out["plain_losses"]  # evaluation changes no training state
    for name in ("plain", "prefetch"):
        metrics = json.loads((tmp_path / f"{name}.json").read_text())
        assert metrics["evals"] == [list(e) for e in outs[0][name]]
        sps = metrics["eval_samples_per_s"]
        assert isinstance(sps, float) and math.isfinite(sps) and sps > 0, sps


def test_eval_pipeline_flag_selects_the_loop_the_evaluation_runs() -> None:
    import torch

    from recpipe.pipeline import EvalPipelinePrefetch
    from recpipe.recipes.loop import PlainEvalLoop, make_eval_pipeline

    model = torch.nn.Linear(2, 1)
    for name, kind in (("plain", PlainEvalLoop), ("prefetch", EvalPipelinePrefetch)):
        config = TrainConfig(**SMALL_SYNTHETIC, max_steps=4, eval_pipeline=name, check_paths=False)
        assert type(make_eval_pipeline(config, model)) is kind


def test_eval_samples_per_s_of_a_run_without_evaluation_is_null_in_the_metrics() -> None:
    from recpipe.recipes.loop import TrainResult

    result = TrainResult(start_step=0, steps=4)
    assert math.isnan(result.eval_samples_per_s)
    assert json.loads(json.dumps(result.to_json(), allow_nan=False))["eval_samples_per_s"] is None


def test_pipeline_change_on_resume_is_noted_not_refused() -> None:
    assert {"pipeline", "semi_sync_start_batch"} <= set(RESUME_NOTED_FIELDS)


@pytest.mark.parametrize(
    ("kwargs", "field", "fix"),
    [
        ({"pipeline": "async"}, "pipeline", "fused, sparse, semi_sync"),
        ({"pipeline": "semi_sync", "semi_sync_start_batch": -1}, "semi_sync_start_batch", "--semi-sync-start-batch"),
        ({"pipeline": "semi_sync", "semi_sync_start_batch": 2.5}, "semi_sync_start_batch", "--semi-sync-start-batch"),
        ({"pipeline": "fused", "semi_sync_start_batch": 3}, "semi_sync_start_batch", "--pipeline semi_sync"),
        ({"eval_pipeline": "lazy"}, "eval_pipeline", "use one of prefetch, plain, e.g. --eval-pipeline prefetch"),
    ],
)
def test_bad_pipeline_values_are_refused_naming_the_field(kwargs: dict[str, Any], field: str, fix: str) -> None:
    with pytest.raises(ConfigError, match=f"invalid config value {field}=") as info:
        TrainConfig(**SMALL_SYNTHETIC, max_steps=4, **kwargs, check_paths=False)
    assert fix in str(info.value)


def test_pipeline_flags_parse_and_default() -> None:
    base = ["--dataset", "synthetic", "--max-steps", "4"]
    assert parse_config(base, check_paths=False).pipeline == "fused"
    assert parse_config(base, check_paths=False).semi_sync_start_batch == DEFAULT_SEMI_SYNC_START_BATCH
    config = parse_config([*base, "--pipeline", "semi_sync", "--semi-sync-start-batch", "0"], check_paths=False)
    assert (config.pipeline, config.semi_sync_start_batch) == ("semi_sync", 0)
    with pytest.raises(ConfigError, match="semi-sync-start-batch"):
        parse_config([*base, "--pipeline", "semi_sync", "--semi-sync-start-batch", "x"], check_paths=False)
