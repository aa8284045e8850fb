"""Partitioner: the rank that holds each table-wise table.

The knapsack budgets a table-wise table by its share of every rank (``ceil(bytes / W)``); this stage
places the whole table on one rank. Row-wise tables load every rank alike (their largest shard), so
each rank starts at that load (and each machine at their slow-tier load). Tables go largest first to the
rank with the least modelled cost so far among those whose fast tier (and machine's slow tier) still holds
them (ties: fewer bytes, then the lower rank), which balances the
lookups and the output traffic table-wise owners carry. Tables no rank can hold are returned for the
planner to repair (it re-plans them row-wise) or refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class Partition:
    """Owner rank per table-wise table (``-1``: no rank holds it), the fast-tier bytes of every rank and the
    slow-tier bytes of every machine."""

    owners: np.ndarray
    rank_bytes: np.ndarray
    machine_slow_bytes: np.ndarray

    @property
    def unplaced(self) -> np.ndarray:
        """Indices (into the partitioned tables) of the tables no rank could hold."""
        return np.flatnonzero(self.owners < 0)


class GreedyTableWisePartitioner:
    """Largest table first onto the cheapest rank that holds it (see the module docstring)."""

    def partition(
        self,
        table_bytes: Sequence[int],
        table_slow_bytes: Sequence[int],
        table_costs: Sequence[float],
        base: Tuple[int, int],
        budgets: Tuple[int, int],
        world_size: int,
        local_world_size: int,
    ) -> Partition:
        """Owners of the table-wise tables.

        Args:
            table_bytes: fast-tier bytes of each table-wise table (all on its owner).
            table_slow_bytes: its slow-tier bytes (on its owner's machine).
            table_costs: modelled ms per step of each (balanced across ranks).
            base: fast-tier bytes every rank and slow-tier bytes every machine already hold (the row-wise
                tables' largest shards).
            budgets: fast-tier bytes per rank, slow-tier bytes per machine.
            world_size: ranks; ``local_world_size``: ranks per machine (rank ``r`` is on machine ``r // L``).

        Returns:
            :class:`Partition`.
        """
        sizes = np.asarray(table_bytes, dtype=np.int64)
        slow = np.asarray(table_slow_bytes, dtype=np.int64)
        costs = np.asarray(table_costs, dtype=np.float64)
        (base_fast, base_slow), (budget, ddr_budget) = base, budgets
        L = local_world_size
        owners = np.full(sizes.shape[0], -1, dtype=np.int64)
        rank_bytes = np.full(world_size, int(base_fast), dtype=np.int64)
        rank_cost = np.zeros(world_size)
        machine_slow = np.full(world_size // L, int(base_slow), dtype=np.int64)
        machine_of = np.arange(world_size) // L
        for i in sorted(range(sizes.shape[0]), key=lambda k: (-int(sizes[k]), -int(slow[k]), k)):
            fits = (rank_bytes + sizes[i] <= budget) & (machine_slow[machine_of] + slow[i] <= ddr_budget)
            if not fits.any():
                continue
            # the cheapest rank that holds it; ties: fewer bytes, then the lower rank
            load = np.where(fits, rank_cost, np.inf)
            tied = np.flatnonzero(load == load.min())
            rank = int(tied[np.argmin(rank_bytes[tied])])
            owners[i] = rank
            rank_bytes[rank] += sizes[i]
            rank_cost[rank] += costs[i]
            machine_slow[machine_of[rank]] += slow[i]
        return Partition(owners=owners, rank_bytes=rank_bytes, machine_slow_bytes=machine_slow)


__all__ = ["GreedyTableWisePartitioner", "Partition"]
