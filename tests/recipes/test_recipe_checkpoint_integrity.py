"""Checkpoint integrity of the recipe: each step a DCP checkpoint committed by its digests
record and then ``latest``, verified loads, resume fallback.

Each fault is applied to a copy of a real checkpoint directory written by the recipe
(``recpipe.recipes.train.run``, 1 rank), and checked three ways:
``recpipe.pipeline.checkpoint.verify_checkpoint`` / a strict :func:`load_checkpoint` name
the damaged file, ``--resume`` falls back to the newest intact checkpoint with one
line saying so and then reproduces the uninterrupted run's losses exactly, and with
nothing intact resume fails (non-zero exit from the CLI) without training.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from harness.recipe_configs import SMALL, flip_bytes, step_dir
from torchrec.distributed.types import ShardingEnv

from recpipe.pipeline.checkpoint import (
    DIGESTS_NAME,
    CheckpointIntegrityError,
    read_extra_state,
    verify_checkpoint,
    write_digests,
)
from recpipe.recipes.build import make_optimizer, shard_model
from recpipe.recipes.checkpoint_policy import (
    CheckpointCorruptError,
    CheckpointDirectoryError,
    NoIntactCheckpointError,
    NonFiniteStateError,
    load_checkpoint,
    save_checkpoint,
)
from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data.registry import make_data_source
from recpipe.recipes.models import build_model
from recpipe.recipes.train import main, run

SAVED_STEPS = 12  # the saved run: checkpoints at 4, 8, 12
RESUME_TO = 16
DATA = "__0_0.distcp"  # rank 0's DCP data file


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """A checkpoint directory (steps 4, 8, 12) and the losses of an uninterrupted 16-step run."""
    root = tmp_path_factory.mktemp("pristine") / "ckpt"
    saved = run(TrainConfig(**SMALL, max_steps=SAVED_STEPS, checkpoint_dir=str(root), checkpoint_every=4))
    reference = run(TrainConfig(**SMALL, max_steps=RESUME_TO))
    assert saved.losses == reference.losses[:SAVED_STEPS]
    return root, reference.losses


@pytest.fixture
def ckpt(pristine: tuple[Path, list[float]], tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(pristine[0], root)
    return root


def _resume(root: Path) -> tuple[Any, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run(
            TrainConfig(**SMALL, max_steps=RESUME_TO, checkpoint_dir=str(root), checkpoint_every=4, resume=True)
        )
    return result, out.getvalue()


def _resume_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("[recpipe] resume:")]


# ---------------------------------------------------------------- the save
def test_save_is_committed_by_a_digests_record_then_latest(pristine: tuple[Path, list[float]]) -> None:
    root, _ = pristine
    assert (root / "latest").read_text() == f"{SAVED_STEPS}\n"
    assert sorted(p.name for p in root.iterdir()) == [
        ".recpipe_save.lock",
        "latest",
        "step_00000004",
        "step_00000008",
        "step_00000012",
    ]
    for step in (4, 8, 12):
        d = step_dir(root, step)
        names = sorted(p.name for p in d.iterdir())
        assert names == [".metadata", DATA, DIGESTS_NAME]  # no temporary, no lock left
        record = json.loads((d / DIGESTS_NAME).read_text())
        assert record["files"] == {
            n: {"bytes": (d / n).stat().st_size, "sha256": hashlib.sha256((d / n).read_bytes()).hexdigest()}
            for n in names
            if n != DIGESTS_NAME
        }
        verify_checkpoint(d)
        extra = read_extra_state(d, 0)
        assert extra is not None and sorted(extra.value) == ["meta", "optimizer"] and extra.path == d / DATA
        assert (extra.value["meta"]["step"], extra.value["meta"]["world_size"]) == (step, 1)


# ---------------------------------------------------------------- damaged files / records
def _flip(root: Path) -> Path:
    path = step_dir(root, 12) / DATA
    flip_bytes(path)
    return path


def _truncate(root: Path) -> Path:
    path = step_dir(root, 12) / DATA
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _zero(root: Path) -> Path:
    path = step_dir(root, 12) / DATA
    path.write_bytes(b"")
    return path


def _delete_data_file(root: Path) -> Path:
    path = step_dir(root, 12) / DATA
    path.unlink()
    return path


def _delete_record(root: Path) -> Path:
    path = step_dir(root, 12) / DIGESTS_NAME
    path.unlink()
    return path


def _garbage_record(root: Path) -> Path:
    path = step_dir(root, 12) / DIGESTS_NAME
    path.write_bytes(path.read_bytes()[:40])
    return path


def _edited_record(root: Path) -> Path:
    """Valid JSON whose recorded digest was changed (e.g. a bit flip inside a hex digit)."""
    path = step_dir(root, 12) / DIGESTS_NAME
    data = json.loads(path.read_text())
    digest = data["files"][DATA]["sha256"]
    data["files"][DATA]["sha256"] = ("0" if digest[0] != "0" else "1") + digest[1:]
    path.write_text(json.dumps(data))
    return path


def _files_of_another_step(root: Path) -> Path:
    """step 8's files copied into step 12 with a matching digests record: the recipe state tells."""
    for name in (".metadata", DATA):
        shutil.copyfile(step_dir(root, 8) / name, step_dir(root, 12) / name)
    write_digests(step_dir(root, 12))
    return step_dir(root, 12) / DATA


