"""The integrity of a checkpoint directory: the digests record, atomic writes, the save lock,
and the local file system as a ``CheckpointStorage``.

:data:`~recpipe.pipeline.checkpoint.layout.DIGESTS_NAME` holds the size and sha256 of DCP's
``.metadata`` and of every data file of the save, plus the record's own digest; ``save`` writes
it last (it marks a finished save) and a verified load checks every file against it, and that the
directory holds no data file it does not list. Records are written atomically through the
``CheckpointStorage`` passed in (default :class:`FileSystemStorage`). A save holds an exclusive
``flock`` on ``<directory>/SAVE_LOCK_NAME``, so a second job saving into the same directory is
refused, not mixed in. Imports ``checkpoint.{checkpoint_errors, collectives, layout}``,
``interfaces`` and ``routing.ops``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import socket
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.futures import Future

from recpipe.pipeline.checkpoint.checkpoint_errors import (
    CORRUPT_FIXES,
    CheckpointIntegrityError,
    PathLike,
    check_path,
    describe_failures,
)
from recpipe.pipeline.checkpoint.collectives import all_gather, rank_world
from recpipe.pipeline.checkpoint.layout import (
    DCP_DATA_SUFFIX,
    DCP_METADATA_NAME,
    DCP_RANK_FILE,
    DIGESTS_NAME,
    SAVE_LOCK_NAME,
)
from recpipe.pipeline.interfaces import CheckpointStorage
from recpipe.pipeline.routing.ops import check_int

READ_CHUNK_BYTES: int = 1 << 22  # bytes per read while hashing (4 MiB); sha256 itself bounds the rate
DIGESTS_FORMAT: str = "recpipe-dcp-digests/1"
# Set by ``save``, which refused NaN / inf tiered rows: a verified load need not check them again.
ROWS_CHECKED_KEY: str = "tiered_rows_checked"
FileEntry = Dict[str, Any]  # {"bytes": int, "sha256": str} of one file


def file_sha256(path: Path) -> str:
    """Hex sha256 of the file at ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: Path) -> FileEntry:
    """The record entry (size, sha256) of a file already on disk."""
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def json_digest(body: Dict[str, Any]) -> str:
    """Hex sha256 of ``body`` as canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def is_file_entry(entry: Any) -> bool:
    """Whether ``entry`` is a well-formed :data:`FileEntry`."""
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
        return False
    sha = entry.get("sha256")
    return isinstance(sha, str) and re.fullmatch("[0-9a-f]{64}", sha) is not None


def file_problem(path: Path, entry: FileEntry, record: str) -> Optional[str]:
    """Why the file at ``path`` does not match its ``entry`` in the record named ``record``, or None."""
    if not path.is_file():
        return f"missing ({record} lists it)"
    try:
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{size} bytes, but {record} records {entry['bytes']} (truncated or overwritten)"
        digest = file_sha256(path)
    except OSError as e:
        return f"unreadable ({type(e).__name__}: {e})"
    if digest != entry["sha256"]:
        return (
            f"sha256 {digest[:16]}... differs from {record}'s {entry['sha256'][:16]}... "
            "(its bytes changed after the save: disk, copy or transfer corruption)"
        )
    return None


def fsync_dir(path: Path) -> None:
    """Makes a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically: into a temporary file beside it, which is fsynced,
    then replaces ``path``; then fsyncs the directory. On failure the temporary file is removed
    and ``path`` is untouched."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class FileSystemStorage:
    """The local (POSIX) file system as a ``CheckpointStorage``, the default of ``save``, ``load``
    and ``verify_checkpoint``: records written by :func:`atomic_write_bytes`."""

    def write_atomic(self, path: Path, data: bytes) -> None:
        """Writes ``data`` to ``path`` atomically and durably (:func:`atomic_write_bytes`)."""
        atomic_write_bytes(Path(path), data)

    def names(self, directory: Path) -> List[str]:
        """The names in ``directory`` (empty when it cannot be listed)."""
        try:
            return [p.name for p in Path(directory).iterdir()]
        except OSError:
            return []

    def remove_files(self, directory: Path, doomed: Callable[[str], bool]) -> None:
        """Removes the files of ``directory`` whose name ``doomed`` accepts, ignoring errors."""
        for name in self.names(directory):
            if doomed(name):
                with contextlib.suppress(OSError):
                    (Path(directory) / name).unlink()


