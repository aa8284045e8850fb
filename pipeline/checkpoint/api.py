"""The checkpoint API: :func:`save`, :func:`load` (and :func:`load_dcp_state_dict` of a reader)
and :func:`verify_checkpoint` of models with tiered tables, through ``torch.distributed.checkpoint``
(DCP), and the checks of a checkpoint's regular part against the loading model.

torchrec's sharded ``state_dict`` skips tiered (CUSTOMIZED_KERNEL) tables, whose routed rows
cannot be a ShardedTensor: :func:`save` writes one DCP checkpoint of the regular state, the
fused optimizer state, every rank's export of each tiered table, its rows of each dynamic table
(keyed by raw key: ``dynamic_tables``) and its ``extra_state``, then the digests record. :func:`load` verifies the files first, then loads under any world size,
routing and placement. Every failure is a ``CheckpointError``; each call takes the
``CheckpointStorage`` its records go through (default: the local file system). Imports the other
modules of this package, ``interfaces``, ``routing`` and ``tiered``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem as _LocalFileSystem
from torch.distributed.tensor import DTensor

from recpipe.pipeline.checkpoint import layout
from recpipe.pipeline.checkpoint.checkpoint_errors import (
    CheckpointLoadError,
    CheckpointNotADirectoryError,
    CheckpointNotFoundError,
    CheckpointRowOrderError,
    CheckpointSaveError,
    PathLike,
    check_model,
    check_path,
    dcp_failures,
)
from recpipe.pipeline.checkpoint.collectives import (
    all_gather,
    raise_first_refusal,
    raise_refusals,
    rank_world,
    refusals,
)
from recpipe.pipeline.checkpoint.dynamic_tables import (
    DynamicLoad,
    check_dynamic_table,
    load_dynamic_table,
    plan_dynamic_load,
)
from recpipe.pipeline.checkpoint.integrity import (
    FileSystemStorage,
    OsErrorNamingWriter,
    SaveLock,
    acquire_save_lock,
    gather_digests,
    release_save_lock,
    remove_rank_files,
    verify_directory,
)
from recpipe.pipeline.checkpoint.layout import (
    DCP_DATA_SUFFIX,
    DCP_METADATA_NAME,
    DIGESTS_NAME,
    FUSED_OPTIMIZER_KEY,
    Source,
    dcp_load,
    dcp_state_dict,
    extra_state_entry,
    is_recpipe_key,
    non_finite_tiered_rows,
    read_row_orders,
    regular_state_dict,
    remote_tiered_tables,
    tiered_tables,
    weight_key,
)
from recpipe.pipeline.checkpoint.torchrec_interop import (
    TableFromTorchrec,
    TableIntoTorchrec,
    check_into_torchrec,
    check_rows_from_torchrec,
    check_table_kinds,
    fill_table_into_torchrec,
    load_table_from_torchrec,
)
from recpipe.pipeline.interfaces import CheckpointStorage
from recpipe.pipeline.routing.ops import check_int
from recpipe.pipeline.routing.row_order import ROW_ORDER_KEY, describe_row_order, row_order_refusal
from recpipe.pipeline.tiered.migration import optimizer_tables, write_optimizer_rows
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard


def check_directory(
    directory: PathLike, argument: str, process_group: Optional[dist.ProcessGroup], collective: bool = True
) -> None:
    """Raises, on every rank, ``CheckpointNotFoundError`` / ``CheckpointNotADirectoryError`` when
    ``directory`` is missing or a file on some rank (collective: no rank is left waiting in the
    load's first collective)."""
    problem: Optional[Tuple[type, str]] = None
    if os.path.exists(directory) and not os.path.isdir(directory):
        problem = (
            CheckpointNotADirectoryError,
            f"DCP checkpoint {os.fspath(directory)!r} (`{argument}`) is a file, not a directory; pass the "
            "directory given to recpipe.pipeline.checkpoint.save (the one holding .metadata and "
            f"{DIGESTS_NAME}), not one of its files.",
        )
    elif not os.path.isdir(directory):
        problem = (
            CheckpointNotFoundError,
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


def verify_checkpoint(
    checkpoint_id: PathLike,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    collective: bool = True,
    storage: Optional[CheckpointStorage] = None,
) -> None:
    """Verifies a checkpoint against its digests record (:data:`DIGESTS_NAME`): the record's own
    digest, the size and sha256 of every file (each rank a share), that the directory holds no
    data file the record does not list, and that DCP's metadata references no unlisted file.

    Args:
        collective: False: this process verifies every file alone (no collective).
        storage: lists the directory (default: the local file system).

    Raises:
        CheckpointNotFoundError: ``checkpoint_id`` does not exist (on every rank).
        CheckpointNotADirectoryError: ``checkpoint_id`` is a file (on every rank).
        CheckpointIntegrityError: on every rank, naming each bad file and the problem.
    """
    check_path(checkpoint_id, "checkpoint_id")
    check_directory(checkpoint_id, "checkpoint_id", process_group, collective)
    verify_directory(
        Path(checkpoint_id), process_group, FileSystemStorage() if storage is None else storage, collective
    )


def check_fused_optimizer(
    src: Source,
    state: Dict[str, Any],
    strict: bool,
    process_group: Optional[dist.ProcessGroup],
    without_state_from_torchrec: Sequence[str] = (),
) -> None:
    """Refuses with ``strict`` a checkpoint without fused optimizer state (e.g. torchrec's own
    ``dcp.save(model.state_dict())``) for ``state`` or for this rank's tiered tables loading from
    torchrec tables whose optimizer keeps state (``without_state_from_torchrec``); without ``strict``, drops
    :data:`FUSED_OPTIMIZER_KEY` from ``state`` so the model keeps its own (DCP alone would fail
    with "Missing key" even without ``strict``)."""
    expected = (
        flatten_state_dict({FUSED_OPTIMIZER_KEY: state[FUSED_OPTIMIZER_KEY]})[0] if FUSED_OPTIMIZER_KEY in state else {}
    )
    if FUSED_OPTIMIZER_KEY in state and not expected:
        # nothing to load on this rank (e.g. it holds no FUSED shard: {"state": {}}), which DCP
        # would look for as an entry of its own ("Missing key in checkpoint state_dict: fused_optimizer")
        del state[FUSED_OPTIMIZER_KEY]
    found = any(key in src.metadata.state_dict_metadata for key in expected)
    lacks = (bool(expected) and not found) or bool(without_state_from_torchrec)
    if not strict:
        if expected and not found:
            del state[FUSED_OPTIMIZER_KEY]
        return
    world = rank_world(process_group)[1]
    verdicts = all_gather((lacks, found), world, process_group)
    # refused only when no rank finds any of its state (a checkpoint holding some of it: DCP
    # names each missing entry)
    if not any(lack for lack, _ in verdicts) or any(f for _, f in verdicts):
        return
    problem = (
        f"it holds no fused optimizer state (no {FUSED_OPTIMIZER_KEY}.* entry): it was saved from model.state_dict() "
        "alone, e.g. by torchrec's own torch.distributed.checkpoint.save(model.state_dict(), ...)"
    )
    fixes = (
        "pass strict=False to load its weights and keep this model's fused optimizer state (e.g. fresh Adagrad "
        "accumulators; a tiered table loading a torchrec table's rows starts from zero state: training goes on, "
        "but not exactly as the saving job's would)",
        f"save with recpipe.pipeline.checkpoint.save, or add model.fused_optimizer.state_dict() under the key "
        f"{FUSED_OPTIMIZER_KEY!r} of the state dict you save",
    )
    raise CheckpointLoadError(src.where, [(problem, list(range(world)))], fixes)


def check_unexpected_entries(
    src: Source,
    state: Dict[str, Any],
    strict: bool,
    process_group: Optional[dist.ProcessGroup],
    from_torchrec: Sequence[TableFromTorchrec] = (),
) -> None:
    """With ``strict``, refuses (``CheckpointLoadError``, naming up to 5 and their number) a
    checkpoint holding regular entries this model lacks (``dcp.load`` would drop them silently);
    the entries of the torchrec tables ``from_torchrec`` loads count as the model's."""
    if not strict:
        return
    metadata = src.metadata
    expected = set(flatten_state_dict(state)[0])
    for a in from_torchrec:
        row_order = a.weight_key[: -len("weight")] + ROW_ORDER_KEY + "."
        expected.update(a.state_keys)
        expected.add(a.weight_key)
        expected.update(k for k in metadata.state_dict_metadata if k.startswith(row_order))
    unexpected = [k for k in metadata.state_dict_metadata if k not in expected and not is_recpipe_key(k)]
    world = rank_world(process_group)[1]
    # a rank's state holds only its own shards' optimizer entries: an entry is the model's when any rank has it
    parts = all_gather(unexpected, world, process_group)
    names = sorted(set(parts[0]).intersection(*parts[1:]))
    if not names:
        return
    listed = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
    problem = f"it holds entries this model does not have: {listed} (saved by a model with other modules or tables)"
    fixes = (
        "build the model as the saving job did (the same modules, tables and optimizer)",
        "pass strict=False to load the entries this model has and ignore the others",
        "start from fresh weights instead of this checkpoint",
    )
    raise CheckpointLoadError(src.where, [(problem, list(range(world)))], fixes)


def check_row_orders(src: Source, state: Dict[str, Any], process_group: Optional[dist.ProcessGroup]) -> None:
    """Refuses (``CheckpointRowOrderError``, naming each table and both row orders), before any row
    is read, sharded weights saved in another row order than this model's (routed rows that DCP
    would reshard as contiguous blocks, in place, on other ids)."""
    weights = [
        k
        for k, v in state.items()
        if k.endswith(".weight") and isinstance(v, (ShardedTensor, DTensor)) and k in src.metadata.state_dict_metadata
    ]
    bases = [k[: -len("weight")] + ROW_ORDER_KEY for k in weights]
    saved = read_row_orders(src, bases)
    problems: List[str] = []
    for weight, base in zip(weights, bases):
        theirs = saved.get(base)
        if theirs != state.get(base):
            problems.append(
                f"table {weight[: -len('.weight')]!r}: the checkpoint holds "
                f"{describe_row_order(theirs)}, this model {describe_row_order(state.get(base))}"
            )
    world = rank_world(process_group)[1]
    everyone = sorted({p for part in all_gather(problems, world, process_group) for p in part})
    if everyone:
        raise CheckpointRowOrderError(
            str(row_order_refusal(f"recpipe.pipeline.checkpoint.load of {src.where}", everyone))
        )


class _LoadPlan(NamedTuple):
    """What a load does, checked on every rank before anything is read into the model."""

    src: Source
    state: Dict[str, Any]  # the model's regular state dict for DCP's load
    tiered: Dict[str, TieredEmbeddingShard]  # tiered tables loaded from the exports
    heads: Dict[str, Dict[int, Dict[str, Any]]]  # their exports' checked metadata and steps
    from_torchrec: Dict[str, TableFromTorchrec]  # tiered tables loaded from the checkpoint's torchrec tables
    from_torchrec_shards: Dict[str, TieredEmbeddingShard]  # those tables' shards
    into_torchrec: Dict[str, TableIntoTorchrec]  # torchrec tables loaded from the checkpoint's exports
    remote: List[str]  # table-wise tiered tables other ranks hold (fqns): nothing loads here
    dynamic: Dict[str, DynamicLoad]  # dynamic tables, loaded by raw key (checkpoint.dynamic_tables)


def _plan_load(model: nn.Module, src: Source, strict: bool, process_group: Optional[dist.ProcessGroup]) -> _LoadPlan:
    """Checks the checkpoint against the model on every rank; reads no row."""
    state, found = regular_state_dict(model)
    tiered = tiered_tables(found)
    dynamic = plan_dynamic_load(src, state, tiered, strict, process_group)  # takes them out of `tiered`
    absent, from_torchrec, into_fqns = check_table_kinds(src, state, tiered, strict, process_group)
    # tables tiered in the checkpoint, torchrec tables here: their exports checked first
    into_torchrec = check_into_torchrec(model, into_fqns, state, src, process_group)
    # tiered tables the checkpoint holds as torchrec tables: streamed from them by saved block
    shards = {fqn: tiered.pop(fqn) for fqn in from_torchrec}
    for fqn in absent:
        del tiered[fqn]
    without_state = [fqn for fqn, t in from_torchrec.items() if not t.state_keys and shards[fqn].state_cols]
    check_fused_optimizer(src, state, strict, process_group, without_state)
    check_row_orders(src, state, process_group)
    entries = [*from_torchrec.values(), *(TableFromTorchrec(u.weight_key, (), None) for u in into_torchrec.values())]
    check_unexpected_entries(src, state, strict, process_group, entries)
    # a table of another size, dim or optimizer must leave the whole model untouched
    heads: Dict[str, Dict[int, Dict[str, Any]]] = {}

    def read_heads() -> None:
        heads.update({fqn: layout.tiered_heads(shard, src, fqn) for fqn, shard in tiered.items()})

    raise_first_refusal(refusals(read_heads, process_group), process_group)
    remote = remote_tiered_tables(found)
    return _LoadPlan(src, state, tiered, heads, from_torchrec, shards, into_torchrec, remote, dynamic)


def _each_table(plan: _LoadPlan, check: bool) -> None:
    """Checks (NaN / inf or missing rows, keeping none) or loads the tiered tables: from their
    exports, then those loading from the torchrec tables (one saved chunk at a time), then the
    dynamic tables (by raw key)."""
    for fqn, shard in plan.tiered.items():
        if check:
            layout.check_tiered_rows(shard, plan.heads[fqn], plan.src, fqn)
        else:
            layout.load_tiered_table(shard, plan.heads[fqn], plan.src, fqn)
    for fqn, shard in plan.from_torchrec_shards.items():
        if check:
            check_rows_from_torchrec(shard, plan.from_torchrec[fqn], plan.src, fqn)
        else:
            load_table_from_torchrec(shard, plan.from_torchrec[fqn], plan.src)
    for fqn, load in plan.dynamic.items():
        (check_dynamic_table if check else load_dynamic_table)(load, plan.src, fqn)


def _load_regular(model: nn.Module, plan: _LoadPlan, strict: bool, process_group: Optional[dist.ProcessGroup]) -> None:
    """DCP's load of the regular part, the fused optimizer state and the tables loaded into torchrec."""
    state, into, src = plan.state, plan.into_torchrec, plan.src
    # strict=False: entries the checkpoint lacks keep the model's values (load_state_dict's
    # strict=False); DCP alone refuses them ("Missing key in checkpoint state_dict").
    # a tiered table loading from torchrec: its weight key holds the tiered table's empty placeholder
    # here and the torchrec table in the checkpoint: streamed by load_table_from_torchrec, not resharded by DCP
    placeholders = {t.weight_key: state.pop(t.weight_key) for t in plan.from_torchrec.values()}
    remote = [weight_key(fqn, state) for fqn in plan.remote]
    placeholders.update({key: state.pop(key) for key in remote if key is not None})
    planner = DefaultLoadPlanner(allow_partial_load=not strict)
    dcp_load(state, src, process_group=process_group, no_dist=not dist.is_initialized(), planner=planner)
    optimizer_state = state.pop(FUSED_OPTIMIZER_KEY, None)
    state.update(placeholders)
    if optimizer_state is not None:  # the torchrec tables' own state (torchrec's load wants every table)
        optimizer_state["state"].update(
            {u.weight_key: u.fused_entry for u in into.values() if u.fused_entry is not None}
        )
    # tables tiered in the checkpoint: this rank's rows written into the model's own weight shards,
    # one table at a time (model.load_state_dict copies them in, onto themselves where they alias
    # the TBE's rows); their optimizer state after torchrec's optimizer load, which would reload it
    into_state = {
        u.weight_key[: -len(".weight")]: (fill_table_into_torchrec(u, src), int(u.heads[min(u.heads)]["step"]))
        for u in into.values()
    }
    for u in into.values():
        state[u.weight_key] = u.own_weight
        if u.row_order is not None:
            state[u.weight_key[: -len("weight")] + ROW_ORDER_KEY] = u.row_order
    model.load_state_dict(state, strict=strict)
    if optimizer_state is not None:  # saved by regular_state_dict from the model's fused_optimizer (torchrec's)
        getattr(model, "fused_optimizer").load_state_dict(optimizer_state)
    if into_state:  # sets each TBE's step as torchrec's set_optimizer_step
        # the tables' descriptions gathered by check_into_torchrec (the other tables' are not read)
        desc = {u.weight_key[: -len(".weight")]: u.desc for u in into.values()}
        write_optimizer_rows(model, optimizer_tables(model), desc, into_state)


def _load(
    model: nn.Module,
    reader: FileSystemReader,
    argument: str,
    process_group: Optional[dist.ProcessGroup],
    strict: bool,
    verify: bool,
    check_rows: Optional[bool],
    storage: Optional[CheckpointStorage],
) -> None:
    """:func:`load` of an argument-checked model and reader (``argument``: the reader's name in messages)."""
    local = isinstance(getattr(reader, "fs", None), _LocalFileSystem)  # not e.g. an fsspec reader's URL
    if verify and not local:
        raise ValueError(
            f"`{argument}` is a {type(reader).__name__} of {os.fspath(reader.path)!r}, but verify=True checks the "
            f"files against {DIGESTS_NAME} on the local file system only; pass a local directory (or a "
            "FileSystemReader of one), or verify=False to load it unverified."
        )
    if local:
        check_directory(reader.path, argument, process_group)
    storage = FileSystemStorage() if storage is None else storage
    rows_checked = verify_directory(Path(reader.path), process_group, storage) if verify else False
    src = Source(reader, reader.read_metadata(), f"checkpoint {os.fspath(reader.path)}")
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


def load_dcp_state_dict(
    model: nn.Module,
    checkpoint: Union[PathLike, FileSystemReader],
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    strict: bool = True,
    verify: bool = True,
    check_rows: Optional[bool] = None,
    storage: Optional[CheckpointStorage] = None,
) -> None:
    """Loads a checkpoint written by :func:`save` into ``model`` (any world size, routing and
    placement; a collective over ``process_group``).

    The regular part goes through DCP's load (resharding torchrec's tables); each tiered table
    streams from every saving rank's export, one at a time. Tables of the other kind load from
    the checkpoint's torchrec tables into tiered ones, or from its tiered tables into torchrec ones.

    Args:
        checkpoint: the checkpoint directory or a reader of it.
        strict: ``model.load_state_dict``'s: True refuses (before anything is read) entries this
            model lacks or has that the checkpoint lacks; False keeps the model's own values of
            missing entries (e.g. fused optimizer state torchrec's own save omits) and ignores extras.
        verify: verify the files' sizes and sha256 against :data:`DIGESTS_NAME` first.
        check_rows: check every tiered export (NaN / inf, missing rows) before anything is
            written, so a refused load leaves the model unchanged (reads them twice). None: unless
            the record says :func:`save` wrote it (which refused such rows).
        storage: lists the directory while verifying (default: the local file system).

    Raises:
        CheckpointIntegrityError: with ``verify``, a file or the record is missing or damaged, or
            the directory holds a data file the record does not list.
        ValueError: ``verify`` with a reader of a non-local file system (e.g. ``FsspecReader``).
        CheckpointNotFoundError: the checkpoint directory does not exist.
        CheckpointNotADirectoryError: ``checkpoint`` is a file.
        CheckpointTableError: the checkpoint's tables do not fit the model's, a tiered table's
            exports are incomplete, or rows hold NaN / inf or are missing.
        CheckpointLoadError: DCP refused the regular part (another shape; with ``strict``,
            missing or extra entries).
        CheckpointRowOrderError: a routed FUSED table saved or loaded in another routing, world
            size or seed (DCP cannot reshard routed rows).
    """
    check_model(model, "load_dcp_state_dict")
    if not isinstance(checkpoint, FileSystemReader):
        check_path(checkpoint, "checkpoint")
    reader = checkpoint if isinstance(checkpoint, FileSystemReader) else FileSystemReader(checkpoint)
    _load(model, reader, "checkpoint", process_group, strict, verify, check_rows, storage)


def load(
    model: nn.Module,
    checkpoint_id: PathLike,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    strict: bool = True,
    verify: bool = True,
    check_rows: Optional[bool] = None,
    storage: Optional[CheckpointStorage] = None,
) -> None:
    """Loads the checkpoint directory ``checkpoint_id`` written by :func:`save`; arguments and
    errors as :func:`load_dcp_state_dict`'s (every one a ``CheckpointError``, but the
    ``ValueError`` of a bad argument)."""
    check_path(checkpoint_id, "checkpoint_id")
    check_model(model, "load")
    _load(model, FileSystemReader(checkpoint_id), "checkpoint_id", process_group, strict, verify, check_rows, storage)


def _lock_directory(
    checkpoint_id: PathLike, storage: CheckpointStorage
) -> Tuple[Optional[SaveLock], Optional[str], Optional[Tuple[str, ...]]]:
    """Rank 0 of a save: takes the directory's lock and removes the older save's record and DCP files.
    Returns the lock and what failed (with its fixes), if anything."""
    if os.path.exists(checkpoint_id) and not os.path.isdir(checkpoint_id):
        return (
            None,
            f"{os.fspath(checkpoint_id)!r} is a file, not a directory",
            ("pass a directory (created if missing) as checkpoint_id, e.g. 'ckpt/step_100'",),
        )
    # a concurrent save would mix its files with ours: refused before anything is touched
    directory = Path(checkpoint_id)
    lock = acquire_save_lock(directory)
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
    # an older save's record does not describe the files this save writes
    storage.remove_files(directory, lambda name: name == DIGESTS_NAME)
    if DIGESTS_NAME in storage.names(directory):
        problem = (
            f"removing the old record {directory / DIGESTS_NAME} failed: the storage still lists it "
            "(a read-only directory, or a directory of that name)"
        )
        return lock, problem, None
    # files this save does not overwrite (larger world, more writer threads) would stay for good,
    # and verify refuses a data file the new record does not list
    storage.remove_files(directory, lambda name: name.endswith(DCP_DATA_SUFFIX) or name == DCP_METADATA_NAME)
    return lock, None, None


def _refuse_non_finite(
    state: Dict[str, Any], where: str, world: int, process_group: Optional[dist.ProcessGroup]
) -> None:
    """Refuses, on every rank before anything is written, tiered rows holding NaN / inf (a load refuses them)."""
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


def save(
    model: nn.Module,
    checkpoint_id: PathLike,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    thread_count: int = 1,
    extra_state: Any = None,
    check_state: Optional[Callable[[Dict[str, Any]], None]] = None,
    storage: Optional[CheckpointStorage] = None,
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
        storage: where the record is written and the older save's files removed (default: the
            local file system); DCP's data files go through DCP's own ``FileSystemWriter``.

    Raises:
        CheckpointSaveError: on every rank, when another save holds the directory's lock,
            ``checkpoint_id`` is a file or cannot be created, DCP or the record failed to write,
            or a tiered table's rows hold NaN / inf (nothing written).
    """
    # checked before anything is touched: a bad argument must not cost the old save its record
    check_path(checkpoint_id, "checkpoint_id")
    thread_count = check_int(thread_count, "thread_count", 1)
    storage = FileSystemStorage() if storage is None else storage
    state = dcp_state_dict(model)
    rank, world = rank_world(process_group)
    if extra_state is not None:
        key, value = extra_state_entry(extra_state, rank)
        state[key] = value
    if check_state is not None:
        check_state(state)
    where = f"checkpoint {os.fspath(checkpoint_id)}"
    _refuse_non_finite(state, where, world, process_group)
    lock, failed, fixes = _lock_directory(checkpoint_id, storage) if rank == 0 else (None, None, None)
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
            remove_rank_files(checkpoint_id, rank, storage=storage)  # uncommitted: the old record is gone
            raise CheckpointSaveError(where, dcp_failures(e)) from None
        problems = gather_digests(checkpoint_id, process_group, storage, rows_checked=True)
        if problems:  # e.g. the disk filled up or the directory became read-only after DCP's write
            raise CheckpointSaveError(where, problems)
    finally:
        if lock is not None and lock.fd is not None:  # held until every rank returned from gather_digests
            release_save_lock(lock, remove=True)
