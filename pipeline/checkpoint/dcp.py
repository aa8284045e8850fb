"""torch.distributed.checkpoint (DCP) save / load of models with tiered tables.

torchrec users checkpoint ``model.state_dict()`` with DCP, which reshards
ShardedTensors / DTensors across world sizes itself. torchrec's sharded
``state_dict`` skips CUSTOMIZED_KERNEL (tiered) tables, and a tiered shard's rows
are hash-routed (not a contiguous row range), so they cannot be a ShardedTensor of
the table. This module writes one DCP checkpoint holding:

* the model's regular ``state_dict()`` (ShardedTensors / DTensors of torchrec's
  tables, dense parameters and buffers), resharded by DCP on load;
* ``fused_optimizer.<...>``: ``model.fused_optimizer.state_dict()`` (torchrec's
  fused optimizer state of the non-tiered tables, ShardedTensors too), when the
  model has one;
* for every tiered table, each owning rank's export
  (:meth:`~recpipe.pipeline.tiered.shard.TieredEmbeddingShard.export_state`) under
  per-rank keys ``tiered.<table fqn>.rank<r>.{global_ids, weights,
  optimizer_state, step, metadata}`` (``<table fqn>`` as in the model's state
  dict, e.g. ``ebc.embedding_bags.t0``; ``metadata`` is the export's routing and
  placement metadata as JSON). Only that rank writes them (replicas of the same
  shard write identical keys, which DCP stores once).

Loading (any world size, routing and placement; a roundrobin / hash_roundrobin
FUSED table only into its own routing, world size and seed, as its shards hold
routed rows: see ``recpipe.pipeline.routing.sharding.RowOrder``): the regular part goes through
``dcp.load`` (collective); then every rank reads the checkpoint metadata to find
every saving rank's export of each of its tiered tables, reads their routing
metadata and steps (checked for consistency), and then the exports themselves one
saving rank at a time (``no_dist``: ranks read different keys). Each is validated
against the table (num_embeddings, dim, dtype, optimizer, routing; errors name the
table) and the rows this rank owns under its own routing are kept (by global id);
:meth:`~recpipe.pipeline.tiered.shard.TieredEmbeddingShard.load_states` writes them to
their tiers. When the saving job routed the table exactly as the loading job
(same world size, dist_type and seed; the placement may differ), only this rank's
own export is read. Peak extra memory per table: one saving rank's export plus
two copies of this rank's rows (the gathered rows and ``load_states``' staging
buffer); one export plus one copy when the routing is the same.

Adopting tiered tables: a table tiered in the loading model but held by the checkpoint as
a torchrec table (its ``weight`` a ``[num_embeddings, dim]`` ShardedTensor, e.g. of a plain
torchrec job's ``torch.distributed.checkpoint.save({**model.state_dict(), "fused_optimizer":
model.fused_optimizer.state_dict()})``) is loaded from it: each rank streams the table and
its fused optimizer state (torchrec's ``fused_optimizer.state.<weight key>.<table>.momentum1``
..., :data:`~recpipe.pipeline.tiered.sharders.OPTIMIZER_STATE_NAMES`) one saved row block at a time
(a saving rank's ROW_WISE chunk; a TABLE_WISE table is one block) into CPU tensors, and
:meth:`~recpipe.pipeline.tiered.shard.TieredEmbeddingShard.load_row_blocks` writes the block's rows
this rank owns (by global id) to their tiers as it comes. Peak extra memory: one saved block
(which DCP's reader holds twice while it reads it), one table at a time (it used to be a whole
table per rank). torchrec's checkpoint
holds no optimizer step (fbgemm's ``iter`` is in neither its ``state_dict()`` nor its fused
optimizer's), so the table keeps its own, as a torchrec table loading it keeps its TBE's.
The reverse, a table tiered in the checkpoint that the loading model holds as a torchrec
(ShardedTensor) table, is checked first (every export read once, none kept); then each rank
gathers only the rows its shards hold from every saving rank's export (by global id, one table
at a time), writes them into the weight's local shards (given to ``model.load_state_dict``) and
their fused optimizer state into torchrec's optimizer state after its load, with the exports'
step (as :func:`~recpipe.pipeline.tiered.sharders.load_full_optimizer_state` sets it). Extra memory:
the rank's rows of one table and one export.

Integrity: :func:`save` writes :data:`DIGESTS_NAME` last (size and sha256 of DCP's
``.metadata`` and of every data file it references; each rank hashes a share), and
:func:`load` verifies every file against it before anything reaches the model, so
a bit flip, truncation or a missing / foreign file is a :class:`CheckpointIntegrityError`
naming the file on every rank, never silently wrong weights.

Example::

    from recpipe.pipeline.checkpoint import dcp as recpipe_dcp

    recpipe_dcp.save(model, "ckpt/step_100")          # every rank
    recpipe_dcp.load(model, "ckpt/step_100")          # any world size / placement
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem as _LocalFileSystem
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from recpipe.pipeline.checkpoint.integrity import (SAVE_LOCK_NAME, SaveLock, acquire_save_lock, atomic_write_bytes, file_entry,
                                         file_problem, is_file_entry, json_digest, release_save_lock)
from recpipe.pipeline.routing.ops import ROUTING_VERSION, check_int, local_rows, route_ids
from recpipe.pipeline.placement import FusedOptimizer
from recpipe.pipeline.tiered.optim import TieredOptimizerConfig
from recpipe.pipeline.tiered.sharders import (  # the optimizer-state migration's views of the tables, shared
    OPTIMIZER_STATE_NAMES, OPTIMIZER_STEP_KEY, _describe_tables, _named_to_columns, _optimizer_tables,
    _shard_global_rows, _TieredTablesMixin, _write_optimizer_rows, state_dict_without_tiered_rows)
from recpipe.pipeline.routing.sharding import ROW_ORDER_KEY, RowOrder, describe_row_order, row_order_refusal
from recpipe.pipeline.tiered.shard import (TieredCheckpointError, TieredEmbeddingShard, TieredShardState,
                                     non_finite_rows as _non_finite_rows)

__all__ = [
    "CheckpointIntegrityError",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "DCP_DATA_FILE",
    "DCP_METADATA_NAME",
    "DIGESTS_NAME",
    "FUSED_OPTIMIZER_KEY",
    "SAVE_LOCK_NAME",
    "TIERED_DCP_PREFIX",
    "TieredCheckpointError",
    "dcp_failures",
    "dcp_state_dict",
    "describe_failures",
    "load",
    "load_dcp_state_dict",
    "remove_rank_files",
    "save",
    "tiered_dcp_key",
    "verify_checkpoint",
    "write_digests",
]

#: First component of every tiered key in a DCP checkpoint written by this module.
TIERED_DCP_PREFIX: str = "tiered"
#: Key of ``model.fused_optimizer.state_dict()`` in the checkpoint (DCP flattens it).
FUSED_OPTIMIZER_KEY: str = "fused_optimizer"
_FIELDS: Tuple[str, ...] = ("global_ids", "weights", "optimizer_state", "step", "metadata")
#: The integrity record :func:`save` writes last into the checkpoint directory: size and
#: sha256 of DCP's ``.metadata`` and of every data file it references, plus the record's
#: own digest. Its presence marks a finished save.
DIGESTS_NAME: str = "recpipe_digests.json"
_DIGESTS_FORMAT: str = "recpipe-dcp-digests/1"
#: DCP's metadata file (``torch.distributed.checkpoint.filesystem._metadata_fn``).
DCP_METADATA_NAME: str = ".metadata"
#: The data files of DCP's ``FileSystemWriter``: ``__<rank>_<n>.distcp`` (group 1: the rank).
DCP_DATA_FILE: "re.Pattern[str]" = re.compile(r"^__(\d+)_\d+\.distcp$")

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointIntegrityError(RuntimeError):
    """Files of a DCP checkpoint differ from what :func:`save` recorded, or its record
    (:data:`DIGESTS_NAME`) is missing or damaged. Raised on every rank before anything is
    loaded into the model.

    Args:
        problems (Sequence[Tuple[str, str]]): ``(path, problem)`` of each bad file.
        fixes (Sequence[str]): the possible solutions, numbered in the message.
    """

    def __init__(self, problems: Sequence[Tuple[str, str]], fixes: Sequence[str]) -> None:
        self.problems: List[Tuple[str, str]] = list(problems)
        self.fixes: Tuple[str, ...] = tuple(fixes)
        super().__init__("\n".join([f"{path}: {problem}" for path, problem in self.problems] + _numbered(fixes)))


def _numbered(fixes: Sequence[str]) -> List[str]:
    """The "Possible solutions" lines of an error message."""
    return ["Possible solutions:"] + [f"  {i}. {fix}" for i, fix in enumerate(fixes, 1)]


def dcp_failures(error: CheckpointException) -> List[Tuple[str, List[int]]]:
    """The distinct failures of a DCP ``CheckpointException`` (which holds one per
    failing rank, with its traceback): ``("<type>: <message>", ranks)`` in rank order."""
    ranks: Dict[str, List[int]] = {}
    for rank, failure in sorted(error.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        ranks.setdefault(f"{type(exc).__name__}: {exc}", []).append(rank)
    return list(ranks.items())


def describe_failures(problems: Sequence[Tuple[str, Sequence[int]]]) -> List[str]:
    """One line per distinct failure of :func:`dcp_failures`, naming its ranks."""
    return [f"{p} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})" for p, r in problems]


class _DCPFailure(RuntimeError):
    """DCP's ``CheckpointException`` as an ordinary exception: DCP raises a
    ``BaseException`` (``except Exception`` does not catch it) holding a traceback per
    rank; this names each distinct problem once with the ranks that hit it.

    Args:
        header (str): what failed, for the first line.
        problems (Sequence[Tuple[str, Sequence[int]]]): ``(problem, ranks)`` of each
            distinct failure (:func:`dcp_failures`).
        fixes (Sequence[str]): the possible solutions, numbered in the message.
    """

    def __init__(self, header: str, problems: Sequence[Tuple[str, Sequence[int]]], fixes: Sequence[str]) -> None:
        self.problems: List[Tuple[str, List[int]]] = [(p, list(r)) for p, r in problems]
        lines = [header] + [f"  - {line}" for line in describe_failures(self.problems)] + _numbered(fixes)
        super().__init__("\n".join(lines))


class CheckpointLoadError(_DCPFailure):
    """``torch.distributed.checkpoint.load`` refused the regular part of a checkpoint,
    e.g. a torchrec table or dense layer of another shape, or an entry the checkpoint
    lacks. DCP finds shape and missing-entry problems while planning, before it reads
    anything, so such a refusal leaves the model unchanged. Raised on every rank of the
    load's group (a tiered export is read by one process: on that rank).

    Args:
        where (str): the checkpoint, for the message.
        problems (Sequence[Tuple[str, Sequence[int]]]): see :func:`dcp_failures`.
        fixes (Sequence[str] | None): the possible solutions (default: those of a
            model that differs from the saving job's).
    """

    def __init__(
        self, where: str, problems: Sequence[Tuple[str, Sequence[int]]], fixes: Optional[Sequence[str]] = None
    ) -> None:
        super().__init__(
            f"{where} could not be loaded into this model (torch.distributed.checkpoint.load failed):",
            problems,
            fixes if fixes is not None else
            ("build the model as the saving job did: the same table sizes and dims, dense layers, module names "
             "and optimizer (each line above names the entry; a size mismatch quotes both shapes)",
             "load a checkpoint saved from this model's configuration",
             "start from fresh weights instead of this checkpoint"),
        )


class CheckpointSaveError(_DCPFailure):
    """``torch.distributed.checkpoint.save``, or the digests record :func:`save` writes
    after it, failed (e.g. a full disk). No digests record was written, so :func:`load`
    refuses the partial checkpoint. Raised on every rank.

    Args:
        where (str): the checkpoint, for the message.
        problems (Sequence[Tuple[str, Sequence[int]]]): see :func:`dcp_failures`.
        fixes (Sequence[str] | None): the possible solutions (default: those of a
            failed write).
    """

    def __init__(
        self, where: str, problems: Sequence[Tuple[str, Sequence[int]]], fixes: Optional[Sequence[str]] = None
    ) -> None:
        super().__init__(
            f"{where} was not saved:",
            problems,
            fixes if fixes is not None else
            ("check the free space and permissions of the checkpoint directory, then save again",
             "save into another directory"),
        )


def _dcp_load(state: Dict[str, Any], reader: FileSystemReader, where: str, **kwargs: Any) -> None:
    """``dcp.load(state, storage_reader=reader, **kwargs)``, DCP's failure raised as a
    :class:`CheckpointLoadError` (an entry the checkpoint lacks also suggests ``strict=False``)."""
    try:
        dcp.load(state, storage_reader=reader, **kwargs)
    except CheckpointException as e:
        problems = dcp_failures(e)
        planner = kwargs.get("planner")
        fixes = None
        if any("Missing key in checkpoint" in p for p, _ in problems) and not getattr(
                planner, "allow_partial_load", False):
            fixes = ("build the model as the saving job did (the same modules, tables and optimizer)",
                     "pass strict=False to load the entries the checkpoint holds and keep this model's own "
                     "values of the others (e.g. a layer added since the save)",
                     "start from fresh weights instead of this checkpoint")
        raise CheckpointLoadError(where, problems, fixes) from None


_CORRUPT_FIXES: Tuple[str, ...] = (
    "restore the checkpoint directory from a copy taken before the damage",
    "load an older checkpoint",
)


def _rank_world(process_group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _all_gather(obj: Any, world: int, process_group: Optional[dist.ProcessGroup]) -> List[Any]:
    if world == 1:
        return [obj]
    out: List[Any] = [None] * world
    dist.all_gather_object(out, obj, group=process_group)
    return out


def _referenced_files(metadata: Metadata) -> List[str]:
    """DCP's metadata file and the data files its entries point into."""
    return sorted({info.relative_path for info in (metadata.storage_data or {}).values()} | {DCP_METADATA_NAME})



def _check_path(value: Any, argument: str) -> None:
    """Raises ``ValueError`` naming ``argument`` unless ``value`` is a path (str or os.PathLike)."""
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
        raise ValueError(f"`{argument}` must be a checkpoint directory path (str or os.PathLike), got "
                         f"{type(value).__name__} {value!r}; e.g. 'ckpt/step_100'.")


def _check_model(model: Any, where: str) -> None:
    """Raises ``ValueError`` unless ``model`` is an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"{where}: `model` must be a torch.nn.Module (e.g. the DistributedModelParallel), got "
                         f"{type(model).__name__}.")


def _check_directory(directory: PathLike, argument: str, process_group: Optional[dist.ProcessGroup]) -> None:
    """Raises, on every rank of ``process_group``, ``FileNotFoundError`` /
    ``NotADirectoryError`` naming ``argument`` when ``directory`` is missing or a file on
    some rank (collective: a rank that cannot see the directory must not leave the
    others waiting in the load's first collective)."""
    problem: Optional[Tuple[str, str]] = None
    if os.path.exists(directory) and not os.path.isdir(directory):
        problem = ("NotADirectoryError",
                   f"DCP checkpoint {os.fspath(directory)!r} (`{argument}`) is a file, not a directory; pass the "
                   "directory given to recpipe.pipeline.checkpoint.dcp.save (the one holding .metadata and "
                   f"{DIGESTS_NAME}), not one of its files.")
    elif not os.path.isdir(directory):
        problem = ("FileNotFoundError",
                   f"DCP checkpoint directory {os.fspath(directory)!r} (`{argument}`) does not exist; pass the "
                   "directory given to recpipe.pipeline.checkpoint.dcp.save (on a file system every loading rank sees).")
    rank, world = _rank_world(process_group)
    everyone = _all_gather(problem, world, process_group)
    bad = [r for r, p in enumerate(everyone) if p is not None]
    if not bad:
        return
    kind, message = problem if problem is not None else everyone[bad[0]]
    if len(bad) < world:
        message += f" (on rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} of {world})"
    raise (NotADirectoryError if kind == "NotADirectoryError" else FileNotFoundError)(message)


def remove_rank_files(checkpoint_id: PathLike, rank: int) -> None:
    """Removes the data files DCP's ``FileSystemWriter`` names after ``rank``
    (``__<rank>_<n>.distcp``) and, for rank 0, DCP's temporary metadata: the partial
    files of a failed save, which would otherwise keep a full disk full. Only for a
    directory that holds no committed checkpoint (:func:`save` has removed the digests
    record before writing; the recipe empties the step directory). Errors are ignored:
    the save's own failure is the one to report.

    Args:
        checkpoint_id (str | os.PathLike): the checkpoint directory.
        rank (int): the saving rank (in the save's process group).
    """
    _check_path(checkpoint_id, "checkpoint_id")
    rank = check_int(rank, "rank", 0)

    def of_rank(name: str) -> bool:
        m = DCP_DATA_FILE.match(name)
        return (m is not None and int(m.group(1)) == rank) or (rank == 0 and name == DCP_METADATA_NAME + ".tmp")

    _remove_files(Path(checkpoint_id), of_rank)


def _remove_files(directory: Path, doomed: Callable[[str], bool]) -> None:
    """Removes the files of ``directory`` whose name ``doomed`` accepts (DCP's files of a
    directory that holds no committed checkpoint). Errors are ignored: DCP's write, or the
    save's own failure, is the one to report."""
    try:
        names = [p.name for p in directory.iterdir()]
    except OSError:
        return
    for name in names:
        if doomed(name):
            try:
                (directory / name).unlink()
            except OSError:
                pass


def write_digests(checkpoint_id: PathLike, *, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Records the size and sha256 of every file of a finished DCP save in
    :data:`DIGESTS_NAME` (collective: each rank hashes a share of the files, the
    group's rank 0 writes the record atomically). :func:`save` calls it; call it after
    a ``torch.distributed.checkpoint.save(dcp_state_dict(model), ...)`` of your own so
    that :func:`load` can verify the checkpoint.

    Args:
        checkpoint_id (str | os.PathLike): the checkpoint directory.
        process_group (dist.ProcessGroup | None): group of the save (default: the world).

    Raises:
        OSError: a file could not be hashed or the record not written (on every rank).
    """
    _check_path(checkpoint_id, "checkpoint_id")
    problems = _write_digests(checkpoint_id, process_group)
    if problems:
        raise OSError("; ".join(describe_failures(problems)))


#: Key of the digests record set by :func:`save`, which refused NaN / inf tiered rows before
#: writing complete exports: a verified load need not read the exports twice to check them.
_ROWS_CHECKED_KEY: str = "tiered_rows_checked"


def _write_digests(
    checkpoint_id: PathLike, process_group: Optional[dist.ProcessGroup], rows_checked: bool = False
) -> List[Tuple[str, List[int]]]:
    """:func:`write_digests`: returns its failures as ``(problem, ranks)``, the same on
    every rank (empty when the record was written); ``rows_checked`` (:func:`save`) is
    recorded under :data:`_ROWS_CHECKED_KEY`."""
    directory = Path(checkpoint_id)
    rank, world = _rank_world(process_group)
    mine: Dict[str, Any] = {}
    failed: Optional[str] = None
    try:
        names = _referenced_files(FileSystemReader(directory).read_metadata())
        mine = {name: file_entry(directory / name) for name in names[rank::world]}
    except OSError as e:
        failed = f"hashing the files of {directory} failed ({type(e).__name__}: {e})"
    parts = _all_gather((mine, failed), world, process_group)
    problems = [(err, [r]) for r, (_, err) in enumerate(parts) if err is not None]
    if rank == 0 and not problems:
        files = {name: entry for part, _ in parts for name, entry in part.items()}
        body: Dict[str, Any] = {"format": _DIGESTS_FORMAT, "files": files}
        if rows_checked:
            body[_ROWS_CHECKED_KEY] = True
        text = json.dumps(dict(body, digests_sha256=json_digest(body)), indent=1, sort_keys=True)
        try:
            atomic_write_bytes(directory / DIGESTS_NAME, (text + "\n").encode())
        except OSError as e:
            problems.append((f"writing {directory / DIGESTS_NAME} failed ({type(e).__name__}: {e})", [0]))
    if world > 1:  # every rank learns rank 0's verdict (its list holds every problem)
        problems = _all_gather(problems, world, process_group)[0]
    return problems


def _read_digests(directory: Path) -> Dict[str, Any]:
    """The record :data:`DIGESTS_NAME` (``files`` table and flags), checked against its own digest."""
    path = directory / DIGESTS_NAME
    if not path.is_file():
        raise CheckpointIntegrityError(
            [(str(path), "missing: the checkpoint was not written by recpipe.pipeline.checkpoint.dcp.save, or its save "
                         "did not finish")],
            ("if the save finished (e.g. your own torch.distributed.checkpoint.save of dcp_state_dict(model)), "
             "call recpipe.pipeline.checkpoint.dcp.write_digests(checkpoint_id) once on the saving ranks' files",
             "pass verify=False to load it without an integrity check",
             "load an older checkpoint"),
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointIntegrityError([(str(path), f"unreadable ({type(e).__name__}: {e})")], _CORRUPT_FIXES) from None
    body = {k: v for k, v in data.items() if k != "digests_sha256"} if isinstance(data, dict) else {}
    files = body.get("files")
    if body.get("format") != _DIGESTS_FORMAT or not isinstance(files, dict) or not all(
        isinstance(n, str) and "/" not in n and is_file_entry(e) for n, e in files.items()
    ):
        raise CheckpointIntegrityError([(str(path), f"not a {_DIGESTS_FORMAT} record")], _CORRUPT_FIXES)
    if data.get("digests_sha256") != json_digest(body):
        raise CheckpointIntegrityError(
            [(str(path), "its content does not match its own sha256 (altered after the save)")], _CORRUPT_FIXES
        )
    return body


def verify_checkpoint(checkpoint_id: PathLike, *, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Verifies a checkpoint written by :func:`save` against its :data:`DIGESTS_NAME`
    record: the record's own digest, then the size and sha256 of every file it lists
    (collective: each rank verifies a share, all ranks learn every verdict), then that
    DCP's metadata references no file the record does not list.

    Args:
        checkpoint_id (str | os.PathLike): the checkpoint directory.
        process_group (dist.ProcessGroup | None): group of the load (default: the world).

    Raises:
        FileNotFoundError: ``checkpoint_id`` does not exist (on every rank).
        NotADirectoryError: ``checkpoint_id`` is a file (on every rank).
        CheckpointIntegrityError: on every rank, naming each bad file and the problem.
    """
    _check_path(checkpoint_id, "checkpoint_id")
    _check_directory(checkpoint_id, "checkpoint_id", process_group)
    _verify(Path(checkpoint_id), process_group)


def _verify(directory: Path, process_group: Optional[dist.ProcessGroup]) -> bool:
    """:func:`verify_checkpoint` of an existing directory; True when :func:`save` wrote it
    (its record says the tiered rows were checked before they were written)."""
    rank, world = _rank_world(process_group)
    problems: List[Tuple[str, str]] = []
    fixes: Tuple[str, ...] = _CORRUPT_FIXES
    record: Dict[str, Any] = {}
    files: Dict[str, Any] = {}
    try:
        record = _read_digests(directory)
        files = record["files"]
    except CheckpointIntegrityError as e:  # every rank reads the record: rank 0 reports it
        problems, fixes = (e.problems if rank == 0 else []), e.fixes
    for name in sorted(files)[rank::world]:
        problem = file_problem(directory / name, files[name], DIGESTS_NAME)
        if problem is not None:
            problems.append((str(directory / name), problem))
    everyone = [p for part in _all_gather(problems, world, process_group) for p in part]
    if everyone:
        raise CheckpointIntegrityError(everyone, fixes)
    unrecorded = sorted(set(_referenced_files(FileSystemReader(directory).read_metadata())) - set(files))
    if unrecorded:
        raise CheckpointIntegrityError(
            [(str(directory / DCP_METADATA_NAME), f"references {unrecorded}, which {DIGESTS_NAME} does not list "
                                                   "(files of another save)")],
            _CORRUPT_FIXES,
        )
    return record.get(_ROWS_CHECKED_KEY) is True


def tiered_dcp_key(table_fqn: str, rank: int, field: str) -> str:
    """DCP key of one field of one rank's export of a tiered table.

    Args:
        table_fqn (str): ``<module prefix><collection>.<table>`` as in the model's
            ``state_dict()`` (e.g. ``ebc.embedding_bags.t0``).
        rank (int): the exporting shard's rank in the table's sharding group.
        field (str): one of ``global_ids``, ``weights``, ``optimizer_state``,
            ``step``, ``metadata``.

    Returns:
        str: ``tiered.<table_fqn>.rank<rank>.<field>``.
    """
    if field not in _FIELDS:
        raise ValueError(f"field must be one of {_FIELDS}, got {field!r}.")
    return f"{TIERED_DCP_PREFIX}.{table_fqn}.rank{rank}.{field}"


def _regular_state_dict(model: nn.Module) -> Tuple[Dict[str, Any], Dict[str, Tuple[_TieredTablesMixin, str]]]:
    """``model.state_dict()`` without tiered exports, and the tiered modules by prefix."""
    with state_dict_without_tiered_rows(model) as modules:
        state = model.state_dict()
    found = {prefix: (module, module._TIERED_COLLECTION) for prefix, module in modules.items()}
    fused = getattr(model, "fused_optimizer", None)
    if fused is not None:
        state[FUSED_OPTIMIZER_KEY] = fused.state_dict()
    return state, found


def _tiered_tables(found: Dict[str, Tuple[_TieredTablesMixin, str]]) -> Dict[str, TieredEmbeddingShard]:
    """``{table fqn: shard}`` of this rank's tiered shards."""
    return {f"{prefix}{collection}.{name}": shard
            for prefix, (module, collection) in found.items()
            for name, shard in module.tiered_tables().items()}


def dcp_state_dict(model: nn.Module) -> Dict[str, Any]:
    """The state dict to pass to ``torch.distributed.checkpoint.save``.

    Args:
        model (nn.Module): a ``DistributedModelParallel`` (or any module) whose
            sharded collections may hold tiered tables.

    Returns:
        Dict[str, Any]: the regular ``state_dict()`` (tiered rows left out),
        ``fused_optimizer`` (when the model has one) and, for every tiered table,
        this rank's export under :func:`tiered_dcp_key` keys (CPU tensors this rank
        alone writes; ``metadata`` as a JSON string).
    """
    _check_model(model, "dcp_state_dict")
    state, found = _regular_state_dict(model)
    for fqn, shard in _tiered_tables(found).items():
        st = shard.export_state()
        rank = int(st.metadata["rank"])
        state[tiered_dcp_key(fqn, rank, "global_ids")] = st.global_ids
        state[tiered_dcp_key(fqn, rank, "weights")] = st.weights
        state[tiered_dcp_key(fqn, rank, "optimizer_state")] = st.optimizer_state
        state[tiered_dcp_key(fqn, rank, "step")] = torch.tensor(st.step, dtype=torch.int64)
        state[tiered_dcp_key(fqn, rank, "metadata")] = json.dumps(st.metadata, sort_keys=True)
    return state


def _saved_ranks(metadata: Metadata, table_fqn: str) -> Dict[int, List[str]]:
    """Saving ranks of a tiered table in the checkpoint -> the fields present."""
    head = f"{TIERED_DCP_PREFIX}.{table_fqn}.rank"
    ranks: Dict[int, List[str]] = {}
    for key in metadata.state_dict_metadata:
        if not key.startswith(head):
            continue
        rank_str, _, field = key[len(head):].partition(".")
        if rank_str.isdigit() and field in _FIELDS:
            ranks.setdefault(int(rank_str), []).append(field)
    return ranks


_TIERED_KEY = re.compile(rf"^{TIERED_DCP_PREFIX}\.(.+)\.rank\d+\.(?:{'|'.join(_FIELDS)})$")


def _weight_key(table_fqn: str, state: Dict[str, Any]) -> Optional[str]:
    """The key of a tiered table's (placeholder) weight in the model's state dict: the
    longest dotted suffix of ``<table_fqn>.weight`` it holds (DMP strips wrapper
    prefixes such as DDP's ``module.`` from the state dict, not from the fqn)."""
    full = f"{table_fqn}.weight"
    keys = [k for k in state if k == full or full.endswith("." + k)]
    return max(keys, key=len) if keys else None


class _Adoption(NamedTuple):
    """A tiered table of the model that the checkpoint holds as a torchrec table (a
    ``[num_embeddings, dim]`` ShardedTensor ``weight``, e.g. a plain torchrec job's TABLE_WISE
    / ROW_WISE FUSED table): :func:`load_dcp_state_dict` streams the table (and its fused
    optimizer state) one saved block at a time and gives the tiered shard its rows by global id.

    Attributes:
        weight_key (str): the weight's key, in the checkpoint and in the model's state dict
            (where the tiered table keeps an empty placeholder under it).
        state_keys (Tuple[str, ...]): checkpoint keys of the table's fused optimizer state in
            the tiered state's column order (torchrec's ``fused_optimizer.state.<weight_key>.
            <table>.<name>``, :data:`~recpipe.pipeline.tiered.sharders.OPTIMIZER_STATE_NAMES`); empty
            for SGD, or when the checkpoint holds no fused optimizer state (``strict=False``).
        row_order (Optional[RowOrder]): the routed row order the saving table kept (a
            roundrobin / hash_roundrobin FUSED table of recpipe's sharders), None for
            torchrec's contiguous row blocks.
    """

    weight_key: str
    state_keys: Tuple[str, ...]
    row_order: Optional[RowOrder]


def _fused_state_head(weight_key: str, table: str) -> str:
    """The checkpoint key prefix of a torchrec table's fused optimizer state:
    ``fused_optimizer.state.<weight key>.<table>.`` (torchrec names the state
    ``<table config name>.<name>`` under the weight's key)."""
    return f"{FUSED_OPTIMIZER_KEY}.state.{weight_key}.{table}."


def _has_fused_state(metadata: Metadata) -> bool:
    """Whether the checkpoint holds any fused optimizer state (``fused_optimizer.state.*``)."""
    head = f"{FUSED_OPTIMIZER_KEY}.state."
    return any(key.startswith(head) for key in metadata.state_dict_metadata)


def _saved_optimizer(metadata: Metadata, head: str, rows: int, dim: int) -> Tuple[str, Dict[str, List[int]]]:
    """What optimizer the checkpoint's fused state under ``head`` belongs to, by torchrec's
    names and shapes (``momentum1`` ``[rows]``: row-wise Adagrad; ``momentum1`` and
    ``exp_avg_sq`` ``[rows, dim]``: Adam; none: SGD), and the state's names and shapes."""
    found = {key[len(head):]: list(md.size) for key, md in metadata.state_dict_metadata.items()
             if key.startswith(head) and isinstance(md, TensorStorageMetadata)}
    for opt, names in OPTIMIZER_STATE_NAMES.items():
        row = opt is FusedOptimizer.ROWWISE_ADAGRAD
        if found == {n: ([rows] if row else [rows, dim]) for n in names}:
            return opt.value, found
    return "an unrecognised optimizer", found


def _saved_row_order(
    metadata: Metadata, reader: FileSystemReader, weight_key: str, where: str
) -> Tuple[Optional[RowOrder], Optional[str]]:
    """The row order a routed FUSED table was saved in (its ``row_order`` record beside the
    weight; None for contiguous rows), or why its rows cannot be put in global row order."""
    base = weight_key[: -len("weight")] + ROW_ORDER_KEY
    fields = (*RowOrder._fields, "routing_version")
    saved: Dict[str, Any] = {f"{base}.{f}": None for f in fields if f"{base}.{f}" in metadata.state_dict_metadata}
    if not saved:
        return None, None
    _dcp_load(saved, reader, where, no_dist=True)
    record = {f: saved.get(f"{base}.{f}") for f in fields}
    md = metadata.state_dict_metadata[weight_key]
    try:
        order = RowOrder(str(record["dist_type"]), int(record["world_size"]),  # type: ignore[arg-type]
                         int(record["routing_seed"]), int(record["num_embeddings"]))  # type: ignore[arg-type]
        chunks = sorted((int(c.offsets[0]), int(c.sizes[0])) for c in md.chunks)  # type: ignore[union-attr]
        sizes = [local_rows(order.num_embeddings, order.world_size, r) for r in range(order.world_size)]
        layout_ok = (chunks == [(sum(sizes[:r]), n) for r, n in enumerate(sizes)]
                     and order.num_embeddings == int(md.size[0]))  # type: ignore[union-attr]
    except (TypeError, ValueError, KeyError):
        layout_ok = False
    if not layout_ok or int(record.get("routing_version") or 0) != ROUTING_VERSION:
        return None, (f"its weight was saved with {describe_row_order(record)} in a layout this recpipe "
                      f"cannot put in global row order (routing version {ROUTING_VERSION})")
    return order, None


def _check_table_kinds(
    metadata: Metadata,
    reader: FileSystemReader,
    state: Dict[str, Any],
    tiered_here: Dict[str, TieredEmbeddingShard],
    where: str,
    strict: bool,
    process_group: Optional[dist.ProcessGroup],
) -> Tuple[List[str], Dict[str, _Adoption], List[str]]:
    """Refuses, on every rank and before anything is read, a checkpoint whose tables
    are tiered where this model's are torchrec tables, or tiered in this model where
    the checkpoint holds no rows of them (a checkpoint saved with another kind of plan):
    DCP itself would fail mid-load with "Missing key" or "Size mismatch" on some ranks only.

    A tiered table the checkpoint holds as a torchrec table (a ``[num_embeddings, dim]``
    weight, e.g. a plain torchrec job's FUSED table) is adopted: loaded from the torchrec table
    (:class:`_Adoption`), when its shape and fused optimizer state fit the tiered table
    (another shape, or the state of another optimizer, is refused naming both).

    Args:
        metadata (Metadata): the checkpoint's DCP metadata.
        reader (FileSystemReader): the checkpoint (row-order records of routed FUSED tables).
        state (Dict[str, Any]): the model's regular state dict (to name the weight
            key a torchrec table of the same name would have).
        tiered_here (Dict[str, TieredEmbeddingShard]): this rank's tiered tables by fqn.
        where (str): the checkpoint, for messages.
        strict (bool): also refuse tiered tables of the checkpoint that this model
            does not tier at all, and this model's tiered tables the checkpoint does not
            hold at all (``load_state_dict``'s ``strict``).
        process_group (dist.ProcessGroup | None): group of the load.

    Returns:
        Tuple[List[str], Dict[str, _Adoption]]: without ``strict``, this rank's tiered tables
        the checkpoint does not hold at all (no tiered rows, no weight entry: they keep their
        rows); and this rank's tiered tables to load from the checkpoint's torchrec tables.

    Raises:
        TieredCheckpointError: naming every such table, with possible solutions.
    """
    world = _rank_world(process_group)[1]
    tiered_anywhere = {fqn for part in _all_gather(sorted(tiered_here), world, process_group) for fqn in part}
    saved_tiered = {m.group(1) for key in metadata.state_dict_metadata if (m := _TIERED_KEY.match(key))}
    fused_state = _has_fused_state(metadata)
    problems: List[str] = []
    misfits: List[str] = []
    absent: List[str] = []
    adopted: Dict[str, _Adoption] = {}
    for fqn in sorted(set(tiered_here) - saved_tiered):
        key = _weight_key(fqn, state)
        weight = metadata.state_dict_metadata.get(key) if key is not None else None
        if weight is None and not strict:  # not in the checkpoint at all: the table keeps its rows
            absent.append(fqn)
            continue
        if not isinstance(weight, TensorStorageMetadata) or weight.size.numel() == 0 or len(weight.size) != 2:
            problems.append(f"table {fqn!r} is tiered in this model, but the checkpoint holds no rows of it")
            continue
        assert key is not None
        shard, table = tiered_here[fqn], fqn.rsplit(".", 1)[-1]
        mine, theirs = [shard.num_embeddings, shard.embedding_dim], list(weight.size)
        if theirs != mine:
            misfits.append(f"table {fqn!r}: the checkpoint holds a torchrec table of [num_embeddings, dim] = "
                           f"{theirs}, this model a tiered table of {mine}")
            continue
        saved_opt, names = _saved_optimizer(metadata, _fused_state_head(key, table), *mine)
        want = shard.optimizer.name
        if names or fused_state:  # the checkpoint holds fused optimizer state: this table's must be its optimizer's
            if saved_opt != want:
                got = f"{saved_opt} state {names}" if names else "no state (sgd)"
                misfits.append(f"table {fqn!r}: the checkpoint holds fused optimizer state of {got} "
                               f"(under {_fused_state_head(key, table)}*), this model's tiered table trains with "
                               f"{want}")
                continue
        order, refusal = _saved_row_order(metadata, reader, key, where)
        if refusal is not None:
            misfits.append(f"table {fqn!r}: {refusal}")
            continue
        state_keys = tuple(_fused_state_head(key, table) + n for n in OPTIMIZER_STATE_NAMES[FusedOptimizer(want)]
                           if _fused_state_head(key, table) + n in metadata.state_dict_metadata)
        adopted[fqn] = _Adoption(key, state_keys, order)
    # tiered when saved, a torchrec (ShardedTensor) table here: loaded from the exports (_check_unadoptions)
    fused_here = sorted(fqn for fqn in saved_tiered - tiered_anywhere
                        if isinstance(state.get(_weight_key(fqn, state) or ""), ShardedTensor))
    fused_anywhere = {fqn for part in _all_gather(fused_here, world, process_group) for fqn in part}
    if strict:
        problems += [f"table {fqn!r} was tiered when saved, but this model does not tier it"
                     for fqn in sorted(saved_tiered - tiered_anywhere - fused_anywhere)]
    parts = _all_gather((problems, misfits), world, process_group)
    everyone = sorted({p for part, _ in parts for p in part})
    if everyone:
        raise TieredCheckpointError(
            f"{where} does not fit this model's tables: " + "; ".join(everyone) + ". Possible solutions:\n"
            "  1. shard every table as the saving job did: tables tiered there (recpipe's tiered sharders and "
            "placement plan) tiered here, torchrec tables as torchrec tables or tiered (a tiered table loads a "
            "torchrec table's rows; the recipe: resume with the checkpoint's --placement)\n"
            "  2. a module or table was renamed: load with the names it was saved under\n"
            "  3. start from fresh tables instead of this checkpoint"
        )
    everyone = sorted({p for _, part in parts for p in part})
    if everyone:
        raise TieredCheckpointError(
            f"{where}: a tiered table of this model cannot load the torchrec table the checkpoint holds: "
            + "; ".join(everyone) + ". Nothing was loaded: the model is unchanged. Possible solutions:\n"
            "  1. build each such table as it was saved: the same num_embeddings and embedding_dim, and the same "
            "fused optimizer (apply_optimizer_in_backward's, or the sharder's fused_params: SGD, RowWiseAdagrad "
            "or Adam)\n"
            "  2. load a checkpoint saved from this model's configuration\n"
            "  3. start from fresh tables instead of this checkpoint"
        )
    return absent, adopted, sorted(fused_anywhere)


class _Unadoption(NamedTuple):
    """A table tiered in the checkpoint that this model holds as a torchrec (ShardedTensor)
    table, checked by :func:`_check_unadoptions`; :func:`_fill_unadopted` gathers the rows this
    rank's shards hold (values and fused optimizer state) from every saving rank's export by
    global id, one table at a time.

    Attributes:
        fqn (str): the table's fqn (``<collection>.<table>``).
        weight_key (str): the table's weight key in the model's state dict.
        heads (Dict[int, Dict[str, Any]]): every saving rank's export metadata and step.
        desc (Any): the model's table as the optimizer-state migration describes it (rows, dim,
            fused optimizer; ``recpipe.pipeline.tiered.sharders``' gathered description).
        own_weight (Any): the model's own weight (its ShardedTensor, kept out of DCP's load, as
            the checkpoint holds a placeholder, and given back to ``model.load_state_dict``, which
            copies it in: :func:`_fill_unadopted` writes the table's rows into it first).
        fused_entry (Any): the table's entry of the model's own ``fused_optimizer.state_dict()``
            (kept out of DCP's load, which would look for it in the checkpoint, and given back to
            ``model.fused_optimizer.load_state_dict``, which wants every table's).
        row_order (Any): the model's own row-order record of a routed table (kept out of DCP's
            load, as the checkpoint has none, and given back to ``model.load_state_dict``).
    """

    fqn: str
    weight_key: str
    heads: Dict[int, Dict[str, Any]]
    desc: Any
    own_weight: Any
    fused_entry: Any
    row_order: Any


def _unadopted_exports(
    u: _Unadoption, reader: FileSystemReader, metadata: Metadata, n: int, where: str
) -> Iterator[Tuple[torch.Tensor, TieredShardState]]:
    """Every saving rank's export of an unadopted table in turn (one held at a time): its global
    ids as int64 and the export, refusing ids outside ``[0, n)``."""
    for r in sorted(u.heads):
        st = _read_export(reader, metadata, u.fqn, r, where)
        gids = st.global_ids.to(torch.int64)
        if gids.numel() and (int(gids.min()) < 0 or int(gids.max()) >= n):
            raise TieredCheckpointError(
                f"{where}: table {u.fqn!r}: the tiered export of rank {r} holds global ids outside [0, {n}); "
                "the checkpoint is damaged or was edited: re-save it. Nothing was loaded: the model is "
                "unchanged.")
        yield gids, st
        del st, gids


@torch.no_grad()
def _check_unadoptions(
    model: nn.Module,
    tables: Sequence[str],
    state: Dict[str, Any],
    reader: FileSystemReader,
    metadata: Metadata,
    where: str,
    process_group: Optional[dist.ProcessGroup],
) -> Dict[str, _Unadoption]:
    """Checks the tiered exports of ``tables`` (tiered in the checkpoint, torchrec tables in this
    model), refusing, on every rank before anything is loaded, exports of another size or
    optimizer than the table's, rows missing or repeated, and NaN / inf rows. Reads every export
    once and keeps none (extra memory: one export and a count per row of the table). Removes the
    tables' weight, row-order record and fused optimizer state from ``state`` (the checkpoint
    holds a placeholder / nothing under their keys): :func:`load_dcp_state_dict` loads the tables
    after DCP's load, one at a time (:func:`_fill_unadopted`).

    Args:
        model (nn.Module): the model to load into (its tables' optimizers and shapes).
        tables (Sequence[str]): fqns of such tables, the same on every rank.
        state (Dict[str, Any]): the model's regular state dict for DCP's load (changed).
        reader (FileSystemReader): the checkpoint.
        metadata (Metadata): its DCP metadata.
        where (str): the checkpoint, for messages.
        process_group (dist.ProcessGroup | None): group of the load.

    Returns:
        Dict[str, _Unadoption]: by table fqn.

    Raises:
        TieredCheckpointError: naming the table, both shapes or optimizers and the fixes.
    """
    if not tables:
        return {}
    desc = _describe_tables(_optimizer_tables(model), process_group)  # collective
    out: Dict[str, _Unadoption] = {}

    def check() -> None:
        for fqn in tables:
            key = _weight_key(fqn, state)
            assert key is not None
            d = desc.get(key[: -len(".weight")])
            heads = _tiered_heads(None, reader, metadata, fqn, where)
            md = heads[min(heads)]["metadata"]
            saved = [md.get("num_embeddings"), md.get("embedding_dim"), md.get("optimizer")]
            if d is None or d.optimizer not in {o.value for o in OPTIMIZER_STATE_NAMES} or saved != [
                    d.rows, d.dim, d.optimizer]:
                mine = (f"[{d.rows}, {d.dim}] trained with {d.optimizer}" if d is not None
                        else "without a fused optimizer")
                raise TieredCheckpointError(
                    f"{where}: table {fqn!r} was tiered when saved ([{md.get('num_embeddings')}, "
                    f"{md.get('embedding_dim')}] trained with {md.get('optimizer')}), and this model's torchrec table "
                    f"is {mine}. Nothing was loaded: the model is unchanged. Possible solutions:\n"
                    "  1. build the table as it was saved (the same num_embeddings, embedding_dim and fused optimizer: "
                    "SGD, RowWiseAdagrad or Adam, TABLE_WISE or ROW_WISE)\n"
                    "  2. plan it tiered, as it was saved\n  3. start from fresh tables instead of this checkpoint")
            u = _Unadoption(fqn, key, heads, d, None, None, None)
            count = torch.zeros(d.rows, dtype=torch.int64)
            non_finite = 0
            for gids, st in _unadopted_exports(u, reader, metadata, d.rows, where):
                count.index_add_(0, gids, torch.ones_like(gids))
                bad = _non_finite_rows(st.weights, st.optimizer_state)
                non_finite += 0 if bad is None else int(bad.sum())
                del gids, st  # before the next export is read
            if bool((count != 1).any()):
                raise TieredCheckpointError(
                    f"{where}: table {fqn!r}: {int((count == 0).sum())} rows are missing from its tiered exports and "
                    f"{int((count > 1).sum())} appear more than once; the exports do not partition the table: "
                    "re-save the checkpoint. Nothing was loaded: the model is unchanged.")
            if non_finite:
                raise TieredCheckpointError(
                    f"{where}: table {fqn!r}: {non_finite} rows of its tiered exports hold NaN or inf values or "
                    "optimizer state. Nothing was loaded: the model is unchanged. Possible solutions:\n"
                    + "\n".join(f"  {i}. {fix}" for i, fix in enumerate(_NON_FINITE_FIXES, 1)))
            out[fqn] = u

    problems = _refusals(check, process_group)
    if problems:
        mine = dict(problems).get(_rank_world(process_group)[0])
        raise TieredCheckpointError(mine if mine is not None else f"on rank {problems[0][0]}: {problems[0][1]}")
    fused = state.get(FUSED_OPTIMIZER_KEY)
    for fqn, u in out.items():
        u = u._replace(own_weight=state.pop(u.weight_key, None),
                       row_order=state.pop(u.weight_key[: -len("weight")] + ROW_ORDER_KEY, None))
        if isinstance(fused, dict) and isinstance(fused.get("state"), dict):
            u = u._replace(fused_entry=fused["state"].pop(u.weight_key, None))
        out[fqn] = u
    return out


def _global_rows(rows: Any) -> torch.Tensor:
    """A shard's global rows (a contiguous ``slice`` or int64 routed ids) as int64 ids."""
    return torch.arange(rows.start, rows.stop, dtype=torch.int64) if isinstance(rows, slice) else rows


@torch.no_grad()
def _fill_unadopted(
    u: _Unadoption, reader: FileSystemReader, metadata: Metadata, where: str
) -> Callable[[str, Any], torch.Tensor]:
    """Writes an unadopted table's rows (checked by :func:`_check_unadoptions`) into the model's
    own weight shards (``u.own_weight``, which ``model.load_state_dict`` is given after): only
    the rows this rank's shards hold are gathered from every saving rank's export, by global id.
    Returns where :func:`~recpipe.pipeline.tiered.sharders._write_optimizer_rows` reads the table's
    fused optimizer state of those rows (torchrec's names). Extra memory: this rank's rows of the
    table (values and state) and one export."""
    order = RowOrder(*(u.row_order[f] for f in RowOrder._fields)) if u.row_order is not None else None
    shards = u.own_weight.local_shards()
    rows = [_shard_global_rows(s.metadata, int(s.tensor.shape[0]), order) for s in shards]
    needed = torch.unique(torch.cat([_global_rows(r) for r in rows])) if rows else torch.empty(0, dtype=torch.int64)
    m = needed.numel()
    weights = torch.zeros((m, u.desc.dim), dtype=torch.float32)
    opt = torch.zeros((m, TieredOptimizerConfig(optimizer=u.desc.optimizer).state_cols(u.desc.dim)),
                      dtype=torch.float32)
    for gids, st in (_unadopted_exports(u, reader, metadata, u.desc.rows, where) if m else ()):
        pos = torch.searchsorted(needed, gids).clamp_(max=m - 1)
        hit = (needed.index_select(0, pos) == gids).nonzero().squeeze(1)
        at = pos.index_select(0, hit)
        weights.index_copy_(0, at, st.weights.index_select(0, hit).to(torch.float32))
        opt.index_copy_(0, at, st.optimizer_state.index_select(0, hit).to(torch.float32))
        del pos, hit, at, gids, st  # before the next export is read

    def positions(r: Any) -> torch.Tensor:
        return torch.searchsorted(needed, _global_rows(r))

    for shard, r in zip(shards, rows):  # whole rows, or a column-wise shard's columns
        c0, t = int(shard.metadata.shard_offsets[1]), shard.tensor
        t.copy_(weights.index_select(0, positions(r))[:, c0:c0 + t.shape[1]].to(t.device, t.dtype))
    del weights
    named = _named_to_columns(u.desc, opt, u.fqn.rsplit(".", 1)[-1])
    return lambda k, r: named[k].index_select(0, positions(r))


def _check_fused_optimizer(
    metadata: Metadata,
    state: Dict[str, Any],
    where: str,
    strict: bool,
    process_group: Optional[dist.ProcessGroup],
    adopted_without_state: Sequence[str] = (),
) -> None:
    """A checkpoint without fused optimizer state, e.g. torchrec's own
    ``torch.distributed.checkpoint.save(model.state_dict(), ...)``: refused with
    ``strict`` (on every rank: the verdict is gathered, as a rank holding no FUSED shard
    expects no state), else ``state`` loses its :data:`FUSED_OPTIMIZER_KEY` entry so that
    the model keeps its own optimizer state. DCP alone would fail with a "Missing key" of
    the first optimizer entry, even without ``strict``.

    Args:
        adopted_without_state (Sequence[str]): this rank's tiered tables loaded from the
            checkpoint's torchrec tables whose optimizer keeps state the checkpoint lacks
            (they keep zero state without ``strict``).
    """
    expected = (flatten_state_dict({FUSED_OPTIMIZER_KEY: state[FUSED_OPTIMIZER_KEY]})[0]
                if FUSED_OPTIMIZER_KEY in state else {})
    if FUSED_OPTIMIZER_KEY in state and not expected:
        # nothing to load on this rank (e.g. it holds no FUSED shard: {"state": {}}), which DCP
        # would look for as an entry of its own ("Missing key in checkpoint state_dict: fused_optimizer")
        del state[FUSED_OPTIMIZER_KEY]
    found = any(key in metadata.state_dict_metadata for key in expected)
    lacks = (bool(expected) and not found) or bool(adopted_without_state)
    if not strict:
        if expected and not found:
            del state[FUSED_OPTIMIZER_KEY]
        return
    world = _rank_world(process_group)[1]
    verdicts = _all_gather((lacks, found), world, process_group)
    # refused only when no rank finds any of its state (a checkpoint holding some of it: DCP
    # names each missing entry)
    if not any(lack for lack, _ in verdicts) or any(f for _, f in verdicts):
        return
    head = FUSED_OPTIMIZER_KEY + "."
    raise CheckpointLoadError(
        where,
        [(f"it holds no fused optimizer state (no {head}* entry): it was saved from model.state_dict() alone, "
          "e.g. by torchrec's own torch.distributed.checkpoint.save(model.state_dict(), ...)", list(range(world)))],
        ("pass strict=False to load its weights and keep this model's fused optimizer state (e.g. fresh Adagrad "
         "accumulators; a tiered table loading a torchrec table's rows starts from zero state: training goes on, "
         "but not exactly as the saving job's would)",
         f"save with recpipe.pipeline.checkpoint.dcp.save, or add model.fused_optimizer.state_dict() under the key "
         f"{FUSED_OPTIMIZER_KEY!r} of the state dict you save"),
    )


def _check_unexpected_entries(
    metadata: Metadata,
    state: Dict[str, Any],
    where: str,
    strict: bool,
    process_group: Optional[dist.ProcessGroup],
    adopted: Sequence[_Adoption] = (),
) -> None:
    """With ``strict``, refuses (on every rank, before anything is read) a checkpoint
    holding regular entries this model does not have, e.g. a table or layer the saving
    model had: ``dcp.load`` reads only the model's keys and would drop them silently,
    where ``load_state_dict(strict=True)`` refuses unexpected keys. The entries of the
    torchrec tables that tiered tables load (``adopted``: their fused optimizer state and
    row-order record) are this model's.

    Raises:
        CheckpointLoadError: naming (up to 5 of) the entries and their number.
    """
    if not strict:
        return
    expected = set(flatten_state_dict(state)[0])
    for a in adopted:
        row_order = a.weight_key[: -len("weight")] + ROW_ORDER_KEY + "."
        expected.update(a.state_keys)
        expected.add(a.weight_key)
        expected.update(k for k in metadata.state_dict_metadata if k.startswith(row_order))
    unexpected = [k for k in metadata.state_dict_metadata if k not in expected and not _TIERED_KEY.match(k)]
    world = _rank_world(process_group)[1]
    # A rank's state holds only its own shards' optimizer entries (e.g. of a TABLE_WISE
    # table another rank owns): an entry is the model's when any rank has it.
    parts = _all_gather(unexpected, world, process_group)
    names = sorted(set(parts[0]).intersection(*parts[1:]))
    if not names:
        return
    listed = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
    raise CheckpointLoadError(
        where,
        [(f"it holds entries this model does not have: {listed} (saved by a model with other modules or tables)",
          list(range(world)))],
        ("build the model as the saving job did (the same modules, tables and optimizer)",
         "pass strict=False to load the entries this model has and ignore the others",
         "start from fresh weights instead of this checkpoint"),
    )


def _check_row_orders(
    metadata: Metadata,
    state: Dict[str, Any],
    reader: FileSystemReader,
    where: str,
    process_group: Optional[dist.ProcessGroup],
) -> None:
    """Refuses, on every rank and before any row is read, sharded weights saved in
    another row order than this model's tables (``RowOrder``: a roundrobin /
    hash_roundrobin FUSED table's shards hold routed rows while DCP reshards them as
    contiguous blocks): DCP would write them into the model in place, on other ids,
    before ``load_state_dict`` could look at their record.

    Raises:
        RowOrderMismatchError: naming each such table and both row orders.
    """
    saved_keys = metadata.state_dict_metadata
    fields = (*RowOrder._fields, "routing_version")
    weights = [k for k, v in state.items() if k.endswith(".weight") and isinstance(v, (ShardedTensor, DTensor))
               and k in saved_keys]
    bases = [k[: -len("weight")] + ROW_ORDER_KEY for k in weights]
    saved_bases = [b for b in bases if any(f"{b}.{f}" in saved_keys for f in fields)]
    saved: Dict[str, Any] = {f"{b}.{f}": None for b in saved_bases for f in fields if f"{b}.{f}" in saved_keys}
    if saved:
        _dcp_load(saved, reader, where, no_dist=True)
    problems: List[str] = []
    for weight, base in zip(weights, bases):
        theirs = {f: saved[f"{base}.{f}"] for f in fields if f"{base}.{f}" in saved} if base in saved_bases else None
        if theirs != state.get(base):
            problems.append(f"table {weight[: -len('.weight')]!r}: the checkpoint holds "
                            f"{describe_row_order(theirs)}, this model {describe_row_order(state.get(base))}")
    world = _rank_world(process_group)[1]
    everyone = sorted({p for part in _all_gather(problems, world, process_group) for p in part})
    if everyone:
        raise row_order_refusal(f"recpipe.pipeline.checkpoint.dcp.load of {where}", everyone)


def _read_here(state: Dict[str, Any], reader: FileSystemReader, where: str, **kwargs: Any) -> None:
    """Fills ``state`` from the checkpoint in this process alone (``no_dist``: ranks read
    different keys, or each the whole of a table); a regular tensor of a key saved as a
    ShardedTensor is filled from every saving rank's chunks. ``kwargs``: DCP's (a planner)."""
    with warnings.catch_warnings():  # DCP warns that no_dist means "a single process": here, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        _dcp_load(state, reader, where, no_dist=True, **kwargs)


def _read_fields(
    reader: FileSystemReader, metadata: Metadata, table_fqn: str, rank: int, fields: Tuple[str, ...], where: str
) -> Dict[str, Any]:
    """Reads fields of one saving rank's export of a tiered table (this process only)."""
    state: Dict[str, Any] = {}
    for field in fields:
        key = tiered_dcp_key(table_fqn, rank, field)
        if field == "metadata":
            state[key] = ""
            continue
        md = metadata.state_dict_metadata[key]
        if not isinstance(md, TensorStorageMetadata):
            raise TieredCheckpointError(
                f"{where}: {key} is not a tensor; the checkpoint was not written by "
                "recpipe.pipeline.checkpoint.dcp.save (or was edited): re-save it."
            )
        state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    _read_here(state, reader, where)
    out = {field: state[tiered_dcp_key(table_fqn, rank, field)] for field in fields}
    if "metadata" in out:
        out["metadata"] = json.loads(out["metadata"])
    if "step" in out:
        out["step"] = int(out["step"])
    return out


def _read_export(
    reader: FileSystemReader, metadata: Metadata, table_fqn: str, rank: int, where: str
) -> TieredShardState:
    """Reads one saving rank's whole export of a tiered table (this process only)."""
    f = _read_fields(reader, metadata, table_fqn, rank, _FIELDS, where)
    return TieredShardState(global_ids=f["global_ids"], weights=f["weights"], optimizer_state=f["optimizer_state"],
                            step=f["step"], metadata=f["metadata"])


def _tiered_heads(
    shard: Optional[TieredEmbeddingShard], reader: FileSystemReader, metadata: Metadata, table_fqn: str, where: str
) -> Dict[int, Dict[str, Any]]:
    """Reads and checks the metadata and step of every saving rank's export of one
    table (a few bytes each; nothing is loaded): complete, consistent with each
    other and compatible with ``shard`` (``check_export_metadata``; None: a table this
    model holds as a torchrec table, checked by :func:`_check_unadoptions`).

    Returns:
        Dict[int, Dict[str, Any]]: saving rank -> ``{"metadata", "step"}``.
    """
    ranks = _saved_ranks(metadata, table_fqn)
    if not ranks:
        raise TieredCheckpointError(
            f"{where}: no tiered rows of table {table_fqn!r} (keys {tiered_dcp_key(table_fqn, 0, 'weights')} ...). "
            "Possible solutions:\n  1. the table was not tiered (CUSTOMIZED_KERNEL) when the checkpoint was "
            "saved: plan it as it was saved, or load the rows from its torchrec weight\n  2. the module or "
            "table was renamed: load with the names it was saved under"
        )
    incomplete = {r: sorted(set(_FIELDS) - set(f)) for r, f in ranks.items() if set(f) != set(_FIELDS)}
    if incomplete:
        raise TieredCheckpointError(
            f"{where}: table {table_fqn!r}: exports lack fields {incomplete} (rank: missing fields); "
            "the checkpoint is incomplete: re-save it with recpipe.pipeline.checkpoint.dcp.save."
        )
    heads = {r: _read_fields(reader, metadata, table_fqn, r, ("metadata", "step"), where) for r in sorted(ranks)}
    r0 = min(heads)
    saved_world, step = heads[r0]["metadata"].get("world_size"), heads[r0]["step"]
    for r, head in heads.items():
        if head["metadata"].get("rank") != r:
            raise TieredCheckpointError(
                f"{where}: table {table_fqn!r}: keys of rank {r} hold the export of rank "
                f"{head['metadata'].get('rank')}; the checkpoint was edited: re-save it."
            )
        if head["step"] != step or head["metadata"].get("world_size") != saved_world:
            raise TieredCheckpointError(
                f"{where}: table {table_fqn!r}: saving ranks disagree (rank {r}: step {head['step']}, world size "
                f"{head['metadata'].get('world_size')}; rank {r0}: step {step}, world size {saved_world}); "
                "the directory mixes checkpoints: save into an empty directory."
            )
    if sorted(ranks) != list(range(int(saved_world))):
        raise TieredCheckpointError(
            f"{where}: table {table_fqn!r} was saved by {saved_world} ranks but the checkpoint holds the exports "
            f"of ranks {sorted(ranks)}; the checkpoint is incomplete: re-save it from every rank."
        )
    for head in heads.values():
        if shard is not None:
            shard.check_export_metadata(head["metadata"])
    return heads


_NON_FINITE_FIXES: Tuple[str, ...] = (
    "the saving run diverged (or the rows were set so) and the checkpoint was written without "
    "recpipe.pipeline.checkpoint.dcp.save's check: load an earlier checkpoint",
    "re-save the table from a healthy run",
)


@torch.no_grad()
def _for_rows_of_rank(
    shard: TieredEmbeddingShard,
    heads: Dict[int, Dict[str, Any]],
    reader: FileSystemReader,
    metadata: Metadata,
    table_fqn: str,
    where: str,
    use: Callable[[TieredShardState, torch.Tensor, torch.Tensor], None],
) -> None:
    """Reads every saving rank's export of a table in turn (validated against ``shard``,
    one held at a time) and calls ``use(export, sel, local)``: ``sel`` the positions of
    the export's rows this rank owns under its own routing, ``local`` their local ids.

    Raises:
        TieredCheckpointError: the exports do not hold each of this rank's rows exactly
            once (after the last export), or one disagrees with the table.
    """
    count = torch.zeros(shard.num_rows, dtype=torch.int64)
    for rank in sorted(heads):
        st = _read_export(reader, metadata, table_fqn, rank, where)
        shard._validate_state(st)  # num_embeddings / dim / dtype / optimizer / routing, naming the table
        owner, local = route_ids(st.global_ids, shard.num_embeddings, shard.world_size,
                                 shard.dist_type, shard.routing_seed)
        sel = (owner == shard.rank).nonzero().squeeze(1)
        mine = local.index_select(0, sel)
        count.index_add_(0, mine, torch.ones_like(mine))
        use(st, sel, mine)
        del st, owner, local, sel, mine
    if bool((count != 1).any()):
        bad = shard.global_ids().index_select(0, (count != 1).nonzero().squeeze(1)[:5])
        raise TieredCheckpointError(
            f"{where}: table {table_fqn!r}: {int((count == 0).sum())} rows of rank {shard.rank}/{shard.world_size} "
            f"are missing and {int((count > 1).sum())} appear more than once (e.g. global ids {bad.tolist()}); "
            "the exports do not partition the table: re-save the checkpoint."
        )


@torch.no_grad()
def _check_tiered_rows(
    shard: TieredEmbeddingShard,
    heads: Dict[int, Dict[str, Any]],
    reader: FileSystemReader,
    metadata: Metadata,
    table_fqn: str,
    where: str,
) -> None:
    """Refuses what ``load_states`` would refuse of the rows :func:`_load_tiered_table`
    loads into ``shard`` (rows missing or repeated, global ids that disagree with their
    metadata, NaN / inf values or optimizer state), before anything is written into the
    model. Reads the same exports, one at a time and keeps none: extra memory is one
    export plus a count per row of this rank.

    Raises:
        TieredCheckpointError: naming the table and the problem.
    """
    if shard.routes_as(heads[shard.rank]["metadata"] if shard.rank in heads else {}):
        st = _read_export(reader, metadata, table_fqn, shard.rank, where)
        # row count and global ids: exactly this rank's rows under its own routing
        shard._validate_state(st)
        bad = _non_finite_rows(st.weights, st.optimizer_state)
        non_finite = 0 if bad is None else int(bad.sum())
    else:
        counts: List[int] = []

        def count_non_finite(st: TieredShardState, sel: torch.Tensor, mine: torch.Tensor) -> None:
            bad = _non_finite_rows(st.weights, st.optimizer_state)
            if bad is not None:  # only the rows this rank loads count (as in load_states)
                counts.append(int(bad.index_select(0, sel).sum()))

        _for_rows_of_rank(shard, heads, reader, metadata, table_fqn, where, count_non_finite)
        non_finite = sum(counts)
    if non_finite:
        raise shard._ckpt_error(
            f"{non_finite} of the rows it would load from {where} (table {table_fqn!r}) hold NaN or inf values "
            "or optimizer state", _NON_FINITE_FIXES)


@torch.no_grad()
def _load_tiered_table(
    shard: TieredEmbeddingShard,
    heads: Dict[int, Dict[str, Any]],
    reader: FileSystemReader,
    metadata: Metadata,
    table_fqn: str,
    where: str,
) -> None:
    """Loads one table into ``shard`` from every saving rank's export (by global id).

    ``heads`` are the exports' checked metadata and steps (:func:`_tiered_heads`).
    When the saving job routed the table as this job does (same world size,
    dist_type, seed), this rank's own export holds exactly its rows and is the only
    one read; otherwise every saving rank's export is read in turn and the rows this
    rank owns are gathered.
    """
    ranks = sorted(heads)
    step = heads[ranks[0]]["step"]
    if shard.routes_as(heads[shard.rank]["metadata"] if shard.rank in heads else {}):
        # load_states validates it (table, routing, row count, non-finite values)
        shard.load_states([_read_export(reader, metadata, table_fqn, shard.rank, where)])
        return
    R = shard.num_rows
    weights = torch.empty((R, shard.embedding_dim), dtype=shard.dtype)
    opt = torch.empty((R, shard.fast_state.shape[1]), dtype=torch.float32)

    def gather(st: TieredShardState, sel: torch.Tensor, mine: torch.Tensor) -> None:
        weights.index_copy_(0, mine, st.weights.index_select(0, sel).to(shard.dtype))
        opt.index_copy_(0, mine, st.optimizer_state.index_select(0, sel).to(torch.float32))

    _for_rows_of_rank(shard, heads, reader, metadata, table_fqn, where, gather)
    # This rank's rows, as if exported by a shard of the loading layout: load_states
    # re-checks them (routing, non-finite values) and writes them to their tiers.
    shard.load_states([TieredShardState(global_ids=shard.global_ids(), weights=weights, optimizer_state=opt,
                                        step=step, metadata=shard.metadata())])


class _RowBlockLoadPlanner(DefaultLoadPlanner):
    """Reads rows ``[start, start + rows)`` (first dimension) of each key of the state dict from a
    checkpoint of any sharding into the state dict's ``[rows, ...]`` tensors: the reads DCP's
    resharding plans for a chunk at ``start`` (``create_read_items_for_chunk_list``), so only
    the saved chunks that overlap the block are read.

    Args:
        start (int): the block's first row.
    """

    def __init__(self, start: int) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._start = start

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: List[ReadItem] = []
        for key, rows in self.state_dict.items():
            md = self.metadata.state_dict_metadata[key]
            assert isinstance(md, TensorStorageMetadata)
            chunk = ChunkStorageMetadata(offsets=torch.Size([self._start] + [0] * (rows.dim() - 1)),
                                         sizes=rows.size())
            items += create_read_items_for_chunk_list(key, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]  # the block's own tensor (DCP's default looks the chunk up by offset)


def _saved_blocks(adoption: _Adoption, metadata: Metadata, n: int) -> List[Tuple[int, int]]:
    """The row blocks ``[start, stop)`` a torchrec table of the checkpoint was saved in (its
    chunks' row ranges, cut where any chunk starts or ends; a TABLE_WISE table: one block,
    ROW_WISE: one per saving rank), in row order, empty ones left out."""
    md = metadata.state_dict_metadata[adoption.weight_key]
    assert isinstance(md, TensorStorageMetadata)  # checked by _check_table_kinds
    bounds = sorted({0, n} | {int(c.offsets[0]) + e for c in md.chunks for e in (0, int(c.sizes[0]))})
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if a < b]


def _adopted_blocks(
    shard: TieredEmbeddingShard, adoption: _Adoption, reader: FileSystemReader, metadata: Metadata, where: str
) -> Iterator[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """Reads a torchrec table of the checkpoint one saved row block (:func:`_saved_blocks`) at
    a time (this process alone): yields each block's int64 global ids, ``[rows, dim]`` weights
    and, when ``adoption`` names its fused optimizer state, ``[rows, state_cols]`` fp32 state in
    the tiered shard's column layout (row-wise Adagrad: the momentum; Adam: ``exp_avg`` then
    ``exp_avg_sq``), else None. A routed FUSED table's block of saving rank ``r`` holds ``r``'s
    routed rows in local-id order (:func:`_saved_row_order` checked that its chunks are the
    ranks' blocks). Memory: one saved chunk at a time, as DCP's own load (which reads a whole
    saved chunk for any part of it) needs for a torchrec table."""
    order = adoption.row_order
    rank_at: Dict[int, int] = {}  # a routed table's saving rank by its block's first row
    if order is not None:
        start = 0
        for r in range(order.world_size):
            rows = local_rows(order.num_embeddings, order.world_size, r)
            if rows:
                rank_at[start] = r
            start += rows
    for start, stop in _saved_blocks(adoption, metadata, shard.num_embeddings):
        state: Dict[str, Any] = {}
        for key in (adoption.weight_key, *adoption.state_keys):
            kmd = metadata.state_dict_metadata[key]
            assert isinstance(kmd, TensorStorageMetadata)
            state[key] = torch.empty((stop - start, *kmd.size[1:]), dtype=kmd.properties.dtype)
        _read_here(state, reader, where, planner=_RowBlockLoadPlanner(start))
        weights = state.pop(adoption.weight_key)
        opt = (torch.cat([state.pop(k).reshape(stop - start, -1).to(torch.float32) for k in adoption.state_keys],
                         dim=1) if adoption.state_keys else None)
        gids = order.global_ids(rank_at[start]) if order is not None else torch.arange(start, stop, dtype=torch.int64)
        assert gids.numel() == stop - start
        yield gids, weights, opt
        del state, weights, opt, gids


@torch.no_grad()
def _check_adopted_rows(
    shard: TieredEmbeddingShard, adoption: _Adoption, reader: FileSystemReader, metadata: Metadata, fqn: str,
    where: str,
) -> None:
    """Reads a torchrec table a tiered table loads (:func:`_adopted_blocks`, keeping none) and
    refuses NaN / inf rows (the tiered table could not be saved, nor its export loaded, with them).

    Raises:
        TieredCheckpointError: naming the table and the number of such rows.
    """
    non_finite = 0
    for _, weights, opt in _adopted_blocks(shard, adoption, reader, metadata, where):
        bad = _non_finite_rows(weights, opt if opt is not None else torch.empty((weights.shape[0], 0)))
        non_finite += 0 if bad is None else int(bad.sum())
        del weights, opt  # before the next block is read
    if non_finite:
        raise shard._ckpt_error(
            f"{non_finite} of the {shard.num_embeddings} rows of the torchrec table it would load from {where} "
            f"(table {fqn!r}, {adoption.weight_key}) hold NaN or inf values or optimizer state", _NON_FINITE_FIXES)


def _load_adopted_table(
    shard: TieredEmbeddingShard, adoption: _Adoption, reader: FileSystemReader, metadata: Metadata, fqn: str,
    where: str,
) -> None:
    """Loads a tiered table from the torchrec table the checkpoint holds: streams its saved row
    blocks (:func:`_adopted_blocks`) into ``load_row_blocks``, which writes the rows this rank
    owns, with their fused optimizer state (zero without it), as each block comes. Extra memory:
    one saved block. torchrec's checkpoint holds no optimizer step (fbgemm's ``iter`` is in
    neither its ``state_dict()`` nor its fused optimizer's), so the table keeps its own step, as a
    torchrec table loading that checkpoint keeps its TBE's."""
    step = shard._fbgemm.get_step() if shard._fbgemm is not None else int(shard.step)  # as export_state reads it
    shard.load_row_blocks(_adopted_blocks(shard, adoption, reader, metadata, where), step)


def load_dcp_state_dict(
    model: nn.Module,
    checkpoint: Union[PathLike, FileSystemReader],
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    strict: bool = True,
    verify: bool = True,
    check_rows: Optional[bool] = None,
) -> None:
    """Loads a checkpoint written by :func:`save` into ``model`` (any world size,
    routing and placement).

    Collective over ``process_group`` (every rank calls it). With ``verify``, the
    checkpoint's files are first checked against :data:`DIGESTS_NAME`
    (:func:`verify_checkpoint`), so a damaged checkpoint changes nothing. The regular part goes
    through ``torch.distributed.checkpoint.load`` (which reshards torchrec's
    ShardedTensors / DTensors) and ``model.load_state_dict``; the fused optimizer
    state through ``model.fused_optimizer.load_state_dict``; each tiered table is
    streamed from every saving rank's export, one at a time (read twice: first checked
    on every rank before anything is written into the model, then loaded, so a refused
    load changes nothing). A tiered table the checkpoint holds as a torchrec table (a
    ``[num_embeddings, dim]`` ShardedTensor weight, e.g. a plain torchrec job's
    ``torch.distributed.checkpoint.save({**model.state_dict(), "fused_optimizer":
    model.fused_optimizer.state_dict()})``) is loaded from the torchrec table and its fused
    optimizer state, streamed on every rank one saved chunk at a time (a TABLE_WISE table's
    chunk is the table; extra memory: a chunk plus the rank's own rows; read twice unless
    ``check_rows`` is off); it keeps its own optimizer step (torchrec's checkpoint records
    none). A table tiered in the checkpoint that this model holds as a
    torchrec table is checked before anything is loaded, then each rank gathers the rows its
    shards hold from the exports (one table at a time) and loads them with their optimizer
    state and step.

    Args:
        model (nn.Module): the model to load into (sharded for the loading job).
        checkpoint (str | os.PathLike | FileSystemReader): the checkpoint directory
            or a reader of it.
        process_group (dist.ProcessGroup | None): group of the regular DCP load
            (default: the world, when torch.distributed is initialized).
        strict (bool): ``model.load_state_dict``'s: True refuses (on every rank,
            before anything is read) a checkpoint holding entries this model lacks
            (another layer, table or optimizer) or lacking entries it has; False keeps
            the model's own values of entries the checkpoint lacks, e.g. of a checkpoint
            without fused optimizer state (torchrec's own
            ``torch.distributed.checkpoint.save(model.state_dict(), ...)``) or of a
            (tiered) table the checkpoint does not hold at all, and ignores the
            checkpoint's entries (and tiered tables) this model lacks.
        verify (bool): verify the files' sizes and sha256 first (False: load a
            checkpoint without a digests record, or one verified by other means).
        check_rows (bool | None): read and check every tiered export before anything is
            written into the model (NaN / inf, rows missing), so a refused load leaves it
            unchanged; it reads the exports twice. None (default): unless the verified
            record says :func:`save` wrote the checkpoint (it refused such rows before
            writing them). False: skip it (e.g. the recipe, whose save checked the rows
            and whose manifest verified the files); a refusal then comes after the rest
            was loaded.

    Raises:
        CheckpointIntegrityError: with ``verify``, a file differs from the record, or
            the record is missing or damaged (before anything is loaded).
        ValueError: ``verify`` with a reader of another file system than the local
            one (e.g. torch's ``FsspecReader``), whose files it cannot verify.
        FileNotFoundError: the checkpoint directory does not exist (on every rank).
        NotADirectoryError: ``checkpoint`` is a file, not the checkpoint directory.
        TieredCheckpointError: a table is tiered in the model but the checkpoint holds
            no rows of it, or (``strict``) tiered in the checkpoint but not in the model,
            nor a torchrec table there (on every rank, before anything is read); a table
            tiered in the checkpoint and a torchrec table here of another shape or
            optimizer, or whose exports miss rows or hold NaN / inf; a tiered table the
            checkpoint holds as a torchrec table of another ``[num_embeddings, dim]``, or
            with fused optimizer state of another optimizer (naming the table and both); a tiered
            table's exports are incomplete, or they disagree with the table (names it);
            or some rank's rows are refused (NaN / inf values, rows missing from a
            checkpoint :func:`save` did not write).
            Every tiered export is read and checked (one at a time) before anything is
            written into the model, so each of these leaves the model unchanged, on
            every rank.
        CheckpointLoadError: DCP refused the regular part, e.g. a torchrec table or
            dense layer of another shape, or (``strict``) the checkpoint holds no
            fused optimizer state (also for a tiered table loading a torchrec table:
            ``strict=False`` loads its weights with zero state), holds entries this model
            lacks, or lacks one of its entries (on every rank, before anything is read).
        RowOrderMismatchError: a roundrobin / hash_roundrobin FUSED table saved or
            loaded in another routing, world size or seed (its shards hold routed
            rows, which DCP cannot reshard; on every rank, before any row is read).
    """
    _check_model(model, "load_dcp_state_dict")
    if not isinstance(checkpoint, FileSystemReader):
        _check_path(checkpoint, "checkpoint")
    reader = checkpoint if isinstance(checkpoint, FileSystemReader) else FileSystemReader(checkpoint)
    where = f"checkpoint {os.fspath(reader.path)}"
    local = isinstance(getattr(reader, "fs", None), _LocalFileSystem)  # not e.g. an fsspec reader's URL
    if verify and not local:
        raise ValueError(
            f"`checkpoint` is a {type(reader).__name__} of {os.fspath(reader.path)!r}, but verify=True checks the "
            f"files against {DIGESTS_NAME} on the local file system only; pass a local directory (or a "
            "FileSystemReader of one), or verify=False to load it unverified.")
    if local:
        _check_directory(reader.path, "checkpoint", process_group)
    rows_checked = _verify(Path(reader.path), process_group) if verify else False
    metadata = reader.read_metadata()
    state, found = _regular_state_dict(model)
    tiered = _tiered_tables(found)
    absent, adopted, fused_tiered = _check_table_kinds(metadata, reader, state, tiered, where, strict, process_group)
    # tables tiered in the checkpoint, torchrec tables here: their exports checked first
    unadopted = _check_unadoptions(model, fused_tiered, state, reader, metadata, where, process_group)
    # tiered tables the checkpoint holds as torchrec tables: streamed from them by saved block
    adopters = {fqn: tiered.pop(fqn) for fqn in adopted}
    for fqn in absent:
        del tiered[fqn]
    _check_fused_optimizer(metadata, state, where, strict, process_group,
                           [fqn for fqn, a in adopted.items() if not a.state_keys and adopters[fqn].state_cols])
    _check_row_orders(metadata, state, reader, where, process_group)
    _check_unexpected_entries(metadata, state, where, strict, process_group,
                              [*adopted.values(), *(_Adoption(u.weight_key, (), None) for u in unadopted.values())])
    # Every tiered export's metadata is checked on every rank before anything is loaded,
    # so a table of another size, dim or optimizer leaves the whole model untouched.
    heads: Dict[str, Dict[int, Dict[str, Any]]] = {}

    def read_heads() -> None:
        heads.update({fqn: _tiered_heads(shard, reader, metadata, fqn, where) for fqn, shard in tiered.items()})

    problems = _refusals(read_heads, process_group)
    if problems:
        mine = dict(problems).get(_rank_world(process_group)[0])
        raise TieredCheckpointError(mine if mine is not None else f"on rank {problems[0][0]}: {problems[0][1]}")
    # Then the rows themselves (e.g. NaN / inf rows of a checkpoint not written by save, rows
    # missing): one export at a time, nothing kept; every rank learns any rank's refusal
    # before anything is written into the model, so a refused load changes nothing.
    if check_rows is False or (check_rows is None and rows_checked):
        tiered_to_check: Dict[str, TieredEmbeddingShard] = {}
        adopters_to_check: Dict[str, TieredEmbeddingShard] = {}
    else:
        tiered_to_check, adopters_to_check = tiered, adopters

    def check_rows_first() -> None:
        for fqn, shard in tiered_to_check.items():
            _check_tiered_rows(shard, heads[fqn], reader, metadata, fqn, where)
        for fqn, shard in adopters_to_check.items():  # one saved chunk at a time, nothing kept
            _check_adopted_rows(shard, adopted[fqn], reader, metadata, fqn, where)

    problems = _refusals(check_rows_first, process_group)
    if problems:
        raise TieredCheckpointError(
            "\n".join(f"rank {r}: {p}" for r, p in problems)
            + f"\nNothing was loaded from {where}: the model is unchanged."
        )
    no_dist = not dist.is_initialized()
    # strict=False: entries the checkpoint lacks keep the model's values (load_state_dict's
    # strict=False); DCP alone refuses them ("Missing key in checkpoint state_dict").
    # an adopted table's weight key holds the tiered table's empty placeholder here and the
    # torchrec table in the checkpoint: streamed by _load_adopted_table, not resharded by DCP
    placeholders = {a.weight_key: state.pop(a.weight_key) for a in adopted.values()}
    _dcp_load(state, reader, where, process_group=process_group, no_dist=no_dist,
              planner=DefaultLoadPlanner(allow_partial_load=not strict))
    optimizer_state = state.pop(FUSED_OPTIMIZER_KEY, None)
    state.update(placeholders)
    if optimizer_state is not None:  # the unadopted tables' own state (torchrec's load wants every table)
        optimizer_state["state"].update({u.weight_key: u.fused_entry for u in unadopted.values()
                                         if u.fused_entry is not None})
    # tables tiered in the checkpoint: this rank's rows written into the model's own weight shards,
    # one table at a time (model.load_state_dict copies them in, onto themselves where they alias
    # the TBE's rows); their optimizer state after torchrec's optimizer load, which would reload it
    unadopted_state = {u.weight_key[: -len(".weight")]: (_fill_unadopted(u, reader, metadata, where),
                                                         int(u.heads[min(u.heads)]["step"]))
                       for u in unadopted.values()}
    for u in unadopted.values():
        state[u.weight_key] = u.own_weight
        if u.row_order is not None:
            state[u.weight_key[: -len("weight")] + ROW_ORDER_KEY] = u.row_order
    model.load_state_dict(state, strict=strict)
    if optimizer_state is not None:
        model.fused_optimizer.load_state_dict(optimizer_state)  # type: ignore[union-attr, operator]
    if unadopted_state:  # sets each TBE's step as torchrec's set_optimizer_step
        # the tables' descriptions gathered by _check_unadoptions (the other tables' are not read)
        desc = {u.weight_key[: -len(".weight")]: u.desc for u in unadopted.values()}
        _write_optimizer_rows(model, _optimizer_tables(model), desc, unadopted_state)
    del unadopted, unadopted_state
    # The rows were checked above; load_states checks them again while they load (only a
    # file changed since then fails here): every rank learns any rank's refusal, so none
    # goes on alone.
    problems = _refusals(lambda: ([_load_tiered_table(shard, heads[fqn], reader, metadata, fqn, where)
                                   for fqn, shard in tiered.items()],
                                  [_load_adopted_table(shard, adopted[fqn], reader, metadata, fqn, where)
                                   for fqn, shard in adopters.items()]), process_group)
    if problems:
        raise TieredCheckpointError(
            "\n".join(f"rank {r}: {p}" for r, p in problems)
            + f"\nThe model is partly loaded from {where}: load another checkpoint into it, or rebuild it."
        )


def _refusals(action: Callable[[], Any], process_group: Optional[dist.ProcessGroup]) -> List[Tuple[int, str]]:
    """Runs ``action`` on this rank and returns every rank's refusal (``(rank, message)``
    of a ``TieredCheckpointError`` / ``CheckpointLoadError``), so that all ranks raise
    together instead of one raising while the others wait in the next collective."""
    problem: Optional[str] = None
    try:
        action()
    except (TieredCheckpointError, CheckpointLoadError) as e:
        problem = str(e)
    world = _rank_world(process_group)[1]
    return [(r, p) for r, p in enumerate(_all_gather(problem, world, process_group)) if p is not None]


def _non_finite_tiered_rows(state: Dict[str, Any]) -> List[str]:
    """This rank's tiered exports in ``state`` (:func:`dcp_state_dict`) whose rows hold
    NaN or inf values or optimizer state, one line per table: ``load_states`` refuses
    such rows, so a checkpoint holding them could not be loaded back."""
    problems: List[str] = []
    for key, value in state.items():
        m = _TIERED_KEY.match(key)
        if m is None or not key.endswith(".weights"):
            continue
        opt = state.get(key[: -len("weights")] + "optimizer_state")
        parts = [t for t in (value, opt) if isinstance(t, torch.Tensor) and t.numel()]
        # amax / amin propagate NaN and reach +-inf: two reductions per tensor, no full-size
        # temporary; rows are counted only when one is not finite
        if all(bool(torch.isfinite(torch.stack([t.amax(), t.amin()])).all()) for t in parts):
            continue
        n = int(sum((~torch.isfinite(t.reshape(t.shape[0], -1))).any(dim=1) for t in parts).count_nonzero())
        if n:
            problems.append(f"tiered table {m.group(1)!r}: {n} of the rank's {value.shape[0]} rows hold NaN or "
                            "inf values or optimizer state (load would refuse them)")
    return problems


def save(
    model: nn.Module,
    checkpoint_id: PathLike,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    thread_count: int = 1,
) -> None:
    """Saves ``model`` (regular state, fused optimizer state, tiered tables) with DCP,
    then records every file's size and sha256 (:func:`write_digests`, written last:
    the record marks a finished save).

    Collective over ``process_group`` (every rank calls it).

    Args:
        model (nn.Module): the model (e.g. a ``DistributedModelParallel``).
        checkpoint_id (str | os.PathLike): checkpoint directory (created).
        process_group (dist.ProcessGroup | None): group of the save (default: the
            world, when torch.distributed is initialized).
        thread_count (int): writer threads per rank (``FileSystemWriter``).

    Raises:
        CheckpointSaveError: another save (another job, or a concurrent call) holds
            the directory's lock ``checkpoint_id/SAVE_LOCK_NAME`` (rank 0 holds it for
            the whole save; the message names the holder; nothing was written), or
            ``checkpoint_id`` is a file or cannot be created; DCP failed to write (each rank's partial data files are
            removed first, :func:`remove_rank_files`), rank 0 could not remove an older
            save's digests record, or the digests record could not be written (on
            every rank; no digests record is written, so :func:`load` refuses what
            was written); or a tiered table's rows hold NaN / inf on some rank
            (naming the table and rank; nothing is written and the directory's older
            save keeps its record).
    """
    # checked before anything is touched: a bad argument must not cost the old save its record
    _check_path(checkpoint_id, "checkpoint_id")
    thread_count = check_int(thread_count, "thread_count", 1)
    state = dcp_state_dict(model)
    rank, world = _rank_world(process_group)
    # Tiered rows holding NaN / inf cannot be loaded back (load refuses them, on the ranks
    # owning them only, after the rest of the model was loaded): refused on every rank
    # before anything is written, so the directory keeps its older save.
    non_finite = [(p, [r]) for r, part in enumerate(_all_gather(_non_finite_tiered_rows(state), world,
                                                                 process_group)) for p in part]
    if non_finite:
        raise CheckpointSaveError(
            f"checkpoint {os.fspath(checkpoint_id)}", non_finite,
            ("training diverged (or the rows were set so): find the first non-finite loss, lower the learning "
             "rate, and save from a model whose tables are finite",
             "load the last good checkpoint instead (this save wrote nothing: the directory keeps its older save)"),
        )
    failed: Optional[str] = None
    fixes: Optional[Tuple[str, ...]] = None
    lock: Optional[SaveLock] = None
    if rank == 0:
        # Another job (or call) saving into this directory now would mix its files with this
        # save's and remove them as an older save's: refused before anything is touched.
        if os.path.exists(checkpoint_id) and not os.path.isdir(checkpoint_id):
            failed = f"{os.fspath(checkpoint_id)!r} is a file, not a directory"
            fixes = ("pass a directory (created if missing) as checkpoint_id, e.g. 'ckpt/step_100'",)
        else:
            lock = acquire_save_lock(Path(checkpoint_id))
            if lock.error is not None:
                failed = f"creating {lock.path} failed ({type(lock.error).__name__}: {lock.error})"
            elif lock.holder is not None:
                failed = (f"another save ({lock.holder}) is writing into {os.fspath(checkpoint_id)} at this moment "
                          f"(it holds {lock.path}); two saves into one directory would mix their files")
                fixes = ("give each job (and each concurrent save) its own checkpoint directory",
                         "wait until the other save has returned, then save again (this save wrote nothing: the "
                         "directory keeps what the other save writes)")
    try:
        if failed is None and rank == 0:  # an older save's record no longer describes the files
            record = Path(checkpoint_id, DIGESTS_NAME)
            try:
                record.unlink(missing_ok=True)
            except OSError as e:
                failed = f"removing the old record {record} failed ({type(e).__name__}: {e})"
            if failed is None:
                # The older save is no longer committed: its DCP files go too, or those this save
                # does not overwrite (of a larger world or more writer threads) would stay for good.
                _remove_files(Path(checkpoint_id),
                              lambda name: DCP_DATA_FILE.match(name) is not None or name == DCP_METADATA_NAME)
        # every rank learns it before any enters DCP's save, a collective the others would wait in
        failed, fixes = _all_gather((failed, fixes), world, process_group)[0]
        if failed is not None:
            raise CheckpointSaveError(f"checkpoint {os.fspath(checkpoint_id)}", [(failed, [0])], fixes)
        writer = FileSystemWriter(checkpoint_id, thread_count=thread_count)
        try:
            dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=not dist.is_initialized())
        except CheckpointException as e:
            remove_rank_files(checkpoint_id, rank)  # uncommitted: the old record is gone
            raise CheckpointSaveError(f"checkpoint {os.fspath(checkpoint_id)}", dcp_failures(e)) from None
        problems = _write_digests(checkpoint_id, process_group, rows_checked=True)
        if problems:  # e.g. the disk filled up or the directory became read-only after DCP's write
            raise CheckpointSaveError(f"checkpoint {os.fspath(checkpoint_id)}", problems)
    finally:
        if lock is not None:  # held until the record is written (every rank returned from _write_digests)
            release_save_lock(lock, remove=True)


def load(
    model: nn.Module,
    checkpoint_id: PathLike,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    strict: bool = True,
    verify: bool = True,
    check_rows: Optional[bool] = None,
) -> None:
    """Loads a checkpoint written by :func:`save` (see :func:`load_dcp_state_dict`).

    Args:
        model (nn.Module): the model to load into.
        checkpoint_id (str | os.PathLike): checkpoint directory.
        process_group (dist.ProcessGroup | None): group of the regular DCP load.
        strict (bool): see :func:`load_dcp_state_dict`.
        verify (bool): verify the files against :data:`DIGESTS_NAME` first.
        check_rows (bool | None): see :func:`load_dcp_state_dict`.

    Raises:
        FileNotFoundError: ``checkpoint_id`` does not exist.
        NotADirectoryError: ``checkpoint_id`` is a file (e.g. the checkpoint's
            ``.metadata``), not the checkpoint directory.
        CheckpointIntegrityError, TieredCheckpointError, CheckpointLoadError: see
            :func:`load_dcp_state_dict`.
    """
    _check_path(checkpoint_id, "checkpoint_id")
    _check_model(model, "load")
    _check_directory(checkpoint_id, "checkpoint_id", process_group)
    load_dcp_state_dict(model, FileSystemReader(checkpoint_id), process_group=process_group, strict=strict,
                        verify=verify, check_rows=check_rows)
