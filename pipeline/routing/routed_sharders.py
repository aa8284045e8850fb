"""Sharders offering routed ROW_WISE on every device, and the kernel checks they run.

A row-wise table routes by its placement fused params, else the sharder's ``table_dist_types=``,
else ``continuous`` (bit-identical to torchrec). May import ``recpipe.pipeline.placement`` and
routing modules only.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Mapping, Optional, Union, cast

import torch
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import BaseEmbeddingSharder, EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType

from recpipe.pipeline.placement import DistType
from recpipe.pipeline.routing.features import RoutingOverrides
from recpipe.pipeline.routing.routed_collections import (
    RoutedShardedEmbeddingBagCollection,
    RoutedShardedEmbeddingCollection,
)

__all__ = [
    "RoutedEmbeddingBagCollectionSharder",
    "RoutedEmbeddingCollectionSharder",
    "RoutedSharderMixin",
    "routed_sharders",
]


class RoutedSharderMixin(BaseEmbeddingSharder):
    """ROW_WISE on every compute device, and the sharder-level routing.

    Subclasses swap ``_SHARDED_MODULE``, the class ``shard()`` builds, and name in ``_SHARDED_MODULE_ATTRS``
    the arguments of it their torchrec base adds (argument -> sharder attribute). Mixed in before torchrec's
    EBC / EC sharder, whose base ``BaseEmbeddingSharder`` it names so its calls into it are typed (the
    sharders' MRO is unchanged: that base follows them).

    Args:
        table_dist_types: table name -> dist type for row-wise tables without their own.
        seed: hash_roundrobin seed for those tables.
    """

    _SHARDED_MODULE: Any  # a class; the tiered sharders set their own per instance (backend)
    _SHARDED_MODULE_ATTRS: ClassVar[Dict[str, str]]

    def __init__(
        self,
        *args: Any,
        table_dist_types: Optional[Mapping[str, Union[DistType, str]]] = None,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        # RoutingOverrides checks the mapping and parses its str values into DistType
        given = cast(Mapping[str, DistType], table_dist_types if table_dist_types is not None else {})
        routing = RoutingOverrides(table_dist_types=given, seed=seed)
        self._routing = routing if routing.table_dist_types else None  # None: the sharder routes no table

    def shard(
        self,
        module: nn.Module,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> nn.Module:
        """``module`` sharded by ``params`` as ``_SHARDED_MODULE`` with this sharder's routing."""
        self._check_kernels(params, device)
        return self._SHARDED_MODULE.with_routing(self._routing)(
            module,
            params,
            env,
            self.fused_params,
            device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            **{arg: getattr(self, attr) for arg, attr in self._SHARDED_MODULE_ATTRS.items()},
        )

    def sharding_types(self, compute_device_type: str) -> List[str]:
        types: List[str] = super().sharding_types(compute_device_type)
        if ShardingType.ROW_WISE.value not in types:
            types = types + [ShardingType.ROW_WISE.value]
        return types

    def _check_kernels(self, params: Dict[str, ParameterSharding], device: Optional[torch.device]) -> None:
        """Refuses what this sharder's kernels cannot run exactly, naming the table. Tiered tables this sharder does not
        run (torchrec would fail later naming no table), and on CPU two fbgemm-gpu-cpu bugs: a FUSED ROW_WISE shard of 0
        rows (wrong updates to the next table) and a DENSE EmbeddingCollection table (pools despite
        ``PoolingMode.NONE``)."""
        device_type = device.type if device is not None else "cpu"
        if device_type == "cpu":
            for name, ps in params.items():
                _check_no_empty_fused_shard(name, ps)
                if isinstance(self, EmbeddingCollectionSharder):
                    _check_no_dense_sequence_table(name, ps)
        kernel = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
        if kernel in self.compute_kernels(ShardingType.ROW_WISE.value, device_type):
            return
        for name, ps in params.items():
            if ps.compute_kernel == kernel:
                raise ValueError(
                    f"table {name!r} has compute_kernel {kernel} (a recpipe tiered table, as "
                    f"recpipe.planner's plans make them), which {type(self).__name__} does not run: shard with "
                    "recpipe.pipeline.tiered.tiered_sharders.TieredEmbeddingBagCollectionSharder() / "
                    "TieredEmbeddingCollectionSharder(), which take the same arguments and shard every other "
                    "table as this sharder does."
                )


def _check_no_empty_fused_shard(name: str, ps: ParameterSharding) -> None:
    """Raises ``ValueError`` for a FUSED ROW_WISE table with a 0-row shard (CPU)."""
    if ps.sharding_type != ShardingType.ROW_WISE.value or ps.compute_kernel != EmbeddingComputeKernel.FUSED.value:
        return
    shards = getattr(ps.sharding_spec, "shards", None) or []
    sizes = [int(m.shard_sizes[0]) for m in sorted(shards, key=lambda m: m.shard_offsets[0])]
    if 0 in sizes:
        empty = [
            m.placement.rank() if m.placement is not None else i
            for i, m in enumerate(shards)
            if int(m.shard_sizes[0]) == 0
        ]
        raise ValueError(
            f"table {name!r} is ROW_WISE with row-wise shards of {sizes} rows: rank(s) {empty} hold 0 rows, and "
            "fbgemm-gpu-cpu's fused TBE backward on CPU then updates the next table of another dim in the same "
            "TBE wrongly (an fbgemm bug, reproduced without recpipe). Possible solutions:\n"
            "  1) shard the table over at most as many ranks as it has rows, with at least one row each "
            "(a table of N rows: N >= world size), or\n"
            "  2) shard it TABLE_WISE (or DATA_PARALLEL), or\n"
            "  3) make it a recpipe tiered table (recpipe.planner + the Tiered sharders), whose CPU kernel is "
            "recpipe's own."
        )


def _check_no_dense_sequence_table(name: str, ps: ParameterSharding) -> None:
    """Raises ``ValueError`` for a DENSE-kernel EmbeddingCollection table (CPU)."""
    if ps.compute_kernel == EmbeddingComputeKernel.DENSE.value:
        raise ValueError(
            f"EmbeddingCollection table {name!r} is {ps.sharding_type} with compute_kernel {ps.compute_kernel} on "
            "CPU: fbgemm-gpu-cpu's dense TBE ignores PoolingMode.NONE on CPU and returns one pooled row per bag "
            "instead of one row per id, so the sequence output dist fails or corrupts the heap (an fbgemm bug, "
            "reproduced without recpipe; torchrec's own sharder fails the same way). Possible solutions:\n"
            "  1) give the table compute_kernel fused (EmbeddingComputeKernel.FUSED) with any sharding but "
            "DATA_PARALLEL, whose kernel is always dense, or\n"
            "  2) make it a recpipe tiered table (recpipe.planner + TieredEmbeddingCollectionSharder), whose CPU "
            "kernel is recpipe's own."
        )


class RoutedEmbeddingBagCollectionSharder(RoutedSharderMixin, EmbeddingBagCollectionSharder):
    """EmbeddingBagCollectionSharder offering ROW_WISE on CPU, routed by recpipe (args: as
    :class:`RoutedSharderMixin` and torchrec's ``EmbeddingBagCollectionSharder``)."""

    _SHARDED_MODULE: Any = RoutedShardedEmbeddingBagCollection
    _SHARDED_MODULE_ATTRS = {"sharded_module_order_overwrite": "_sharded_module_order_overwrite"}


class RoutedEmbeddingCollectionSharder(RoutedSharderMixin, EmbeddingCollectionSharder):
    """EmbeddingCollectionSharder offering ROW_WISE on CPU, routed by recpipe (args as the EBC sharder)."""

    _SHARDED_MODULE: Any = RoutedShardedEmbeddingCollection
    _SHARDED_MODULE_ATTRS = {"use_index_dedup": "_use_index_dedup"}


def routed_sharders(
    fused_params: Optional[Dict[str, Any]] = None,
    table_dist_types: Optional[Mapping[str, Union[DistType, str]]] = None,
    seed: int = 0,
) -> List[BaseEmbeddingSharder]:
    """``[RoutedEmbeddingBagCollectionSharder, RoutedEmbeddingCollectionSharder]`` sharing their arguments."""
    kwargs: Dict[str, Any] = dict(fused_params=fused_params, table_dist_types=table_dist_types, seed=seed)
    return [RoutedEmbeddingBagCollectionSharder(**kwargs), RoutedEmbeddingCollectionSharder(**kwargs)]
