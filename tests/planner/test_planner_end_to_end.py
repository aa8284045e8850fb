"""Tests of recpipe.planner: storage formulas, cost models, DP vs brute force, plans."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrec.distributed.planner.types import Topology
from torchrec.distributed.types import ShardingType
from torchrec.distributed.utils import add_params_from_parameter_sharding
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recpipe.pipeline.placement import fbgemm_shard_storage
from recpipe.planner import (
    CACHE_ROW_MAP_BYTES,
    CACHE_SLOT_BYTES,
    AnalyticCostModel,
    BruteForceProposer,
    EmpiricalCostModel,
    FusedOptimizerKind,
    GridPlacementEnumerator,
    KnapsackProposer,
    Mode,
    PlacementConstraints,
    PlacementErrorType,
    PlacementParameterSharding,
    PlacementPlan,
    PlacementPlanner,
    PlacementPlannerError,
    ShardStorage,
    TableSpec,
    fast_tier_hit_rate,
    local_rows,
    machine_storage,
    make_topology,
    max_local_rows,
    optimizer_state_bytes_per_row,
    placements_from_sharding_plan,
    row_bytes,
    shard_storage,
    tier_rows,
)
from recpipe.planner.__main__ import main as cli_main
from recpipe.planner.communication import CommConstants
from recpipe.planner.cost_models import generalized_harmonic
from recpipe.planner.option_arrays import options_to_arrays

#: A network so fast that communication costs nothing: plans priced by lookups alone.
ZERO_COMM = CommConstants(name="zero", network_bw=1e30, bag_ns=0.0, bucketize_ns=0.0, source="tests")

GiB = 1024**3


def topo(world: int = 8, local: int = 8, hbm: int = 80 * GiB, ddr_per_rank: int = 128 * GiB) -> Topology:
    return Topology(world_size=world, local_world_size=local, compute_device="cuda", hbm_cap=hbm, ddr_cap=ddr_per_rank)


# ---------------------------------------------------------------- storage ----
def test_local_rows_sum_and_values() -> None:
    assert [local_rows(10, 4, r) for r in range(4)] == [3, 3, 2, 2]
    for n, w in [(1, 8), (7, 8), (8, 8), (1000003, 64), (5, 1)]:
        rows = [local_rows(n, w, r) for r in range(w)]
        assert sum(rows) == n
        # rank r owns exactly the ids h with h % w == r
        assert rows == [len(range(r, n, w)) for r in range(w)]
        assert max_local_rows(n, w) == max(rows) == -(-n // w)


def test_optimizer_and_row_bytes() -> None:
    assert [optimizer_state_bytes_per_row(o, 16) for o in ("sgd", "rowwise_adagrad", "adagrad", "adam")] == [
        0,
        4,
        64,
        128,
    ]
    assert row_bytes(128, torch.float32, "adam") == 512 + 1024
    assert row_bytes(64, torch.float16, "rowwise_adagrad") == 128 + 4
    assert row_bytes(8, "bfloat16", "sgd") == 16
    with pytest.raises(ValueError, match="sgd.*rowwise_adagrad.*adagrad.*adam"):
        optimizer_state_bytes_per_row("lamb", 8)


def test_tier_rows_and_float_robust_floor() -> None:
    assert tier_rows(10, Mode.HYBRID, 0.3) == (3, 7, 0)  # int(0.3 * 10) would be 2
    assert tier_rows(10, "CACHING", 0.3) == (0, 10, 3)
    assert tier_rows(10, Mode.CACHING, 1.0) == tier_rows(10, Mode.HYBRID, 1.0) == (10, 0, 0)
    for x in [0.1 * i for i in range(1, 10)] + [0.7, 0.35]:
        for n in (1, 7, 10, 100, 12345, 10**9 + 7):
            exact = math.floor(Fraction(repr(x)) * n)
            assert tier_rows(n, Mode.HYBRID, x)[0] == exact
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="cache_load_factor"):
            tier_rows(10, Mode.HYBRID, bad)


def test_shard_storage_hand_computed() -> None:
    rb = 4 * 4  # dim 4 fp32, sgd
    s = shard_storage(10, 4, torch.float32, "sgd", Mode.CACHING, 0.3)
    assert (s.fast_bytes, s.slow_bytes) == (3 * rb + 10 * 8 + 3 * 16, 10 * rb) == (176, 160)
    assert CACHE_ROW_MAP_BYTES == 8 and CACHE_SLOT_BYTES == 16
    s = shard_storage(10, 4, torch.float32, "sgd", Mode.HYBRID, 0.3)
    assert (s.fast_bytes, s.slow_bytes) == (3 * rb, 7 * rb)
    for mode in Mode:
        s = shard_storage(10, 4, torch.float32, "adam", mode, 1.0)
        assert (s.fast_bytes, s.slow_bytes) == (10 * (16 + 32), 0)
    # machine bytes = explicit sum of the shards of ranks 0..L-1 (N % W != 0)
    n, w, lws = 1003, 16, 8
    for mode, x in [(Mode.CACHING, 0.25), (Mode.HYBRID, 0.7)]:
        m = machine_storage(n, w, lws, 8, torch.float32, "adagrad", mode, x)
        per = [shard_storage(local_rows(n, w, r), 8, torch.float32, "adagrad", mode, x) for r in range(lws)]
        assert m.fast_bytes == sum(p.fast_bytes for p in per)
        assert m.slow_bytes == sum(p.slow_bytes for p in per)


# ------------------------------------------------------------ cost models ----
def test_generalized_harmonic_and_zipf_hit() -> None:
    for alpha in (0.0, 0.5, 1.0, 1.05, 2.0):
        n = np.array([0, 1, 17, 4096, 4097, 30000])
        ref = [sum(i**-alpha for i in range(1, k + 1)) for k in n]
        np.testing.assert_allclose(generalized_harmonic(n, alpha), ref, rtol=1e-10)
    t = TableSpec(name="t", rows=20000, dim=8, zipf_alpha=1.05)
    ref = sum(i**-1.05 for i in range(1, 6001)) / sum(i**-1.05 for i in range(1, 20001))
    assert fast_tier_hit_rate(t, Mode.CACHING, 0.3) == pytest.approx(ref, rel=1e-9)
    assert fast_tier_hit_rate(t, Mode.HYBRID, 0.3) == 0.3
    assert fast_tier_hit_rate(t, Mode.CACHING, 1.0) == 1.0
    counts = [1, 50, 3, 0, 46]
    tc = TableSpec(name="c", rows=5, dim=8, access_counts=counts)
    assert fast_tier_hit_rate(tc, Mode.CACHING, 0.4) == pytest.approx((50 + 46) / 100)


def test_empirical_model_reproduces_seed_sweep_ratios() -> None:
    # PR #508 A10 sweep: HBM-only 0.80 ms, CACHING@<1 2.63 ms, HYBRID@<1 5.44 ms.
    t = TableSpec(name="t", rows=4_000_000, dim=128, optimizer="adam")
    c_hbm, c_cache, c_hyb = EmpiricalCostModel().costs(
        t, [(Mode.HYBRID, 1.0), (Mode.CACHING, 0.0001), (Mode.HYBRID, 0.0001)]
    )
    assert c_cache / c_hbm == pytest.approx(2.63 / 0.80, rel=0.05)
    assert c_hyb / c_hbm == pytest.approx(5.44 / 0.80, rel=0.05)
    # tie-break: larger x cheaper within a mode
    a, b = EmpiricalCostModel().costs(t, [(Mode.CACHING, 0.2), (Mode.CACHING, 0.8)])
    assert b < a


# -------------------------------------------------------------- proposers ----
@st.composite
def knapsacks(draw: st.DrawFn):
    m = draw(st.integers(1, 5))
    k = draw(st.integers(1, 4))
    ints = st.integers(0, 25)
    hbm = np.array(draw(st.lists(ints, min_size=m * k, max_size=m * k))).reshape(m, k)
    ddr = np.array(draw(st.lists(ints, min_size=m * k, max_size=m * k))).reshape(m, k)
    cost = np.array(draw(st.lists(st.floats(0, 10), min_size=m * k, max_size=m * k))).reshape(m, k)
    holes = np.array(draw(st.lists(st.booleans(), min_size=m * k, max_size=m * k))).reshape(m, k)
    cost[holes & (np.arange(k)[None, :] > 0)] = np.inf  # option 0 always exists
    return hbm, ddr, cost, draw(st.integers(0, 70)), draw(st.integers(0, 70))


def exhaustive(hbm, ddr, cost, H, D):
    m, k = cost.shape
    best = math.inf
    for combo in itertools.product(range(k), repeat=m):
        r = np.arange(m)
        idx = np.array(combo)
        if hbm[r, idx].sum() <= H and ddr[r, idx].sum() <= D:
            best = min(best, cost[r, idx].sum())
    return best


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(knapsacks())
def test_dp_equals_brute_force_random(inst) -> None:
    hbm, ddr, cost, H, D = inst
    ref = exhaustive(hbm, ddr, cost, H, D)
    dp = KnapsackProposer(bins=(max(H, 1), max(D, 1))).solve(hbm, ddr, cost, H, D)  # 1 byte per bin
    # the DP alone (no repair step) must be exact with one bin per byte too
    dp_only = KnapsackProposer(bins=(max(H, 1), max(D, 1)), repair=False).solve(hbm, ddr, cost, H, D)
    bf = BruteForceProposer().solve(hbm, ddr, cost, H, D)
    r = np.arange(cost.shape[0])
    for sol in (dp, dp_only, bf):
        if math.isinf(ref):
            assert sol is None
        else:
            assert sol is not None
            assert hbm[r, sol].sum() <= H and ddr[r, sol].sum() <= D
            assert cost[r, sol].sum() == pytest.approx(ref, rel=1e-12, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**31),
    st.integers(2, 12),
    st.floats(0.15, 0.9),
    st.floats(0.15, 0.9),
    st.sampled_from(["native", "fbgemm"]),
)
def test_planner_never_exceeds_budgets_coarse_bins(seed: int, m: int, hf: float, df: float, backend: str) -> None:
    rng = np.random.default_rng(seed)
    tables = [
        TableSpec(
            name=f"t{i}",
            rows=int(rng.integers(10**5, 10**8)),
            dim=int(rng.choice([16, 64, 128])),
            optimizer=str(rng.choice(["sgd", "adam", "rowwise_adagrad"])),
            lookups_per_step=float(rng.integers(100, 10**5)),
            zipf_alpha=float(rng.uniform(0.5, 1.5)),
        )
        for i in range(m)
    ]
    full = sum(
        shard_storage(max_local_rows(t.rows, 8), t.dim, t.dtype, t.optimizer, Mode.HYBRID, 1.0).fast_bytes
        for t in tables
    )
    mach = sum(machine_storage(t.rows, 8, 8, t.dim, t.dtype, t.optimizer, Mode.CACHING, 0.5).slow_bytes for t in tables)
    planner = PlacementPlanner(
        topo(hbm=int(full * hf / 0.85) + 1, ddr_per_rank=int(mach * df) // 8 + 1), bins=(20, 10), backend=backend
    )
    try:
        plan = planner.plan(tables)
    except PlacementPlannerError:
        return
    assert plan.backend == backend
    assert plan.hbm_bytes_per_rank <= planner.hbm_budget
    assert plan.ddr_bytes_per_machine <= planner.ddr_budget
    # exact bytes reported are the backend's storage formulas' bytes
    for p, t in zip(plan.placements, tables):
        if p.fused:  # the whole table on its owner, torchrec's FUSED kernel: values and state in HBM
            assert p.rank in range(8) and (p.hbm_bytes_per_rank, p.ddr_bytes_per_rank) == (
                t.rows * row_bytes(t.dim, t.dtype, t.optimizer),
                0,
            )
            continue
        rows = t.rows if p.table_wise else max_local_rows(t.rows, 8)  # a table-wise table is one whole shard
        if backend == "fbgemm":
            s = fbgemm_shard_storage(rows, t.dim, t.dtype, t.optimizer, p.mode, p.cache_load_factor, "lfu")
        else:
            s = shard_storage(rows, t.dim, t.dtype, t.optimizer, p.mode, p.cache_load_factor)
        assert (p.hbm_bytes_per_rank, p.ddr_bytes_per_rank) == (s.fast_bytes, s.slow_bytes)


def test_dp_default_bins_close_to_brute_force() -> None:
    rng = np.random.default_rng(7)
    model = AnalyticCostModel()
    gaps = []
    for _ in range(5):
        tables = [
            TableSpec(
                name=f"t{i}",
                rows=int(rng.integers(10**6, 10**8)),
                dim=64,
                lookups_per_step=float(rng.integers(1000, 10**5)),
            )
            for i in range(4)
        ]
        opts = GridPlacementEnumerator(8, 8, model, (0.25, 0.5, 0.75, 1.0)).enumerate(tables)
        hbm, ddr, cost = options_to_arrays(opts)
        H, D = int(hbm.max(axis=1).sum() * 0.5), int(ddr.max(axis=1).sum() * 0.6)
        bf = BruteForceProposer().solve(hbm, ddr, cost, H, D)
        dp = KnapsackProposer().solve(hbm, ddr, cost, H, D)
        r = np.arange(4)
        if bf is None:
            continue
        assert dp is not None and hbm[r, dp].sum() <= H and ddr[r, dp].sum() <= D
        gaps.append(cost[r, dp].sum() / cost[r, bf].sum() - 1)
    assert gaps and max(gaps) <= 0.01


def _random_tables(rng: np.random.Generator, m: int) -> List[TableSpec]:
    return [
        TableSpec(
            name=f"t{i}",
            rows=int(rng.integers(10**5, 2 * 10**8)),
            dim=int(rng.choice([32, 64, 128, 256])),
            optimizer=str(rng.choice(["adam", "rowwise_adagrad", "sgd"])),
            lookups_per_step=float(rng.integers(10**3, 10**6)),
            zipf_alpha=float(rng.uniform(0.6, 1.4)),
        )
        for i in range(m)
    ]


def test_dp_default_bins_gap_random_six_tables() -> None:
    # The gap target (<= 1% vs the exact solver) on random 6-table instances,
    # for the DP alone (repair=False) and for the full proposer; never over budget.
    rng = np.random.default_rng(2024)
    model = AnalyticCostModel()
    gaps: List[float] = []
    dp_only_gaps: List[float] = []
    for _ in range(24):
        tabs = _random_tables(rng, 6)
        hbm, ddr, cost = options_to_arrays(GridPlacementEnumerator(8, 8, model).enumerate(tabs))
        H = int(hbm.max(axis=1).sum() * rng.uniform(0.3, 0.8))
        D = int(ddr.max(axis=1).sum() * rng.uniform(0.3, 0.8))
        bf = BruteForceProposer().solve(hbm, ddr, cost, H, D)
        full = KnapsackProposer().solve(hbm, ddr, cost, H, D)
        bare = KnapsackProposer(repair=False).solve(hbm, ddr, cost, H, D)
        r = np.arange(6)
        for sol in (full, bare):
            if sol is not None:
                assert hbm[r, sol].sum() <= H and ddr[r, sol].sum() <= D
        if bf is None:
            assert full is None and bare is None
            continue
        assert full is not None and bare is not None
        ref = cost[r, bf].sum()
        gaps.append(cost[r, full].sum() / ref - 1)
        dp_only_gaps.append(cost[r, bare].sum() / ref - 1)
        assert gaps[-1] <= dp_only_gaps[-1] + 1e-12  # the repair never makes a plan worse
    assert len(gaps) >= 10
    assert max(dp_only_gaps) <= 0.01 and max(gaps) <= 0.01


@pytest.mark.parametrize("backend,policy", [("native", "lfu"), ("fbgemm", "lfu"), ("fbgemm", "lru")])
def test_bulk_enumeration_equals_storage_formulas(backend: str, policy: str) -> None:
    # Independent reference: the scalar storage functions of the backend and fast_tier_hit_rate.
    rng = np.random.default_rng(3)
    tables = _random_tables(rng, 12) + [
        TableSpec(name="tiny", rows=5, dim=8, optimizer="rowwise_adagrad"),  # N < W: ranks with 0 rows
        TableSpec(name="even", rows=64 * 1000, dim=16, optimizer="sgd"),  # W divides N
        TableSpec(name="counts", rows=6, dim=4, access_counts=[5, 1, 0, 9, 2, 2]),
        TableSpec(name="sets", rows=64 * 40 + 3, dim=12, optimizer="adam"),  # CACHING: 1 set, then several
    ]

    def shard(t: TableSpec, rows: int, mode: Mode, x: float) -> ShardStorage:
        if backend == "fbgemm":
            return fbgemm_shard_storage(rows, t.dim, t.dtype, t.optimizer, mode, x, policy)
        return shard_storage(rows, t.dim, t.dtype, t.optimizer, mode, x)

    xs = (0.01, 0.1, 0.25, 0.3, 0.7, 0.3333333333333333, 1.0)  # 1/3: int64 products overflow -> scalar path
    for world, local in [(8, 8), (64, 8), (12, 4)]:
        cons = {
            "t1": PlacementConstraints(mode="CACHING"),
            "t2": PlacementConstraints(load_factors=[0.5, 1.0]),
            "sets": PlacementConstraints(mode="CACHING"),
        }
        enum = GridPlacementEnumerator(
            world,
            local,
            AnalyticCostModel(backend=backend),
            xs,
            cons,
            backend=backend,
            cache_policy=policy,
            sharding_types=("row_wise",),
        )
        arrays = enum.enumerate_arrays(tables)
        for i, t in enumerate(tables):
            cands = enum.candidates(t)
            assert int((arrays.modes[i] >= 0).sum()) == len(cands)
            for j, (mode, x) in enumerate(cands):
                o = arrays.option(i, j)
                rank = shard(t, max_local_rows(t.rows, world), mode, x)
                if backend == "native":
                    mach = machine_storage(t.rows, world, local, t.dim, t.dtype, t.optimizer, mode, x)
                else:
                    mach = ShardStorage(
                        sum(shard(t, local_rows(t.rows, world, r), mode, x).fast_bytes for r in range(local)),
                        sum(shard(t, local_rows(t.rows, world, r), mode, x).slow_bytes for r in range(local)),
                    )
                assert (o.mode, o.cache_load_factor) == (mode, x)
                assert (o.hbm_bytes_per_rank, o.ddr_bytes_per_rank) == (rank.fast_bytes, rank.slow_bytes)
                assert (o.hbm_bytes_per_machine, o.ddr_bytes_per_machine) == (mach.fast_bytes, mach.slow_bytes)
                # price: values at the rows' hit rate; optimizer state with its row, except in
                # fbgemm's layout (row-wise state in HBM; other state of CACHING x < 1 in UVM)
                hit = fast_tier_hit_rate(t, mode, x)
                value = t.dim * 4
                state = row_bytes(t.dim, t.dtype, t.optimizer) - value
                state_hit = hit
                if backend == "fbgemm" and t.optimizer is FusedOptimizerKind.ROWWISE_ADAGRAD:
                    state_hit = 1.0
                elif backend == "fbgemm" and mode is Mode.CACHING and x < 1:
                    state_hit = 0.0
                hbm_bw, h2d_bw = enum.cost_model.hbm_mem_bw, enum.cost_model.hbm_to_ddr_mem_bw
                ref = t.lookups_per_step * (
                    value / (hit * hbm_bw + (1 - hit) * h2d_bw)
                    + state / (state_hit * hbm_bw + (1 - state_hit) * h2d_bw)
                )
                assert o.cost == pytest.approx(ref, rel=1e-12)
        assert arrays.to_options() == enum.enumerate(tables)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(knapsacks())
def test_prune_dominated_keeps_the_optimum(inst) -> None:
    from recpipe.planner.knapsack import prune_dominated

    hbm, ddr, cost, H, D = inst
    usable = np.isfinite(cost)
    keep = prune_dominated(hbm, ddr, cost, usable)
    assert (keep <= usable).all() and (keep.any(axis=1) == usable.any(axis=1)).all()
    for i, j in zip(*np.nonzero(usable & ~keep)):  # every dropped option has a kept dominator
        ok = keep[i] & (hbm[i] <= hbm[i, j]) & (ddr[i] <= ddr[i, j]) & (cost[i] <= cost[i, j])
        assert ok.any()
    assert exhaustive(hbm, ddr, np.where(keep, cost, np.inf), H, D) == exhaustive(hbm, ddr, cost, H, D)


def test_repair_only_improves_and_keeps_budgets() -> None:
    from recpipe.planner.proposers import _DpProblem, _repair

    rng = np.random.default_rng(11)
    for _ in range(30):
        m, k = int(rng.integers(2, 9)), int(rng.integers(2, 6))
        hbm = rng.integers(0, 50, (m, k))
        ddr = rng.integers(0, 50, (m, k))
        cost = rng.uniform(0, 10, (m, k))
        start = rng.integers(0, k, m)
        r = np.arange(m)
        H, D = int(hbm[r, start].sum()) + int(rng.integers(0, 20)), int(ddr[r, start].sum()) + int(rng.integers(0, 20))
        out = _repair(_DpProblem(hbm, ddr, cost, cost, np.ones((m, k), bool), H, D), start.copy(), 256, 400_000)
        assert hbm[r, out].sum() <= H and ddr[r, out].sum() <= D
        assert cost[r, out].sum() <= cost[r, start].sum() + 1e-12
        # no single-table change improves the result any more (1-opt local optimum)
        for i in range(m):
            for j in range(k):
                alt = out.copy()
                alt[i] = j
                if hbm[r, alt].sum() <= H and ddr[r, alt].sum() <= D:
                    assert cost[r, alt].sum() >= cost[r, out].sum() - 1e-9


def test_large_instance_plans_within_budgets() -> None:
    # 300 tables x 64 ranks with both budgets binding: a plan exists (all HYBRID at
    # x = 0.5 fits by construction) and the DP must find one within budgets.
    rng = np.random.default_rng(5)
    tables = _random_tables(rng, 300)
    enum = GridPlacementEnumerator(64, 8, AnalyticCostModel(), sharding_types=("row_wise",))
    hbm, ddr, _ = options_to_arrays(enum.enumerate(tables))
    t = Topology(
        world_size=64,
        local_world_size=8,
        compute_device="cuda",
        hbm_cap=int(hbm.max(axis=1).sum() * 0.6 / 0.85),
        ddr_cap=int(ddr.max(axis=1).sum() * 0.75) // 8,
    )
    planner = PlacementPlanner(t, sharding_types=("row_wise",), communication=ZERO_COMM)
    plan = planner.plan(tables)
    assert plan.hbm_bytes_per_rank <= planner.hbm_budget and plan.ddr_bytes_per_machine <= planner.ddr_budget
    assert plan.hbm_bytes_per_rank > 0.9 * planner.hbm_budget  # the tight HBM budget is used, not wasted
    # an independent feasible plan (every table HYBRID at x = 0.5) is never cheaper
    half = [
        next(o for o in opts if o.mode is Mode.HYBRID and o.cache_load_factor == 0.5) for opts in enum.enumerate(tables)
    ]
    assert sum(o.hbm_bytes_per_rank for o in half) <= planner.hbm_budget
    assert sum(o.ddr_bytes_per_machine for o in half) <= planner.ddr_budget
    assert plan.total_cost < sum(o.cost for o in half)


# ------------------------------------------------------- planner behaviour ----
def _one_table(rows: int = 8_000_000, dim: int = 64, **kw) -> TableSpec:
    return TableSpec(name="t", rows=rows, dim=dim, optimizer="sgd", lookups_per_step=10_000, zipf_alpha=1.05, **kw)


def test_caching_when_ddr_generous_hybrid_when_tight() -> None:
    t = _one_table()
    full_rank = shard_storage(max_local_rows(t.rows, 8), 64, torch.float32, "sgd", Mode.HYBRID, 1.0).fast_bytes
    hbm = int(full_rank * 0.45 / 0.85)  # x=1 cannot fit
    generous = PlacementPlanner(topo(hbm=hbm, ddr_per_rank=full_rank * 4)).plan([t])
    assert generous.placements[0].mode is Mode.CACHING and generous.placements[0].cache_load_factor < 1
    # DDR below one full backing store per machine: only HYBRID fits
    tight_ddr = int(full_rank * 8 * 0.9) // 8
    tight = PlacementPlanner(topo(hbm=hbm, ddr_per_rank=tight_ddr)).plan([t])
    assert tight.placements[0].mode is Mode.HYBRID and tight.placements[0].cache_load_factor < 1
    assert tight.ddr_bytes_per_machine <= tight_ddr * 8


def test_shared_ddr_forces_different_modes() -> None:
    a, b = _one_table(), TableSpec(**{**_one_table().__dict__, "name": "u"})
    full = shard_storage(max_local_rows(a.rows, 8), 64, torch.float32, "sgd", Mode.HYBRID, 1.0).fast_bytes
    # HBM for ~0.45 of each table; DDR for one full backing store plus one HYBRID remainder.
    planner = PlacementPlanner(
        topo(hbm=int(full * 0.95 / 0.85), ddr_per_rank=int(full * 1.6)), sharding_types=("row_wise",)
    )
    plan = planner.plan([a, b])
    assert {p.mode for p in plan.placements} == {Mode.CACHING, Mode.HYBRID}
    # both CACHING would need 2 full backing stores per machine, more than the budget
    assert 2 * 8 * full > planner.ddr_budget
    # and the DP plan costs what the exact solver finds
    hbm, ddr, cost = options_to_arrays(planner.enumerator.enumerate([a, b]))
    bf = BruteForceProposer().solve(hbm, ddr, cost, planner.hbm_budget, planner.ddr_budget)
    assert plan.total_cost == pytest.approx(cost[[0, 1], bf].sum(), rel=0.01)


def test_pinned_constraints_respected() -> None:
    tables = [_one_table(), TableSpec(**{**_one_table().__dict__, "name": "u"})]
    full = shard_storage(max_local_rows(tables[0].rows, 8), 64, torch.float32, "sgd", Mode.HYBRID, 1.0).fast_bytes
    cons = {"t": PlacementConstraints(mode="HYBRID"), "u": PlacementConstraints(cache_load_factor=0.3)}
    plan = PlacementPlanner(topo(hbm=full * 3, ddr_per_rank=full * 4), constraints=cons).plan(tables)
    t, u = plan.placement("t"), plan.placement("u")
    assert t.mode is Mode.HYBRID  # x may be 1.0 (mode-independent "all in HBM")
    assert u.cache_load_factor == 0.3
    with pytest.raises(PlacementPlannerError) as e:
        PlacementPlanner(topo(), constraints={"nope": PlacementConstraints(mode="CACHING")}).plan(tables)
    assert e.value.planner_error_type is PlacementErrorType.INPUT_VALIDATION


def test_x_one_handling_and_empty_model() -> None:
    t = _one_table()
    enum = GridPlacementEnumerator(8, 8, AnalyticCostModel())
    cands = enum.candidates(t)
    assert sum(x == 1.0 for _, x in cands) == 1 and len(cands) == 19
    plan = PlacementPlanner(topo()).plan([t])  # 80 GiB HBM: everything fits
    p = plan.placements[0]
    assert p.cache_load_factor == 1.0 and p.ddr_bytes_per_rank == 0 and p.ddr_bytes_per_machine == 0
    empty = PlacementPlanner(topo()).plan([])
    assert empty.placements == [] and empty.total_cost == 0.0
    assert empty.to_sharding_plan().plan == {}


def test_infeasible_raises_typed_error_with_numbers() -> None:
    t = _one_table(rows=400_000_000, dim=128)
    with pytest.raises(PlacementPlannerError) as e:
        PlacementPlanner(topo(hbm=1 * GiB, ddr_per_rank=1 * GiB)).plan([t])
    assert e.value.planner_error_type is PlacementErrorType.TABLE_DOES_NOT_FIT
    msg = str(e.value)
    assert "'t'" in msg and "Possible solutions" in msg and "1)" in msg and "2)" in msg
    small = [_one_table(rows=10**7) for _ in range(1)] + [
        TableSpec(**{**_one_table(rows=10**7).__dict__, "name": f"x{i}"}) for i in range(30)
    ]
    with pytest.raises(PlacementPlannerError) as e:
        PlacementPlanner(topo(hbm=GiB, ddr_per_rank=64 * GiB)).plan(small)
    assert e.value.planner_error_type is PlacementErrorType.INSUFFICIENT_HBM
    # a cuda topology budgets fbgemm's tables (the default backend there)
    min_h = sum(
        fbgemm_shard_storage(max_local_rows(10**7, 8), 64, torch.float32, "sgd", Mode.HYBRID, 0.1, "lfu").fast_bytes
        for _ in small
    )
    assert f"({min_h} B)" in str(e.value)


def _quoted_caps(solution: str) -> Tuple[Optional[int], Optional[int]]:
    """(hbm_cap, ddr_cap per rank) a "Possible solutions" line asks for, None where it names none."""
    h = re.search(r"hbm_cap\) to at least \d+\.\d\d [KMGT]iB \((\d+) B\)", solution)
    d = re.search(r"DDR per machine to at least \d+\.\d\d [KMGT]iB \((\d+) B; ddr_cap (\d+) B per rank\)", solution)
    if d is not None:
        assert int(d.group(1)) == 2 * int(d.group(2))  # local_world_size 2
    return (int(h.group(1)) if h else None), (int(d.group(2)) if d else None)


def test_infeasible_solutions_quote_the_smallest_capacities_that_work() -> None:
    # Each capacity a solution quotes is exact: the plan fits with it and not with 1 byte less
    # (per rank), and a budget the option already meets is not named.
    t = TableSpec(name="t", rows=1_000_000, dim=64, optimizer="adam")
    H0, D0 = 10 * 2**20, 50 * 2**20

    def plan(hbm: int, ddr: int, pin: Optional[PlacementConstraints] = None) -> None:
        PlacementPlanner(
            topo(2, 2, hbm=hbm, ddr_per_rank=ddr), backend="native", constraints={"t": pin} if pin else None
        ).plan([t])

    with pytest.raises(PlacementPlannerError) as e:
        plan(H0, D0)
    assert e.value.planner_error_type is PlacementErrorType.TABLE_DOES_NOT_FIT
    sols = re.findall(r"^  \d\) (raise .*)$", str(e.value), re.M)
    assert len(sols) == 2, str(e.value)  # the smallest-HBM and the smallest-DDR option
    for sol in sols:
        mode, x = re.search(r"the table's (HYBRID|CACHING) x=([0-9.]+) option", sol).groups()
        pin = PlacementConstraints(mode=mode, cache_load_factor=float(x))
        hbm, ddr = _quoted_caps(sol)
        assert hbm is not None or ddr is not None
        plan(hbm or H0, ddr or D0, pin)
        for less in ([(hbm - 1, ddr or D0)] if hbm else []) + ([(hbm or H0, ddr - 1)] if ddr else []):
            with pytest.raises(PlacementPlannerError):
                plan(*less, pin)
    # HBM enough for the smallest-HBM option (x = 0.1): only DDR is named for it
    with pytest.raises(PlacementPlannerError) as e:
        plan(64 * 2**20, D0)
    first = re.findall(r"^  1\) (raise .*)$", str(e.value), re.M)[0]
    assert "x=0.1 option" in first and "hbm_cap" not in first and _quoted_caps(first)[1] is not None

    # INSUFFICIENT_HBM: the quoted hbm_cap plans the tables, 1 byte less does not
    many = [TableSpec(name=f"x{i}", rows=10**6, dim=64, optimizer="sgd") for i in range(8)]
    with pytest.raises(PlacementPlannerError) as e:
        PlacementPlanner(topo(2, 2, hbm=40 * 2**20, ddr_per_rank=64 * GiB), backend="native").plan(many)
    assert e.value.planner_error_type is PlacementErrorType.INSUFFICIENT_HBM
    hbm, _ = _quoted_caps(str(e.value))
    assert hbm is not None
    PlacementPlanner(topo(2, 2, hbm=hbm, ddr_per_rank=64 * GiB), backend="native").plan(many)
    with pytest.raises(PlacementPlannerError):
        PlacementPlanner(topo(2, 2, hbm=hbm - 1, ddr_per_rank=64 * GiB), backend="native").plan(many)


def test_a_table_that_fits_nowhere_also_names_what_the_whole_model_needs() -> None:
    # Two tables that each fit neither budget alone: raising the budgets to what one table
    # needs (solutions 1, 2) still fails for the pair. The line for all tables quotes one
    # pair of capacities that plans them, and neither can be a byte smaller (HBM: the sum of
    # each table's least HBM, checked against the storage formulas; DDR: what those options
    # need), so following one line of the first error is enough.
    ts = [TableSpec(name=f"t{i}", rows=10**7, dim=64, optimizer="sgd") for i in range(2)]
    H0, D0 = 2**20, 2**20

    def plan(hbm: int, ddr: int) -> None:
        PlacementPlanner(topo(2, 2, hbm=hbm, ddr_per_rank=ddr), backend="native").plan(ts)

    with pytest.raises(PlacementPlannerError) as e:
        plan(H0, D0)
    assert e.value.planner_error_type is PlacementErrorType.TABLE_DOES_NOT_FIT
    one = re.search(r"^  1\) (raise .*)$", str(e.value), re.M).group(1)
    with pytest.raises(PlacementPlannerError):  # one table's raise is not enough for two
        plan(*(c or d for c, d in zip(_quoted_caps(one), (H0, D0))))
    whole = re.search(r"^  \d\) (for all 2 tables together, raise .*)$", str(e.value), re.M)
    assert whole is not None, str(e.value)
    hbm, ddr = _quoted_caps(whole.group(1))
    assert hbm is not None and ddr is not None
    plan(hbm, ddr)
    for less in ((hbm - 1, ddr), (hbm, ddr - 1)):
        with pytest.raises(PlacementPlannerError):
            plan(*less)
    # the HBM quoted is each table's least HBM (x = 0.1 HYBRID: its hot rows) from the byte formulas
    rows = max_local_rows(10**7, 2)
    least = shard_storage(rows, 64, torch.float32, "sgd", Mode.HYBRID, 0.1).fast_bytes
    assert re.search(rf"needs \d+\.\d\d [KMGT]iB \({2 * least} B\) of HBM per rank", whole.group(1))


def test_infeasible_pair_of_budgets_offers_a_finer_grid_only_when_it_can_help() -> None:
    # Two tables that each fit alone, but whose options fitting the tiny DDR budget (all
    # in HBM) overflow HBM together: no plan exists whatever the grid.
    ts = [TableSpec(name=n, rows=100_000, dim=64, optimizer="adam") for n in ("a", "b")]
    with pytest.raises(PlacementPlannerError) as e:
        PlacementPlanner(topo(2, 2, hbm=60 * 2**20, ddr_per_rank=2**20), backend="native").plan(ts)
    assert e.value.planner_error_type is PlacementErrorType.INSUFFICIENT_STORAGE
    assert "finer DP grid" not in str(e.value) and "bins now" not in str(e.value)
    hbm, _ = _quoted_caps(re.search(r"^  2\) (.*)$", str(e.value), re.M).group(1))  # the lowest-DDR plan
    PlacementPlanner(topo(2, 2, hbm=hbm, ddr_per_rank=2**20), backend="native").plan(ts)


def test_cuda_plans_budget_fbgemm_bytes_and_cpu_plans_native_bytes() -> None:
    """Row-wise Adagrad keeps a float per row in HBM for fbgemm's UVM rows too, and a
    HYBRID shard adds its int32 split map: a budget that recpipe's own layout just meets
    is too small for fbgemm's tables. A cuda topology plans fbgemm's bytes by default."""
    t = TableSpec(name="t", rows=8_000_000, dim=64, optimizer="rowwise_adagrad", lookups_per_step=10_000)
    rows = max_local_rows(t.rows, 8)
    native = shard_storage(rows, 64, torch.float32, "rowwise_adagrad", Mode.HYBRID, 0.5)
    fbgemm = fbgemm_shard_storage(rows, 64, torch.float32, "rowwise_adagrad", Mode.HYBRID, 0.5, "lfu")
    assert fbgemm.fast_bytes == native.fast_bytes + (rows - rows // 2) * 4 + rows * 4
    pin = {"t": PlacementConstraints(mode="HYBRID")}
    budget = topo(hbm=int(native.fast_bytes / 0.85) + 2)  # hbm_reservation 0.15
    cpu_plan = PlacementPlanner(budget, constraints=pin, backend="native").plan([t])
    assert (cpu_plan.backend, cpu_plan.placements[0].cache_load_factor) == ("native", 0.5)
    assert cpu_plan.hbm_bytes_per_rank == native.fast_bytes
    planner = PlacementPlanner(budget, constraints=pin)
    assert planner.backend == "fbgemm"
    plan = planner.plan([t])
    p = plan.placements[0]
    assert (plan.backend, p.cache_load_factor) == ("fbgemm", 0.4)  # 0.5 does not fit
    got = fbgemm_shard_storage(rows, 64, torch.float32, "rowwise_adagrad", Mode.HYBRID, 0.4, "lfu")
    assert p.hbm_bytes_per_rank == got.fast_bytes <= planner.hbm_budget < fbgemm.fast_bytes
    assert "backend=fbgemm" in plan.report()
    assert PlacementPlan.from_dict(plan.to_dict()) == plan
    legacy = plan.to_dict()
    del legacy["backend"]  # plans saved before the backend was recorded budgeted recpipe's layout
    assert PlacementPlan.from_dict(legacy).backend == "native"
    assert PlacementPlanner(topo(), backend=None).backend == "fbgemm"
    cpu = Topology(world_size=8, local_world_size=8, compute_device="cpu", hbm_cap=GiB, ddr_cap=GiB)
    assert PlacementPlanner(cpu).backend == "native"
    with pytest.raises(ValueError, match="backend must be one of"):
        PlacementPlanner(topo(), backend="torch")


def test_cuda_plans_price_optimizer_state_where_fbgemm_keeps_it() -> None:
    """fbgemm's cache holds values only: Adam's two moments of a CACHING (x < 1) table are
    read from UVM on every lookup, while row-wise Adagrad's one float per row stays in HBM.
    With HBM for ~45% of a skewed table, recpipe's own layout (state cached with its row)
    plans CACHING; fbgemm's plans HYBRID for Adam and still CACHING without UVM state."""
    rows = max_local_rows(8_000_000, 8)

    def plan(optimizer: str, backend: str) -> Tuple[Mode, float]:
        t = TableSpec(name="t", rows=8_000_000, dim=64, optimizer=optimizer, lookups_per_step=10_000, zipf_alpha=1.05)
        full = fbgemm_shard_storage(rows, 64, torch.float32, optimizer, Mode.HYBRID, 1.0, "lfu").fast_bytes
        p = (
            PlacementPlanner(topo(hbm=int(full * 0.45 / 0.85), ddr_per_rank=full * 4), backend=backend)
            .plan([t])
            .placements[0]
        )
        assert p.cache_load_factor < 1
        return p.mode, p.cache_load_factor

    assert plan("adam", "native")[0] is Mode.CACHING
    assert plan("adam", "fbgemm")[0] is Mode.HYBRID
    assert plan("sgd", "fbgemm")[0] is Mode.CACHING
    assert plan("rowwise_adagrad", "fbgemm")[0] is Mode.CACHING
    # the price, by hand: 256 value bytes at the cache's hit rate, 512 state bytes from UVM
    t = TableSpec(name="t", rows=8_000_000, dim=64, optimizer="adam", lookups_per_step=10_000, zipf_alpha=1.05)
    model = AnalyticCostModel(backend="fbgemm")
    hit = fast_tier_hit_rate(t, Mode.CACHING, 0.3)
    bw = hit * model.hbm_mem_bw + (1 - hit) * model.hbm_to_ddr_mem_bw
    caching, hybrid = model.costs(t, [(Mode.CACHING, 0.3), (Mode.HYBRID, 0.3)])
    assert caching == pytest.approx(10_000 * (256 / bw + 512 / model.hbm_to_ddr_mem_bw), rel=1e-12)
    assert hybrid == pytest.approx(AnalyticCostModel().costs(t, [(Mode.HYBRID, 0.3)])[0], rel=1e-12)
    assert PlacementPlanner(topo()).cost_model.backend == "fbgemm"  # type: ignore[attr-defined]
    with pytest.raises(
        ValueError,
        match=r"cost_model prices the 'native' layout but backend is 'fbgemm': "
        r"build it with the same backend, e.g. AnalyticCostModel\(backend='fbgemm'\)",
    ):
        GridPlacementEnumerator(8, 8, AnalyticCostModel(), backend="fbgemm")
    with pytest.raises(ValueError, match="backend must be one of"):
        AnalyticCostModel(backend="torch")


