"""Proposers: pick one option per table minimising total cost under two budgets.

Both proposers solve the same problem, given as arrays of shape ``(M, K)``
(tables x options; missing options have ``cost = inf``):

    minimise   sum_i cost[i, j_i]
    such that  sum_i hbm[i, j_i] <= hbm_budget   (bytes per device)
               sum_i ddr[i, j_i] <= ddr_budget   (bytes per machine)

``DynamicProgrammingProposer`` is the 2-D knapsack DP over (HBM bins, DDR bins)
written as array operations; ``BruteForceProposer`` enumerates every
combination (<= 8 tables) and is exact.
"""

from __future__ import annotations

import math
from typing import List, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

# Per-axis bin cap of the 2-D DP grid, as in TorchEasyRec PR #508
# (``_DP_AXIS_BIN_CAP``). Bins.
DP_AXIS_BIN_CAP: int = 1024
# Default DP work when ``bins`` is not given: tables x options x cells stays
# near this many cell updates (~0.5 s for 1000 tables with NumPy on one core here).
DP_WORK_TARGET: float = 2.0e7
# Smallest default grid per binding axis (HBM, DDR). Bins.
DP_MIN_BINS: Tuple[int, int] = (16, 8)
# Sentinel "usage" of an unreachable DP cell (bytes); far above any budget.
_UNREACHABLE: int = np.iinfo(np.int64).max // 4
# Tables above which the brute-force proposer refuses (19^8 ~ 1.7e10 combos).
BRUTE_FORCE_MAX_TABLES: int = 8


@runtime_checkable
class Proposer(Protocol):
    """Chooses one option index per table."""

    def solve(
        self,
        hbm: np.ndarray,
        ddr: np.ndarray,
        cost: np.ndarray,
        hbm_budget: int,
        ddr_budget: int,
    ) -> Optional[np.ndarray]:
        """Solve the placement knapsack.

        Args:
            hbm (np.ndarray): ``(M, K)`` int64 HBM bytes per device of each option.
            ddr (np.ndarray): ``(M, K)`` int64 DDR bytes per machine of each option.
            cost (np.ndarray): ``(M, K)`` float64 cost, ``inf`` for no option.
            hbm_budget (int): HBM bytes per device.
            ddr_budget (int): DDR bytes per machine.

        Returns:
            Optional[np.ndarray]: ``(M,)`` chosen option per table, or None if no
            combination fits.
        """
        ...


def _validate(hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, hbm_budget: int, ddr_budget: int) -> None:
    if not (hbm.shape == ddr.shape == cost.shape and cost.ndim == 2):
        raise ValueError(
            f"hbm {hbm.shape}, ddr {ddr.shape} and cost {cost.shape} must share one (tables, options) shape."
        )
    if hbm_budget < 0 or ddr_budget < 0:
        raise ValueError(f"budgets must be >= 0 bytes, got hbm_budget={hbm_budget}, ddr_budget={ddr_budget}.")


def budget_prices(
    hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, hbm_budget: int, ddr_budget: int, iters: int = 200
) -> Tuple[float, float]:
    """Lagrange prices (cost per whole budget) of the HBM and DDR constraints.

    Projected subgradient ascent on the dual
    ``g(l) = sum_i min_j (c_ij + l_h h_ij / H + l_d d_ij / D) - l_h - l_d``.
    The DP prices partial plans with them when two share a grid cell, so a
    cheaper plan that eats more of a binding budget does not evict a leaner one.

    Args:
        hbm (np.ndarray): ``(M, K)`` HBM bytes.
        ddr (np.ndarray): ``(M, K)`` DDR bytes.
        cost (np.ndarray): ``(M, K)`` costs (``inf`` = no option).
        hbm_budget (int): HBM budget.
        ddr_budget (int): DDR budget.
        iters (int): subgradient steps.

    Returns:
        Tuple[float, float]: ``(l_h, l_d)``, in cost units per full budget.
    """
    ok = np.isfinite(cost)
    if not ok.any():
        return 0.0, 0.0
    a = np.where(ok, hbm / max(hbm_budget, 1), 0.0)
    b = np.where(ok, ddr / max(ddr_budget, 1), 0.0)
    c = np.where(ok, cost, np.inf)
    spread = float(np.sum(np.where(ok, cost, -np.inf).max(axis=1) - c.min(axis=1)))
    scale = max(spread, 1e-12)
    lh = ld = 0.0
    best = (-np.inf, 0.0, 0.0)
    rows = np.arange(cost.shape[0])
    for k in range(iters):
        j = np.argmin(c + lh * a + ld * b, axis=1)
        ga, gb = a[rows, j].sum() - 1.0, b[rows, j].sum() - 1.0
        g = float((c[rows, j] + lh * a[rows, j] + ld * b[rows, j]).sum() - lh - ld)
        if g > best[0]:
            best = (g, lh, ld)
        step = scale / (k + 1)
        lh, ld = max(0.0, lh + step * ga), max(0.0, ld + step * gb)
    return best[1], best[2]


