"""torchrec sharders that run recpipe tiered tables behind row-wise or table-wise sharding.

They extend recpipe's routed EBC / EC sharders with the ``CUSTOMIZED_KERNEL`` compute kernel for
ROW_WISE and TABLE_WISE tables and shard to the tiered sharded collections; ``backend=`` reaches the kernel
through the tiered tables' fused params (``FUSED_PARAM_BACKEND``). May import
``recpipe.pipeline.placement``, ``recpipe.pipeline.routing`` and other ``recpipe.pipeline.tiered`` modules.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType

from recpipe.pipeline.routing.routed_sharders import (
    RoutedEmbeddingBagCollectionSharder,
    RoutedEmbeddingCollectionSharder,
    RoutedSharderMixin,
)
from recpipe.pipeline.tiered.backends import BACKENDS, resolve_backend
from recpipe.pipeline.tiered.tiered_collections import (
    TieredShardedEmbeddingBagCollection,
    TieredShardedEmbeddingCollection,
)


class _TieredSharderMixin(RoutedSharderMixin):
    """Offers the tiered CUSTOMIZED_KERNEL for ROW_WISE and TABLE_WISE tables and refuses it elsewhere. ``backend``
    (keyword-only): ``native``, ``fbgemm``, ``torch``, or None for the device's default; refused when
    unknown, or (in :meth:`shard`) when it cannot run on the device. Mixed in before a routed sharder, whose
    ``RoutedSharderMixin`` it names as its base so its calls into it are typed (the sharders' MRO is unchanged)."""

    _SHARDED_MODULE: Any

    def __init__(self, *args: Any, backend: Optional[str] = None, **kwargs: Any) -> None:
        if backend is not None and backend not in BACKENDS:
            raise ValueError(
                f"{type(self).__name__}: backend must be one of {list(BACKENDS)} or None (the "
                f"device's default), got {backend!r}."
            )
        super().__init__(*args, **kwargs)
        self._backend: Optional[str] = backend
        if backend is not None:  # shard() builds this class (the base sharder reads _SHARDED_MODULE)
            self._SHARDED_MODULE = type(self)._SHARDED_MODULE.with_backend(backend)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        kernels: List[str] = super().compute_kernels(sharding_type, compute_device_type)
        if sharding_type in TIERED_SHARDING_TYPES:
            kernels.append(EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value)
        return kernels

    def shard(
        self,
        module: nn.Module,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> Any:
        _check_tiered_params(params)
        if self._backend is not None:
            try:
                resolve_backend(self._backend, device if device is not None else torch.device("cpu"))
            except ValueError as e:
                raise ValueError(f"{type(self).__name__}(backend={self._backend!r}): {e}") from None
        return super().shard(module, params, env, device, module_fqn)

    @property
    def sharded_module_type(self) -> type:
        return type(self)._SHARDED_MODULE


class TieredEmbeddingBagCollectionSharder(_TieredSharderMixin, RoutedEmbeddingBagCollectionSharder):
    """recpipe's routed EBC sharder whose CUSTOMIZED_KERNEL row-wise tables run the tiered kernel
    (arguments: ``RoutedEmbeddingBagCollectionSharder``'s, plus ``backend``, :class:`_TieredSharderMixin`)."""

    _SHARDED_MODULE: Any = TieredShardedEmbeddingBagCollection


#: Sharding types a tiered (CUSTOMIZED_KERNEL) table runs under: row-wise over every rank (hash-routed),
#: or whole on one rank.
TIERED_SHARDING_TYPES = (ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value)


def _check_tiered_params(params: Dict[str, ParameterSharding]) -> None:
    for name, ps in params.items():
        if (
            ps.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
            and ps.sharding_type not in TIERED_SHARDING_TYPES
        ):
            raise ValueError(
                f"table {name}: CUSTOMIZED_KERNEL (tiered) needs sharding_type row_wise or table_wise, got "
                f"{ps.sharding_type}; build the plan with recpipe.planner (PlacementPlan.to_sharding_plan())."
            )


class TieredEmbeddingCollectionSharder(_TieredSharderMixin, RoutedEmbeddingCollectionSharder):
    """recpipe's routed EC sharder whose CUSTOMIZED_KERNEL row-wise tables run the tiered sequence kernel
    (arguments: ``RoutedEmbeddingCollectionSharder``'s, plus ``backend``, :class:`_TieredSharderMixin`)."""

    _SHARDED_MODULE: Any = TieredShardedEmbeddingCollection
