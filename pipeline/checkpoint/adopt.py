"""Adopting torchrec tables into tiered tables: a table tiered in the loading model that the
checkpoint holds as a torchrec table (a ``[num_embeddings, dim]`` ShardedTensor ``weight``).

Each rank streams the table and its fused optimizer state one saved row block at a time and
writes the rows it owns to their tiers: peak extra memory is one saved block, one table at a
time. torchrec's checkpoint holds no optimizer step, so the table keeps its own.
Imports ``checkpoint.{errors, layout}``, ``placement``, ``routing`` and ``tiered``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from recpipe.pipeline.checkpoint import layout
from recpipe.pipeline.checkpoint.errors import NON_FINITE_FIXES, all_gather, rank_world
from recpipe.pipeline.checkpoint.layout import FUSED_OPTIMIZER_KEY, TIERED_KEY, dcp_load, weight_key
from recpipe.pipeline.placement import FusedOptimizer
from recpipe.pipeline.routing.ops import ROUTING_VERSION, local_rows
from recpipe.pipeline.routing.row_order import ROW_ORDER_KEY, RowOrder, describe_row_order
from recpipe.pipeline.tiered.migration import OPTIMIZER_STATE_NAMES
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard
from recpipe.pipeline.tiered.state import TieredCheckpointError, non_finite_rows


class Adoption(NamedTuple):
    """A tiered table of the model that the checkpoint holds as a torchrec table.

    Attributes:
        weight_key: the weight's key in the checkpoint and the model's state dict (where the
            tiered table keeps an empty placeholder).
        state_keys: checkpoint keys of its fused optimizer state in the tiered state's column
            order; empty for SGD or when the checkpoint holds none (``strict=False``).
        row_order: the routed row order of a roundrobin / hash_roundrobin FUSED table, None for
            torchrec's contiguous row blocks.
    """

    weight_key: str
    state_keys: Tuple[str, ...]
    row_order: Optional[RowOrder]


def _fused_state_head(weight_key: str, table: str) -> str:
    """The checkpoint key prefix of a torchrec table's fused optimizer state."""
    return f"{FUSED_OPTIMIZER_KEY}.state.{weight_key}.{table}."


def _has_fused_state(metadata: Metadata) -> bool:
    """Whether the checkpoint holds any fused optimizer state."""
    head = f"{FUSED_OPTIMIZER_KEY}.state."
    return any(key.startswith(head) for key in metadata.state_dict_metadata)


def _saved_optimizer(metadata: Metadata, head: str, rows: int, dim: int) -> Tuple[str, Dict[str, List[int]]]:
    """The optimizer the fused state under ``head`` belongs to (by torchrec's names and shapes),
    and the state's names and shapes."""
    found = {
        key[len(head) :]: list(md.size)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(head) and isinstance(md, TensorStorageMetadata)
    }
    for opt, names in OPTIMIZER_STATE_NAMES.items():
        row = opt is FusedOptimizer.ROWWISE_ADAGRAD
        if found == {n: ([rows] if row else [rows, dim]) for n in names}:
            return opt.value, found
    return "an unrecognised optimizer", found


def _saved_row_order(
    metadata: Metadata, reader: FileSystemReader, weight_key: str, where: str
) -> Tuple[Optional[RowOrder], Optional[str]]:
    """The row order a routed FUSED table was saved in (None: contiguous rows), or why its rows
    cannot be put in global row order."""
    base = weight_key[: -len("weight")] + ROW_ORDER_KEY
    fields = (*RowOrder._fields, "routing_version")
    saved: Dict[str, Any] = {f"{base}.{f}": None for f in fields if f"{base}.{f}" in metadata.state_dict_metadata}
    if not saved:
        return None, None
    dcp_load(saved, reader, where, no_dist=True)
    record = {f: saved.get(f"{base}.{f}") for f in fields}
    md = metadata.state_dict_metadata[weight_key]
    try:
        order = RowOrder(
            str(record["dist_type"]),
            int(record["world_size"]),  # type: ignore[arg-type]
            int(record["routing_seed"]),
            int(record["num_embeddings"]),
        )  # type: ignore[arg-type]
        chunks = sorted((int(c.offsets[0]), int(c.sizes[0])) for c in md.chunks)  # type: ignore[union-attr]
        sizes = [local_rows(order.num_embeddings, order.world_size, r) for r in range(order.world_size)]
        layout_ok = chunks == [(sum(sizes[:r]), n) for r, n in enumerate(sizes)] and order.num_embeddings == int(
            md.size[0]
        )  # type: ignore[union-attr]
    except (TypeError, ValueError, KeyError):
        layout_ok = False
    if not layout_ok or int(record.get("routing_version") or 0) != ROUTING_VERSION:
        return None, (
            f"its weight was saved with {describe_row_order(record)} in a layout this recpipe "
            f"cannot put in global row order (routing version {ROUTING_VERSION})"
        )
    return order, None


