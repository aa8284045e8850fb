"""The planner's choice of sharding type: the communication model, the table-wise partitioner, the
plan's owners and bytes, and the torchrec plan of a table-wise table.

References are independent: the communication formulas written out by hand for one table, and a brute
force over every option and every owner of the table-wise tables for small instances.
"""

from __future__ import annotations

import math
from typing import List, Optional

import numpy as np
import pytest
import torch
from harness.planner_reference import CONSTANTS, brute_force_cost, brute_force_fits
from harness.planner_reference import planner as make_planner
from torchrec.distributed.types import ParameterSharding

from recpipe.planner import PlacementConstraints, PlacementPlan, PlacementPlannerError, TableSpec, row_bytes
from recpipe.planner.communication import CommConstants, CommCostModel
from recpipe.planner.partitioners import GreedyTableWisePartitioner
from recpipe.planner.torchrec_plan import PlacementParameterSharding


# ------------------------------------------------------------------ communication model
def test_communication_cost_by_hand() -> None:
    t = TableSpec(name="t", rows=10_000, dim=16, lookups_per_step=1000.0, bags_per_step=256.0)
    model = CommCostModel(CONSTANTS, world_size=4)
    # input: (1000 ids x 8 B + 256 lengths x 4 B) x 3/4 remote = 6768 B, for both types
    # table-wise output: 2 (fwd + bwd) x 256 bags x 16 x 4 B x 3/4 = 24576 B; 256 bags pooled x 10 ns
    assert model.split(t, "table_wise") == pytest.approx(((6768 + 24576) / 1000, 256 * 10 / 1e6))
    # row-wise: 3 partial sums per bag leave (2 x 256 x 16 x 4 x 3 = 98304 B), 4 x 256 bags pooled, 1000 ids routed
    assert model.split(t, "row_wise") == pytest.approx(((6768 + 98304) / 1000, (4 * 256 * 10 + 1000 * 2) / 1e6))
    assert model.sharding_type_costs(t, ["table_wise", "row_wise"]).tolist() == pytest.approx([31.34656, 105.08424])
    # one rank: nothing moves and nothing is routed; only the bags are pooled
    alone = CommCostModel(CONSTANTS, world_size=1)
    assert alone.split(t, "table_wise") == alone.split(t, "row_wise") == (0.0, 256 * 10 / 1e6)


def test_bags_default_to_one_id_each_and_tables_from_a_module_count_samples_x_features() -> None:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    assert TableSpec(name="t", rows=10, dim=4, lookups_per_step=77.0).bags_per_step == 77.0
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=100, feature_names=["f0", "f1"])],
        device=torch.device("meta"),
    )
    from recpipe.planner import tables_from_module

    (spec,) = tables_from_module(ebc, batch_size=64, pooling_factor=3.0)
    assert (spec.lookups_per_step, spec.bags_per_step) == (64 * 3.0 * 2, 64 * 2)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_communication_constants_refuse_a_bandwidth_that_is_not_positive_and_finite(bad: float) -> None:
    with pytest.raises(ValueError, match=r"CommConstants\(x\)\.network_bw must be a finite number > 0"):
        CommConstants(name="x", network_bw=bad, bag_ns=0.0, bucketize_ns=0.0, source="")


# ------------------------------------------------------------------ partitioner


@pytest.mark.parametrize("seed", range(20))
def test_partitioner_places_within_every_rank_budget(seed: int) -> None:
    rng = np.random.default_rng(seed)
    world = int(rng.integers(2, 4))
    sizes = [int(s) for s in rng.integers(1, 50, size=int(rng.integers(1, 7)))]
    base, budget = int(rng.integers(0, 10)), int(rng.integers(40, 90))
    n = len(sizes)
    part = GreedyTableWisePartitioner().partition(sizes, [0] * n, [1.0] * n, (base, 0), (budget, 0), world, world)
    loads = [base + sum(s for s, o in zip(sizes, part.owners) if o == r) for r in range(world)]
    assert loads == part.rank_bytes.tolist()
    assert max(loads) <= budget
    if not part.unplaced.size:
        assert brute_force_fits([(s, 1) for s in sizes], base, budget, world)
    if not brute_force_fits([(s, 1) for s in sizes], base, budget, world):
        assert part.unplaced.size  # never claims a placement that does not exist


def test_partitioner_balances_modelled_cost_across_ranks() -> None:
    part = GreedyTableWisePartitioner().partition([10] * 6, [0] * 6, [1.0] * 6, (0, 0), (10**6, 0), 3, 3)
    assert sorted(np.bincount(part.owners, minlength=3).tolist()) == [2, 2, 2]


def test_partitioner_keeps_each_machine_within_its_slow_tier() -> None:
    # 4 ranks on 2 machines; each table has 30 slow-tier bytes and a machine holds 60 beyond its base of 10
    part = GreedyTableWisePartitioner().partition([1] * 4, [30] * 4, [1.0] * 4, (0, 10), (100, 70), 4, 2)
    machines = part.owners // 2
    assert sorted(np.bincount(machines, minlength=2).tolist()) == [2, 2]
    assert part.machine_slow_bytes.tolist() == [70, 70]
    full = GreedyTableWisePartitioner().partition([1] * 5, [30] * 5, [1.0] * 5, (0, 10), (100, 70), 4, 2)
    assert full.unplaced.size == 1


