"""The planner's COLUMN_WISE option: torchrec's FUSED table in column shards, each whole on one rank.

References are independent: torchrec's own column-shard sizes and ``column_wise`` sharding generator, the
communication formula written out by hand, and a brute force over every owner of every shard.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness.planner_reference import CONSTANTS, brute_force_cost, brute_force_fits
from harness.planner_reference import planner as make_planner
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import _calculate_cw_shard_sizes_and_offsets, column_wise
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recpipe.planner import PlacementConstraints, PlacementPlan, PlacementPlannerError, TableSpec, row_bytes
from recpipe.planner.communication import CommCostModel
from recpipe.planner.partitioners import GreedyTableWisePartitioner
from recpipe.planner.torchrec_plan import column_shard_dim, column_shards


def _table(name: str = "w", rows: int = 1000, dim: int = 512, **kwargs) -> TableSpec:
    return TableSpec(name=name, rows=rows, dim=dim, optimizer="rowwise_adagrad", lookups_per_step=64.0, **kwargs)


@pytest.mark.parametrize("dim", [4, 8, 64, 128, 132, 192, 200, 256, 384, 512, 640, 1000, 1024])
def test_column_shards_are_torchrecs_default_blocks(dim: int) -> None:
    sizes, offsets = _calculate_cw_shard_sizes_and_offsets(dim, 10)
    assert [s[1] for s in sizes] == [column_shard_dim(dim)] * column_shards(dim)
    assert [o[1] for o in offsets] == [j * column_shard_dim(dim) for j in range(column_shards(dim))]


def test_column_wise_communication_by_hand() -> None:
    t = TableSpec(name="t", rows=10_000, dim=256, lookups_per_step=1000.0, bags_per_step=256.0)
    model = CommCostModel(CONSTANTS, world_size=4)
    # 2 shards of 128 columns: every id goes to both owners: 2 x (1000 x 8 + 256 x 4) x 3/4 = 13536 B;
    # the pooled output is table-wise's, 2 x 256 x 256 x 4 x 3/4 = 393216 B; 2 x 256 bags pooled x 10 ns
    assert model.split(t, "column_wise") == pytest.approx(((13536 + 393216) / 1000, 2 * 256 * 10 / 1e6))
    net_tw, _ = model.split(t, "table_wise")
    assert model.split(t, "column_wise")[0] - net_tw == pytest.approx(6768 / 1000)


def test_enumerator_offers_column_wise_only_where_the_width_splits_over_more_than_one_rank() -> None:
    tables = [_table("w", dim=512), _table("n", dim=128)]
    arrays = make_planner(4, 2**40).enumerator.enumerate_arrays(tables)
    cw = arrays.sharding == 2
    assert cw[0].sum() == 1 and not cw[1].any()
    j = int(np.flatnonzero(cw[0])[0])
    shard = 1000 * row_bytes(128, torch.float32, "rowwise_adagrad")
    assert arrays.fused[0, j] and arrays.owner_bytes[0, j] == shard
    assert arrays.hbm_bytes_per_rank[0, j] == -(-4 * shard // 4)  # the knapsack's share of 4 shards
    assert arrays.hbm_bytes_per_machine[0, j] == 4 * shard
    assert not (make_planner(1, 2**40).enumerator.enumerate_arrays(tables).sharding == 2).any()
    only_tw = make_planner(4, 2**40, sharding_types=("table_wise", "row_wise"))
    assert not (only_tw.enumerator.enumerate_arrays(tables).sharding == 2).any()


@pytest.mark.parametrize("seed", range(20))
def test_partitioner_places_every_shard_or_none_within_every_rank_budget(seed: int) -> None:
    rng = np.random.default_rng(seed)
    world = int(rng.integers(2, 4))
    n = int(rng.integers(1, 4))
    sizes = [int(s) for s in rng.integers(1, 40, size=n)]
    shards = [int(k) for k in rng.integers(1, 4, size=n)]
    base, budget = int(rng.integers(0, 10)), int(rng.integers(40, 90))
    part = GreedyTableWisePartitioner().partition(
        sizes, [0] * n, [1.0] * n, (base, 0), (budget, 0), world, world, shards
    )
    loads = [base] * world
    for size, owners, k in zip(sizes, part.shard_owners, shards):
        assert len(owners) in (0, k)  # whole or not at all
        for r in owners:
            loads[r] += size
    assert loads == part.rank_bytes.tolist() and max(loads) <= budget
    assert part.owners.tolist() == [o[0] if o else -1 for o in part.shard_owners]
    if not part.unplaced.size:
        assert brute_force_fits(list(zip(sizes, shards)), base, budget, world)
    if not brute_force_fits(list(zip(sizes, shards)), base, budget, world):
        assert part.unplaced.size  # never claims a placement that does not exist


def test_partitioner_spreads_the_shards_of_a_table_over_distinct_ranks() -> None:
    part = GreedyTableWisePartitioner().partition([10], [0], [4.0], (0, 0), (10**6, 0), 4, 4, [4])
    assert sorted(part.shard_owners[0]) == [0, 1, 2, 3]


def test_a_fused_table_too_wide_for_one_rank_is_planned_column_wise() -> None:
    # fused pinned (torchrec's table, all in the fast tier); a rank holds half the table, not all of it
    table = _table("w", dim=512)
    whole = 1000 * row_bytes(512, torch.float32, "rowwise_adagrad")
    shard = 1000 * row_bytes(128, torch.float32, "rowwise_adagrad")
    planner = make_planner(4, hbm=whole // 2, constraints={"w": PlacementConstraints(fused=True)})
    plan = planner.plan([table])
    (p,) = plan.placements
    assert (p.sharding_type, p.storage, p.rank) == ("column_wise", "FUSED", None)
    assert sorted(p.ranks) == [0, 1, 2, 3]
    assert plan.rank_hbm_bytes() == [shard] * 4
    assert "column_wise" in plan.report() and "1 column-wise" in plan.report()


def test_pinned_column_wise_plan_is_torchrecs_column_wise_sharding() -> None:
    tables = [_table("w", dim=256), _table("n", dim=64)]
    planner = make_planner(2, 2**40, constraints={"w": PlacementConstraints(sharding_type="column_wise")})
    plan = planner.plan(tables)
    p = plan.placement("w")
    assert p.sharding_type == "column_wise" and len(p.ranks) == 2
    got = plan.to_sharding_plan(compute_device="cpu").plan[""]["w"]
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="w", embedding_dim=256, num_embeddings=1000, feature_names=["f"])],
        device=torch.device("meta"),
    )
    want = column_wise(ranks=list(p.ranks), compute_kernel="fused")(
        ebc.embedding_bags["w"].weight, 2, 2, "cpu", EmbeddingBagCollectionSharder()
    )
    assert (got.sharding_type, got.compute_kernel, got.ranks) == (want.sharding_type, want.compute_kernel, want.ranks)
    assert got.sharding_spec == want.sharding_spec


def test_column_wise_plan_round_trips_through_json_and_refuses_bad_ranks() -> None:
    planner = make_planner(2, 2**40, constraints={"w": PlacementConstraints(sharding_type="column_wise")})
    plan = planner.plan([_table("w", dim=384)])
    assert PlacementPlan.from_dict(plan.to_dict()) == plan
    bad = plan.to_dict()
    bad["placements"][0]["ranks"] = [0, 1]  # 3 shards of 128 columns
    with pytest.raises(ValueError, match=r"\['ranks'\] must list the owner rank of each of the 3 column shards"):
        PlacementPlan.from_dict(bad)
    bad["placements"][0]["ranks"] = [0, 1, -1]
    with pytest.raises(ValueError, match=r"ranks'\]\[2\]"):
        PlacementPlan.from_dict(bad)
    tw = make_planner(2, 2**40).plan([_table("n", dim=64)]).to_dict()
    assert "ranks" not in tw["placements"][0]  # plans without column-wise tables read as before
    tw["placements"][0]["ranks"] = [0]
    with pytest.raises(ValueError, match=r"\['ranks'\] must be absent"):
        PlacementPlan.from_dict(tw)


def test_column_wise_pins_are_refused_where_they_cannot_hold() -> None:
    with pytest.raises(ValueError, match=r"sharding_type='column_wise'.*fused=False"):
        PlacementConstraints(sharding_type="column_wise", fused=False)
    with pytest.raises(ValueError, match=r"sharding_type='column_wise'.*no mode or cache_load_factor < 1"):
        PlacementConstraints(sharding_type="column_wise", mode="CACHING")
    planner = make_planner(2, 2**40, constraints={"n": PlacementConstraints(sharding_type="column_wise")})
    with pytest.raises(
        PlacementPlannerError, match=r"(?s)table .n. \(dim 64\) has no placement option.*Possible solutions"
    ):
        planner.plan([_table("n", dim=64)])


@pytest.mark.parametrize("fraction", [0.55, 0.6, 0.8, 1.5])
def test_fused_tables_under_a_binding_budget_reach_the_brute_force_optimum(fraction: float) -> None:
    # a and b are pinned FUSED (table- or column-wise); at 0.55 of all bytes per rank neither fits whole
    # next to the rest, so the optimum shards them by columns
    tables = [_table("a", rows=1200, dim=256), _table("b", rows=500, dim=384), _table("c", rows=800, dim=64)]
    whole = sum(t.rows * row_bytes(t.dim, torch.float32, "rowwise_adagrad") for t in tables)
    pins = {t.name: PlacementConstraints(fused=True) for t in tables[:2]}
    planner = make_planner(2, hbm=int(fraction * whole), constraints=pins)
    want = brute_force_cost(planner, tables)
    plan = planner.plan(tables)
    assert plan.hbm_bytes_per_rank <= planner.hbm_budget
    assert plan.total_cost == pytest.approx(want, rel=1e-5)
    column_wise = {p.table for p in plan.placements if p.sharding_type == "column_wise"}
    assert column_wise == ({"a", "b"} if fraction == 0.55 else set()), plan.report()
