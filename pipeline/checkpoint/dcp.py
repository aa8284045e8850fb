"""torch.distributed.checkpoint (DCP) save / load of models with tiered tables.

torchrec's sharded ``state_dict`` skips tiered (CUSTOMIZED_KERNEL) tables, whose routed rows
cannot be a ShardedTensor: :func:`save` writes one DCP checkpoint of the regular state, the
fused optimizer state, every rank's export of each tiered table and its ``extra_state``, then
the digests record. :func:`load` verifies the files first, then loads under any world size,
routing and placement. Imports the other modules of this package, ``routing`` and ``tiered``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem as _LocalFileSystem

from recpipe.pipeline.checkpoint import exports
from recpipe.pipeline.checkpoint.adopt import Adoption, check_adopted_rows, check_table_kinds, load_adopted_table
from recpipe.pipeline.checkpoint.checks import check_fused_optimizer, check_row_orders, check_unexpected_entries
from recpipe.pipeline.checkpoint.digests import (
    DCP_DATA_FILE,
    DCP_METADATA_NAME,
    DIGESTS_NAME,
    PathLike,
    check_directory,
    check_model,
    check_path,
    gather_digests,
    remove_rank_files,
    verify,
)
from recpipe.pipeline.checkpoint.errors import (
    CheckpointSaveError,
    all_gather,
    dcp_failures,
    raise_first_refusal,
    raise_refusals,
    rank_world,
    refusals,
)
from recpipe.pipeline.checkpoint.integrity import SaveLock, acquire_save_lock, release_save_lock
from recpipe.pipeline.checkpoint.layout import (
    FUSED_OPTIMIZER_KEY,
    Source,
    dcp_load,
    dcp_state_dict,
    extra_state_entry,
    non_finite_tiered_rows,
    regular_state_dict,
    remote_tiered_tables,
    tiered_tables,
    weight_key,
)
from recpipe.pipeline.checkpoint.leave import Unadoption, check_unadoptions, fill_unadopted
from recpipe.pipeline.checkpoint.storage import FILE_SYSTEM, OsErrorNamingWriter
from recpipe.pipeline.routing.ops import check_int
from recpipe.pipeline.routing.row_order import ROW_ORDER_KEY
from recpipe.pipeline.tiered.migration import optimizer_tables, write_optimizer_rows
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard


def _open_reader(
    model: nn.Module,
    checkpoint: Union[PathLike, FileSystemReader],
    verify_files: bool,
    process_group: Optional[dist.ProcessGroup],
) -> Tuple[Source, bool]:
    """The checkpoint to read, and whether ``save`` checked its tiered rows."""
    check_model(model, "load_dcp_state_dict")
    if not isinstance(checkpoint, FileSystemReader):
        check_path(checkpoint, "checkpoint")
    reader = checkpoint if isinstance(checkpoint, FileSystemReader) else FileSystemReader(checkpoint)
    local = isinstance(getattr(reader, "fs", None), _LocalFileSystem)  # not e.g. an fsspec reader's URL
    if verify_files and not local:
        raise ValueError(
            f"`checkpoint` is a {type(reader).__name__} of {os.fspath(reader.path)!r}, but verify=True checks the "
            f"files against {DIGESTS_NAME} on the local file system only; pass a local directory (or a "
            "FileSystemReader of one), or verify=False to load it unverified."
        )
    if local:
        check_directory(reader.path, "checkpoint", process_group)
    rows_checked = verify(Path(reader.path), process_group) if verify_files else False
    return Source(reader, reader.read_metadata(), f"checkpoint {os.fspath(reader.path)}"), rows_checked


class _LoadPlan(NamedTuple):
    """What a load does, checked on every rank before anything is read into the model."""

    src: Source
    state: Dict[str, Any]  # the model's regular state dict for DCP's load
    tiered: Dict[str, TieredEmbeddingShard]  # tiered tables loaded from the exports
    heads: Dict[str, Dict[int, Dict[str, Any]]]  # their exports' checked metadata and steps
    adopted: Dict[str, Adoption]  # tiered tables loaded from the checkpoint's torchrec tables
    adopters: Dict[str, TieredEmbeddingShard]  # those tables' shards
    unadopted: Dict[str, Unadoption]  # torchrec tables loaded from the checkpoint's exports
    remote: List[str]  # table-wise tiered tables other ranks hold (fqns): nothing loads here


def _plan_load(model: nn.Module, src: Source, strict: bool, process_group: Optional[dist.ProcessGroup]) -> _LoadPlan:
    """Checks the checkpoint against the model on every rank; reads no row."""
    state, found = regular_state_dict(model)
    tiered = tiered_tables(found)
    absent, adopted, fused_tiered = check_table_kinds(src, state, tiered, strict, process_group)
    # tables tiered in the checkpoint, torchrec tables here: their exports checked first
    unadopted = check_unadoptions(model, fused_tiered, state, src, process_group)
    # tiered tables the checkpoint holds as torchrec tables: streamed from them by saved block
    adopters = {fqn: tiered.pop(fqn) for fqn in adopted}
    for fqn in absent:
        del tiered[fqn]
    without_state = [fqn for fqn, a in adopted.items() if not a.state_keys and adopters[fqn].state_cols]
    check_fused_optimizer(src, state, strict, process_group, without_state)
    check_row_orders(src, state, process_group)
    entries = [*adopted.values(), *(Adoption(u.weight_key, (), None) for u in unadopted.values())]
    check_unexpected_entries(src, state, strict, process_group, entries)
    # a table of another size, dim or optimizer must leave the whole model untouched
    heads: Dict[str, Dict[int, Dict[str, Any]]] = {}

    def read_heads() -> None:
        heads.update({fqn: exports.tiered_heads(shard, src, fqn) for fqn, shard in tiered.items()})

    raise_first_refusal(refusals(read_heads, process_group), process_group)
    return _LoadPlan(src, state, tiered, heads, adopted, adopters, unadopted, remote_tiered_tables(found))


def _each_table(plan: _LoadPlan, check: bool) -> None:
    """Checks (NaN / inf or missing rows, keeping none) or loads the tiered tables: from their
    exports, then the adopted ones from the torchrec tables (one saved chunk at a time)."""
    for fqn, shard in plan.tiered.items():
        if check:
            exports.check_tiered_rows(shard, plan.heads[fqn], plan.src, fqn)
        else:
            exports.load_tiered_table(shard, plan.heads[fqn], plan.src, fqn)
    for fqn, shard in plan.adopters.items():
        if check:
            check_adopted_rows(shard, plan.adopted[fqn], plan.src, fqn)
        else:
            load_adopted_table(shard, plan.adopted[fqn], plan.src)


def _load_regular(model: nn.Module, plan: _LoadPlan, strict: bool, process_group: Optional[dist.ProcessGroup]) -> None:
    """DCP's load of the regular part, the fused optimizer state and the unadopted torchrec tables."""
    state, unadopted, src = plan.state, plan.unadopted, plan.src
    # strict=False: entries the checkpoint lacks keep the model's values (load_state_dict's
    # strict=False); DCP alone refuses them ("Missing key in checkpoint state_dict").
    # an adopted table's weight key holds the tiered table's empty placeholder here and the
    # torchrec table in the checkpoint: streamed by load_adopted_table, not resharded by DCP
    placeholders = {a.weight_key: state.pop(a.weight_key) for a in plan.adopted.values()}
    remote = [weight_key(fqn, state) for fqn in plan.remote]
    placeholders.update({key: state.pop(key) for key in remote if key is not None})
    planner = DefaultLoadPlanner(allow_partial_load=not strict)
    dcp_load(state, src, process_group=process_group, no_dist=not dist.is_initialized(), planner=planner)
    optimizer_state = state.pop(FUSED_OPTIMIZER_KEY, None)
    state.update(placeholders)
    if optimizer_state is not None:  # the unadopted tables' own state (torchrec's load wants every table)
        optimizer_state["state"].update(
            {u.weight_key: u.fused_entry for u in unadopted.values() if u.fused_entry is not None}
        )
    # tables tiered in the checkpoint: this rank's rows written into the model's own weight shards,
    # one table at a time (model.load_state_dict copies them in, onto themselves where they alias
    # the TBE's rows); their optimizer state after torchrec's optimizer load, which would reload it
    unadopted_state = {
        u.weight_key[: -len(".weight")]: (fill_unadopted(u, src), int(u.heads[min(u.heads)]["step"]))
        for u in unadopted.values()
    }
    for u in unadopted.values():
        state[u.weight_key] = u.own_weight
        if u.row_order is not None:
            state[u.weight_key[: -len("weight")] + ROW_ORDER_KEY] = u.row_order
    model.load_state_dict(state, strict=strict)
    if optimizer_state is not None:
        model.fused_optimizer.load_state_dict(optimizer_state)  # type: ignore[union-attr, operator]
    if unadopted_state:  # sets each TBE's step as torchrec's set_optimizer_step
        # the tables' descriptions gathered by check_unadoptions (the other tables' are not read)
        desc = {u.weight_key[: -len(".weight")]: u.desc for u in unadopted.values()}
        write_optimizer_rows(model, optimizer_tables(model), desc, unadopted_state)


