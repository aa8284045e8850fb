"""What a recpipe DCP checkpoint holds: its files, its keys, and how one process reads a part.

Files: DCP's ``.metadata`` and data files (``*.distcp``), then :data:`DIGESTS_NAME`, the digests
record ``save`` writes last. Keys: the model's regular ``state_dict()``; ``fused_optimizer.<...>``;
each owning rank's export of every tiered table under ``tiered.<table fqn>.rank<r>.<field>``
(:func:`tiered_dcp_key`); each key shard's rows of every dynamic table, keyed by raw key, under
``dynamic.<table fqn>.rank<r>.<field>`` (:func:`dynamic_dcp_key`; loaded by ``checkpoint.dynamic_tables``);
``extra_state.rank<r>`` (pickled). A tiered table loads from its exports
by global id (:func:`tiered_heads`, :func:`check_tiered_rows`, :func:`load_tiered_table`): every
saving rank's export is read one at a time and validated against the loading table, keeping the
rows this rank owns under its own routing; when the saving job routed the table alike, only this
rank's own export is read. Imports ``checkpoint.checkpoint_errors``, ``routing`` and ``tiered``.
"""

from __future__ import annotations

import io
import json
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from recpipe.pipeline.checkpoint.checkpoint_errors import (
    NON_FINITE_FIXES,
    CheckpointIntegrityError,
    CheckpointLoadError,
    CheckpointTableError,
    PathLike,
    check_model,
    check_path,
    dcp_failures,
)
from recpipe.pipeline.routing.ops import route_ids
from recpipe.pipeline.routing.row_order import RowOrder
from recpipe.pipeline.tiered.dynamic.dynamic_shard import DynamicEmbeddingShard
from recpipe.pipeline.tiered.dynamic.dynamic_state import export_dynamic_state
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard
from recpipe.pipeline.tiered.state import TieredShardState, non_finite_rows
from recpipe.pipeline.tiered.tiered_collections import TieredTablesMixin, state_dict_without_tiered_rows

DIGESTS_NAME: str = "recpipe_digests.json"  # the digests record, written last by ``save``
DCP_METADATA_NAME: str = ".metadata"  # torch.distributed.checkpoint.filesystem._metadata_fn
DCP_DATA_SUFFIX: str = ".distcp"  # DCP FileSystemWriter's data files
# DCP FileSystemWriter's data files as it names them; group 1: the rank
DCP_RANK_FILE: "re.Pattern[str]" = re.compile(r"^__(\d+)_\d+\.distcp$")
# the file a saving process holds an exclusive flock on (its content names the holder)
SAVE_LOCK_NAME: str = ".recpipe_save.lock"
TIERED_DCP_PREFIX: str = "tiered"  # first component of every tiered export key
FUSED_OPTIMIZER_KEY: str = "fused_optimizer"  # key of model.fused_optimizer.state_dict() (DCP flattens it)
EXTRA_STATE_PREFIX: str = "extra_state"
FIELDS: Tuple[str, ...] = ("global_ids", "weights", "optimizer_state", "step", "metadata")
#: A tiered export's key; group 1: the table fqn.
TIERED_KEY: "re.Pattern[str]" = re.compile(rf"^{TIERED_DCP_PREFIX}\.(.+)\.rank\d+\.(?:{'|'.join(FIELDS)})$")
DYNAMIC_DCP_PREFIX: str = "dynamic"  # first component of every dynamic table's key
DYNAMIC_FIELDS: Tuple[str, ...] = ("keys", "weights", "optimizer_state", "scores", "step", "metadata")
#: A dynamic table's fields a checkpoint may lack (its admission counters: a table without them loads with none).
DYNAMIC_OPTIONAL_FIELDS: Tuple[str, ...] = ("admission_keys", "admission_counts")
_DYNAMIC_ANY = "|".join(DYNAMIC_FIELDS + DYNAMIC_OPTIONAL_FIELDS)
#: A dynamic table's key; group 1: the table fqn.
DYNAMIC_KEY: "re.Pattern[str]" = re.compile(rf"^{DYNAMIC_DCP_PREFIX}\.(.+)\.rank\d+\.(?:{_DYNAMIC_ANY})$")
_EXTRA_KEY: "re.Pattern[str]" = re.compile(rf"^{EXTRA_STATE_PREFIX}\.rank(\d+)$")


