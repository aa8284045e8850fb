"""What :class:`~recpipe.planner.planners.PlacementPlanner` checks of its stages (the extension points of
``recpipe.planner.types``): each argument's type at construction, the default enumerator's settings beside a
given enumerator, and what each stage returns, so a stage's mistake is refused naming it instead of surfacing
as a plan over budget or an index error."""

from __future__ import annotations

import itertools
import numbers
from dataclasses import fields
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from recpipe.pipeline.placement import CachePolicy
from recpipe.planner.communication import PLANNED_SHARDING_TYPES
from recpipe.planner.constraints import check_sharding_types
from recpipe.planner.errors import sized
from recpipe.planner.option_arrays import OptionArrays
from recpipe.planner.partitioners import Partition
from recpipe.planner.specs import DEFAULT_LOAD_FACTORS, STORAGE_BACKENDS, TableSpec
from recpipe.planner.types import CostModel, PlacementEnumerator, PlacementPartitioner, PlacementProposer

#: Each stage argument -> the method its protocol (``recpipe.planner.types``) requires and an instance.
_STAGES: Dict[str, Tuple[str, str, str]] = {
    "enumerator": (
        "PlacementEnumerator",
        "enumerate_arrays",
        "GridPlacementEnumerator(world_size, local_world_size, AnalyticCostModel())",
    ),
    "partitioner": ("PlacementPartitioner", "partition", "GreedyTableWisePartitioner()"),
    "proposer": ("PlacementProposer", "solve", "KnapsackProposer() or BruteForceProposer()"),
}


def check_stages(stages: Mapping[str, Any], bins: Optional[Tuple[int, int]]) -> None:
    """Refuses a stage (``enumerator``, ``partitioner``, ``proposer``) that is not an instance with its protocol's
    method (or None), and ``bins`` beside a given proposer (they size the default one only).

    Raises:
        ValueError: naming the argument and an instance that fits.
    """
    for name, value in stages.items():
        protocol, method, example = _STAGES[name]
        if value is not None and (isinstance(value, type) or not callable(getattr(value, method, None))):
            what = f"the class {value.__name__}" if isinstance(value, type) else f"{type(value).__name__} {value!r:.80}"
            raise ValueError(
                f"{name} must be a {protocol} instance (with {method}(...), recpipe.planner.types) or None, got "
                f"{what}: e.g. {example}."
            )
    proposer = stages.get("proposer")
    if proposer is not None and bins is not None:
        raise ValueError(
            f"bins={bins!r} and proposer={type(proposer).__name__}(...) were both given, but bins only sizes the "
            "default KnapsackProposer's grid and a given proposer ignores it: drop bins, or pass "
            f"proposer=KnapsackProposer(bins={bins!r}) instead of both."
        )


def check_enumerator_settings(
    enumerator: PlacementEnumerator, backend: str, cache_policy: CachePolicy, **settings: Any
) -> None:
    """Refuses the default enumerator's settings (``cost_model``, ``load_factors``, ``constraints``,
    ``sharding_types``, ``communication``) beside a given ``enumerator``, which lists and prices the options
    itself, and an enumerator sizing another layout than the plan records (``backend``, ``cache_policy``)."""
    defaults = {"load_factors": DEFAULT_LOAD_FACTORS, "sharding_types": PLANNED_SHARDING_TYPES, "constraints": {}}
    given = [
        name
        for name, value in settings.items()
        if value is not None
        and not (name == "load_factors" and tuple(float(x) for x in value) == defaults[name])
        and not (name == "sharding_types" and check_sharding_types(value) == defaults[name])
        and not (name == "constraints" and not value)
    ]
    kind = type(enumerator).__name__
    if given:
        raise ValueError(
            f"enumerator={kind}(...) was given together with {', '.join(given)}, which only configure the default "
            "GridPlacementEnumerator: a given enumerator lists and prices the options itself. Build it with them "
            "(e.g. GridPlacementEnumerator(world_size, local_world_size, cost_model, load_factors, constraints, "
            f"sharding_types=..., comm_model=...)), or drop {', '.join(given)}."
        )
    if backend not in STORAGE_BACKENDS:
        raise ValueError(f"backend must be one of {list(STORAGE_BACKENDS)} (or None), got {backend!r}.")
    for name, planned, value in (
        ("backend", backend, getattr(enumerator, "backend", backend)),
        ("cache_policy", cache_policy, CachePolicy.parse(getattr(enumerator, "cache_policy", cache_policy))),
    ):
        if value != planned:
            shown = getattr(value, "value", value)
            raise ValueError(
                f"enumerator={kind}(...) sizes tables for {name} {shown!r}, but the planner's {name} is "
                f"{getattr(planned, 'value', planned)!r}: the plan records the planner's. Pass {name}={shown!r} to "
                "the planner, or build the enumerator with the planner's."
            )