# ------------------------------------------------------------------ planner
def _tables(n: int, rows: int = 1000, dim: int = 16) -> List[TableSpec]:
    return [TableSpec(name=f"t{i}", rows=rows, dim=dim, optimizer="sgd", lookups_per_step=64.0) for i in range(n)]


@pytest.mark.parametrize("backend, storage", [("fbgemm", "FUSED"), ("native", "HBM")])
def test_unbounded_fast_tier_places_every_table_whole_and_balances_the_owners(backend: str, storage: str) -> None:
    # all in the fast tier: on CUDA (fbgemm) torchrec's FUSED table, which runs the same TBE as a tiered
    # table there; on CPU (native) recpipe's tiered table, whose kernel is faster than fbgemm-gpu-cpu's
    plan = make_planner(2, hbm=2**40, backend=backend).plan(_tables(6))
    assert [p.sharding_type for p in plan.placements] == ["table_wise"] * 6
    assert [p.storage for p in plan.placements] == [storage] * 6
    assert [p.fused for p in plan.placements] == [storage == "FUSED"] * 6
    owners = [p.rank for p in plan.placements]
    assert sorted(owners) == [0, 0, 0, 1, 1, 1]
    whole = 1000 * row_bytes(16, torch.float32, "sgd")
    assert plan.rank_hbm_bytes() == [3 * whole, 3 * whole] and plan.hbm_bytes_per_rank == 3 * whole
    assert all(p.reason.startswith("cheapest: next ") for p in plan.placements)
    assert "table-wise FUSED" in plan.report() and "| table_wise |" in plan.report()


def test_one_rank_keeps_the_tiered_row_wise_table() -> None:
    # with one rank nothing moves, so both types cost the same and the tiered kernel is kept
    plan = make_planner(1, hbm=2**40).plan(_tables(2))
    assert [p.sharding_type for p in plan.placements] == ["row_wise", "row_wise"]


@pytest.mark.parametrize("fraction", [0.3, 0.55, 0.8, 1.2])
def test_binding_budget_mixes_types_at_the_brute_force_optimum(fraction: float) -> None:
    tables = [
        TableSpec(name=f"t{i}", rows=r, dim=16, optimizer="sgd", lookups_per_step=64.0)
        for i, r in enumerate((4000, 1000, 600))
    ]
    whole = sum(t.rows for t in tables) * row_bytes(16, torch.float32, "sgd")
    planner = make_planner(2, hbm=int(fraction * whole / 2), load_factors=(0.25, 0.5, 1.0))
    plan = planner.plan(tables)
    assert max(plan.rank_hbm_bytes()) <= planner.hbm_budget
    assert plan.ddr_bytes_per_machine <= planner.ddr_budget
    for p in plan.placements:
        assert (p.rank is not None) == p.table_wise
    # the knapsack budgets table-wise tables by their share and the partitioner repairs what it cannot
    # place, so the plan is near the optimum, not always at it
    assert plan.total_cost == pytest.approx(brute_force_cost(planner, tables), rel=1e-5)


def test_pins_choose_the_sharding_type() -> None:
    pins = {
        "t0": PlacementConstraints(sharding_type="row_wise"),
        "t1": PlacementConstraints(sharding_type="table_wise"),
    }
    plan = make_planner(2, hbm=2**40, constraints=pins).plan(_tables(2))
    assert [p.sharding_type for p in plan.placements] == ["row_wise", "table_wise"]
    only_row_wise = make_planner(2, hbm=2**40, sharding_types=("row_wise",)).plan(_tables(2))
    assert {p.sharding_type for p in only_row_wise.placements} == {"row_wise"}


def test_a_table_wise_pin_with_a_tiered_storage_is_a_tiered_table_on_one_rank() -> None:
    pins = {"t0": PlacementConstraints(sharding_type="table_wise", mode="CACHING", cache_load_factor=0.25)}
    plan = make_planner(2, hbm=2**40, constraints=pins).plan(_tables(2))
    p = plan.placement("t0")
    assert (p.sharding_type, p.storage, p.cache_load_factor, p.fused) == ("table_wise", "CACHING", 0.25, False)
    from recpipe.planner import shard_storage

    whole = shard_storage(1000, 16, torch.float32, "sgd", "CACHING", 0.25)
    assert (p.hbm_bytes_per_rank, p.ddr_bytes_per_rank) == (whole.fast_bytes, whole.slow_bytes)
    assert plan.machine_ddr_bytes() == [whole.slow_bytes]
    ps = plan.to_sharding_plan(compute_device="cpu").plan[""]["t0"]
    assert isinstance(ps, PlacementParameterSharding)
    assert (ps.sharding_type, ps.compute_kernel, ps.ranks) == ("table_wise", "customized_kernel", [p.rank])
    with pytest.raises(ValueError, match=r"PlacementConstraints\(fused=True\) is torchrec's FUSED table"):
        PlacementConstraints(fused=True, mode="CACHING")
    with pytest.raises(ValueError, match="sharding_type must be 'table_wise', 'row_wise' or 'column_wise', got 'data"):
        PlacementConstraints(sharding_type="data_parallel")
    with pytest.raises(ValueError, match=r"sharding_types holds \['table_row_wise'\]"):
        make_planner(2, hbm=2**40, sharding_types=("table_row_wise",))


