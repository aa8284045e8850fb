"""The digests record of a DCP checkpoint (written last by ``save``, verified before a load),
and the argument checks every entry point shares.

:data:`DIGESTS_NAME` holds the size and sha256 of DCP's ``.metadata`` and every data file it
references, plus the record's own digest. Imports ``checkpoint.{errors, integrity, storage}``
and ``routing.ops``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from recpipe.pipeline.checkpoint.errors import (
    CORRUPT_FIXES,
    CheckpointIntegrityError,
    all_gather,
    describe_failures,
    rank_world,
)
from recpipe.pipeline.checkpoint.integrity import file_entry, file_problem, is_file_entry, json_digest
from recpipe.pipeline.checkpoint.storage import FILE_SYSTEM
from recpipe.pipeline.routing.ops import check_int

DIGESTS_NAME: str = "recpipe_digests.json"
DIGESTS_FORMAT: str = "recpipe-dcp-digests/1"
DCP_METADATA_NAME: str = ".metadata"  # torch.distributed.checkpoint.filesystem._metadata_fn
# DCP FileSystemWriter's data files; group 1: the rank
DCP_DATA_FILE: "re.Pattern[str]" = re.compile(r"^__(\d+)_\d+\.distcp$")
# Set by ``save``, which refused NaN / inf tiered rows: a verified load need not check them again.
ROWS_CHECKED_KEY: str = "tiered_rows_checked"

PathLike = Union[str, "os.PathLike[str]"]


def check_path(value: Any, argument: str) -> None:
    """Raises ``ValueError`` naming ``argument`` unless ``value`` is a path (str or os.PathLike)."""
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
        raise ValueError(
            f"`{argument}` must be a checkpoint directory path (str or os.PathLike), got "
            f"{type(value).__name__} {value!r}; e.g. 'ckpt/step_100'."
        )


def check_model(model: Any, where: str) -> None:
    """Raises ``ValueError`` unless ``model`` is an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"{where}: `model` must be a torch.nn.Module (e.g. the DistributedModelParallel), got "
            f"{type(model).__name__}."
        )


def check_directory(
    directory: PathLike, argument: str, process_group: Optional[dist.ProcessGroup], collective: bool = True
) -> None:
    """Raises, on every rank, ``FileNotFoundError`` / ``NotADirectoryError`` when ``directory`` is
    missing or a file on some rank (collective: no rank is left waiting in the load's first collective)."""
    problem: Optional[Tuple[type, str]] = None
    if os.path.exists(directory) and not os.path.isdir(directory):
        problem = (
            NotADirectoryError,
            f"DCP checkpoint {os.fspath(directory)!r} (`{argument}`) is a file, not a directory; pass the "
            "directory given to recpipe.pipeline.checkpoint.save (the one holding .metadata and "
            f"{DIGESTS_NAME}), not one of its files.",
        )
    elif not os.path.isdir(directory):
        problem = (
            FileNotFoundError,
            f"DCP checkpoint directory {os.fspath(directory)!r} (`{argument}`) does not exist; pass the "
            "directory given to recpipe.pipeline.checkpoint.save (on a file system every loading rank sees).",
        )
    world = rank_world(process_group)[1] if collective else 1
    everyone = all_gather(problem, world, process_group)
    bad = [r for r, p in enumerate(everyone) if p is not None]
    if not bad:
        return
    kind, message = problem if problem is not None else everyone[bad[0]]
    if len(bad) < world:
        message += f" (on rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} of {world})"
    raise kind(message)


def referenced_files(metadata: Metadata) -> List[str]:
    """DCP's metadata file and the data files its entries point into."""
    return sorted({info.relative_path for info in (metadata.storage_data or {}).values()} | {DCP_METADATA_NAME})


