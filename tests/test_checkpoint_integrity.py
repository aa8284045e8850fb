"""Checkpoint integrity: atomic saves with a sha256 manifest, verified loads, resume fallback.

Each fault is applied to a copy of a real checkpoint directory written by the recipe
(``recpipe.recipes.train.run``, 1 rank; 2 gloo ranks where ranks could disagree), and
checked three ways: :func:`verify_checkpoint` / a strict :func:`load_checkpoint` name
the damaged file, ``--resume`` falls back to the newest intact checkpoint with one
line saying so and then reproduces the uninterrupted run's losses exactly, and with
nothing intact resume fails (non-zero exit from the CLI) without training.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from gloo_harness import run_gloo
from torchrec.distributed.types import ShardingEnv

from recpipe.recipes.build import make_optimizer, shard_model
from recpipe.recipes.checkpoint import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    NoIntactCheckpointError,
    NonFiniteStateError,
    load_checkpoint,
    read_manifest,
    reseal_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data.registry import make_data_source
from recpipe.recipes.models import build_model
from recpipe.recipes.train import run
from test_recipes_dist import SMALL_SYNTHETIC

# the small synthetic DLRM run of the recipe tests
SMALL: dict[str, Any] = SMALL_SYNTHETIC
SAVED_STEPS = 12  # the saved run: checkpoints at 4, 8, 12
RESUME_TO = 16


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def flip_bytes(path: Path, count: int = 64) -> None:
    """Inverts ``count`` bytes spread over the file's second half (tensor data)."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    stride = max(1, (len(data) - start) // (count + 1))
    for i in range(count):
        data[start + (i + 1) * stride - 1] ^= 0xFF
    path.write_bytes(bytes(data))


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
def test_save_is_committed_by_a_manifest_of_sha256_then_latest(pristine: tuple[Path, list[float]]) -> None:
    root, _ = pristine
    assert (root / "latest").read_text() == f"{SAVED_STEPS}\n"
    assert sorted(p.name for p in root.iterdir()) == [".recpipe_save.lock", "latest", "step_00000004", "step_00000008",
                                                      "step_00000012"]
    for step in (4, 8, 12):
        d = step_dir(root, step)
        assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "rank0.pt"]  # no temporary left
        manifest = json.loads((d / "manifest.json").read_text())
        data = (d / "rank0.pt").read_bytes()
        assert manifest["step"] == step and manifest["world_size"] == 1
        assert manifest["files"] == {"rank0.pt": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
        assert verify_checkpoint(d)["files"] == manifest["files"]


# ---------------------------------------------------------------- damaged rank files / manifests
def _flip(root: Path) -> Path:
    path = step_dir(root, 12) / "rank0.pt"
    flip_bytes(path)
    return path


def _truncate(root: Path) -> Path:
    path = step_dir(root, 12) / "rank0.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _zero(root: Path) -> Path:
    path = step_dir(root, 12) / "rank0.pt"
    path.write_bytes(b"")
    return path


def _delete_rank_file(root: Path) -> Path:
    path = step_dir(root, 12) / "rank0.pt"
    path.unlink()
    return path


def _delete_manifest(root: Path) -> Path:
    path = step_dir(root, 12) / "manifest.json"
    path.unlink()
    return path


def _garbage_manifest(root: Path) -> Path:
    path = step_dir(root, 12) / "manifest.json"
    path.write_bytes(path.read_bytes()[:40])
    return path


def _edited_manifest(root: Path) -> Path:
    """Valid JSON whose recorded digest was changed (e.g. a bit flip inside a hex digit)."""
    path = step_dir(root, 12) / "manifest.json"
    data = json.loads(path.read_text())
    digest = data["files"]["rank0.pt"]["sha256"]
    data["files"]["rank0.pt"]["sha256"] = ("0" if digest[0] != "0" else "1") + digest[1:]
    path.write_text(json.dumps(data))
    return path


def _unpicklable_resealed(root: Path) -> Path:
    """Junk bytes whose digest was recorded: only unpickling can tell."""
    path = step_dir(root, 12) / "rank0.pt"
    path.write_bytes(b"this is not a torch checkpoint\n" * 64)
    reseal_checkpoint(path.parent)
    return path


def _file_of_another_step(root: Path) -> Path:
    """step 8's rank file copied into step 12 with a matching manifest: its metadata tells."""
    path = step_dir(root, 12) / "rank0.pt"
    shutil.copyfile(step_dir(root, 8) / "rank0.pt", path)
    reseal_checkpoint(path.parent)
    return path


FAULTS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "64_flipped_bytes": (_flip, r"sha256 [0-9a-f]+\.\.\. differs from manifest\.json's"),
    "truncated": (_truncate, r"\d+ bytes, but manifest\.json records \d+ \(truncated"),
    "zero_bytes": (_zero, r"0 bytes, but manifest\.json records \d+"),
    "rank_file_missing": (_delete_rank_file, r"missing \(manifest\.json lists it\)"),
    "manifest_missing": (_delete_manifest, r"missing: the save did not finish"),
    "manifest_truncated": (_garbage_manifest, r"unreadable \(JSONDecodeError"),
    "manifest_edited": (_edited_manifest, r"does not match its own sha256"),
    "unpicklable_content": (_unpicklable_resealed, r"cannot be unpickled"),
    "file_of_another_step": (_file_of_another_step, r"metadata .* is \(8, 0, 1\), expected \(12, 0, 1\)"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_verify_names_the_damaged_file(ckpt: Path, fault: str) -> None:
    damage, problem = FAULTS[fault]
    damaged = damage(ckpt)
    with pytest.raises(CheckpointCorruptError, match=problem) as e:
        verify_checkpoint(step_dir(ckpt, 12))
    assert e.value.path == damaged and str(damaged) in str(e.value)
    verify_checkpoint(step_dir(ckpt, 8))  # the older checkpoint is untouched


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_resume_falls_back_to_the_newest_intact_checkpoint(
    ckpt: Path, pristine: tuple[Path, list[float]], fault: str
) -> None:
    damage, problem = FAULTS[fault]
    damaged = damage(ckpt)
    result, stdout = _resume(ckpt)
    assert result.start_step == 8
    # bit-identical to the run that was never interrupted
    assert result.losses == pristine[1][8:RESUME_TO]
    (line,) = _resume_lines(stdout)
    assert "damaged checkpoint step_00000012" in line and str(damaged) in line
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


def _save_crashed_before_its_manifest(root: Path) -> None:
    """A rank file of step 16 exists, its manifest and the new ``latest`` do not."""
    d = step_dir(root, 16)
    d.mkdir()
    shutil.copyfile(step_dir(root, 12) / "rank0.pt", d / "rank0.pt")


def _crashed_save_and_latest_missing(root: Path) -> None:
    _save_crashed_before_its_manifest(root)
    _latest_missing(root)


LATEST_FAULTS: dict[str, tuple[Callable[[Path], None], int, list[str]]] = {
    # fault -> (step resumed from, what the one resume line must say; [] = no line)
    "garbage": (_latest_garbage, 12, ["latest holds 'x7', not a step number"]),
    "empty": (_latest_empty, 12, ["latest holds '', not a step number"]),
    "missing": (_latest_missing, 12, ["latest is missing"]),
    "names_missing_step": (_latest_names_a_missing_step, 12, ["names step 99, which has no directory"]),
    "garbage_and_newest_flipped": (
        _latest_garbage_and_newest_flipped, 8, ["not a step number", "damaged checkpoint step_00000012"]
    ),
    "crashed_save": (_save_crashed_before_its_manifest, 12, []),
    "crashed_save_and_latest_missing": (
        _crashed_save_and_latest_missing, 12, ["latest is missing", "damaged checkpoint step_00000016", "manifest.json"]
    ),
}


def test_resume_names_changed_learning_rates(ckpt: Path, pristine: tuple[Path, list[float]]) -> None:
    # A new learning rate on resume is legitimate, but the run no longer continues the
    # saved one: the resume line says so, naming old and new values.
    lr = SMALL.get("dense_lr", TrainConfig.dense_lr)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run(TrainConfig(**{**SMALL, "dense_lr": lr * 2}, max_steps=RESUME_TO, checkpoint_dir=str(ckpt),
                                 resume=True))
    expected = (f"[recpipe] resumed from {step_dir(ckpt, SAVED_STEPS)}; changed since it was saved: "
                f"dense_lr {lr!r} -> {lr * 2!r} (training continues with the new values, so losses differ "
                "from an uninterrupted run's)")
    assert expected in out.getvalue().splitlines(), out.getvalue()
    assert result.start_step == SAVED_STEPS and result.losses != pristine[1][SAVED_STEPS:RESUME_TO]


def test_clean_resume_says_where_it_resumed_and_a_short_segment_reports_throughput(
    ckpt: Path, pristine: tuple[Path, list[float]], tmp_path: Path
) -> None:
    # Resuming at 12 of 16 steps with log_every=4: one logging interval, which used to
    # leave throughput NaN (and metrics.json with a NaN, not strict JSON).
    metrics = tmp_path / "m.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run(TrainConfig(**SMALL, max_steps=RESUME_TO, checkpoint_dir=str(ckpt), resume=True,
                                 metrics_file=str(metrics)))
    assert result.start_step == SAVED_STEPS and result.losses == pristine[1][SAVED_STEPS:RESUME_TO]
    assert f"[recpipe] resumed from {step_dir(ckpt, SAVED_STEPS)}" in out.getvalue().splitlines()
    assert _resume_lines(out.getvalue()) == []  # nothing skipped: no fallback note
    assert math.isfinite(result.samples_per_s) and result.samples_per_s > 0
    saved = json.loads(metrics.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert saved["samples_per_s"] == pytest.approx(result.samples_per_s)
    assert saved["start_step"] == SAVED_STEPS and saved["steps"] == RESUME_TO


@pytest.mark.parametrize("fault", sorted(LATEST_FAULTS))
def test_resume_survives_a_damaged_latest_marker(
    ckpt: Path, pristine: tuple[Path, list[float]], fault: str
) -> None:
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


# ---------------------------------------------------------------- nothing intact
def _damage_everything(root: Path) -> list[Path]:
    paths = []
    for step in (4, 8):
        path = step_dir(root, step) / "rank0.pt"
        flip_bytes(path)
        paths.append(path)
    paths.append(_delete_manifest(root))
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
    args = [f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
            for k, v in SMALL.items() if k != "progress_bar"]
    proc = subprocess.run(
        [sys.executable, "-m", "recpipe.recipes.train", *args, "--no-progress-bar",
         f"--max-steps={RESUME_TO}", f"--checkpoint-dir={ckpt}", "--resume"],
        capture_output=True, text=True, timeout=600,
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
            load_checkpoint(str(ckpt), model, optimizer, config, table_ranks, step=12)
        assert e.value.path == damaged
        after = _dense_state(model)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert load_checkpoint(str(ckpt), model, optimizer, config, table_ranks, step=8) == 8
        assert any(not torch.equal(before[k], v) for k, v in _dense_state(model).items())


@pytest.mark.parametrize("checkpoint_format", ["pt", "dcp"])
def test_save_refuses_non_finite_weights(tmp_path: Path, checkpoint_format: str) -> None:
    config = TrainConfig(**SMALL, max_steps=4, checkpoint_format=checkpoint_format)
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


class _FullDiskFile(io.RawIOBase):
    """A writable file on a disk that fills up after ``room`` bytes (then ENOSPC, as
    ``write(2)`` reports it); it writes through to the real file until then."""

    def __init__(self, real: Any, room: int) -> None:
        super().__init__()
        self.real, self.room = real, room

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= n
        return self.real.write(data)

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:
        self.real.close()
        super().close()


def test_a_full_disk_during_a_pt_save_is_a_checkpoint_write_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save's zip writer turns the OSError of a failed write into a RuntimeError
    ("unexpected pos"), which the save's OSError handling missed: rank 0 crashed with a
    traceback (the other ranks then lost their peer) and left its partial ``.tmp`` file.
    It is a CheckpointWriteError naming the OS error; ``latest`` still names the last
    good checkpoint, which loads, and no partial file is left."""
    import builtins

    from recpipe.pipeline.checkpoint import integrity as _integrity  # opens the rank file's temporary file (atomic_file)
    from recpipe.recipes.checkpoint import CheckpointWriteError

    def full_disk_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        real = builtins.open(file, mode, *args, **kwargs)
        return _FullDiskFile(real, room=4096) if str(file).endswith(".pt.tmp") else real

    config = TrainConfig(**SMALL, max_steps=4)
    root = tmp_path / "ckpt"
    with _fresh_run_state(config) as (model, optimizer, table_ranks):
        save_checkpoint(str(root), 1, model, optimizer, config, table_ranks)
        with monkeypatch.context() as m:
            m.setattr(_integrity, "open", full_disk_open, raising=False)
            with pytest.raises(CheckpointWriteError) as err:
                save_checkpoint(str(root), 2, model, optimizer, config, table_ranks)
        assert load_checkpoint(str(root), model, optimizer, config, table_ranks) == 1
    msg = str(err.value)
    assert msg.startswith("checkpoint of step 2 was not committed: rank 0: writing"), msg
    assert "OSError: [Errno 28] No space left on device" in msg and "free space" in msg, msg
    assert (root / "latest").read_text() == "1\n"
    assert sorted(p.name for p in step_dir(root, 2).iterdir()) == []  # no partial rank0.pt.tmp


# ---------------------------------------------------------------- 2 ranks
def _two_rank_body(rank: int, world_size: int, root: str, placement: str) -> dict[str, Any]:
    base = dict(SMALL, placement=placement)
    whole = run(TrainConfig(**base, max_steps=12))
    run(TrainConfig(**base, max_steps=8, checkpoint_dir=root, checkpoint_every=4))
    manifest = read_manifest(Path(root) / "step_00000008")
    dist.barrier()
    if rank == 0:  # only rank 1's file of the newest checkpoint is damaged
        flip_bytes(Path(root) / "step_00000008" / "rank1.pt")
    dist.barrier()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        resumed = run(TrainConfig(**base, max_steps=12, checkpoint_dir=root, resume=True))
    return {
        "whole": whole.losses,
        "start": resumed.start_step,
        "resumed": resumed.losses,
        "lines": _resume_lines(out.getvalue()),
        "manifest_files": manifest["files"],
    }


@pytest.mark.parametrize("placement", ["table_wise", "planned"])
def test_two_ranks_agree_on_the_fallback(tmp_path: Path, placement: str) -> None:
    # table_wise: each rank reads only its own file, so rank 0 alone would load step 8;
    # planned (tiered tables): every rank reads every file.
    root = tmp_path / "ckpt"
    outs = run_gloo(2, _two_rank_body, str(root), placement, timeout_s=300)
    for rank, out in enumerate(outs):
        assert out["start"] == 4, f"rank {rank}"
        assert out["resumed"] == out["whole"][4:12], f"rank {rank}"
    damaged = step_dir(root, 8) / "rank1.pt"
    (line,) = outs[0]["lines"]
    assert "damaged checkpoint step_00000008" in line and str(damaged) in line and "sha256" in line
    assert outs[1]["lines"] == []  # printed once, by rank 0
    # both ranks' digests reached the manifest (the step-8 save before the damage)
    files = outs[0]["manifest_files"]
    assert sorted(files) == ["rank0.pt", "rank1.pt"]
    assert files["rank0.pt"]["sha256"] == hashlib.sha256((step_dir(root, 8) / "rank0.pt").read_bytes()).hexdigest()
    verify_checkpoint(step_dir(root, 12))
    # a 2-rank checkpoint on 1 rank is a mismatch (fatal), not damage (no fallback)
    with pytest.raises(CheckpointMismatchError, match=r"manifest\.json does not fit this run: world size 2"):
        run(TrainConfig(**SMALL, placement=placement, max_steps=16, checkpoint_dir=str(root), resume=True))
