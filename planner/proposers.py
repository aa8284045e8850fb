"""The default proposer: a 2-D knapsack DP over (HBM bins, DDR bins) on the reachable cells, then an
exact-bytes local search. The relaxation loop runs as ``torch.ops.recpipe.placement_dp`` or its NumPy twin."""

from __future__ import annotations

import itertools
import math
from typing import List, NamedTuple, Optional, Tuple

import numpy as np

from recpipe.planner.knapsack import (
    DP_AXIS_BIN_CAP,
    EXACT_BYTES,
    PRICE_ITERS,
    _budget_prices_cpp,
    _byte_totals,
    _check_kernel_budgets,
    _check_kernel_grid,
    _cpp_ops,
    _loaded_ops,
    _prune_dominated,
    _prune_dominated_cpp,
    _tensors,
    _validated,
    budget_prices,
)

# Default DP work (cell, option updates) when ``bins`` is not given: the grid is sized so that
# sum_i options_i x min(cells, reachable combinations before table i) stays near it.
DP_WORK_TARGET: float = 2.0e7
# Smallest default grid per binding axis (HBM, DDR). Bins.
DP_MIN_BINS: Tuple[int, int] = (16, 8)
# Largest tables x options for which the repair tries every pair of single-table changes. Count.
REPAIR_PAIR_LIMIT: int = 256
# Largest C(tables, 3) x options^3 for which the repair tries every three-table change. Count.
REPAIR_TRIPLE_LIMIT: int = 400_000
# Most improving moves the repair applies (bounds its time on big instances). Moves.
REPAIR_MAX_STEPS: int = 200
# Relative slack of the incumbent bound (kBoundSlack in csrc/placement_dp.cpp): float error never drops a tie.
BOUND_SLACK: float = 1e-9
# Warm-start ladder: grids are halved while they keep LADDER_MIN_CELLS cells, at most LADDER_LEVELS - 1 times.
LADDER_MIN_CELLS: int = 128
LADDER_LEVELS: int = 3


class _DpProblem(NamedTuple):
    """One DP instance: the ``(M, K)`` option bytes and costs, the ``priced`` costs that rank plans sharing
    a cell, the options ``keep`` allows, and the budgets ``H`` (HBM per device) and ``D`` (DDR per machine)."""

    hbm: np.ndarray
    ddr: np.ndarray
    cost: np.ndarray
    priced: np.ndarray
    keep: np.ndarray
    H: int
    D: int