def _foreign_data_file(root: Path) -> Path:
    """A data file of another rank beside step 12's files: DCP's metadata does not reference it."""
    path = step_dir(root, 12) / "__1_0.distcp"
    shutil.copyfile(step_dir(root, 12) / DATA, path)
    return path


# fault -> (damage, what the refusal says); the digests record names these
FAULTS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "64_flipped_bytes": (_flip, r"sha256 [0-9a-f]+\.\.\. differs from recpipe_digests\.json's"),
    "truncated": (_truncate, r"\d+ bytes, but recpipe_digests\.json records \d+ \(truncated"),
    "zero_bytes": (_zero, r"0 bytes, but recpipe_digests\.json records \d+"),
    "data_file_missing": (_delete_data_file, r"missing \(recpipe_digests\.json lists it\)"),
    "record_missing": (_delete_record, r"missing: the checkpoint was not written by .*or its save did not finish"),
    "record_truncated": (_garbage_record, r"unreadable \(JSONDecodeError"),
    "record_edited": (_edited_record, r"does not match its own sha256"),
    "foreign_data_file": (_foreign_data_file, r"not listed in recpipe_digests\.json: a data file this checkpoint's"),
}
# intact files of another checkpoint: the recipe's own check of its state names them
RECIPE_FAULTS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "files_of_another_step": (
        _files_of_another_step,
        r"recipe state \(step, rank, world size\) is \(8, 0, 1\), expected \(12, 0, 1\)",
    )
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_verify_names_the_damaged_file(ckpt: Path, fault: str) -> None:
    damage, problem = FAULTS[fault]
    damaged = damage(ckpt)
    with pytest.raises(CheckpointIntegrityError, match=problem) as e:
        verify_checkpoint(step_dir(ckpt, 12))
    assert e.value.problems[0][0] == str(damaged) and str(damaged) in str(e.value)
    verify_checkpoint(step_dir(ckpt, 8))  # the older checkpoint is untouched


@pytest.mark.parametrize("fault", sorted(RECIPE_FAULTS))
def test_strict_load_names_a_file_of_another_checkpoint(ckpt: Path, fault: str) -> None:
    damage, problem = RECIPE_FAULTS[fault]
    damaged = damage(ckpt)
    verify_checkpoint(step_dir(ckpt, 12))  # its files are intact
    config = TrainConfig(**SMALL, max_steps=RESUME_TO, checkpoint_dir=str(ckpt), resume=True)
    with _fresh_run_state(config) as (model, optimizer, table_ranks):
        with pytest.raises(CheckpointCorruptError, match=problem) as e:
            load_checkpoint(str(ckpt), model, optimizer, config, step=12)
    assert e.value.path == damaged and str(damaged) in str(e.value)


