"""The planner's compiled kernels (torch.ops.recpipe.placement_dp / placement_budget_prices /
placement_prune_dominated).

Each is checked against its NumPy twin (recpipe.planner.knapsack / proposers: the same
recurrence written as array operations), against brute force where the DP is exact,
with torch.library.opcheck and FakeTensor shapes, and on bad input.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import recpipe._C  # noqa: F401,E402  (registers torch.ops.recpipe.*)
from recpipe.planner import BruteForceProposer, KnapsackProposer
from recpipe.planner import knapsack as P
from recpipe.planner.proposers import _DpProblem

OPS = P._cpp_ops()
assert OPS is not None, "recpipe._C must provide the planner kernels"


def random_instance(rng: np.random.Generator, m: int, k: int, tight: float = 0.6):
    """Tables x options shaped like the planner's: leaner options cost more."""
    hbm = rng.integers(1, 10**9, size=(m, k)).astype(np.int64)
    ddr = rng.integers(0, 10**9, size=(m, k)).astype(np.int64)
    cost = rng.uniform(1.0, 10.0, size=(m, k)) + 3.0 * (1.0 - hbm / 10**9) + 2.0 * (1.0 - ddr / 10**9)
    cost[rng.random((m, k)) < 0.15] = np.inf
    cost[:, 0] = np.where(np.isfinite(cost[:, 0]), cost[:, 0], 5.0)  # every table keeps an option
    H = int(hbm.max(axis=1).sum() * tight)
    D = int(ddr.max(axis=1).sum() * tight)
    return hbm, ddr, cost, H, D


def prepared(hbm, ddr, cost, H, D):
    """The inputs solve() hands to one DP pass (usable mask, dominance prune, prices, order)."""
    usable = np.isfinite(cost) & (hbm <= H) & (ddr <= D)
    keep = P.prune_dominated(hbm, ddr, cost, usable)
    lh, ld = P.budget_prices(hbm, ddr, cost, H, D)
    ph, pd = lh / max(H, 1), ld / max(D, 1)
    priced = cost + ph * hbm + pd * ddr
    return keep, priced, ph, pd


GRIDS = [(64, 32), (16, 8), (0, 24), (24, 0), (0, 0), (1, 1), (200, 3)]


@pytest.mark.parametrize("simd", ["auto", "scalar"])
@pytest.mark.parametrize("seed", range(12))
def test_dp_kernel_equals_numpy_twin(seed: int, simd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if simd == "scalar":
        monkeypatch.setenv("RECPIPE_PLANNER_SIMD", "scalar")  # the kernel's scalar loop instead of AVX2 lanes
    rng = np.random.default_rng(seed)
    m, k = int(rng.integers(1, 40)), int(rng.integers(1, 12))
    hbm, ddr, cost, H, D = random_instance(rng, m, k, tight=float(rng.uniform(0.3, 0.9)))
    keep, priced, ph, pd = prepared(hbm, ddr, cost, H, D)
    if not keep.any(axis=1).all():
        pytest.skip("a table has no usable option")
    problem = _DpProblem(hbm, ddr, cost, priced, keep, H, D)
    for nh, nd in GRIDS:
        for inc_scale in (math.inf, 1.002, 0.97):
            ref = KnapsackProposer._dp_numpy(problem, nh, nd)
            inc = math.inf if inc_scale == math.inf or ref is None else ref[1] * inc_scale
            a = KnapsackProposer._dp_numpy(problem, nh, nd, inc, ph, pd)
            b = KnapsackProposer._dp_cpp(problem, nh, nd, inc, ph, pd)
            assert (a is None) == (b is None), (nh, nd, inc)
            if a is not None:
                np.testing.assert_array_equal(a[0], b[0])
                assert a[1] == b[1]
            # Whatever a bounded pass returns fits and beats the incumbent.
            if b is not None:
                r = np.arange(m)
                assert b[1] <= inc * (1 + 1e-9)
                assert hbm[r, b[0]].sum() <= H and ddr[r, b[0]].sum() <= D
                assert float(cost[r, b[0]].sum()) == pytest.approx(b[1], rel=1e-12)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 5), st.integers(1, 4), st.integers(0, 2**32 - 1), st.integers(0, 60), st.integers(0, 60))