def _repair(p: _DpProblem, choice: np.ndarray, pair_limit: int, triple_limit: int) -> np.ndarray:
    """Exact-bytes local search on a feasible plan of ``p``: best improving 1-, 2- and 3-table changes.

    Only ``keep`` options are taken; every accepted move keeps both budgets and strictly lowers the cost,
    so the loop ends.
    """
    hbm, ddr, H, D = p.hbm, p.ddr, p.H, p.D
    M, K = p.cost.shape
    rows = np.arange(M)
    c = np.where(p.keep, p.cost, np.inf)
    for _ in range(REPAIR_MAX_STEPS):
        cur_h, cur_d, cur_c = hbm[rows, choice], ddr[rows, choice], c[rows, choice]
        slack_h, slack_d = H - int(cur_h.sum()), D - int(cur_d.sum())
        dh = hbm - cur_h[:, None]  # (M, K) change of usage / cost when table i takes option j
        dd = ddr - cur_d[:, None]
        dc = c - cur_c[:, None]
        single = np.where((dh <= slack_h) & (dd <= slack_d), dc, np.inf)
        k = int(np.argmin(single))
        move: Tuple[Tuple[int, int], ...] = ((k // K, k % K),)  # (table, option) pairs: one, two or three
        best_gain = float(single.flat[k])
        if M * K <= pair_limit and M > 1:
            fh, fd, fc = dh.ravel(), dd.ravel(), dc.ravel()
            tot = fc[:, None] + fc[None, :]
            ok = (fh[:, None] + fh[None, :] <= slack_h) & (fd[:, None] + fd[None, :] <= slack_d)
            owner = np.repeat(rows, K)
            ok &= owner[:, None] < owner[None, :]  # two different tables, each pair once
            tot = np.where(ok, tot, np.inf)
            q = int(np.argmin(tot))
            if tot.flat[q] < best_gain:
                a, b = divmod(q, M * K)
                best_gain, move = float(tot.flat[q]), ((a // K, a % K), (b // K, b % K))
        if M >= 3 and math.comb(M, 3) * K**3 <= triple_limit:
            for t in itertools.combinations(range(M), 3):
                x, y, z = t
                th = dh[x][:, None, None] + dh[y][None, :, None] + dh[z][None, None, :]
                td = dd[x][:, None, None] + dd[y][None, :, None] + dd[z][None, None, :]
                tc = dc[x][:, None, None] + dc[y][None, :, None] + dc[z][None, None, :]
                tc = np.where((th <= slack_h) & (td <= slack_d), tc, np.inf)
                q = int(np.argmin(tc))
                if tc.flat[q] < best_gain:
                    jx, rem = divmod(q, K * K)
                    jy, jz = divmod(rem, K)
                    best_gain, move = float(tc.flat[q]), ((x, jx), (y, jy), (z, jz))
        # Relative threshold: float noise must not loop forever.
        if not best_gain < -1e-12 * max(1.0, float(cur_c.sum())):
            return choice
        for i, j in move:
            choice[i] = j
    return choice


class _NumpyDpPass:
    """One DP pass over the tables in NumPy; the state is sparse, one entry per occupied cell."""

    def __init__(self, p: _DpProblem, nh: int, nd: int, incumbent: float, ph: float, pd: float) -> None:
        self.hbm, self.ddr, self.cost, self.priced, self.keep, self.H, self.D = p
        self.nh, self.nd, self.ph, self.pd = nh, nd, ph, pd
        self.stride = nd + 1
        self.ncell = (nh + 1) * self.stride
        # Bins per byte. A plan within float error of a bin edge may be filed one cell off, which is
        # harmless: feasibility is checked on exact bytes.
        self.fh = nh / p.H if (nh and p.H) else 0.0  # a zero budget holds only zero-byte plans: one bin
        self.fd = nd / p.D if (nd and p.D) else 0.0
        # Room every later table needs at least (its leanest kept option).
        big = np.iinfo(np.int64).max
        self.rest_h = _suffix_after(np.where(p.keep, p.hbm, big).min(axis=1))
        self.rest_d = _suffix_after(np.where(p.keep, p.ddr, big).min(axis=1))
        # Lagrangian bound of the later tables, sum_{l > i} min_j (c + ph h + pd d).
        self.rest_l = _suffix_after(np.where(p.keep, (p.cost + ph * p.hbm) + pd * p.ddr, np.inf).min(axis=1))
        self.bound = incumbent + BOUND_SLACK * max(1.0, abs(incumbent))
        self.P = np.zeros(1)  # priced cost
        self.T = np.zeros(1)  # true cost
        self.U = np.zeros(1, dtype=np.int64)  # exact HBM bytes
        self.V = np.zeros(1, dtype=np.int64)  # exact DDR bytes
        self.back_opt: List[np.ndarray] = []
        self.back_src: List[np.ndarray] = []
        self.best = np.empty(self.ncell)
        self.winner = np.empty(self.ncell, dtype=np.int64)
        self.grid = np.empty((nh + 1, nd + 1))

    def run(self) -> Optional[Tuple[np.ndarray, float]]:
        """Adds every table, then reads the cheapest plan back; None when none fits or beats the incumbent."""
        M = self.cost.shape[0]
        for i in range(M):
            if not self._add_table(i):
                return None
        pos = int(np.argmin(self.T))
        total = float(self.T[pos])
        if total > self.bound:
            return None  # the bound is a lower bound: the cheapest final plan can still lose to the incumbent
        choice = np.empty(M, dtype=np.int64)
        for i in range(M - 1, -1, -1):
            choice[i] = self.back_opt[i][pos]
            pos = int(self.back_src[i][pos])
        return choice, total

    def _add_table(self, i: int) -> bool:
        """Pushes every occupied cell through table ``i``'s kept options, keeping the cheapest per target cell."""
        opts = np.flatnonzero(self.keep[i])
        k = opts.size
        U2 = self.U[:, None] + self.hbm[i, opts]
        V2 = self.V[:, None] + self.ddr[i, opts]
        T2 = self.T[:, None] + self.cost[i, opts]
        lb = ((T2 + self.rest_l[i]) - self.ph * (self.H - U2)) - self.pd * (self.D - V2)
        fits = (U2 <= self.H - self.rest_h[i]) & (V2 <= self.D - self.rest_d[i]) & (lb <= self.bound)
        a = np.minimum(np.ceil(U2 * self.fh), self.nh)
        b = np.minimum(np.ceil(V2 * self.fd), self.nd)
        cell = (a * self.stride + b).astype(np.int64).ravel()
        P2 = (self.P[:, None] + self.priced[i, opts]).ravel()
        if fits.all():
            sel, cs, ps = None, cell, P2
        else:
            sel = np.flatnonzero(fits.ravel())
            if sel.size == 0:
                return False
            cs, ps = cell[sel], P2[sel]
        best, winner = self.best, self.winner
        best.fill(np.inf)
        np.minimum.at(best, cs, ps)
        won = ps == best[cs]  # the last of equals wins
        win_cells = cs[won]
        winner[win_cells] = np.flatnonzero(won) if sel is None else sel[won]
        occupied = np.flatnonzero(best < np.inf) if self.ncell <= 4 * win_cells.size else np.unique(win_cells)
        w = winner[occupied]  # flat (state, option) index of each cell's winner
        src, jj = np.divmod(w, k)
        self.P, self.T, self.U, self.V = best[occupied], T2.ravel()[w], U2.ravel()[w], V2.ravel()[w]
        bo, bs = opts[jj], src
        if self.nh > 0 and self.nd > 0 and occupied.size > 1:
            alive = self._undominated(occupied)
            if not alive.all():
                self.P, self.T, self.U, self.V = self.P[alive], self.T[alive], self.U[alive], self.V[alive]
                bo, bs = bo[alive], bs[alive]
        self.back_opt.append(bo)
        self.back_src.append(bs)
        return True

    def _undominated(self, occupied: np.ndarray) -> np.ndarray:
        """Mask of the states no state in a cell strictly lower on both axes beats at no more cost."""
        grid = self.grid
        grid.fill(np.inf)
        grid.ravel()[occupied] = self.T
        low = np.minimum.accumulate(np.minimum.accumulate(grid, axis=0), axis=1)
        ra, rb = np.divmod(occupied, self.stride)
        lower = np.full(occupied.size, np.inf)
        inner = (ra > 0) & (rb > 0)
        lower[inner] = low[ra[inner] - 1, rb[inner] - 1]
        return lower > self.T


def _suffix_after(values: np.ndarray) -> np.ndarray:
    """``out[i] = sum(values[i + 1:])``."""
    return np.concatenate([np.cumsum(values[::-1])[::-1][1:], np.zeros(1, dtype=values.dtype)])


class KnapsackProposer:
    """2-D knapsack DP over (HBM bins, DDR bins) with back-pointers, then exact repair.

    State: for every occupied cell ``(a, b)`` the cheapest partial plan whose exact usage rounds *up* to
    it; each cell carries its plan's exact bytes, so rounding never accumulates. A candidate is dropped
    when the later tables' leanest options no longer fit, when its Lagrangian bound cannot beat the
    incumbent, or when a plan strictly below it on both axes costs no more. With coarse bins, plans sharing
    a cell are ranked on cost plus budget prices; if that finds no plan, a second pass ranks them by bytes.
    Tables go largest first, and grids are solved as a coarse-to-fine ladder.

    Args:
        bins: (HBM bins, DDR bins); None sizes the grid for about ``DP_WORK_TARGET`` updates, at most
            ``DP_AXIS_BIN_CAP`` per axis, HBM:DDR = 2:1.
        repair: run the exact local search on the DP's plan.
        backend: ``"cpp"`` (the ``recpipe._C`` kernels), ``"numpy"`` (their twins, same plan) or ``"auto"``
            (cpp when it loads). Option byte sums of 2^53 or more on an axis are refused (a size typo).
    """

    def __init__(self, bins: Optional[Tuple[int, int]] = None, repair: bool = True, backend: str = "auto") -> None:
        if backend not in ("auto", "cpp", "numpy"):
            raise ValueError(f"backend must be 'auto', 'cpp' or 'numpy', got {backend!r}.")
        if backend == "cpp" and _cpp_ops() is None:
            raise RuntimeError(
                "backend='cpp' needs the compiled kernels torch.ops.recpipe.placement_dp (recpipe._C), which did not "
                "load; build/install recpipe (`make venv`) or pass backend='numpy'."
            )
        self.backend = "cpp" if backend == "cpp" or (backend == "auto" and _cpp_ops() is not None) else "numpy"
        if bins is not None:
            if (
                not isinstance(bins, (tuple, list))
                or len(bins) != 2
                or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in bins)
            ):
                raise ValueError(
                    f"bins must be a pair of positive ints (hbm_bins, ddr_bins), got "
                    f"{type(bins).__name__} {bins!r}; e.g. bins=(100, 50), or None to size the grid."
                )
            bins = (int(bins[0]), int(bins[1]))
        if not isinstance(repair, (bool, np.bool_)):
            raise ValueError(f"repair must be True or False, got {type(repair).__name__} {repair!r}.")
        self._bins = bins
        self.repair = bool(repair)
        self.last_bins: Tuple[int, int] = (0, 0)

    def _grid(self, options_per_table: np.ndarray, hbm_binds: bool, ddr_binds: bool) -> Tuple[int, int]:
        if self._bins is not None:
            nh, nd = self._bins
        else:
            # The work for a grid of C cells is sum_i k_i * min(C, prod_{l<i} k_l): few tables afford fine bins.
            k = options_per_table.astype(np.float64)
            reach = np.exp(np.minimum(np.cumsum(np.log(np.concatenate([[1.0], k[:-1]]))), math.log(1e18)))
            lo, hi = 1.0, float(DP_AXIS_BIN_CAP + 1) ** 2
            for _ in range(60):  # bisection on the cell count C
                mid = math.sqrt(lo * hi)
                lo, hi = (mid, hi) if float(np.sum(k * np.minimum(mid, reach))) <= DP_WORK_TARGET else (lo, mid)
            cells = lo
            if hbm_binds and ddr_binds:
                nh = int(math.sqrt(2.0 * cells))
                nh, nd = max(nh, DP_MIN_BINS[0]), max(nh // 2, DP_MIN_BINS[1])
            else:
                nh = nd = max(int(cells), DP_MIN_BINS[0])
            nh, nd = min(nh, DP_AXIS_BIN_CAP), min(nd, DP_AXIS_BIN_CAP)
        return (nh if hbm_binds else 0), (nd if ddr_binds else 0)

    @staticmethod
    def _dp_numpy(
        p: _DpProblem, nh: int, nd: int, incumbent: float = math.inf, ph: float = 0.0, pd: float = 0.0
    ) -> Optional[Tuple[np.ndarray, float]]:
        """One DP pass in NumPy (the twin of ``placement_dp``): (choice, cost), or None when no plan fits
        or beats ``incumbent`` (partial plans whose Lagrangian bound at prices ``ph``, ``pd`` exceeds it drop)."""
        return _NumpyDpPass(p, nh, nd, incumbent, ph, pd).run()

    @staticmethod
    def _dp_cpp(
        p: _DpProblem, nh: int, nd: int, incumbent: float = math.inf, ph: float = 0.0, pd: float = 0.0
    ) -> Optional[Tuple[np.ndarray, float]]:
        """One DP pass through ``torch.ops.recpipe.placement_dp``; budgets and grids it refuses are named first."""
        _check_kernel_budgets("placement_dp", p.H, p.D, EXACT_BYTES - 1, "2^53 - 1, its exact byte range")
        _check_kernel_grid(None, nh, nd)
        choice, total = _loaded_ops()[1].placement_dp(
            *_tensors(p.hbm, p.ddr, p.cost, p.priced, p.keep), p.H, p.D, nh, nd, float(incumbent), float(ph), float(pd)
        )
        # an empty choice: no plan fits or beats the incumbent
        return (choice.numpy(), float(total)) if choice.numel() == p.cost.shape[0] else None

    def solve(
        self, hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, hbm_budget: int, ddr_budget: int
    ) -> Optional[np.ndarray]:
        """See ``PlacementProposer.solve``."""
        hbm, ddr, cost = _validated(hbm, ddr, cost, hbm_budget, ddr_budget)
        H, D = int(hbm_budget), int(ddr_budget)
        M = cost.shape[0]
        if M == 0:
            return np.zeros(0, dtype=np.int64)
        usable = np.isfinite(cost) & (hbm <= H) & (ddr <= D)
        if not usable.any(axis=1).all():
            return None
        # A budget at or past 2^53 bytes (the kernel's exact range) binds no plan: solving at the sum of each
        # table's largest option (below 2^53) gives the same plan.
        max_h, max_d = _byte_totals(hbm, ddr, usable)
        H = max_h if H >= EXACT_BYTES else H
        D = max_d if D >= EXACT_BYTES else D
        keep = (_prune_dominated if self.backend == "numpy" else _prune_dominated_cpp)(hbm, ddr, cost, usable)
        nh, nd = self._grid(keep.sum(axis=1), max_h > H, max_d > D)
        self.last_bins = (nh, nd)
        if self.backend == "cpp":  # the finest grid of the ladder below; bins=None never comes near
            _check_kernel_grid(self._bins, nh, nd)
        # Prices per byte of the binned budgets: with coarse bins, ranking on cost + prices x bytes stops
        # cheap-but-greedy plans from evicting lean ones cell after cell.
        ph = pd = 0.0
        if nh or nd:
            prices = budget_prices if self.backend == "numpy" else _budget_prices_cpp
            lh, ld = prices(hbm, ddr, cost, H, D, PRICE_ITERS)
            ph, pd = (lh / H if nh else 0.0), (ld / D if nd else 0.0)
        priced = cost + ph * hbm + pd * ddr
        # Big tables first: the last tables then fill the slack the bins cannot see.
        size = np.where(usable, hbm / max(H, 1) + ddr / max(D, 1), 0.0).max(axis=1)
        order = np.argsort(-size, kind="stable")
        problem = _DpProblem(hbm[order], ddr[order], cost[order], priced[order], keep[order], H, D)
        choice = self._ladder(problem, nh, nd, ph, pd)
        if choice is None:
            return None
        out = np.empty(M, dtype=np.int64)
        out[order] = choice
        return out

    def _ladder(self, p: _DpProblem, nh: int, nd: int, ph: float, pd: float) -> Optional[np.ndarray]:
        """The cheapest repaired plan of the ladder's passes, each coarser pass's plan the next's incumbent."""
        dp = self._dp_cpp if self.backend == "cpp" else self._dp_numpy
        rows = np.arange(p.cost.shape[0])
        levels = [(nh, nd)]
        while len(levels) < LADDER_LEVELS:
            a, b = levels[0][0] // 2, levels[0][1] // 2
            if (a + 1) * (b + 1) < LADDER_MIN_CELLS:
                break
            levels.insert(0, (a, b))
        inc_choice: Optional[np.ndarray] = None
        inc_cost = math.inf
        for a, b in levels:
            found = dp(p, a, b, inc_cost, ph, pd)
            if found is None and inc_choice is None and (a or b):
                # A cheaper plan can evict a leaner one from a shared cell on a sliver-thin budget:
                # retry ranking plans in a cell by bytes, cost only breaking ties.
                lean = (p.hbm / max(p.H, 1) if a else 0.0) + (p.ddr / max(p.D, 1) if b else 0.0)
                scale = float(np.abs(np.where(np.isfinite(p.cost), p.cost, 0.0)).sum()) + 1.0
                found = dp(p._replace(priced=p.cost + 1e6 * scale * lean), a, b)
            if found is None:
                continue  # nothing beats the incumbent at this grid
            choice = found[0]
            if self.repair:
                choice = _repair(p, choice, REPAIR_PAIR_LIMIT, REPAIR_TRIPLE_LIMIT)
            total = float(p.cost[rows, choice].sum())
            if total < inc_cost:
                inc_choice, inc_cost = choice, total
        return inc_choice


__all__ = [
    "DP_MIN_BINS",
    "DP_WORK_TARGET",
    "KnapsackProposer",
    "REPAIR_MAX_STEPS",
    "REPAIR_PAIR_LIMIT",
    "REPAIR_TRIPLE_LIMIT",
]