def test_a_table_whose_fast_part_fits_no_rank_whole_is_planned_row_wise() -> None:
    from recpipe.planner import shard_storage

    tables = _tables(1, rows=10_000)
    smallest_whole = shard_storage(10_000, 16, torch.float32, "sgd", "HYBRID", 0.25).fast_bytes
    plan = make_planner(2, hbm=int(0.7 * smallest_whole), load_factors=(0.25, 1.0)).plan(tables)
    (p,) = plan.placements
    assert p.sharding_type == "row_wise" and p.cache_load_factor == 0.25
    assert p.reason.startswith("budget: table_wise HBM x=1.00 models ")


def test_table_wise_sharding_plan_and_json_round_trip(tmp_path) -> None:
    pins: Optional[dict] = {
        "t0": PlacementConstraints(sharding_type="row_wise", mode="CACHING", cache_load_factor=0.5),
        "t1": PlacementConstraints(fused=True),
        "t2": PlacementConstraints(fused=True),
    }
    plan = make_planner(2, hbm=2**40, constraints=pins).plan(_tables(3))
    sp = plan.to_sharding_plan(compute_device="cpu").plan[""]
    assert isinstance(sp["t0"], PlacementParameterSharding) and sp["t0"].sharding_type == "row_wise"
    for p in plan.placements[1:]:
        ps = sp[p.table]
        assert type(ps) is ParameterSharding
        assert (ps.sharding_type, ps.compute_kernel, ps.ranks) == ("table_wise", "fused", [p.rank])
        (shard,) = ps.sharding_spec.shards  # type: ignore[union-attr]
        assert (shard.shard_offsets, shard.shard_sizes, shard.placement.rank()) == ([0, 0], [1000, 16], p.rank)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert PlacementPlan.load(path) == plan
    # a plan written before plans carried sharding types reads as row-wise
    old = plan.to_dict()
    old["placements"] = [old["placements"][0]]
    for key in ("sharding_type", "rank", "lookup_cost", "comm_cost", "reason"):
        del old["placements"][0][key]
    assert PlacementPlan.from_dict(old).placements[0].sharding_type == "row_wise"
    bad = plan.to_dict()
    bad["placements"][1]["rank"] = None
    with pytest.raises(ValueError, match=r"\['rank'\] \(the owner of a table-wise table\)"):
        PlacementPlan.from_dict(bad)


def test_tables_no_rank_can_hold_whole_are_planned_row_wise() -> None:
    from recpipe.planner.partitioners import Partition

    class NeverPlaces(GreedyTableWisePartitioner):
        def partition(self, shard_bytes, shard_slow_bytes, table_costs, base, budgets, world_size, local, shards=None):  # type: ignore[override]
            full = np.full(world_size, budgets[0])
            return Partition(
                shard_owners=[()] * len(shard_bytes), rank_bytes=full, machine_slow_bytes=np.full(1, budgets[1])
            )

    planner = make_planner(2, hbm=2**40)
    planner.partitioner = NeverPlaces()
    plan = planner.plan(_tables(3))
    assert {p.sharding_type for p in plan.placements} == {"row_wise"}
    assert plan.hbm_bytes_per_rank <= planner.hbm_budget


def test_the_fused_table_is_offered_on_cpu_only_for_the_optimizers_fbgemm_gpu_cpu_runs() -> None:
    # fbgemm-gpu-cpu's TBE has no Adam: a CPU (native) plan must not build a FUSED Adam table
    adam = [TableSpec(name="a", rows=1000, dim=256, optimizer="adam", lookups_per_step=64.0)]
    sgd = [TableSpec(name="s", rows=1000, dim=256, optimizer="sgd", lookups_per_step=64.0)]
    for backend, tables, fused in (("native", adam, False), ("native", sgd, True), ("fbgemm", adam, True)):
        arrays = make_planner(2, hbm=2**40, backend=backend).enumerator.enumerate_arrays(tables)
        assert bool(arrays.fused.any()) is fused, (backend, tables[0].optimizer)
    pinned = make_planner(2, hbm=2**40, constraints={"a": PlacementConstraints(fused=True)})
    with pytest.raises(
        PlacementPlannerError, match=r"(?s)table 'a' \(dim 256\) has no placement option.*\['rowwise_adagrad', 'sgd'\]"
    ):
        pinned.plan(adam)
