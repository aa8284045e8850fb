"""File integrity helpers shared by recpipe's checkpoint writers and readers.

A checkpoint records each file's size and sha256 in a JSON record that carries its
own digest (``json_digest`` of the record without it); readers compare both before
they unpickle or load anything. Records and markers are written atomically
(temporary file, fsync, ``os.replace``, fsync of the directory).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Dict, Iterator, Optional

#: Bytes read per ``read`` call while hashing: 4 MiB, the recipe manifest's value since it
#: was written; the hashing itself (sha256 ~1.7 GB/s on one core of the development
#: machine, measured 2026-11-24) bounds the rate, not the number of reads.
READ_CHUNK_BYTES: int = 1 << 22

FileEntry = Dict[str, Any]
"""``{"bytes": int, "sha256": str}`` of one file."""


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
    sha = entry.get("sha256") if isinstance(entry, dict) else None
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("bytes"), int)
        and isinstance(sha, str)
        and len(sha) == 64
        and all(c in "0123456789abcdef" for c in sha)
    )


def file_problem(path: Path, entry: FileEntry, record: str) -> Optional[str]:
    """Why the file at ``path`` does not match its ``entry`` in ``record``, or None.

    Args:
        path (Path): the file.
        entry (FileEntry): its recorded size and sha256.
        record (str): the record's name, quoted in the problem.

    Returns:
        Optional[str]: ``None`` when size and sha256 match; else the problem (missing,
        other size, other digest, unreadable).
    """
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


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """Writes ``path`` atomically: yields a temporary file in the same directory, then
    fsyncs it, ``os.replace``-s it into place and fsyncs the directory. When the block or
    any of that fails, the temporary file is removed (a partial file only takes space)
    and the error propagates; ``path`` is untouched.

    Args:
        path (Path): the file to write.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` through :func:`atomic_file`."""
    with atomic_file(path) as f:
        f.write(data)
