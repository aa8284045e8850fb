"""Enumerator: every (mode, cache_load_factor) option of every table, with bytes and cost."""

from __future__ import annotations

from typing import List, Mapping, Optional, Sequence, Tuple

import numpy as np

from recpipe.planner.cost_models import CostModel
from recpipe.planner.storage import _check_load_factor, machine_storage, max_local_rows, shard_storage
from recpipe.planner.types import (
    DEFAULT_LOAD_FACTORS,
    Mode,
    PlacementConstraints,
    PlacementOption,
    PlannerError,
    PlannerErrorType,
    TableSpec,
)


def _constraint_for(table: TableSpec, constraints: Mapping[str, PlacementConstraints]) -> Optional[PlacementConstraints]:
    return constraints.get(table.fqn) or constraints.get(table.name)


class GridPlacementEnumerator:
    """Enumerates ``{HYBRID, CACHING} x load_factors`` per table (``x = 1`` once).

    Bytes come from ``recpipe.planner.storage`` for row-wise sharding over all
    ``world_size`` ranks; costs from the cost model. Pinned constraints narrow a
    table's options.

    Args:
        world_size (int): ranks ``W``.
        local_world_size (int): ranks per machine ``L``.
        cost_model (CostModel): prices options.
        load_factors (Sequence[float]): x grid in (0, 1].
        constraints (Optional[Mapping[str, PlacementConstraints]]): pins keyed by
            table name or FQN.

    Example::

        options = GridPlacementEnumerator(8, 8, AnalyticCostModel()).enumerate(tables)
    """

    def __init__(
        self,
        world_size: int,
        local_world_size: int,
        cost_model: CostModel,
        load_factors: Sequence[float] = DEFAULT_LOAD_FACTORS,
        constraints: Optional[Mapping[str, PlacementConstraints]] = None,
    ) -> None:
        if not load_factors:
            raise ValueError("load_factors is empty: give at least one x in (0, 1], e.g. (0.1, ..., 1.0).")
        for x in load_factors:
            _check_load_factor(x)
        self.world_size = world_size
        self.local_world_size = local_world_size
        self.cost_model = cost_model
        self.load_factors: Tuple[float, ...] = tuple(sorted({float(x) for x in load_factors}))
        self.constraints: Mapping[str, PlacementConstraints] = constraints or {}

    def candidates(self, table: TableSpec) -> List[Tuple[Mode, float]]:
        """The (mode, x) pairs allowed for ``table``.

        Args:
            table (TableSpec): the table.

        Returns:
            List[Tuple[Mode, float]]: candidates; ``x = 1`` appears once, as HYBRID.
        """
        pin = _constraint_for(table, self.constraints)
        xs: Sequence[float] = self.load_factors
        modes: Sequence[Mode] = (Mode.HYBRID, Mode.CACHING)
        if pin is not None:
            if pin.load_factors is not None:
                xs = tuple(sorted({float(x) for x in pin.load_factors}))
            if pin.cache_load_factor is not None:
                xs = (float(pin.cache_load_factor),)
            if pin.mode is not None:
                modes = (Mode.parse(pin.mode),)
        out: List[Tuple[Mode, float]] = []
        for x in xs:
            if x >= 1.0:
                # Both modes collapse to "all in HBM"; report it under the pinned
                # mode if there is one, else HYBRID.
                out.append((modes[0] if len(modes) == 1 else Mode.HYBRID, 1.0))
            else:
                out.extend((m, x) for m in modes)
        return out

    def enumerate(self, tables: Sequence[TableSpec]) -> List[List[PlacementOption]]:
        """Options of every table with per-rank / per-machine bytes and cost.

        Args:
            tables (Sequence[TableSpec]): the tables.

        Returns:
            List[List[PlacementOption]]: options per table, in input order.
        """
        unknown = set(self.constraints) - {t.name for t in tables} - {t.fqn for t in tables}
        if unknown:
            raise PlannerError(
                f"constraints name tables that are not in the model: {sorted(unknown)}.\n"
                f"Possible solutions:\n  1) key constraints by one of {[t.fqn for t in tables][:20]}.",
                PlannerErrorType.INPUT_VALIDATION,
            )
        result: List[List[PlacementOption]] = []
        W, L = self.world_size, self.local_world_size
        for table in tables:
            cands = self.candidates(table)
            costs = self.cost_model.costs(table, cands)
            rows = max_local_rows(table.rows, W)
            opts: List[PlacementOption] = []
            for (mode, x), cost in zip(cands, costs):
                rank = shard_storage(rows, table.dim, table.dtype, table.optimizer, mode, x)
                mach = machine_storage(table.rows, W, L, table.dim, table.dtype, table.optimizer, mode, x)
                opts.append(
                    PlacementOption(
                        mode=mode,
                        cache_load_factor=x,
                        hbm_bytes_per_rank=rank.fast_bytes,
                        ddr_bytes_per_rank=rank.slow_bytes,
                        hbm_bytes_per_machine=mach.fast_bytes,
                        ddr_bytes_per_machine=mach.slow_bytes,
                        cost=float(cost),
                    )
                )
            result.append(opts)
        return result


def options_to_arrays(options: Sequence[Sequence[PlacementOption]]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pack options into the ``(M, K)`` arrays the proposers take.

    Args:
        options (Sequence[Sequence[PlacementOption]]): options per table.

    Returns:
        Tuple[np.ndarray, np.ndarray, np.ndarray]: HBM bytes per rank, DDR bytes
        per machine (int64) and cost (float64, ``inf`` where a table has fewer
        options).
    """
    M = len(options)
    K = max((len(o) for o in options), default=0)
    hbm = np.zeros((M, K), dtype=np.int64)
    ddr = np.zeros((M, K), dtype=np.int64)
    cost = np.full((M, K), np.inf)
    for i, opts in enumerate(options):
        for j, o in enumerate(opts):
            hbm[i, j] = o.hbm_bytes_per_rank
            ddr[i, j] = o.ddr_bytes_per_machine
            cost[i, j] = o.cost
    return hbm, ddr, cost


__all__ = ["GridPlacementEnumerator", "options_to_arrays"]