def cost_model_name(cost_model: Optional[CostModel], enumerator: PlacementEnumerator) -> str:
    """What the plan records as its cost model: the model's ``name``, else its class, else the enumerator's."""
    if cost_model is None:
        return type(enumerator).__name__
    return str(getattr(cost_model, "name", type(cost_model).__name__))


def checked_options(enumerator: PlacementEnumerator, options: Any, specs: Sequence[TableSpec]) -> OptionArrays:
    """``enumerator.enumerate_arrays(specs)``'s result, refused unless ``OptionArrays`` of one row per table,
    each with an option."""
    who = f"enumerator {type(enumerator).__name__}.enumerate_arrays({len(specs)} tables)"
    if not isinstance(options, OptionArrays):
        raise ValueError(f"{who} returned {type(options).__name__}; it must return OptionArrays, one row per table.")
    shape = options.cost.shape
    arrays = [np.shape(getattr(options, f.name)) for f in fields(OptionArrays)]
    if len(shape) != 2 or shape[0] != len(specs) or any(a != shape for a in arrays):
        raise ValueError(
            f"{who} returned arrays of shapes {sorted(set(arrays))}; every array must be (tables, options) = "
            f"({len(specs)}, K)."
        )
    none = np.flatnonzero(~(np.isfinite(options.cost) & (options.modes >= 0)).any(axis=1))
    if none.size:
        raise ValueError(
            f"{who} gave table {specs[int(none[0])].fqn!r} no option of finite cost ({none.size} such table(s)); "
            "it must give every table at least one, or raise a PlacementPlannerError naming why there is none."
        )
    return options


def checked_choice(
    proposer: PlacementProposer, got: Any, options: OptionArrays, cost: np.ndarray, H: int, D: int
) -> np.ndarray:
    """``proposer.solve``'s choice as int64, refused unless one option of finite cost per table within both
    budgets."""
    who = f"proposer {type(proposer).__name__}.solve"
    want = (
        "one option index per table (an int array of shape (tables,)) of finite cost, whose bytes sum within "
        "both budgets, or None when no combination fits"
    )
    M, K = cost.shape
    choice = np.asarray(got)
    if choice.shape != (M,) or (M and choice.dtype.kind not in "iu"):
        raise ValueError(
            f"{who} returned {type(got).__name__} of shape {choice.shape} and dtype {choice.dtype}; it must return {want}."
        )
    choice = choice.astype(np.int64)
    rows = np.arange(M)
    bad = np.flatnonzero((choice < 0) | (choice >= K))
    if not bad.size:
        bad = np.flatnonzero(~np.isfinite(cost[rows, choice]))
    if bad.size:
        raise ValueError(
            f"{who} picked option {int(choice[bad[0]])} for table {int(bad[0])}, which has no such option (or "
            f"an infinite cost) ({bad.size} such table(s)); it must return {want}."
        )
    hbm = int(options.hbm_bytes_per_rank[rows, choice].sum())
    ddr = int(options.ddr_bytes_per_machine[rows, choice].sum())
    if hbm > H or ddr > D:
        raise ValueError(
            f"{who} picked options needing {sized(hbm)} of HBM per rank and {sized(ddr)} of DDR per machine, over "
            f"the budgets {sized(H)} and {sized(D)}; it must return {want}."
        )
    return choice


