"""Checkpoints across table kinds: tiered tables of the model loading the torchrec tables a
checkpoint holds ("from torchrec"), and torchrec tables of the model loading the tiered tables a
checkpoint holds ("into torchrec").

From torchrec: a table tiered here that the checkpoint holds as a ``[num_embeddings, dim]``
ShardedTensor ``weight``. Each rank streams the table and its fused optimizer state one saved row
block at a time and writes the rows it owns to their tiers: peak extra memory is one saved block,
one table at a time. torchrec's checkpoint holds no optimizer step, so the table keeps its own.

Into torchrec: a table tiered in the checkpoint that this model holds as a torchrec
(ShardedTensor) table. Each rank gathers only the rows its shards hold from every saving rank's
export (by global id, one table at a time); extra memory: the rank's rows of one table and one export.

Imports ``checkpoint.{checkpoint_errors, collectives, layout}``, ``placement``, ``routing`` and ``tiered``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from recpipe.pipeline.checkpoint import layout
from recpipe.pipeline.checkpoint.checkpoint_errors import NON_FINITE_FIXES, CheckpointTableError, numbered
from recpipe.pipeline.checkpoint.collectives import all_gather, raise_first_refusal, rank_world, refusals
from recpipe.pipeline.checkpoint.layout import (
    FUSED_OPTIMIZER_KEY,
    TIERED_KEY,
    Source,
    read_export,
    read_row_orders,
    tiered_heads,
    weight_key,
)
from recpipe.pipeline.placement import FusedOptimizerKind
from recpipe.pipeline.routing.ops import ROUTING_VERSION, local_rows
from recpipe.pipeline.routing.row_order import ROW_ORDER_KEY, RowOrder, describe_row_order
from recpipe.pipeline.tiered.migration import (
    OPTIMIZER_STATE_NAMES,
    describe_optimizer_tables,
    named_to_columns,
    optimizer_tables,
    shard_global_rows,
)
from recpipe.pipeline.tiered.optim import TieredOptimizerConfig
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard
from recpipe.pipeline.tiered.state import TieredShardState, non_finite_rows


class TableFromTorchrec(NamedTuple):
    """A tiered table of the model that the checkpoint holds as a torchrec table: its weight's key
    (in the checkpoint, and in the model's state dict, which holds an empty placeholder there),
    the checkpoint keys of its fused optimizer state in the tiered state's column order (empty for
    SGD or when the checkpoint holds none: ``strict=False``), and the routed row order of a
    roundrobin / hash_roundrobin FUSED table (None: torchrec's contiguous row blocks)."""

    weight_key: str
    state_keys: Tuple[str, ...]
    row_order: Optional[RowOrder]


def _saved_optimizer(metadata: Metadata, head: str, rows: int, dim: int) -> Tuple[str, Dict[str, List[int]]]:
    """The optimizer the fused state under ``head`` belongs to (by torchrec's names and shapes),
    and the state's names and shapes."""
    found = {
        key[len(head) :]: list(md.size)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(head) and isinstance(md, TensorStorageMetadata)
    }
    for opt, names in OPTIMIZER_STATE_NAMES.items():
        row = opt is FusedOptimizerKind.ROWWISE_ADAGRAD
        if found == {n: ([rows] if row else [rows, dim]) for n in names}:
            return opt.value, found
    (name,) = OPTIMIZER_STATE_NAMES[FusedOptimizerKind.ROWWISE_ADAGRAD]
    if list(found) == [name] and len(found[name]) == 1 and found[name][0] % rows == 0 and found[name][0] > rows:
        shards = found[name][0] // rows
        return (
            f"row-wise Adagrad of a column-wise table ({shards} accumulators per row, one per column shard, where "
            "a tiered table keeps one: plan the table column_wise as it was saved)"
        ), found
    return "an unrecognised optimizer", found


def _saved_row_order(
    src: Source, weight_key: str, md: TensorStorageMetadata
) -> Tuple[Optional[RowOrder], Optional[str]]:
    """The row order a routed FUSED table (saved weight ``md``) was saved in (None: contiguous rows), or
    why its rows cannot be put in global row order."""
    base = weight_key[: -len("weight")] + ROW_ORDER_KEY
    saved = read_row_orders(src, [base]).get(base)
    if saved is None:
        return None, None
    record: Dict[str, Any] = {f: saved.get(f) for f in (*RowOrder._fields, "routing_version")}  # as saved
    try:
        sizes_and_seed = [int(record[f]) for f in RowOrder._fields[1:]]  # None (not saved): TypeError
        order = RowOrder(str(record["dist_type"]), *sizes_and_seed)
        chunks = sorted((int(c.offsets[0]), int(c.sizes[0])) for c in md.chunks)
        sizes = [local_rows(order.num_embeddings, order.world_size, r) for r in range(order.world_size)]
        blocks = [(sum(sizes[:r]), n) for r, n in enumerate(sizes)]
        layout_ok = chunks == blocks and order.num_embeddings == int(md.size[0])
    except (TypeError, ValueError, KeyError):
        layout_ok = False
    if not layout_ok or int(record.get("routing_version") or 0) != ROUTING_VERSION:
        return None, (
            f"its weight was saved with {describe_row_order(record)} in a layout this recpipe "
            f"cannot put in global row order (routing version {ROUTING_VERSION})"
        )
    return order, None


def _from_torchrec(
    fqn: str, shard: TieredEmbeddingShard, key: str, src: Source, fused_state: bool
) -> Tuple[Optional[TableFromTorchrec], Optional[str]]:
    """How tiered table ``fqn`` loads the torchrec table the checkpoint holds under ``key``, or why it cannot."""
    metadata = src.metadata
    weight = metadata.state_dict_metadata[key]
    assert isinstance(weight, TensorStorageMetadata)
    table = fqn.rsplit(".", 1)[-1]
    mine, theirs = [shard.num_embeddings, shard.embedding_dim], list(weight.size)
    if theirs != mine:
        return None, (
            f"table {fqn!r}: the checkpoint holds a torchrec table of [num_embeddings, dim] = "
            f"{theirs}, this model a tiered table of {mine}"
        )
    head = f"{FUSED_OPTIMIZER_KEY}.state.{key}.{table}."  # the table's fused optimizer state
    saved_opt, names = _saved_optimizer(metadata, head, *mine)
    want = shard.optimizer.name
    # the checkpoint holds fused optimizer state: this table's must be its optimizer's
    if (names or fused_state) and saved_opt != want:
        got = f"{saved_opt} state {names}" if names else "no state (sgd)"
        return None, (
            f"table {fqn!r}: the checkpoint holds fused optimizer state of {got} "
            f"(under {head}*), this model's tiered table trains with {want}"
        )
    order, refusal = _saved_row_order(src, key, weight)
    if refusal is not None:
        return None, f"table {fqn!r}: {refusal}"
    state_keys = tuple(
        head + n for n in OPTIMIZER_STATE_NAMES[FusedOptimizerKind(want)] if head + n in metadata.state_dict_metadata
    )
    return TableFromTorchrec(key, state_keys, order), None


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
    src: Source,
    state: Dict[str, Any],
    tiered_here: Dict[str, TieredEmbeddingShard],
    strict: bool,
    process_group: Optional[dist.ProcessGroup],
) -> Tuple[List[str], Dict[str, TableFromTorchrec], List[str]]:
    """Refuses (``CheckpointTableError``), on every rank and before anything is read, a checkpoint
    whose tables do not fit the kinds of this model's (DCP itself would fail mid-load on some ranks
    only); ``strict`` also refuses tiered tables either side lacks entirely.

    Returns this rank's tiered tables (``tiered_here``, by fqn) the checkpoint lacks entirely
    (without ``strict``: they keep their rows); this rank's tiered tables that load from the
    checkpoint's torchrec tables (:class:`TableFromTorchrec`, by fqn); and the tables tiered in the
    checkpoint that some rank holds as torchrec tables (loaded into torchrec, :func:`check_into_torchrec`).
    """
    metadata, where = src.metadata, src.where
    world = rank_world(process_group)[1]
    tiered_anywhere = {fqn for part in all_gather(sorted(tiered_here), world, process_group) for fqn in part}
    saved_tiered = {m.group(1) for key in metadata.state_dict_metadata if (m := TIERED_KEY.match(key))}
    fused_state = any(key.startswith(f"{FUSED_OPTIMIZER_KEY}.state.") for key in metadata.state_dict_metadata)
    problems: List[str] = []
    misfits: List[str] = []
    absent: List[str] = []
    from_torchrec: Dict[str, TableFromTorchrec] = {}
    for fqn in sorted(set(tiered_here) - saved_tiered):
        key = weight_key(fqn, state)
        weight = metadata.state_dict_metadata.get(key) if key is not None else None
        if weight is None and not strict:  # not in the checkpoint at all: the table keeps its rows
            absent.append(fqn)
        elif not isinstance(weight, TensorStorageMetadata) or weight.size.numel() == 0 or len(weight.size) != 2:
            problems.append(f"table {fqn!r} is tiered in this model, but the checkpoint holds no rows of it")
        else:
            assert key is not None
            table, misfit = _from_torchrec(fqn, tiered_here[fqn], key, src, fused_state)
            if table is not None:
                from_torchrec[fqn] = table
            else:
                misfits.append(str(misfit))
    # tiered when saved, a torchrec (ShardedTensor) table here: loaded into torchrec from the exports
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
        raise CheckpointTableError(f"{where} does not fit this model's tables: " + "; ".join(everyone) + _KIND_FIXES)
    everyone = sorted({p for _, part in parts for p in part})
    if everyone:
        raise CheckpointTableError(
            f"{where}: a tiered table of this model cannot load the torchrec table the checkpoint holds: "
            + "; ".join(everyone)
            + _MISFIT_FIXES
        )
    return absent, from_torchrec, sorted(fused_anywhere)


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