def remove_rank_files(checkpoint_id: PathLike, rank: int) -> None:
    """Removes the partial files of a failed save of ``rank`` (its DCP data files; rank 0: DCP's
    temporary metadata), which would keep a full disk full. Only for an uncommitted directory;
    errors are ignored (the save's own failure is the one to report)."""
    check_path(checkpoint_id, "checkpoint_id")
    rank = check_int(rank, "rank", 0)

    def of_rank(name: str) -> bool:
        m = DCP_DATA_FILE.match(name)
        return (m is not None and int(m.group(1)) == rank) or (rank == 0 and name == DCP_METADATA_NAME + ".tmp")

    FILE_SYSTEM.remove_files(Path(checkpoint_id), of_rank)


def write_digests(checkpoint_id: PathLike, *, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Records the size and sha256 of every file of a finished DCP save in :data:`DIGESTS_NAME`
    (collective). Call it after your own ``torch.distributed.checkpoint.save(dcp_state_dict(model))``
    so that ``load`` can verify the checkpoint.

    Raises:
        OSError: a file could not be hashed or the record not written (on every rank).
    """
    check_path(checkpoint_id, "checkpoint_id")
    problems = gather_digests(checkpoint_id, process_group)
    if problems:
        raise OSError("; ".join(describe_failures(problems)))


def gather_digests(
    checkpoint_id: PathLike, process_group: Optional[dist.ProcessGroup], rows_checked: bool = False
) -> List[Tuple[str, List[int]]]:
    """:func:`write_digests`, returning its failures as ``(problem, ranks)``, the same on every rank."""
    directory = Path(checkpoint_id)
    rank, world = rank_world(process_group)
    mine: Dict[str, Any] = {}
    failed: Optional[str] = None
    try:
        names = referenced_files(FileSystemReader(directory).read_metadata())
        mine = {name: file_entry(directory / name) for name in names[rank::world]}
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
            FILE_SYSTEM.write_atomic(directory / DIGESTS_NAME, (text + "\n").encode())
        except OSError as e:
            problems.append((f"writing {directory / DIGESTS_NAME} failed ({type(e).__name__}: {e})", [0]))
    if world > 1:  # every rank learns rank 0's verdict (its list holds every problem)
        problems = all_gather(problems, world, process_group)[0]
    return problems


def read_digests(directory: Path) -> Dict[str, Any]:
    """The record :data:`DIGESTS_NAME` (``files`` table and flags), checked against its own digest."""
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


def verify_checkpoint(
    checkpoint_id: PathLike, *, process_group: Optional[dist.ProcessGroup] = None, collective: bool = True
) -> None:
    """Verifies a checkpoint against its :data:`DIGESTS_NAME` record: the record's own digest, the
    size and sha256 of every file (each rank a share), and that DCP's metadata references no
    unlisted file.

    Args:
        collective: False: this process verifies every file alone (no collective).

    Raises:
        FileNotFoundError: ``checkpoint_id`` does not exist (on every rank).
        NotADirectoryError: ``checkpoint_id`` is a file (on every rank).
        CheckpointIntegrityError: on every rank, naming each bad file and the problem.
    """
    check_path(checkpoint_id, "checkpoint_id")
    check_directory(checkpoint_id, "checkpoint_id", process_group, collective)
    verify(Path(checkpoint_id), process_group, collective)


def verify(directory: Path, process_group: Optional[dist.ProcessGroup], collective: bool = True) -> bool:
    """:func:`verify_checkpoint` of an existing directory; True when ``save`` checked its tiered rows."""
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
    everyone = [p for part in all_gather(problems, world, process_group) for p in part]
    if everyone:
        raise CheckpointIntegrityError(everyone, fixes)
    unrecorded = sorted(set(referenced_files(FileSystemReader(directory).read_metadata())) - set(files))
    if unrecorded:
        problem = f"references {unrecorded}, which {DIGESTS_NAME} does not list (files of another save)"
        raise CheckpointIntegrityError([(str(directory / DCP_METADATA_NAME), problem)], CORRUPT_FIXES)
    return record.get(ROWS_CHECKED_KEY) is True
