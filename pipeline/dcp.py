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
  (:meth:`~recpipe.pipeline.tiered.TieredEmbeddingShard.export_state`) under
  per-rank keys ``tiered.<table fqn>.rank<r>.{global_ids, weights,
  optimizer_state, step, metadata}`` (``<table fqn>`` as in the model's state
  dict, e.g. ``ebc.embedding_bags.t0``; ``metadata`` is the export's routing and
  placement metadata as JSON). Only that rank writes them (replicas of the same
  shard write identical keys, which DCP stores once).

Loading (any world size, routing and placement): the regular part goes through
``dcp.load`` (collective); then every rank reads the checkpoint metadata to find
every saving rank's export of each of its tiered tables, reads their routing
metadata and steps (checked for consistency), and then the exports themselves one
saving rank at a time (``no_dist``: ranks read different keys). Each is validated
against the table (num_embeddings, dim, dtype, optimizer, routing; errors name the
table) and the rows this rank owns under its own routing are kept (by global id);
:meth:`~recpipe.pipeline.tiered.TieredEmbeddingShard.load_states` writes them to
their tiers. When the saving job routed the table exactly as the loading job
(same world size, dist_type and seed; the placement may differ), only this rank's
own export is read. Peak extra memory per table: one saving rank's export plus
two copies of this rank's rows (the gathered rows and ``load_states``' staging
buffer); one export plus one copy when the routing is the same.

Example::

    from recpipe.pipeline import dcp as recpipe_dcp

    recpipe_dcp.save(model, "ckpt/step_100")          # every rank
    recpipe_dcp.load(model, "ckpt/step_100")          # any world size / placement
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from recpipe.pipeline.ops import ROUTING_VERSION, route_ids
from recpipe.pipeline.sharders import _TieredTablesMixin, state_dict_without_tiered_rows
from recpipe.pipeline.tiered import TieredCheckpointError, TieredEmbeddingShard, TieredShardState

__all__ = [
    "FUSED_OPTIMIZER_KEY",
    "TIERED_DCP_PREFIX",
    "TieredCheckpointError",
    "dcp_state_dict",
    "load",
    "load_dcp_state_dict",
    "save",
    "tiered_dcp_key",
]

#: First component of every tiered key in a DCP checkpoint written by this module.
TIERED_DCP_PREFIX: str = "tiered"
#: Key of ``model.fused_optimizer.state_dict()`` in the checkpoint (DCP flattens it).
FUSED_OPTIMIZER_KEY: str = "fused_optimizer"
_FIELDS: Tuple[str, ...] = ("global_ids", "weights", "optimizer_state", "step", "metadata")

PathLike = Union[str, "os.PathLike[str]"]


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
                "recpipe.pipeline.dcp.save (or was edited): re-save it."
            )
        state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(state, storage_reader=reader, no_dist=True)
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


def _same_layout(shard: TieredEmbeddingShard, md: Dict[str, Any]) -> bool:
    """True when the saving job routed the table's rows exactly as ``shard``'s job does."""
    return (md.get("num_embeddings") == shard.num_embeddings and md.get("world_size") == shard.world_size
            and md.get("dist_type") == shard.dist_type and md.get("routing_seed") == shard.routing_seed
            and int(md.get("routing_version", 1)) == ROUTING_VERSION)