def _naming_os_error(error: BaseException) -> BaseException:
    """``error``, or an ``OSError`` naming the first OS error in its cause / context chain (e.g.
    ENOSPC under torch's "unexpected pos" of a short write) with ``error``'s text in parentheses."""
    os_error: Optional[BaseException] = error
    seen = set()
    while os_error is not None and id(os_error) not in seen and not isinstance(os_error, OSError):
        seen.add(id(os_error))
        os_error = os_error.__cause__ or os_error.__context__
    if not isinstance(os_error, OSError) or os_error is error:
        return error
    named = OSError(os_error.errno, f"{os_error.strerror} ({type(error).__name__}: {error})")
    named.__cause__ = error
    return named


class OsErrorNamingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` whose write failures name the OS error under them.

    torch's zip writer reports a short write to a full disk as ``RuntimeError: ... unexpected
    pos``, keeping the ``OSError`` (ENOSPC) only as its context, which DCP drops when it gathers
    the ranks' failures; this writer raises the ``OSError`` on the rank that hit it instead.
    """

    def write_data(self, plan: Any, planner: Any) -> Future:
        try:
            written = super().write_data(plan, planner)
        except Exception as e:  # noqa: BLE001 - re-raised, named
            raise _naming_os_error(e)

        def name_failure(fut: Future) -> Any:
            try:
                return fut.value()
            except Exception as e:  # noqa: BLE001 - re-raised, named
                raise _naming_os_error(e)

        return written.then(name_failure)


class SaveLock(NamedTuple):
    """The outcome of :func:`acquire_save_lock`. All of ``fd``, ``holder``, ``error`` None: the
    file system has no ``flock`` (some NFS or Lustre mounts); the save goes on unlocked."""

    fd: Optional[int]  # the locked file's descriptor; None when not held
    holder: Optional[str]  # another process holds the lock: what its file says of it ("pid N on HOST")
    error: Optional[OSError]  # the lock file (or its directory) could not be created
    path: Path  # the lock file


def acquire_save_lock(directory: Path) -> SaveLock:
    """Takes an exclusive, non-blocking ``flock`` on ``directory/SAVE_LOCK_NAME`` (creating both)
    and writes ``"pid N on HOST"`` into it for a refused process to name. One process calls it."""
    path = Path(directory) / SAVE_LOCK_NAME
    while True:
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            return SaveLock(None, None, e, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = "another process"
            with contextlib.suppress(OSError, UnicodeDecodeError):
                holder = path.read_text().strip() or holder
            return SaveLock(None, holder, None, path)
        except OSError:  # no flock on this file system: the guard is lost, not the checkpoint
            os.close(fd)
            return SaveLock(None, None, None, path)
        # A holder releasing with remove=True unlinks the file before it unlocks: a lock
        # taken on that unlinked file guards nothing, so take the one on the path again.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except OSError:
            same = False
        if same:
            break
        os.close(fd)
    with contextlib.suppress(OSError):  # names the holder in the other process's refusal
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    return SaveLock(fd, None, None, path)


def release_save_lock(lock: SaveLock, remove: bool = False) -> None:
    """Releases a lock :func:`acquire_save_lock` took (no-op when not held); ``remove`` also
    removes the lock file (before unlocking, so no process locks the removed file)."""
    if lock.fd is None:
        return
    if remove:
        with contextlib.suppress(OSError):
            lock.path.unlink()
    os.close(lock.fd)


def referenced_files(metadata: Metadata) -> List[str]:
    """DCP's metadata file and the data files its entries point into."""
    return sorted({info.relative_path for info in (metadata.storage_data or {}).values()} | {DCP_METADATA_NAME})


def remove_rank_files(checkpoint_id: PathLike, rank: int, *, storage: Optional[CheckpointStorage] = None) -> None:
    """Removes the partial files of a failed save of ``rank`` (its DCP data files; rank 0: DCP's
    temporary metadata), which would keep a full disk full. Only for an uncommitted directory;
    errors are ignored (the save's own failure is the one to report).

    Args:
        storage: where the files are removed (default: the local file system).
    """
    check_path(checkpoint_id, "checkpoint_id")
    rank = check_int(rank, "rank", 0)

    def of_rank(name: str) -> bool:
        m = DCP_RANK_FILE.match(name)
        return (m is not None and int(m.group(1)) == rank) or (rank == 0 and name == DCP_METADATA_NAME + ".tmp")

    (FileSystemStorage() if storage is None else storage).remove_files(Path(checkpoint_id), of_rank)


def write_digests(
    checkpoint_id: PathLike,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    storage: Optional[CheckpointStorage] = None,
) -> None:
    """Records the size and sha256 of every file of a finished DCP save in
    :data:`~recpipe.pipeline.checkpoint.layout.DIGESTS_NAME` (collective): DCP's metadata, the
    data files it references and every other data file (``*.distcp``) in the directory, which
    a verified load would refuse unlisted. Call it after your own
    ``torch.distributed.checkpoint.save(dcp_state_dict(model))`` into a directory holding no
    older save's data files, so that ``load`` can verify the checkpoint.

    Args:
        storage: where the record is written (default: the local file system).

    Raises:
        OSError: a file could not be hashed or the record not written (on every rank).
    """
    check_path(checkpoint_id, "checkpoint_id")
    problems = gather_digests(checkpoint_id, process_group, FileSystemStorage() if storage is None else storage)
    if problems:
        raise OSError("; ".join(describe_failures(problems)))


def gather_digests(
    checkpoint_id: PathLike,
    process_group: Optional[dist.ProcessGroup],
    storage: CheckpointStorage,
    rows_checked: bool = False,
) -> List[Tuple[str, List[int]]]:
    """:func:`write_digests`, returning its failures as ``(problem, ranks)``, the same on every rank."""
    directory = Path(checkpoint_id)
    rank, world = rank_world(process_group)
    mine: Dict[str, Any] = {}
    failed: Optional[str] = None
    try:
        names = referenced_files(FileSystemReader(directory).read_metadata())
        mine = {name: file_entry(directory / name) for name in names[rank::world]}
        if rank == 0:  # data files DCP wrote that no entry references (a rank with nothing of its own to write)
            unreferenced = [n for n in sorted(storage.names(directory)) if n.endswith(DCP_DATA_SUFFIX)]
            mine.update({n: file_entry(directory / n) for n in unreferenced if n not in names})
    except OSError as e:
        failed = f"hashing the files of {directory} failed ({type(e).__name__}: {e})"
    parts = all_gather((mine, failed), world, process_group)
    problems = [(err, [r]) for r, (_, err) in enumerate(parts) if err is not None]
    if rank == 0 and not problems:
        files = {name: entry for part, _ in parts for name, entry in part.items()}
        body: Dict[str, Any] = {"format": DIGESTS_FORMAT, "files": files}
        if rows_checked:
            body[ROWS_CHECKED_KEY] = True
        text = json.dumps(dict(body, digests_sha256=json_digest(body)), indent=1, sort_keys=True)
        try:
            storage.write_atomic(directory / DIGESTS_NAME, (text + "\n").encode())
        except OSError as e:
            problems.append((f"writing {directory / DIGESTS_NAME} failed ({type(e).__name__}: {e})", [0]))
    if world > 1:  # every rank learns rank 0's verdict (its list holds every problem)
        problems = all_gather(problems, world, process_group)[0]
    return problems


def read_digests(directory: Path) -> Dict[str, Any]:
    """The digests record (``files`` table and flags), checked against its own digest."""
    path = directory / DIGESTS_NAME
    if not path.is_file():
        problem = (
            "missing: the checkpoint was not written by recpipe.pipeline.checkpoint.save, or its save did not finish"
        )
        raise CheckpointIntegrityError(
            [(str(path), problem)],
            (
                "if the save finished (e.g. your own torch.distributed.checkpoint.save of dcp_state_dict(model)), "
                "call recpipe.pipeline.checkpoint.write_digests(checkpoint_id) once on the saving ranks' files",
                "pass verify=False to load it without an integrity check",
                "load an older checkpoint",
            ),
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointIntegrityError([(str(path), f"unreadable ({type(e).__name__}: {e})")], CORRUPT_FIXES) from None
    body = {k: v for k, v in data.items() if k != "digests_sha256"} if isinstance(data, dict) else {}
    files = body.get("files")
    if (
        body.get("format") != DIGESTS_FORMAT
        or not isinstance(files, dict)
        or not all(isinstance(n, str) and "/" not in n and is_file_entry(e) for n, e in files.items())
    ):
        raise CheckpointIntegrityError([(str(path), f"not a {DIGESTS_FORMAT} record")], CORRUPT_FIXES)
    if data.get("digests_sha256") != json_digest(body):
        raise CheckpointIntegrityError(
            [(str(path), "its content does not match its own sha256 (altered after the save)")], CORRUPT_FIXES
        )
    return body


def _foreign_files(directory: Path, files: Dict[str, Any], storage: CheckpointStorage) -> List[Tuple[str, str]]:
    """``(path, problem)`` of each DCP data file in ``directory`` the record does not list."""
    return [
        (str(directory / name), f"not listed in {DIGESTS_NAME}: a data file this checkpoint's save did not write")
        for name in sorted(storage.names(directory))
        if name.endswith(DCP_DATA_SUFFIX) and name not in files
    ]


def verify_directory(
    directory: Path, process_group: Optional[dist.ProcessGroup], storage: CheckpointStorage, collective: bool = True
) -> bool:
    """Verifies an existing checkpoint directory against its digests record: the record's own
    digest, the size and sha256 of every file (each rank a share), no data file the record does
    not list (``storage`` lists the directory), and that DCP's metadata references no unlisted
    file. Returns whether ``save`` checked its tiered rows.

    Raises:
        CheckpointIntegrityError: on every rank, naming each bad file and the problem.
    """
    rank, world = rank_world(process_group) if collective else (0, 1)
    problems: List[Tuple[str, str]] = []
    fixes: Tuple[str, ...] = CORRUPT_FIXES
    record: Dict[str, Any] = {}
    files: Dict[str, Any] = {}
    try:
        record = read_digests(directory)
        files = record["files"]
    except CheckpointIntegrityError as e:  # every rank reads the record: rank 0 reports it
        problems, fixes = (e.problems if rank == 0 else []), e.fixes
    for name in sorted(files)[rank::world]:
        problem = file_problem(directory / name, files[name], DIGESTS_NAME)
        if problem is not None:
            problems.append((str(directory / name), problem))
    foreign = _foreign_files(directory, files, storage) if rank == 0 and files else []
    parts = all_gather((problems, foreign), world, process_group)
    everyone = [p for part, more in parts for p in part + more]
    if any(more for _, more in parts):
        fixes = (
            "move each such file out of the checkpoint directory: the record lists every file the save wrote, "
            "so a data file beside them belongs to another save (a mixed or copied-into directory)",
            *fixes,
        )
    if everyone:
        raise CheckpointIntegrityError(everyone, fixes)
    unrecorded = sorted(set(referenced_files(FileSystemReader(directory).read_metadata())) - set(files))
    if unrecorded:
        problem = f"references {unrecorded}, which {DIGESTS_NAME} does not list (files of another save)"
        raise CheckpointIntegrityError([(str(directory / DCP_METADATA_NAME), problem)], CORRUPT_FIXES)
    return record.get(ROWS_CHECKED_KEY) is True
