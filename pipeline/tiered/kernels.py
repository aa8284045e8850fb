"""The tiered kernel modules (torchrec CUSTOMIZED_KERNEL groups) and the grouped lookups that build them.

The sequence kernel reuses the pooled shard with one id per bag (sum pooling): each output row is
the stored row, and the backward sums each id's gradients per unique row, as fbgemm's sequence TBE.
May import ``recpipe.pipeline.placement``, ``recpipe.pipeline.routing`` and other ``recpipe.pipeline.tiered`` modules.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Iterator, List, Optional, Tuple, cast

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig, ShardedEmbeddingTable
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import PoolingType, pooling_type_to_pooling_mode
from torchrec.optim.fused import FusedOptimizer as TorchrecFusedOptimizer
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.pipeline.placement import PlacementParams
from recpipe.pipeline.tiered.dynamic.dynamic_shard import DynamicEmbeddingShard
from recpipe.pipeline.tiered.fused_optimizer import TieredFusedOptimizer
from recpipe.pipeline.tiered.fused_params import table_backend, tiered_output_dtype, tiered_placement, tiered_vbe_error
from recpipe.pipeline.tiered.optim import TieredOptimizerConfig
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, bounds_check_mode_of
from recpipe.pipeline.tiered.shard_routing import WholeTableRouting


class TieredKernelBase(BaseEmbedding, FusedOptimizerModule):
    """A CUSTOMIZED_KERNEL group: one :class:`TieredEmbeddingShard` per table (pooled and sequence base).

    ``pg`` is the sharding process group (rank, world size), ``device`` the fast tier's; ``whole_tables``:
    each table lives whole on this rank (TABLE_WISE: local id = global id), else row-wise over ``pg``.
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        whole_tables: bool = False,
    ) -> None:
        super().__init__()
        self._config = config
        self._whole_tables = whole_tables
        rank = dist.get_rank(pg) if pg is not None else 0
        world = dist.get_world_size(pg) if pg is not None else 1
        self.tables: nn.ModuleDict = nn.ModuleDict()
        self._feature_table: List[str] = []
        self._output_dtypes: Dict[str, torch.dtype] = {}
        for table in config.embedding_tables:
            params, optimizer = tiered_placement(table)
            self._output_dtypes[table.name] = tiered_output_dtype(table.fused_params, table.name)
            backend = table_backend(table, device)
            if params.dynamic is not None:
                self.tables[table.name] = self._dynamic_shard(table, params, optimizer, backend, device, rank, world)
                self._feature_table += [table.name] * table.num_features()
                continue
            shard = TieredEmbeddingShard(
                num_embeddings=table.num_embeddings,
                embedding_dim=table.local_cols,
                mode=params.mode,
                cache_load_factor=params.cache_load_factor,
                optimizer=optimizer,
                pooling=self._shard_pooling(table),
                cache_policy=params.cache_policy,
                rank=rank,
                world_size=world,
                dist_type=params.dist_type.value,
                routing_seed=params.seed,
                split_seed=rank,
                dtype=params.dtype,
                device=device,
                table_name=table.name,
                backend=backend,
                routing=WholeTableRouting(table.num_embeddings) if whole_tables else None,
                weight_init_min=table.get_weight_init_min(),  # torchrec's fused kernels' init range
                weight_init_max=table.get_weight_init_max(),
                # fbgemm's rule for torchrec's FUSED tables: the fused param, default WARNING
                bounds_check_mode=bounds_check_mode_of(table.fused_params, table.name),
            )
            self.tables[table.name] = shard
            self._feature_table += [table.name] * table.num_features()
        self._fused_optimizer: TieredFusedOptimizer = TieredFusedOptimizer(self.shards())

    def _dynamic_shard(
        self,
        table: ShardedEmbeddingTable,
        params: PlacementParams,
        optimizer: TieredOptimizerConfig,
        backend: Optional[str],
        device: Optional[torch.device],
        rank: int,
        world: int,
    ) -> DynamicEmbeddingShard:
        """A dynamic table's shard: keys routed by raw-key ``hash_roundrobin`` over ``world`` ranks, or the
        whole table on this rank (table-wise)."""
        assert params.dynamic is not None
        whole = self._whole_tables
        return DynamicEmbeddingShard(
            num_embeddings=table.num_embeddings,
            embedding_dim=table.local_cols,
            options=params.dynamic,
            shards=1 if whole else world,
            key_rank=0 if whole else rank,
            key_routing_seed=params.seed,
            mode=params.mode,
            cache_load_factor=params.cache_load_factor,
            optimizer=optimizer,
            pooling=self._shard_pooling(table),
            cache_policy=params.cache_policy,
            split_seed=rank,
            dtype=params.dtype,
            device=device,
            table_name=table.name,
            backend=backend,
        )

    def shards(self) -> Dict[str, TieredEmbeddingShard]:
        """Table name -> the group's shard of it (``self.tables`` holds exactly these)."""
        return {name: cast(TieredEmbeddingShard, shard) for name, shard in self.tables.items()}

    @property
    def fused_optimizer(self) -> TorchrecFusedOptimizer:
        """The group's :class:`TieredFusedOptimizer` (torchrec ``FusedOptimizerModule`` interface)."""
        return self._fused_optimizer

    def _shard_pooling(self, table: ShardedEmbeddingTable) -> str:
        raise NotImplementedError

    def _table_runs(self) -> Iterator[Tuple[str, int, int]]:
        """Yields ``(table, first feature, end feature)`` for each table's run of features."""
        f = 0
        for name, run in itertools.groupby(self._feature_table):
            g = f + len(list(run))
            yield name, f, g
            f = g

    @property
    def config(self) -> GroupedEmbeddingConfig:
        """The group's config (torchrec ``BaseEmbedding`` interface)."""
        return self._config

    def state_dict(
        self, destination: Optional[Dict[str, Any]] = None, prefix: str = "", keep_vars: bool = False
    ) -> Dict[str, Any]:
        """Adds nothing: the sharded collection checkpoints the tiered rows itself."""
        self.flush()
        return destination if destination is not None else {}

    def named_parameters_by_table(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Yields nothing: tiered rows are not ``nn.Parameter`` slices."""
        return iter(())

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load from a torchrec state dict (see :meth:`state_dict`)."""

    def flush(self) -> None:
        """Writes back every dirty cached row (torchrec calls it before ``state_dict``)."""
        for shard in self.shards().values():
            shard.flush()

    def purge(self) -> None:
        """No cached state to drop beyond a flush (torchrec interface)."""
        self.flush()

    def tier_stats(self) -> Dict[str, Dict[str, float]]:
        """Table name -> ``TieredEmbeddingShard.tier_stats()`` of the last step."""
        return {name: shard.tier_stats() for name, shard in self.shards().items()}


class TieredBatchedEmbeddingBag(TieredKernelBase):
    """Pooled CUSTOMIZED_KERNEL group (pooling SUM or MEAN). Under ``sharding_type`` ROW_WISE a MEAN table
    pools with SUM and torchrec's EBC divides after the output all-to-all (a local mean would average partial sums).
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        sharding_type: Optional[ShardingType] = ShardingType.ROW_WISE,
    ) -> None:
        self._sharding_type = sharding_type  # read by _shard_pooling during super().__init__
        super().__init__(config, pg=pg, device=device, whole_tables=sharding_type == ShardingType.TABLE_WISE)

    def _shard_pooling(self, table: ShardedEmbeddingTable) -> str:
        if table.pooling not in (PoolingType.SUM, PoolingType.MEAN):
            raise ValueError(f"table {table.name}: pooling {table.pooling} is not supported; use SUM or MEAN.")
        mode = pooling_type_to_pooling_mode(table.pooling, self._sharding_type)  # torchrec's rule
        return "sum" if mode == PoolingMode.SUM else "mean"

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """Pooled lookups ``[stride, sum of dims]`` of the group's features, in feature order; a
        ValueError when ``features`` has a variable batch size per feature (VBE)."""
        if features.variable_stride_per_key():
            raise tiered_vbe_error(
                "TieredBatchedEmbeddingBag.forward",
                {t.name: list(t.feature_names) for t in self._config.embedding_tables},
                features,
            )
        B = features.stride()
        values = features.values()
        weights = features.weights_or_none()
        offsets = features.offsets()
        starts = features.offset_per_key()  # host ints the KJT keeps: no device read per table
        outs: List[torch.Tensor] = []
        for name, f, g in self._table_runs():
            lo, hi = starts[f], starts[g]
            psw = weights[lo:hi] if weights is not None else None
            pooled = self.tables[name](values[lo:hi], offsets[f * B : g * B + 1] - lo, psw)  # [(g - f) * B, D]
            pooled = pooled.to(self._output_dtypes[name])  # fused param output_dtype, as fbgemm's TBE
            D = pooled.shape[-1]  # explicit: an empty batch (B = 0) leaves no -1 to infer
            outs.append(pooled.view(g - f, B, D).transpose(0, 1).reshape(B, (g - f) * D))  # feature-major columns
        return torch.cat(outs, dim=1)


class TieredBatchedEmbedding(TieredKernelBase):
    """Sequence (unpooled) CUSTOMIZED_KERNEL group; KJT weights are ignored, as by torchrec's FUSED one."""

    def _shard_pooling(self, table: ShardedEmbeddingTable) -> str:
        return "sum"  # one id per bag: the sum is the row itself

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """One embedding row per id, ``[len(features.values()), dim]``, in ``values()`` order."""
        if features.variable_stride_per_key():
            raise ValueError("tiered tables do not support variable batch size per feature (VBE) yet.")
        values = features.values()
        starts = features.offset_per_key()  # host ints the KJT keeps: no device read per table
        outs: List[torch.Tensor] = []
        for name, f, g in self._table_runs():
            lo, hi = starts[f], starts[g]
            ids = values[lo:hi]
            per_id = torch.arange(hi - lo + 1, dtype=torch.int64, device=ids.device)
            outs.append(self.tables[name](ids, per_id, None).to(self._output_dtypes[name]))  # [hi - lo, D]
        if not outs:
            dtype = next(iter(self._output_dtypes.values()), torch.float32)
            return values.new_zeros((0, 0), dtype=dtype)
        return torch.cat(outs, dim=0)


class TieredGroupedPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """torchrec's grouped lookup; CUSTOMIZED_KERNEL groups get the tiered kernel."""

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        device: Optional[torch.device],
        pg: Optional[dist.ProcessGroup],
        sharding_type: Optional[ShardingType],
        env: Optional[ShardingEnv],
    ) -> BaseEmbedding:
        if config.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return TieredBatchedEmbeddingBag(config=config, pg=pg, device=device, sharding_type=sharding_type)
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)


class TieredGroupedEmbeddingsLookup(GroupedEmbeddingsLookup):
    """torchrec's grouped sequence lookup; CUSTOMIZED_KERNEL groups get the tiered kernel (row-wise shards,
    or whole tables when ``_WHOLE_TABLES``)."""

    _WHOLE_TABLES: bool = False

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        pg: Optional[dist.ProcessGroup],
        device: Optional[torch.device],
        env: Optional[ShardingEnv] = None,
    ) -> BaseEmbedding:
        if config.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return TieredBatchedEmbedding(config=config, pg=pg, device=device, whole_tables=self._WHOLE_TABLES)
        return super()._create_embedding_kernel(config, pg, device, env)


class TieredTwGroupedEmbeddingsLookup(TieredGroupedEmbeddingsLookup):
    """The grouped sequence lookup of table-wise tiered tables (each whole on this rank)."""

    _WHOLE_TABLES = True
