"""Dynamic tables in a recpipe DCP checkpoint: their kinds checked, their rows loaded by raw key.

``save`` writes each key shard's rows of a dynamic table under its own keys
``dynamic.<table fqn>.rank<r>.{keys,weights,optimizer_state,scores,step,metadata}`` and its admission
counters ``...rank<r>.{admission_keys,admission_counts}``
(``layout.dynamic_dcp_key``; ``r`` the key shard: row-wise the rank, table-wise 0), so every rank
writes tensors of its own row count. A load works at any world size and sharding (row-wise <->
table-wise): every loading shard reads every saving shard's keys and scores
(:func:`plan_dynamic_load`), keeps those its raw-key routing owns (``DynamicEmbeddingShard.owned``),
then reads their rows and optimizer state (:func:`load_dynamic_table`), restoring the optimizer step,
the lru clock (the saving shards' maximum) and the admission counters it owns (a checkpoint without
them loads with none). Refused on every rank, before anything is loaded: a
table dynamic on one side and static tiered or torchrec on the other, another embedding dim, dtype,
optimizer or eviction, repeated keys, and keys the loading capacity cannot hold under
``on_full='error'``; NaN / inf rows are refused by :func:`check_dynamic_table` (or while loading).
Imports ``checkpoint.{checkpoint_errors, collectives, layout}`` and ``tiered``.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from recpipe.pipeline.checkpoint.checkpoint_errors import CheckpointTableError
from recpipe.pipeline.checkpoint.collectives import all_gather, raise_first_refusal, rank_world, refusals
from recpipe.pipeline.checkpoint.layout import (
    DYNAMIC_DCP_PREFIX,
    DYNAMIC_FIELDS,
    DYNAMIC_KEY,
    DYNAMIC_OPTIONAL_FIELDS,
    TIERED_KEY,
    Source,
    dynamic_dcp_key,
    read_here,
    weight_key,
)
from recpipe.pipeline.tiered.dynamic.dynamic_shard import DynamicEmbeddingShard
from recpipe.pipeline.tiered.dynamic.dynamic_state import (
    check_dynamic_metadata,
    check_dynamic_rows,
    check_dynamic_shapes,
    concat_rows,
    dropped_at_load,
    dynamic_error,
    load_owned_rows,
    owned_admission,
    repeated_keys,
    routes_keys_as,
)
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard

__all__ = ["DynamicLoad", "check_dynamic_table", "load_dynamic_table", "plan_dynamic_load", "saved_dynamic_ranks"]

_KIND_FIXES: str = (
    ". Nothing was loaded: the model is unchanged. Possible solutions:\n"
    "  1. plan every table as the saving job did: a table saved dynamic with PlacementConstraints(dynamic=...) "
    "(any world size, sharding and capacity), a static one without it\n"
    "  2. a module or table was renamed: load with the names it was saved under\n"
    "  3. pass strict=False to leave out the tables one side lacks entirely (they keep their rows)\n"
    "  4. start from fresh tables instead of this checkpoint"
)


class DynamicLoad(NamedTuple):
    """What a load reads into one dynamic shard, checked while planning: the saving shards' ``heads``
    (key shard -> ``{"metadata", "step", "fields"}``), the saving shards it reads and, of each, the positions of
    the keys this shard owns (``owned``); those ``keys`` and ``scores`` (saving shard order, then slot
    order), the optimizer ``step`` and the lru ``clock`` it restores, and the admission counters
    (``admission_keys``, ``admission_counts``) it owns."""

    shard: DynamicEmbeddingShard
    heads: Dict[int, Dict[str, Any]]
    owned: Dict[int, torch.Tensor]
    keys: torch.Tensor
    scores: torch.Tensor
    step: int
    clock: int
    admission_keys: torch.Tensor
    admission_counts: torch.Tensor


def saved_dynamic_ranks(metadata: Metadata, table_fqn: str) -> Dict[int, List[str]]:
    """Saving key shards of a dynamic table in the checkpoint -> the fields present."""
    head = f"{DYNAMIC_DCP_PREFIX}.{table_fqn}.rank"
    ranks: Dict[int, List[str]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith(head):
            rank, _, field = key[len(head) :].partition(".")
            if rank.isdigit() and field in DYNAMIC_FIELDS + DYNAMIC_OPTIONAL_FIELDS:
                ranks.setdefault(int(rank), []).append(field)
    return ranks


def _tensor_md(src: Source, key: str) -> TensorStorageMetadata:
    md = src.metadata.state_dict_metadata[key]
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointTableError(
            f"{src.where}: {key} is not a tensor; the checkpoint was not written by "
            "recpipe.pipeline.checkpoint.save (or was edited): re-save it."
        )
    return md


def _read(src: Source, table_fqn: str, rank: int, fields: Sequence[str]) -> Dict[str, Any]:
    """Reads fields of one saving key shard's rows of a dynamic table (this process only)."""
    state: Dict[str, Any] = {}
    for field in fields:
        key = dynamic_dcp_key(table_fqn, rank, field)
        if field == "metadata":
            state[key] = ""
        else:
            md = _tensor_md(src, key)
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    read_here(state, src)
    out = {field: state[dynamic_dcp_key(table_fqn, rank, field)] for field in fields}
    if "metadata" in out:
        out["metadata"] = json.loads(out["metadata"])
    if "step" in out:
        out["step"] = int(out["step"])
    return out


