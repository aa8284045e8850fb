"""Reading, validating and loading tiered tables' exports from a checkpoint.

Every saving rank's export of a table is read one at a time, validated against the loading
table, and the rows this rank owns under its own routing are kept by global id; when the
saving job routed the table alike, only this rank's own export is read.
Imports ``checkpoint.{errors, layout}``, ``routing.ops`` and ``tiered``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from recpipe.pipeline.checkpoint.errors import NON_FINITE_FIXES
from recpipe.pipeline.checkpoint.layout import FIELDS, Source, read_export, read_fields, saved_ranks, tiered_dcp_key
from recpipe.pipeline.routing.ops import route_ids
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard
from recpipe.pipeline.tiered.state import TieredCheckpointError, TieredShardState, non_finite_rows


def tiered_heads(shard: Optional[TieredEmbeddingShard], src: Source, table_fqn: str) -> Dict[int, Dict[str, Any]]:
    """Reads and checks the metadata and step of every saving rank's export of one table:
    complete, consistent, and compatible with ``shard`` (None: a torchrec table here).
    Returns saving rank -> ``{"metadata", "step"}``."""
    where = src.where
    ranks = saved_ranks(src.metadata, table_fqn)
    if not ranks:
        raise TieredCheckpointError(
            f"{where}: no tiered rows of table {table_fqn!r} (keys {tiered_dcp_key(table_fqn, 0, 'weights')} ...). "
            "Possible solutions:\n  1. the table was not tiered (CUSTOMIZED_KERNEL) when the checkpoint was "
            "saved: plan it as it was saved, or load the rows from its torchrec weight\n  2. the module or "
            "table was renamed: load with the names it was saved under"
        )
    incomplete = {r: sorted(set(FIELDS) - set(f)) for r, f in ranks.items() if set(f) != set(FIELDS)}
    if incomplete:
        raise TieredCheckpointError(
            f"{where}: table {table_fqn!r}: exports lack fields {incomplete} (rank: missing fields); "
            "the checkpoint is incomplete: re-save it with recpipe.pipeline.checkpoint.dcp.save."
        )
    heads = {r: read_fields(src, table_fqn, r, ("metadata", "step")) for r in sorted(ranks)}
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
        raise TieredCheckpointError(
            f"{src.where}: table {table_fqn!r}: {int((count == 0).sum())} rows of rank {shard.rank}/{shard.world_size} "
            f"are missing and {int((count > 1).sum())} appear more than once (e.g. global ids {bad.tolist()}); "
            "the exports do not partition the table: re-save the checkpoint."
        )


@torch.no_grad()
def check_tiered_rows(
    shard: TieredEmbeddingShard, heads: Dict[int, Dict[str, Any]], src: Source, table_fqn: str
) -> None:
    """Refuses (``TieredCheckpointError``), before anything is written, what ``load_states`` would
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