class Source(NamedTuple):
    """The checkpoint a load reads: its reader, its DCP metadata and its name for messages."""

    reader: FileSystemReader
    metadata: Metadata
    where: str


def tiered_dcp_key(table_fqn: str, rank: int, field: str) -> str:
    """``tiered.<table_fqn>.rank<rank>.<field>``: one field (of :data:`FIELDS`) of one rank's export
    (``table_fqn`` as in the model's ``state_dict()``, e.g. ``ebc.embedding_bags.t0``)."""
    if field not in FIELDS:
        raise ValueError(f"field must be one of {FIELDS}, got {field!r}.")
    return f"{TIERED_DCP_PREFIX}.{table_fqn}.rank{rank}.{field}"


def dynamic_dcp_key(table_fqn: str, rank: int, field: str) -> str:
    """``dynamic.<table_fqn>.rank<rank>.<field>``: one field (of :data:`DYNAMIC_FIELDS` or
    :data:`DYNAMIC_OPTIONAL_FIELDS`) of key shard ``rank``'s rows of a dynamic table (row-wise: the rank among
    the table's shards; table-wise: 0)."""
    if field not in DYNAMIC_FIELDS + DYNAMIC_OPTIONAL_FIELDS:
        raise ValueError(f"field must be one of {DYNAMIC_FIELDS + DYNAMIC_OPTIONAL_FIELDS}, got {field!r}.")
    return f"{DYNAMIC_DCP_PREFIX}.{table_fqn}.rank{rank}.{field}"


def is_recpipe_key(key: str) -> bool:
    """Whether a checkpoint key is a tiered export's, a dynamic table's or an extra state's (not the model's)."""
    return any(p.match(key) is not None for p in (TIERED_KEY, DYNAMIC_KEY, _EXTRA_KEY))


def extra_state_entry(value: Any, rank: int) -> Tuple[str, bytes]:
    """The key and ``torch.save`` bytes of rank ``rank``'s extra state (pickled: DCP would flatten a dict)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return f"{EXTRA_STATE_PREFIX}.rank{rank}", buffer.getvalue()


def regular_state_dict(model: nn.Module) -> Tuple[Dict[str, Any], Dict[str, Tuple[TieredTablesMixin, str]]]:
    """``model.state_dict()`` without tiered exports, and the tiered modules by prefix."""
    with state_dict_without_tiered_rows(model) as modules:
        state = model.state_dict()
    found = {prefix: (module, module.TIERED_COLLECTION) for prefix, module in modules.items()}
    fused = getattr(model, "fused_optimizer", None)
    if fused is not None:
        state[FUSED_OPTIMIZER_KEY] = fused.state_dict()
    return state, found


def tiered_tables(found: Dict[str, Tuple[TieredTablesMixin, str]]) -> Dict[str, TieredEmbeddingShard]:
    """``{table fqn: shard}`` of this rank's tiered shards."""
    return {
        f"{prefix}{collection}.{name}": shard
        for prefix, (module, collection) in found.items()
        for name, shard in module.tiered_tables().items()
    }


def remote_tiered_tables(found: Dict[str, Tuple[TieredTablesMixin, str]]) -> List[str]:
    """Fqns of the table-wise tiered tables another rank holds: here only an empty ``weight`` placeholder,
    which neither DCP nor a torchrec checkpoint of the table fills."""
    return [
        f"{prefix}{collection}.{name}"
        for prefix, (module, collection) in found.items()
        for name in module.remote_tiered_names()
    ]


