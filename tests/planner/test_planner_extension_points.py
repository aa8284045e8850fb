"""The planner's four extension points (``recpipe.planner.types``): a toy enumerator, partitioner, cost model
and proposer, each plugged into ``PlacementPlanner``, decide the plan; bad ones are refused naming the argument.

References are independent of the stage under test: the byte formula of a tiered shard
(``shard_storage``), the toy's own rule evaluated by hand, and the default planner's plan, which each toy
must change.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch

from recpipe.planner import (
    AnalyticCostModel,
    CostModel,
    GridPlacementEnumerator,
    KnapsackProposer,
    Mode,
    PlacementConstraints,
    PlacementEnumerator,
    PlacementPartitioner,
    PlacementPlanner,
    PlacementProposer,
    TableSpec,
    make_topology,
    max_local_rows,
    shard_storage,
)
from recpipe.planner.option_arrays import OptionArrays
from recpipe.planner.partitioners import GreedyTableWisePartitioner, Partition

WORLD = 4


def _topology(hbm: int = 2**40, world: int = WORLD) -> Any:
    return make_topology(world_size=world, local_world_size=world, hbm_cap=hbm, ddr_cap=2**40)


def _tables(n: int = 4, rows: int = 1000, dim: int = 16) -> List[TableSpec]:
    return [TableSpec(name=f"t{i}", rows=rows, dim=dim, optimizer="sgd", lookups_per_step=64.0) for i in range(n)]


def _planner(hbm: int = 2**40, **kwargs: Any) -> PlacementPlanner:
    return PlacementPlanner(_topology(hbm), hbm_reservation=0.0, backend="native", **kwargs)


# ------------------------------------------------------------------ toys
class OneOptionEnumerator:
    """Offers every table one option: row-wise CACHING at ``x`` (kept from the grid enumerator's options)."""

    def __init__(self, x: float) -> None:
        self.inner = GridPlacementEnumerator(WORLD, WORLD, AnalyticCostModel(), load_factors=(x, 1.0))
        self.x, self.backend = x, self.inner.backend

    def enumerate_arrays(self, tables: Sequence[TableSpec]) -> OptionArrays:
        o = self.inner.enumerate_arrays(tables)
        keep = (o.modes == 1) & (o.load_factors == self.x) & (o.sharding == 0)
        assert keep.sum(axis=1).tolist() == [1] * len(tables)
        o.cost[~keep], o.modes[~keep] = np.inf, -1
        return o


class AllOnRankZero:
    """Places every shard of every table on rank 0, whatever the budgets."""

    def partition(
        self,
        shard_bytes: Sequence[int],
        shard_slow_bytes: Sequence[int],
        table_costs: Sequence[float],
        base: Tuple[int, int],
        budgets: Tuple[int, int],
        world_size: int,
        local_world_size: int,
        shards: Optional[Sequence[int]] = None,
    ) -> Partition:
        counts = [1] * len(shard_bytes) if shards is None else [int(k) for k in shards]
        rank_bytes = np.full(world_size, base[0], dtype=np.int64)
        rank_bytes[0] += sum(int(b) * k for b, k in zip(shard_bytes, counts))
        machine = np.full(world_size // local_world_size, base[1], dtype=np.int64)
        machine[0] += sum(int(b) * k for b, k in zip(shard_slow_bytes, counts))
        return Partition(shard_owners=[(0,) * k for k in counts], rank_bytes=rank_bytes, machine_slow_bytes=machine)


class PrefersCachingAt:
    """Prices an option by its distance to CACHING at ``x``: ``|x' - x| + (1 unless CACHING)``."""

    def __init__(self, x: float) -> None:
        self.x, self.name = x, f"prefers_caching_{x}"

    def costs(self, table: TableSpec, options: Sequence[Tuple[Mode, float]]) -> np.ndarray:
        return np.array([abs(x - self.x) + (0.0 if Mode.parse(m) is Mode.CACHING else 1.0) for m, x in options])


class MostExpensive:
    """Picks every table's most expensive option (a plan no cost-minimising proposer would give)."""

    def solve(
        self, hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, hbm_budget: int, ddr_budget: int
    ) -> Optional[np.ndarray]:
        return np.where(np.isfinite(cost), cost, -np.inf).argmax(axis=1)


# ------------------------------------------------------------------ each stage decides the plan
def test_the_default_stages_are_the_documented_classes_and_each_meets_its_protocol() -> None:
    planner = _planner()
    assert type(planner.enumerator) is GridPlacementEnumerator
    assert type(planner.partitioner) is GreedyTableWisePartitioner
    assert type(planner.cost_model) is AnalyticCostModel
    assert type(planner.proposer) is KnapsackProposer
    for stage, protocol in (
        (planner.enumerator, PlacementEnumerator),
        (planner.partitioner, PlacementPartitioner),
        (planner.cost_model, CostModel),
        (planner.proposer, PlacementProposer),
        (OneOptionEnumerator(0.5), PlacementEnumerator),
        (AllOnRankZero(), PlacementPartitioner),
        (PrefersCachingAt(0.5), CostModel),
        (MostExpensive(), PlacementProposer),
    ):
        assert isinstance(stage, protocol), (stage, protocol)
    assert not isinstance(MostExpensive(), PlacementPartitioner)
    assert not isinstance(AllOnRankZero(), PlacementProposer)


@pytest.mark.parametrize("x", [0.3, 0.6])
def test_a_toy_enumerator_offering_one_option_per_table_is_the_plan(x: float) -> None:
    tables = _tables(3)
    plan = _planner(enumerator=OneOptionEnumerator(x)).plan(tables)
    # the bytes of a row-wise CACHING shard at x, from the storage formula
    shard = shard_storage(max_local_rows(1000, WORLD), 16, torch.float32, "sgd", "CACHING", x)
    for p in plan.placements:
        assert (p.sharding_type, p.mode, p.cache_load_factor, p.fused) == ("row_wise", Mode.CACHING, x, False)
        assert (p.hbm_bytes_per_rank, p.ddr_bytes_per_rank) == (shard.fast_bytes, shard.slow_bytes)
        assert p.reason == "only option"
    assert plan.cost_model == "OneOptionEnumerator"  # it prices with no CostModel the planner knows of
    default = _planner().plan(tables)
    assert all((p.mode, p.cache_load_factor) != (Mode.CACHING, x) for p in default.placements)


def test_a_toy_partitioner_placing_everything_on_rank_0_sets_the_plans_owners() -> None:
    tables = _tables(4)
    plan = _planner(partitioner=AllOnRankZero(), sharding_types=("table_wise",)).plan(tables)
    assert [p.rank for p in plan.placements] == [0] * 4
    assert plan.rank_hbm_bytes() == [sum(p.hbm_bytes_per_rank for p in plan.placements), 0, 0, 0]
    # the default partitioner balances the four equal tables over the four ranks
    default = _planner(sharding_types=("table_wise",)).plan(tables)
    assert sorted(p.rank for p in default.placements) == [0, 1, 2, 3]


@pytest.mark.parametrize("x", [0.2, 0.7])
def test_a_toy_cost_model_decides_the_proposers_choice(x: float) -> None:
    tables = _tables(3)
    grid = (0.1, 0.2, 0.5, 0.7, 1.0)
    plan = _planner(cost_model=PrefersCachingAt(x), load_factors=grid, sharding_types=("row_wise",)).plan(tables)
    # by hand: CACHING at x costs 0; every other option of the grid costs more
    for p in plan.placements:
        assert (p.mode, p.cache_load_factor) == (Mode.CACHING, x)
        assert p.lookup_cost == 0.0
    assert plan.cost_model == f"prefers_caching_{x}"
    default = _planner(load_factors=grid, sharding_types=("row_wise",)).plan(tables)
    assert all((p.mode, p.cache_load_factor) != (Mode.CACHING, x) for p in default.placements)


def test_a_toy_proposers_picks_are_the_plan() -> None:
    tables = _tables(3) + [TableSpec(name="wide", rows=500, dim=256, optimizer="sgd", lookups_per_step=64.0)]
    planner = _planner(proposer=MostExpensive())
    plan = planner.plan(tables)
    for p, options in zip(plan.placements, planner.enumerator.enumerate(tables)):  # type: ignore[attr-defined]
        worst = max(options, key=lambda o: o.cost)
        got = (p.sharding_type, p.mode, p.cache_load_factor, p.fused)
        assert got == (worst.sharding_type, worst.mode, worst.cache_load_factor, worst.fused)
        assert p.cost == pytest.approx(worst.cost, rel=1e-12)
    assert plan.total_cost > _planner().plan(tables).total_cost


# ------------------------------------------------------------------ bad stages are refused, named
@pytest.mark.parametrize(
    "arg, value, match",
    [
        ("enumerator", GridPlacementEnumerator, r"enumerator must be a PlacementEnumerator instance.*the class"),
        ("enumerator", object(), r"enumerator must be a PlacementEnumerator instance \(with enumerate_arrays"),
        ("partitioner", GreedyTableWisePartitioner, r"partitioner must be a PlacementPartitioner instance"),
        ("partitioner", MostExpensive(), r"partitioner must be a PlacementPartitioner instance \(with partition"),
        ("proposer", AllOnRankZero(), r"proposer must be a PlacementProposer instance \(with solve"),
        ("cost_model", MostExpensive(), r"cost_model .* does not implement CostModel"),
    ],
)
def test_a_stage_without_its_protocols_method_is_refused_naming_the_argument(arg: str, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _planner(**{arg: value})


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(cost_model="empirical"), "cost_model"),
        (dict(load_factors=(0.5, 1.0)), "load_factors"),
        (dict(sharding_types=("row_wise",)), "sharding_types"),
        (dict(communication="gloo_cpu"), "communication"),
        (dict(constraints={"t0": PlacementConstraints(mode="CACHING")}), "constraints"),
    ],
)
def test_the_default_enumerators_settings_beside_a_given_enumerator_are_refused(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=rf"enumerator=OneOptionEnumerator\(\.\.\.\) was given together with {named}"):
        _planner(enumerator=OneOptionEnumerator(0.5), **kwargs)
    # the defaults, in any order, are not a setting of one's own
    _planner(enumerator=OneOptionEnumerator(0.5), sharding_types=("column_wise", "row_wise", "table_wise"))