@pytest.mark.parametrize("fault", sorted({**FAULTS, **RECIPE_FAULTS}))
def test_resume_falls_back_to_the_newest_intact_checkpoint(
    ckpt: Path, pristine: tuple[Path, list[float]], fault: str
) -> None:
    damage, problem = {**FAULTS, **RECIPE_FAULTS}[fault]
    damaged = damage(ckpt)
    result, stdout = _resume(ckpt)
    assert result.start_step == 8
    # bit-identical to the run that was never interrupted
    assert result.losses == pristine[1][8:RESUME_TO]
    (line,) = _resume_lines(stdout)
    assert "damaged checkpoint step_00000012" in line and str(damaged) in line
    assert re.search(problem, line), line
    assert f"resuming from {step_dir(ckpt, 8)} instead" in line
    # the resumed run saved step 12 again over the damaged one: it verifies now
    verify_checkpoint(step_dir(ckpt, 12))
    verify_checkpoint(step_dir(ckpt, RESUME_TO))
    assert (ckpt / "latest").read_text() == f"{RESUME_TO}\n"


# ---------------------------------------------------------------- the latest marker
def _latest_garbage(root: Path) -> None:
    (root / "latest").write_text("x7\n")


def _latest_empty(root: Path) -> None:
    (root / "latest").write_bytes(b"")


def _latest_missing(root: Path) -> None:
    (root / "latest").unlink()


def _latest_names_a_missing_step(root: Path) -> None:
    (root / "latest").write_text("99\n")


def _latest_garbage_and_newest_flipped(root: Path) -> None:
    _latest_garbage(root)
    _flip(root)


def _save_crashed_before_its_record(root: Path) -> None:
    """DCP's files of step 16 exist, its digests record and the new ``latest`` do not."""
    d = step_dir(root, 16)
    d.mkdir()
    for name in (".metadata", DATA):
        shutil.copyfile(step_dir(root, 12) / name, d / name)


def _crashed_save_and_latest_missing(root: Path) -> None:
    _save_crashed_before_its_record(root)
    _latest_missing(root)


LATEST_FAULTS: dict[str, tuple[Callable[[Path], None], int, list[str]]] = {
    # fault -> (step resumed from, what the one resume line must say; [] = no line)
    "garbage": (_latest_garbage, 12, ["latest holds 'x7', not a step number"]),
    "empty": (_latest_empty, 12, ["latest holds '', not a step number"]),
    "missing": (_latest_missing, 12, ["latest is missing"]),
    "names_missing_step": (_latest_names_a_missing_step, 12, ["names step 99, which has no directory"]),
    "garbage_and_newest_flipped": (
        _latest_garbage_and_newest_flipped,
        8,
        ["not a step number", "damaged checkpoint step_00000012"],
    ),
    "crashed_save": (_save_crashed_before_its_record, 12, []),
    "crashed_save_and_latest_missing": (
        _crashed_save_and_latest_missing,
        12,
        ["latest is missing", "damaged checkpoint step_00000016", DIGESTS_NAME],
    ),
}


def test_resume_names_changed_learning_rates(ckpt: Path, pristine: tuple[Path, list[float]]) -> None:
    # A new learning rate on resume is legitimate, but the run no longer continues the
    # saved one: the resume line says so, naming old and new values.
    lr = SMALL.get("dense_lr", TrainConfig.dense_lr)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run(
            TrainConfig(**{**SMALL, "dense_lr": lr * 2}, max_steps=RESUME_TO, checkpoint_dir=str(ckpt), resume=True)
        )
    expected = (
        f"[recpipe] resumed from {step_dir(ckpt, SAVED_STEPS)}; changed since it was saved: "
        f"dense_lr {lr!r} -> {lr * 2!r} (training continues with the new values, so losses differ "
        "from an uninterrupted run's)"
    )
    assert expected in out.getvalue().splitlines(), out.getvalue()
    assert result.start_step == SAVED_STEPS and result.losses != pristine[1][SAVED_STEPS:RESUME_TO]


