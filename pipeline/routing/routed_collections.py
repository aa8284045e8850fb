"""Sharded EmbeddingBagCollection / EmbeddingCollection whose ROW_WISE tables are routed.

May import ``recpipe.pipeline.placement`` and routing modules only.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, ShardedEmbeddingModule
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.types import Awaitable, QuantizedCommCodecs, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.pipeline.routing.features import RoutingOverrides
from recpipe.pipeline.routing.row_order import ROW_ORDER_KEY, RowOrder, describe_row_order, row_order_refusal
from recpipe.pipeline.routing.rw_sharding import (
    RoutedInputDistMixin,
    RoutedRwPooledEmbeddingSharding,
    RoutedRwSequenceEmbeddingSharding,
)

__all__ = ["RoutedShardedEmbeddingBagCollection", "RoutedShardedEmbeddingCollection", "RoutedShardedMixin"]


class RoutedShardedMixin(ShardedEmbeddingModule):
    """Routing, ROW_WISE sharding class and row-order records of a recpipe sharded collection. torchrec builds shardings
    in a classmethod, so the sharder's routing is a class attribute of a per-sharder subclass (:meth:`with_routing`);
    subclasses swap ``_ROW_WISE_SHARDING`` (and set ``_TABLE_WISE_SHARDING``). Mixed in before torchrec's
    ``ShardedEmbeddingBagCollection`` / ``ShardedEmbeddingCollection``, whose base ``ShardedEmbeddingModule`` it
    names so its calls into them are typed (their MRO is unchanged: that base follows them)."""

    _routing: ClassVar[Optional[RoutingOverrides]] = None
    _ROW_WISE_SHARDING: ClassVar[type]
    #: the sharding of table-wise groups holding a CUSTOMIZED_KERNEL table (None: torchrec's for every group)
    _TABLE_WISE_SHARDING: ClassVar[Optional[type]] = None
    #: attribute (and state_dict key part) holding the tables: ``embedding_bags`` / ``embeddings``
    _COLLECTION: ClassVar[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._register_state_dict_hook(RoutedShardedMixin._row_order_post_state_dict_hook)

    @classmethod
    def with_routing(cls, routing: Optional[RoutingOverrides]) -> type:
        """A subclass whose shardings use ``routing``."""
        return type(cls.__name__, (cls,), {"_routing": routing})

    def _shardings(self) -> List[EmbeddingSharding]:
        raise NotImplementedError

    @classmethod
    def _own_sharding(
        cls, sharding_type: str, sharding_infos: List[EmbeddingShardingInfo]
    ) -> Optional[Tuple[type, Dict[str, Any]]]:
        """``(sharding class, its extra arguments)`` for a group recpipe shards itself, else None (torchrec's)."""
        if sharding_type == ShardingType.ROW_WISE.value:
            return cls._ROW_WISE_SHARDING, {"routing": cls._routing}
        kernel = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
        if (
            sharding_type == ShardingType.TABLE_WISE.value
            and cls._TABLE_WISE_SHARDING is not None
            and any(info.param_sharding.compute_kernel == kernel for info in sharding_infos)
        ):
            return cls._TABLE_WISE_SHARDING, {}
        return None

    def row_orders(self) -> Dict[str, RowOrder]:
        """:class:`RowOrder` of each routed table torchrec's kernels hold, by table name."""
        out: Dict[str, RowOrder] = {}
        for sharding in self._shardings():
            if isinstance(sharding, RoutedInputDistMixin):
                out.update(sharding.row_orders())
        return out

    @staticmethod
    def _row_order_post_state_dict_hook(
        module: "RoutedShardedMixin", destination: Dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        for name, order in module.row_orders().items():
            destination[f"{prefix}{module._COLLECTION}.{name}.{ROW_ORDER_KEY}"] = order.record()

    @staticmethod
    def _pre_load_state_dict_hook(
        self: "RoutedShardedMixin", state_dict: Dict[str, Any], prefix: str, *args: Any
    ) -> None:
        """Checks and places routed tables' rows, then runs torchrec's hook. torchrec takes a sharded ``weight``'s local
        shard as is and slices a full tensor at contiguous offsets; a routed table holds other rows. So a ShardedTensor
        / DTensor loads only when its :data:`ROW_ORDER_KEY` record equals this table's (checked for all tables before
        any changes), and a full tensor gives each rank its routed rows.

        Raises:
            RowOrderMismatchError: naming each refused table and both row orders.
        """
        orders = self.row_orders()
        rank = int(self._env.rank)
        collection = f"{prefix}{self._COLLECTION}."
        problems: List[str] = []
        routed_full: Dict[str, torch.Tensor] = {}
        for name in self.module_sharding_plan:  # plan order: same on every rank
            key = f"{collection}{name}.weight"
            saved = state_dict.pop(f"{collection}{name}.{ROW_ORDER_KEY}", None)
            value = state_dict.get(key)
            order = orders.get(name)
            mine = order.record() if order is not None else None
            if isinstance(value, (ShardedTensor, DTensor)):
                if saved != mine:
                    problems.append(
                        f"table {name!r} ({key}): the state holds {describe_row_order(saved)}, "
                        f"this model {describe_row_order(mine)}"
                    )
            elif (
                order is not None
                and isinstance(value, torch.Tensor)
                and value.dim() == 2
                and value.shape[0] == order.num_embeddings
            ):
                routed_full[key] = value.index_select(0, order.global_ids(rank).to(value.device))
        if problems:
            raise row_order_refusal(
                f"{type(self).__name__}.load_state_dict",
                problems,
                "\nIf torch.distributed.checkpoint.load filled this state dict in place (dcp.load(model.state_dict(), "
                "...)), it has already written the saved rows into these tables' shards: rebuild the model or load a "
                "checkpoint of this routing before training on. recpipe.pipeline.checkpoint.load checks the "
                "routing before it reads any row.",
            )
        super(RoutedShardedMixin, type(self))._pre_load_state_dict_hook(self, state_dict, prefix, *args)
        state_dict.update(routed_full)  # over torchrec's slice of the full tensor at the contiguous offsets


class RoutedShardedEmbeddingBagCollection(RoutedShardedMixin, ShardedEmbeddingBagCollection):
    """ShardedEmbeddingBagCollection whose ROW_WISE shardings route with recpipe's op. torchrec's mean-pooling callback
    (row-wise MEAN tables pool as SUM, then divide) divides every feature not of a row-wise SUM table; here only
    row-wise MEAN features are divided, so every table pools as the unsharded module does.

    Raises:
        ValueError: a feature read both by a row-wise MEAN table and by another table.
    """

    _ROW_WISE_SHARDING: ClassVar[type] = RoutedRwPooledEmbeddingSharding
    _COLLECTION: ClassVar[str] = "embedding_bags"

    def _shardings(self) -> List[EmbeddingSharding]:
        return list(self._embedding_shardings)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._divide_only_row_wise_mean_features()

    def _divide_only_row_wise_mean_features(self) -> None:
        """Gives the mean-pooling callback a divisor of 1 for every feature not of a row-wise MEAN table."""
        if not self._has_mean_pooling_callback:
            return
        rs = self._pooling_type_to_rs_features
        divided = set(rs.get(PoolingType.MEAN.value, []))
        readers: Dict[str, List[str]] = {}
        for config in self._embedding_bag_configs:
            for feature in config.feature_names:
                readers.setdefault(feature, []).append(config.name)
        summed = list(rs.get(PoolingType.SUM.value, []))
        row_wise = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)
        for feature, tables in readers.items():
            if feature not in divided:
                if feature not in summed:
                    summed.append(feature)
                continue
            row_wise_mean = [
                t
                for t in tables
                if self._table_name_to_config[t].pooling == PoolingType.MEAN
                and self.module_sharding_plan[t].sharding_type in row_wise
            ]
            if len(row_wise_mean) != len(tables):
                others = [t for t in tables if t not in row_wise_mean]
                raise ValueError(
                    f"recpipe: feature {feature!r} is read by the row-wise MEAN table(s) {row_wise_mean} and by "
                    f"{others}, which are not row-wise MEAN tables: torchrec divides a row-wise MEAN feature's "
                    "pooled sums by its bag lengths after the output dist, one divisor per feature, so the other "
                    "tables' output would be divided too. Possible solutions:\n  1) give each of these tables its "
                    "own feature name, or\n  2) give them the same pooling and sharding (all row-wise MEAN, or "
                    "none)."
                )
        rs[PoolingType.SUM.value] = summed

    def input_dist(self, ctx: Any, features: Any) -> Awaitable[Awaitable[Any]]:
        """torchrec's input dist, a VBE KJT's ``inverse_indices`` first put in the shardings' feature order. torchrec's
        VBE mean-pooling divisor reads ``inverse_indices`` in key order but lengths in feature order; another key order
        would fail or divide by other features' lengths."""
        if (
            self._has_mean_pooling_callback
            and isinstance(features, KeyedJaggedTensor)
            and features.variable_stride_per_key()
            and features.inverse_indices_or_none() is not None
        ):
            features = self._vbe_in_feature_order(features)
        return super().input_dist(ctx, features)

    def _vbe_in_feature_order(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` with ``inverse_indices`` in the shardings' feature order; keys, values, lengths kept."""
        names = [f for sharding in self._embedding_shardings for f in sharding.feature_names()]
        inverse_keys, inverse = features.inverse_indices()
        if len(set(names)) != len(names) or list(inverse_keys) == names or not set(names) <= set(inverse_keys):
            return features  # torchrec's own path (shared features, or rows it cannot name)
        position = {k: i for i, k in enumerate(inverse_keys)}
        rows = torch.tensor([position[n] for n in names], device=inverse.device)
        return KeyedJaggedTensor(
            keys=features.keys(),
            values=features.values(),
            weights=features.weights_or_none(),
            lengths=features.lengths_or_none(),
            offsets=features.offsets_or_none(),
            stride_per_key_per_rank=features.stride_per_key_per_rank(),
            inverse_indices=(names, inverse.index_select(0, rows)),
        )

    @classmethod
    def create_embedding_bag_sharding(
        cls,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> EmbeddingSharding:
        own = cls._own_sharding(sharding_infos[0].param_sharding.sharding_type, sharding_infos)
        if own is not None:
            sharding, extra = own
            return sharding(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry, **extra)
        return super().create_embedding_bag_sharding(
            sharding_infos,
            env,
            device,
            permute_embeddings=permute_embeddings,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )


class RoutedShardedEmbeddingCollection(RoutedShardedMixin, ShardedEmbeddingCollection):
    """ShardedEmbeddingCollection whose ROW_WISE shardings route with recpipe's op."""

    _ROW_WISE_SHARDING: ClassVar[type] = RoutedRwSequenceEmbeddingSharding
    _COLLECTION: ClassVar[str] = "embeddings"

    def _shardings(self) -> List[EmbeddingSharding]:
        return list(self._sharding_type_to_sharding.values())

    @classmethod
    def create_embedding_sharding(
        cls,
        sharding_type: str,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> EmbeddingSharding:
        own = cls._own_sharding(sharding_type, sharding_infos)
        if own is not None:
            sharding, extra = own
            return sharding(
                sharding_infos=sharding_infos,
                env=env,
                device=device,
                qcomm_codecs_registry=qcomm_codecs_registry,
                **extra,
            )
        return super().create_embedding_sharding(
            sharding_type, sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry
        )
