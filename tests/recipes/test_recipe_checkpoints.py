"""Recipe checkpoints through ``recpipe.pipeline.checkpoint`` (DCP), per placement.

The model (tiered tables included), its fused optimizer and each rank's recipe state
(dense optimizer, step, metadata: the save's ``extra_state``) go into one DCP checkpoint.
Checked here: the digests record covers every file and the recipe state travels inside;
resume is exact (losses bit-identical to an uninterrupted run) on 1 and 2 gloo ranks with
planned (tiered) and table_wise placement; a flipped byte in a ``.distcp`` file or
``.metadata`` is refused naming the file and ``--resume`` falls back to the newest intact
checkpoint; a checkpoint saved by 2 ranks loads on 1 rank with every table row equal, and
training goes on; the retired ``--checkpoint-format`` flag is refused by name.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
from harness.gloo import run_gloo
from harness.recipe_configs import SMALL, flip_bytes, step_dir
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.types import ShardingEnv

from recpipe.pipeline.checkpoint import DIGESTS_NAME, CheckpointIntegrityError, read_extra_state, verify_checkpoint
from recpipe.recipes.build import make_optimizer, shard_model
from recpipe.recipes.checkpoint_policy import load_checkpoint, save_checkpoint
from recpipe.recipes.cli import parse_config
from recpipe.recipes.config import ConfigError, TrainConfig
from recpipe.recipes.data.registry import make_data_source
from recpipe.recipes.models import build_model
from recpipe.recipes.train import run

DCP: dict[str, Any] = dict(SMALL)
SAVED_STEPS = 12  # the saved run: checkpoints at 4, 8, 12
RESUME_TO = 16


def _resume_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("[recpipe] resume:")]


def _resume(root: Path, base: dict[str, Any], max_steps: int) -> tuple[Any, list[str]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run(
            TrainConfig(**base, max_steps=max_steps, checkpoint_dir=str(root), checkpoint_every=4, resume=True)
        )
    return result, _resume_lines(out.getvalue())


@pytest.fixture(scope="module", params=["planned", "table_wise"])
def pristine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[float], dict[str, Any]]:
    """A dcp checkpoint directory (steps 4, 8, 12) and the losses of an uninterrupted 16-step run."""
    base = dict(DCP, placement=request.param)
    root = tmp_path_factory.mktemp(f"dcp_{request.param}") / "ckpt"
    saved = run(TrainConfig(**base, max_steps=SAVED_STEPS, checkpoint_dir=str(root), checkpoint_every=4))
    reference = run(TrainConfig(**base, max_steps=RESUME_TO))
    assert saved.losses == reference.losses[:SAVED_STEPS]
    return root, reference.losses, base


@pytest.fixture
def ckpt(pristine: tuple[Path, list[float], dict[str, Any]], tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(pristine[0], root)
    return root


def test_the_retired_checkpoint_format_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unrecognized arguments: --checkpoint-format pt"):
        parse_config(["--dataset", "synthetic", "--max-steps", "4", "--checkpoint-format", "pt"])
    config = tmp_path / "c.yaml"
    config.write_text("checkpoint_format: dcp\n")
    with pytest.raises(ConfigError, match=r"unknown keys \['checkpoint_format'\]"):
        parse_config(["--config", str(config)])


def test_digests_record_every_dcp_file(pristine: tuple[Path, list[float], dict[str, Any]]) -> None:
    root, _, _ = pristine
    assert (root / "latest").read_text() == f"{SAVED_STEPS}\n"
    for step in (4, 8, 12):
        d = step_dir(root, step)
        names = sorted(p.name for p in d.iterdir())
        assert names == [".metadata", "__0_0.distcp", DIGESTS_NAME]  # no temporary left
        record = json.loads((d / DIGESTS_NAME).read_text())
        assert record["files"] == {
            n: {"bytes": (d / n).stat().st_size, "sha256": hashlib.sha256((d / n).read_bytes()).hexdigest()}
            for n in names
            if n != DIGESTS_NAME
        }
        verify_checkpoint(d)
        extra = read_extra_state(d, 0)  # the recipe state lives in DCP's files too
        assert extra is not None and sorted(extra.value) == ["meta", "optimizer"]
        assert extra.value["meta"]["step"] == step and extra.world_size == 1


def test_resume_is_exact(ckpt: Path, pristine: tuple[Path, list[float], dict[str, Any]]) -> None:
    _, reference, base = pristine
    result, lines = _resume(ckpt, base, RESUME_TO)
    assert result.start_step == SAVED_STEPS and lines == []
    assert result.losses == reference[SAVED_STEPS:RESUME_TO]  # bit-identical
    verify_checkpoint(step_dir(ckpt, RESUME_TO))


def test_resume_with_another_placement_kind_moves_the_tables(
    ckpt: Path, pristine: tuple[Path, list[float], dict[str, Any]]
) -> None:
    """dcp moves tables between tiered and torchrec placements (--placement planned <->
    table_wise): the resume names the change and trains on from the saved tables, whose
    losses stay those of the uninterrupted run (up to the two kernels' float sums)."""
    _, reference, base = pristine
    other = "table_wise" if base["placement"] == "planned" else "planned"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run(
            TrainConfig(
                **dict(base, placement=other),
                max_steps=RESUME_TO,
                checkpoint_dir=str(ckpt),
                checkpoint_every=4,
                resume=True,
            )
        )
    assert result.start_step == SAVED_STEPS
    resumed = [line for line in out.getvalue().splitlines() if line.startswith("[recpipe] resumed from")]
    assert len(resumed) == 1 and f"placement {base['placement']!r} -> {other!r}" in resumed[0], out.getvalue()
    np.testing.assert_allclose(result.losses, reference[SAVED_STEPS:RESUME_TO], rtol=1e-4, atol=1e-5)


def _flip_distcp(root: Path) -> Path:
    path = step_dir(root, 12) / "__0_0.distcp"
    flip_bytes(path, count=1)
    return path


def _flip_metadata(root: Path) -> Path:
    path = step_dir(root, 12) / ".metadata"
    flip_bytes(path, count=1)
    return path


def _truncate_distcp(root: Path) -> Path:
    path = step_dir(root, 12) / "__0_0.distcp"
    path.write_bytes(path.read_bytes()[:-1])
    return path


FAULTS = {
    "distcp_flipped_byte": (_flip_distcp, r"sha256 [0-9a-f]+\.\.\. differs from recpipe_digests\.json's"),
    "metadata_flipped_byte": (_flip_metadata, r"sha256 [0-9a-f]+\.\.\. differs from recpipe_digests\.json's"),
    "distcp_truncated": (_truncate_distcp, r"\d+ bytes, but recpipe_digests\.json records \d+ \(truncated"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_damaged_dcp_file_is_named_and_resume_falls_back(
    ckpt: Path, pristine: tuple[Path, list[float], dict[str, Any]], fault: str
) -> None:
    _, reference, base = pristine
    damage, problem = FAULTS[fault]
    damaged = damage(ckpt)
    with pytest.raises(CheckpointIntegrityError, match=problem) as e:
        verify_checkpoint(step_dir(ckpt, 12))
    assert e.value.problems[0][0] == str(damaged) and str(damaged) in str(e.value)
    result, lines = _resume(ckpt, base, RESUME_TO)
    assert result.start_step == 8
    assert result.losses == reference[8:RESUME_TO]  # bit-identical to the uninterrupted run
    (line,) = lines
    assert "damaged checkpoint step_00000012" in line and str(damaged) in line
    assert f"resuming from {step_dir(ckpt, 8)} instead" in line
    verify_checkpoint(step_dir(ckpt, 12))  # saved again over the damaged one
    assert (ckpt / "latest").read_text() == f"{RESUME_TO}\n"


# ---------------------------------------------------------------- model state helpers
def _build(config: TrainConfig) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """The recipe's model, optimizer and placement on the initialised process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    source = make_data_source(config, rank, world)
    torch.manual_seed(config.seed)
    model = build_model(config, source.spec, dense_device=torch.device("cpu"))
    sharded = shard_model(config, model, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    return sharded.model, make_optimizer(config, sharded.model), sharded.table_ranks


@contextlib.contextmanager
def _one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rows(model: torch.nn.Module) -> dict[str, dict[int, torch.Tensor]]:
    """This rank's table rows: tiered ones by global id (weights and row-wise optimizer
    state), torchrec ShardedTensor tables by global row offset."""
    out: dict[str, dict[int, torch.Tensor]] = {}
    for fqn, module in model.named_modules():
        if hasattr(module, "tiered_state"):
            for name, st in module.tiered_state().items():
                rows = out.setdefault(f"{fqn}.{name}", {})
                value = torch.cat([st.weights.float(), st.optimizer_state.float()], dim=1)
                for gid, row in zip(st.global_ids.tolist(), value):
                    rows[gid] = row.clone()
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor) and key.endswith(".weight"):
            rows = out.setdefault(key, {})
            for shard in value.local_shards():
                r0, c0 = shard.metadata.shard_offsets
                assert c0 == 0 and shard.tensor.size(1) == value.size(1), f"{key}: not a row-wise shard"
                for i, row in enumerate(shard.tensor):
                    rows[r0 + i] = row.clone()
    return out


def _merge(views: list[dict[str, dict[int, torch.Tensor]]]) -> dict[str, dict[int, list[float]]]:
    """Every rank's rows as plain lists (exact for float32; tensors cannot outlive a
    spawned rank's process on their way through the result queue)."""
    full: dict[str, dict[int, list[float]]] = {}
    for view in views:
        for table, rows in view.items():
            dest = full.setdefault(table, {})
            for gid, row in rows.items():
                assert gid not in dest, f"{table}: row {gid} on two ranks"
                dest[gid] = row.tolist()
    return full


@pytest.mark.parametrize("writes_first", [False, True], ids=["full_before_writing", "full_after_writing"])
def test_a_failed_dcp_write_is_a_checkpoint_write_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writes_first: bool
) -> None:
    """A failed DCP write (a CheckpointException, a BaseException) is a CheckpointWriteError
    naming the OS error once, without a traceback; ``latest`` still names the last good
    checkpoint, which loads, byte for byte. A data file DCP wrote before the disk was full
    is removed (it would keep the disk full for the next save)."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    from recpipe.recipes.checkpoint_policy import CheckpointWriteError

    write_data = FileSystemWriter.write_data

    def full_disk(self: Any, *args: Any, **kwargs: Any) -> Any:
        if writes_first:
            write_data(self, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    config = TrainConfig(**DCP, max_steps=8)
    root = tmp_path / "ckpt"
    with _one_rank():
        model, optimizer, table_ranks = _build(config)
        save_checkpoint(str(root), 4, model, optimizer, config, table_ranks)
        good = {p.name: p.read_bytes() for p in step_dir(root, 4).iterdir()}
        with monkeypatch.context() as m:
            m.setattr(FileSystemWriter, "write_data", full_disk)
            with pytest.raises(CheckpointWriteError) as err:
                save_checkpoint(str(root), 8, model, optimizer, config, table_ranks)
        assert sorted(p.name for p in step_dir(root, 8).iterdir()) == []
        assert {p.name: p.read_bytes() for p in step_dir(root, 4).iterdir()} == good
        assert load_checkpoint(str(root), model, optimizer, config) == 4
    msg = str(err.value)
    assert msg.startswith(f"checkpoint of step 8 was not committed: writing {step_dir(root, 8)} failed: "), msg
    assert msg.count("OSError: [Errno 28] No space left on device (rank 0)") == 1, msg
    assert "Traceback" not in msg and "free space" in msg, msg
    assert (root / "latest").read_text() == "4\n"


def test_a_second_run_saving_into_the_same_directory_fails_before_writing(tmp_path: Path) -> None:
    """Two runs saving into one --checkpoint-dir at once would mix their files and ``latest``:
    the save finds the other run's lock, raises CheckpointWriteError naming it and writes
    nothing; the other run's checkpoint is untouched."""
    import fcntl
    import os

    from recpipe.recipes.checkpoint_policy import CheckpointWriteError

    lock = ".recpipe_save.lock"  # recpipe.pipeline.checkpoint.SAVE_LOCK_NAME

    config = TrainConfig(**DCP, max_steps=8)
    root = tmp_path / "ckpt"
    with _one_rank():
        model, optimizer, table_ranks = _build(config)
        save_checkpoint(str(root), 4, model, optimizer, config, table_ranks)
        good = {p.name: p.read_bytes() for p in step_dir(root, 4).iterdir()}
        fd = os.open(root / lock, os.O_RDWR | os.O_CREAT)  # the other run's rank 0, mid-save
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.write(fd, b"pid 4242 on otherhost\n")
            for step in (4, 8):
                with pytest.raises(CheckpointWriteError) as err:
                    save_checkpoint(str(root), step, model, optimizer, config, table_ranks)
                msg = str(err.value)
                assert f"checkpoint of step {step} was not committed: another run (pid 4242 on otherhost)" in msg, msg
                assert "own --checkpoint-dir" in msg, msg
        finally:
            os.close(fd)
        assert {p.name: p.read_bytes() for p in step_dir(root, 4).iterdir()} == good
        assert not step_dir(root, 8).exists() and (root / "latest").read_text() == "4\n"
        save_checkpoint(str(root), 8, model, optimizer, config, table_ranks)  # the lock is free again
        assert load_checkpoint(str(root), model, optimizer, config) == 8


def test_a_file_system_without_flock_saves_unlocked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some NFS / Lustre mounts refuse flock (ENOLCK, EOPNOTSUPP): the same-directory guard
    is lost there, never the checkpoint, which saves, commits and loads as elsewhere."""
    import errno
    import types

    from recpipe.pipeline.checkpoint import integrity as checkpoint_module  # the save lock lives there

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    config = TrainConfig(**DCP, max_steps=8)
    root = tmp_path / "ckpt"
    with _one_rank():
        model, optimizer, table_ranks = _build(config)
        monkeypatch.setattr(
            checkpoint_module,
            "fcntl",
            types.SimpleNamespace(
                flock=no_flock, LOCK_EX=checkpoint_module.fcntl.LOCK_EX, LOCK_NB=checkpoint_module.fcntl.LOCK_NB
            ),
        )
        save_checkpoint(str(root), 4, model, optimizer, config, table_ranks)
        assert (root / "latest").read_text() == "4\n"
        assert load_checkpoint(str(root), model, optimizer, config) == 4


def test_every_checkpoint_failure_is_one_checkpoint_error_the_entry_point_prints_as_one_line() -> None:
    """The recipe's checkpoint errors and the library's (refusals of the lower layers included)
    share one root, so the entry point names one type for all of them; other failures keep their
    traceback unless they are a collective timeout, which is explained."""
    from recpipe.pipeline import checkpoint
    from recpipe.recipes import checkpoint_policy as policy
    from recpipe.recipes.faults import CollectiveFailureError, user_facing_error

    config = TrainConfig(**DCP, max_steps=4)
    failures = [
        policy.CheckpointMismatchError("another model"),
        policy.CheckpointCorruptError("ckpt/step_00000004/__0_0.distcp", "truncated"),
        policy.NoIntactCheckpointError("none intact"),
        policy.CheckpointWriteError("not committed"),
        policy.NonFiniteStateError("NaN in the state"),
        policy.CheckpointDirectoryError("latest is a directory"),
        checkpoint.CheckpointIntegrityError([("ckpt/.metadata", "missing")], ("restore it",)),
        checkpoint.CheckpointLoadError("checkpoint ckpt", [("Size mismatch", [0])]),
        checkpoint.CheckpointSaveError("checkpoint ckpt", [("OSError: disk full", [0])]),
        checkpoint.CheckpointTableError("table 't0' is tiered in this model, but the checkpoint holds no rows of it"),
        checkpoint.CheckpointRowOrderError("rows routed with dist_type='roundrobin'"),
        checkpoint.CheckpointNotFoundError("ckpt does not exist"),
    ]
    for error in failures:
        assert isinstance(error, checkpoint.CheckpointError), type(error)
        assert user_facing_error(error, config) is error, type(error)
    assert user_facing_error(RuntimeError("shape mismatch"), config) is None
    explained = user_facing_error(RuntimeError("[gloo] Timed out waiting 30000ms for recv"), config)
    assert isinstance(explained, CollectiveFailureError) and "--timeout-s" in str(explained)


# ---------------------------------------------------------------- 2 ranks
def _two_rank_body(rank: int, world_size: int, root: str, placement: str) -> dict[str, Any]:
    base = dict(DCP, placement=placement)
    whole = run(TrainConfig(**base, max_steps=12))
    run(TrainConfig(**base, max_steps=8, checkpoint_dir=root, checkpoint_every=4))
    names = sorted(p.name for p in step_dir(Path(root), 8).iterdir())
    record = json.loads((step_dir(Path(root), 8) / DIGESTS_NAME).read_text())["files"]
    digests = {n: hashlib.sha256((step_dir(Path(root), 8) / n).read_bytes()).hexdigest() for n in record}
    dist.barrier()
    if rank == 0:  # only rank 1's DCP file of the newest checkpoint is damaged
        flip_bytes(step_dir(Path(root), 8) / "__1_0.distcp", count=1)
    dist.barrier()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        resumed = run(TrainConfig(**base, max_steps=12, checkpoint_dir=root, checkpoint_every=4, resume=True))
    # the tables as this 2-rank job loads step 12, for the 1-rank load in the parent
    config = TrainConfig(**base, max_steps=16)
    model, optimizer, table_ranks = _build(config)
    assert load_checkpoint(root, model, optimizer, config, step=12) == 12
    views: list[Any] = [None] * world_size
    dist.all_gather_object(views, _rows(model))
    return {
        "whole": whole.losses,
        "start": resumed.start_step,
        "resumed": resumed.losses,
        "lines": _resume_lines(out.getvalue()),
        "names": names,
        "recorded": {n: e["sha256"] for n, e in record.items()},
        "digests": digests,
        "rows": _merge(views) if rank == 0 else None,
    }


@pytest.mark.parametrize("placement", ["planned", "table_wise"])
def test_two_ranks_resume_exactly_and_a_one_rank_job_loads_their_checkpoint(tmp_path: Path, placement: str) -> None:
    root = tmp_path / "ckpt"
    outs = run_gloo(2, _two_rank_body, str(root), placement, timeout_s=300)
    for rank, out in enumerate(outs):
        assert out["names"] == [".metadata", "__0_0.distcp", "__1_0.distcp", DIGESTS_NAME]
        # both ranks' files reached the record (the step-8 save, before the damage)
        assert out["recorded"] == out["digests"] and sorted(out["recorded"]) == out["names"][:3], f"rank {rank}"
        assert out["start"] == 4, f"rank {rank}"
        assert out["resumed"] == out["whole"][4:12], f"rank {rank}"  # bit-identical
    damaged = step_dir(root, 8) / "__1_0.distcp"
    (line,) = outs[0]["lines"]
    assert "damaged checkpoint step_00000008" in line and str(damaged) in line and "sha256" in line
    assert outs[1]["lines"] == []  # printed once, by rank 0
    verify_checkpoint(step_dir(root, 12))

    # 2 -> 1 rank: every table row equals the 2-rank job's right after the load ...
    saved = outs[0]["rows"]
    base = dict(DCP, placement=placement)
    config = TrainConfig(**base, max_steps=16)
    with _one_rank():
        model, optimizer, table_ranks = _build(config)
        assert load_checkpoint(str(root), model, optimizer, config, step=12) == 12
        loaded = _merge([_rows(model)])
    assert sorted(loaded) == sorted(saved) and saved
    for table, rows in saved.items():
        assert sorted(loaded[table]) == sorted(rows), table
        assert all(loaded[table][gid] == row for gid, row in rows.items()), table
    # ... and the 1-rank job trains on from it, saying the global batch changed, and saves in
    # its own world size
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run(TrainConfig(**base, max_steps=16, checkpoint_dir=str(root), checkpoint_every=4, resume=True))
    lines = _resume_lines(out.getvalue())
    batch = base.get("batch_size", TrainConfig.batch_size)
    assert (
        f"[recpipe] resumed from {step_dir(root, 12)}; changed since it was saved: world size 2 -> 1 "
        f"(global batch {2 * batch} -> {batch} samples per step) (training continues with the new values, so "
        "losses differ from an uninterrupted run's)"
    ) in out.getvalue().splitlines(), out.getvalue()
    assert result.start_step == 12 and len(result.losses) == 4 and lines == []
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert read_extra_state(step_dir(root, 16), 0).world_size == 1  # type: ignore[union-attr]
    verify_checkpoint(step_dir(root, 16))
