"""Benchmark of recpipe's placement planner.

Rows:
* planning time of ``PlacementPlanner.plan`` for (tables, devices) in
  {(100, 8), (1000, 64), (5000, 128), (10000, 1024)} (targets: 1000 x 64 < 1 s,
  10000 x 1024 < 2 s), every table offered table-wise and row-wise (and column-wise where 256 wide);
* the same DP written as the pure-Python triple loop of TorchEasyRec PR #508
  (kept here only, as the baseline) at 100 tables, same options and bins,
  against recpipe's proposer with its C++ kernel (default) and its NumPy twin
  (target: >= 100x), minimum over 7 interleaved rounds (recpipe best of 5
  per round: a ~1 ms call is disrupted by any context switch);
* torchrec's own ``EmbeddingShardingPlanner`` on the same 100 tables;
* optimality gap of the DP (default bins) vs the exact brute force on 200 random
  6-table instances (target <= 1%), with and without the exact repair step, and
  budget violations (target 0).

Run: ``PYTHONPATH=build/dev .venv/bin/python scripts/bench_planner.py [--quick] [--backend fbgemm]``
(``--backend``: the tiered-table bytes every planner and budget uses; ``native``, the
default, gives the instances the targets were set on).
"""

from __future__ import annotations

import argparse
import logging
import platform
import time
from typing import List, Optional, Tuple

import numpy as np
import torch
from benchutil import hardware_line
from torchrec.distributed.planner.types import Topology

from recpipe.planner import (
    BruteForceProposer,
    GridPlacementEnumerator,
    KnapsackProposer,
    PlacementPlanner,
    PlacementPlannerError,
    TableSpec,
)
from recpipe.planner.cost_models import AnalyticCostModel
from recpipe.planner.option_arrays import options_to_arrays

GiB = 1024**3


def random_tables(n: int, rng: np.random.Generator) -> List[TableSpec]:
    return [
        TableSpec(
            name=f"t{i}",
            rows=int(rng.integers(10**5, 2 * 10**8)),
            dim=int(rng.choice([32, 64, 128, 256])),
            optimizer=str(rng.choice(["adam", "rowwise_adagrad", "sgd"])),
            lookups_per_step=float(rng.integers(10**3, 10**6)),
            zipf_alpha=float(rng.uniform(0.6, 1.4)),
        )
        for i in range(n)
    ]


def tight_topology(
    tables: List[TableSpec], world: int, local: int, hf: float = 0.6, df: float = 0.75, backend: str = "native"
) -> Topology:
    """A topology where both budgets bind: HBM for ``hf`` of all-in-HBM, DDR for ``df`` of
    all-CACHING, in the bytes of ``backend`` (the planners' backend: the same instance)."""
    opts = GridPlacementEnumerator(world, local, AnalyticCostModel(backend=backend), backend=backend).enumerate(tables)
    hbm, ddr, _ = options_to_arrays(opts)
    h = int(hbm.max(axis=1).sum() * hf / 0.85)
    d = int(ddr.max(axis=1).sum() * df) // local
    return Topology(world_size=world, local_world_size=local, compute_device="cuda", hbm_cap=h, ddr_cap=d)


def seed_python_dp(
    hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, H: int, D: int, nh: int, nd: int
) -> Optional[List[int]]:
    """PR #508's DP as a pure-Python triple loop (float bins carrying exact usage)."""
    M, K = cost.shape
    inf = float("inf")
    hb, db = H / nh, D / nd
    hw = [[float(hbm[i, j]) / hb if np.isfinite(cost[i, j]) else inf for j in range(K)] for i in range(M)]
    dw = [[float(ddr[i, j]) / db if np.isfinite(cost[i, j]) else inf for j in range(K)] for i in range(M)]
    pw = [[float(cost[i, j]) for j in range(K)] for i in range(M)]
    dp = [[[(inf, inf, inf)] * (nd + 1) for _ in range(nh + 1)] for _ in range(M)]
    bt = [[[(-1, -1, -1)] * (nd + 1) for _ in range(nh + 1)] for _ in range(M)]
    for j in range(K):
        h, d = hw[0][j], dw[0][j]
        if h > nh or d > nd:
            continue
        if dp[0][int(h)][int(d)][0] > pw[0][j]:
            dp[0][int(h)][int(d)] = (pw[0][j], h, d)
            bt[0][int(h)][int(d)] = (j, -1, -1)
    for i in range(1, M):
        prev, cur, back = dp[i - 1], dp[i], bt[i]
        for a in range(nh + 1):
            for b in range(nd + 1):
                pc, ph, pd = prev[a][b]
                if pc == inf:
                    continue
                for j in range(K):
                    c = pw[i][j]
                    if c == inf:
                        continue
                    nhv, ndv = ph + hw[i][j], pd + dw[i][j]
                    if nhv > nh or ndv > nd:
                        continue
                    na, nb = int(nhv), int(ndv)
                    if cur[na][nb][0] > pc + c:
                        cur[na][nb] = (pc + c, nhv, ndv)
                        back[na][nb] = (j, a, b)
    last = dp[M - 1]
    best, cell = inf, None
    for a in range(nh + 1):
        for b in range(nd + 1):
            if last[a][b][0] < best:
                best, cell = last[a][b][0], (a, b)
    if cell is None:
        return None
    out = [0] * M
    a, b = cell
    for i in range(M - 1, -1, -1):
        out[i], a, b = bt[i][a][b]
    return out


