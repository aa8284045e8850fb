"""File integrity helpers of recpipe's checkpoints: digests, atomic writes, the save lock.

Records carry each file's size and sha256 and their own digest; records and markers are
written atomically. A save holds an exclusive ``flock`` on ``<directory>/SAVE_LOCK_NAME``, so
a second job saving into the same directory is refused, not mixed in. Imports nothing of recpipe.
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
from typing import Any, Dict, NamedTuple, Optional

READ_CHUNK_BYTES: int = 1 << 22  # bytes per read while hashing (4 MiB); sha256 itself bounds the rate
# the file a saving process holds an exclusive flock on (its content names the holder)
SAVE_LOCK_NAME: str = ".recpipe_save.lock"
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