def _adoption(
    fqn: str,
    shard: TieredEmbeddingShard,
    key: str,
    metadata: Metadata,
    reader: FileSystemReader,
    where: str,
    fused_state: bool,
) -> Tuple[Optional[Adoption], Optional[str]]:
    """How tiered table ``fqn`` loads the torchrec table the checkpoint holds under ``key``, or why it cannot."""
    weight = metadata.state_dict_metadata[key]
    assert isinstance(weight, TensorStorageMetadata)
    table = fqn.rsplit(".", 1)[-1]
    mine, theirs = [shard.num_embeddings, shard.embedding_dim], list(weight.size)
    if theirs != mine:
        return None, (
            f"table {fqn!r}: the checkpoint holds a torchrec table of [num_embeddings, dim] = "
            f"{theirs}, this model a tiered table of {mine}"
        )
    head = _fused_state_head(key, table)
    saved_opt, names = _saved_optimizer(metadata, head, *mine)
    want = shard.optimizer.name
    # the checkpoint holds fused optimizer state: this table's must be its optimizer's
    if (names or fused_state) and saved_opt != want:
        got = f"{saved_opt} state {names}" if names else "no state (sgd)"
        return None, (
            f"table {fqn!r}: the checkpoint holds fused optimizer state of {got} "
            f"(under {head}*), this model's tiered table trains with {want}"
        )
    order, refusal = _saved_row_order(metadata, reader, key, where)
    if refusal is not None:
        return None, f"table {fqn!r}: {refusal}"
    state_keys = tuple(
        head + n for n in OPTIMIZER_STATE_NAMES[FusedOptimizer(want)] if head + n in metadata.state_dict_metadata
    )
    return Adoption(key, state_keys, order), None


_KIND_FIXES: str = (
    ". Possible solutions:\n"
    "  1. shard every table as the saving job did: tables tiered there (recpipe's tiered sharders and "
    "placement plan) tiered here, torchrec tables as torchrec tables or tiered (a tiered table loads a "
    "torchrec table's rows; the recipe: resume with the checkpoint's --placement)\n"
    "  2. a module or table was renamed: load with the names it was saved under\n"
    "  3. start from fresh tables instead of this checkpoint"
)
_MISFIT_FIXES: str = (
    ". Nothing was loaded: the model is unchanged. Possible solutions:\n"
    "  1. build each such table as it was saved: the same num_embeddings and embedding_dim, and the same "
    "fused optimizer (apply_optimizer_in_backward's, or the sharder's fused_params: SGD, RowWiseAdagrad "
    "or Adam)\n"
    "  2. load a checkpoint saved from this model's configuration\n"
    "  3. start from fresh tables instead of this checkpoint"
)


def check_table_kinds(
    metadata: Metadata,
    reader: FileSystemReader,
    state: Dict[str, Any],
    tiered_here: Dict[str, TieredEmbeddingShard],
    where: str,
    strict: bool,
    process_group: Optional[dist.ProcessGroup],
) -> Tuple[List[str], Dict[str, Adoption], List[str]]:
    """Refuses, on every rank and before anything is read, a checkpoint whose tables do not
    fit this model's kinds (DCP itself would fail mid-load on some ranks only); a tiered table
    the checkpoint holds as a fitting torchrec table is adopted (:class:`Adoption`).

    Args:
        state: the model's regular state dict.
        tiered_here: this rank's tiered tables by fqn.
        where: the checkpoint, for messages.
        strict: also refuse tiered tables either side lacks entirely.

    Returns:
        Without ``strict``, this rank's tiered tables the checkpoint lacks entirely (they keep
        their rows); this rank's tables to adopt; and the tables tiered in the checkpoint that
        some rank holds as torchrec tables (loaded by ``leave``).

    Raises:
        TieredCheckpointError: naming every such table, with possible solutions.
    """
    world = rank_world(process_group)[1]
    tiered_anywhere = {fqn for part in all_gather(sorted(tiered_here), world, process_group) for fqn in part}
    saved_tiered = {m.group(1) for key in metadata.state_dict_metadata if (m := TIERED_KEY.match(key))}
    fused_state = _has_fused_state(metadata)
    problems: List[str] = []
    misfits: List[str] = []
    absent: List[str] = []
    adopted: Dict[str, Adoption] = {}
    for fqn in sorted(set(tiered_here) - saved_tiered):
        key = weight_key(fqn, state)
        weight = metadata.state_dict_metadata.get(key) if key is not None else None
        if weight is None and not strict:  # not in the checkpoint at all: the table keeps its rows
            absent.append(fqn)
        elif not isinstance(weight, TensorStorageMetadata) or weight.size.numel() == 0 or len(weight.size) != 2:
            problems.append(f"table {fqn!r} is tiered in this model, but the checkpoint holds no rows of it")
        else:
            assert key is not None
            adoption, misfit = _adoption(fqn, tiered_here[fqn], key, metadata, reader, where, fused_state)
            if adoption is not None:
                adopted[fqn] = adoption
            else:
                misfits.append(str(misfit))
    # tiered when saved, a torchrec (ShardedTensor) table here: loaded from the exports (leave)
    fused_here = sorted(
        fqn
        for fqn in saved_tiered - tiered_anywhere
        if isinstance(state.get(weight_key(fqn, state) or ""), ShardedTensor)
    )
    fused_anywhere = {fqn for part in all_gather(fused_here, world, process_group) for fqn in part}
    if strict:
        problems += [
            f"table {fqn!r} was tiered when saved, but this model does not tier it"
            for fqn in sorted(saved_tiered - tiered_anywhere - fused_anywhere)
        ]
    parts = all_gather((problems, misfits), world, process_group)
    everyone = sorted({p for part, _ in parts for p in part})
    if everyone:
        raise TieredCheckpointError(f"{where} does not fit this model's tables: " + "; ".join(everyone) + _KIND_FIXES)
    everyone = sorted({p for _, part in parts for p in part})
    if everyone:
        raise TieredCheckpointError(
            f"{where}: a tiered table of this model cannot load the torchrec table the checkpoint holds: "
            + "; ".join(everyone)
            + _MISFIT_FIXES
        )
    return absent, adopted, sorted(fused_anywhere)