def dcp_state_dict(model: nn.Module) -> Dict[str, Any]:
    """The state dict to pass to ``torch.distributed.checkpoint.save``: the regular state
    (tiered rows left out), ``fused_optimizer`` and this rank's export of every tiered table and
    its rows of every dynamic table (``metadata`` as a JSON string)."""
    check_model(model, "dcp_state_dict")
    state, found = regular_state_dict(model)
    for fqn, shard in tiered_tables(found).items():
        if isinstance(shard, DynamicEmbeddingShard):  # keyed by raw key, under its key shard's rank
            entries = export_dynamic_state(shard).entries()
            entries["metadata"] = json.dumps(entries.pop("_extra_state"), sort_keys=True)
            state.update({dynamic_dcp_key(fqn, shard.key_rank, f): v for f, v in entries.items()})
            continue
        st = shard.export_state()
        entries = st.entries()
        entries["metadata"] = json.dumps(entries.pop("_extra_state"), sort_keys=True)
        state.update({tiered_dcp_key(fqn, int(st.metadata["rank"]), f): v for f, v in entries.items()})
    return state


def saved_ranks(metadata: Metadata, table_fqn: str) -> Dict[int, List[str]]:
    """Saving ranks of a tiered table in the checkpoint -> the fields present."""
    head = f"{TIERED_DCP_PREFIX}.{table_fqn}.rank"
    ranks: Dict[int, List[str]] = {}
    for key in metadata.state_dict_metadata:
        if not key.startswith(head):
            continue
        rank_str, _, field = key[len(head) :].partition(".")
        if rank_str.isdigit() and field in FIELDS:
            ranks.setdefault(int(rank_str), []).append(field)
    return ranks


def weight_key(table_fqn: str, state: Dict[str, Any]) -> Optional[str]:
    """The key of a table's weight in ``state``: the longest dotted suffix of ``<table_fqn>.weight``
    (DMP strips wrapper prefixes such as DDP's ``module.`` from the state dict, not the fqn)."""
    full = f"{table_fqn}.weight"
    keys = [k for k in state if k == full or full.endswith("." + k)]
    return max(keys, key=len) if keys else None


def dcp_load(state: Dict[str, Any], src: Source, **kwargs: Any) -> None:
    """``dcp.load(state, storage_reader=src.reader, **kwargs)``, DCP's failure raised as a
    :class:`CheckpointLoadError`."""
    try:
        dcp.load(state, storage_reader=src.reader, **kwargs)
    except CheckpointException as e:
        problems = dcp_failures(e)
        fixes = None
        partial = getattr(kwargs.get("planner"), "allow_partial_load", False)
        if any("Missing key in checkpoint" in p for p, _ in problems) and not partial:
            fixes = (
                "build the model as the saving job did (the same modules, tables and optimizer)",
                "pass strict=False to load the entries the checkpoint holds and keep this model's own "
                "values of the others (e.g. a layer added since the save)",
                "start from fresh weights instead of this checkpoint",
            )
        raise CheckpointLoadError(src.where, problems, fixes) from None


def read_here(state: Dict[str, Any], src: Source, **kwargs: Any) -> None:
    """Fills ``state`` from the checkpoint in this process alone (ranks read different keys);
    a regular tensor of a key saved as a ShardedTensor gets every saving rank's chunks."""
    with warnings.catch_warnings():  # DCP warns that no_dist means "a single process": here, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp_load(state, src, no_dist=True, **kwargs)