def test_planner_refuses_tables_no_tiered_table_runs() -> None:
    # The tiered runtime (TieredEmbeddingShard, every backend) holds float32 rows and runs
    # sgd / rowwise_adagrad / adam; fbgemm's TBE also needs dim % 4 == 0. A plan it cannot
    # build is refused at plan time, naming the table, not later at sharding.
    cases = [
        (dict(dim=6, optimizer="sgd"), ("fbgemm",), r"dim 6 is not a multiple of 4", "backend='native'"),
        (
            dict(dim=8, optimizer="adagrad"),
            ("fbgemm", "native"),
            r"fused optimizer adagrad is not one tiered tables "
            r"run \(\['adam', 'rowwise_adagrad', 'sgd'\]\)",
            "apply_optimizer_in_backward",
        ),
        (
            dict(dim=8, optimizer="sgd", dtype="float16"),
            ("fbgemm", "native"),
            r"dtype float16 is not one tiered "
            r"tables hold \(\['float32'\]\)",
            "DataType.FP32",
        ),
    ]
    for spec, backends, why, fix in cases:
        t = TableSpec(name="odd", rows=1000, **spec)
        for backend in backends:
            with pytest.raises(PlacementPlannerError, match=why) as e:
                PlacementPlanner(topo(), backend=backend).plan([t])
            assert e.value.planner_error_type is PlacementErrorType.INPUT_VALIDATION
            msg = str(e.value)
            assert f"table 'odd' cannot be a tiered table on the {backend} backend" in msg, msg
            assert "Possible solutions:\n  1) " in msg and fix in msg, msg
        if backends == ("fbgemm",):
            assert PlacementPlanner(topo(), backend="native").plan([t]).backend == "native"
    # every problem of a table at once, one solution each
    t = TableSpec(name="bad", rows=1000, dim=6, optimizer="adagrad", dtype="bfloat16")
    with pytest.raises(PlacementPlannerError) as e:
        PlacementPlanner(topo()).plan([t])
    msg = str(e.value)
    assert msg.count("; its ") == 2 and "  3) use a dim that is a multiple of 4 (e.g. 8)" in msg, msg


