"""End to end through torchx local_cwd (2 processes), TensorBoard read-back and serving."""

from __future__ import annotations

import json
import math
import os
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from tensorboard import program
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torchx.specs import AppState

from recpipe.recipes import components, launch
from recpipe.recipes.config import ConfigError

TAGS = {"train/loss", "train/samples_per_s", "train/step_ms", "eval/auroc"}


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, launch.LaunchResult]:
    root = tmp_path_factory.mktemp("e2e")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    app = components.train(
        "--dataset",
        "synthetic",
        "--model",
        "dlrm",
        "--pipeline",
        "sparse",
        "--num-embeddings",
        "5000",
        "--synthetic-id-space",
        "100000",
        "--embedding-dim",
        "16",
        "--dense-arch",
        "32,16",
        "--over-arch",
        "32,1",
        "--batch-size",
        "256",
        "--max-steps",
        "40",
        "--log-every",
        "5",
        "--eval-every",
        "20",
        "--eval-batches",
        "4",
        "--embedding-lr",
        "0.1",
        "--dense-lr",
        "0.05",
        "--tb-dir",
        str(root / "tb"),
        "--metrics-file",
        str(root / "metrics.json"),
        j="1x2",
    )
    result = launch.run_app(app, log_dir=str(root / "torchx"))
    assert result.state == AppState.SUCCEEDED, "\n".join(result.log_lines[-40:])
    return root, json.loads((root / "metrics.json").read_text()), result


def test_torchx_run_writes_tensorboard_and_loss_falls(synthetic_run) -> None:
    root, metrics, result = synthetic_run
    assert metrics["world_size"] == 2 and metrics["steps"] == 40
    acc = EventAccumulator(str(root / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert TAGS <= set(acc.Tags()["scalars"])
    assert "placement/plan/text_summary" in acc.Tags()["tensors"]
    for tag in TAGS:
        values = [e.value for e in acc.Scalars(tag)]
        assert values and all(math.isfinite(v) for v in values), tag
    assert [e.step for e in acc.Scalars("eval/auroc")] == [20, 40]
    # planned placements put the tables in tiered storage: per-table cache hit
    # rate and tier traffic are logged
    tier = {t for t in acc.Tags()["scalars"] if t.startswith("tier/")}
    tables = {t.split("/")[1] for t in tier}
    assert tables, acc.Tags()["scalars"]
    for table in tables:
        for stat in ("hit_rate", "bytes_moved", "rows_loaded"):
            values = [e.value for e in acc.Scalars(f"tier/{table}/{stat}")]
            assert values and all(math.isfinite(v) for v in values), (table, stat)
        for ratio in ("hit_rate", "fast_fraction", "cumulative_hit_rate"):  # fractions of 2 ranks' lookups
            assert all(0.0 <= e.value <= 1.0 for e in acc.Scalars(f"tier/{table}/{ratio}")), (table, ratio)
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert len(losses) == 8
    # the hidden logistic model is learnable: loss falls clearly over 40 steps
    assert sum(losses[-3:]) / 3 < sum(losses[:2]) / 2 - 0.02
    assert [v for _, v in metrics["logged_losses"]] == pytest.approx(losses, rel=1e-6)
    assert any("[recpipe] step 40/40" in line for line in result.log_lines)


def test_tensorboard_server_serves_the_scalars(synthetic_run) -> None:
    root, _, _ = synthetic_run
    tb = program.TensorBoard()
    tb.configure(argv=[None, "--logdir", str(root / "tb"), "--host", "127.0.0.1", "--port", "0"])
    url = tb.launch()
    acc = EventAccumulator(str(root / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    for tag in ("train/loss", "eval/auroc"):
        q = urllib.parse.urlencode({"run": ".", "tag": tag})
        with urllib.request.urlopen(f"{url.rstrip('/')}/data/plugin/scalars/scalars?{q}", timeout=30) as r:
            served = json.loads(r.read())
        assert [(s, v) for _, s, v in served] == [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]


def test_crashing_worker_fails_the_job_with_its_error(tmp_path: Path) -> None:
    good = "\t".join(["1"] + ["3"] * 13 + ["0a0b0c0d"] * 26)
    bad = "\t".join(["0"] + ["3"] * 13 + ["nothex!!"] * 26)
    data = tmp_path / "broken.tsv"
    data.write_text("\n".join([good] * 40 + [bad] + [good] * 40) + "\n")
    app = components.train(
        "--dataset",
        "criteo_tsv",
        "--data-path",
        str(data),
        "--model",
        "dlrm",
        "--num-embeddings",
        "100",
        "--embedding-dim",
        "8",
        "--dense-arch",
        "8",
        "--over-arch",
        "8,1",
        "--batch-size",
        "8",
        "--pipeline",
        "sparse",
        "--no-progress-bar",
        j="1x2",
    )
    result = launch.run_app(app, log_dir=str(tmp_path / "torchx"))
    assert result.state == AppState.FAILED
    surfaced = "\n".join(result.log_lines) + (result.status.structured_error_msg or "")
    assert "CriteoFormatError" in surfaced and "nothex!!" in surfaced


def test_bad_config_fails_before_any_process(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        components.train("--batch-size", "0")
    code = launch.main(["--tb-dir", str(tmp_path / "tb"), "--pipeline", "turbo"])
    assert code == 2
    assert "pipeline" in capsys.readouterr().err
    assert not (tmp_path / "tb").exists()
