"""A dynamic shard's rows keyed by raw key, as ``state_dict()`` and checkpoints save and load them.

:func:`export_dynamic_state` takes every key a shard holds with its row, optimizer state and score (slot
order), the admission counter table's keys and sightings, the optimizer step and :func:`dynamic_metadata` (table, dim, dtype, optimizer, options, key
routing, the lru clock, capacity). :func:`load_dynamic_states` loads into a shard the keys it owns of the
exports of any key routing, world size and capacity (``DynamicEmbeddingShard.owned``), refusing
exports of another dim, dtype, optimizer or eviction, non-finite rows and repeated keys before anything
changes; keys its capacity cannot hold follow its ``on_full``. ``state_dict()`` carries one export per
shard (:data:`DYNAMIC_STATE_FIELDS`; a sharded collection under ``<collection>.<table>.dynamic.<field>``).
Imports ``recpipe.pipeline.placement`` and ``recpipe.pipeline.tiered`` modules (the shard for types only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from recpipe.pipeline.interfaces import RowOptimizer, TierBackend
from recpipe.pipeline.placement import DynamicTableOptions, Mode
from recpipe.pipeline.tiered.dynamic.key_index import DynamicKeyIndex
from recpipe.pipeline.tiered.state import TieredCheckpointError, non_finite_rows


class DynamicShardView(Protocol):
    """What this module reads and calls of a ``DynamicEmbeddingShard`` (a structural type, so the shard's module
    can import this one without a cycle)."""

    table_name: str
    table_num_embeddings: int
    embedding_dim: int
    num_rows: int
    state_cols: int
    dtype: torch.dtype
    mode: Mode
    cache_load_factor: float
    optimizer: RowOptimizer
    options: DynamicTableOptions
    key_shards: int
    key_rank: int
    key_routing_seed: int
    index: DynamicKeyIndex
    tiers: TierBackend

    def dynamic_rows(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, weights, optimizer state, scores)`` of every key held."""

    def load_dynamic_rows(
        self, keys: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, scores: torch.Tensor, step: int
    ) -> None:
        """Replaces the shard's keys and rows."""

    def owned(self, keys: torch.Tensor) -> torch.Tensor:
        """Which of ``keys`` this shard holds."""


__all__ = [
    "DYNAMIC_ADMISSION_FIELDS",
    "DYNAMIC_FORMAT",
    "DYNAMIC_STATE_FIELDS",
    "DYNAMIC_STATE_KEY",
    "DynamicShardState",
    "check_dynamic_metadata",
    "check_dynamic_rows",
    "check_dynamic_shapes",
    "concat_rows",
    "dropped_at_load",
    "dynamic_entries_misfit",
    "dynamic_error",
    "dynamic_metadata",
    "dynamic_state_entries",
    "export_dynamic_state",
    "load_dynamic_entries",
    "load_dynamic_states",
    "load_owned_rows",
    "owned_admission",
    "pop_dynamic_entries",
    "repeated_keys",
    "routes_keys_as",
]

#: The ``format`` of a dynamic export's metadata.
DYNAMIC_FORMAT: str = "recpipe-dynamic/1"
#: ``state_dict`` key infix of a sharded collection's dynamic table: ``<collection>.<table>.dynamic.<field>``.
DYNAMIC_STATE_KEY: str = "dynamic"
#: The ``state_dict`` fields of a dynamic export (:meth:`DynamicShardState.entries`).
DYNAMIC_STATE_FIELDS: Tuple[str, ...] = ("keys", "weights", "optimizer_state", "scores", "step", "_extra_state")
#: Optional ``state_dict`` fields: the admission counter table's keys and sightings (int64 ``[M]``, empty without
#: admission); an export without them loads as one with empty counters.
DYNAMIC_ADMISSION_FIELDS: Tuple[str, ...] = ("admission_keys", "admission_counts")
#: Metadata fields a load reads (every export records them).
_REQUIRED: Tuple[str, ...] = ("format", "table", "embedding_dim", "dtype", "optimizer", "options", "key_shards")
_REQUIRED += ("key_rank", "key_routing_seed", "clock", "capacity")