def test_an_enumerator_sizing_another_backend_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"sizes tables for backend 'native', but the planner's backend is 'fbgemm'"):
        PlacementPlanner(_topology(), enumerator=OneOptionEnumerator(0.5), backend="fbgemm")
    # without backend=, the planner takes the enumerator's, which must be a layout it budgets
    assert PlacementPlanner(_topology(), enumerator=OneOptionEnumerator(0.5)).backend == "native"
    odd = OneOptionEnumerator(0.5)
    odd.backend = "xla"
    with pytest.raises(ValueError, match=r"backend must be one of \['native', 'fbgemm'\] \(or None\), got 'xla'"):
        PlacementPlanner(_topology(), enumerator=odd)


def test_a_partitioner_overfilling_a_rank_is_refused_naming_it() -> None:
    tables = _tables(4)
    whole = shard_storage(1000, 16, torch.float32, "sgd", "HYBRID", 1.0).fast_bytes
    # the knapsack sees each table's share (whole / 4), so all four fit; rank 0 cannot hold them whole
    only = dict(sharding_types=("table_wise",), load_factors=(1.0,))
    planner = _planner(hbm=int(2.5 * whole), partitioner=AllOnRankZero(), **only)
    with pytest.raises(ValueError, match=r"partitioner AllOnRankZero\.partition overfills rank 0"):
        planner.plan(tables)
    # the default partitioner spreads them within the same budget
    assert max(_planner(hbm=int(2.5 * whole), **only).plan(tables).rank_hbm_bytes()) <= int(2.5 * whole)