def test_module_input_sharding_plan_round_trip_and_json(tmp_path: Path) -> None:
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="a", embedding_dim=32, num_embeddings=1_000_003, feature_names=["fa", "fb"]),
            EmbeddingBagConfig(name="b", embedding_dim=16, num_embeddings=999, feature_names=["fc"]),
        ],
        device=torch.device("meta"),
    )
    model = torch.nn.Module()
    model.sparse = ebc
    t = topo(world=4, local=2, hbm=64 * 1024**2, ddr_per_rank=GiB)
    plan = PlacementPlanner(t, batch_size=256, seed=5, sharding_types=("row_wise",)).plan(model)
    assert [p.fqn for p in plan.placements] == ["sparse.a", "sparse.b"]
    sp = plan.to_sharding_plan()
    mp = sp.plan["sparse"]
    for p in plan.placements:
        ps = mp[p.table]
        assert isinstance(ps, PlacementParameterSharding)
        assert ps.sharding_type == ShardingType.ROW_WISE.value and ps.compute_kernel == "customized_kernel"
        assert ps.ranks == [0, 1, 2, 3]
        shards = ps.sharding_spec.shards
        assert [s.shard_sizes[0] for s in shards] == [local_rows(p.rows, 4, r) for r in range(4)]
        assert sum(s.shard_sizes[0] for s in shards) == p.rows
        assert [s.shard_offsets[0] for s in shards] == list(np.cumsum([0] + [s.shard_sizes[0] for s in shards[:-1]]))
        assert shards[3].placement.device().index == 1  # rank 3 on a 2-GPU machine
        fused = add_params_from_parameter_sharding({}, ps)  # torchrec's own hook
        assert fused["recpipe_mode"] == p.mode.value
        assert fused["recpipe_cache_load_factor"] == p.cache_load_factor
        assert fused["recpipe_dist_type"] == "hash_roundrobin" and fused["recpipe_seed"] == 5
    back = placements_from_sharding_plan(sp)
    assert back == {(p.module_path, p.table): (p.mode, p.cache_load_factor) for p in plan.placements}
    plan.save(tmp_path / "plan.json")
    assert PlacementPlan.load(tmp_path / "plan.json") == plan
    assert json.loads((tmp_path / "plan.json").read_text())["placements"][0]["table"] == "a"
    assert "sparse.a" in plan.report() and "HBM per rank" in plan.report()