class DynamicProgrammingProposer:
    """2-D knapsack DP over (HBM bins, DDR bins), one min-plus array update per table.

    State: for every grid cell ``(a, b)`` the cheapest partial plan whose exact
    cumulative usage ``(U, V)`` rounds *up* to that cell, i.e.
    ``a = ceil(U * nh / hbm_budget)`` and ``b = ceil(V * nd / ddr_budget)``. Each
    cell carries its plan's exact bytes, so budgets are checked on exact bytes
    (a plan never breaks a budget) and rounding never accumulates over tables.
    Adding table ``i`` with option ``(h, d, c)`` moves a plan by
    ``floor(h * nh / H)`` (+0 or +1) cells: the update is a shifted-slice min-plus
    per option over the whole grid, followed by a re-bucketing of each plan to
    its exact rounded-up cell (four masked shifts). Back-pointers (option, source
    cell) per table give the plan. With one bin per byte the DP is exact; with
    coarser bins two partial plans in one cell keep only the cheaper.

    An axis whose budget cannot bind (the heaviest option of every table fits
    together) is collapsed to one bin, so all resolution goes where it matters.

    Args:
        bins (Optional[Tuple[int, int]]): (HBM bins, DDR bins) per device /
            machine budget. None picks them from the problem size (about
            ``DP_WORK_TARGET`` cell updates, at most ``DP_AXIS_BIN_CAP`` per axis,
            HBM:DDR = 2:1 like the seed's 100:50).

    Example::

        choice = DynamicProgrammingProposer(bins=(100, 50)).solve(hbm, ddr, cost, H, D)
    """

    def __init__(self, bins: Optional[Tuple[int, int]] = None) -> None:
        if bins is not None:
            if len(bins) != 2 or any((not isinstance(b, (int, np.integer))) or b < 1 for b in bins):
                raise ValueError(f"bins must be a pair of positive ints (hbm_bins, ddr_bins), got {bins!r}.")
            bins = (int(bins[0]), int(bins[1]))
        self._bins = bins
        self.last_bins: Tuple[int, int] = (0, 0)
        self.last_prices: Tuple[float, float] = (0.0, 0.0)

    def _grid(self, num_tables: int, num_options: int, hbm_binds: bool, ddr_binds: bool) -> Tuple[int, int]:
        if self._bins is not None:
            nh, nd = self._bins
        else:
            cells = DP_WORK_TARGET / max(num_tables * num_options, 1)
            if hbm_binds and ddr_binds:
                nh = int(math.sqrt(2.0 * cells))
                nh, nd = max(nh, DP_MIN_BINS[0]), max(nh // 2, DP_MIN_BINS[1])
            else:
                nh = nd = max(int(cells), DP_MIN_BINS[0])
            nh, nd = min(nh, DP_AXIS_BIN_CAP), min(nd, DP_AXIS_BIN_CAP)
        return (nh if hbm_binds else 0), (nd if ddr_binds else 0)

    def solve(
        self,
        hbm: np.ndarray,
        ddr: np.ndarray,
        cost: np.ndarray,
        hbm_budget: int,
        ddr_budget: int,
    ) -> Optional[np.ndarray]:
        """See ``Proposer.solve``."""
        hbm = np.asarray(hbm, dtype=np.int64)
        ddr = np.asarray(ddr, dtype=np.int64)
        cost = np.asarray(cost, dtype=np.float64)
        _validate(hbm, ddr, cost, hbm_budget, ddr_budget)
        H, D = int(hbm_budget), int(ddr_budget)
        M, K = cost.shape
        if M == 0:
            return np.zeros(0, dtype=np.int64)
        usable = np.isfinite(cost) & (hbm <= H) & (ddr <= D)
        if not usable.any(axis=1).all():
            return None
        max_h = np.where(usable, hbm, 0).max(axis=1).sum()
        max_d = np.where(usable, ddr, 0).max(axis=1).sum()
        nh, nd = self._grid(M, K, bool(max_h > H), bool(max_d > D))
        self.last_bins = (nh, nd)
        shape = (nh + 1, nd + 1)
        ncell = shape[0] * shape[1]
        flat = np.arange(ncell, dtype=np.int32).reshape(shape)
        rows_a = np.arange(nh + 1, dtype=np.int64)[:, None]
        cols_b = np.arange(nd + 1, dtype=np.int64)[None, :]

        # Plans sharing a cell are compared on cost + budget prices x bytes (the
        # true cost is carried alongside): with one bin per byte this changes
        # nothing, with coarse bins it stops cheap-but-greedy plans from
        # evicting lean ones cell after cell (which would drift towards
        # per-table rounding and lose feasible plans).
        lh, ld = budget_prices(hbm, ddr, cost, H, D) if (nh or nd) else (0.0, 0.0)
        ph = lh / H if nh else 0.0
        pd = ld / D if nd else 0.0
        self.last_prices = (lh, ld)
        C = np.full(shape, np.inf)
        T = np.full(shape, np.inf)
        U = np.full(shape, _UNREACHABLE, dtype=np.int64)
        V = np.full(shape, _UNREACHABLE, dtype=np.int64)
        C[0, 0], T[0, 0], U[0, 0], V[0, 0] = 0.0, 0.0, 0, 0
        opt_dtype = np.int8 if K < 127 else np.int32
        back_opt: List[np.ndarray] = []
        back_src: List[np.ndarray] = []

        for i in range(M):
            Cn = np.full(shape, np.inf)
            Tn = np.full(shape, np.inf)
            Un = np.full(shape, _UNREACHABLE, dtype=np.int64)
            Vn = np.full(shape, _UNREACHABLE, dtype=np.int64)
            On = np.full(shape, -1, dtype=opt_dtype)
            Sn = np.full(shape, -1, dtype=np.int32)
            for j in np.flatnonzero(usable[i]):
                h, d, c = int(hbm[i, j]), int(ddr[i, j]), float(cost[i, j])
                sa = (h * nh) // H if nh else 0
                sb = (d * nd) // D if nd else 0
                if sa > nh or sb > nd:
                    continue
                ea, eb = nh + 1 - sa, nd + 1 - sb
                Us, Vs = U[:ea, :eb], V[:ea, :eb]
                cand = C[:ea, :eb] + (c + ph * h + pd * d)
                dst_c = Cn[sa:, sb:]
                better = cand < dst_c
                better &= Us <= H - h
                better &= Vs <= D - d
                np.copyto(dst_c, cand, where=better)
                np.copyto(Tn[sa:, sb:], T[:ea, :eb] + c, where=better)
                np.copyto(Un[sa:, sb:], Us + h, where=better)
                np.copyto(Vn[sa:, sb:], Vs + d, where=better)
                np.copyto(On[sa:, sb:], j, where=better, casting="unsafe")
                np.copyto(Sn[sa:, sb:], flat[:ea, :eb], where=better)
            # Re-bucket every plan to the cell its exact bytes round up to:
            # the floor shift above is short by 0 or 1 cell per axis.
            reach = Un < _UNREACHABLE
            if not reach.any():
                return None
            da = np.zeros(shape, dtype=np.int64)
            db = np.zeros(shape, dtype=np.int64)
            if nh:
                np.subtract((np.where(reach, Un, 0) * nh + H - 1) // H, rows_a, out=da, where=reach)
            if nd:
                np.subtract((np.where(reach, Vn, 0) * nd + D - 1) // D, cols_b, out=db, where=reach)
            if da.any() or db.any():
                C2 = np.full(shape, np.inf)
                T2 = np.full(shape, np.inf)
                U2 = np.full(shape, _UNREACHABLE, dtype=np.int64)
                V2 = np.full(shape, _UNREACHABLE, dtype=np.int64)
                O2 = np.full(shape, -1, dtype=opt_dtype)
                S2 = np.full(shape, -1, dtype=np.int32)
                for ta in (0, 1):
                    for tb in (0, 1):
                        m = reach & (da == ta) & (db == tb)
                        if not m.any():
                            continue
                        ea, eb = nh + 1 - ta, nd + 1 - tb
                        src_c = Cn[:ea, :eb]
                        dst_c = C2[ta:, tb:]
                        better = m[:ea, :eb] & (src_c < dst_c)
                        np.copyto(dst_c, src_c, where=better)
                        np.copyto(T2[ta:, tb:], Tn[:ea, :eb], where=better)
                        np.copyto(U2[ta:, tb:], Un[:ea, :eb], where=better)
                        np.copyto(V2[ta:, tb:], Vn[:ea, :eb], where=better)
                        np.copyto(O2[ta:, tb:], On[:ea, :eb], where=better)
                        np.copyto(S2[ta:, tb:], Sn[:ea, :eb], where=better)
                Cn, Tn, Un, Vn, On, Sn = C2, T2, U2, V2, O2, S2
            C, T, U, V = Cn, Tn, Un, Vn
            back_opt.append(On)
            back_src.append(Sn)

        if not np.isfinite(T).any():
            return None
        cell = int(np.argmin(T))
        choice = np.empty(M, dtype=np.int64)
        for i in range(M - 1, -1, -1):
            choice[i] = int(back_opt[i].flat[cell])
            cell = int(back_src[i].flat[cell])
        return choice


class BruteForceProposer:
    """Exact solver: every combination, meet-in-the-middle, for <= 8 tables.

    Options dominated within their table (no less HBM, DDR and cost than another
    option) are dropped first, which keeps the answer exact. The tables are split
    in two halves whose combinations are enumerated with NumPy; each block of
    left-half combinations is paired with all right-half combinations.

    Args:
        max_tables (int): refuse larger instances (default 8).
    """

    def __init__(self, max_tables: int = BRUTE_FORCE_MAX_TABLES) -> None:
        self.max_tables = max_tables

    @staticmethod
    def _combos(
        hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, opts: List[np.ndarray], first: int
    ) -> Tuple[np.ndarray, ...]:
        h = np.zeros(1, dtype=np.int64)
        d = np.zeros(1, dtype=np.int64)
        c = np.zeros(1, dtype=np.float64)
        idx = np.zeros((1, 0), dtype=np.int64)
        for t, o in enumerate(opts, start=first):
            h = (h[:, None] + hbm[t, o][None, :]).ravel()
            d = (d[:, None] + ddr[t, o][None, :]).ravel()
            c = (c[:, None] + cost[t, o][None, :]).ravel()
            idx = np.concatenate(
                [np.repeat(idx, len(o), axis=0), np.tile(o, idx.shape[0])[:, None]], axis=1
            )
        return h, d, c, idx

    def solve(
        self,
        hbm: np.ndarray,
        ddr: np.ndarray,
        cost: np.ndarray,
        hbm_budget: int,
        ddr_budget: int,
    ) -> Optional[np.ndarray]:
        """See ``Proposer.solve``."""
        hbm = np.asarray(hbm, dtype=np.int64)
        ddr = np.asarray(ddr, dtype=np.int64)
        cost = np.asarray(cost, dtype=np.float64)
        _validate(hbm, ddr, cost, hbm_budget, ddr_budget)
        M = cost.shape[0]
        if M > self.max_tables:
            raise ValueError(
                f"BruteForceProposer handles at most max_tables={self.max_tables} tables, got {M}: "
                "use DynamicProgrammingProposer."
            )
        if M == 0:
            return np.zeros(0, dtype=np.int64)
        opts: List[np.ndarray] = []
        for t in range(M):
            ok = np.flatnonzero(np.isfinite(cost[t]) & (hbm[t] <= hbm_budget) & (ddr[t] <= ddr_budget))
            keep = []
            for j in ok:
                dominated = np.any(
                    (hbm[t, ok] <= hbm[t, j]) & (ddr[t, ok] <= ddr[t, j]) & (cost[t, ok] <= cost[t, j])
                    & ((hbm[t, ok] < hbm[t, j]) | (ddr[t, ok] < ddr[t, j]) | (cost[t, ok] < cost[t, j]))
                )
                if not dominated:
                    keep.append(j)
            if not keep:
                return None
            opts.append(np.asarray(keep, dtype=np.int64))
        half = M // 2
        hl, dl, cl, il = self._combos(hbm, ddr, cost, opts[:half], 0)
        hr, dr, cr, ir = self._combos(hbm, ddr, cost, opts[half:], half)
        best_cost, best = np.inf, None
        block = max(1, 2_000_000 // max(len(hr), 1))
        for s in range(0, len(hl), block):
            e = min(s + block, len(hl))
            tot = cl[s:e, None] + cr[None, :]
            fits = (hl[s:e, None] + hr[None, :] <= hbm_budget) & (dl[s:e, None] + dr[None, :] <= ddr_budget)
            tot = np.where(fits, tot, np.inf)
            k = int(np.argmin(tot))
            if tot.flat[k] < best_cost:
                best_cost = float(tot.flat[k])
                a, b = divmod(k, len(hr))
                best = np.concatenate([il[s + a], ir[b]])
        return best


__all__ = [
    "BRUTE_FORCE_MAX_TABLES",
    "BruteForceProposer",
    "DP_AXIS_BIN_CAP",
    "DP_MIN_BINS",
    "DP_WORK_TARGET",
    "DynamicProgrammingProposer",
    "Proposer",
]