def _no_keys() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass
class DynamicShardState:
    """Export of one dynamic shard: int64 ``keys`` ``[N]``, ``weights`` ``[N, dim]``, fp32 ``optimizer_state``
    ``[N, state columns]`` and int64 ``scores`` ``[N]`` in slot order, the optimizer ``step``,
    :func:`dynamic_metadata`, and the admission counter table's int64 ``admission_keys`` and
    ``admission_counts`` ``[M]`` (sightings of keys not yet admitted; empty without admission)."""

    keys: torch.Tensor
    weights: torch.Tensor
    optimizer_state: torch.Tensor
    scores: torch.Tensor
    step: int
    metadata: Dict[str, Any] = field(default_factory=dict)
    admission_keys: torch.Tensor = field(default_factory=_no_keys)
    admission_counts: torch.Tensor = field(default_factory=_no_keys)

    def entries(self) -> Dict[str, Any]:
        """The export as ``state_dict`` entries by field (``step`` a 0-dim int64, ``_extra_state`` the metadata)."""
        tensors = {k: getattr(self, k) for k in DYNAMIC_STATE_FIELDS[:4] + DYNAMIC_ADMISSION_FIELDS}
        return {**tensors, "step": torch.tensor(self.step, dtype=torch.int64), "_extra_state": self.metadata}

    @classmethod
    def from_entries(cls, entry: Callable[[str], Any]) -> "DynamicShardState":
        """The export of the ``state_dict`` entries ``entry(field)`` (the inverse of :meth:`entries`); ``entry``
        gives None for an absent field of :data:`DYNAMIC_ADMISSION_FIELDS`."""
        tensors = {k: entry(k) for k in DYNAMIC_STATE_FIELDS[:4]}
        admission = {k: v for k, v in ((k, entry(k)) for k in DYNAMIC_ADMISSION_FIELDS) if v is not None}
        return cls(**tensors, step=int(entry("step")), metadata=dict(entry("_extra_state")), **admission)


def dynamic_metadata(shard: DynamicShardView) -> Dict[str, Any]:
    """What an export of ``shard`` records besides its rows (JSON-serializable): the table, its dim,
    dtype and optimizer, its ``DynamicTableOptions`` (JSON), the key routing (``key_shards``,
    ``key_rank``, ``key_routing_seed``), the index's lru ``clock`` and the table's ``capacity``."""
    return {
        "format": DYNAMIC_FORMAT,
        "table": shard.table_name,
        "embedding_dim": shard.embedding_dim,
        "dtype": str(shard.dtype).replace("torch.", ""),
        "optimizer": shard.optimizer.name,
        "options": shard.options.to_fused_param(),
        "key_shards": shard.key_shards,
        "key_rank": shard.key_rank,
        "key_routing_seed": shard.key_routing_seed,
        "clock": int(shard.index.clock),
        "capacity": shard.options.table_capacity(shard.table_num_embeddings),
        "slots": shard.num_rows,
    }


@torch.no_grad()
def export_dynamic_state(shard: DynamicShardView) -> DynamicShardState:
    """Every key ``shard`` holds with its row, optimizer state and score (slot order, CPU; flushes the cache)."""
    keys, weights, state, scores = shard.dynamic_rows()
    admission_keys, admission_counts = (t.cpu() for t in shard.index.export_admission())
    return DynamicShardState(
        keys,
        weights,
        state,
        scores,
        shard.tiers.export_step(),
        dynamic_metadata(shard),
        admission_keys,
        admission_counts,
    )


def dynamic_state_entries(shard: DynamicShardView, prefix: str) -> Dict[str, Any]:
    """``{prefix + field: value}`` of ``shard``'s export (:data:`DYNAMIC_STATE_FIELDS`)."""
    return {prefix + k: v for k, v in export_dynamic_state(shard).entries().items()}


def dynamic_error(shard: DynamicShardView, what: str, fixes: Sequence[str]) -> TieredCheckpointError:
    """A ``TieredCheckpointError`` naming ``shard``'s table and key shard, what failed and the numbered fixes."""
    where = "one key shard" if shard.key_shards == 1 else f"key shard {shard.key_rank} of {shard.key_shards}"
    lines = [
        f"cannot load dynamic table {shard.table_name!r} ({where}, {shard.mode.name} {shard.cache_load_factor}): "
        f"{what}. Possible solutions:"
    ]
    return TieredCheckpointError("\n".join(lines + [f"  {i}. {fix}" for i, fix in enumerate(fixes, 1)]))