class OwnerOf:
    """Places every table whole on ``owner`` (a bad value for some tests), reporting nothing of its bytes."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def partition(self, shard_bytes: Sequence[int], *args: Any, **kwargs: Any) -> Partition:
        return Partition(shard_owners=[(self.owner,)] * len(shard_bytes), rank_bytes=None, machine_slow_bytes=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "owner, match",
    [
        (WORLD, r"gave table 't0' the owners \(4,\); it must name one rank \(an int in \[0, 4\)\) per shard"),
        (-1, r"gave table 't0' the owners \(-1,\)"),
        (1.0, r"gave table 't0' the owners \(1\.0,\)"),
        (True, r"gave table 't0' the owners \(True,\)"),
        (np.int64(1), r"returned rank_bytes of shape \(\) and dtype object"),
    ],
)
def test_a_partitioners_owner_that_is_not_a_rank_is_refused_naming_it(owner: Any, match: str) -> None:
    planner = _planner(partitioner=OwnerOf(owner), sharding_types=("table_wise",))
    with pytest.raises(ValueError, match=r"^partitioner OwnerOf\.partition " + match):
        planner.plan(_tables(2))


class WrongShape:
    def solve(self, hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, h: int, d: int) -> Optional[np.ndarray]:
        return np.zeros(cost.shape[0] + 1, dtype=np.int64)


class Largest:
    def solve(self, hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, h: int, d: int) -> Optional[np.ndarray]:
        return np.where(np.isfinite(cost), hbm, -1).argmax(axis=1)


@pytest.mark.parametrize(
    "proposer, match",
    [
        (WrongShape(), r"proposer WrongShape\.solve returned ndarray of shape \(4,\)"),
        (Largest(), r"proposer Largest\.solve picked options needing .* over the budgets"),
    ],
)
def test_a_proposers_pick_outside_the_options_or_budgets_is_refused_naming_it(proposer: Any, match: str) -> None:
    tables = _tables(3)
    whole = shard_storage(max_local_rows(1000, WORLD), 16, torch.float32, "sgd", "HYBRID", 1.0).fast_bytes
    hbm = 2 * whole  # below three tables all in the fast tier, above them at small load factors
    with pytest.raises(ValueError, match=match):
        _planner(hbm=hbm, proposer=proposer, sharding_types=("row_wise",)).plan(tables)
    assert _planner(hbm=hbm, sharding_types=("row_wise",)).plan(tables).hbm_bytes_per_rank <= hbm


class NoRows:
    def enumerate_arrays(self, tables: Sequence[TableSpec]) -> OptionArrays:
        return OptionArrays.empty(len(tables), 3)


def test_an_enumerator_leaving_a_table_without_options_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"enumerator NoRows\.enumerate_arrays\(2 tables\) gave table 't0' no option"):
        PlacementPlanner(_topology(), enumerator=NoRows()).plan(_tables(2))
