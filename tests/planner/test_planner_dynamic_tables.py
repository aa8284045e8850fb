"""The planner plans dynamic tables (``PlacementConstraints(dynamic=...)``) beside static ones, under the same
budgets: a dynamic shard's bytes are its slots as a tiered shard plus its hash index in the fast tier; it is
never torchrec's FUSED table nor column-wise; a bigger capacity pushes it out of HBM; its cost grows once the
distinct keys pass its capacity; its options reach the sharders' fused params intact; bad pins are refused
naming the field.

References are independent: the bytes are written out from the slot count (``ceil(ceil(C / shards) / 16) x 16``)
and the bytes per row (``dim x 4`` plus the optimizer's state), the index as 16 bytes per slot plus 8 per bucket
(with admission, a counter table of a quarter of the capacity laid out alike), the costs from torchrec's bandwidth constants and the miss rate ``1 - C / K`` of
uniform access.
"""

from __future__ import annotations

import copy
import json
from fractions import Fraction
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
from harness.planner_reference import planner as make_planner
from torchrec.distributed.planner.constants import HBM_MEM_BW, HBM_TO_DDR_MEM_BW

from recpipe.pipeline.placement import (
    DynamicInitializer,
    DynamicTableOptions,
    Mode,
    PlacementParams,
    dynamic_shard_storage,
)
from recpipe.planner import (
    AnalyticCostModel,
    GridPlacementEnumerator,
    PlacementConstraints,
    PlacementPlan,
    PlacementPlanner,
    PlacementPlannerError,
    PlannerInputError,
    TableSpec,
    make_topology,
)

_STATE_BYTES = {"sgd": lambda dim: 0, "rowwise_adagrad": lambda dim: 4, "adam": lambda dim: 8 * dim}


def _row_bytes(dim: int, optimizer: str) -> int:
    """fp32 values plus the optimizer's fp32 state, written out."""
    return 4 * dim + _STATE_BYTES[optimizer](dim)