def check_dynamic_metadata(shard: DynamicShardView, md: Any) -> None:
    """Refuses an export ``shard`` cannot load: not a dynamic export, or another embedding dim, dtype,
    optimizer or eviction (its scores mean that eviction's).

    Raises:
        TieredCheckpointError: naming the table, the field that differs and the fix.
    """
    if not isinstance(md, Mapping) or md.get("format") != DYNAMIC_FORMAT:
        got = md.get("format") if isinstance(md, Mapping) else type(md).__name__
        raise dynamic_error(
            shard,
            f"the export is not a dynamic table's ({DYNAMIC_FORMAT!r} metadata), got {got!r}",
            ["pass the export of a dynamic table (state_dict() of a model that planned it dynamic)"],
        )
    missing = [k for k in _REQUIRED if k not in md]
    if missing:
        raise dynamic_error(shard, f"the export's metadata lacks {missing}", ["re-save the table"])
    mine = dynamic_metadata(shard)
    try:
        theirs = DynamicTableOptions.from_fused_param(md["options"]).eviction
    except (ValueError, TypeError) as e:
        raise dynamic_error(shard, f"the export's options do not parse ({e})", ["re-save the table"]) from None
    wrong = [(k, md[k], mine[k]) for k in ("embedding_dim", "dtype", "optimizer") if md[k] != mine[k]]
    if theirs != shard.options.eviction:
        wrong.append(("eviction", theirs, shard.options.eviction))
    if wrong:
        key, saved, here = wrong[0]
        raise dynamic_error(
            shard,
            f"the export has {key}={saved!r} but this table has {key}={here!r}"
            + (" (its scores are that eviction's)" if key == "eviction" else ""),
            [
                f"build the table with {key}={saved!r}, as it was saved",
                "load a checkpoint saved from this model's configuration",
            ],
        )


def routes_keys_as(shard: DynamicShardView, md: Mapping[str, Any]) -> bool:
    """Whether an export with metadata ``md`` holds exactly the keys ``shard``'s key routing sends it."""
    if int(md["key_shards"]) != shard.key_shards:
        return False
    return shard.key_shards == 1 or (
        int(md["key_rank"]) == shard.key_rank and int(md["key_routing_seed"]) == shard.key_routing_seed
    )


def check_dynamic_shapes(shard: DynamicShardView, keys: Any, weights: Any, state: Any, scores: Any) -> None:
    """Refuses rows that are not ``[N]`` int64 keys and scores, ``[N, dim]`` weights and ``[N, state
    columns]`` state of ``shard``'s table."""
    tensors = (keys, weights, state, scores)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        kinds = [type(t).__name__ for t in tensors]
        raise dynamic_error(shard, f"keys, weights, state and scores must be tensors, got {kinds}", ["re-save it"])
    n = int(keys.shape[0]) if keys.dim() == 1 else -1
    want = [[n], [n, shard.embedding_dim], [n, shard.state_cols], [n]]
    got = [list(t.shape) for t in tensors]
    if n < 0 or got != want or keys.dtype != torch.int64 or scores.dtype != torch.int64:
        raise dynamic_error(
            shard,
            f"the export's keys, weights, state and scores have shapes {got} and key / score dtypes "
            f"{keys.dtype} / {scores.dtype}, expected {want} and int64",
            ["the export is truncated or edited: re-save the table", "load the export of the matching table"],
        )


def check_dynamic_rows(
    shard: DynamicShardView, keys: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, scores: torch.Tensor
) -> None:
    """Refuses rows ``shard`` cannot load: :func:`check_dynamic_shapes`, NaN / inf values or state, or
    repeated keys."""
    check_dynamic_shapes(shard, keys, weights, state, scores)
    bad = non_finite_rows(weights, state)
    if bad is not None:
        raise dynamic_error(
            shard,
            f"{int(bad.sum())} of the {keys.numel()} rows it would load hold NaN or inf values or optimizer state",
            ["the saving run diverged or the export is damaged: load an earlier checkpoint"],
        )
    repeated = repeated_keys(keys)
    if repeated.numel():
        raise dynamic_error(
            shard,
            f"{repeated.numel()} keys appear more than once among the rows it would load "
            f"(e.g. {repeated[:5].tolist()})",
            ["the exports overlap (a directory mixing saves, or one export passed twice): re-save the table"],
        )


def repeated_keys(keys: torch.Tensor) -> torch.Tensor:
    """The distinct keys that appear more than once in ``keys`` (ascending)."""
    ordered = torch.sort(keys).values
    return ordered[1:][ordered[1:] == ordered[:-1]].unique()


