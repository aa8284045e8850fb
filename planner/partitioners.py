"""Partitioner: the ranks that hold each table-wise and column-wise table.

The knapsack budgets such a table by its share of every rank (``ceil(bytes / W)``); this stage places it
whole: a table-wise table as one shard on one rank, a column-wise one as its ``k`` equal column shards, on
distinct ranks where it can. Row-wise tables load every rank alike (their largest shard), so each rank
starts at that load (and each machine at their slow-tier load). Tables go largest first, each shard to the
rank with the least modelled cost so far among those whose fast tier (and machine's slow tier) still holds
it (ties: fewer bytes, then the lower rank), which balances the lookups and the output traffic the owners
carry. Tables whose shards no ranks can hold are left out whole and returned for the planner to repair
(it re-plans them) or refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class Partition:
    """Owner rank of each table's shards (``shard_owners[i]``, in column order; empty: no ranks hold it),
    the fast-tier bytes of every rank and the slow-tier bytes of every machine."""

    shard_owners: List[Tuple[int, ...]]
    rank_bytes: np.ndarray
    machine_slow_bytes: np.ndarray

    @property
    def owners(self) -> np.ndarray:
        """The rank of each table's first shard (a table-wise table's owner), ``-1`` where it is unplaced."""
        return np.array([o[0] if o else -1 for o in self.shard_owners], dtype=np.int64)

    @property
    def unplaced(self) -> np.ndarray:
        """Indices (into the partitioned tables) of the tables no ranks could hold."""
        return np.flatnonzero([not o for o in self.shard_owners]).astype(np.int64)


class GreedyTableWisePartitioner:
    """Largest table first, each shard onto the cheapest rank that holds it (see the module docstring)."""

    def partition(
        self,
        shard_bytes: Sequence[int],
        shard_slow_bytes: Sequence[int],
        table_costs: Sequence[float],
        base: Tuple[int, int],
        budgets: Tuple[int, int],
        world_size: int,
        local_world_size: int,
        shards: Optional[Sequence[int]] = None,
    ) -> Partition:
        """Owners of the shards of the table- and column-wise tables.

        Args:
            shard_bytes: fast-tier bytes of one shard of each table (a table-wise table's: all of it).
            shard_slow_bytes: slow-tier bytes of one shard (on its owner's machine).
            table_costs: modelled ms per step of each table (balanced across ranks, split evenly over shards).
            base: fast-tier bytes every rank and slow-tier bytes every machine already hold (the row-wise
                tables' largest shards).
            budgets: fast-tier bytes per rank, slow-tier bytes per machine.
            world_size: ranks; ``local_world_size``: ranks per machine (rank ``r`` is on machine ``r // L``).
            shards: equal shards of each table (None: 1 each, table-wise).

        Returns:
            :class:`Partition`.
        """
        sizes = np.asarray(shard_bytes, dtype=np.int64)
        slow = np.asarray(shard_slow_bytes, dtype=np.int64)
        costs = np.asarray(table_costs, dtype=np.float64)
        count = np.ones(sizes.shape[0], dtype=np.int64) if shards is None else np.asarray(shards, dtype=np.int64)
        (base_fast, base_slow), L = base, local_world_size
        owners: List[Tuple[int, ...]] = [()] * sizes.shape[0]
        rank_bytes = np.full(world_size, int(base_fast), dtype=np.int64)
        rank_cost = np.zeros(world_size)
        machine_slow = np.full(world_size // L, int(base_slow), dtype=np.int64)
        total, total_slow = sizes * count, slow * count
        for i in sorted(range(sizes.shape[0]), key=lambda k: (-int(total[k]), -int(total_slow[k]), k)):
            placed = place_shards(
                rank_bytes, machine_slow, rank_cost, int(sizes[i]), int(slow[i]), int(count[i]), costs[i], budgets, L
            )
            owners[i] = placed or ()
        return Partition(shard_owners=owners, rank_bytes=rank_bytes, machine_slow_bytes=machine_slow)


def place_shards(
    rank_bytes: np.ndarray,
    machine_slow: np.ndarray,
    rank_load: np.ndarray,
    shard: int,
    slow: int,
    count: int,
    cost: float,
    budgets: Tuple[int, int],
    local_world_size: int,
) -> Optional[Tuple[int, ...]]:
    """Places the ``count`` equal shards of one table (``shard`` fast-tier, ``slow`` slow-tier bytes each), each
    on the rank with the least ``rank_load`` whose fast tier (and machine's slow tier) still holds it, one not
    holding another shard of the table where there is one (ties: fewer bytes, then the lower rank); each shard
    adds ``cost / count`` to its rank's load.

    Updates ``rank_bytes``, ``machine_slow`` and ``rank_load`` in place and returns the owners in shard order;
    a table is placed whole or not at all: if a shard fits nowhere, nothing changes and it returns None.
    """
    budget, ddr_budget = budgets
    machine_of = np.arange(rank_bytes.size) // local_world_size
    placed: List[int] = []
    for _ in range(count):
        fits = (rank_bytes + shard <= budget) & (machine_slow[machine_of] + slow <= ddr_budget)
        if not fits.any():
            break
        fresh = fits.copy()
        fresh[placed] = False
        load = np.where(fresh if fresh.any() else fits, rank_load, np.inf)
        tied = np.flatnonzero(load == load.min())
        rank = int(tied[np.argmin(rank_bytes[tied])])
        placed.append(rank)
        rank_bytes[rank] += shard
        rank_load[rank] += cost / count
        machine_slow[machine_of[rank]] += slow
    if len(placed) == count:
        return tuple(placed)
    for rank in placed:
        rank_bytes[rank] -= shard
        rank_load[rank] -= cost / count
        machine_slow[machine_of[rank]] -= slow
    return None


__all__ = ["GreedyTableWisePartitioner", "Partition", "place_shards"]