def load_dcp_state_dict(
    model: nn.Module,
    checkpoint: Union[PathLike, FileSystemReader],
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    strict: bool = True,
    verify: bool = True,
    check_rows: Optional[bool] = None,
) -> None:
    """Loads a checkpoint written by :func:`save` into ``model`` (any world size, routing and
    placement; a collective over ``process_group``).

    The regular part goes through DCP's load (resharding torchrec's tables); each tiered table
    streams from every saving rank's export, one at a time. Tables of the other kind load from
    torchrec tables (``adopt``) or into them (``leave``).

    Args:
        checkpoint: the checkpoint directory or a reader of it.
        strict: ``model.load_state_dict``'s: True refuses (before anything is read) entries this
            model lacks or has that the checkpoint lacks; False keeps the model's own values of
            missing entries (e.g. fused optimizer state torchrec's own save omits) and ignores extras.
        verify: verify the files' sizes and sha256 against :data:`DIGESTS_NAME` first.
        check_rows: check every tiered export (NaN / inf, missing rows) before anything is
            written, so a refused load leaves the model unchanged (reads them twice). None: unless
            the record says :func:`save` wrote it (which refused such rows).

    Raises:
        CheckpointIntegrityError: with ``verify``, a file or the record is missing or damaged.
        ValueError: ``verify`` with a reader of a non-local file system (e.g. ``FsspecReader``).
        FileNotFoundError: the checkpoint directory does not exist.
        NotADirectoryError: ``checkpoint`` is a file.
        TieredCheckpointError: the checkpoint's tables do not fit the model's, a tiered table's
            exports are incomplete, or rows hold NaN / inf or are missing.
        CheckpointLoadError: DCP refused the regular part (another shape; with ``strict``,
            missing or extra entries).
        RowOrderMismatchError: a routed FUSED table saved or loaded in another routing, world
            size or seed (DCP cannot reshard routed rows).
    """
    src, rows_checked = _open_reader(model, checkpoint, verify, process_group)
    plan = _plan_load(model, src, strict, process_group)
    if not (check_rows is False or (check_rows is None and rows_checked)):
        problems = refusals(lambda: _each_table(plan, check=True), process_group)
        raise_refusals(problems, f"Nothing was loaded from {src.where}: the model is unchanged.")
    _load_regular(model, plan, strict, process_group)
    # Checked again while loading (only a file changed since fails here); every rank learns any refusal.
    problems = refusals(lambda: _each_table(plan, check=False), process_group)
    raise_refusals(
        problems, f"The model is partly loaded from {src.where}: load another checkpoint into it, or rebuild it."
    )