def read_row_orders(src: Source, bases: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """The saved row-order record under each of ``bases`` (``<table>.<ROW_ORDER_KEY>``) that the
    checkpoint holds any field of, with the fields it holds (this process only)."""
    fields = (*RowOrder._fields, "routing_version")
    saved: Dict[str, Any] = {
        f"{b}.{f}": None for b in bases for f in fields if f"{b}.{f}" in src.metadata.state_dict_metadata
    }
    if saved:
        dcp_load(saved, src, no_dist=True)
    records = {b: {f: saved[f"{b}.{f}"] for f in fields if f"{b}.{f}" in saved} for b in bases}
    return {b: record for b, record in records.items() if record}


def read_fields(src: Source, table_fqn: str, rank: int, fields: Tuple[str, ...]) -> Dict[str, Any]:
    """Reads fields of one saving rank's export of a tiered table (this process only)."""
    state: Dict[str, Any] = {}
    for field in fields:
        key = tiered_dcp_key(table_fqn, rank, field)
        if field == "metadata":
            state[key] = ""
            continue
        md = src.metadata.state_dict_metadata[key]
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointTableError(
                f"{src.where}: {key} is not a tensor; the checkpoint was not written by "
                "recpipe.pipeline.checkpoint.save (or was edited): re-save it."
            )
        state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    read_here(state, src)
    out = {field: state[tiered_dcp_key(table_fqn, rank, field)] for field in fields}
    if "metadata" in out:
        out["metadata"] = json.loads(out["metadata"])
    if "step" in out:
        out["step"] = int(out["step"])
    return out


def read_export(src: Source, table_fqn: str, rank: int) -> TieredShardState:
    """Reads one saving rank's whole export of a tiered table (this process only)."""
    return TieredShardState(**read_fields(src, table_fqn, rank, FIELDS))


def non_finite_tiered_rows(state: Dict[str, Any]) -> List[str]:
    """One line per tiered export (or dynamic table's rows) in ``state`` whose rows hold NaN / inf (load
    would refuse them)."""
    problems: List[str] = []
    for key, value in state.items():
        m = TIERED_KEY.match(key) or DYNAMIC_KEY.match(key)
        if m is None or not key.endswith(".weights"):
            continue
        opt = state.get(key[: -len("weights")] + "optimizer_state")
        parts = [t for t in (value, opt) if isinstance(t, torch.Tensor) and t.numel()]
        # amax / amin propagate NaN and reach +-inf: no full-size temporary unless one is not finite
        if all(bool(torch.isfinite(torch.stack([t.amax(), t.amin()])).all()) for t in parts):
            continue
        bad = torch.stack([(~torch.isfinite(t.reshape(t.shape[0], -1))).any(dim=1) for t in parts]).any(dim=0)
        n = int(bad.count_nonzero())
        if n:
            problems.append(
                f"{key.split('.', 1)[0]} table {m.group(1)!r}: {n} of the rank's {value.shape[0]} rows hold NaN or "
                "inf values or optimizer state (load would refuse them)"
            )
    return problems


class ExtraState(NamedTuple):
    """One saving rank's extra state: its ``value``, that ``rank``, how many saving ranks stored
    one (``world_size``) and the data file holding it (``path``)."""

    value: Any
    rank: int
    world_size: int
    path: Path


def read_extra_state(checkpoint_id: PathLike, rank: int) -> Optional[ExtraState]:
    """Reads (this process only) the extra state saving rank ``rank % W`` stored, of ``W`` saving
    ranks; None when there is none. Verify the checkpoint first: the bytes are unpickled.

    Raises:
        CheckpointIntegrityError: the saving ranks' extra states are not ``0 .. W - 1`` (an edited checkpoint).
    """
    check_path(checkpoint_id, "checkpoint_id")
    reader = FileSystemReader(checkpoint_id)
    metadata = reader.read_metadata()
    ranks = sorted(int(m.group(1)) for key in metadata.state_dict_metadata if (m := _EXTRA_KEY.match(key)))
    if not ranks:
        return None
    src = Source(reader, metadata, f"checkpoint {checkpoint_id}")
    if ranks != list(range(len(ranks))):
        problem = (
            f"holds the extra state of ranks {ranks}, not of ranks 0 to {len(ranks) - 1} (the checkpoint was edited)"
        )
        raise CheckpointIntegrityError([(str(checkpoint_id), problem)], ("re-save the checkpoint", "load an older one"))
    source = rank % len(ranks)
    key = f"{EXTRA_STATE_PREFIX}.rank{source}"
    state: Dict[str, Any] = {key: b""}
    read_here(state, src)
    path = next(info.relative_path for index, info in (metadata.storage_data or {}).items() if index.fqn == key)
    value = torch.load(io.BytesIO(state[key]), weights_only=False, map_location="cpu")
    return ExtraState(value, source, len(ranks), Path(checkpoint_id) / path)


def tiered_heads(shard: Optional[TieredEmbeddingShard], src: Source, table_fqn: str) -> Dict[int, Dict[str, Any]]:
    """Reads and checks the metadata and step of every saving rank's export of one table:
    complete, consistent, and compatible with ``shard`` (None: a torchrec table here).
    Returns saving rank -> ``{"metadata", "step"}``."""
    where = src.where
    ranks = saved_ranks(src.metadata, table_fqn)
    if not ranks:
        raise CheckpointTableError(
            f"{where}: no tiered rows of table {table_fqn!r} (keys {tiered_dcp_key(table_fqn, 0, 'weights')} ...). "
            "Possible solutions:\n  1. the table was not tiered (CUSTOMIZED_KERNEL) when the checkpoint was "
            "saved: plan it as it was saved, or load the rows from its torchrec weight\n  2. the module or "
            "table was renamed: load with the names it was saved under"
        )
    incomplete = {r: sorted(set(FIELDS) - set(f)) for r, f in ranks.items() if set(f) != set(FIELDS)}
    if incomplete:
        raise CheckpointTableError(
            f"{where}: table {table_fqn!r}: exports lack fields {incomplete} (rank: missing fields); "
            "the checkpoint is incomplete: re-save it with recpipe.pipeline.checkpoint.save."
        )
    heads = {r: read_fields(src, table_fqn, r, ("metadata", "step")) for r in sorted(ranks)}
    r0 = min(heads)
    saved_world, step = heads[r0]["metadata"].get("world_size"), heads[r0]["step"]
    for r, head in heads.items():
        if head["metadata"].get("rank") != r:
            raise CheckpointTableError(
                f"{where}: table {table_fqn!r}: keys of rank {r} hold the export of rank "
                f"{head['metadata'].get('rank')}; the checkpoint was edited: re-save it."
            )
        if head["step"] != step or head["metadata"].get("world_size") != saved_world:
            raise CheckpointTableError(
                f"{where}: table {table_fqn!r}: saving ranks disagree (rank {r}: step {head['step']}, world size "
                f"{head['metadata'].get('world_size')}; rank {r0}: step {step}, world size {saved_world}); "
                "the directory mixes checkpoints: save into an empty directory."
            )
    if sorted(ranks) != list(range(int(saved_world))):
        raise CheckpointTableError(
            f"{where}: table {table_fqn!r} was saved by {saved_world} ranks but the checkpoint holds the exports "
            f"of ranks {sorted(ranks)}; the checkpoint is incomplete: re-save it from every rank."
        )
    if shard is not None:
        for head in heads.values():
            shard.check_export_metadata(head["metadata"])
    return heads


@torch.no_grad()
def _for_rows_of_rank(
    shard: TieredEmbeddingShard,
    heads: Dict[int, Dict[str, Any]],
    src: Source,
    table_fqn: str,
    use: Callable[[TieredShardState, torch.Tensor, torch.Tensor], None],
) -> None:
    """Calls ``use(export, sel, local)`` for every saving rank's export in turn: ``sel`` the
    positions of the rows this rank owns, ``local`` their local ids. Refuses exports that do not
    hold each of this rank's rows exactly once, or one that disagrees with the table."""
    count = torch.zeros(shard.num_rows, dtype=torch.int64)
    for rank in sorted(heads):
        st = read_export(src, table_fqn, rank)
        shard.validate_state(st)  # num_embeddings / dim / dtype / optimizer / routing, naming the table
        owner, local = route_ids(
            st.global_ids, shard.num_embeddings, shard.world_size, shard.dist_type, shard.routing_seed
        )
        sel = (owner == shard.rank).nonzero().squeeze(1)
        mine = local.index_select(0, sel)
        count.index_add_(0, mine, torch.ones_like(mine))
        use(st, sel, mine)
        del st, owner, local, sel, mine
    if bool((count != 1).any()):
        bad = shard.global_ids().index_select(0, (count != 1).nonzero().squeeze(1)[:5])
        raise CheckpointTableError(
            f"{src.where}: table {table_fqn!r}: {int((count == 0).sum())} rows of rank {shard.rank}/{shard.world_size} "
            f"are missing and {int((count > 1).sum())} appear more than once (e.g. global ids {bad.tolist()}); "
            "the exports do not partition the table: re-save the checkpoint."
        )


@torch.no_grad()
def check_tiered_rows(
    shard: TieredEmbeddingShard, heads: Dict[int, Dict[str, Any]], src: Source, table_fqn: str
) -> None:
    """Refuses (``CheckpointTableError``), before anything is written, what ``load_states`` would
    refuse of the rows :func:`load_tiered_table` loads (missing, repeated, NaN / inf), keeping none."""
    if shard.routes_as(heads[shard.rank]["metadata"] if shard.rank in heads else {}):
        st = read_export(src, table_fqn, shard.rank)
        # row count and global ids: exactly this rank's rows under its own routing
        shard.validate_state(st)
        bad = non_finite_rows(st.weights, st.optimizer_state)
        non_finite = 0 if bad is None else int(bad.sum())
    else:
        counts: List[int] = []

        def count_non_finite(st: TieredShardState, sel: torch.Tensor, mine: torch.Tensor) -> None:
            bad = non_finite_rows(st.weights, st.optimizer_state)
            if bad is not None:  # only the rows this rank loads count (as in load_states)
                counts.append(int(bad.index_select(0, sel).sum()))

        _for_rows_of_rank(shard, heads, src, table_fqn, count_non_finite)
        non_finite = sum(counts)
    if non_finite:
        raise shard.checkpoint_error(
            f"{non_finite} of the rows it would load from {src.where} (table {table_fqn!r}) hold NaN or inf values "
            "or optimizer state",
            NON_FINITE_FIXES,
        )


@torch.no_grad()
def load_tiered_table(
    shard: TieredEmbeddingShard, heads: Dict[int, Dict[str, Any]], src: Source, table_fqn: str
) -> None:
    """Loads one table into ``shard`` from the saving ranks' exports (by global id); ``heads``
    from :func:`tiered_heads`."""
    if shard.routes_as(heads[shard.rank]["metadata"] if shard.rank in heads else {}):
        # load_states validates it (table, routing, row count, non-finite values)
        shard.load_states([read_export(src, table_fqn, shard.rank)])
        return
    R = shard.num_rows
    weights = torch.empty((R, shard.embedding_dim), dtype=shard.dtype)
    opt = torch.empty((R, shard.state_cols), dtype=torch.float32)

    def gather(st: TieredShardState, sel: torch.Tensor, mine: torch.Tensor) -> None:
        weights.index_copy_(0, mine, st.weights.index_select(0, sel).to(shard.dtype))
        opt.index_copy_(0, mine, st.optimizer_state.index_select(0, sel).to(torch.float32))

    _for_rows_of_rank(shard, heads, src, table_fqn, gather)
    # as if exported by a shard of the loading layout: load_states re-checks and writes them
    step = heads[min(heads)]["step"]
    shard.load_states([TieredShardState(shard.global_ids(), weights, opt, step, shard.metadata())])