def _kind_problems(
    src: Source,
    state: Dict[str, Any],
    dynamic: Dict[str, DynamicEmbeddingShard],
    static: Dict[str, TieredEmbeddingShard],
    dynamic_anywhere: Sequence[str],
    strict: bool,
) -> Tuple[List[str], List[str]]:
    """This rank's refusals of tables whose kind differs between the checkpoint and the model, and its
    dynamic tables the checkpoint lacks entirely (without ``strict``: they keep their rows)."""
    metadata, where = src.metadata.state_dict_metadata, src.where
    saved = {m.group(1) for key in metadata if (m := DYNAMIC_KEY.match(key))}
    saved_static = {m.group(1) for key in metadata if (m := TIERED_KEY.match(key))}
    problems: List[str] = []
    absent: List[str] = []
    for fqn in sorted(set(dynamic) - saved):
        key = weight_key(fqn, state)
        weight = metadata.get(key) if key is not None else None
        if fqn in saved_static:
            problems.append(f"table {fqn!r} is dynamic in this model, but {where} holds it as a static tiered table")
        elif isinstance(weight, TensorStorageMetadata) and len(weight.size) == 2 and weight.size.numel():
            problems.append(
                f"table {fqn!r} is dynamic in this model, but {where} holds it as a torchrec table "
                f"({list(weight.size)})"
            )
        elif strict:
            problems.append(f"table {fqn!r} is dynamic in this model, but {where} holds no rows of it")
        else:
            absent.append(fqn)
    for fqn in sorted(saved - set(dynamic_anywhere)):
        if fqn in static:
            problems.append(f"table {fqn!r} was saved dynamic, but this model plans it as a static tiered table")
        elif weight_key(fqn, state) is not None:
            problems.append(f"table {fqn!r} was saved dynamic, but this model does not plan it dynamic")
        elif strict:
            problems.append(f"{where} holds dynamic table {fqn!r}, which this model does not have")
    return problems, absent


def _check_saved_shards(src: Source, shard: DynamicEmbeddingShard, fqn: str) -> Dict[int, Dict[str, Any]]:
    """Reads and checks every saving key shard's metadata and step; returns them by key shard, each with the
    ``fields`` it saved."""
    where = src.where
    ranks = saved_dynamic_ranks(src.metadata, fqn)
    incomplete = {r: sorted(set(DYNAMIC_FIELDS) - set(f)) for r, f in ranks.items() if set(DYNAMIC_FIELDS) - set(f)}
    if incomplete:
        raise CheckpointTableError(
            f"{where}: dynamic table {fqn!r}: key shards lack fields {incomplete} (key shard: missing fields); "
            "the checkpoint is incomplete: re-save it with recpipe.pipeline.checkpoint.save."
        )
    heads = {r: {**_read(src, fqn, r, ("metadata", "step")), "fields": ranks[r]} for r in sorted(ranks)}
    for head in heads.values():
        check_dynamic_metadata(shard, head["metadata"])
    shards = {int(h["metadata"]["key_shards"]) for h in heads.values()}
    steps = {h["step"] for h in heads.values()}
    mislabeled = [r for r, h in heads.items() if int(h["metadata"]["key_rank"]) != r]
    if mislabeled or len(shards) != 1 or sorted(heads) != list(range(shards.pop())) or len(steps) != 1:
        raise CheckpointTableError(
            f"{where}: dynamic table {fqn!r}: its saving key shards disagree: key shards {sorted(heads)}, each "
            f"saved as one of {sorted({int(h['metadata']['key_shards']) for h in heads.values()})} (mislabeled: "
            f"{mislabeled}), optimizer steps {sorted(steps)}; the checkpoint is incomplete or mixes saves: "
            "re-save it into an empty directory."
        )
    for r in heads:
        md = [_tensor_md(src, dynamic_dcp_key(fqn, r, f)) for f in ("keys", "weights", "optimizer_state", "scores")]
        check_dynamic_shapes(shard, *(torch.empty(m.size, dtype=m.properties.dtype, device="meta") for m in md))
    return heads


