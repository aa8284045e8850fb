"""Row-wise input dist (routed bucketization) and pooled output dist of routed tables.

May import ``recpipe.pipeline.placement`` and routing modules only.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed import comm_ops
from torchrec.distributed.dist_data import PooledEmbeddingsAllToAll
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist, RwSparseFeaturesDist
from torchrec.distributed.types import Awaitable, NoWait, QuantizedCommCodecs
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.pipeline.routing.features import FeatureRouting
from recpipe.pipeline.routing.kjt import bucketize_kjt_by
from recpipe.pipeline.routing.ops import dist_type_code

__all__ = ["RoutedRwPooledEmbeddingDist", "RoutedRwSparseFeaturesDist"]


class RoutedRwSparseFeaturesDist(RwSparseFeaturesDist):
    """torchrec's ``RwSparseFeaturesDist`` routed per feature by ``routing`` (:func:`feature_routing`). The routing
    metadata stays on the CPU, so a CUDA batch is routed without a host sync. Other arguments: as
    ``RwSparseFeaturesDist``."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        num_features: int,
        routing: FeatureRouting,
        device: Optional[torch.device] = None,
        is_sequence: bool = False,
        has_feature_processor: bool = False,
        need_pos: bool = False,
    ) -> None:
        super().__init__(
            pg=pg,
            num_features=num_features,
            feature_hash_sizes=routing.table_sizes,
            device=device,
            is_sequence=is_sequence,
            has_feature_processor=has_feature_processor,
            need_pos=need_pos,
        )
        for name, value in (("dist_types", routing.dist_types), ("row_bounds", routing.row_bounds)):
            if value is not None and len(value) != num_features:
                raise ValueError(f"recpipe: `{name}` has {len(value)} entries for {num_features} features")
        self._seed = int(routing.seed)
        # CPU metadata, not buffers: Module.to() must not move them to the device.
        self._recpipe_dist_types = torch.tensor([dist_type_code(d) for d in routing.dist_types], dtype=torch.int64)
        self._recpipe_table_sizes = torch.tensor(routing.table_sizes, dtype=torch.int64)
        self._recpipe_block_sizes = self._feature_block_sizes_tensor.detach().to("cpu", copy=True)
        self._recpipe_keep_keys: Optional[torch.Tensor] = (
            None if routing.keep_keys is None else torch.tensor(routing.keep_keys, dtype=torch.bool)
        )
        self._recpipe_row_bounds: Optional[List[torch.Tensor]] = (
            None if routing.row_bounds is None else [torch.tensor(b, dtype=torch.int64) for b in routing.row_bounds]
        )

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Bucketizes ``sparse_features`` by owner rank, then starts the KJT all-to-all. Bad ids are routed
        past their owner's rows, as torchrec does, so the owner's kernel applies the table's ``bounds_check_mode``."""
        weighted = sparse_features.weights_or_none() is not None
        bucketized, self.unbucketize_permute_tensor = bucketize_kjt_by(
            sparse_features,
            self._world_size,
            self._recpipe_block_sizes,
            self._recpipe_dist_types,
            self._recpipe_table_sizes,
            seed=self._seed,
            sequence=self._is_sequence,
            bucketize_pos=self._need_pos if weighted else self._has_feature_processor,
            row_bounds=self._recpipe_row_bounds,
            route_bad_ids=True,
            keep_orig_idx_per_feature=self._recpipe_keep_keys,
        )
        return self._dist(bucketized)


class _AllToAllSum(torch.autograd.Function):
    """Reduce-scatter of a 1-D tensor of per-rank segments by one all-to-all and a rank-order sum; the
    backward all-to-alls the gradient, divided by ``W`` under torchrec's gradient division."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, splits: List[int], pg: dist.ProcessGroup) -> torch.Tensor:
        world, me = pg.size(), pg.rank()
        out = flat.new_empty((world * splits[me],))
        dist.all_to_all_single(out, flat.contiguous(), [splits[me]] * world, list(splits), group=pg)
        ctx.splits, ctx.pg = list(splits), pg
        return out.view(world, splits[me]).sum(dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None]:
        pg, splits = ctx.pg, ctx.splits
        world = pg.size()
        if comm_ops.get_gradient_division():
            grad = grad / world
        out = grad.new_empty((sum(splits),))
        dist.all_to_all_single(out, grad.contiguous().repeat(world), splits, [grad.numel()] * world, group=pg)
        return out, None, None


class RoutedRwPooledEmbeddingDist(RwPooledEmbeddingDist):
    """Row-wise pooled output dist: on gloo an all-to-all of partial sums, else torchrec's. gloo's ``reduce_scatter`` is
    slow, so each rank gets its samples' ``W`` partial sums by ``PooledEmbeddingsAllToAll`` and sums them in rank order
    (bit-identical for ``W = 2``; the last bit may differ beyond). VBE batches use :class:`_AllToAllSum`, since gloo's
    all-gather (the variable reduce-scatter's backward) needs equal sizes. Codecs and other backends keep torchrec's."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        embedding_dims: List[int],
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> None:
        super().__init__(pg, embedding_dims=embedding_dims, qcomm_codecs_registry=qcomm_codecs_registry)
        world = pg.size()
        dim = sum(embedding_dims)
        self._a2a: Optional[PooledEmbeddingsAllToAll] = None
        if dist.get_backend(pg) == "gloo" and self._codecs is None and world > 1:
            self._a2a = PooledEmbeddingsAllToAll(
                pg, [dim] * world, callbacks=[lambda t: t.view(t.size(0), world, dim).sum(dim=1)]
            )

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: Optional[EmbeddingShardingContext] = None
    ) -> Awaitable[torch.Tensor]:
        """Starts the output dist of ``[B_global, D]`` partial sums; awaits ``[B_local, D]`` sums."""
        if self._a2a is None:
            return super().forward(local_embs, sharding_ctx)
        if sharding_ctx is not None and sharding_ctx.variable_batch_per_feature:
            splits = [
                sum(b * d for b, d in zip(per_feature, self._embedding_dims))
                for per_feature in sharding_ctx.batch_size_per_rank_per_feature
            ]
            return NoWait(_AllToAllSum.apply(local_embs.view(-1), splits, self._pg))
        rank_splits = sharding_ctx.batch_size_per_rank if sharding_ctx is not None else None
        return self._a2a(local_embs, batch_size_per_rank=rank_splits or None)
