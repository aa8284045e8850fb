"""Independent references for the planner's sharding-type tests (no tests here): a planner with fixed
communication constants, and brute forces over every owner of every whole shard (a table-wise table's one
shard, a column-wise table's column shards) and over every option of every table."""

from __future__ import annotations

import itertools
import math
from typing import List, Sequence, Tuple

import numpy as np

from recpipe.planner import PlacementPlanner, TableSpec, make_topology
from recpipe.planner.communication import CommConstants
from recpipe.planner.torchrec_plan import column_shards

#: Round communication constants, so the tests' hand-written formulas stay readable.
CONSTANTS = CommConstants(name="test", network_bw=1000.0, bag_ns=10.0, bucketize_ns=2.0, source="tests")


def planner(world: int, hbm: int, ddr: int = 2**40, backend: str = "native", **kwargs) -> PlacementPlanner:
    """A one-machine planner of ``world`` ranks with ``hbm`` fast-tier bytes each, no reservation, ``CONSTANTS``."""
    topo = make_topology(world_size=world, local_world_size=world, hbm_cap=hbm, ddr_cap=ddr // world)
    return PlacementPlanner(topo, hbm_reservation=0.0, backend=backend, communication=CONSTANTS, **kwargs)


def brute_force_fits(shards: Sequence[Tuple[int, int]], base: int, budget: int, world: int) -> bool:
    """Whether ``count`` shards of ``bytes`` for every ``(bytes, count)`` fit on ``world`` ranks holding ``base``
    bytes each, under any owners."""
    items = [b for b, k in shards for _ in range(k)]
    return any(
        all(base + sum(s for s, o in zip(items, owners) if o == r) <= budget for r in range(world))
        for owners in itertools.product(range(world), repeat=len(items))
    )


def brute_force_cost(p: PlacementPlanner, tables: List[TableSpec]) -> float:
    """Cheapest modelled cost over every option of every table and every owner of its whole shards."""
    o = p.enumerator.enumerate_arrays(tables)
    H, W = p.hbm_budget, p.topology.world_size
    rows = np.arange(len(tables))
    best = math.inf
    for choice in itertools.product(*[np.flatnonzero(o.modes[i] >= 0) for i in rows]):
        ch = np.array(choice)
        if o.ddr_bytes_per_machine[rows, ch].sum() > p.ddr_budget:
            continue
        owned = [i for i in rows if o.sharding[i, ch[i]] >= 1]
        base = sum(int(o.hbm_bytes_per_rank[i, ch[i]]) for i in rows if i not in owned)
        shards = [
            (int(o.owner_bytes[i, ch[i]]), column_shards(tables[i].dim) if o.sharding[i, ch[i]] == 2 else 1)
            for i in owned
        ]
        if brute_force_fits(shards, base, H, W):
            best = min(best, float(o.cost[rows, ch].sum()))
    return best
