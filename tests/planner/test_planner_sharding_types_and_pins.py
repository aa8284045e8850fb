"""How ``sharding_types`` and a pinned sharding type meet: a pin the sharding types rule out is refused naming
both; ``sharding_types`` is a set (any order, repeats); a table they leave no option is refused with the fix
that applies (widen ``sharding_types`` when nothing is pinned) and, for a width without column shards, the
rule torchrec's column block follows.

References are independent: the column-block rule written out by brute force over divisors, and each
message's suggested fix applied, which must then plan.
"""

from __future__ import annotations

import ast
import re
from typing import Any, List

import pytest
from harness.planner_reference import planner as make_planner

from recpipe.planner import PlacementConstraints, PlacementPlannerError, PlannerInputError, TableSpec
from recpipe.planner.torchrec_plan import column_shards


def _tables(*dims: int, optimizer: str = "sgd") -> List[TableSpec]:
    return [
        TableSpec(name=f"t{i}", rows=1000, dim=d, optimizer=optimizer, lookups_per_step=64.0)
        for i, d in enumerate(dims)
    ]


def _splits(dim: int) -> bool:
    """The column-block rule by brute force: a divisor of ``dim`` that is >= 128, a multiple of 4 and below dim."""
    return any(dim % d == 0 and d % 4 == 0 for d in range(128, dim))


# ------------------------------------------------------------------ a pin outside sharding_types
@pytest.mark.parametrize(
    "pin, allowed, wanted",
    [
        (PlacementConstraints(sharding_type="table_wise"), ("row_wise",), "table_wise"),
        (PlacementConstraints(sharding_type="row_wise"), ("table_wise", "column_wise"), "row_wise"),
        (PlacementConstraints(sharding_type="column_wise"), ("table_wise",), "column_wise"),
        (PlacementConstraints(fused=True), ("row_wise",), "table_wise"),
    ],
)
def test_a_pin_the_sharding_types_rule_out_is_refused_naming_both(pin: Any, allowed: tuple, wanted: str) -> None:
    with pytest.raises(PlannerInputError) as info:
        make_planner(2, hbm=2**40, constraints={"t0": pin}, sharding_types=allowed)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert msg.startswith("constraints['t0'] pins ")
    assert f"but sharding_types {list(allowed)} rules it out" in msg
    assert f"add {wanted!r} to sharding_types" in msg and "--sharding-types" in msg
    # the first fix, applied, plans and the pin holds
    widened = re.search(r"sharding_types=(\([^)]*\))", msg).group(1)  # type: ignore[union-attr]
    planner = make_planner(2, hbm=2**40, constraints={"t0": pin}, sharding_types=ast.literal_eval(widened))
    got = planner.plan(_tables(256, 16)).placement("t0")
    if pin.sharding_type is not None:
        assert got.sharding_type == wanted
    else:
        assert got.fused and got.sharding_type in ("table_wise", "column_wise")


def test_a_pin_within_the_sharding_types_chooses_among_them() -> None:
    pins = {"t0": PlacementConstraints(sharding_type="table_wise")}
    plan = make_planner(2, hbm=2**40, constraints=pins, sharding_types=("row_wise", "table_wise")).plan(_tables(16, 16))
    assert plan.placement("t0").sharding_type == "table_wise"
    assert plan.placement("t1").sharding_type in ("row_wise", "table_wise")


# ------------------------------------------------------------------ sharding_types is a set
def test_sharding_types_in_any_order_or_repeated_plan_alike() -> None:
    tables = _tables(16, 256, 64)
    ref = make_planner(2, hbm=2**40, sharding_types=("table_wise", "row_wise")).plan(tables)
    assert {p.sharding_type for p in ref.placements} <= {"table_wise", "row_wise"}
    for given in (("row_wise", "table_wise"), ("row_wise", "row_wise", "table_wise"), "row_wise, table_wise"):
        planner = make_planner(2, hbm=2**40, sharding_types=given)
        assert planner.sharding_types == ("table_wise", "row_wise")
        assert planner.plan(tables).to_dict() == ref.to_dict()