def checked_partition(
    partitioner: PlacementPartitioner,
    got: Any,
    tables: Sequence[TableSpec],
    shards: np.ndarray,
    shard_bytes: Tuple[np.ndarray, np.ndarray],
    base: Tuple[int, int],
    budgets: Tuple[int, int],
    world_size: int,
    local_world_size: int,
) -> Partition:
    """``partitioner.partition``'s owners, refused unless each table has one rank in ``[0, world_size)`` per
    shard (or none: left unplaced) and every rank and machine stays within its budget; each rank's and machine's
    load is the larger of the one its owners imply and the one the partitioner reports."""
    who = f"partitioner {type(partitioner).__name__}.partition"
    want = f"it must return a Partition whose shard_owners hold one tuple of ranks per table ({len(tables)})"
    try:
        owners = [o if type(o) is tuple else tuple(o) for o in getattr(got, "shard_owners", None) or ()]
    except TypeError:
        raise ValueError(
            f"{who} returned shard_owners with an entry that is not a sequence of ranks; {want}."
        ) from None
    if len(owners) != len(tables):
        raise ValueError(f"{who} returned {type(got).__name__} with {len(owners)} shard owner entries; {want}.")
    ranks = list(itertools.chain.from_iterable(owners))
    if not all(type(r) is int for r in ranks):  # numpy ints become Python ints (the plan's JSON); others are refused
        owners = [tuple(int(r) if _is_rank(r, world_size) else -1 for r in o) for o in owners]
        ranks = list(itertools.chain.from_iterable(owners))
    lens = np.fromiter(map(len, owners), dtype=np.int64, count=len(owners))
    flat = np.array(ranks, dtype=np.int64)
    bad = (lens != 0) & (lens != shards)
    np.logical_or.at(bad, np.repeat(np.arange(len(owners)), lens), (flat < 0) | (flat >= world_size))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"{who} gave table {tables[i].fqn!r} the owners {getattr(got, 'shard_owners')[i]!r}; it must name one "
            f"rank (an int in [0, {world_size})) per shard ({int(shards[i])} here), or none to leave the table "
            "unplaced."
        )
    (H, D), L = budgets, local_world_size
    rank_bytes = np.full(world_size, int(base[0]), dtype=np.int64)
    machine_slow = np.full(world_size // L, int(base[1]), dtype=np.int64)
    if flat.size:
        np.add.at(rank_bytes, flat, np.repeat(np.asarray(shard_bytes[0], dtype=np.int64), lens))
        np.add.at(machine_slow, flat // L, np.repeat(np.asarray(shard_bytes[1], dtype=np.int64), lens))
    if rank_bytes.max() > H or machine_slow.max() > D:
        r, m = int(np.argmax(rank_bytes)), int(np.argmax(machine_slow))
        raise ValueError(
            f"{who} overfills rank {r} ({sized(int(rank_bytes[r]))} of fast tier, budget {sized(H)}) or machine "
            f"{m} ({sized(int(machine_slow[m]))} of slow tier, budget {sized(D)}); it must keep every rank and "
            "machine within its budget, leaving a table it cannot place without owners (the planner re-plans it)."
        )
    # a partitioner may report fuller ranks than its owners imply (bytes it keeps free): the repair honours that
    for name, ours in (("rank_bytes", rank_bytes), ("machine_slow_bytes", machine_slow)):
        reported = np.asarray(getattr(got, name, ours))
        if reported.shape != ours.shape or reported.dtype.kind not in "iuf":
            raise ValueError(
                f"{who} returned {name} of shape {reported.shape} and dtype {reported.dtype}; it must be "
                f"{ours.shape[0]} byte counts (one per {'rank' if name == 'rank_bytes' else 'machine'})."
            )
        np.maximum(ours, reported.astype(np.int64), out=ours)
    return Partition(shard_owners=owners, rank_bytes=rank_bytes, machine_slow_bytes=machine_slow)


def _is_rank(value: Any, world_size: int) -> bool:
    """Whether ``value`` is a rank of ``world_size`` (an int in ``[0, world_size)``, not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= int(value) < world_size


__all__ = [
    "check_enumerator_settings",
    "check_stages",
    "checked_choice",
    "checked_options",
    "checked_partition",
    "cost_model_name",
]
