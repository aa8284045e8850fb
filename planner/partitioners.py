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

import heapq
from dataclasses import dataclass
from typing import List, Sequence, Tuple

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
        machine_slow = np.full(world_size // L, int(base_slow), dtype=np.int64)
        # a heap of (cost, bytes, rank) over ranks; a rank too full for one table may still take a smaller one
        heap: List[Tuple[float, int, int]] = [(0.0, int(base_fast), r) for r in range(world_size)]
        for i in sorted(range(sizes.shape[0]), key=lambda k: (-int(sizes[k]), -int(slow[k]), k)):
            size, slow_size = int(sizes[i]), int(slow[i])
            skipped: List[Tuple[float, int, int]] = []
            while heap and (heap[0][1] + size > budget or int(machine_slow[heap[0][2] // L]) + slow_size > ddr_budget):
                skipped.append(heapq.heappop(heap))
            if heap:
                cost, used, rank = heapq.heappop(heap)
                owners[i] = rank
                rank_bytes[rank] = used + size
                machine_slow[rank // L] += slow_size
                heapq.heappush(heap, (cost + float(costs[i]), used + size, rank))
            for entry in skipped:
                heapq.heappush(heap, entry)
        return Partition(owners=owners, rank_bytes=rank_bytes, machine_slow_bytes=machine_slow)


__all__ = ["GreedyTableWisePartitioner", "Partition"]