# -------------------------------------------------------------------- CLI ----
def _write_tables(path: Path) -> None:
    path.write_text(
        "- {name: users, rows: 200000000, dim: 128, dtype: float32, optimizer: adam, lookups_per_step: 65536, zipf_alpha: 1.1}\n"
        "- {name: items, rows: 20000000, dim: 64, optimizer: rowwise_adagrad, lookups_per_step: 65536}\n"
    )


def test_cli_prints_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    y = tmp_path / "tables.yaml"
    _write_tables(y)
    rc = cli_main(
        [
            "--tables",
            str(y),
            "--world-size",
            "16",
            "--local-world-size",
            "8",
            "--hbm",
            "80GiB",
            "--ddr",
            "1TiB",
            "--json",
            str(tmp_path / "p.json"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "users" in out and "items" in out and "DDR per machine" in out
    plan = PlacementPlan.load(tmp_path / "p.json")
    assert plan.world_size == 16 and plan.ddr_budget_per_machine == 2**40
    rc = cli_main(
        ["--tables", str(y), "--world-size", "16", "--local-world-size", "8", "--hbm", "1GiB", "--ddr", "1GiB"]
    )
    assert rc == 2 and "Possible solutions" in capsys.readouterr().err
    # fbgemm's CUDA tables by default; --backend native for recpipe's CPU layout
    odd = tmp_path / "odd.yaml"
    odd.write_text("- {name: odd, rows: 1000, dim: 6, optimizer: sgd}\n")
    base = ["--tables", str(odd), "--world-size", "2", "--hbm", "1GiB", "--ddr", "1TiB"]
    assert cli_main(base) == 2 and "dim 6 is not a multiple of 4" in capsys.readouterr().err
    assert cli_main([*base, "--backend", "native", "--json", str(tmp_path / "n.json")]) == 0
    assert "backend=native" in capsys.readouterr().out
    assert PlacementPlan.load(tmp_path / "n.json").backend == "native"


def test_cli_module_entry_point(tmp_path: Path) -> None:
    y = tmp_path / "tables.yaml"
    _write_tables(y)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "recpipe.planner",
            "--tables",
            str(y),
            "--world-size",
            "16",
            "--local-world-size",
            "8",
            "--hbm",
            "80GiB",
            "--ddr",
            "1TiB",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "recpipe placement plan: world_size=16 local_world_size=8" in res.stdout
    # the topology comes from torchrec's TopologyFactory: no "constructed directly" warning
    assert "constructed directly" not in res.stderr and "WARNING" not in res.stderr, res.stderr


def test_make_topology_equals_a_direct_topology() -> None:
    made = make_topology(world_size=16, local_world_size=8, hbm_cap=80 * GiB, ddr_cap=128 * GiB)
    direct = topo(16, 8, 80 * GiB, 128 * GiB)
    for attr in (
        "world_size",
        "local_world_size",
        "compute_device",
        "hbm_mem_bw",
        "ddr_mem_bw",
        "hbm_to_ddr_mem_bw",
        "intra_host_bw",
        "inter_host_bw",
    ):
        assert getattr(made, attr) == getattr(direct, attr), attr
    assert [(d.storage.hbm, d.storage.ddr) for d in made.devices] == [
        (d.storage.hbm, d.storage.ddr) for d in direct.devices
    ]


def test_bad_input_errors_name_the_argument() -> None:
    # TableSpec validation names the argument and the fix.
    with pytest.raises(ValueError, match="rows must be a positive int"):
        TableSpec(name="x", rows=0, dim=4)
    with pytest.raises(ValueError, match="optimizer"):
        TableSpec(name="x", rows=4, dim=4, optimizer="lion")
    with pytest.raises(ValueError, match="bins"):
        KnapsackProposer(bins=(0, 3))
    tables: List[TableSpec] = []
    assert PlacementPlanner(topo()).plan(tables).placements == []


@pytest.mark.parametrize(
    "table,message",
    [
        (
            "{name: a, rows: 10.7, dim: 8}",
            r"table #0: TableSpec\(a\)\.rows must be a positive int, got 10\.7 \(float\)",
        ),
        ("{name: a, rows: true, dim: 8}", r"table #0: TableSpec\(a\)\.rows must be a positive int, got True \(bool\)"),
        ("{name: a, rows: '100', dim: 8}", r"TableSpec\(a\)\.rows must be a positive int, got '100' \(str\)"),
        ("{name: a, dim: 8}", r"table #0 \(a\) lacks \['rows'\]; every table needs \['name', 'rows', 'dim'\]"),
        (
            "{name: a, rows: 1000000000000000000, dim: 8}",
            r"TableSpec\(a\) needs 96000000000000000000 bytes \(1000000000000000000 rows x 96 bytes per row\), above "
            r"the planner's limit of 2\^62 bytes",
        ),
        ("{name: a, rows: 100, dim: 8, zipf_alpha: .nan}", r"zipf_alpha must be a finite number >= 0"),
        ("{name: a, rows: 100, dim: 8, lookups_per_step: .inf}", r"lookups_per_step must be a finite number >= 0"),
        (
            "{name: null, rows: 100, dim: 8}",
            r"table #0: name is None \(NoneType\); it must be a non-empty string "
            r"\(YAML: quote it, e.g. name: \"user_id\"\)",
        ),
        ("{name: 123, rows: 100, dim: 8}", r"table #0: name is 123 \(int\); it must be a non-empty string"),
        ("{name: ' ', rows: 100, dim: 8}", r"table #0: name is ' ' \(str\); it must be a non-empty string"),
        (
            "{name: a, rows: 100, dim: 8, optimizer: null}",
            r"table #0: optimizer is None \(NoneType\).*optimizer: \"adam\"",
        ),
        ("{name: a, rows: 100, dim: 8, dtype: 16}", r"table #0: dtype is 16 \(int\).*dtype: \"float32\""),
    ],
)
def test_cli_bad_tables_print_one_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], table: str, message: str
) -> None:
    """Bad table files exit 2 with one line naming the file and the table (no traceback);
    YAML values keep their types (10.7 is not 10, true is not 1)."""
    y = tmp_path / "tables.yaml"
    y.write_text(f"- {table}\n")
    rc = cli_main(["--tables", str(y), "--world-size", "2", "--hbm", "1GiB", "--ddr", "1TiB"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert re.search(message, err), err
    assert err.startswith(f"error: {y}: table #0")


def test_cli_bad_files_and_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    y = tmp_path / "tables.yaml"
    _write_tables(y)
    base = ["--hbm", "1GiB", "--ddr", "1TiB"]
    assert cli_main(["--tables", str(tmp_path / "none.yaml"), "--world-size", "2", *base]) == 2
    assert "cannot read the file" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("- {name: a, rows: [1\n")
    assert cli_main(["--tables", str(tmp_path / "bad.yaml"), "--world-size", "2", *base]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    for flags, message in (
        (["--world-size", "0"], r"--world-size must be >= 1 \(the number of ranks\), got 0"),
        (
            ["--world-size", "4", "--local-world-size", "0"],
            r"--local-world-size must be >= 1 \(ranks per machine\), got 0",
        ),
        (["--world-size", "4", "--local-world-size", "3"], r"--local-world-size \(3\) must divide --world-size \(4\)"),
        (
            ["--world-size", "4", "--hbm-reservation", "nan"],
            r"--hbm-reservation must be a fraction in \[0, 1\), got nan",
        ),
        (["--world-size", "4", "--bins", "0", "8"], r"--bins must be two positive ints"),
        (["--world-size", "4", "--hbm", "0"], r"--hbm must be a positive size"),
        # a negative size is a bad size, not "expected one argument" (argparse read -1GiB as a flag)
        (["--world-size", "4", "--hbm", "-1GiB"], r"argument --hbm: bad size '-1GiB': use a number"),
        (["--world-size", "4", "--ddr", "-0.5TiB"], r"argument --ddr: bad size '-0.5TiB': use a number"),
    ):
        with pytest.raises(SystemExit) as exc:
            cli_main(["--tables", str(y), *base, *flags])
        assert exc.value.code == 2
        assert re.search(message, capsys.readouterr().err), flags
    # a bad --json path is refused before planning (nothing printed, nothing planned)
    for bad in (tmp_path / "missing-dir" / "p.json", tmp_path):
        with pytest.raises(SystemExit) as exc:
            cli_main(
                [
                    "--tables",
                    str(y),
                    "--world-size",
                    "16",
                    "--local-world-size",
                    "8",
                    "--hbm",
                    "80GiB",
                    "--ddr",
                    "1TiB",
                    "--json",
                    str(bad),
                ]
            )
        out = capsys.readouterr()
        assert exc.value.code == 2 and f"--json {bad}: not a writable file path" in out.err and out.out == ""
    # per-element Adagrad is not offered (the planner refuses it for every tiered table)
    with pytest.raises(SystemExit) as exc:
        cli_main(["--tables", str(y), "--world-size", "2", *base, "--optimizer", "adagrad"])
    assert exc.value.code == 2 and "invalid choice: 'adagrad'" in capsys.readouterr().err
    # a file that lists no tables is an error, not an empty plan
    for empty in ("", "[]\n"):
        (tmp_path / "empty.yaml").write_text(empty)
        assert cli_main(["--tables", str(tmp_path / "empty.yaml"), "--world-size", "2", *base]) == 2
        assert "the file lists no tables" in capsys.readouterr().err


def test_cli_duplicate_table_names_name_the_file_and_both_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    y = tmp_path / "dup.yaml"
    y.write_text("- {name: a, rows: 10, dim: 8}\n- {name: b, rows: 10, dim: 8}\n- {name: a, rows: 20, dim: 8}\n")
    assert cli_main(["--tables", str(y), "--world-size", "2", "--hbm", "1GiB", "--ddr", "1TiB"]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert out.out == "" and len(lines) == 1, out.err
    assert (
        lines[0] == f"error: {y}: table #2 is named 'a' like table #0; every table needs its own name "
        "(rename one, or drop the duplicate entry)."
    ), lines[0]


def test_cli_omit_hint_is_only_given_for_the_optional_local_world_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --world-size is required: its error must not say "Omit it" (argparse then
    # refuses the command line for the missing flag); --local-world-size may be omitted.
    y = tmp_path / "tables.yaml"
    _write_tables(y)
    base = ["--tables", str(y), "--hbm", "1GiB", "--ddr", "1TiB"]
    with pytest.raises(SystemExit):
        cli_main(base)  # omitting --world-size is itself an error
    assert "the following arguments are required: --world-size" in capsys.readouterr().err
    for flags in (["--world-size", "0"], ["--world-size", "0", "--local-world-size", "0"]):
        with pytest.raises(SystemExit) as exc:
            cli_main([*base, *flags])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "--world-size must be >= 1" in err and "Omit it" not in err, err
    with pytest.raises(SystemExit) as exc:
        cli_main([*base, "--world-size", "4", "--local-world-size", "0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--local-world-size must be >= 1" in err and "Omit it for one machine." in err


def test_insufficient_hbm_also_names_the_ddr_the_least_hbm_plan_needs() -> None:
    # HBM is short, and the only plan the quoted hbm_cap admits (each table at its
    # lowest-HBM option) also overflows DDR: both raises are listed, and together they fit.
    many = [TableSpec(name=f"x{i}", rows=10**6, dim=64, optimizer="sgd") for i in range(6)]

    def plan(hbm: int, ddr: int) -> None:
        PlacementPlanner(topo(2, 2, hbm=hbm, ddr_per_rank=ddr), backend="native").plan(many)

    with pytest.raises(PlacementPlannerError) as e:
        plan(40 * 2**20, 300 * 2**20)
    assert e.value.planner_error_type is PlacementErrorType.INSUFFICIENT_HBM
    assert str(e.value).startswith("Insufficient HBM and DDR for 6 tables.")
    first = re.search(r"^  1\) (.*)$", str(e.value), re.M).group(1)
    second = re.search(r"^  2\) (.*)$", str(e.value), re.M).group(1)
    hbm, ddr = _quoted_caps(first)[0], _quoted_caps(second)[1]
    assert hbm is not None and ddr is not None
    plan(hbm, ddr)  # the listed fixes together are enough
    for less in ((hbm - 1, ddr), (hbm, ddr - 1)):  # and each is the exact least
        with pytest.raises(PlacementPlannerError):
            plan(*less)


def test_module_without_embedding_collections_is_refused() -> None:
    with pytest.raises(
        PlacementPlannerError, match=r"torch\.nn\.modules\.linear\.Linear\) holds no EmbeddingBagCollection"
    ) as e:
        PlacementPlanner(topo()).plan(torch.nn.Linear(3, 3))
    assert e.value.planner_error_type is PlacementErrorType.INPUT_VALIDATION
    assert "pass the model that holds the embedding collections" in str(e.value)


def _two_modules_one_name() -> torch.nn.Module:
    model = torch.nn.Module()
    for path, rows in (("a", 1000), ("b", 2000)):
        setattr(
            model,
            path,
            EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(name="t", embedding_dim=16, num_embeddings=rows, feature_names=[f"f_{path}"])
                ],
                device=torch.device("meta"),
            ),
        )
    return model


def test_table_name_shared_by_two_modules_is_ambiguous() -> None:
    model = _two_modules_one_name()
    plan = PlacementPlanner(topo()).plan(model)
    with pytest.raises(KeyError, match=r"ambiguous.*\['a\.t', 'b\.t'\].*module_path"):
        plan.placement("t")
    assert plan.placement("t", module_path="b").rows == 2000
    with pytest.raises(PlacementPlannerError, match=r"constraints\['t'\] is ambiguous.*\['a\.t', 'b\.t'\]") as e:
        PlacementPlanner(topo(), constraints={"t": PlacementConstraints(mode="CACHING")}).plan(model)
    assert e.value.planner_error_type is PlacementErrorType.INPUT_VALIDATION
    assert "'a.t', 'b.t'" in str(e.value).split("Possible solutions")[1]
    # keyed by full name, or a name one table keeps once the other has its own key: not ambiguous
    pinned = PlacementPlanner(topo(), constraints={"a.t": PlacementConstraints(mode="CACHING", cache_load_factor=0.5)})
    assert pinned.plan(model).placement("t", module_path="a").cache_load_factor == 0.5
    PlacementPlanner(
        topo(), constraints={"t": PlacementConstraints(mode="CACHING"), "b.t": PlacementConstraints(mode="HYBRID")}
    ).plan(model)


@pytest.mark.parametrize(
    "counts, match",
    [
        ([1.0] * 9, r"TableSpec\(t\)\.access_counts has 9 entries .* for rows=10"),
        ([-1.0] + [1.0] * 9, r"TableSpec\(t\)\.access_counts must be finite numbers >= 0, got -1\.0 at row 0"),
        ([float("nan")] * 10, r"TableSpec\(t\)\.access_counts must be finite numbers >= 0, got nan"),
        ([0.0] * 10, r"TableSpec\(t\)\.access_counts are all 0"),
    ],
)
def test_access_counts_are_checked(counts: List[float], match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        TableSpec(name="t", rows=10, dim=8, access_counts=counts)
    assert "access_counts=None" in str(e.value)


@pytest.mark.parametrize("miss", [float("nan"), 5.0, -0.5])
def test_cache_stats_miss_rate_out_of_range_is_refused(miss: float) -> None:
    from torchrec.distributed.types import CacheStatistics

    class Stats(CacheStatistics):
        @property
        def expected_lookups(self) -> float:
            return 1.0

        def expected_miss_rate(self, clf: float) -> float:
            return miss

        @property
        def cacheability(self) -> float:
            return 1.0

    t = TableSpec(name="t", rows=1000, dim=8, cache_stats=Stats())
    with pytest.raises(
        ValueError, match=r"TableSpec\(t\)\.cache_stats\.expected_miss_rate\(0\.5\) returned .*\[0, 1\]"
    ):
        fast_tier_hit_rate(t, Mode.CACHING, 0.5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=0, local_world_size=1), r"^world_size must be >= 1 \(the number of ranks\), got 0\.$"),
        (dict(world_size=4, local_world_size=0), r"^local_world_size must be >= 1 \(ranks per machine\), got 0\.$"),
        (dict(world_size=4, local_world_size=3), r"^local_world_size \(3\) must divide world_size \(4\)"),
        (dict(world_size=4, local_world_size=8), r"^local_world_size \(8\) must divide world_size \(4\)"),
        (dict(world_size=4, local_world_size=2, hbm_cap=-5), r"^hbm_cap must be a size >= 0 bytes, got -5"),
        (dict(world_size=4, local_world_size=2, ddr_cap=-5), r"^ddr_cap must be a size >= 0 bytes, got -5"),
    ],
)
def test_make_topology_checks_its_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_topology(**{"hbm_cap": GiB, "ddr_cap": GiB, **kwargs})


def test_planner_checks_a_directly_built_topology() -> None:
    t = topo(4, 2, hbm=GiB, ddr_per_rank=GiB)
    t.devices[3].storage.ddr = -5
    with pytest.raises(ValueError, match=r"Topology ddr_cap \(DDR per rank\) must be a size >= 0 bytes, got -5"):
        PlacementPlanner(t)
    t = topo(4, 2, hbm=GiB, ddr_per_rank=GiB)
    t.devices[0].storage.hbm = -5
    with pytest.raises(ValueError, match=r"Topology hbm_cap \(HBM per device\) must be a size >= 0 bytes, got -5"):
        PlacementPlanner(t)
    with pytest.raises(ValueError, match=r"Topology world_size must be >= 1 \(the number of ranks\), got 0"):
        PlacementPlanner(topo(0, 1))


def test_constraints_must_be_placement_constraints() -> None:
    with pytest.raises(
        PlacementPlannerError,
        match=r"(?s)constraints\['big'\] is a dict.*PlacementConstraints\(\*\*\{'mode': 'CACHING'\}\)",
    ) as e:
        PlacementPlanner(topo(), constraints={"big": {"mode": "CACHING"}})  # type: ignore[dict-item]
    assert e.value.planner_error_type is PlacementErrorType.INPUT_VALIDATION
