"""Extension points of the placement planner: a :class:`CostModel` prices a table's placement options,
a :class:`Proposer` picks one option per table under the budgets."""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, Tuple, runtime_checkable

import numpy as np

from recpipe.pipeline.placement import Mode
from recpipe.planner.specs import TableSpec


@runtime_checkable
class CostModel(Protocol):
    """Prices placement options of one table in modelled milliseconds per step."""

    name: str

    def costs(self, table: TableSpec, options: Sequence[Tuple[Mode, float]]) -> np.ndarray:
        """Modelled step cost (float64 ms) of each ``(mode, x)`` option of ``table``."""
        ...


@runtime_checkable
class Proposer(Protocol):
    """Chooses one option index per table."""

    def solve(
        self, hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, hbm_budget: int, ddr_budget: int
    ) -> Optional[np.ndarray]:
        """Solve the knapsack: minimise ``sum_i cost[i, j_i]`` with ``sum_i hbm[i, j_i] <= hbm_budget``
        and ``sum_i ddr[i, j_i] <= ddr_budget``.

        Args:
            hbm: ``(M, K)`` int64 HBM bytes per device of each option.
            ddr: ``(M, K)`` int64 DDR bytes per machine of each option.
            cost: ``(M, K)`` float64 cost, ``inf`` for no option.

        Returns:
            ``(M,)`` chosen option per table, or None if no combination fits.
        """
        ...


__all__ = ["CostModel", "Proposer"]
