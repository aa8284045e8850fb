"""Communication cost of a sharding type: what moving a table's ids and pooled embeddings costs per step.

Per rank and step, for a table whose batch holds ``n`` ids in ``o`` bags (samples x features) of
width ``D`` over ``W`` ranks (``r = (W - 1) / W``, the remote share):

* input all-to-all (both types): ``n x 8 + o x 4`` bytes (int64 ids, int32 lengths) x ``r``;
* TABLE_WISE output: the owner returns the pooled rows of every remote sample, forward and
  backward: ``2 x o x D x 4 x r`` bytes on average over ranks; its owner pools ``W x o`` bags,
  ``o`` per rank on average;
* ROW_WISE adds the bucketization of the ids (``n x bucketize_ns``) and, since every rank pools a
  partial sum for every sample, ``W`` times the output traffic (``2 x o x D x 4 x (W - 1)``, a
  reduce-scatter and its backward) and ``W`` times the bags (``W x o``);
* COLUMN_WISE (``k = column_shards(D)`` shards of ``D / k`` columns, each whole on one rank) sends
  every id to each of its ``k`` owners (``k`` times the input bytes) and pools every bag once per shard
  (``k x o``); its output bytes are TABLE_WISE's, split over the owners.

``ms = bytes / network_bw + bags x bag_ns / 1e6 + ids x bucketize_ns / 1e6`` (the fixed latency of
a collective is paid once per step by all tables of a sharding type, not per table, so it is left
out). Constants come from :class:`CommConstants`: ``GLOO_CPU`` was measured on this project's CI
machine kind by ``scripts/calibrate_comm.py``; :func:`topology_constants` takes a torchrec
``Topology``'s bandwidths (CUDA: NVLink within a host, the network across hosts).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from torchrec.distributed.planner.types import Topology
from torchrec.distributed.types import ShardingType

from recpipe.planner.specs import TableSpec
from recpipe.planner.torchrec_plan import column_shards

#: Bytes per id and per bag length in the input all-to-all (int64 ids, int32 lengths).
ID_BYTES: int = 8
LENGTH_BYTES: int = 4
#: Bytes per value of a pooled embedding on the wire (fp32 outputs and gradients).
POOLED_VALUE_BYTES: int = 4
#: The sharding types the planner prices and the runtime shards (torchrec's spelling).
PLANNED_SHARDING_TYPES: tuple[str, ...] = (
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
)


@dataclass(frozen=True, kw_only=True)
class CommConstants:
    """The machine constants of the communication model."""

    name: str
    """Short name shown in plan reports."""
    network_bw: float
    """All-to-all payload bandwidth per rank, bytes/ms (torchrec ``Topology`` units)."""
    bag_ns: float
    """Fixed cost of pooling one bag (sample x feature) beyond its rows' bytes, ns."""
    bucketize_ns: float
    """Cost of routing one id to its row-wise owner (the bucketize op), ns."""
    source: str
    """Where the numbers come from (script and machine, or the torchrec constant)."""

    def __post_init__(self) -> None:
        for field_name in ("network_bw", "bag_ns", "bucketize_ns"):
            value = getattr(self, field_name)
            positive = field_name == "network_bw"
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(value)
                or value < 0
                or (positive and value == 0)
            ):
                raise ValueError(
                    f"CommConstants({self.name}).{field_name} must be a finite number "
                    f"{'> 0' if positive else '>= 0'}, got {value!r}."
                )


#: gloo over loopback TCP on one CPU machine: 2 ranks x 1 thread on a 2-vCPU AMD EPYC VM
#: (the CI machine kind), measured by ``python scripts/calibrate_comm.py``.
GLOO_CPU: CommConstants = CommConstants(
    name="gloo_cpu",
    network_bw=5.4e5,
    bag_ns=52.0,
    bucketize_ns=16.0,
    source="scripts/calibrate_comm.py: 2 gloo ranks x 1 thread, AMD EPYC 2 vCPU",
)