@pytest.mark.parametrize(
    "given, match",
    [
        (("row_wise", "data_parallel"), r"sharding_types holds \['data_parallel'\]: the planner plans"),
        (("table_row_wise", "table_wise"), r"sharding_types holds \['table_row_wise'\]"),
        ((), r"sharding_types must be a non-empty list"),
        (" , ", r"sharding_types must be a non-empty list"),
    ],
)
def test_sharding_types_refuses_only_unknown_names_or_none(given: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_planner(2, hbm=2**40, sharding_types=given)


# ------------------------------------------------------------------ no option: the fix that applies
def test_column_wise_only_without_a_pin_suggests_widening_sharding_types_not_dropping_a_pin() -> None:
    tables = _tables(300, 512)
    with pytest.raises(PlacementPlannerError) as info:
        make_planner(2, hbm=2**40, sharding_types=("column_wise",)).plan(tables)
    msg = str(info.value)
    assert msg.startswith("table 't0' (dim 300) has no placement option")
    assert "pin" not in msg.split("Possible solutions:")[1]
    assert "widen sharding_types with 'table_wise' and/or 'row_wise'" in msg and "--sharding-types" in msg
    plan = make_planner(2, hbm=2**40, sharding_types=("column_wise", "table_wise", "row_wise")).plan(tables)
    assert plan.placement("t1").sharding_type in ("column_wise", "table_wise", "row_wise")


def test_a_column_wise_pin_that_cannot_hold_suggests_changing_the_pin() -> None:
    pins = {"t0": PlacementConstraints(sharding_type="column_wise")}
    with pytest.raises(
        PlacementPlannerError, match=r"(?s)its pin sharding_type='column_wise'.*1\) pin 't0' to sharding_type"
    ):
        make_planner(2, hbm=2**40, constraints=pins).plan(_tables(300))


def test_column_wise_only_that_does_not_fit_suggests_widening_not_smaller_load_factors() -> None:
    # torchrec's FUSED table keeps every row in HBM: smaller load factors cannot help, a tiered type can
    tables = _tables(512)
    hbm = 300_000  # below one 256-column shard (1000 rows x 1 KiB), above a tiered table at x = 0.1 over 2 ranks
    with pytest.raises(PlacementPlannerError) as info:
        make_planner(2, hbm=hbm, sharding_types=("column_wise",)).plan(tables)
    fixes = str(info.value).split("Possible solutions:")[1]
    assert "load factors" not in fixes and "load_factors" not in fixes
    assert "widen sharding_types (now ['column_wise']) with 'table_wise' and/or 'row_wise'" in fixes
    widened = make_planner(2, hbm=hbm, sharding_types=("table_wise", "row_wise", "column_wise")).plan(tables)
    assert widened.hbm_bytes_per_rank <= hbm


@pytest.mark.parametrize("dim", [300, 200, 260, 1002])
def test_a_width_without_column_shards_is_refused_stating_the_real_rule(dim: int) -> None:
    assert not _splits(dim) and column_shards(dim) == 1
    with pytest.raises(PlacementPlannerError) as info:
        make_planner(2, hbm=2**40, sharding_types=("column_wise",)).plan(_tables(dim))
    msg = str(info.value)
    assert ">= 2 shards of >= 128 columns" not in msg  # a rule dim 300 (2 x 150) seems to meet, and does not
    assert "the smallest divisor of dim that is >= 128, a multiple of 4 and below dim" in msg
    divisors = [d for d in range(128, dim + 1) if dim % d == 0]
    assert f"dim {dim} has none (its divisors >= 128: {divisors})" in msg
    # the widths it suggests split, and none nearer does
    suggested = [int(w) for w in re.findall(r"(\d+) \(\d+ x \d+\)", msg)]
    assert suggested and all(_splits(w) for w in suggested)
    below = [w for w in suggested if w < dim]
    above = [w for w in suggested if w > dim]
    assert len(above) == 1 and not any(_splits(w) for w in range(dim + 1, above[0]))
    assert not below or not any(_splits(w) for w in range(below[0] + 1, dim))
    assert bool(below) == any(_splits(w) for w in range(256, dim))


def test_the_stated_column_rule_is_the_one_the_planner_follows() -> None:
    assert [d for d in range(1, 2049) if column_shards(d) > 1] == [d for d in range(1, 2049) if _splits(d)]
