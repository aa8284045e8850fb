"""Per-table and per-feature routing of a row-wise sharding, and the shard layouts it implies.

May import ``recpipe.pipeline.placement`` and routing modules only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

from torchrec.distributed.embedding_types import GroupedEmbeddingConfig

from recpipe.pipeline.placement import (
    FUSED_PARAM_DIST_TYPE,
    FUSED_PARAM_DYNAMIC,
    FUSED_PARAM_MODE,
    FUSED_PARAM_SEED,
    DistType,
    PlacementContractError,
    PlacementParams,
    check_int,
    local_rows,
)
from recpipe.pipeline.routing.rows import continuous_block_rows, shard_num_rows

__all__ = [
    "DIST_TYPE_KEY",
    "SEED_KEY",
    "FeatureRouting",
    "RoutingOverrides",
    "check_routed_layout",
    "feature_routing",
    "table_routing",
]

#: fused_params keys carrying a table's routing and seed (aliases of the placement contract's).
DIST_TYPE_KEY: str = FUSED_PARAM_DIST_TYPE
SEED_KEY: str = FUSED_PARAM_SEED


@dataclass(frozen=True)
class RoutingOverrides:
    """Routing chosen at the sharder (table name -> ``DistType``, hash seed) for tables without their own."""

    table_dist_types: Mapping[str, DistType] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.table_dist_types, Mapping):
            raise ValueError(
                f"recpipe: `table_dist_types` must be a dict of table name -> dist type, got "
                f"{type(self.table_dist_types).__name__} {self.table_dist_types!r}; e.g. {{'t0': 'hash_roundrobin'}}."
            )
        parsed: Dict[str, DistType] = {}
        for table, dt in self.table_dist_types.items():
            if not isinstance(table, str):
                raise ValueError(f"recpipe: `table_dist_types` keys must be table names (str), got {table!r}.")
            try:
                parsed[table] = DistType.parse(dt)
            except ValueError as e:
                raise ValueError(f"recpipe: `table_dist_types[{table!r}]`: {e}") from None
        object.__setattr__(self, "table_dist_types", parsed)
        object.__setattr__(self, "seed", check_int(self.seed, "seed", -(2**63), 2**63 - 1))


class FeatureRouting(NamedTuple):
    """Routing of a sharding's features (:func:`feature_routing`). ``row_bounds`` is None unless some continuous table
    is cut unevenly; then per feature the shard bounds of a continuous table (``[0, b, ..., W * b]`` if even) or ``[]``
    for a routed one. ``keep_keys`` is None unless some table is dynamic; then per feature whether its ids are raw
    keys kept as they are (a dynamic table: ``hash_roundrobin`` over the whole int64 range, table size 0)."""

    dist_types: List[str]
    table_sizes: List[int]
    seed: int
    row_bounds: Optional[List[List[int]]]
    keep_keys: Optional[List[bool]] = None


def feature_routing(
    grouped_configs: List[GroupedEmbeddingConfig], world_size: int, overrides: Optional[RoutingOverrides] = None
) -> FeatureRouting:
    """Per-feature routing in torchrec's feature order (groups, tables, features); a table's own fused
    params win over ``overrides``.

    Raises:
        ValueError: shards that do not match the routing, or hashed tables with different seeds.
    """
    dist_types: List[str] = []
    sizes: List[int] = []
    bounds: List[List[int]] = []
    uneven = False
    keep: List[bool] = []
    seeds: dict[int, str] = {}
    for table in (t for group in grouped_configs for t in group.embedding_tables):
        dt, table_seed = table_routing(table.fused_params, table.name, overrides)
        n = int(table.num_embeddings)
        cut: List[int] = []
        dynamic = (table.fused_params or {}).get(FUSED_PARAM_DYNAMIC) is not None
        keep.extend([dynamic] * table.num_features())
        if dynamic:
            if dt is not DistType.HASH_ROUNDROBIN:
                raise ValueError(
                    f"recpipe: dynamic table {table.name!r} is routed {dt.value}; raw keys are routed by "
                    "hash_roundrobin: plan it with dist_type='hash_roundrobin' (the planner's default)."
                )
            seeds.setdefault(table_seed, table.name)
            n = 0  # raw keys: the whole int64 range
        elif dt is DistType.CONTINUOUS:
            block = continuous_block_rows(n, world_size)
            table_cut = _uneven_bounds(table, n, world_size)
            uneven = uneven or table_cut is not None
            cut = table_cut if table_cut is not None else [block * r for r in range(world_size + 1)]
        else:
            check_routed_layout(table, n, world_size, dt)
            if dt is DistType.HASH_ROUNDROBIN:
                seeds.setdefault(table_seed, table.name)
        dist_types.extend([dt.value] * table.num_features())
        sizes.extend([n] * table.num_features())
        bounds.extend([list(cut)] * table.num_features())
    if len(seeds) > 1:
        raise ValueError(
            "recpipe: hash_roundrobin tables of one sharding must share one seed, got "
            f"{ {t: s for s, t in seeds.items()} }; give them the same `recpipe_seed`."
        )
    return FeatureRouting(
        dist_types, sizes, next(iter(seeds), 0), bounds if uneven else None, keep if any(keep) else None
    )


def table_routing(
    fused_params: Optional[Mapping[str, Any]], table_name: str, overrides: Optional[RoutingOverrides] = None
) -> Tuple[DistType, int]:
    """``(dist_type, seed)`` of one table. Fused params carrying a placement (``recpipe_mode``) are validated whole;
    otherwise the routing keys, filled from ``overrides``, default ``continuous`` with seed 0.

    Raises:
        PlacementContractError: a placement or routing key holds a bad value.
    """
    if fused_params is not None and not isinstance(fused_params, Mapping):
        raise ValueError(
            f"table {table_name!r}: fused_params must be a dict (or None), got "
            f"{type(fused_params).__name__} {fused_params!r}."
        )
    if overrides is not None and not isinstance(overrides, RoutingOverrides):
        raise ValueError(
            f"table {table_name!r}: overrides must be a RoutingOverrides (or None), got "
            f"{type(overrides).__name__}; e.g. RoutingOverrides(table_dist_types={{...}}, seed=0)."
        )
    params: Dict[str, Any] = dict(fused_params or {})
    if FUSED_PARAM_MODE in params:
        placed = PlacementParams.from_fused_params(params, table_name)
        return placed.dist_type, placed.seed
    if overrides is not None and table_name in overrides.table_dist_types:
        params.setdefault(FUSED_PARAM_DIST_TYPE, overrides.table_dist_types[table_name])
        params.setdefault(FUSED_PARAM_SEED, overrides.seed)
    try:
        dist_type = DistType.parse(params.get(FUSED_PARAM_DIST_TYPE, DistType.CONTINUOUS))
    except ValueError as e:
        raise PlacementContractError(f"table {table_name!r}: fused param {FUSED_PARAM_DIST_TYPE!r}: {e}") from None
    seed = params.get(FUSED_PARAM_SEED, 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise PlacementContractError(
            f"table {table_name!r}: fused param {FUSED_PARAM_SEED!r} must be an int, got {seed!r}."
        )
    return dist_type, int(seed)


def _row_shards(table: Any) -> Optional[Tuple[List[Any], List[int]]]:
    """A sharded table's shards in row order and their row counts; None without a global spec."""
    spec = getattr(table, "global_metadata", None)
    if spec is None:
        return None
    shards = sorted(spec.shards_metadata, key=lambda m: m.shard_offsets[0])
    return shards, [int(m.shard_sizes[0]) for m in shards]