def dropped_at_load(shard: DynamicShardView, keys: torch.Tensor, scores: torch.Tensor) -> int:
    """How many of ``keys`` its capacity cannot hold (each bucket keeps its keys of highest score); refuses
    them when the table's ``on_full`` is ``error``, before anything changes."""
    dropped = int((shard.index.placement(keys, scores) < 0).sum())
    if dropped and shard.options.on_full == "error":
        raise dynamic_error(
            shard,
            f"{dropped} of the {keys.numel()} keys it would load find no slot ({shard.num_rows} slots on this "
            "shard, buckets of 16) and its on_full is 'error'",
            [
                "raise DynamicTableOptions.capacity of the loading table to hold every saved key",
                "set on_full='warning' or 'ignore' to keep each bucket's keys of highest score and drop the rest",
            ],
        )
    return dropped


@torch.no_grad()
def load_owned_rows(
    shard: DynamicShardView,
    keys: torch.Tensor,
    weights: torch.Tensor,
    state: torch.Tensor,
    scores: torch.Tensor,
    step: int,
    clock: int,
) -> None:
    """Replaces ``shard``'s keys by ``keys`` (those it owns) with their rows, state and scores, after
    :func:`check_dynamic_rows` and :func:`dropped_at_load`; then the optimizer ``step`` and the lru ``clock``."""
    check_dynamic_rows(shard, keys, weights, state, scores)
    dropped_at_load(shard, keys, scores)
    shard.load_dynamic_rows(keys, weights, state, scores, step)
    shard.index.clock = int(clock)


def _owned(shard: DynamicShardView, st: DynamicShardState) -> List[torch.Tensor]:
    """``[keys, weights, state, scores]`` of the keys of ``st`` that ``shard`` owns."""
    check_dynamic_shapes(shard, st.keys, st.weights, st.optimizer_state, st.scores)
    sel = shard.owned(st.keys.cpu()).cpu().nonzero().squeeze(1)
    return [t.cpu().index_select(0, sel) for t in (st.keys, st.weights, st.optimizer_state, st.scores)]


