"""The enumerators' options packed as ``(tables, options)`` arrays, and the int8 codes of their modes and
sharding types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from recpipe.pipeline.placement import Mode
from recpipe.planner.constraints import COLUMN_WISE, ROW_WISE, TABLE_WISE
from recpipe.planner.specs import PlacementOption

# Sharding type <-> int8 code in ``OptionArrays.sharding``.
SHARDING_OF_CODE: Tuple[str, str, str] = (ROW_WISE, TABLE_WISE, COLUMN_WISE)
SHARDING_CODE: Dict[str, int] = {s: code for code, s in enumerate(SHARDING_OF_CODE)}
# Mode <-> int8 code in ``OptionArrays.modes`` (-1 = no option).
MODE_CODE: Dict[Mode, int] = {Mode.HYBRID: 0, Mode.CACHING: 1}
MODE_OF_CODE: Tuple[Mode, Mode] = (Mode.HYBRID, Mode.CACHING)


@dataclass
class OptionArrays:
    """Every table's options packed as ``(tables, options)`` arrays.

    ``modes`` are int8 codes (0 HYBRID, 1 CACHING, -1 no option), ``sharding`` int8 codes (0 ROW_WISE,
    1 TABLE_WISE, 2 COLUMN_WISE), ``fused`` marks torchrec's FUSED table (all in the fast tier); bytes are int64
    of the most loaded rank / machine (a table- or column-wise option's HBM per rank and DDR per machine are its
    shares ``ceil(bytes / W)`` and ``ceil(slow bytes / machines)``; ``owner_bytes`` / ``owner_slow_bytes`` what
    the owner of one of its shards holds); ``shards`` the int16 count of such whole shards (1 table-wise,
    ``column_shards(dim)`` column-wise, 0 row-wise); ``cost`` is float64 modelled ms (``lookup_cost +
    comm_cost``), ``inf`` where a table has fewer options.
    """

    modes: np.ndarray
    load_factors: np.ndarray
    hbm_bytes_per_rank: np.ndarray
    ddr_bytes_per_rank: np.ndarray
    hbm_bytes_per_machine: np.ndarray
    ddr_bytes_per_machine: np.ndarray
    cost: np.ndarray
    sharding: np.ndarray
    fused: np.ndarray
    owner_bytes: np.ndarray
    owner_slow_bytes: np.ndarray
    lookup_cost: np.ndarray
    comm_cost: np.ndarray
    shards: np.ndarray

    @classmethod
    def empty(cls, num_tables: int, num_options: int) -> "OptionArrays":
        """All-padding arrays of shape ``(num_tables, num_options)``: modes -1, bytes 0, cost inf."""
        shape = (num_tables, num_options)
        z = lambda: np.zeros(shape, dtype=np.int64)  # noqa: E731
        return cls(
            np.full(shape, -1, dtype=np.int8),
            np.zeros(shape),
            z(),
            z(),
            z(),
            z(),
            np.full(shape, np.inf),
            np.zeros(shape, dtype=np.int8),
            np.zeros(shape, dtype=bool),
            z(),
            z(),
            np.zeros(shape),
            np.zeros(shape),
            np.zeros(shape, dtype=np.int16),
        )

    @property
    def byte_arrays(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """HBM / DDR bytes per rank, then HBM / DDR bytes per machine (``PlacementOption`` field order)."""
        return self.hbm_bytes_per_rank, self.ddr_bytes_per_rank, self.hbm_bytes_per_machine, self.ddr_bytes_per_machine

    def option(self, table: int, index: int) -> PlacementOption:
        """The ``PlacementOption`` at ``(table, index)`` (IndexError for padding)."""
        code = int(self.modes[table, index])
        if code < 0:
            raise IndexError(f"table {table} has no option {index}.")
        hbm_per_rank, ddr_per_rank, hbm_per_machine, ddr_per_machine = (int(a[table, index]) for a in self.byte_arrays)
        return PlacementOption(
            MODE_OF_CODE[code],
            float(self.load_factors[table, index]),
            hbm_per_rank,
            ddr_per_rank,
            hbm_per_machine,
            ddr_per_machine,
            cost=float(self.cost[table, index]),
            sharding_type=SHARDING_OF_CODE[int(self.sharding[table, index])],
            fused=bool(self.fused[table, index]),
            owner_bytes=int(self.owner_bytes[table, index]),
            owner_slow_bytes=int(self.owner_slow_bytes[table, index]),
            lookup_cost=float(self.lookup_cost[table, index]),
            comm_cost=float(self.comm_cost[table, index]),
        )

    def to_options(self) -> List[List[PlacementOption]]:
        """Options per table as ``PlacementOption`` lists, in input order (padding dropped)."""
        return [
            [self.option(i, int(j)) for j in np.flatnonzero(self.modes[i] >= 0)] for i in range(self.modes.shape[0])
        ]


def options_to_arrays(options: Sequence[Sequence[PlacementOption]]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pack options into ``(M, K)`` arrays: HBM bytes per rank, DDR bytes per machine, cost (``inf`` pads)."""
    M = len(options)
    K = max((len(o) for o in options), default=0)
    hbm, ddr, cost = np.zeros((M, K), dtype=np.int64), np.zeros((M, K), dtype=np.int64), np.full((M, K), np.inf)
    for i, opts in enumerate(options):
        for j, o in enumerate(opts):
            hbm[i, j], ddr[i, j], cost[i, j] = o.hbm_bytes_per_rank, o.ddr_bytes_per_machine, o.cost
    return hbm, ddr, cost


__all__ = ["MODE_CODE", "MODE_OF_CODE", "SHARDING_CODE", "SHARDING_OF_CODE", "OptionArrays", "options_to_arrays"]
