"""What a recpipe DCP checkpoint holds, under which keys, and how one process reads a part.

Keys: the model's regular ``state_dict()``; ``fused_optimizer.<...>``; each owning rank's export
of every tiered table under ``tiered.<table fqn>.rank<r>.<field>`` (:func:`tiered_dcp_key`);
``extra_state.rank<r>`` (pickled). Imports ``checkpoint.{errors, digests}``, ``routing`` and ``tiered``.
"""

from __future__ import annotations

import io
import json
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from recpipe.pipeline.checkpoint.digests import PathLike, check_model, check_path
from recpipe.pipeline.checkpoint.errors import CheckpointLoadError, dcp_failures
from recpipe.pipeline.routing.row_order import RowOrder
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard
from recpipe.pipeline.tiered.state import TieredCheckpointError, TieredShardState
from recpipe.pipeline.tiered.tiered_collections import TieredTablesMixin, state_dict_without_tiered_rows

TIERED_DCP_PREFIX: str = "tiered"  # first component of every tiered export key
FUSED_OPTIMIZER_KEY: str = "fused_optimizer"  # key of model.fused_optimizer.state_dict() (DCP flattens it)
EXTRA_STATE_PREFIX: str = "extra_state"
FIELDS: Tuple[str, ...] = ("global_ids", "weights", "optimizer_state", "step", "metadata")
#: A tiered export's key; group 1: the table fqn.
TIERED_KEY: "re.Pattern[str]" = re.compile(rf"^{TIERED_DCP_PREFIX}\.(.+)\.rank\d+\.(?:{'|'.join(FIELDS)})$")
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


def is_recpipe_key(key: str) -> bool:
    """Whether a checkpoint key is a tiered export's or an extra state's (not the model's)."""
    return TIERED_KEY.match(key) is not None or _EXTRA_KEY.match(key) is not None


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
    (tiered rows left out), ``fused_optimizer`` and this rank's export of every tiered table
    (``metadata`` as a JSON string)."""
    check_model(model, "dcp_state_dict")
    state, found = regular_state_dict(model)
    for fqn, shard in tiered_tables(found).items():
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
            raise TieredCheckpointError(
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
    """One line per tiered export in ``state`` whose rows hold NaN / inf (load would refuse them)."""
    problems: List[str] = []
    for key, value in state.items():
        m = TIERED_KEY.match(key)
        if m is None or not key.endswith(".weights"):
            continue
        opt = state.get(key[: -len("weights")] + "optimizer_state")
        parts = [t for t in (value, opt) if isinstance(t, torch.Tensor) and t.numel()]
        # amax / amin propagate NaN and reach +-inf: no full-size temporary unless one is not finite
        if all(bool(torch.isfinite(torch.stack([t.amax(), t.amin()])).all()) for t in parts):
            continue
        n = int(sum((~torch.isfinite(t.reshape(t.shape[0], -1))).any(dim=1) for t in parts).count_nonzero())
        if n:
            problems.append(
                f"tiered table {m.group(1)!r}: {n} of the rank's {value.shape[0]} rows hold NaN or "
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
        TieredCheckpointError: the saving ranks' extra states are not ``0 .. W - 1``.
    """
    check_path(checkpoint_id, "checkpoint_id")
    reader = FileSystemReader(checkpoint_id)
    metadata = reader.read_metadata()
    ranks = sorted(int(m.group(1)) for key in metadata.state_dict_metadata if (m := _EXTRA_KEY.match(key)))
    if not ranks:
        return None
    src = Source(reader, metadata, f"checkpoint {checkpoint_id}")
    if ranks != list(range(len(ranks))):
        raise TieredCheckpointError(
            f"{src.where} holds the extra state of ranks {ranks}, not of ranks 0 to "
            f"{len(ranks) - 1}; the checkpoint was edited: re-save it."
        )
    source = rank % len(ranks)
    key = f"{EXTRA_STATE_PREFIX}.rank{source}"
    state: Dict[str, Any] = {key: b""}
    read_here(state, src)
    path = next(info.relative_path for index, info in (metadata.storage_data or {}).items() if index.fqn == key)
    value = torch.load(io.BytesIO(state[key]), weights_only=False, map_location="cpu")
    return ExtraState(value, source, len(ranks), Path(checkpoint_id) / path)
