"""Partitioner: the rank that holds each table-wise table.

The knapsack budgets a table-wise table by its share of every rank (``ceil(bytes / W)``); this stage
places the whole table on one rank. Row-wise tables load every rank alike (their largest shard), so
each rank starts at that load. Tables go largest first to the rank with the least modelled cost so far
among those whose fast tier still holds them (ties: fewer bytes, then the lower rank), which balances the
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
    """Owner rank per table-wise table (``-1``: no rank holds it), and the fast-tier bytes of every rank."""

    owners: np.ndarray
    rank_bytes: np.ndarray

    @property
    def unplaced(self) -> np.ndarray:
        """Indices (into the partitioned tables) of the tables no rank could hold."""
        return np.flatnonzero(self.owners < 0)


class GreedyTableWisePartitioner:
    """Largest table first onto the cheapest rank that holds it (see the module docstring)."""

    def partition(
        self, table_bytes: Sequence[int], table_costs: Sequence[float], base_bytes: int, budget: int, world_size: int
    ) -> Partition:
        """Owners of the table-wise tables.

        Args:
            table_bytes: fast-tier bytes of each table-wise table (all on its owner).
            table_costs: modelled ms per step of each (balanced across ranks).
            base_bytes: fast-tier bytes every rank already holds (the row-wise tables' largest shards).
            budget: fast-tier bytes per rank.
            world_size: ranks.

        Returns:
            :class:`Partition`.
        """
        sizes = np.asarray(table_bytes, dtype=np.int64)
        costs = np.asarray(table_costs, dtype=np.float64)
        owners = np.full(sizes.shape[0], -1, dtype=np.int64)
        rank_bytes = np.full(world_size, int(base_bytes), dtype=np.int64)
        # a heap of (cost, bytes, rank) over ranks; a rank too full for one table may still take a smaller one
        heap: List[Tuple[float, int, int]] = [(0.0, int(base_bytes), r) for r in range(world_size)]
        for i in sorted(range(sizes.shape[0]), key=lambda k: (-int(sizes[k]), k)):
            size = int(sizes[i])
            skipped: List[Tuple[float, int, int]] = []
            while heap and heap[0][1] + size > budget:
                skipped.append(heapq.heappop(heap))
            if heap:
                cost, used, rank = heapq.heappop(heap)
                owners[i] = rank
                rank_bytes[rank] = used + size
                heapq.heappush(heap, (cost + float(costs[i]), used + size, rank))
            for entry in skipped:
                heapq.heappush(heap, entry)
        return Partition(owners=owners, rank_bytes=rank_bytes)


__all__ = ["GreedyTableWisePartitioner", "Partition"]
