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

from recpipe.pipeline.routing.kjt import bucketize_kjt_by
from recpipe.pipeline.routing.ops import dist_type_code

__all__ = ["RecpipeRwPooledEmbeddingDist", "RecpipeRwSparseFeaturesDist"]


class RecpipeRwSparseFeaturesDist(RwSparseFeaturesDist):
    """torchrec's ``RwSparseFeaturesDist`` routed per feature by ``dist_types``.

    The routing metadata stays on the CPU, so a CUDA batch is routed without a host sync.

    Args: as ``RwSparseFeaturesDist``, plus ``dist_types`` (per feature), ``seed`` and
        ``row_bounds`` (:attr:`FeatureRouting.row_bounds`).
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        num_features: int,
        feature_hash_sizes: List[int],
        dist_types: List[str],
        seed: int = 0,
        device: Optional[torch.device] = None,
        is_sequence: bool = False,
        has_feature_processor: bool = False,
        need_pos: bool = False,
        row_bounds: Optional[List[List[int]]] = None,
    ) -> None:
        super().__init__(
            pg=pg,
            num_features=num_features,
            feature_hash_sizes=feature_hash_sizes,
            device=device,
            is_sequence=is_sequence,
            has_feature_processor=has_feature_processor,
            need_pos=need_pos,
        )
        if len(dist_types) != num_features:
            raise ValueError(f"recpipe: `dist_types` has {len(dist_types)} entries for {num_features} features")
        if row_bounds is not None and len(row_bounds) != num_features:
            raise ValueError(f"recpipe: `row_bounds` has {len(row_bounds)} entries for {num_features} features")
        self._seed = int(seed)
        # CPU metadata, not buffers: Module.to() must not move them to the device.
        self._recpipe_dist_types = torch.tensor([dist_type_code(d) for d in dist_types], dtype=torch.int64)
        self._recpipe_table_sizes = torch.tensor(feature_hash_sizes, dtype=torch.int64)
        self._recpipe_block_sizes = self._feature_block_sizes_tensor.detach().to("cpu", copy=True)
        self._recpipe_row_bounds: Optional[List[torch.Tensor]] = (
            [torch.tensor(b, dtype=torch.int64) for b in row_bounds] if row_bounds is not None else None
        )

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Bucketizes ``sparse_features`` by owner rank, then starts the KJT all-to-all."""
        bucketized, self.unbucketize_permute_tensor = self._bucketize(sparse_features, self._is_sequence)
        return self._dist(bucketized)

    def _bucketize(
        self, features: KeyedJaggedTensor, sequence: bool
    ) -> Tuple[KeyedJaggedTensor, Optional[torch.Tensor]]:
        """``features`` bucketized by owner rank (and the unbucketize permutation if ``sequence``).

        Bad ids are routed past their owner's rows (``route_bad_ids``), as torchrec does, so the
        owner's kernel applies the table's ``bounds_check_mode``.
        """
        weights = features.weights_or_none()
        return bucketize_kjt_by(
            features,
            self._world_size,
            self._recpipe_block_sizes,
            self._recpipe_dist_types,
            self._recpipe_table_sizes,
            seed=self._seed,
            sequence=sequence,
            bucketize_pos=self._has_feature_processor if weights is None else self._need_pos,
            row_bounds=self._recpipe_row_bounds,
            route_bad_ids=True,
        )


class _AllToAllSum(torch.autograd.Function):
    """Reduce-scatter of a 1-D tensor of per-rank segments by one all-to-all and a rank-order sum.

    The backward all-to-alls the gradient, divided by ``W`` under torchrec's gradient division.
    """

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


class RecpipeRwPooledEmbeddingDist(RwPooledEmbeddingDist):
    """Row-wise pooled output dist: on gloo an all-to-all of partial sums, else torchrec's.

    gloo's ``reduce_scatter`` is slow, so each rank gets its samples' ``W`` partial sums by
    ``PooledEmbeddingsAllToAll`` and sums them in rank order (bit-identical for ``W = 2``; the last
    bit may differ beyond). VBE batches use :class:`_AllToAllSum`, since gloo's all-gather (the
    variable reduce-scatter's backward) needs equal sizes. Codecs and other backends keep torchrec's.

    Args: as ``RwPooledEmbeddingDist``.
    """

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
        splits = sharding_ctx.batch_size_per_rank if sharding_ctx is not None else None
        return self._a2a(local_embs, batch_size_per_rank=splits or None)