class _RowBlockLoadPlanner(DefaultLoadPlanner):
    """Reads rows ``[start, start + rows)`` of each key into the state dict's ``[rows, ...]``
    tensors, from a checkpoint of any sharding (only the overlapping saved chunks are read)."""

    def __init__(self, start: int) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._start = start

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: List[ReadItem] = []
        for key, rows in self.state_dict.items():
            md = self.metadata.state_dict_metadata[key]
            assert isinstance(md, TensorStorageMetadata)
            chunk = ChunkStorageMetadata(offsets=torch.Size([self._start] + [0] * (rows.dim() - 1)), sizes=rows.size())
            items += create_read_items_for_chunk_list(key, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]  # the block's own tensor (DCP's default looks the chunk up by offset)


def _saved_blocks(adoption: Adoption, metadata: Metadata, n: int) -> List[Tuple[int, int]]:
    """The non-empty row blocks ``[start, stop)`` a torchrec table was saved in, in row order."""
    md = metadata.state_dict_metadata[adoption.weight_key]
    assert isinstance(md, TensorStorageMetadata)  # checked by check_table_kinds
    bounds = sorted({0, n} | {int(c.offsets[0]) + e for c in md.chunks for e in (0, int(c.sizes[0]))})
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if a < b]


def _adopted_blocks(
    shard: TieredEmbeddingShard, adoption: Adoption, reader: FileSystemReader, metadata: Metadata, where: str
) -> Iterator[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """Reads a torchrec table one saved row block at a time (this process alone): yields each
    block's int64 global ids, ``[rows, dim]`` weights and ``[rows, state_cols]`` fp32 optimizer
    state in the tiered column layout (None without state). A routed table's block of saving
    rank ``r`` holds ``r``'s routed rows in local-id order."""
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
        layout.read_here(state, reader, where, planner=_RowBlockLoadPlanner(start))
        weights = state.pop(adoption.weight_key)
        opt = (
            torch.cat([state.pop(k).reshape(stop - start, -1).to(torch.float32) for k in adoption.state_keys], dim=1)
            if adoption.state_keys
            else None
        )
        gids = order.global_ids(rank_at[start]) if order is not None else torch.arange(start, stop, dtype=torch.int64)
        assert gids.numel() == stop - start
        yield gids, weights, opt
        del state, weights, opt, gids


@torch.no_grad()
def check_adopted_rows(
    shard: TieredEmbeddingShard, adoption: Adoption, reader: FileSystemReader, metadata: Metadata, fqn: str, where: str
) -> None:
    """Refuses NaN / inf rows of a torchrec table a tiered table loads, keeping none of them.

    Raises:
        TieredCheckpointError: naming the table and the number of such rows.
    """
    non_finite = 0
    for _, weights, opt in _adopted_blocks(shard, adoption, reader, metadata, where):
        bad = non_finite_rows(weights, opt if opt is not None else torch.empty((weights.shape[0], 0)))
        non_finite += 0 if bad is None else int(bad.sum())
        del weights, opt  # before the next block is read
    if non_finite:
        raise shard.checkpoint_error(
            f"{non_finite} of the {shard.num_embeddings} rows of the torchrec table it would load from {where} "
            f"(table {fqn!r}, {adoption.weight_key}) hold NaN or inf values or optimizer state",
            NON_FINITE_FIXES,
        )


def load_adopted_table(
    shard: TieredEmbeddingShard, adoption: Adoption, reader: FileSystemReader, metadata: Metadata, fqn: str, where: str
) -> None:
    """Loads a tiered table from the torchrec table the checkpoint holds, one saved block at a
    time (optimizer state zero without it); the table keeps its own optimizer step."""
    step = shard.tiers.export_step()  # as export_state reads it
    shard.load_row_blocks(_adopted_blocks(shard, adoption, reader, metadata, where), step)