@torch.no_grad()
def _load_tiered_table(
    shard: TieredEmbeddingShard, reader: FileSystemReader, metadata: Metadata, table_fqn: str, where: str
) -> None:
    """Loads one table into ``shard`` from every saving rank's export (by global id).

    The exports' metadata and steps are read first (a few bytes each) and checked
    for consistency. When the saving job routed the table as this job does (same
    world size, dist_type, seed), this rank's own export holds exactly its rows and
    is the only one read; otherwise every saving rank's export is read in turn and
    the rows this rank owns are gathered.
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
            "the checkpoint is incomplete: re-save it with recpipe.pipeline.dcp.save."
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
    if _same_layout(shard, heads[shard.rank]["metadata"] if shard.rank in heads else {}):
        # load_states validates it (table, routing, row count, non-finite values)
        shard.load_states([_read_export(reader, metadata, table_fqn, shard.rank, where)])
        return
    R = shard.num_rows
    weights = torch.empty((R, shard.embedding_dim), dtype=shard.dtype)
    opt = torch.empty((R, shard.fast_state.shape[1]), dtype=torch.float32)
    count = torch.zeros(R, dtype=torch.int64)
    for rank in sorted(ranks):
        st = _read_export(reader, metadata, table_fqn, rank, where)
        shard._validate_state(st)  # num_embeddings / dim / dtype / optimizer / routing, naming the table
        owner, local = route_ids(st.global_ids, shard.num_embeddings, shard.world_size,
                                 shard.dist_type, shard.routing_seed)
        sel = (owner == shard.rank).nonzero().squeeze(1)
        mine = local.index_select(0, sel)
        count.index_add_(0, mine, torch.ones_like(mine))
        weights.index_copy_(0, mine, st.weights.index_select(0, sel).to(shard.dtype))
        opt.index_copy_(0, mine, st.optimizer_state.index_select(0, sel).to(torch.float32))
        del st, owner, local, sel, mine
    if bool((count != 1).any()):
        bad = shard.global_ids().index_select(0, (count != 1).nonzero().squeeze(1)[:5])
        raise TieredCheckpointError(
            f"{where}: table {table_fqn!r}: {int((count == 0).sum())} rows of rank {shard.rank}/{shard.world_size} "
            f"are missing and {int((count > 1).sum())} appear more than once (e.g. global ids {bad.tolist()}); "
            "the exports do not partition the table: re-save the checkpoint."
        )
    # This rank's rows, as if exported by a shard of the loading layout: load_states
    # re-checks them (routing, non-finite values) and writes them to their tiers.
    shard.load_states([TieredShardState(global_ids=shard.global_ids(), weights=weights, optimizer_state=opt,
                                        step=step, metadata=shard.metadata())])


def load_dcp_state_dict(
    model: nn.Module,
    checkpoint: Union[PathLike, FileSystemReader],
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    strict: bool = True,
) -> None:
    """Loads a checkpoint written by :func:`save` into ``model`` (any world size,
    routing and placement).

    Collective over ``process_group`` (every rank calls it). The regular part goes
    through ``torch.distributed.checkpoint.load`` (which reshards torchrec's
    ShardedTensors / DTensors) and ``model.load_state_dict``; the fused optimizer
    state through ``model.fused_optimizer.load_state_dict``; each tiered table is
    streamed from every saving rank's export, one at a time.

    Args:
        model (nn.Module): the model to load into (sharded for the loading job).
        checkpoint (str | os.PathLike | FileSystemReader): the checkpoint directory
            or a reader of it.
        process_group (dist.ProcessGroup | None): group of the regular DCP load
            (default: the world, when torch.distributed is initialized).
        strict (bool): passed to ``model.load_state_dict``.

    Raises:
        TieredCheckpointError: a tiered table is missing from the checkpoint, its
            exports are incomplete, or they disagree with the table (names it).
    """
    reader = checkpoint if isinstance(checkpoint, FileSystemReader) else FileSystemReader(checkpoint)
    where = f"checkpoint {os.fspath(reader.path)}"
    metadata = reader.read_metadata()
    state, found = _regular_state_dict(model)
    no_dist = not dist.is_initialized()
    dcp.load(state, storage_reader=reader, process_group=process_group, no_dist=no_dist)
    optimizer_state = state.pop(FUSED_OPTIMIZER_KEY, None)
    model.load_state_dict(state, strict=strict)
    if optimizer_state is not None:
        model.fused_optimizer.load_state_dict(optimizer_state)  # type: ignore[union-attr, operator]
    for fqn, shard in _tiered_tables(found).items():
        _load_tiered_table(shard, reader, metadata, fqn, where)


def save(
    model: nn.Module,
    checkpoint_id: PathLike,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    thread_count: int = 1,
) -> None:
    """Saves ``model`` (regular state, fused optimizer state, tiered tables) with DCP.

    Collective over ``process_group`` (every rank calls it).

    Args:
        model (nn.Module): the model (e.g. a ``DistributedModelParallel``).
        checkpoint_id (str | os.PathLike): checkpoint directory (created).
        process_group (dist.ProcessGroup | None): group of the save (default: the
            world, when torch.distributed is initialized).
        thread_count (int): writer threads per rank (``FileSystemWriter``).
    """
    state = dcp_state_dict(model)
    writer = FileSystemWriter(checkpoint_id, thread_count=thread_count)
    dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=not dist.is_initialized())


def load(
    model: nn.Module,
    checkpoint_id: PathLike,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    strict: bool = True,
) -> None:
    """Loads a checkpoint written by :func:`save` (see :func:`load_dcp_state_dict`).

    Args:
        model (nn.Module): the model to load into.
        checkpoint_id (str | os.PathLike): checkpoint directory.
        process_group (dist.ProcessGroup | None): group of the regular DCP load.
        strict (bool): passed to ``model.load_state_dict``.
    """
    if not os.path.isdir(checkpoint_id):
        raise FileNotFoundError(f"DCP checkpoint directory {os.fspath(checkpoint_id)!r} does not exist; "
                                "pass the directory given to recpipe.pipeline.dcp.save.")
    load_dcp_state_dict(model, FileSystemReader(checkpoint_id), process_group=process_group, strict=strict)
