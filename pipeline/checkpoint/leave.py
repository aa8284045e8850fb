"""Leaving tiered tables for torchrec tables: a table tiered in the checkpoint that the loading
model holds as a torchrec (ShardedTensor) table.

Each rank gathers only the rows its shards hold from every saving rank's export (by global id,
one table at a time); extra memory: the rank's rows of one table and one export.
Imports ``checkpoint.{errors, exports, layout}``, ``routing.row_order`` and ``tiered``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from recpipe.pipeline.checkpoint.errors import NON_FINITE_FIXES, numbered, raise_first_refusal, refusals
from recpipe.pipeline.checkpoint.exports import tiered_heads
from recpipe.pipeline.checkpoint.layout import FUSED_OPTIMIZER_KEY, Source, read_export, weight_key
from recpipe.pipeline.routing.row_order import ROW_ORDER_KEY, RowOrder
from recpipe.pipeline.tiered.migration import (
    OPTIMIZER_STATE_NAMES,
    describe_optimizer_tables,
    named_to_columns,
    optimizer_tables,
    shard_global_rows,
)
from recpipe.pipeline.tiered.optim import TieredOptimizerConfig
from recpipe.pipeline.tiered.state import TieredCheckpointError, TieredShardState, non_finite_rows


class Unadoption(NamedTuple):
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


def _unadopted_exports(u: Unadoption, src: Source, n: int) -> Iterator[Tuple[torch.Tensor, TieredShardState]]:
    """Every saving rank's export (int64 global ids, export) in turn, refusing ids outside ``[0, n)``."""
    for r in sorted(u.heads):
        st = read_export(src, u.fqn, r)
        gids = st.global_ids.to(torch.int64)
        if gids.numel() and (int(gids.min()) < 0 or int(gids.max()) >= n):
            raise TieredCheckpointError(
                f"{src.where}: table {u.fqn!r}: the tiered export of rank {r} holds global ids outside [0, {n}); "
                "the checkpoint is damaged or was edited: re-save it. Nothing was loaded: the model is "
                "unchanged."
            )
        yield gids, st
        del st, gids


@torch.no_grad()
def _check_unadoption(fqn: str, key: str, d: Any, src: Source) -> Unadoption:
    """Checks one unadopted table's exports against its description ``d``: size and optimizer,
    each row held exactly once, no NaN / inf row. Reads every export once and keeps none."""
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
        raise TieredCheckpointError(
            f"{where}: table {fqn!r} was tiered when saved ([{md.get('num_embeddings')}, "
            f"{md.get('embedding_dim')}] trained with {md.get('optimizer')}), and this model's torchrec table "
            f"is {mine}. Nothing was loaded: the model is unchanged. Possible solutions:\n"
            "  1. build the table as it was saved (the same num_embeddings, embedding_dim and fused optimizer: "
            "SGD, RowWiseAdagrad or Adam, TABLE_WISE or ROW_WISE)\n"
            "  2. plan it tiered, as it was saved\n  3. start from fresh tables instead of this checkpoint"
        )
    u = Unadoption(fqn, key, heads, d, None, None, None)
    count = torch.zeros(d.rows, dtype=torch.int64)
    non_finite = 0
    for gids, st in _unadopted_exports(u, src, d.rows):
        count.index_add_(0, gids, torch.ones_like(gids))
        bad = non_finite_rows(st.weights, st.optimizer_state)
        non_finite += 0 if bad is None else int(bad.sum())
        del gids, st  # before the next export is read
    if bool((count != 1).any()):
        raise TieredCheckpointError(
            f"{where}: table {fqn!r}: {int((count == 0).sum())} rows are missing from its tiered exports and "
            f"{int((count > 1).sum())} appear more than once; the exports do not partition the table: "
            "re-save the checkpoint. Nothing was loaded: the model is unchanged."
        )
    if non_finite:
        raise TieredCheckpointError(
            f"{where}: table {fqn!r}: {non_finite} rows of its tiered exports hold NaN or inf values or "
            "optimizer state. Nothing was loaded: the model is unchanged. " + "\n".join(numbered(NON_FINITE_FIXES))
        )
    return u


def check_unadoptions(
    model: nn.Module,
    tables: Sequence[str],
    state: Dict[str, Any],
    src: Source,
    process_group: Optional[dist.ProcessGroup],
) -> Dict[str, Unadoption]:
    """Checks the exports of ``tables`` (fqns tiered in the checkpoint, torchrec tables here, the
    same on every rank) on every rank before anything is loaded (``TieredCheckpointError``), and
    moves the tables' own entries out of ``state`` (the regular state dict for DCP's load).
    Returns the :class:`Unadoption` of each table, by fqn."""
    if not tables:
        return {}
    desc = describe_optimizer_tables(optimizer_tables(model), process_group)  # collective
    out: Dict[str, Unadoption] = {}

    def check() -> None:
        for fqn in tables:
            key = weight_key(fqn, state)
            assert key is not None
            out[fqn] = _check_unadoption(fqn, key, desc.get(key[: -len(".weight")]), src)

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
def fill_unadopted(u: Unadoption, src: Source) -> Callable[[str, Any], torch.Tensor]:
    """Writes the rows this rank's shards hold of an unadopted table into ``u.own_weight``;
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
    for gids, st in _unadopted_exports(u, src, u.desc.rows) if m else ():
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
