"""Row-wise embedding shardings (pooled and sequence) with recpipe's routed input dist.

May import ``recpipe.pipeline.placement`` and routing modules only.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, Optional

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding

from recpipe.pipeline.placement import DistType
from recpipe.pipeline.routing.dists import RoutedRwPooledEmbeddingDist, RoutedRwSparseFeaturesDist
from recpipe.pipeline.routing.features import RoutingOverrides, feature_routing, table_routing
from recpipe.pipeline.routing.row_order import RowOrder

__all__ = ["RoutedRwPooledEmbeddingSharding", "RoutedRwSequenceEmbeddingSharding", "RoutedInputDistMixin"]


class RoutedInputDistMixin:
    """Gives a torchrec ``BaseRwEmbeddingSharding`` the routed input dist (``routing``: the sharder's)."""

    _IS_SEQUENCE: ClassVar[bool] = False

    def __init__(self, *args: Any, routing: Optional[RoutingOverrides] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._routing = routing

    def row_orders(self) -> Dict[str, RowOrder]:
        """:class:`RowOrder` of each routed table torchrec's kernels hold (tiered tables export global ids)."""
        base: Any = self
        out: Dict[str, RowOrder] = {}
        for group in base._grouped_embedding_configs:
            for table in group.embedding_tables:
                if table.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
                    continue
                dt, seed = table_routing(table.fused_params, table.name, self._routing)
                if dt is not DistType.CONTINUOUS:
                    out[table.name] = RowOrder(
                        dt.value,
                        int(base._world_size),
                        seed if dt is DistType.HASH_ROUNDROBIN else 0,
                        int(table.num_embeddings),
                    )
        return out

    def create_input_dist(self, device: Optional[torch.device] = None) -> RoutedRwSparseFeaturesDist:
        base: Any = self
        return RoutedRwSparseFeaturesDist(
            pg=base._pg,
            num_features=base._get_num_features(),
            routing=feature_routing(base._grouped_embedding_configs, base._world_size, self._routing),
            device=device if device is not None else base._device,
            is_sequence=self._IS_SEQUENCE,
            has_feature_processor=base._has_feature_processor,
            need_pos=False if self._IS_SEQUENCE else base._need_pos,
        )


class RoutedRwPooledEmbeddingSharding(RoutedInputDistMixin, RwPooledEmbeddingSharding):
    """torchrec's pooled row-wise sharding with routed input (``routing``: :class:`RoutingOverrides`) and
    :class:`RoutedRwPooledEmbeddingDist` output."""

    def create_output_dist(self, device: Optional[torch.device] = None) -> RoutedRwPooledEmbeddingDist:
        """:class:`RoutedRwPooledEmbeddingDist` of this sharding's process group (``device`` unused)."""
        assert self._pg is not None, "row-wise sharding needs a process group"
        return RoutedRwPooledEmbeddingDist(
            self._pg, embedding_dims=self.embedding_dims(), qcomm_codecs_registry=self.qcomm_codecs_registry
        )


class RoutedRwSequenceEmbeddingSharding(RoutedInputDistMixin, RwSequenceEmbeddingSharding):
    """torchrec's sequence row-wise sharding with routed input (``routing``: :class:`RoutingOverrides`)."""

    _IS_SEQUENCE: ClassVar[bool] = True
