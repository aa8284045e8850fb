"""The pins and sharding types the default enumerator plans with: their checks, and the refusal of a table
they leave without any placement option (naming the cause and the fix)."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from torchrec.distributed.planner.constants import MIN_CW_DIM

from recpipe.planner.communication import PLANNED_SHARDING_TYPES
from recpipe.planner.errors import PlacementErrorType, PlacementPlannerError, PlannerInputError, solutions
from recpipe.planner.specs import PlacementConstraints, TableSpec
from recpipe.planner.torchrec_plan import column_shard_dim, column_shards

TABLE_WISE, ROW_WISE, COLUMN_WISE = PLANNED_SHARDING_TYPES


def sharding_types_flags(sharding_types: Sequence[str]) -> str:
    """How the command lines spell ``sharding_types``: the planner CLI's flag and the recipe's."""
    return (
        f"python -m recpipe.planner --sharding-types {' '.join(sharding_types)}; the recipe's --sharding-types "
        f"{','.join(sharding_types)}"
    )


def constraint_for(table: TableSpec, constraints: Mapping[str, PlacementConstraints]) -> Optional[PlacementConstraints]:
    """The pin of ``table``: keyed by its FQN, else by its name; None if it has none."""
    return constraints.get(table.fqn) or constraints.get(table.name)


def check_sharding_types(sharding_types: Any) -> Tuple[str, ...]:
    """``sharding_types`` as the planned sharding types it names, in ``PLANNED_SHARDING_TYPES`` order: any order
    and repeats are accepted (the planner plans a set), as is one comma-separated string; refused if empty or
    naming another type.

    Raises:
        ValueError: empty, not a list of names, or holding a name the planner does not plan.
    """
    choices = list(PLANNED_SHARDING_TYPES)
    if isinstance(sharding_types, str):
        sharding_types = [s.strip() for s in sharding_types.split(",") if s.strip()]
    if isinstance(sharding_types, bytes) or not isinstance(sharding_types, Sequence) or not sharding_types:
        raise ValueError(
            f"sharding_types must be a non-empty list of {choices} (any order), got {sharding_types!r}; "
            "e.g. ('table_wise', 'row_wise'), or ('row_wise',) for tiered row-wise tables only."
        )
    names = [getattr(s, "value", s) for s in sharding_types]
    unknown = [s for s in names if s not in PLANNED_SHARDING_TYPES]
    if unknown:
        raise ValueError(
            f"sharding_types holds {unknown}: the planner plans {choices} (torchrec ShardingType values, in any "
            "order); drop the others."
        )
    return tuple(s for s in PLANNED_SHARDING_TYPES if s in names)


def check_constraints(constraints: Optional[Mapping[Any, Any]], sharding_types: Sequence[str]) -> None:
    """Refuses pins that are not a table name -> ``PlacementConstraints`` map, and pins that ask for a sharding
    type ``sharding_types`` rules out (a dynamic table's: row- or table-wise; a pin never widens the planner-wide
    choice: both are the user's word, and one silently overriding the other hides a mistake).

    Raises:
        PlannerInputError: naming the pin, the sharding types and the fix.
    """
    for key, pin in (constraints or {}).items():
        if not isinstance(key, str) or not isinstance(pin, PlacementConstraints):
            example = (
                f"PlacementConstraints(**{pin!r})"
                if isinstance(pin, dict)
                else "PlacementConstraints(mode=Mode.CACHING)"
            )
            raise PlannerInputError(
                f"constraints[{key!r}] is a {type(pin).__name__} under a {type(key).__name__} key: constraints "
                "must map a table name or FQN (str) to a PlacementConstraints.\n"
                + solutions([f"write constraints={{{str(key)!r}: {example}}}."])
            )
        wanted = [pin.sharding_type] if pin.sharding_type is not None else []
        if pin.fused and pin.sharding_type is None:  # torchrec's FUSED table: table- or column-wise
            wanted = [TABLE_WISE, COLUMN_WISE]
        if pin.dynamic is not None and pin.sharding_type is None:  # a recpipe tiered table: row- or table-wise
            wanted = [ROW_WISE, TABLE_WISE]
        if wanted and not set(wanted) & set(sharding_types):
            what = (
                f"sharding_type={wanted[0]!r}"
                if pin.sharding_type is not None
                else "fused=True (table_wise or column_wise)"
                if pin.fused
                else "dynamic=DynamicTableOptions(...) (a tiered table: row_wise or table_wise)"
            )
            other = f"pin {key!r} to one of {list(sharding_types)}, or drop its {what.split(' ')[0]} pin"
            if pin.dynamic is not None and pin.sharding_type is None:
                other = f"drop the dynamic pin of {key!r} (a static table may be torchrec's FUSED one)"
            widened = tuple(s for s in PLANNED_SHARDING_TYPES if s in sharding_types or s == wanted[0])
            raise PlannerInputError(
                f"constraints[{key!r}] pins {what}, but sharding_types {list(sharding_types)} rules it out: the "
                "planner plans only the sharding types sharding_types allows, and a pin does not widen them.\n"
                + solutions(
                    [
                        f"add {wanted[0]!r} to sharding_types: sharding_types={widened} "
                        f"({sharding_types_flags(widened)})",
                        other,
                    ]
                )
            )


def check_constraint_keys(constraints: Mapping[str, PlacementConstraints], tables: Sequence[TableSpec]) -> None:
    """Refuses pins naming no table of ``tables``, and a bare name two tables share (it would pin both).

    Raises:
        PlacementPlannerError: ``INPUT_VALIDATION``, naming the keys and the tables' full names.
    """
    unknown = set(constraints) - {t.name for t in tables} - {t.fqn for t in tables}
    if unknown:
        raise PlacementPlannerError(
            f"constraints name tables that are not in the model: {sorted(unknown)}.\n"
            f"Possible solutions:\n  1) key constraints by one of {[t.fqn for t in tables][:20]}.",
            PlacementErrorType.INPUT_VALIDATION,
        )
    by_name: Dict[str, List[str]] = {}
    for t in tables:
        by_name.setdefault(t.name, []).append(t.fqn)
    fqns = {t.fqn for t in tables}
    for key in constraints:  # O(tables + constraints): every table may be pinned
        pinned = [key] if key in fqns else []
        pinned += [f for f in by_name.get(key, []) if f != key and f not in constraints]
        if len(pinned) > 1:
            names = ", ".join(map(repr, pinned))
            fix = f"key the constraint by each table's full name (module path + '.' + table): {names}."
            raise PlacementPlannerError(
                f"constraints[{key!r}] is ambiguous: the name {key!r} matches {len(pinned)} tables {pinned}.\n"
                + solutions([fix]),
                PlacementErrorType.INPUT_VALIDATION,
            )


def column_split_text(dim: int) -> Tuple[str, str]:
    """Why a table of width ``dim`` has no column shards, and the nearest widths that have (torchrec's default
    block, :func:`column_shard_dim`), as ``(cause, "a width that splits, e.g. ...")``."""
    divisors = [d for d in range(MIN_CW_DIM, dim + 1) if dim % d == 0]
    below = next((d for d in range(dim - 1, 2 * MIN_CW_DIM - 1, -1) if column_shards(d) > 1), None)
    above = next(d for d in range(max(dim + 1, 2 * MIN_CW_DIM), 4 * dim + 4 * MIN_CW_DIM) if column_shards(d) > 1)
    near = [d for d in (below, above) if d is not None]
    cause = (
        f"column_wise splits a table into column shards whose width is the smallest divisor of dim that is "
        f">= {MIN_CW_DIM}, a multiple of 4 and below dim (torchrec's default block), and dim {dim} has none "
        f"(its divisors >= {MIN_CW_DIM}: {divisors})"
    )
    widths = " or ".join(f"{d} ({d // column_shard_dim(d)} x {column_shard_dim(d)})" for d in near)
    return cause, f"a width that splits, e.g. dim {widths}"


def no_option_error(
    table: TableSpec,
    pin: PlacementConstraints,
    sharding_types: Sequence[str],
    world_size: int,
    fused_blocks: Sequence[Tuple[str, str]],
    count: int,
) -> PlacementPlannerError:
    """The refusal of ``table``, which its pin and ``sharding_types`` leave only torchrec's FUSED table options
    (column-wise, or ``fused=True``) and none of those.

    Args:
        fused_blocks: ``(cause, fix)`` of each reason the FUSED table cannot hold ``table`` (its x grid, its
            optimizer on the backend).
        count: tables without an option (this one the first).
    """
    fixes: List[str] = []
    if pin.sharding_type == COLUMN_WISE or pin.fused:
        only = "sharding_type='column_wise'" if pin.sharding_type == COLUMN_WISE else "fused=True"
        allows = f"its pin {only} allows only torchrec's FUSED table"
        fixes.append(
            f"pin {table.fqn!r} to sharding_type 'table_wise' or 'row_wise' (a recpipe tiered table, which takes "
            f"any dim, optimizer and x), or drop its {only} pin"
        )
    else:
        allows = f"sharding_types {list(sharding_types)} allows only column_wise (torchrec's FUSED table)"
        fixes.append(
            "widen sharding_types with 'table_wise' and/or 'row_wise' (recpipe tiered tables, which take any "
            f"dim, optimizer and x): sharding_types={PLANNED_SHARDING_TYPES} "
            f"({sharding_types_flags(PLANNED_SHARDING_TYPES)})"
        )
    causes = [cause for cause, _ in fused_blocks]
    fixes += [fix for _, fix in fused_blocks]
    if pin.sharding_type == COLUMN_WISE or (COLUMN_WISE in sharding_types and pin.sharding_type is None):
        if column_shards(table.dim) < 2:
            cause, widths = column_split_text(table.dim)
            causes.append(cause)
            fixes.append(f"give {table.fqn!r} {widths}")
        elif world_size < 2:
            causes.append("column_wise needs more than one rank for its shards, and world_size is 1")
            fixes.append("plan over more than one rank")
    return PlacementPlannerError(
        f"table {table.fqn!r} (dim {table.dim}) has no placement option ({count} such table(s)): {allows}, and "
        f"{'; '.join(causes)}.\n" + solutions(fixes),
        PlacementErrorType.INPUT_VALIDATION,
    )


__all__ = [
    "COLUMN_WISE",
    "ROW_WISE",
    "TABLE_WISE",
    "check_constraint_keys",
    "check_constraints",
    "check_sharding_types",
    "column_split_text",
    "constraint_for",
    "no_option_error",
    "sharding_types_flags",
]