def _uneven_bounds(table: Any, n: int, world_size: int) -> Optional[List[int]]:
    """Shard offsets and end of a continuous table its plan cuts unevenly (not ``ceil(N / W)`` blocks), else None."""
    row_shards = _row_shards(table)
    if row_shards is None:
        return None
    shards, sizes = row_shards
    if len(shards) != world_size or sizes == [
        shard_num_rows(n, world_size, r, "continuous") for r in range(world_size)
    ]:
        return None
    ranks = [m.placement.rank() if m.placement is not None else -1 for m in shards]
    if ranks != list(range(world_size)):
        raise ValueError(
            f"recpipe: table {table.name!r} has uneven row-wise shards held by ranks {ranks} in "
            f"row order; recpipe routes uneven shards to ranks 0..{world_size - 1} in row order. "
            "Possible solutions:\n  1) place shard r of the table on rank r, or\n"
            "  2) cut the table into torchrec's blocks of ceil(N / W) rows."
        )
    return [int(m.shard_offsets[0]) for m in shards] + [n]


def check_routed_layout(table: Any, n: int, world_size: int, dist_type: Union[DistType, str]) -> None:
    """roundrobin/hash routing puts ``ceil((N - r) / W)`` rows on rank ``r``."""
    row_shards = _row_shards(table)
    if row_shards is None:
        return
    got = row_shards[1]
    want = [local_rows(n, world_size, r) for r in range(world_size)]
    if got != want:
        raise ValueError(
            f"recpipe: table {table.name!r} is routed with {DistType.parse(dist_type).value!r}, which puts "
            f"{want} rows on ranks 0..{world_size - 1}, but its sharding plan has shards of "
            f"{got} rows (torchrec's contiguous blocks). Possible solutions:\n"
            "  1) build the plan with recpipe.planner (PlacementPlan.to_sharding_plan()), or\n"
            "  2) route this table with dist_type 'continuous'."
        )
