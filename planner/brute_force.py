"""An exact proposer for small instances: every combination, meet-in-the-middle."""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from recpipe.pipeline.placement import check_int
from recpipe.planner.knapsack import _byte_totals, _prune_dominated, _validated

# Tables above which the brute-force proposer refuses (19^8 ~ 1.7e10 combos).
BRUTE_FORCE_MAX_TABLES: int = 8


class BruteForceProposer:
    """Exact solver for few tables: every combination, meet-in-the-middle.

    Options dominated within their table are dropped first (``prune_dominated``: keeps the answer exact);
    the two halves' combinations are enumerated with NumPy and paired block by block.
    """

    def __init__(self, max_tables: int = BRUTE_FORCE_MAX_TABLES) -> None:
        self.max_tables = check_int(max_tables, "BruteForceProposer(max_tables)", 1)

    @staticmethod
    def _combos(
        hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, opts: List[np.ndarray], first: int
    ) -> Tuple[np.ndarray, ...]:
        h, d, c = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.float64)
        idx = np.zeros((1, 0), dtype=np.int64)
        for t, o in enumerate(opts, start=first):
            h = (h[:, None] + hbm[t, o][None, :]).ravel()
            d = (d[:, None] + ddr[t, o][None, :]).ravel()
            c = (c[:, None] + cost[t, o][None, :]).ravel()
            idx = np.concatenate([np.repeat(idx, len(o), axis=0), np.tile(o, idx.shape[0])[:, None]], axis=1)
        return h, d, c, idx

    def solve(
        self, hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, hbm_budget: int, ddr_budget: int
    ) -> Optional[np.ndarray]:
        """See ``PlacementProposer.solve``."""
        hbm, ddr, cost = _validated(hbm, ddr, cost, hbm_budget, ddr_budget)
        M = cost.shape[0]
        if M > self.max_tables:
            raise ValueError(
                f"BruteForceProposer handles at most max_tables={self.max_tables} tables, got {M}: "
                "use KnapsackProposer."
            )
        if M == 0:
            return np.zeros(0, dtype=np.int64)
        usable = np.isfinite(cost) & (hbm <= hbm_budget) & (ddr <= ddr_budget)
        if not usable.any(axis=1).all():
            return None
        _byte_totals(hbm, ddr, usable)  # int64 sums of the combinations below cannot wrap
        opts = [np.flatnonzero(keep) for keep in _prune_dominated(hbm, ddr, cost, usable)]
        half = M // 2
        hl, dl, cl, il = self._combos(hbm, ddr, cost, opts[:half], 0)
        hr, dr, cr, ir = self._combos(hbm, ddr, cost, opts[half:], half)
        best_cost, best = np.inf, None
        block = max(1, 2_000_000 // max(len(hr), 1))
        for s in range(0, len(hl), block):
            e = min(s + block, len(hl))
            fits = (hl[s:e, None] + hr[None, :] <= hbm_budget) & (dl[s:e, None] + dr[None, :] <= ddr_budget)
            tot = np.where(fits, cl[s:e, None] + cr[None, :], np.inf)
            k = int(np.argmin(tot))
            if tot.flat[k] < best_cost:
                best_cost = float(tot.flat[k])
                a, b = divmod(k, len(hr))
                best = np.concatenate([il[s + a], ir[b]])
        return best


__all__ = ["BRUTE_FORCE_MAX_TABLES", "BruteForceProposer"]