def _lock_directory(checkpoint_id: PathLike) -> Tuple[Optional[SaveLock], Optional[str], Optional[Tuple[str, ...]]]:
    """Rank 0 of a save: takes the directory's lock and removes the older save's record and DCP files.
    Returns the lock and what failed (with its fixes), if anything."""
    if os.path.exists(checkpoint_id) and not os.path.isdir(checkpoint_id):
        return (
            None,
            f"{os.fspath(checkpoint_id)!r} is a file, not a directory",
            ("pass a directory (created if missing) as checkpoint_id, e.g. 'ckpt/step_100'",),
        )
    # a concurrent save would mix its files with ours: refused before anything is touched
    lock = acquire_save_lock(Path(checkpoint_id))
    if lock.error is not None:
        return lock, f"creating {lock.path} failed ({type(lock.error).__name__}: {lock.error})", None
    if lock.holder is not None:
        problem = (
            f"another save ({lock.holder}) is writing into {os.fspath(checkpoint_id)} at this moment "
            f"(it holds {lock.path}); two saves into one directory would mix their files"
        )
        fixes = (
            "give each job (and each concurrent save) its own checkpoint directory",
            "wait until the other save has returned, then save again (this save wrote nothing: the "
            "directory keeps what the other save writes)",
        )
        return lock, problem, fixes
    record = Path(checkpoint_id, DIGESTS_NAME)
    try:  # an older save's record does not describe the files this save writes
        record.unlink(missing_ok=True)
    except OSError as e:
        return lock, f"removing the old record {record} failed ({type(e).__name__}: {e})", None
    # files this save does not overwrite (larger world, more writer threads) would stay for good
    FILE_SYSTEM.remove_files(
        Path(checkpoint_id), lambda name: DCP_DATA_FILE.match(name) is not None or name == DCP_METADATA_NAME
    )
    return lock, None, None