@example(2, 2, 5, 0, 30)  # zero HBM budget
def test_dp_kernel_one_byte_bins_equals_brute_force(m: int, k: int, seed: int, H: int, D: int) -> None:
    rng = np.random.default_rng(seed)
    hbm = rng.integers(0, 25, size=(m, k)).astype(np.int64)
    ddr = rng.integers(0, 25, size=(m, k)).astype(np.int64)
    hbm[rng.random((m, k)) < 0.3] = 0  # zero-byte options, so zero budgets can hold plans
    cost = rng.integers(0, 50, size=(m, k)).astype(np.float64)
    cost[rng.random((m, k)) < 0.2] = np.inf
    r = np.arange(m)
    best = math.inf
    for combo in itertools.product(range(k), repeat=m):
        idx = np.array(combo)
        if hbm[r, idx].sum() <= H and ddr[r, idx].sum() <= D:
            best = min(best, float(cost[r, idx].sum()))
    for backend in ("cpp", "numpy"):
        sol = KnapsackProposer(bins=(max(H, 1), max(D, 1)), repair=False, backend=backend).solve(hbm, ddr, cost, H, D)
        if math.isinf(best):
            assert sol is None
        else:
            assert sol is not None and hbm[r, sol].sum() <= H and ddr[r, sol].sum() <= D
            assert float(cost[r, sol].sum()) == best
    if math.isinf(best):
        return
    # One bounded pass with one bin per byte is exact: it finds the optimum when
    # the incumbent is above it and nothing when the incumbent is below it.
    usable = np.isfinite(cost) & (hbm <= H) & (ddr <= D)
    keep = P.prune_dominated(hbm, ddr, cost, usable)
    lh, ld = P.budget_prices(hbm, ddr, cost, H, D)
    ph, pd = lh / max(H, 1), ld / max(D, 1)
    problem = _DpProblem(hbm, ddr, cost, cost + ph * hbm + pd * ddr, keep, H, D)
    for dp in (KnapsackProposer._dp_cpp, KnapsackProposer._dp_numpy):
        above = dp(problem, max(H, 1), max(D, 1), best + 0.5, ph, pd)
        assert above is not None and above[1] == best
        if best > 0:
            assert dp(problem, max(H, 1), max(D, 1), best - 0.5, ph, pd) is None


