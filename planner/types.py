"""Extension points of the placement planner, one stage each, as in torchrec's planner (whose own
``Enumerator`` / ``Partitioner`` / ``Proposer`` take torchrec sharding options, so these are named apart):

* a :class:`PlacementEnumerator` lists every table's placement options with their bytes and cost;
* a :class:`CostModel` prices a table's storage options (the default enumerator's lookup cost);
* a :class:`PlacementProposer` picks one option per table under the HBM and DDR budgets;
* a :class:`PlacementPartitioner` picks the owner ranks of the table- and column-wise tables' shards.

``PlacementPlanner(enumerator=, cost_model=, proposer=, partitioner=)`` takes an instance of each; the
defaults are ``GridPlacementEnumerator``, ``AnalyticCostModel``, ``KnapsackProposer`` and
``GreedyTableWisePartitioner``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, Sequence, Tuple, runtime_checkable

import numpy as np

from recpipe.pipeline.placement import Mode
from recpipe.planner.specs import TableSpec

if TYPE_CHECKING:  # the stages' modules import this one
    from recpipe.planner.option_arrays import OptionArrays
    from recpipe.planner.partitioners import Partition


@runtime_checkable
class CostModel(Protocol):
    """Prices the storage options of one table in modelled milliseconds per step (the lookup cost; the
    default enumerator adds each sharding type's communication cost)."""

    name: str
    """Short name the plan records (``PlacementPlan.cost_model``)."""

    def costs(self, table: TableSpec, options: Sequence[Tuple[Mode, float]]) -> np.ndarray:
        """Modelled step cost of each storage option of ``table``.

        Args:
            table: the table to price.
            options: ``(mode, x)`` pairs: HYBRID or CACHING with ``x`` of the rows in the fast tier.

        Returns:
            ``(len(options),)`` float64 ms, each finite and >= 0.

        Raises:
            ValueError: a table or option the model cannot price.
        """
        ...


@runtime_checkable
class PlacementEnumerator(Protocol):
    """Lists every table's placement options (sharding type, storage, bytes, cost)."""

    def enumerate_arrays(self, tables: Sequence[TableSpec]) -> "OptionArrays":
        """The options of every table, packed.

        Args:
            tables: the tables to place, in plan order.

        Returns:
            ``OptionArrays`` of shape ``(len(tables), K)``: row ``i`` holds table ``i``'s options, ``cost =
            inf`` (and ``modes = -1``) padding rows with fewer than ``K``; every table needs at least one.

        Raises:
            PlacementPlannerError: a table has no option (``INPUT_VALIDATION``, naming the table and the fix).
        """
        ...


@runtime_checkable
class PlacementProposer(Protocol):
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
            hbm_budget: HBM bytes per device.
            ddr_budget: DDR bytes per machine.

        Returns:
            ``(M,)`` chosen option per table (each of finite cost, the sums within both budgets), or None if
            no combination fits.
        """
        ...


@runtime_checkable
class PlacementPartitioner(Protocol):
    """Picks the owner ranks of the whole shards of the table- and column-wise tables the proposer chose."""

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
    ) -> "Partition":
        """Owners of every shard of each table, within the budgets.

        Args:
            shard_bytes: fast-tier bytes of one shard of each table (a table-wise table's: all of it).
            shard_slow_bytes: slow-tier bytes of one shard (on its owner's machine).
            table_costs: modelled ms per step of each table.
            base: fast-tier bytes every rank and slow-tier bytes every machine already hold (the row-wise
                tables' largest shards).
            budgets: fast-tier bytes per rank, slow-tier bytes per machine.
            world_size: ranks; rank ``r`` is on machine ``r // local_world_size``.
            local_world_size: ranks per machine.
            shards: equal shards of each table (None: 1 each, table-wise).

        Returns:
            ``Partition`` whose ``shard_owners[i]`` names one rank per shard of table ``i`` (in column order),
            or is empty for a table it leaves unplaced (the planner then re-plans that table), with the bytes
            of every rank and machine (the planner takes the larger of these and what the owners imply). The
            planner refuses owners that overfill a rank's fast tier or a machine's slow tier.
        """
        ...


__all__ = ["CostModel", "PlacementEnumerator", "PlacementPartitioner", "PlacementProposer"]