def save(
    model: nn.Module,
    checkpoint_id: PathLike,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    thread_count: int = 1,
    extra_state: Any = None,
    check_state: Optional[Callable[[Dict[str, Any]], None]] = None,
) -> None:
    """Saves ``model`` (regular state, fused optimizer state, tiered tables) with DCP, then
    writes the digests record last (it marks a finished save). Collective over ``process_group``.

    Args:
        checkpoint_id: checkpoint directory (created).
        thread_count: writer threads per rank (DCP's ``FileSystemWriter``).
        extra_state: a picklable object of this rank saved under ``extra_state.rank<r>``
            (read back with ``read_extra_state``).
        check_state: called on every rank with the state about to be written, before anything
            is touched; what it raises stops the save (it must raise on every rank alike).

    Raises:
        CheckpointSaveError: on every rank, when another save holds the directory's lock,
            ``checkpoint_id`` is a file or cannot be created, DCP or the record failed to write,
            or a tiered table's rows hold NaN / inf (nothing written).
    """
    # checked before anything is touched: a bad argument must not cost the old save its record
    check_path(checkpoint_id, "checkpoint_id")
    thread_count = check_int(thread_count, "thread_count", 1)
    state = dcp_state_dict(model)
    rank, world = rank_world(process_group)
    if extra_state is not None:
        key, value = extra_state_entry(extra_state, rank)
        state[key] = value
    if check_state is not None:
        check_state(state)
    where = f"checkpoint {os.fspath(checkpoint_id)}"
    # NaN / inf tiered rows cannot be loaded back: refused before anything is written.
    non_finite = [
        (p, [r]) for r, part in enumerate(all_gather(non_finite_tiered_rows(state), world, process_group)) for p in part
    ]
    if non_finite:
        fixes = (
            "training diverged (or the rows were set so): find the first non-finite loss, lower the learning "
            "rate, and save from a model whose tables are finite",
            "load the last good checkpoint instead (this save wrote nothing: the directory keeps its older save)",
        )
        raise CheckpointSaveError(where, non_finite, fixes)
    lock, failed, fixes = _lock_directory(checkpoint_id) if rank == 0 else (None, None, None)
    try:
        # every rank learns it before any enters DCP's save, a collective the others would wait in
        failed, fixes = all_gather((failed, fixes), world, process_group)[0]
        if failed is not None:
            raise CheckpointSaveError(where, [(failed, [0])], fixes)
        try:
            torch_dcp.save(
                state,
                storage_writer=OsErrorNamingWriter(checkpoint_id, thread_count=thread_count),
                process_group=process_group,
                no_dist=not dist.is_initialized(),
            )
        except CheckpointException as e:
            remove_rank_files(checkpoint_id, rank)  # uncommitted: the old record is gone
            raise CheckpointSaveError(where, dcp_failures(e)) from None
        problems = gather_digests(checkpoint_id, process_group, rows_checked=True)
        if problems:  # e.g. the disk filled up or the directory became read-only after DCP's write
            raise CheckpointSaveError(where, problems)
    finally:
        if lock is not None and lock.fd is not None:  # held until every rank returned from gather_digests
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
    """Loads the checkpoint directory ``checkpoint_id`` written by :func:`save`; arguments and
    errors as :func:`load_dcp_state_dict`'s."""
    check_path(checkpoint_id, "checkpoint_id")
    check_model(model, "load")
    check_directory(checkpoint_id, "checkpoint_id", process_group)
    load_dcp_state_dict(
        model,
        FileSystemReader(checkpoint_id),
        process_group=process_group,
        strict=strict,
        verify=verify,
        check_rows=check_rows,
    )