def _slots(capacity: int, shards: int) -> int:
    """Slots of one shard: the capacity split evenly, rounded up to whole buckets of 16."""
    per_shard = -(-capacity // shards)
    return -(-per_shard // 16) * 16


def _index_bytes(slots: int, counter_slots: int = 0) -> int:
    """int64 key and int64 score per slot, one int64 header per bucket of 16; the admission counter table's
    ``counter_slots`` likewise."""
    return sum(n * 16 + (n // 16) * 8 for n in (slots, counter_slots))


def _reference_shard(
    capacity: int, shards: int, dim: int, optimizer: str, mode: str, x: float, admission: bool
) -> Tuple[int, int]:
    """``(fast, slow)`` bytes of one dynamic shard in recpipe's native layout, written out: HYBRID keeps
    ``floor(x S)`` slot rows fast, CACHING keeps every slot row slow and caches ``floor(x S)`` of them (an int64
    row map per slot, 16 bytes per cache slot)."""
    s, rb = _slots(capacity, shards), _row_bytes(dim, optimizer)
    k = int(Fraction(repr(x)) * s)  # floor: Fraction of the decimal, as written
    if x >= 1.0:
        fast, slow = s * rb, 0
    elif mode == "HYBRID":
        fast, slow = k * rb, (s - k) * rb
    else:
        fast, slow = k * rb + s * 8 + k * 16, s * rb
    counter = _slots(max(1, capacity // 4), shards) if admission else 0  # a quarter of the keys, split alike
    return fast + _index_bytes(s, counter), slow


def _topology_planner(world: int, local: int, hbm: int, ddr_per_machine: int, **kwargs: Any) -> PlacementPlanner:
    topo = make_topology(world_size=world, local_world_size=local, hbm_cap=hbm, ddr_cap=ddr_per_machine // local)
    return PlacementPlanner(topo, hbm_reservation=0.0, backend="native", **kwargs)


# ------------------------------------------------------------------ bytes
@pytest.mark.parametrize(
    "sharding, mode, x, capacity, admit_after, optimizer",
    [
        ("row_wise", "HYBRID", 0.3, 100_003, 1, "adam"),
        ("row_wise", "CACHING", 0.5, 64_000, 3, "sgd"),
        ("row_wise", "HYBRID", 1.0, 1_000, 2, "rowwise_adagrad"),
        ("table_wise", "CACHING", 0.2, 77_777, 1, "rowwise_adagrad"),
        ("table_wise", "HYBRID", 0.7, 50_000, 2, "adam"),
    ],
)
def test_planned_dynamic_bytes_equal_slots_as_tiered_rows_plus_the_index(
    sharding: str, mode: str, x: float, capacity: int, admit_after: int, optimizer: str
) -> None:
    world, local, dim = 4, 2, 24
    options = DynamicTableOptions(capacity=capacity, admit_after=admit_after)
    pin = PlacementConstraints(dynamic=options, sharding_type=sharding, mode=mode, cache_load_factor=x)
    planner = _topology_planner(world, local, 2**34, 2**40, constraints={"d": pin})
    tables = [
        TableSpec(name="d", rows=10_000, dim=dim, optimizer=optimizer),
        TableSpec(name="s", rows=5_000, dim=dim, optimizer=optimizer),
    ]
    plan = planner.plan(tables)
    got = plan.placement("d")
    shards = world if sharding == "row_wise" else 1
    fast, slow = _reference_shard(capacity, shards, dim, optimizer, mode, x, admit_after > 1)
    on_machine = local if sharding == "row_wise" else 1
    assert got.sharding_type == sharding and not got.fused and got.dynamic == options
    assert (got.hbm_bytes_per_rank, got.ddr_bytes_per_rank) == (fast, slow)
    assert (got.hbm_bytes_per_machine, got.ddr_bytes_per_machine) == (on_machine * fast, on_machine * slow)
    # the function the runtime reads gives the same shard
    shard = dynamic_shard_storage(options, 10_000, shards, dim, "float32", optimizer, mode, x)
    assert (shard.fast_bytes, shard.slow_bytes) == (fast, slow)
    # the plan's per-rank accounting holds the dynamic shard on every rank (row-wise) or on its owner
    static = plan.placement("s")
    for r, total in enumerate(plan.rank_hbm_bytes()):
        expect = (fast if sharding == "row_wise" or r == got.rank else 0) + (
            static.hbm_bytes_per_rank if static.sharding_type == "row_wise" or r == static.rank else 0
        )
        assert total == expect


def test_capacity_defaults_to_num_embeddings_and_fbgemm_sizes_the_slots_in_its_layout() -> None:
    from recpipe.pipeline.placement import fbgemm_shard_storage

    options = DynamicTableOptions()  # capacity: the table's rows
    pin = PlacementConstraints(dynamic=options, sharding_type="row_wise", mode="CACHING", cache_load_factor=0.25)
    planner = make_planner(2, hbm=2**34, backend="fbgemm", constraints={"d": pin})
    got = planner.plan([TableSpec(name="d", rows=30_001, dim=32, optimizer="adam")]).placement("d")
    slots = _slots(30_001, 2)
    rows = fbgemm_shard_storage(slots, 32, "float32", "adam", "CACHING", 0.25, "lfu")
    assert got.hbm_bytes_per_rank == rows.fast_bytes + _index_bytes(slots)
    assert got.ddr_bytes_per_rank == rows.slow_bytes


# ------------------------------------------------------------------ never FUSED, never column-wise
def test_a_dynamic_table_is_never_fused_nor_column_wise_where_its_static_twin_would_be() -> None:
    # dim 256 splits into 2 column shards and SGD runs on fbgemm-gpu-cpu's FUSED TBE: the static twin gets both
    tables = [TableSpec(name=n, rows=2_000, dim=256, optimizer="sgd", lookups_per_step=64.0) for n in ("d", "s")]
    pin = PlacementConstraints(dynamic=DynamicTableOptions(capacity=2_000))
    planner = make_planner(2, hbm=2**34, constraints={"d": pin})
    options = planner.enumerator.enumerate_arrays(tables)
    valid = options.modes >= 0
    assert (options.fused[1] & valid[1]).any() and (options.sharding[1][valid[1]] == 2).any()
    assert not (options.fused[0] & valid[0]).any()
    assert set(options.sharding[0][valid[0]].tolist()) == {0, 1}  # row_wise and table_wise only
    for hbm in (2**34, 2**22):  # ample, then tight
        got = make_planner(2, hbm=hbm, constraints={"d": pin}).plan(tables).placement("d")
        assert not got.fused and got.sharding_type in ("row_wise", "table_wise") and got.storage != "FUSED"


# ------------------------------------------------------------------ budgets
def test_budgets_hold_with_dynamic_and_static_tables_by_independent_accounting() -> None:
    world, local, dim, optimizer = 4, 2, 16, "rowwise_adagrad"
    H, D = 5 * 2**19, 2**30
    dyn = {
        "d0": (DynamicTableOptions(capacity=40_000), None),
        "d1": (DynamicTableOptions(capacity=5_000, admit_after=2), None),
        "d2": (DynamicTableOptions(capacity=80_000), "row_wise"),
    }
    constraints = {n: PlacementConstraints(dynamic=o, sharding_type=s) for n, (o, s) in dyn.items()}
    tables = [TableSpec(name=n, rows=10_000, dim=dim, optimizer=optimizer) for n in dyn]
    tables += [TableSpec(name=f"s{i}", rows=30_000 + 5_000 * i, dim=dim, optimizer=optimizer) for i in range(3)]
    plan = _topology_planner(world, local, H, D, constraints=constraints).plan(tables)
    all_fast = sum(
        _reference_shard(o.capacity, world, dim, optimizer, "HYBRID", 1.0, False)[0] for o, _ in dyn.values()
    )
    assert all_fast > H  # the dynamic tables alone could not all sit in HBM: the budget binds
    assert any(plan.placement(n).cache_load_factor < 1.0 for n in dyn)
    rank_fast, machine_slow = [0] * world, [0] * (world // local)
    for p in plan.placements:
        if p.dynamic is not None:
            shards = world if p.sharding_type == "row_wise" else 1
            capacity, admission = p.dynamic.table_capacity(p.rows), p.dynamic.admit_after > 1
            fast, slow = _reference_shard(capacity, shards, dim, optimizer, p.mode.name, p.cache_load_factor, admission)
        else:
            fast, slow = p.hbm_bytes_per_rank, p.ddr_bytes_per_rank
        holders = range(world) if p.sharding_type == "row_wise" else [p.rank]
        if p.sharding_type == "row_wise" and p.dynamic is None:
            machine_slow = [m + p.ddr_bytes_per_machine for m in machine_slow]
        for r in holders:
            rank_fast[r] += fast
            if p.dynamic is not None or p.sharding_type != "row_wise":
                machine_slow[r // local] += slow
    assert max(rank_fast) <= H and max(machine_slow) <= D
    assert plan.rank_hbm_bytes() == rank_fast and plan.machine_ddr_bytes() == machine_slow


def test_a_bigger_capacity_moves_a_dynamic_table_out_of_hbm_under_a_tight_budget() -> None:
    table = TableSpec(name="d", rows=10_000, dim=64, optimizer="sgd")
    H = 64 * 2**20
    small, big = DynamicTableOptions(capacity=10_000), DynamicTableOptions(capacity=1_000_000)
    # the small table's shard fits in HBM row-wise, the big one's does not
    assert _reference_shard(10_000, 2, 64, "sgd", "HYBRID", 1.0, False)[0] <= H
    assert _reference_shard(1_000_000, 2, 64, "sgd", "HYBRID", 1.0, False)[0] > H
    got = {}
    for name, options in (("small", small), ("big", big)):
        planner = make_planner(2, hbm=H, constraints={"d": PlacementConstraints(dynamic=options)})
        got[name] = planner.plan([table]).placement("d")
    assert got["small"].storage == "HBM" and got["small"].cache_load_factor == 1.0
    assert got["big"].storage in ("HYBRID", "CACHING") and got["big"].cache_load_factor < 1.0
    assert got["big"].hbm_bytes_per_rank <= H and got["big"].ddr_bytes_per_rank > 0


# ------------------------------------------------------------------ cost
def _lookup_costs(tables: List[TableSpec], constraints: Dict[str, PlacementConstraints]) -> Tuple[Any, np.ndarray]:
    """The enumerator's options and their lookup costs (no communication model: lookups only)."""
    enum = GridPlacementEnumerator(2, 2, AnalyticCostModel(), constraints=constraints, sharding_types=["row_wise"])
    options = enum.enumerate_arrays(tables)
    return options, options.lookup_cost


def _uniform(rows: int, name: str = "d") -> TableSpec:
    return TableSpec(name=name, rows=rows, dim=32, optimizer="adam", lookups_per_step=1000.0, zipf_alpha=0.0)


def test_within_capacity_a_dynamic_table_costs_the_static_formula_plus_one_probe_per_lookup() -> None:
    capacity, lookups = 50_000, 1000.0
    pin = PlacementConstraints(dynamic=DynamicTableOptions(capacity=capacity), distinct_keys=capacity)
    opts, dyn = _lookup_costs([_uniform(100_000)], {"d": pin})
    _, static = _lookup_costs([_uniform(capacity, "s")], {})
    probe_ms = lookups * (16 * 8 + 8 + 8) / HBM_MEM_BW  # the bucket's keys and header read, the score written
    valid = opts.modes[0] >= 0
    np.testing.assert_allclose(dyn[0][valid], static[0][valid] + probe_ms, rtol=1e-12)


def test_the_cost_grows_when_distinct_keys_pass_the_capacity_by_the_insert_model() -> None:
    capacity, lookups, dim = 50_000, 1000.0, 32
    costs = {}
    for distinct in (None, capacity, 2 * capacity, 4 * capacity, 16 * capacity):
        pin = PlacementConstraints(dynamic=DynamicTableOptions(capacity=capacity), distinct_keys=distinct)
        opts, cost = _lookup_costs([_uniform(100_000)], {"d": pin})
        costs[distinct] = cost[0][opts.modes[0] >= 0]
    np.testing.assert_array_equal(costs[None], costs[capacity])  # default: distinct keys = capacity
    for lo, hi in ((capacity, 2 * capacity), (2 * capacity, 4 * capacity), (4 * capacity, 16 * capacity)):
        assert (costs[hi] > costs[lo]).all()
    # the written-out model at 4x: uniform access leaves 3/4 of the lookups without a row; each reads and writes a
    # new row (values + Adam state) at its hit rate (1 at x = 1, x HYBRID, 0 CACHING) and writes its key and score
    _, static = _lookup_costs([_uniform(capacity, "s")], {})
    kinds = [
        (Mode.HYBRID if m == 0 else Mode.CACHING, x) for m, x in zip(opts.modes[0], opts.load_factors[0]) if m >= 0
    ]
    miss, row = 0.75, _row_bytes(dim, "adam")
    expect = []
    for (mode, x), s in zip(kinds, static[0][opts.modes[0] >= 0]):
        hit = 1.0 if x >= 1.0 else (x if mode is Mode.HYBRID else 0.0)
        bw = hit * HBM_MEM_BW + (1 - hit) * HBM_TO_DDR_MEM_BW
        insert = 2 * row / bw + 16 / HBM_MEM_BW
        expect.append((1 - miss) * s + lookups * (144 / HBM_MEM_BW + miss * insert))
    np.testing.assert_allclose(costs[4 * capacity], expect, rtol=1e-12)


def test_admission_adds_a_counter_probe_per_miss_only() -> None:
    capacity = 50_000
    got = {}
    for admit_after in (1, 3):
        for distinct in (capacity, 4 * capacity):
            options = DynamicTableOptions(capacity=capacity, admit_after=admit_after)
            opts, cost = _lookup_costs(
                [_uniform(100_000)], {"d": PlacementConstraints(dynamic=options, distinct_keys=distinct)}
            )
            got[admit_after, distinct] = cost[0][opts.modes[0] >= 0]
    np.testing.assert_array_equal(got[1, capacity], got[3, capacity])
    np.testing.assert_allclose(got[3, 4 * capacity] - got[1, 4 * capacity], 1000.0 * 0.75 * 144 / HBM_MEM_BW, rtol=1e-9)


@pytest.mark.parametrize("admission_capacity, counter_keys", [(None, 250), (48, 48), (5_000, 5_000)])
def test_the_admission_counter_table_is_sized_by_admission_capacity(
    admission_capacity: Optional[int], counter_keys: int
) -> None:
    options = DynamicTableOptions(capacity=1_000, admit_after=2, admission_capacity=admission_capacity)
    got = dynamic_shard_storage(options, 1_000, 2, 8, torch.float32, "sgd", "HYBRID", 1.0)
    counter = _slots(counter_keys, 2)  # default: a quarter of the capacity
    assert got.fast_bytes == _slots(1_000, 2) * _row_bytes(8, "sgd") + _index_bytes(_slots(1_000, 2), counter)


def test_a_bad_admission_capacity_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"DynamicTableOptions.admission_capacity must be an int in \[1, "):
        DynamicTableOptions(admit_after=2, admission_capacity=0)


# ------------------------------------------------------------------ emission
def test_the_emitted_fused_params_round_trip_to_the_same_options(tmp_path: Path) -> None:
    options = DynamicTableOptions(
        capacity=12_345,
        eviction="lfu",
        admit_after=3,
        admission_capacity=777,
        initializer=DynamicInitializer(mode="normal", mean=0.5, std=0.01, lower=-1.0, upper=1.0),
        on_full="error",
        seed=-7,
    )
    tables = [TableSpec(name="d", rows=1_000, dim=16, optimizer="sgd"), TableSpec(name="s", rows=1_000, dim=16)]
    plan = make_planner(2, hbm=2**34, constraints={"d": PlacementConstraints(dynamic=options)}).plan(tables)
    params = plan.placement_params("d")
    assert params.dynamic == options
    sharding = plan.to_sharding_plan().plan[""]
    fused = sharding["d"].get_additional_fused_params()
    json.dumps(fused)  # plain values, as torchrec deep-copies and compares fused params
    assert PlacementParams.from_fused_params(copy.deepcopy(fused), "d").dynamic == options
    assert "recpipe_dynamic" not in sharding["s"].get_additional_fused_params()
    # the saved plan reads back with the same options, and emits them again
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = PlacementPlan.load(path)
    assert loaded.placement("d").dynamic == options and loaded.placement("s").dynamic is None
    again = loaded.to_sharding_plan().plan[""]["d"].get_additional_fused_params()
    assert PlacementParams.from_fused_params(again, "d").dynamic == options
    assert "(dynamic)" in plan.report()


def test_a_plan_file_with_bad_dynamic_options_is_refused_naming_the_key() -> None:
    pin = PlacementConstraints(dynamic=DynamicTableOptions(capacity=100))
    data = make_planner(2, hbm=2**34, constraints={"d": pin}).plan([TableSpec(name="d", rows=64, dim=8)]).to_dict()
    data["placements"][0]["dynamic"]["eviction"] = "oldest"
    with pytest.raises(ValueError, match=r"\['dynamic'\] holds invalid dynamic-table options.*eviction"):
        PlacementPlan.from_dict(data)


# ------------------------------------------------------------------ refusals
_OPTS = DynamicTableOptions(capacity=1_000)


@pytest.mark.parametrize(
    "kwargs, words, fixed",
    [
        (
            dict(dynamic=_OPTS, sharding_type="column_wise"),
            ["sharding_type='column_wise'", "row- or table-wise"],
            dict(dynamic=_OPTS, sharding_type="row_wise"),
        ),
        (dict(dynamic=_OPTS, fused=True), ["fused=True", "never torchrec's FUSED table"], dict(dynamic=_OPTS)),
        (
            dict(dynamic={"capacity": 1_000}),
            ["PlacementConstraints.dynamic must be a DynamicTableOptions"],
            dict(dynamic=DynamicTableOptions(capacity=1_000)),
        ),
        (
            dict(distinct_keys=5_000),
            ["PlacementConstraints.distinct_keys", "dynamic=DynamicTableOptions"],
            dict(dynamic=_OPTS, distinct_keys=5_000),
        ),
        (
            dict(dynamic=_OPTS, distinct_keys=0),
            ["PlacementConstraints.distinct_keys must be a positive int"],
            dict(dynamic=_OPTS, distinct_keys=1),
        ),
        (
            dict(dynamic=_OPTS, distinct_keys=2.5),
            ["PlacementConstraints.distinct_keys must be a positive int"],
            dict(dynamic=_OPTS, distinct_keys=2),
        ),
        (
            dict(dynamic=_OPTS, distinct_keys=True),
            ["PlacementConstraints.distinct_keys must be a positive int"],
            dict(dynamic=_OPTS),
        ),
    ],
)
def test_bad_dynamic_constraints_are_refused_naming_the_field(
    kwargs: Dict[str, Any], words: List[str], fixed: Dict[str, Any]
) -> None:
    with pytest.raises(ValueError) as info:
        PlacementConstraints(**kwargs)
    for word in words:
        assert word in str(info.value)
    pin = PlacementConstraints(**fixed)  # the fix the message names is accepted and plans
    got = make_planner(2, hbm=2**34, constraints={"d": pin}).plan([TableSpec(name="d", rows=100, dim=8)])
    assert got.placement("d").dynamic == pin.dynamic


def test_a_dynamic_pin_the_sharding_types_rule_out_is_refused_with_the_widening() -> None:
    pin = PlacementConstraints(dynamic=_OPTS)
    with pytest.raises(PlannerInputError) as info:
        make_planner(2, hbm=2**34, constraints={"d": pin}, sharding_types=("column_wise",))
    msg = str(info.value)
    assert "pins dynamic=DynamicTableOptions(...)" in msg and "add 'row_wise' to sharding_types" in msg
    planner = make_planner(2, hbm=2**34, constraints={"d": pin}, sharding_types=("row_wise", "column_wise"))
    assert planner.plan([TableSpec(name="d", rows=100, dim=256)]).placement("d").sharding_type == "row_wise"


def test_a_capacity_past_the_planners_limit_is_refused_naming_capacity() -> None:
    pin = PlacementConstraints(dynamic=DynamicTableOptions(capacity=2**60))
    with pytest.raises(PlacementPlannerError, match=r"DynamicTableOptions.capacity 1152921504606846976 rows"):
        make_planner(2, hbm=2**34, constraints={"d": pin}).plan([TableSpec(name="d", rows=100, dim=64)])


def test_a_dynamic_table_that_fits_nowhere_names_its_capacity_and_a_smaller_one_plans() -> None:
    H, table = 2**20, TableSpec(name="d", rows=100, dim=64, optimizer="sgd")
    pin: Optional[PlacementConstraints] = PlacementConstraints(dynamic=DynamicTableOptions(capacity=4_000_000))
    with pytest.raises(PlacementPlannerError) as info:
        make_planner(2, hbm=H, ddr=2**40, constraints={"d": pin}).plan([table])
    assert "lower the capacity of dynamic table 'd' (DynamicTableOptions.capacity, now 4000000 rows)" in str(info.value)
    pin = PlacementConstraints(dynamic=DynamicTableOptions(capacity=20_000))
    got = make_planner(2, hbm=H, ddr=2**40, constraints={"d": pin}).plan([table]).placement("d")
    assert got.hbm_bytes_per_rank <= H
