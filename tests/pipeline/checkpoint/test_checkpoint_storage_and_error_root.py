"""The ``storage=`` argument of save / load / verify_checkpoint, the one error root, one check per load.

* A recording ``CheckpointStorage`` (delegating to the file system) sees every record write,
  directory listing and removal of a save, and the listing of a verified load and of
  ``verify_checkpoint``; a listing it invents is what the foreign-file check refuses, and a write
  it fails is a ``CheckpointSaveError``.
* Every exception class ``recpipe.pipeline.checkpoint`` exports is a ``CheckpointError`` (but
  the tiered layer's own ``TieredCheckpointError``); those the checkpoint layer raises for a
  lower layer's refusal are that layer's type too.
* A load runs each of its checks (model, directory, digests) once.

One process, no torch.distributed: every call here is a collective of one rank.
"""

from __future__ import annotations

import errno
import inspect
import json
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, List, Tuple

import pytest
import torch

from recpipe.pipeline import checkpoint as recpipe_dcp
from recpipe.pipeline.checkpoint import api
from recpipe.pipeline.routing.row_order import RowOrderMismatchError
from recpipe.pipeline.tiered.state import TieredCheckpointError


class RecordingStorage:
    """A ``CheckpointStorage`` that records each call as ``(method, path)`` and delegates to the
    file system; ``extra_names`` are listed beside the directory's real names."""

    def __init__(self, extra_names: Tuple[str, ...] = ()) -> None:
        self.inner = recpipe_dcp.FileSystemStorage()
        self.calls: List[Tuple[str, Path]] = []
        self.written: List[bytes] = []
        self.extra_names = extra_names

    def write_atomic(self, path: Any, data: bytes) -> None:
        self.calls.append(("write_atomic", Path(path)))
        self.written.append(data)
        self.inner.write_atomic(path, data)

    def names(self, directory: Any) -> List[str]:
        self.calls.append(("names", Path(directory)))
        return self.inner.names(directory) + list(self.extra_names)

    def remove_files(self, directory: Any, doomed: Callable[[str], bool]) -> None:
        self.calls.append(("remove_files", Path(directory)))
        self.inner.remove_files(directory, doomed)


class FullDiskStorage(RecordingStorage):
    """Fails every record write as a full disk would."""

    def write_atomic(self, path: Any, data: bytes) -> None:
        self.calls.append(("write_atomic", Path(path)))
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(autouse=True)
def _single_process_dcp() -> Iterator[None]:
    with warnings.catch_warnings():  # DCP warns that no_dist means "a single process": here, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _linear(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def test_save_load_and_verify_go_through_the_storage_passed_in(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    saved = _linear(0)
    storage = RecordingStorage()
    recpipe_dcp.save(saved, d, storage=storage)
    # the old record and the old DCP files removed (checked by listing), the new data files listed, the record written
    assert storage.calls == [
        ("remove_files", d),
        ("names", d),
        ("remove_files", d),
        ("names", d),
        ("write_atomic", d / "recpipe_digests.json"),
    ]
    assert storage.written == [(d / recpipe_dcp.DIGESTS_NAME).read_bytes()]
    assert set(json.loads(storage.written[0])["files"]) == {p.name for p in d.iterdir()} - {recpipe_dcp.DIGESTS_NAME}

    storage.calls.clear()
    loaded = _linear(1)
    recpipe_dcp.load(loaded, d, storage=storage)
    assert storage.calls == [("names", d)]  # the verified load lists the directory through it
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), saved.state_dict().values()))

    storage.calls.clear()
    recpipe_dcp.verify_checkpoint(d, storage=storage)
    assert storage.calls == [("names", d)]
    storage.calls.clear()
    recpipe_dcp.load(loaded, d, verify=False, storage=storage)
    assert storage.calls == []  # unverified: the storage is not consulted


def test_a_data_file_the_storage_lists_beside_the_record_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    recpipe_dcp.save(_linear(0), d)
    foreign = RecordingStorage(extra_names=("__3_0.distcp",))
    with pytest.raises(recpipe_dcp.CheckpointIntegrityError) as err:
        recpipe_dcp.verify_checkpoint(d, storage=foreign)
    assert err.value.problems == [
        (
            str(d / "__3_0.distcp"),
            f"not listed in {recpipe_dcp.DIGESTS_NAME}: a data file this checkpoint's save did not write",
        )
    ]
    assert "move each such file out of the checkpoint directory" in str(err.value)
    model = _linear(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(recpipe_dcp.CheckpointIntegrityError, match=r"__3_0\.distcp: not listed"):
        recpipe_dcp.load(model, d, storage=foreign)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    recpipe_dcp.verify_checkpoint(d)  # the file system itself holds no such file


def test_a_record_the_storage_cannot_write_is_a_save_error_and_no_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    with pytest.raises(recpipe_dcp.CheckpointSaveError) as err:
        recpipe_dcp.save(_linear(0), d, storage=FullDiskStorage())
    assert f"writing {d / recpipe_dcp.DIGESTS_NAME} failed (OSError: [Errno 28] No space left on device)" in str(
        err.value
    )
    with pytest.raises(recpipe_dcp.CheckpointIntegrityError, match="missing: the checkpoint was not written"):
        recpipe_dcp.load(_linear(1), d)


def test_every_exported_error_derives_from_the_one_root() -> None:
    classes = {
        name: obj
        for name in recpipe_dcp.__all__
        if inspect.isclass(obj := getattr(recpipe_dcp, name)) and issubclass(obj, BaseException)
    }
    assert len(classes) >= 8, sorted(classes)
    assert issubclass(recpipe_dcp.CheckpointError, RuntimeError)
    outside = sorted(n for n, c in classes.items() if not issubclass(c, recpipe_dcp.CheckpointError))
    assert outside == ["TieredCheckpointError"]  # the tiered layer's type, exported for its shards' loads
    lower = {
        recpipe_dcp.CheckpointTableError: TieredCheckpointError,
        recpipe_dcp.CheckpointRowOrderError: RowOrderMismatchError,
        recpipe_dcp.CheckpointNotFoundError: FileNotFoundError,
        recpipe_dcp.CheckpointNotADirectoryError: NotADirectoryError,
    }
    for cls, base in lower.items():
        assert issubclass(cls, recpipe_dcp.CheckpointError) and issubclass(cls, base), cls


def test_a_missing_directory_is_both_a_checkpoint_error_and_a_file_not_found_error(tmp_path: Path) -> None:
    for call in (
        lambda: recpipe_dcp.load(_linear(0), tmp_path / "absent"),
        lambda: recpipe_dcp.verify_checkpoint(tmp_path / "absent"),
    ):
        with pytest.raises(recpipe_dcp.CheckpointError) as err:
            call()
        assert isinstance(err.value, FileNotFoundError) and "(`checkpoint_id`) does not exist" in str(err.value)


@pytest.mark.parametrize("verify", [True, False])
def test_a_load_runs_each_check_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify: bool) -> None:
    d = tmp_path / "ckpt"
    recpipe_dcp.save(_linear(0), d)
    counts = {"check_path": 0, "check_model": 0, "check_directory": 0, "verify_directory": 0}

    def counted(name: str) -> Callable[..., Any]:
        original = getattr(api, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return original(*args, **kwargs)

        return call

    for name in counts:
        monkeypatch.setattr(api, name, counted(name))
    recpipe_dcp.load(_linear(1), d, verify=verify)
    assert counts == {"check_path": 1, "check_model": 1, "check_directory": 1, "verify_directory": int(verify)}