@pytest.mark.parametrize("seed", range(6))
def test_budget_prices_kernel_equals_numpy_twin(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    hbm, ddr, cost, H, D = random_instance(rng, int(rng.integers(1, 200)), int(rng.integers(1, 20)), 0.5)
    ref = P.budget_prices(hbm, ddr, cost, H, D)
    got = P._budget_prices_cpp(hbm, ddr, cost, H, D)
    # Same steps; only the order of a few float sums differs (NumPy sums pairwise).
    assert got == pytest.approx(ref, rel=1e-9, abs=1e-12)
    # roomy budgets: the cheapest option of every table fits, nothing is priced
    big = P._budget_prices_cpp(hbm, ddr, cost, int(hbm.max(axis=1).sum()) * 2, int(ddr.max(axis=1).sum()) * 2)
    assert big == (0.0, 0.0)


@pytest.mark.parametrize("seed", range(8))
def test_prune_kernel_equals_numpy_twin(seed: int) -> None:
    rng = np.random.default_rng(300 + seed)
    m, k = int(rng.integers(1, 50)), int(rng.integers(1, 15))
    hbm, ddr, cost, H, D = random_instance(rng, m, k, 0.5)
    # ties and duplicates, so the lower-index rule matters
    hbm[:, k // 2] = hbm[:, 0]
    ddr[:, k // 2] = ddr[:, 0]
    cost[:, k // 2] = cost[:, 0]
    usable = np.isfinite(cost) & (hbm <= H) & (ddr <= D)
    np.testing.assert_array_equal(
        P._prune_dominated_cpp(hbm, ddr, cost, usable), P.prune_dominated(hbm, ddr, cost, usable)
    )


@pytest.mark.parametrize("seed", range(4))
def test_solve_backends_agree_and_keep_budgets(seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    hbm, ddr, cost, H, D = random_instance(rng, 60, 10, 0.55)
    r = np.arange(60)
    sols = {}
    for backend in ("cpp", "numpy"):
        for bins in ((64, 32), None):
            sol = KnapsackProposer(bins=bins, backend=backend).solve(hbm, ddr, cost, H, D)
            assert sol is not None
            assert hbm[r, sol].sum() <= H and ddr[r, sol].sum() <= D
            sols[backend, bins] = float(cost[r, sol].sum())
    for bins in ((64, 32), None):
        assert sols["cpp", bins] == pytest.approx(sols["numpy", bins], rel=1e-9)


def _op_args(m: int = 5, k: int = 4):
    rng = np.random.default_rng(3)
    hbm, ddr, cost, H, D = random_instance(rng, m, k, 0.7)
    keep, priced, ph, pd = prepared(hbm, ddr, cost, H, D)
    t = [torch.from_numpy(x) for x in (hbm, ddr, cost, priced, keep)]
    return t, H, D, ph, pd


def test_opcheck_and_fake_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    t, H, D, ph, pd = _op_args()
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.recpipe.placement_dp, (*t, H, D, 16, 8, math.inf, ph, pd), test_utils=utils)
    torch.library.opcheck(torch.ops.recpipe.placement_budget_prices, (t[0], t[1], t[2], H, D, 50), test_utils=utils)
    usable = torch.isfinite(t[2])
    torch.library.opcheck(torch.ops.recpipe.placement_prune_dominated, (t[0], t[1], t[2], usable), test_utils=utils)
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        ft = [mode.from_tensor(x) for x in t]
        choice, total = torch.ops.recpipe.placement_dp(*ft, H, D, 16, 8, math.inf, ph, pd)
        prices = torch.ops.recpipe.placement_budget_prices(ft[0], ft[1], ft[2], H, D, 50)
        kept = torch.ops.recpipe.placement_prune_dominated(ft[0], ft[1], ft[2], mode.from_tensor(t[4]))
    assert choice.dtype == torch.int64 and choice.dim() == 1 and total.shape == () and total.dtype == torch.float64
    assert prices.shape == (2,) and prices.dtype == torch.float64
    assert kept.shape == t[4].shape and kept.dtype == torch.bool
    real_choice, _ = torch.ops.recpipe.placement_dp(*t, H, D, 16, 8, math.inf, ph, pd)
    assert real_choice.shape == (5,)


def test_bad_input_errors_name_the_argument() -> None:
    t, H, D, ph, pd = _op_args()
    hbm, ddr, cost, priced, keep = t
    op = torch.ops.recpipe.placement_dp
    cases = [
        ((hbm.float(), ddr, cost, priced, keep, H, D, 4, 4, math.inf, ph, pd), "`hbm` and `ddr` must be int64"),
        ((hbm, ddr, cost.float(), priced, keep, H, D, 4, 4, math.inf, ph, pd), "`cost` must be float64"),
        ((hbm, ddr[:3], cost, priced, keep, H, D, 4, 4, math.inf, ph, pd), "must share one (tables, options) shape"),
        ((hbm[0], ddr[0], cost[0], priced[0], keep[0], H, D, 4, 4, math.inf, ph, pd), "`hbm` must be 2-D"),
        ((hbm, ddr, cost, priced, keep.long(), H, D, 4, 4, math.inf, ph, pd), "`keep` must be a CPU bool tensor"),
        ((hbm, ddr, cost, priced[:, :2], keep, H, D, 4, 4, math.inf, ph, pd), "`priced` must be a CPU float64"),
        ((hbm, ddr, cost, priced, keep, -1, D, 4, 4, math.inf, ph, pd), "budgets must be >= 0 bytes"),
        ((hbm, ddr, cost, priced, keep, H, D, -1, 4, math.inf, ph, pd), "`hbm_bins` and `ddr_bins` must be >= 0"),
        ((hbm, ddr, cost, priced, keep, H, D, 1 << 14, 1 << 14, math.inf, ph, pd), "pass fewer bins"),
        ((hbm, ddr, cost, priced, keep, H, D, 4, 4, math.nan, ph, pd), "`incumbent` is NaN"),
        ((hbm, ddr, cost, priced, keep, H, D, 4, 4, math.inf, -1.0, pd), "`price_hbm` and `price_ddr` must be"),
        ((hbm, ddr, cost, priced, keep, 1 << 60, D, 4, 4, math.inf, ph, pd), "budgets must be < 2^53 bytes"),
    ]
    big = hbm.clone()
    big[0, 0] = 1 << 60
    cases.append(
        ((big, ddr, cost, priced, torch.ones_like(keep), H, D, 4, 4, math.inf, ph, pd), "must be in [0, 2^53)")
    )
    for args, msg in cases:
        with pytest.raises(RuntimeError) as e:
            op(*args)
        assert msg in str(e.value), (msg, str(e.value))
    with pytest.raises(RuntimeError, match="`usable` must be a CPU bool tensor"):
        torch.ops.recpipe.placement_prune_dominated(hbm, ddr, cost, keep.long())
    with pytest.raises(RuntimeError, match="`iters` must be >= 1"):
        torch.ops.recpipe.placement_budget_prices(hbm, ddr, cost, H, D, 0)
    with pytest.raises(ValueError, match="backend must be"):
        KnapsackProposer(backend="gpu")


def test_empty_and_no_plan() -> None:
    e = torch.empty((0, 3), dtype=torch.int64)
    choice, total = torch.ops.recpipe.placement_dp(
        e, e, e.double(), e.double(), e.bool(), 10, 10, 4, 4, math.inf, 0.0, 0.0
    )
    assert choice.numel() == 0 and float(total) == 0.0
    # one table whose every option is over budget after the room check: no plan
    h = torch.tensor([[5, 6]], dtype=torch.int64)
    c = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    choice, total = torch.ops.recpipe.placement_dp(
        h, h, c, c, torch.ones_like(h, dtype=torch.bool), 4, 100, 4, 4, math.inf, 0.0, 0.0
    )
    assert choice.numel() == 0 and math.isinf(float(total))
    assert BruteForceProposer().solve(h.numpy(), h.numpy(), c.numpy(), 4, 100) is None