def _saved_blocks(table: TableFromTorchrec, metadata: Metadata, n: int) -> List[Tuple[int, int]]:
    """The non-empty row blocks ``[start, stop)`` a torchrec table was saved in, in row order."""
    md = metadata.state_dict_metadata[table.weight_key]
    assert isinstance(md, TensorStorageMetadata)  # checked by check_table_kinds
    bounds = sorted({0, n} | {int(c.offsets[0]) + e for c in md.chunks for e in (0, int(c.sizes[0]))})
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if a < b]


def _blocks_from_torchrec(
    shard: TieredEmbeddingShard, table: TableFromTorchrec, src: Source
) -> Iterator[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """Reads a torchrec table one saved row block at a time (this process alone): yields each
    block's int64 global ids, ``[rows, dim]`` weights and ``[rows, state_cols]`` fp32 optimizer
    state in the tiered column layout (None without state). A routed table's block of saving
    rank ``r`` holds ``r``'s routed rows in local-id order."""
    order = table.row_order
    rank_at: Dict[int, int] = {}  # a routed table's saving rank by its block's first row
    if order is not None:
        sizes = [local_rows(order.num_embeddings, order.world_size, r) for r in range(order.world_size)]
        rank_at = {sum(sizes[:r]): r for r in range(order.world_size) if sizes[r]}
    for start, stop in _saved_blocks(table, src.metadata, shard.num_embeddings):
        state: Dict[str, Any] = {}
        for key in (table.weight_key, *table.state_keys):
            kmd = src.metadata.state_dict_metadata[key]
            assert isinstance(kmd, TensorStorageMetadata)
            state[key] = torch.empty((stop - start, *kmd.size[1:]), dtype=kmd.properties.dtype)
        layout.read_here(state, src, planner=_RowBlockLoadPlanner(start))
        weights = state.pop(table.weight_key)
        opt = (
            torch.cat([state.pop(k).reshape(stop - start, -1).to(torch.float32) for k in table.state_keys], dim=1)
            if table.state_keys
            else None
        )
        gids = order.global_ids(rank_at[start]) if order is not None else torch.arange(start, stop, dtype=torch.int64)
        assert gids.numel() == stop - start
        yield gids, weights, opt
        del state, weights, opt, gids


@torch.no_grad()
def check_rows_from_torchrec(shard: TieredEmbeddingShard, table: TableFromTorchrec, src: Source, fqn: str) -> None:
    """Refuses (the shard's ``TieredCheckpointError``) NaN / inf rows of a torchrec table a tiered table
    loads, naming the table and their number; keeps none of them."""
    non_finite = 0
    for _, weights, opt in _blocks_from_torchrec(shard, table, src):
        bad = non_finite_rows(weights, opt if opt is not None else torch.empty((weights.shape[0], 0)))
        non_finite += 0 if bad is None else int(bad.sum())
        del weights, opt  # before the next block is read
    if non_finite:
        raise shard.checkpoint_error(
            f"{non_finite} of the {shard.num_embeddings} rows of the torchrec table it would load from {src.where} "
            f"(table {fqn!r}, {table.weight_key}) hold NaN or inf values or optimizer state",
            NON_FINITE_FIXES,
        )


def load_table_from_torchrec(shard: TieredEmbeddingShard, table: TableFromTorchrec, src: Source) -> None:
    """Loads a tiered table from the torchrec table the checkpoint holds, one saved block at a
    time (optimizer state zero without it); the table keeps its own optimizer step."""
    step = shard.tiers.export_step()  # as export_state reads it
    shard.load_row_blocks(_blocks_from_torchrec(shard, table, src), step)


class TableIntoTorchrec(NamedTuple):
    """A table tiered in the checkpoint that this model holds as a torchrec (ShardedTensor) table.

    ``own_weight``, ``fused_entry`` and ``row_order`` are the model's own entries, kept out of
    DCP's load (the checkpoint holds none of them) and given back to the model's
    ``load_state_dict`` calls afterwards.
    """

    fqn: str
    weight_key: str  # in the model's state dict
    heads: Dict[int, Dict[str, Any]]  # every saving rank's export metadata and step
    desc: Any  # the model's table as tiered.migration describes it (rows, dim, fused optimizer)
    own_weight: Any
    fused_entry: Any
    row_order: Any


def _exports_into_torchrec(
    u: TableIntoTorchrec, src: Source, n: int
) -> Iterator[Tuple[torch.Tensor, TieredShardState]]:
    """Every saving rank's export (int64 global ids, export) in turn, refusing ids outside ``[0, n)``."""
    for r in sorted(u.heads):
        st = read_export(src, u.fqn, r)
        gids = st.global_ids.to(torch.int64)
        if gids.numel() and (int(gids.min()) < 0 or int(gids.max()) >= n):
            raise CheckpointTableError(
                f"{src.where}: table {u.fqn!r}: the tiered export of rank {r} holds global ids outside [0, {n}); "
                "the checkpoint is damaged or was edited: re-save it. Nothing was loaded: the model is "
                "unchanged."
            )
        yield gids, st
        del st, gids


@torch.no_grad()
def _check_into_torchrec(fqn: str, key: str, d: Any, src: Source) -> TableIntoTorchrec:
    """Checks the exports of one table loaded into torchrec against its description ``d``: size
    and optimizer, each row held exactly once, no NaN / inf row. Reads every export once and keeps none."""
    where = src.where
    heads = tiered_heads(None, src, fqn)
    md = heads[min(heads)]["metadata"]
    saved = [md.get("num_embeddings"), md.get("embedding_dim"), md.get("optimizer")]
    if (
        d is None
        or d.optimizer not in {o.value for o in OPTIMIZER_STATE_NAMES}
        or saved != [d.rows, d.dim, d.optimizer]
    ):
        mine = f"[{d.rows}, {d.dim}] trained with {d.optimizer}" if d is not None else "without a fused optimizer"
        raise CheckpointTableError(
            f"{where}: table {fqn!r} was tiered when saved ([{md.get('num_embeddings')}, "
            f"{md.get('embedding_dim')}] trained with {md.get('optimizer')}), and this model's torchrec table "
            f"is {mine}. Nothing was loaded: the model is unchanged. Possible solutions:\n"
            "  1. build the table as it was saved (the same num_embeddings, embedding_dim and fused optimizer: "
            "SGD, RowWiseAdagrad or Adam, TABLE_WISE or ROW_WISE)\n"
            "  2. plan it tiered, as it was saved\n  3. start from fresh tables instead of this checkpoint"
        )
    u = TableIntoTorchrec(fqn, key, heads, d, None, None, None)
    count = torch.zeros(d.rows, dtype=torch.int64)
    non_finite = 0
    for gids, st in _exports_into_torchrec(u, src, d.rows):
        count.index_add_(0, gids, torch.ones_like(gids))
        bad = non_finite_rows(st.weights, st.optimizer_state)
        non_finite += 0 if bad is None else int(bad.sum())
        del gids, st  # before the next export is read
    if bool((count != 1).any()):
        raise CheckpointTableError(
            f"{where}: table {fqn!r}: {int((count == 0).sum())} rows are missing from its tiered exports and "
            f"{int((count > 1).sum())} appear more than once; the exports do not partition the table: "
            "re-save the checkpoint. Nothing was loaded: the model is unchanged."
        )
    if non_finite:
        raise CheckpointTableError(
            f"{where}: table {fqn!r}: {non_finite} rows of its tiered exports hold NaN or inf values or "
            "optimizer state. Nothing was loaded: the model is unchanged. " + "\n".join(numbered(NON_FINITE_FIXES))
        )
    return u


def check_into_torchrec(
    model: nn.Module,
    tables: Sequence[str],
    state: Dict[str, Any],
    src: Source,
    process_group: Optional[dist.ProcessGroup],
) -> Dict[str, TableIntoTorchrec]:
    """Checks the exports of ``tables`` (fqns tiered in the checkpoint, torchrec tables here, the
    same on every rank) on every rank before anything is loaded (``CheckpointTableError``), and
    moves the tables' own entries out of ``state`` (the regular state dict for DCP's load).
    Returns the :class:`TableIntoTorchrec` of each table, by fqn."""
    if not tables:
        return {}
    desc = describe_optimizer_tables(optimizer_tables(model), process_group)  # collective
    out: Dict[str, TableIntoTorchrec] = {}

    def check() -> None:
        for fqn in tables:
            key = weight_key(fqn, state)
            assert key is not None
            out[fqn] = _check_into_torchrec(fqn, key, desc.get(key[: -len(".weight")]), src)

    raise_first_refusal(refusals(check, process_group), process_group)
    fused = state.get(FUSED_OPTIMIZER_KEY)
    fused_state = fused.get("state") if isinstance(fused, dict) else None
    for fqn, u in out.items():
        out[fqn] = u._replace(
            own_weight=state.pop(u.weight_key, None),
            row_order=state.pop(u.weight_key[: -len("weight")] + ROW_ORDER_KEY, None),
            fused_entry=fused_state.pop(u.weight_key, None) if isinstance(fused_state, dict) else None,
        )
    return out


def _global_rows(rows: Any) -> torch.Tensor:
    """A shard's global rows (a contiguous ``slice`` or int64 routed ids) as int64 ids."""
    return torch.arange(rows.start, rows.stop, dtype=torch.int64) if isinstance(rows, slice) else rows


@torch.no_grad()
def fill_table_into_torchrec(u: TableIntoTorchrec, src: Source) -> Callable[[str, Any], torch.Tensor]:
    """Writes the rows this rank's shards hold of a table loaded into torchrec into ``u.own_weight``;
    returns where ``write_optimizer_rows`` reads those rows' fused optimizer state (torchrec's names)."""
    order = RowOrder(*(u.row_order[f] for f in RowOrder._fields)) if u.row_order is not None else None
    shards = u.own_weight.local_shards()
    rows = [shard_global_rows(s.metadata, int(s.tensor.shape[0]), order) for s in shards]
    needed = torch.unique(torch.cat([_global_rows(r) for r in rows])) if rows else torch.empty(0, dtype=torch.int64)
    m = needed.numel()
    weights = torch.zeros((m, u.desc.dim), dtype=torch.float32)
    opt = torch.zeros(
        (m, TieredOptimizerConfig(optimizer=u.desc.optimizer).state_cols(u.desc.dim)), dtype=torch.float32
    )
    for gids, st in _exports_into_torchrec(u, src, u.desc.rows) if m else ():
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
        t.copy_(weights.index_select(0, positions(r))[:, c0 : c0 + t.shape[1]].to(t.device, t.dtype))
    del weights
    named = named_to_columns(u.desc, opt, u.fqn.rsplit(".", 1)[-1])
    return lambda k, r: named[k].index_select(0, positions(r))