def topology_constants(topology: Topology) -> CommConstants:
    """Constants of a torchrec ``Topology``: its intra-host bandwidth on one machine, else its inter-host one;
    bag and bucketize costs are those of GPU kernels, small next to the bytes (0.01 ns/bag, 0.01 ns/id)."""
    one_host = topology.world_size == topology.local_world_size
    return CommConstants(
        name="topology",
        network_bw=float(topology.intra_host_bw if one_host else topology.inter_host_bw),
        bag_ns=0.01,
        bucketize_ns=0.01,
        source="torchrec Topology bandwidths (intra_host_bw on one host, else inter_host_bw)",
    )


class CommCostModel:
    """Prices the sharding types of a table (modelled ms per step per rank, see the module docstring).

    Args:
        constants: machine constants.
        world_size: ranks the tables shard over.
    """

    def __init__(self, constants: CommConstants, world_size: int) -> None:
        if not isinstance(constants, CommConstants):
            raise ValueError(
                f"constants must be a CommConstants (e.g. communication.GLOO_CPU), got {type(constants).__name__}."
            )
        if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
        self.constants: CommConstants = constants
        self.world_size: int = int(world_size)

    def split(self, table: TableSpec, sharding_type: str) -> tuple[float, float]:
        """``(network ms, compute ms)`` of ``table`` under ``sharding_type``: bytes moved, and the bag
        pooling and id routing that sharding type adds."""
        network, compute = self._split([table], sharding_type)
        return float(network[0]), float(compute[0])

    def cost_array(self, tables: Sequence[TableSpec], sharding_type: str) -> np.ndarray:
        """Modelled ms per step of every table under ``sharding_type``: :meth:`split` summed, float64."""
        network, compute = self._split(tables, sharding_type)
        return network + compute

    def _split(self, tables: Sequence[TableSpec], sharding_type: str) -> tuple[np.ndarray, np.ndarray]:
        """``(network ms, compute ms)`` of every table under ``sharding_type`` (the module docstring's formulas)."""
        if sharding_type not in PLANNED_SHARDING_TYPES:
            raise ValueError(f"sharding_type must be one of {list(PLANNED_SHARDING_TYPES)}, got {sharding_type!r}.")
        W, c = self.world_size, self.constants
        ids = np.array([t.lookups_per_step for t in tables], dtype=np.float64)
        bags = np.array([t.bags_per_step for t in tables], dtype=np.float64)
        dims = np.array([t.dim for t in tables], dtype=np.float64)
        remote = (W - 1) / W
        pooled = 2.0 * bags * dims * POOLED_VALUE_BYTES
        in_bytes = (ids * ID_BYTES + bags * LENGTH_BYTES) * remote
        if sharding_type == ShardingType.TABLE_WISE.value:
            return (in_bytes + pooled * remote) / c.network_bw, bags * c.bag_ns / 1e6
        if sharding_type == ShardingType.COLUMN_WISE.value:
            k = np.array([column_shards(t.dim) for t in tables], dtype=np.float64)
            return (k * in_bytes + pooled * remote) / c.network_bw, k * bags * c.bag_ns / 1e6
        route = ids * c.bucketize_ns if W > 1 else 0.0 * ids
        return (in_bytes + pooled * (W - 1)) / c.network_bw, (W * bags * c.bag_ns + route) / 1e6

    def sharding_type_costs(self, table: TableSpec, sharding_types: Sequence[str]) -> np.ndarray:
        """Modelled ms per step of ``table`` under each of ``sharding_types`` (network plus compute), float64.
        Not a ``CostModel``: this prices sharding types, a ``CostModel`` prices storage options."""
        return np.array([self.cost_array([table], s)[0] for s in sharding_types], dtype=np.float64)


__all__ = [
    "GLOO_CPU",
    "ID_BYTES",
    "LENGTH_BYTES",
    "PLANNED_SHARDING_TYPES",
    "POOLED_VALUE_BYTES",
    "CommConstants",
    "CommCostModel",
    "topology_constants",
]