def owned_admission(shard: DynamicShardView, parts: Sequence[Tuple[Any, Any]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(keys, counts)`` of the admission counters ``shard`` owns among the saving shards' ``(admission_keys,
    admission_counts)`` parts, refusing parts that are not two int64 ``[M]`` tensors or whose keys repeat.

    Raises:
        TieredCheckpointError: naming the table and the fix.
    """
    keys: List[torch.Tensor] = []
    counts: List[torch.Tensor] = []
    for k, c in parts:
        ok = isinstance(k, torch.Tensor) and isinstance(c, torch.Tensor) and k.dim() == c.dim() == 1
        if not ok or k.shape != c.shape or k.dtype != torch.int64 or c.dtype != torch.int64:
            got = [(type(t).__name__, getattr(t, "dtype", None), list(getattr(t, "shape", []))) for t in (k, c)]
            raise dynamic_error(
                shard,
                f"the export's admission_keys and admission_counts must be two int64 [M] tensors, got {got}",
                ["the export is truncated or edited: re-save the table"],
            )
        sel = shard.owned(k.cpu()).cpu().nonzero().squeeze(1)
        keys.append(k.cpu().index_select(0, sel))
        counts.append(c.cpu().index_select(0, sel))
    mine = torch.cat(keys) if keys else _no_keys()
    repeated = repeated_keys(mine)
    if repeated.numel():
        raise dynamic_error(
            shard,
            f"{repeated.numel()} keys appear more than once among the admission counters it would load",
            ["the exports overlap (a directory mixing saves, or one export passed twice): re-save the table"],
        )
    return mine, torch.cat(counts) if counts else _no_keys()


def concat_rows(
    parts: Sequence[Sequence[torch.Tensor]],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keys, weights, state, scores)`` of ``[keys, weights, state, scores]`` parts, concatenated in order."""
    keys, weights, state, scores = (torch.cat([p[i] for p in parts]) for i in range(4))
    return keys, weights, state, scores


@torch.no_grad()
def load_dynamic_states(shard: DynamicShardView, states: Sequence[DynamicShardState]) -> None:
    """Loads into ``shard`` the keys it owns of every saving shard's export (any key routing, world size
    and capacity): their rows, state and scores, the step (all exports alike) and the clock (their
    maximum). Refuses, before anything changes, what :func:`check_dynamic_metadata` and
    :func:`check_dynamic_rows` refuse, disagreeing steps, and keys the capacity cannot hold under
    ``on_full='error'``.

    Args:
        shard (DynamicEmbeddingShard): the loading shard.
        states (Sequence[DynamicShardState]): every saving shard's :func:`export_dynamic_state`.

    Raises:
        TieredCheckpointError: naming the table, the problem and the fix (the shard unchanged).
    """
    if isinstance(states, DynamicShardState) or not all(isinstance(st, DynamicShardState) for st in states):
        raise dynamic_error(
            shard, "states must be a list of DynamicShardState", ["pass [export_dynamic_state(shard)] per saving shard"]
        )
    if not states:
        raise dynamic_error(shard, "no export given", ["pass the export of every saving shard"])
    for st in states:
        check_dynamic_metadata(shard, st.metadata)
    steps = sorted({int(st.step) for st in states})
    if len(steps) != 1:
        raise dynamic_error(shard, f"the exports disagree on the optimizer step {steps}", ["re-save the table"])
    keys, weights, state, scores = concat_rows([_owned(shard, st) for st in states])
    admission = owned_admission(shard, [(st.admission_keys, st.admission_counts) for st in states])
    load_owned_rows(shard, keys, weights, state, scores, steps[0], max(int(st.metadata["clock"]) for st in states))
    shard.index.load_admission(*admission)


def load_dynamic_entries(shard: DynamicShardView, entry: Callable[[str], Any], owner: str) -> None:
    """Loads one export from ``state_dict`` entries ``entry(field)``; it must hold exactly this shard's keys
    (saved by the shard of the same key routing: ``owner`` names the entries in the refusal).

    Raises:
        TieredCheckpointError: an export of another key routing (naming ``recpipe.pipeline.checkpoint.load``),
            or what :func:`load_dynamic_states` refuses.
    """
    st = DynamicShardState.from_entries(entry)
    check_dynamic_metadata(shard, st.metadata)
    if not routes_keys_as(shard, st.metadata):
        md = st.metadata
        raise dynamic_error(
            shard,
            f"{owner} holds the keys of key shard {md['key_rank']} of {md['key_shards']} (routing seed "
            f"{md['key_routing_seed']}), not this shard's: the rest of the table's keys are in the other ranks' "
            "state dicts",
            [
                "load the checkpoint with recpipe.pipeline.checkpoint.load, which reads every saving rank's keys and "
                "keeps those each shard owns (any world size and sharding)",
                "load each rank's own state_dict() into the same rank of a model sharded alike",
            ],
        )
    load_dynamic_states(shard, [st])


def pop_dynamic_entries(shard: DynamicShardView, state_dict: Dict[str, Any], base: str) -> None:
    """Loads and removes a sharded collection's ``<base><field>`` entries of ``shard`` (``base``:
    ``<collection>.<table>.dynamic.``); none: the shard keeps its rows.

    Raises:
        ValueError: some fields are missing.
        TieredCheckpointError: what :func:`load_dynamic_entries` refuses.
    """
    present = [f for f in DYNAMIC_STATE_FIELDS if base + f in state_dict]
    if not present:
        return
    if len(present) != len(DYNAMIC_STATE_FIELDS):
        absent = [base + f for f in DYNAMIC_STATE_FIELDS if f not in present]
        raise ValueError(
            f"dynamic table {shard.table_name!r}: state_dict has {sorted(base + f for f in present)} but not "
            f"{absent}; pass the complete export written by state_dict()."
        )
    load_dynamic_entries(shard, lambda k: state_dict.pop(base + k, None), f"the state dict's {base}*")


def dynamic_entries_misfit(
    dynamic: Optional[bool], table: str, state_dict: Mapping[str, Any], base: str
) -> Optional[str]:
    """Why ``state_dict``'s entries of a table under ``base`` (``<collection>.<table>.``) do not fit it, or
    None: ``dynamic`` True, a dynamic table given a static tiered export (``tiered.*``); False, a
    static tiered table given a dynamic export (``dynamic.*``)."""
    kind = "tiered." if dynamic else f"{DYNAMIC_STATE_KEY}."
    found = sorted(k for k in state_dict if k.startswith(base + kind))
    if dynamic is None or not found:
        return None
    saved, here = ("a static tiered table (rows by id)", "dynamic") if dynamic else ("a dynamic table", "static")
    return (
        f"table {table!r} is {here} in this model, but the state dict holds it as {saved}: {found}. A "
        "dynamic table's rows are keyed by raw key, a static table's by row id: one cannot load the other. "
        "Possible solutions:\n  1. plan the table as it was saved (PlacementConstraints(dynamic=...) for a "
        "dynamic table, without it for a static one);\n  2. start the table from fresh rows: leave its entries "
        "out and load with strict=False."
    )