def torchrec_planner_seconds(tables: List[TableSpec], world: int, local: int, topology: Topology) -> float:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=[f"f_{t.name}"])
            for t in tables
        ],
        device=torch.device("meta"),
    )
    # Roomy budgets: we time torchrec's search, not its feasibility.
    topo = Topology(
        world_size=world,
        local_world_size=local,
        compute_device="cuda",
        hbm_cap=64 * 1024 * GiB,
        ddr_cap=64 * 1024 * GiB,
    )
    planner = EmbeddingShardingPlanner(topology=topo)
    t0 = time.perf_counter()
    planner.plan(ebc, [EmbeddingBagCollectionSharder()])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer gap instances, skip 5000 and 10000 tables")
    ap.add_argument(
        "--backend",
        choices=("native", "fbgemm"),
        default="native",
        help="tiered-table bytes the planners budget (native: the instances the targets were set on; "
        "fbgemm: a cuda topology's default)",
    )
    args = ap.parse_args()
    backend = args.backend
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(hardware_line() + f", numpy {np.__version__}, python {platform.python_version()}; planner backend {backend}")
    rows: List[Tuple[str, str, str, str]] = []

    sizes = [(100, 8), (1000, 64)] + ([] if args.quick else [(5000, 128), (10000, 1024)])
    targets = {(1000, 64): "< 1 s", (10000, 1024): "< 2 s"}
    for m, w in sizes:
        tables = random_tables(m, rng)
        topo = tight_topology(tables, w, 8, backend=backend)
        planner = PlacementPlanner(topo, backend=backend)
        t0 = time.perf_counter()
        plan = planner.plan(tables)
        dt = time.perf_counter() - t0
        # enumeration share, measured separately (best of 2; the machine is shared)
        t_enum = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            arrays = planner.enumerator.enumerate_arrays(tables)
            t_enum = min(t_enum, time.perf_counter() - t0)
        ok = plan.hbm_bytes_per_rank <= planner.hbm_budget and plan.ddr_bytes_per_machine <= planner.ddr_budget
        target = targets.get((m, w), "-")
        rows.append(
            (
                f"plan {m} tables x {w} devices (bins {planner.proposer.last_bins})",
                f"{dt:.3f} s",
                target,
                ("ok" if ok else "BUDGET VIOLATION")
                + f", HBM {100 * plan.hbm_bytes_per_rank / planner.hbm_budget:.1f}%"
                f" DDR {100 * plan.ddr_bytes_per_machine / planner.ddr_budget:.1f}% used;"
                f" enumeration alone {t_enum:.3f} s ({arrays.cost.shape[1]} options/table)",
            )
        )
    # Known limitation: a sliver-thin feasible region (HBM 45% / DDR 60%) at 1000 tables.
    tables = random_tables(1000, rng)
    planner = PlacementPlanner(tight_topology(tables, 64, 8, 0.45, 0.60, backend=backend), backend=backend)
    try:
        planner.plan(tables)
        note = "plan found"
    except PlacementPlannerError as e:
        note = f"NO PLAN FOUND ({e.planner_error_type.value}); a mix of HYBRID 0.4/0.5 fits"
    rows.append(("plan 1000 x 64, very tight budgets (HBM 45%, DDR 60%)", "-", "plan exists", note))

    # pure-Python seed loop vs vectorized DP, same options and bins
    tables = random_tables(100, rng)
    topo = tight_topology(tables, 8, 8, backend=backend)
    planner = PlacementPlanner(topo, bins=(64, 32), backend=backend)
    hbm, ddr, cost = options_to_arrays(planner.enumerator.enumerate(tables))
    H, D = planner.hbm_budget, planner.ddr_budget
    # One warm-up, then 7 interleaved rounds: each round times the seed loop once
    # and each recpipe backend best-of-5 (a ~1 ms call is disrupted by any
    # context switch on a shared machine; a ~0.2 s loop averages that out).
    # Reported: the minimum per side.
    KnapsackProposer(bins=(64, 32), backend="cpp").solve(hbm, ddr, cost, H, D)
    t_cpp = t_np = t_seed = float("inf")
    ours = ours_np = seed = None
    for _ in range(7):
        for _ in range(5):
            t0 = time.perf_counter()
            ours = KnapsackProposer(bins=(64, 32), backend="cpp").solve(hbm, ddr, cost, H, D)
            t_cpp = min(t_cpp, time.perf_counter() - t0)
        t0 = time.perf_counter()
        ours_np = KnapsackProposer(bins=(64, 32), backend="numpy").solve(hbm, ddr, cost, H, D)
        t_np = min(t_np, time.perf_counter() - t0)
        t0 = time.perf_counter()
        seed = seed_python_dp(hbm, ddr, cost, H, D, 64, 32)
        t_seed = min(t_seed, time.perf_counter() - t0)
    r = np.arange(100)

    def plan_cost(sol: Optional[np.ndarray]) -> float:
        return float(cost[r, sol].sum()) if sol is not None else float("inf")

    rows.append(
        ("seed pure-Python DP, 100 tables, bins (64, 32)", f"{t_seed:.3f} s", "baseline", f"cost {plan_cost(seed):.4f}")
    )
    rows.append(
        (
            "recpipe DP, C++ kernel (default backend), same input",
            f"{1e3 * t_cpp:.2f} ms",
            ">= 100x",
            f"{t_seed / t_cpp:.0f}x faster: {'MET' if t_seed / t_cpp >= 100 else 'NOT MET'}, "
            f"cost {plan_cost(ours):.4f}",
        )
    )
    rows.append(
        (
            "recpipe DP, NumPy twin (backend='numpy'), same input",
            f"{1e3 * t_np:.2f} ms",
            "-",
            f"{t_seed / t_np:.0f}x faster, cost {plan_cost(ours_np):.4f}",
        )
    )
    t0 = time.perf_counter()
    PlacementPlanner(topo, backend=backend).plan(tables)
    t_plan = time.perf_counter() - t0
    t_tr = torchrec_planner_seconds(tables, 8, 8, topo)
    rows.append(
        (
            "torchrec EmbeddingShardingPlanner, same 100 tables x 8",
            f"{t_tr:.3f} s",
            "reference",
            f"recpipe plan() {t_plan:.3f} s (default bins): {t_tr / t_plan:.0f}x faster",
        )
    )

    # optimality gap vs brute force
    n_inst = 40 if args.quick else 200
    gaps: List[float] = []
    bare_gaps: List[float] = []
    viol, infeasible = 0, 0
    t_bf = t_dp = 0.0
    model = AnalyticCostModel(backend=backend)
    for _ in range(n_inst):
        tabs = random_tables(6, rng)
        opts = GridPlacementEnumerator(8, 8, model, backend=backend).enumerate(tabs)
        hbm, ddr, cost = options_to_arrays(opts)
        H = int(hbm.max(axis=1).sum() * rng.uniform(0.3, 0.8))
        D = int(ddr.max(axis=1).sum() * rng.uniform(0.3, 0.8))
        t0 = time.perf_counter()
        bf = BruteForceProposer().solve(hbm, ddr, cost, H, D)
        t_bf += time.perf_counter() - t0
        t0 = time.perf_counter()
        dp = KnapsackProposer().solve(hbm, ddr, cost, H, D)
        t_dp += time.perf_counter() - t0
        bare = KnapsackProposer(repair=False).solve(hbm, ddr, cost, H, D)
        r = np.arange(6)
        for sol in (dp, bare):
            if sol is not None and (hbm[r, sol].sum() > H or ddr[r, sol].sum() > D):
                viol += 1
        if bf is None:
            infeasible += 1
            continue
        ref = cost[r, bf].sum()
        gaps.append(float("inf") if dp is None else cost[r, dp].sum() / ref - 1.0)
        bare_gaps.append(float("inf") if bare is None else cost[r, bare].sum() / ref - 1.0)
    g, gb = np.array(gaps), np.array(bare_gaps)
    rows.append(
        (
            f"optimality gap vs brute force, {n_inst} x 6 tables ({infeasible} infeasible)",
            f"max {100 * g.max():.3f}% / mean {100 * g.mean():.4f}%",
            "<= 1%",
            f"exact on {int((g <= 1e-12).sum())}/{g.size}; DP {t_dp:.1f} s, brute force {t_bf:.1f} s",
        )
    )
    rows.append(
        (
            "  same, DP alone (repair=False, default bins)",
            f"max {100 * gb.max():.3f}% / mean {100 * gb.mean():.4f}%",
            "<= 1%",
            f"exact on {int((gb <= 1e-12).sum())}/{gb.size}",
        )
    )
    rows.append(("budget violations (all runs above)", str(viol), "0", "ok" if viol == 0 else "FAIL"))

    head = ("case", "result", "target", "note")
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(4)]
    fmt = " | ".join("{:<%d}" % w for w in widths)
    print(fmt.format(*head))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(fmt.format(*row))


if __name__ == "__main__":
    main()
