"""The local file system as a ``recpipe.pipeline.interfaces.CheckpointStorage``.

Imports ``recpipe.pipeline.checkpoint.integrity`` (atomic writes) and ``recpipe.pipeline.interfaces``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, List, Optional

from torch.distributed.checkpoint import FileSystemWriter
from torch.futures import Future

from recpipe.pipeline.checkpoint.integrity import atomic_write_bytes
from recpipe.pipeline.interfaces import CheckpointStorage


class FileSystemStorage:
    """Checkpoint records on a POSIX file system, written through ``integrity.atomic_write_bytes``."""

    def write_atomic(self, path: Path, data: bytes) -> None:
        atomic_write_bytes(Path(path), data)

    def names(self, directory: Path) -> List[str]:
        try:
            return [p.name for p in Path(directory).iterdir()]
        except OSError:
            return []

    def remove_files(self, directory: Path, doomed: Callable[[str], bool]) -> None:
        for name in self.names(directory):
            if doomed(name):
                with contextlib.suppress(OSError):
                    (Path(directory) / name).unlink()


FILE_SYSTEM: CheckpointStorage = FileSystemStorage()


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
