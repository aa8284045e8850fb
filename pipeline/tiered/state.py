"""Export, validation and load of a tiered shard's rows (the ``TieredEmbeddingShard`` mixin).

An export holds every row of a shard by global id with its optimizer state, step and metadata.
Loads take exports of any routing, world size and placement and pick this shard's rows by global
id; missing, repeated or non-finite rows raise :class:`TieredCheckpointError`. May import
``recpipe.pipeline.interfaces``, ``recpipe.pipeline.routing``, ``.tiered.routing`` and ``.tiered.optim``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from recpipe.pipeline.interfaces import RowOptimizer, ShardRouting, TierBackend
from recpipe.pipeline.routing.ops import ROUTING_VERSION
from recpipe.pipeline.tiered.optim import check_step
from recpipe.pipeline.tiered.shard_routing import routing_of_export

__all__ = [
    "CHECKPOINT_VERSION",
    "LOAD_CHUNK_ROWS",
    "STATE_FIELDS",
    "ShardStateMixin",
    "TieredCheckpointError",
    "TieredShardState",
    "non_finite_rows",
]

#: Rows of an export routed and copied at a time by ``load_states`` (bounds its extra memory).
LOAD_CHUNK_ROWS: int = 1 << 20

#: Export format version; version 2 records ``routing_version`` (version 1: hash_roundrobin v1).
CHECKPOINT_VERSION: int = 2

#: An iterable of ``(global ids [n], values [n, dim], fp32 state [n, state_cols] or None)``.
RowBlocks = Iterable[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]


#: The ``state_dict`` fields of an export (:meth:`TieredShardState.entries`).
STATE_FIELDS: Tuple[str, ...] = ("global_ids", "weights", "optimizer_state", "step", "_extra_state")


class TieredCheckpointError(ValueError):
    """A tiered-table export cannot be loaded into this shard; the message lists solutions."""


@dataclass
class TieredShardState:
    """Export of one shard: int64 global ids, values and fp32 optimizer state in local-id order,
    the optimizer step, and the table, routing and placement ``metadata``."""

    global_ids: torch.Tensor
    weights: torch.Tensor
    optimizer_state: torch.Tensor
    step: int
    metadata: Dict[str, Any] = field(default_factory=dict)

    def entries(self) -> Dict[str, Any]:
        """The export as ``state_dict`` entries by field (:data:`STATE_FIELDS`; ``step`` a 0-dim int64)."""
        tensors = {k: getattr(self, k) for k in STATE_FIELDS[:3]}
        return {**tensors, "step": torch.tensor(self.step, dtype=torch.int64), "_extra_state": self.metadata}

    @classmethod
    def from_entries(cls, entry: Callable[[str], Any]) -> "TieredShardState":
        """The export of the ``state_dict`` entries ``entry(field)`` (the inverse of :meth:`entries`)."""
        tensors = {k: entry(k) for k in STATE_FIELDS[:3]}
        return cls(**tensors, step=int(entry("step")), metadata=dict(entry("_extra_state")))


def non_finite_rows(weights: torch.Tensor, optimizer_state: torch.Tensor) -> Optional[torch.Tensor]:
    """A bool per row holding a NaN / inf value or state, or None when none does (no row-sized alloc)."""
    parts = [t for t in (weights, optimizer_state) if t.numel()]
    if all(bool(torch.isfinite(torch.stack([t.amax(), t.amin()])).all()) for t in parts):
        return None
    bad = torch.zeros(weights.shape[0], dtype=torch.bool, device=weights.device)
    for t in parts:
        bad |= (~torch.isfinite(t.reshape(t.shape[0], -1))).any(dim=1)
    return bad


class ShardStateMixin:
    """Metadata, export, export checks and loads (exports, streamed row blocks, full tables) of a
    tiered shard (``TieredEmbeddingShard``)."""

    device: torch.device
    rows_writes: int
    table_name: str
    num_embeddings: int
    embedding_dim: int
    dtype: torch.dtype
    num_rows: int
    state_cols: int
    optimizer: RowOptimizer
    routing: ShardRouting
    tiers: TierBackend

    def global_ids(self) -> torch.Tensor:
        """Global id (int64) of every local row, in local-id order."""
        return self.routing.global_ids(torch.arange(self.num_rows, dtype=torch.int64))

    def metadata(self) -> Dict[str, Any]:
        """Routing and placement of this shard as exports record them (JSON-serializable)."""
        routing = self.routing.metadata()
        spec = self.tiers.spec
        return {
            "version": CHECKPOINT_VERSION,
            "table": self.table_name,
            "num_embeddings": self.num_embeddings,
            "embedding_dim": self.embedding_dim,
            "dtype": str(self.dtype).replace("torch.", ""),
            "optimizer": self.optimizer.name,
            **{k: routing[k] for k in ("dist_type", "routing_seed", "routing_version", "world_size", "rank")},
            "num_rows": self.num_rows,
            "placement": {
                "mode": spec.mode.name,
                "cache_load_factor": spec.cache_load_factor,
                "cache_policy": spec.cache_policy.value,
                "split_seed": spec.split_seed,
            },
        }

    @torch.no_grad()
    def export_state(self) -> TieredShardState:
        """Flushes the cache and exports every row (local-id order, on CPU)."""
        self.tiers.flush()
        weights, state = self.tiers.read_rows()
        return TieredShardState(
            global_ids=self.global_ids(),
            weights=weights.cpu(),
            optimizer_state=state.cpu(),
            step=self.tiers.export_step(),
            metadata=self.metadata(),
        )

    def routes_as(self, metadata: Dict[str, Any]) -> bool:
        """Whether an export with ``metadata`` is routed as this shard's job routes (``ShardRouting.routes_as``)."""
        return self.routing.routes_as(metadata)

    def checkpoint_error(self, what: str, solutions: Sequence[str]) -> TieredCheckpointError:
        """A :class:`TieredCheckpointError` naming this shard, ``what`` failed and the numbered ``solutions``."""
        spec, routing = self.tiers.spec, self.routing
        lines = [
            f"cannot load table {self.table_name!r} into shard rank {routing.rank}/{routing.world_size} "
            f"({spec.mode.name} {spec.cache_load_factor}, {routing.dist_type}): {what}. Possible solutions:"
        ]
        lines += [f"  {i}. {s}" for i, s in enumerate(solutions, 1)]
        return TieredCheckpointError("\n".join(lines))

    def check_export_metadata(self, md: Dict[str, Any]) -> None:
        """Checks an export's metadata against this shard (fields, sizes, dtype, optimizer, routing
        version); loaders call it for every export before they change any state."""
        if not isinstance(md, Mapping):
            raise self.checkpoint_error(
                f"export metadata is a {type(md).__name__}, not a dict",
                ["pass TieredShardState.metadata of an export_state() / state_dict() export"],
            )
        mine = self.metadata()
        # every field of this shard's metadata but the table name and routing_version (version 1 lacks it)
        missing = [k for k in mine if k not in md and k not in ("table", "routing_version")]
        if missing:
            raise self.checkpoint_error(
                f"export metadata lacks {missing}", ["export with TieredEmbeddingShard.export_state() / state_dict()"]
            )
        for key in ("num_embeddings", "embedding_dim", "dtype", "optimizer"):
            if md[key] != mine[key]:
                raise self.checkpoint_error(
                    f"export has {key}={md[key]!r} but this shard has {key}={mine[key]!r}",
                    [f"build the shard with {key}={md[key]!r}", "load the export of the matching table"],
                )
        routing_version = int(md.get("routing_version", 1))  # version 1 exports lack the key
        if routing_version > ROUTING_VERSION:
            raise self.checkpoint_error(
                f"export was routed by hash_roundrobin version {routing_version}, newer than this "
                f"recpipe's version {ROUTING_VERSION}",
                ["load it with the recpipe release that wrote it (or a newer one)"],
            )

    def validate_state(self, st: TieredShardState) -> None:
        """Checks an export's metadata, row count, global ids and widths against this shard."""
        md = st.metadata
        self.check_export_metadata(md)
        n = int(st.global_ids.numel())
        source = routing_of_export(md)
        rows = source.num_rows
        counts = {
            "global_ids": n,
            "weights": int(st.weights.shape[0]),
            "optimizer_state": int(st.optimizer_state.shape[0]),
            "metadata['num_rows']": md["num_rows"],
        }
        wrong = {name: count for name, count in counts.items() if count != rows}
        if wrong:
            raise self.checkpoint_error(
                f"export of rank {md['rank']}/{md['world_size']} ({md['dist_type']}) must hold {rows} rows (its "
                f"routing of {md['num_embeddings']} rows), but "
                + ", ".join(f"{name} has {count}" for name, count in wrong.items()),
                ["the export is truncated or its metadata was edited: re-export the shard"],
            )
        self._check_export_ids(st, source)
        cols = self.state_cols
        if tuple(st.weights.shape[1:]) != (self.embedding_dim,) or tuple(st.optimizer_state.shape[1:]) != (cols,):
            raise self.checkpoint_error(
                f"export has value/state widths {list(st.weights.shape[1:])}/{list(st.optimizer_state.shape[1:])}, "
                f"expected [{self.embedding_dim}]/[{cols}]",
                ["load the export of the matching table"],
            )

    def _check_export_ids(self, st: TieredShardState, source: ShardRouting) -> None:
        """The export's global ids are those its routing ``source`` gives its rows."""
        md = st.metadata
        n = int(st.global_ids.numel())
        routing_version = int(md.get("routing_version", 1))
        gids = st.global_ids.to(torch.int64).cpu()
        if md["dist_type"] == "hash_roundrobin" and routing_version != ROUTING_VERSION:
            # Another hash version, not computed here: check the ids are distinct and in range;
            # load_states places every row by global id, so nothing is lost.
            out_of_range = int(((gids < 0) | (gids >= md["num_embeddings"])).sum())
            repeated = n - int(gids.unique().numel())
            if out_of_range or repeated:
                raise self.checkpoint_error(
                    f"export (hash_roundrobin version {routing_version}) has {out_of_range} global ids "
                    f"outside [0, {md['num_embeddings']}) and {repeated} repeated",
                    ["the export is damaged or its metadata was edited: re-export the shard"],
                )
            return
        chunk = LOAD_CHUNK_ROWS
        agree = all(
            torch.equal(
                source.global_ids(torch.arange(lo, min(lo + chunk, n), dtype=torch.int64)), gids[lo : lo + chunk]
            )
            for lo in range(0, n, chunk)
        )
        if not agree:
            raise self.checkpoint_error(
                f"export global ids disagree with its metadata (dist_type={md['dist_type']!r}, "
                f"routing_seed={md['routing_seed']}, world_size={md['world_size']}, rank={md['rank']})",
                [
                    "the metadata does not describe how these rows were routed: re-export the shard",
                    "do not mix exports written with different routing seeds or world sizes",
                ],
            )

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        destination.update({prefix + k: v for k, v in self.export_state().entries().items()})

    def write_local_rows(
        self,
        weights: torch.Tensor,
        state: Optional[torch.Tensor],
        reset_cache: bool,
        rows: Optional[torch.Tensor] = None,
    ) -> None:
        """Writes ``weights`` / ``state`` (None: zeros) of local ``rows`` (None: all), counted in
        ``rows_writes``. Only with the cache empty (``reset_cache`` or emptied by the caller)."""
        self.rows_writes += 1
        if reset_cache:
            self.tiers.empty_cache()
        self.tiers.write_rows(weights, state, rows)

    def _set_step(self, step: int) -> None:
        self.tiers.load_step(int(step))

    def _non_finite_error(self, rows: int) -> TieredCheckpointError:
        return self.checkpoint_error(
            f"{rows} of the rows it would load hold NaN or inf values or optimizer state",
            [
                "the saving run diverged or the export is damaged: load an earlier checkpoint",
                "re-export the table from a healthy run",
            ],
        )

    @torch.no_grad()
    def load_states(self, states: Sequence[TieredShardState]) -> None:
        """Loads this shard's rows by global id from exports of any routing, world size and placement.
        Refuses bad exports, disagreeing steps, and missing, repeated or non-finite rows before writing."""
        if (
            isinstance(states, TieredShardState)
            or not isinstance(states, Sequence)
            or not all(isinstance(st, TieredShardState) for st in states)
        ):
            got = (
                type(states).__name__
                if not isinstance(states, Sequence) or isinstance(states, (str, bytes))
                else f"a {type(states).__name__} of {sorted({type(st).__name__ for st in states})}"
            )
            raise self.checkpoint_error(
                f"states must be a list of TieredShardState, got {got}",
                ["pass a list of exports, e.g. [shard.export_state()] (one per saving rank)"],
            )
        if len(states) == 0:
            raise self.checkpoint_error("no export given", ["pass the exports of every saving rank"])
        for st in states:
            self.validate_state(st)
        steps = {int(st.step) for st in states}
        if len(steps) != 1:
            raise self.checkpoint_error(
                f"exports disagree on the optimizer step {sorted(steps)}",
                ["load exports written at the same training step"],
            )
        if len(states) == 1 and states[0].metadata["rank"] == self.routing.rank and self.routes_as(states[0].metadata):
            # this shard's own rows in local-id order (validated above): written as they are
            st = states[0]
            bad = non_finite_rows(st.weights, st.optimizer_state)
            if bad is not None:
                raise self._non_finite_error(int(bad.sum()))
            weights, opt = st.weights, st.optimizer_state
        else:
            weights, opt = self._gather_own_rows(states)
        self.write_local_rows(weights.to(self.device, self.dtype), opt.to(self.device, torch.float32), reset_cache=True)
        self._set_step(steps.pop())

    def _gather_own_rows(self, states: Sequence[TieredShardState]) -> Tuple[torch.Tensor, torch.Tensor]:
        """This shard's rows and state (local-id order, CPU) from validated exports, in chunks."""
        R = self.num_rows
        weights = torch.empty((R, self.embedding_dim), dtype=self.dtype)
        opt = torch.empty((R, self.state_cols), dtype=torch.float32)
        count = torch.zeros(R, dtype=torch.int64)
        non_finite = 0
        for st in states:
            for lo in range(0, int(st.global_ids.numel()), LOAD_CHUNK_ROWS):
                hi = lo + LOAD_CHUNK_ROWS
                owner, local = self.routing.route(st.global_ids[lo:hi].to(torch.int64).cpu())
                sel = (owner == self.routing.rank).nonzero().squeeze(1)
                if sel.numel() == 0:
                    continue
                mine = local.index_select(0, sel)
                w = st.weights[lo:hi].cpu().index_select(0, sel)
                o = st.optimizer_state[lo:hi].cpu().index_select(0, sel)
                non_finite += int(((~torch.isfinite(w)).any(dim=1) | (~torch.isfinite(o)).any(dim=1)).sum())
                count.index_add_(0, mine, torch.ones_like(mine))
                weights.index_copy_(0, mine, w.to(self.dtype))
                opt.index_copy_(0, mine, o.to(torch.float32))
        if bool((count > 1).any()):
            dup = self.global_ids().index_select(0, (count > 1).nonzero().squeeze(1)[:5])
            raise self.checkpoint_error(
                f"{int((count > 1).sum())} rows appear more than once (global ids {dup.tolist()})",
                ["pass each saving rank's export exactly once"],
            )
        if bool((count == 0).any()):
            gone = self.global_ids().index_select(0, (count == 0).nonzero().squeeze(1)[:5])
            src = sorted({(st.metadata["rank"], st.metadata["world_size"]) for st in states})
            raise self.checkpoint_error(
                f"{int((count == 0).sum())} of its {R} rows are missing from the exports "
                f"(e.g. global ids {gone.tolist()}; got exports of (rank, world_size) {src})",
                [
                    "pass the exports of ALL ranks of the saving job (rows are resharded by global id)",
                    "check that the saving job used the same num_embeddings",
                ],
            )
        if non_finite:
            raise self._non_finite_error(non_finite)
        return weights, opt

    @torch.no_grad()
    def load_row_blocks(self, blocks: RowBlocks, step: int) -> None:
        """Sets every row from streamed ``(global ids, values, state or None)`` blocks, each written as
        it comes; every row must come exactly once. On an error the blocks before stay written."""
        check_step(self.table_name, step, "the step the rows were saved at")
        self.tiers.flush()
        self.tiers.empty_cache()
        count = torch.zeros(self.num_rows, dtype=torch.int64)
        for gids, weights, state in blocks:
            self._load_block(gids, weights, state, count)
        if bool((count != 1).any()):
            raise self.checkpoint_error(
                f"{int((count == 0).sum())} of its {self.num_rows} rows are missing from the blocks and "
                f"{int((count > 1).sum())} appear more than once",
                ["pass every row of the table exactly once"],
            )
        self._set_step(int(step))

    def _load_block(
        self, gids: torch.Tensor, weights: torch.Tensor, state: Optional[torch.Tensor], count: torch.Tensor
    ) -> None:
        """Writes the rows of one block this shard owns; counts them in ``count`` (per local row)."""
        n, cols = int(gids.numel()), self.state_cols
        if (
            gids.dim() != 1
            or tuple(weights.shape) != (n, self.embedding_dim)
            or (state is not None and tuple(state.shape) != (n, cols))
        ):
            got = [list(gids.shape), list(weights.shape), None if state is None else list(state.shape)]
            raise self.checkpoint_error(
                f"a block of rows has shapes (global ids, values, state) {got}, expected [{n}], "
                f"[{n}, {self.embedding_dim}] and [{n}, {cols}] or None",
                ["pass blocks of this table's rows"],
            )
        owner, local = self.routing.route(gids.to(torch.int64).cpu())
        sel = (owner == self.routing.rank).nonzero().squeeze(1)
        mine = local.index_select(0, sel)
        values = weights.index_select(0, sel.to(weights.device))
        opt = state.index_select(0, sel.to(state.device)) if state is not None else None
        bad = non_finite_rows(values, opt if opt is not None else values.new_empty((sel.numel(), 0)))
        if bad is not None:
            raise self._non_finite_error(int(bad.sum()))
        count.index_add_(0, mine, torch.ones_like(mine))
        if mine.numel():
            self.write_local_rows(
                values.to(self.device, self.dtype),
                opt.to(self.device, torch.float32) if opt is not None else None,
                reset_cache=False,
                rows=mine,
            )

    def _load_from_state_dict(
        self,
        state_dict: Dict[str, Any],
        prefix: str,
        local_metadata: Dict[str, Any],
        strict: bool,
        missing_keys: List[str],
        unexpected_keys: List[str],
        error_msgs: List[str],
    ) -> None:
        absent = [prefix + k for k in STATE_FIELDS if prefix + k not in state_dict]
        if absent:
            missing_keys.extend(absent)
            return
        self.load_states([TieredShardState.from_entries(lambda k: state_dict[prefix + k])])

    @torch.no_grad()
    def load_global_weights(self, weights: torch.Tensor) -> None:
        """Sets this shard's rows from a full ``[num_embeddings, dim]`` table; zeroes state."""
        self.write_local_rows(self._own_rows(weights), None, reset_cache=True)
        self._set_step(0)

    def _own_rows(self, weights: Any) -> torch.Tensor:
        """This shard's rows (local-id order, its device and dtype) of a full table."""
        if not isinstance(weights, torch.Tensor):
            raise ValueError(
                f"tiered table {self.table_name!r}: weights must be a torch.Tensor of shape "
                f"[{self.num_embeddings}, {self.embedding_dim}], got {type(weights).__name__}; "
                "pass e.g. torch.as_tensor(weights, dtype=torch.float32)."
            )
        if tuple(weights.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"weights must have shape [num_embeddings={self.num_embeddings}, "
                f"embedding_dim={self.embedding_dim}], got {list(weights.shape)}."
            )
        return weights.index_select(0, self.global_ids().to(weights.device)).to(self.device, self.dtype)

    @torch.no_grad()
    def load_global_optimizer_state(
        self, state: torch.Tensor, step: int, weights: Optional[torch.Tensor] = None
    ) -> None:
        """Sets this shard's optimizer state from a full ``[num_embeddings, state_cols]`` table's ``state``
        (global row order, this shard's layout; Adam: ``exp_avg`` then ``exp_avg_sq``) saved at ``step``
        (the next update is ``step + 1``); ``weights``, a full table, loads in the same write (None keeps
        the shard's values)."""
        shape = [self.num_embeddings, self.state_cols]
        if not isinstance(state, torch.Tensor) or not state.is_floating_point() or list(state.shape) != shape:
            got = (
                f"a {state.dtype} tensor of shape {list(state.shape)}"
                if isinstance(state, torch.Tensor)
                else type(state).__name__
            )
            raise ValueError(
                f"tiered table {self.table_name!r}: optimizer state must be a float tensor of shape {shape} "
                f"([num_embeddings, state columns of {self.optimizer.name}]), got {got}; pass the state of a "
                f"table with the same shape and optimizer."
            )
        check_step(self.table_name, step, "the step the state was saved at")
        local = state.detach().index_select(0, self.global_ids().to(state.device)).to(torch.float32)
        if not bool(torch.isfinite(local).all()):
            raise ValueError(
                f"tiered table {self.table_name!r}: the optimizer state holds NaN or inf values; "
                "load the state of a healthy run."
            )
        # the shard's values: export_state flushes the cache, every value in local-id order
        values = self._own_rows(weights) if weights is not None else self.export_state().weights
        self.write_local_rows(values.to(self.device, self.dtype), local.to(self.device), reset_cache=True)
        self._set_step(int(step))