def test_clean_resume_says_where_it_resumed_and_a_short_segment_reports_throughput(
    ckpt: Path, pristine: tuple[Path, list[float]], tmp_path: Path
) -> None:
    # Resuming at 12 of 16 steps with log_every=4: one logging interval, whose throughput
    # is finite (and metrics.json strict JSON).
    metrics = tmp_path / "m.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run(
            TrainConfig(**SMALL, max_steps=RESUME_TO, checkpoint_dir=str(ckpt), resume=True, metrics_file=str(metrics))
        )
    assert result.start_step == SAVED_STEPS and result.losses == pristine[1][SAVED_STEPS:RESUME_TO]
    assert f"[recpipe] resumed from {step_dir(ckpt, SAVED_STEPS)}" in out.getvalue().splitlines()
    assert _resume_lines(out.getvalue()) == []  # nothing skipped: no fallback note
    assert math.isfinite(result.samples_per_s) and result.samples_per_s > 0
    saved = json.loads(metrics.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert saved["samples_per_s"] == pytest.approx(result.samples_per_s)
    assert saved["start_step"] == SAVED_STEPS and saved["steps"] == RESUME_TO


@pytest.mark.parametrize("fault", sorted(LATEST_FAULTS))
def test_resume_survives_a_damaged_latest_marker(ckpt: Path, pristine: tuple[Path, list[float]], fault: str) -> None:
    damage, start, says = LATEST_FAULTS[fault]
    damage(ckpt)
    result, stdout = _resume(ckpt)
    assert result.start_step == start
    assert result.losses == pristine[1][start:RESUME_TO]
    lines = _resume_lines(stdout)
    if says:
        (line,) = lines
        for text in says:
            assert text in line, line
        assert f"resuming from {step_dir(ckpt, start)} instead" in line
    else:
        assert lines == []
    assert (ckpt / "latest").read_text() == f"{RESUME_TO}\n"


def _cli_args(root: Path, *more: str) -> list[str]:
    """The command line of a ``SMALL`` run into ``root`` (``RESUME_TO`` steps, a save every 4)."""
    flags = [
        f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
        for k, v in SMALL.items()
        if k != "progress_bar"
    ]
    return [
        *flags,
        "--no-progress-bar",
        f"--max-steps={RESUME_TO}",
        f"--checkpoint-dir={root}",
        "--checkpoint-every=4",
        *more,
    ]


@pytest.mark.parametrize("resume", [False, True], ids=["fresh_run", "resume"])
def test_latest_as_a_directory_is_refused_at_start_naming_it_and_the_fix(ckpt: Path, resume: bool) -> None:
    """A ``latest`` that is a directory would fail every save's commit (and tell --resume nothing):
    the run refuses it before it builds or trains anything, naming the path and the fix; the
    entry point prints it as one error line and exits 1."""
    latest = ckpt / "latest"
    latest.unlink()
    latest.mkdir()
    before = _listing(ckpt)
    config = TrainConfig(**SMALL, max_steps=RESUME_TO, checkpoint_dir=str(ckpt), checkpoint_every=4, resume=resume)
    out = io.StringIO()
    with pytest.raises(CheckpointDirectoryError) as e, contextlib.redirect_stdout(out):
        run(config)
    msg = str(e.value)
    assert msg.startswith(f"checkpoints cannot be saved into {ckpt}: {latest} is a directory"), msg
    assert f"Fix: move {latest} out of {ckpt} (or delete it), or pass another --checkpoint-dir" in msg, msg
    assert "[recpipe] step " not in out.getvalue()  # refused before the first step
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(_cli_args(ckpt, *(["--resume"] if resume else [])))
    assert code == 1 and err.getvalue() == f"error: CheckpointDirectoryError: {msg}\n", err.getvalue()
    assert _listing(ckpt) == before and latest.is_dir()  # nothing trained, nothing saved


# ---------------------------------------------------------------- nothing intact
def _damage_everything(root: Path) -> list[Path]:
    paths = []
    for step in (4, 8):
        path = step_dir(root, step) / DATA
        flip_bytes(path)
        paths.append(path)
    paths.append(_delete_record(root))
    return paths


def _listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_resume_with_no_intact_checkpoint_raises_and_trains_nothing(ckpt: Path) -> None:
    damaged = _damage_everything(ckpt)
    before = _listing(ckpt)
    with pytest.raises(NoIntactCheckpointError) as e:
        _resume(ckpt)
    for path in damaged:
        assert str(path) in str(e.value)
    assert _listing(ckpt) == before  # nothing trained, nothing saved


def test_cli_resume_with_no_intact_checkpoint_exits_non_zero(ckpt: Path) -> None:
    _damage_everything(ckpt)
    before = _listing(ckpt)
    args = [
        f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
        for k, v in SMALL.items()
        if k != "progress_bar"
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recpipe.recipes.train",
            *args,
            "--no-progress-bar",
            f"--max-steps={RESUME_TO}",
            f"--checkpoint-dir={ckpt}",
            "--resume",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1", TORCHELASTIC_ERROR_FILE=str(ckpt.parent / "error.json")),
    )
    assert proc.returncode == 1, proc.stdout[-2000:]
    # torchrun / torchx read the failure from torchelastic's error file: the message, no call stack
    reported = json.loads((ckpt.parent / "error.json").read_text())["message"]
    assert reported["message"].startswith("NoIntactCheckpointError: resume=True but no checkpoint in")
    assert reported["extraInfo"]["py_callstack"] == reported["message"]
    assert "NoIntactCheckpointError" in proc.stderr and "no checkpoint in" in proc.stderr, proc.stderr[-3000:]
    # one message, no traceback: it names the damage and the fixes
    assert "Traceback" not in proc.stderr and "\nerror: NoIntactCheckpointError: resume=True" in "\n" + proc.stderr
    assert "[recpipe] step " not in proc.stdout  # never silently started from scratch
    assert _listing(ckpt) == before


# ---------------------------------------------------------------- strict load, save refusal
@contextlib.contextmanager
def _fresh_run_state(config: TrainConfig) -> Iterator[tuple[torch.nn.Module, Any, dict[str, Any]]]:
    """The recipe's model, optimizer and placement on one rank, as ``run`` builds them."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        source = make_data_source(config, 0, 1)
        torch.manual_seed(config.seed)
        model = build_model(config, source.spec, dense_device=torch.device("cpu"))
        sharded = shard_model(config, model, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
        yield sharded.model, make_optimizer(config, sharded.model), sharded.table_ranks
    finally:
        dist.destroy_process_group()


def _dense_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_strict_load_raises_before_touching_the_model(ckpt: Path) -> None:
    damaged = _flip(ckpt)
    config = TrainConfig(**SMALL, max_steps=RESUME_TO, checkpoint_dir=str(ckpt), resume=True)
    with _fresh_run_state(config) as (model, optimizer, table_ranks):
        before = _dense_state(model)
        with pytest.raises(CheckpointCorruptError, match="sha256") as e:
            load_checkpoint(str(ckpt), model, optimizer, config, step=12)
        assert e.value.path == damaged
        after = _dense_state(model)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert load_checkpoint(str(ckpt), model, optimizer, config, step=8) == 8
        assert any(not torch.equal(before[k], v) for k, v in _dense_state(model).items())


def test_save_refuses_non_finite_weights(tmp_path: Path) -> None:
    config = TrainConfig(**SMALL, max_steps=4)
    root = tmp_path / "ckpt"
    with _fresh_run_state(config) as (model, optimizer, table_ranks):
        save_checkpoint(str(root), 1, model, optimizer, config, table_ranks)
        name, param = next((n, p) for n, p in model.named_parameters() if "over_arch" in n)
        with torch.no_grad():
            param.view(-1)[3] = float("nan")
        with pytest.raises(NonFiniteStateError, match="over_arch") as e:
            save_checkpoint(str(root), 2, model, optimizer, config, table_ranks)
    assert "step 2" in str(e.value)
    assert sorted(p.name for p in root.iterdir()) == [".recpipe_save.lock", "latest", "step_00000001"]
    assert (root / "latest").read_text() == "1\n"
