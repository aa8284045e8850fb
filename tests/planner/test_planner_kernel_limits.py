"""The planner at the edges of its layouts and kernels.

* A plan sized in fbgemm's layout (the default of a ``cuda`` topology) turned into a
  sharding plan for CPU, where the tiered sharders run recpipe's native kernel, warns,
  naming the tables, both layouts and the bytes the native tables then allocate: the
  reference is what the tiered sharders allocate under DMP on 2 gloo ranks.
* Arguments the compiled planner kernels cannot take (a budget or ``iters`` past int64,
  a budget past their 2^53-byte range, a DP grid past their cell limit) get the planner's
  typed error, naming the argument, before the C++ call; option bytes past int64 given
  as floats are refused.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Dict, Tuple

import numpy as np
import pytest
import torch
from harness.gloo import run_gloo

from recpipe.planner import (
    BruteForceProposer,
    KnapsackProposer,
    PlacementConstraints,
    PlacementErrorType,
    PlacementPlanner,
    PlacementPlannerError,
    TableSpec,
    make_topology,
)
from recpipe.planner import knapsack as P
from recpipe.planner.proposers import _DpProblem

GiB = 2**30
MiB = 2**20
TABLES = [("t0", 4001, 16), ("t1", 3000, 8)]  # name, rows, dim (multiples of 4: fbgemm's TBE takes them)


# ------------------------------------------------ a plan's layout vs the runtime's
def _ebc() -> Any:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f_{n}"])
            for n, r, d in TABLES
        ],
        device=torch.device("cpu"),
    )
    apply_optimizer_in_backward(torch.optim.Adam, ebc.parameters(), {"lr": 0.01})
    return ebc


def _planner(world: int, **kwargs: Any) -> PlacementPlanner:
    # Adam CACHING: fbgemm's cache holds values only, the native cache holds values + moments
    pins = {
        "t0": PlacementConstraints(sharding_type="row_wise", mode="CACHING", cache_load_factor=0.5),
        "t1": PlacementConstraints(sharding_type="row_wise", mode="HYBRID", cache_load_factor=0.5),
    }
    topo = make_topology(world_size=world, local_world_size=world, hbm_cap=GiB, ddr_cap=GiB)  # compute_device cuda
    return PlacementPlanner(topo, constraints=pins, **kwargs)


def _sharded_bytes(rank: int, world: int) -> Dict[str, Any]:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    ebc = _ebc()
    plan = _planner(world).plan(ebc)  # a cuda topology: fbgemm's layout by default
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharding_plan = plan.to_sharding_plan(compute_device="cpu")
    model = DistributedModelParallel(
        ebc,
        plan=sharding_plan,
        sharders=[TieredEmbeddingBagCollectionSharder()],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )
    tiered = model.module.tiered_tables()
    return {
        "backend": plan.backend,
        "planned": {p.table: (p.hbm_bytes_per_rank, p.ddr_bytes_per_machine) for p in plan.placements},
        "allocated": {
            p.table: (tiered[p.table].tier_bytes().fast_bytes, tiered[p.table].tier_bytes().slow_bytes)
            for p in plan.placements
        },
        "kernels": sorted({tiered[p.table].backend for p in plan.placements}),
        "warnings": [
            (w.category.__name__, str(w.message), w.filename) for w in caught if "to_sharding_plan" in str(w.message)
        ],
    }


def test_fbgemm_plan_sharded_for_cpu_warns_with_the_bytes_the_native_tables_allocate() -> None:
    res = run_gloo(2, _sharded_bytes)
    assert res[0]["backend"] == "fbgemm" and res[0]["kernels"] == ["native"]
    # the reference: bytes the tiered sharders allocated on CPU, rank 0 (the most loaded
    # rank) for HBM per rank, both ranks (one machine) for DDR per machine
    hbm_now = sum(h for h, _ in res[0]["planned"].values())
    ddr_now = sum(d for _, d in res[0]["planned"].values())
    hbm_run = sum(res[0]["allocated"][t][0] for t in res[0]["allocated"])
    ddr_run = sum(r["allocated"][t][1] for r in res for t in r["allocated"])
    assert hbm_run != hbm_now  # the layouts differ on this plan (Adam CACHING)
    for r in res:
        assert len(r["warnings"]) == 1, r["warnings"]
        kind, msg, filename = r["warnings"][0]
        assert kind == "UserWarning"
        assert filename.endswith("test_planner_kernel_limits.py")  # points at the caller's line
        assert "to_sharding_plan(compute_device='cpu'): the plan was sized in fbgemm's layout (backend='fbgemm')" in msg
        assert "on cpu the tiered sharders run recpipe's native layout (backend='native', their default there)" in msg
        assert "2 of its 2 tables (['t0', 't1']) need other bytes" in msg
        assert (
            f"HBM per rank {_fmt(hbm_now)} ({hbm_now} B) in fbgemm -> {_fmt(hbm_run)} ({hbm_run} B) in native, "
            f"{hbm_run - hbm_now:+d} B"
        ) in msg, msg
        assert (
            f"DDR per machine {_fmt(ddr_now)} ({ddr_now} B) in fbgemm -> {_fmt(ddr_run)} ({ddr_run} B) in native, "
            f"{ddr_run - ddr_now:+d} B"
        ) in msg, msg
        assert "Possible solutions:\n  1) re-plan with PlacementPlanner(topology, backend='native')" in msg


def _fmt(num: int) -> str:
    from recpipe.planner.errors import format_bytes

    return format_bytes(num)


def test_layout_warning_only_where_the_device_runs_the_other_layout() -> None:
    tables = [TableSpec(name=n, rows=r, dim=d, optimizer="adam") for n, r, d in TABLES]
    native = _planner(2, backend="native").plan(tables)
    fbgemm = _planner(2).plan(tables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        native.to_sharding_plan(compute_device="cpu")  # the layout that runs on CPU
        fbgemm.to_sharding_plan(compute_device="cuda")  # the layout that runs on CUDA
        native.to_sharding_plan()  # no device named: a cuda topology modelling a CPU run (README)
    with pytest.warns(UserWarning) as caught:
        native.to_sharding_plan(compute_device="cuda")
    msg = str(caught[0].message)
    assert (
        "sized in recpipe's native layout (backend='native'), but on cuda the tiered sharders run fbgemm's "
        "layout (backend='fbgemm', their default there)" in msg
    ), msg
    assert "re-plan with PlacementPlanner(topology, backend='fbgemm')" in msg
    assert "TieredEmbeddingBagCollectionSharder(backend='torch')" in msg  # recpipe's layout on CUDA


# ---------------------------------------- arguments the compiled kernels cannot take
def _instance() -> Tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    rng = np.random.default_rng(3)
    hbm = rng.integers(1, 1000, size=(6, 5)).astype(np.int64)
    ddr = rng.integers(1, 1000, size=(6, 5)).astype(np.int64)
    cost = rng.random((6, 5))
    return hbm, ddr, cost, int(hbm.min(axis=1).sum() * 2), int(ddr.min(axis=1).sum() * 2)


def _input_error(e: BaseException) -> str:
    assert isinstance(e, PlacementPlannerError) and isinstance(e, ValueError), type(e)
    assert e.planner_error_type is PlacementErrorType.INPUT_VALIDATION  # type: ignore[attr-defined]
    assert "refused before calling it" in str(e) and "Possible solutions:\n  1) " in str(e)
    return str(e)


@pytest.mark.parametrize("name", ["hbm_budget", "ddr_budget"])
def test_budget_prices_kernel_budget_past_int64_is_a_typed_error(name: str) -> None:
    hbm, ddr, cost, H, D = _instance()
    budgets = {"hbm_budget": H, "ddr_budget": D, name: 2**64}
    # refused before torch's own "Expected a value of type 'int' ... but instead found type 'int'"
    with pytest.raises(PlacementPlannerError) as info:
        P._budget_prices_cpp(hbm, ddr, cost, budgets["hbm_budget"], budgets["ddr_budget"], 50)
    msg = _input_error(info.value)
    assert msg.startswith(f"{name} is {2**64} bytes, past {2**63 - 1} B (2^63 - 1, the largest int64)"), msg
    assert "torch.ops.recpipe.placement_budget_prices" in msg
    # the NumPy twin takes it, and the kernel takes the largest int64 (the limit quoted)
    P.budget_prices(hbm, ddr, cost, budgets["hbm_budget"], budgets["ddr_budget"], 50)
    budgets[name] = 2**63 - 1
    assert P._budget_prices_cpp(hbm, ddr, cost, budgets["hbm_budget"], budgets["ddr_budget"], 50) == pytest.approx(
        P.budget_prices(hbm, ddr, cost, budgets["hbm_budget"], budgets["ddr_budget"], 50)
    )
    with pytest.raises(
        PlacementPlannerError, match=r"^iters is 9223372036854775808 subgradient steps, past int64"
    ) as info:
        P._budget_prices_cpp(hbm, ddr, cost, H, D, 2**63)
    _input_error(info.value)


@pytest.mark.parametrize("budget", [2**53, 2**63, 2**64])
def test_dp_kernel_budget_past_its_range_is_a_typed_error(budget: int) -> None:
    hbm, ddr, cost, H, D = _instance()
    keep = np.ones_like(cost, dtype=bool)
    with pytest.raises(PlacementPlannerError) as info:
        KnapsackProposer._dp_cpp(_DpProblem(hbm, ddr, cost, cost, keep, H, budget), 8, 8)
    msg = _input_error(info.value)
    assert msg.startswith(f"ddr_budget is {budget} bytes, past {2**53 - 1} B (2^53 - 1"), msg
    assert "torch.ops.recpipe.placement_dp" in msg
    # solve() passes such a budget as the sum of the largest options (it binds no plan)
    assert (
        KnapsackProposer(backend="cpp").solve(hbm, ddr, cost, H, budget).tolist()
        == BruteForceProposer().solve(hbm, ddr, cost, H, budget).tolist()
    )


def test_dp_grid_past_the_kernel_cells_names_bins_and_the_suggested_bins_plan() -> None:
    hbm, ddr, cost, H, D = _instance()
    with pytest.raises(PlacementPlannerError) as info:  # the typed error, not the kernel's RuntimeError
        KnapsackProposer(bins=(5000, 5000), backend="cpp").solve(hbm, ddr, cost, H, D)
    msg = _input_error(info.value)
    assert msg.startswith(
        "KnapsackProposer(bins=(5000, 5000)): a grid of (5000 + 1) x (5000 + 1) = "
        "25010001 cells is past the 8388608 cells (2^23)"
    ), msg
    m = re.search(r"pass fewer bins, e\.g\. bins=\((\d+), (\d+)\)", msg)
    assert m, msg
    bins = (int(m.group(1)), int(m.group(2)))
    assert (bins[0] + 1) * (bins[1] + 1) <= 2**23 < (bins[0] + 2) * (bins[1] + 2)
    # the suggested bins plan, as the NumPy twin (which takes any grid) does with them and with (5000, 5000)
    got = KnapsackProposer(bins=bins, backend="cpp").solve(hbm, ddr, cost, H, D)
    exact = BruteForceProposer().solve(hbm, ddr, cost, H, D)
    assert got.tolist() == KnapsackProposer(bins=bins, backend="numpy").solve(hbm, ddr, cost, H, D).tolist()
    assert cost[np.arange(6), got].sum() == pytest.approx(cost[np.arange(6), exact].sum())
    assert KnapsackProposer(bins=(5000, 5000), backend="numpy").solve(hbm, ddr, cost, H, D) is not None
    # through the planner (the CLI's --bins): a PlacementPlannerError the CLI prints with its flag; both budgets
    # bind here (an axis that cannot bind gets no bins, and then the grid fits)
    tables = [TableSpec(name=n, rows=r, dim=d, optimizer="adam") for n, r, d in TABLES]
    topo = make_topology(world_size=2, local_world_size=2, hbm_cap=400 * 1024, ddr_cap=400 * 1024)
    with pytest.raises(PlacementPlannerError, match=r"KnapsackProposer\(bins=\(5000, 5000\)\)"):
        PlacementPlanner(topo, backend="native", bins=(5000, 5000)).plan(tables)
    assert (
        PlacementPlanner(topo, backend="native", bins=bins).plan(tables).total_cost
        == PlacementPlanner(topo, backend="native", proposer=BruteForceProposer()).plan(tables).total_cost
    )


@pytest.mark.parametrize("backend", ["cpp", "numpy"])
def test_float_option_bytes_past_int64_are_refused(backend: str) -> None:
    hbm, ddr, cost, H, D = _instance()
    huge = hbm.astype(np.float64)
    huge[0, 0] = 1e20  # cast to int64 it would be -2^63 bytes and "fit" every budget
    with pytest.raises(ValueError, match=r"^`hbm` holds 100000000000000000000 bytes, past int64"):
        KnapsackProposer(backend=backend).solve(huge, ddr, cost, H, D)
    for fn in (
        lambda: P.budget_prices(huge, ddr, cost, H, D),
        lambda: P.prune_dominated(huge, ddr, cost, np.isfinite(cost)),
        lambda: BruteForceProposer().solve(huge, ddr, cost, H, D),
    ):
        with pytest.raises(ValueError, match=r"^`hbm` holds 100000000000000000000 bytes, past int64"):
            fn()
    # whole floats within int64 stay accepted: the plan of the int64 arrays
    assert (
        KnapsackProposer(backend=backend).solve(hbm.astype(np.float64), ddr, cost, H, D).tolist()
        == BruteForceProposer().solve(hbm, ddr, cost, H, D).tolist()
    )


@pytest.mark.parametrize("path", [None, 3, True, b"tables.yaml"])
def test_load_tables_refuses_a_path_that_is_not_one(path: Any) -> None:
    """``load_tables`` names the argument and the fix for a value that is not a path (None used
    to raise a bare TypeError from pathlib)."""
    from recpipe.planner.__main__ import load_tables

    with pytest.raises(
        ValueError, match=r"--tables: expected the path of a YAML table list, got .*Path\('tables.yaml'\)"
    ):
        load_tables(path, "rowwise_adagrad")
