"""The planner's numeric range: byte sums, costs and sizes it cannot plan are refused by value.

* byte sums past the DP kernel's range (2^53) or past int64 are refused by size, not by a
  kernel RuntimeError nor a wrapped sum that "fits" (reference: an exhaustive search over
  Python-int bytes);
* a user cost model returning a wrong shape, nan, inf or a negative cost, and a cost of
  -inf, are named; an infinite topology size is refused;
* ``prune_dominated`` names a bad ``usable`` mask or ``cost``.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence

import numpy as np
import pytest
from torchrec.distributed.planner.types import Topology

from recpipe.planner import BruteForceProposer, KnapsackProposer, PlacementPlanner, TableSpec, make_topology
from recpipe.planner import knapsack as P

GiB = 2**30


def _exhaustive(hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, H: int, D: int) -> Optional[float]:
    """The cheapest plan's cost over every combination, bytes summed as Python ints (no wrap)."""
    rows = [
        [(int(hbm[i, j]), int(ddr[i, j]), float(cost[i, j])) for j in range(cost.shape[1]) if np.isfinite(cost[i, j])]
        for i in range(cost.shape[0])
    ]
    best: Optional[float] = None
    for combo in itertools.product(*rows):
        if sum(o[0] for o in combo) <= H and sum(o[1] for o in combo) <= D:
            c = sum(o[2] for o in combo)
            best = c if best is None or c < best else best
    return best


@pytest.mark.parametrize(
    "args, match",
    [
        ((None,), r"`usable` must be a bool array shaped like `cost` \(2, 3\).*got None; e\.g\. usable = np\.isfinite"),
        ((np.ones((2, 2), bool),), r"`usable` must be a bool array shaped like `cost` \(2, 3\).*shape \(2, 2\)"),
        ((np.ones((2, 3), int),), r"`usable` must be a bool array .*of dtype int64"),
    ],
)
def test_prune_dominated_names_a_bad_usable_mask(args: Sequence[Any], match: str) -> None:
    hbm = np.array([[1, 2, 3], [3, 2, 1]], dtype=np.int64)
    cost = np.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match=match):
        P.prune_dominated(hbm, hbm, cost, *args)  # before: TypeError / a numpy broadcast error
    with pytest.raises(ValueError, match=r"`cost` must be a float array without nan .*got None"):
        P.prune_dominated(hbm, hbm, None, np.ones((2, 3), bool))  # type: ignore[arg-type]
    # the check keeps the result: option 0 of table 0 dominates the others; table 1's options tie
    # on cost and trade HBM for nothing (ddr = hbm), so the leanest survives
    assert P.prune_dominated(hbm, hbm, cost, np.ones((2, 3), bool)).tolist() == [
        [True, False, False],
        [False, False, True],
    ]


@pytest.mark.parametrize(
    "rows, n, hbm_cap",
    [
        (2**55, 3, 2**70),  # 2^61 bytes per table: the options' int64 sum wrapped, then a kernel RuntimeError
        (2**50, 1, 2**56),  # one 2^56-byte table under a binding budget: the kernel's bare "< 2^53 bytes" error
        (2**46, 4, 2**70),  # each table below 2^53 bytes, together past it
    ],
)
def test_tables_past_the_planners_byte_range_are_refused_by_size(rows: int, n: int, hbm_cap: int) -> None:
    """Byte sums past 2^53 (the DP kernel's range) are refused by size, not by a kernel RuntimeError."""
    tables = [TableSpec(name=f"t{i}", rows=rows, dim=16, optimizer="sgd") for i in range(n)]
    planner = PlacementPlanner(
        make_topology(world_size=1, local_world_size=1, hbm_cap=hbm_cap, ddr_cap=2**70), backend="native"
    )
    opts = planner.enumerator.enumerate_arrays(tables)
    fits = np.isfinite(opts.cost) & (opts.hbm_bytes_per_rank <= planner.hbm_budget)
    # the independent reference: Python-int bytes of every table's largest option within the budget
    total = sum(max(int(h) for h, ok in zip(row, ok_row) if ok) for row, ok_row in zip(opts.hbm_bytes_per_rank, fits))
    assert total >= 2**53
    with pytest.raises(
        ValueError,
        match=rf"largest options need {total} bytes of HBM per device in all, at or "
        r"past 2\^53 bytes \(8 PiB\).*check the tables' sizes",
    ):
        planner.plan(tables)