def _plan_table(src: Source, shard: DynamicEmbeddingShard, fqn: str) -> DynamicLoad:
    """Reads every saving key shard's keys and scores; keeps those ``shard`` owns; refuses repeated
    keys and keys its capacity cannot hold under ``on_full='error'``."""
    heads = _check_saved_shards(src, shard, fqn)
    # the saving job's shard of this key routing holds exactly this shard's keys: only its rows are read
    alike = [r for r, h in heads.items() if routes_keys_as(shard, h["metadata"])]
    owned: Dict[int, torch.Tensor] = {}
    keys: List[torch.Tensor] = []
    scores: List[torch.Tensor] = []
    readers = alike[:1] or sorted(heads)
    for r in readers:
        saved = _read(src, fqn, r, ("keys", "scores"))
        owned[r] = shard.owned(saved["keys"]).cpu().nonzero().squeeze(1)
        keys.append(saved["keys"].index_select(0, owned[r]))
        scores.append(saved["scores"].index_select(0, owned[r]))
    mine, mine_scores = torch.cat(keys), torch.cat(scores)
    repeated = repeated_keys(mine)
    if repeated.numel():
        raise dynamic_error(
            shard,
            f"{repeated.numel()} of the keys it would load from {src.where} appear more than once "
            f"(e.g. {repeated[:5].tolist()})",
            ["the checkpoint mixes saves or was edited: re-save it into an empty directory"],
        )
    dropped_at_load(shard, mine, mine_scores)
    clock = max(int(h["metadata"]["clock"]) for h in heads.values())
    admission = owned_admission(shard, [_saved_admission(src, fqn, r, heads[r]["fields"]) for r in readers])
    return DynamicLoad(shard, heads, owned, mine, mine_scores, heads[min(heads)]["step"], clock, *admission)


def _saved_admission(src: Source, fqn: str, rank: int, fields: Sequence[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Saving key shard ``rank``'s ``(admission_keys, admission_counts)`` (it saved ``fields``); empty when it
    saved none."""
    if not set(DYNAMIC_OPTIONAL_FIELDS) <= set(fields):
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    got = _read(src, fqn, rank, DYNAMIC_OPTIONAL_FIELDS)
    return got["admission_keys"], got["admission_counts"]


def plan_dynamic_load(
    src: Source,
    state: Dict[str, Any],
    tiered: Dict[str, TieredEmbeddingShard],
    strict: bool,
    process_group: Optional[dist.ProcessGroup],
) -> Dict[str, DynamicLoad]:
    """Takes this rank's dynamic shards out of ``tiered`` (``{fqn: shard}`` of its tiered tables) and
    checks the checkpoint against them on every rank, reading keys and scores but no row.

    Returns:
        ``{fqn: DynamicLoad}`` of this rank's dynamic tables the checkpoint holds (without ``strict``,
        those it lacks entirely keep their rows).

    Raises:
        CheckpointTableError: on every rank, a table dynamic on one side only (or, with ``strict``, a
            dynamic table one side lacks), or what a shard refuses of its saved keys.
    """
    dynamic = {fqn: s for fqn, s in tiered.items() if isinstance(s, DynamicEmbeddingShard)}
    for fqn in dynamic:
        del tiered[fqn]
    world = rank_world(process_group)[1]
    anywhere = sorted({fqn for part in all_gather(sorted(dynamic), world, process_group) for fqn in part})
    problems, absent = _kind_problems(src, state, dynamic, tiered, anywhere, strict)
    everyone = sorted({p for part in all_gather(problems, world, process_group) for p in part})
    if everyone:
        raise CheckpointTableError(
            f"{src.where} does not fit this model's dynamic tables: " + "; ".join(everyone) + _KIND_FIXES
        )
    loads: Dict[str, DynamicLoad] = {}

    def plan() -> None:
        loads.update({fqn: _plan_table(src, shard, fqn) for fqn, shard in dynamic.items() if fqn not in absent})

    raise_first_refusal(refusals(plan, process_group), process_group)
    return loads


def _owned_rows(
    load: DynamicLoad, src: Source, fqn: str
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keys, weights, optimizer state, scores)`` of the keys ``load.shard`` owns, read from every
    saving key shard it reads (one at a time)."""
    fields = ("keys", "weights", "optimizer_state", "scores")
    parts: List[List[torch.Tensor]] = []
    for r, sel in load.owned.items():
        saved = _read(src, fqn, r, fields)
        parts.append([saved[f].index_select(0, sel) for f in fields])
    return concat_rows(parts)


@torch.no_grad()
def check_dynamic_table(load: DynamicLoad, src: Source, fqn: str) -> None:
    """Refuses, keeping nothing, what :func:`load_dynamic_table` would refuse of the rows it reads (NaN /
    inf values or state, repeated keys, another shape).

    Raises:
        TieredCheckpointError: naming the table, the problem and the fix.
    """
    check_dynamic_rows(load.shard, *_owned_rows(load, src, fqn))


@torch.no_grad()
def load_dynamic_table(load: DynamicLoad, src: Source, fqn: str) -> None:
    """Replaces ``load.shard``'s keys by the keys it owns of the checkpoint, with their rows, optimizer
    state and scores, the optimizer step and the lru clock; keys its capacity cannot hold follow its
    ``on_full`` (each bucket keeps its keys of highest score).

    Raises:
        TieredCheckpointError: rows that changed since :func:`plan_dynamic_load` (NaN / inf, repeated keys,
            another shape), naming the table.
    """
    keys, weights, state, scores = _owned_rows(load, src, fqn)
    load_owned_rows(load.shard, keys, weights, state, scores, load.step, load.clock)
    load.shard.index.load_admission(load.admission_keys, load.admission_counts)