def test_proposers_refuse_options_whose_int64_sums_would_wrap() -> None:
    """Brute force summed 4 options of 1.5 * 2^61 bytes in int64: the sum wrapped negative and
    the plan "fit" an HBM budget it is 1.5x over."""
    hbm = np.array([[3 * 2**60, 2**59]] * 4, dtype=np.int64)
    ddr = np.ones((4, 2), dtype=np.int64)
    cost = np.array([[1.0, 2.0]] * 4)
    H = 2**62 + 2**61
    assert _exhaustive(hbm, ddr, cost, H, 10) == 7.0  # one table at the big option at most
    for proposer in (BruteForceProposer(), KnapsackProposer(backend="numpy"), KnapsackProposer()):
        with pytest.raises(ValueError, match=r"largest options need 13835058055282163712 bytes of HBM per device"):
            proposer.solve(hbm, ddr, cost, H, 10)
    # just below the range, the same shape plans exactly (the sums stay far from int64's end)
    small = hbm // 2**12
    best = _exhaustive(small, ddr, cost, H // 2**12, 10)
    for proposer in (BruteForceProposer(), KnapsackProposer(backend="numpy"), KnapsackProposer()):
        choice = proposer.solve(small, ddr, cost, H // 2**12, 10)
        assert choice is not None and float(cost[np.arange(4), choice].sum()) == best


class _ListCostModel:
    """A user's cost model: the costs ``make(k)`` returns for ``k`` options."""

    name = "user"

    def __init__(self, make: Any) -> None:
        self.make = make

    def costs(self, table: TableSpec, options: Sequence[Any]) -> Any:
        return self.make(len(options))


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda k: np.ones(k - 1),
            r"returned shape \(18,\); it must return one finite cost >= 0",
        ),  # numpy broadcast error
        (
            lambda k: np.full(k, np.nan),
            r"returned nan for option 0 \(HYBRID, x=0\.1\)",
        ),  # a proposer error naming neither
        (lambda k: np.full(k, np.inf), r"returned inf for option 0"),  # "does not fit anywhere", blaming the budgets
        (lambda k: -np.ones(k), r"returned -1\.0 for option 0"),  # planned silently
        (lambda k: None, r"returned NoneType None"),
    ],
)
def test_a_user_cost_model_returning_bad_costs_is_named(make: Any, match: str) -> None:
    topo = make_topology(world_size=2, local_world_size=2, hbm_cap=GiB, ddr_cap=GiB)
    tables = [TableSpec(name="a", rows=1000, dim=4)]
    with pytest.raises(ValueError, match=r"^cost_model _ListCostModel\.costs\(table 'a', 19 options\) " + match):
        PlacementPlanner(topo, cost_model=_ListCostModel(make), backend="native").plan(tables)
    # one finite cost per option plans: every option costs the same, so the cheapest in HBM bytes
    # is not forced; the plan holds the table (the reference is the model's own cost, 1.0)
    plan = PlacementPlanner(topo, cost_model=_ListCostModel(lambda k: [1.0] * k), backend="native").plan(tables)
    (p,) = plan.placements
    assert p.lookup_cost == 1.0 and plan.total_cost == 1.0 + p.comm_cost  # the model's cost plus the network's


def test_proposers_refuse_a_cost_of_minus_inf() -> None:
    """-inf was taken for "no option" (as inf is): the cheapest option was dropped silently."""
    hbm = np.ones((2, 2), dtype=np.int64)
    cost = np.array([[-np.inf, 1.0], [1.0, 1.0]])
    for solve in (BruteForceProposer().solve, KnapsackProposer().solve, lambda *a: P.budget_prices(*a)):
        with pytest.raises(
            ValueError,
            match=r"`cost` holds -inf at \(table 0, option 0\): a cost is a finite number, "
            r"or inf to mark no option",
        ):
            solve(hbm, hbm, cost, 3, 3)


@pytest.mark.parametrize("key", ["hbm_cap", "ddr_cap"])
def test_an_infinite_topology_size_is_refused(key: str) -> None:
    """``make_topology(hbm_cap=math.inf)`` was accepted, and planning raised a bare
    ``OverflowError: cannot convert float infinity to integer``."""
    sizes = {"hbm_cap": GiB, "ddr_cap": GiB, key: float("inf")}
    with pytest.raises(ValueError, match=rf"^{key} must be a finite size in bytes, got inf"):
        make_topology(world_size=2, local_world_size=2, **sizes)
    topo = Topology(world_size=2, local_world_size=2, compute_device="cuda", **sizes)  # torchrec takes it
    name = {"hbm_cap": r"Topology hbm_cap \(HBM per device\)", "ddr_cap": r"Topology ddr_cap \(DDR per rank\)"}[key]
    with pytest.raises(ValueError, match=rf"^{name} must be a finite size in bytes, got inf"):
        PlacementPlanner(topo, backend="native")
