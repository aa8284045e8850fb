"""The row-wise shardings and sharded collections of tiered tables.

The shardings complete each tiered table's placement and build lookups whose CUSTOMIZED_KERNEL
groups run the tiered kernels; the sharded EBC / EC carry the tiered rows through ``state_dict()``
/ ``load_state_dict()`` (:class:`TieredTablesMixin`) and refuse VBE KJTs in ``input_dist``, before
any collective. May import ``recpipe.pipeline.placement``, ``.routing`` and other ``.tiered`` modules.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, ClassVar, Dict, Iterator, List, Optional, Sequence, cast

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embedding_types import (
    BaseEmbeddingLookup,
    BaseGroupedFeatureProcessor,
    EmbeddingComputeKernel,
)
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType
from torchrec.optim.fused import EmptyFusedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.pipeline.routing.routed_collections import (
    RoutedShardedEmbeddingBagCollection,
    RoutedShardedEmbeddingCollection,
    RoutedShardedMixin,
)
from recpipe.pipeline.routing.rw_sharding import RoutedRwPooledEmbeddingSharding, RoutedRwSequenceEmbeddingSharding
from recpipe.pipeline.tiered.dynamic.dynamic_shard import DynamicEmbeddingShard
from recpipe.pipeline.tiered.dynamic.dynamic_state import (
    DYNAMIC_STATE_KEY,
    dynamic_entries_misfit,
    dynamic_state_entries,
    pop_dynamic_entries,
)
from recpipe.pipeline.tiered.fused_params import resolve_tiered_fused_params, tiered_vbe_error
from recpipe.pipeline.tiered.kernels import (
    TieredGroupedEmbeddingsLookup,
    TieredGroupedPooledEmbeddingsLookup,
    TieredKernelBase,
    TieredTwGroupedEmbeddingsLookup,
)
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard
from recpipe.pipeline.tiered.state import STATE_FIELDS, TieredShardState


class _TieredShardingMixin(EmbeddingSharding):
    """Completes the tiered tables' placement before the sharding is built, so input dist and kernel agree,
    and builds the tiered grouped lookup (``_LOOKUP``) under ``_SHARDING_TYPE``. ``_backend`` is set on a
    per-sharder subclass by ``TieredTablesMixin.with_backend``; row-wise shardings also take the sharder's
    ``routing``. Mixed in before a torchrec ``EmbeddingSharding``, the base it names so its calls into it are
    typed (the MRO of each sharding is unchanged: that base follows the sharding)."""

    _backend: ClassVar[Optional[str]] = None
    _LOOKUP: ClassVar[type]
    _POOLED: ClassVar[bool] = False
    _SHARDING_TYPE: ClassVar[ShardingType]

    def __init__(self, sharding_infos: List[EmbeddingShardingInfo], *args: Any, **kwargs: Any) -> None:
        resolve_tiered_fused_params(sharding_infos, kwargs.get("routing"), self._backend)
        super().__init__(sharding_infos, *args, **kwargs)

    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> BaseEmbeddingLookup:
        pooled = {"feature_processor": feature_processor, "sharding_type": self._SHARDING_TYPE}
        return self._LOOKUP(
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            env=self._env,
            **(pooled if self._POOLED else {}),
        )


class TieredRwPooledEmbeddingSharding(_TieredShardingMixin, RoutedRwPooledEmbeddingSharding):
    """recpipe's routed row-wise pooled sharding whose CUSTOMIZED_KERNEL tables are tiered."""

    _LOOKUP = TieredGroupedPooledEmbeddingsLookup
    _POOLED = True
    _SHARDING_TYPE = ShardingType.ROW_WISE


class TieredRwSequenceEmbeddingSharding(_TieredShardingMixin, RoutedRwSequenceEmbeddingSharding):
    """recpipe's routed row-wise sequence sharding whose CUSTOMIZED_KERNEL tables are tiered."""

    _LOOKUP = TieredGroupedEmbeddingsLookup
    _SHARDING_TYPE = ShardingType.ROW_WISE


class TieredTwPooledEmbeddingSharding(_TieredShardingMixin, TwPooledEmbeddingSharding):
    """torchrec's table-wise pooled sharding whose CUSTOMIZED_KERNEL tables are tiered, each whole on its owner."""

    _LOOKUP = TieredGroupedPooledEmbeddingsLookup
    _POOLED = True
    _SHARDING_TYPE = ShardingType.TABLE_WISE


class TieredTwSequenceEmbeddingSharding(_TieredShardingMixin, TwSequenceEmbeddingSharding):
    """torchrec's table-wise sequence sharding whose CUSTOMIZED_KERNEL tables are tiered, each whole on its owner."""

    _LOOKUP = TieredTwGroupedEmbeddingsLookup
    _SHARDING_TYPE = ShardingType.TABLE_WISE


#: state_dict key infix of a tiered table's rows: ``<collection>.<table>.tiered.<field>``.
TIERED_STATE_KEY = "tiered"


class TieredTablesMixin(RoutedShardedMixin):
    """Access to the tiered shards of a sharded EBC / EC, and their rows in ``state_dict()``.

    torchrec's sharded state_dict skips CUSTOMIZED_KERNEL tables, so this rank's export of each
    tiered table appears under ``<collection>.<table>.tiered.<field>`` and ``load_state_dict``
    loads it (another world size needs every rank's export: :meth:`load_tiered_state`). Mixed in
    before a routed sharded collection, whose ``RoutedShardedMixin`` it names as its base so its
    calls into it are typed (the collections' MRO is unchanged).
    """

    _lookups: List[nn.Module]
    #: the attribute (and state_dict key part) holding the tables: EBC ``embedding_bags``, EC ``embeddings``
    TIERED_COLLECTION: str = "embedding_bags"
    _ROW_WISE_SHARDING: ClassVar[type]
    _TABLE_WISE_SHARDING: ClassVar[type]

    @classmethod
    def with_backend(cls, backend: str) -> type:
        """A subclass whose tiered tables run ``backend``, as ``with_routing`` carries the routing."""
        shardings = {
            name: type(base.__name__, (base,), {"_backend": backend})
            for name, base in (
                ("_ROW_WISE_SHARDING", cls._ROW_WISE_SHARDING),
                ("_TABLE_WISE_SHARDING", cls._TABLE_WISE_SHARDING),
            )
        }
        return type(cls.__name__, (cls,), shardings)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # set by state_dict_without_tiered_rows(): collects the state_dict prefix instead of rows
        self._tiered_state_dict_sink: Optional[Dict[str, "TieredTablesMixin"]] = None
        self._register_state_dict_hook(TieredTablesMixin._tiered_post_state_dict_hook)

    @staticmethod
    def _tiered_post_state_dict_hook(
        module: "TieredTablesMixin", destination: Dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        if module._tiered_state_dict_sink is not None:
            module._tiered_state_dict_sink[prefix] = module
            return
        for name, shard in module.tiered_tables().items():
            table = f"{prefix}{module.TIERED_COLLECTION}.{name}."
            if isinstance(shard, DynamicEmbeddingShard):  # keyed by raw key: <table>.dynamic.<field>
                destination.update(dynamic_state_entries(shard, f"{table}{DYNAMIC_STATE_KEY}."))
                continue
            destination.update({f"{table}{TIERED_STATE_KEY}.{k}": v for k, v in shard.export_state().entries().items()})

    def _tiered_names(self) -> List[str]:
        """Tables of this module planned with the tiered (CUSTOMIZED_KERNEL) kernel."""
        plan = self.module_sharding_plan
        return [
            name for name, ps in plan.items() if ps.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
        ]

    def reset_parameters(self) -> None:
        """torchrec's init; tiered tables get an empty ``weight`` placeholder, as torchrec's shardless ones."""
        collection = getattr(self, self.TIERED_COLLECTION)
        for name in self._tiered_names():
            holder = collection[name]
            if not hasattr(holder, "weight"):
                placeholder = nn.Parameter(torch.empty(0))
                # torchrec's in-backward optimizer marker, an attribute torch's Parameter does not declare
                setattr(placeholder, "_in_backward_optimizers", [EmptyFusedOptimizer()])
                holder.register_parameter("weight", placeholder)
        super().reset_parameters()

    @staticmethod
    def _pre_load_state_dict_hook(self: Any, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
        """Loads tiered exports and full weights from ``state_dict`` (all checked first), then torchrec's hook."""
        self._check_entries_fit_tables(state_dict, prefix)
        self._load_tiered_entries(state_dict, prefix)
        _load_full_tiered_weights(self, state_dict, f"{prefix}{self.TIERED_COLLECTION}.", self._tiered_names())
        # the next class's hook in the MRO (torchrec's ShardedEmbedding[Bag]Collection)
        super(TieredTablesMixin, type(self))._pre_load_state_dict_hook(self, state_dict, prefix, *args)

    def _check_entries_fit_tables(self, state_dict: Dict[str, Any], prefix: str) -> None:
        """Refuses entries of a table saved under the other kernel (FUSED <-> tiered, static <-> dynamic),
        before any load.

        A tiered table given a sharded ``weight``, a dynamic table given a static tiered export or the
        reverse, or a non-tiered one given a tiered or dynamic export or the empty placeholder (torchrec's
        hook would fail with an ``IndexError``).
        """
        tiered = set(self._tiered_names())
        plan = self.module_sharding_plan
        collection = f"{prefix}{self.TIERED_COLLECTION}."
        shards = self.tiered_tables()
        for name in (n for n in plan if n in tiered):  # plan order: every rank names the same table
            key = f"{collection}{name}.weight"
            if isinstance(state_dict.get(key), (ShardedTensor, DTensor)):
                raise ValueError(_sharded_weight_error(key, name, state_dict[key]))
            dynamic = isinstance(shards[name], DynamicEmbeddingShard) if name in shards else None
            misfit = dynamic_entries_misfit(dynamic, name, state_dict, f"{collection}{name}.")
            if misfit is not None:
                raise ValueError(f"{type(self).__name__}.load_state_dict: {misfit}")
        local = getattr(self, "_model_parallel_name_to_local_shards", {})
        wrappers = getattr(self, "_model_parallel_name_to_shards_wrapper", {})
        for name, ps in plan.items():
            if name in tiered:
                continue
            key = f"{collection}{name}.weight"
            bases = (f"{collection}{name}.{TIERED_STATE_KEY}.", f"{collection}{name}.{DYNAMIC_STATE_KEY}.")
            exported = sorted(k for k in state_dict if k.startswith(bases))
            value: Any = state_dict.get(key)
            has_shard = bool(local.get(name)) or bool((wrappers.get(name) or {}).get("local_tensors"))
            placeholder = (
                isinstance(value, torch.Tensor)
                and not isinstance(value, (ShardedTensor, DTensor))
                and value.dim() != 2
                and has_shard
            )
            if not exported and not placeholder:
                continue
            found = " and ".join(
                ([f"its tiered export {exported}"] if exported else [])
                + ([f"the tiered tables' empty placeholder {key} (shape {list(value.shape)})"] if placeholder else [])
            )
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: table {name!r} is planned {ps.sharding_type} "
                f"{ps.compute_kernel} (not tiered) in this model, but the state dict holds it as a tiered model "
                f"saved it: {found}. A tiered export is one rank's hash-routed rows (global ids, values, "
                f"optimizer state), not this table's {ps.sharding_type} shard, so it cannot be loaded here. "
                "Possible solutions:\n"
                f"  1. load it into a model that plans {name!r} as it was saved (a tiered placement, "
                "compute_kernel 'customized_kernel');\n"
                "  2. move the saved rows as a full table: full = recpipe.pipeline.tiered.migration.gather_full_weights("
                "<the saving (tiered) model>) on every rank, then pass the state dict with full["
                f"{key!r}] instead of the tiered entries (the table's optimizer state then starts from zero: "
                "migrate it with opt = gather_full_optimizer_state(<the saving model>) on every rank, then "
                "load_full_optimizer_state(<this model>, opt) after the weights)."
            )

    def _load_tiered_entries(self, state_dict: Dict[str, Any], prefix: str) -> None:
        """Loads and removes the ``...tiered.*`` (``...dynamic.*``) entries written by the state_dict hook."""
        tables = self.tiered_tables()
        for name, shard in tables.items():
            if isinstance(shard, DynamicEmbeddingShard):
                pop_dynamic_entries(shard, state_dict, f"{prefix}{self.TIERED_COLLECTION}.{name}.{DYNAMIC_STATE_KEY}.")
                continue
            base = f"{prefix}{self.TIERED_COLLECTION}.{name}.{TIERED_STATE_KEY}."
            present = [f for f in STATE_FIELDS if base + f in state_dict]
            if not present:
                continue
            if len(present) != len(STATE_FIELDS):
                absent = [base + f for f in STATE_FIELDS if f not in present]
                raise ValueError(
                    f"tiered table {name!r}: state_dict has {sorted(base + f for f in present)} but not "
                    f"{absent}; pass the complete export written by state_dict()."
                )
            shard.load_states([TieredShardState.from_entries(lambda k: state_dict.pop(base + k))])

    def tiered_tables(self) -> Dict[str, TieredEmbeddingShard]:
        """This rank's tiered shards by table name."""
        out: Dict[str, TieredEmbeddingShard] = {}
        for wrapped in self._lookups:
            lookup: nn.Module = wrapped
            while hasattr(lookup, "module") and not isinstance(lookup, BaseEmbeddingLookup):
                lookup = cast(nn.Module, lookup.module)  # DDP / pipeline wrappers around the lookup
            for module in lookup.modules():
                if isinstance(module, TieredKernelBase):
                    out.update(module.shards())
        return out

    def remote_tiered_names(self) -> List[str]:
        """Tiered tables of this module that another rank holds whole (table-wise): here only their empty
        ``weight`` placeholder."""
        local = self.tiered_tables()
        return [name for name in self._tiered_names() if name not in local]

    def tier_stats(self) -> Dict[str, Dict[str, float]]:
        """Table name -> ``TieredEmbeddingShard.tier_stats()`` of this rank's last step."""
        return {name: shard.tier_stats() for name, shard in self.tiered_tables().items()}

    def tiered_state(self) -> Dict[str, TieredShardState]:
        """Table name -> this rank's export; gathered over ranks, :meth:`load_tiered_state` takes them."""
        return {name: shard.export_state() for name, shard in self.tiered_tables().items()}

    def load_tiered_state(self, states: Dict[str, Sequence[TieredShardState]]) -> None:
        """Loads (and reshards) tiered tables from table name -> every saving rank's export."""
        tables = self.tiered_tables()
        missing = sorted(set(tables) - set(states))
        if missing:
            raise ValueError(f"load_tiered_state: no exports for tiered tables {missing}; pass every table.")
        for name, shard in tables.items():
            shard.load_states(states[name])


class TieredShardedEmbeddingBagCollection(TieredTablesMixin, RoutedShardedEmbeddingBagCollection):
    """recpipe's routed ``ShardedEmbeddingBagCollection`` with tiered CUSTOMIZED_KERNEL tables."""

    _ROW_WISE_SHARDING = TieredRwPooledEmbeddingSharding
    _TABLE_WISE_SHARDING = TieredTwPooledEmbeddingSharding

    def input_dist(self, ctx: Any, features: Any) -> Any:
        """torchrec's input dist, after refusing (ValueError) a VBE KJT when the collection has tiered
        tables (before any collective)."""
        if isinstance(features, KeyedJaggedTensor) and features.variable_stride_per_key():
            tiered = set(self._tiered_names())
            if tiered:
                raise tiered_vbe_error(
                    f"{type(self).__name__}.input_dist",
                    {c.name: list(c.feature_names) for c in self._embedding_bag_configs if c.name in tiered},
                    features,
                )
        return super().input_dist(ctx, features)


def _sharded_weight_error(key: str, name: str, value: Any) -> str:
    """The refusal of a ``ShardedTensor`` / ``DTensor`` weight given to tiered table ``name``."""
    return (
        f"{key}: tiered table {name!r} cannot load a {type(value).__name__} (e.g. the state_dict() of a model "
        "whose table is a torchrec FUSED table): this rank holds a contiguous range of its rows, while the "
        "tiered shard owns hash-routed rows held by every rank. Possible solutions:\n"
        "  1. pass the full [num_embeddings, dim] tensor: full = recpipe.pipeline.tiered.migration.gather_full_weights("
        f"<the saving model>) on every rank, then load_state_dict(full, strict=False) (the table's "
        "optimizer state then starts from zero: FUSED tables keep it in fused_optimizer.state_dict(), which tiered "
        "tables do not load; migrate it with opt = recpipe.pipeline.tiered.migration.gather_full_optimizer_state(<the "
        "saving model>) on every rank, then load_full_optimizer_state(<this model>, opt) after the weights);\n"
        "  2. load the state_dict() (or tiered_state() exports, with load_tiered_state()) of a model that planned "
        "the table tiered."
    )


def _load_full_tiered_weights(
    module: Any, state_dict: Dict[str, Any], key_prefix: str, tiered_names: List[str]
) -> None:
    """Loads full ``[num_embeddings, dim]`` tiered weights by global id, leaving the empty placeholder
    in ``state_dict`` for torchrec's hook and the strict key check."""
    tiered = module.tiered_tables()
    for name in tiered_names:
        key = f"{key_prefix}{name}.weight"
        if key not in state_dict:
            continue
        value = state_dict[key]
        if value.numel() == 0:
            continue
        # a table-wise tiered table another rank holds loads nothing here; a dynamic table has no id-indexed
        # rows (its keys come from training or from its own exports)
        if name in tiered and not isinstance(tiered[name], DynamicEmbeddingShard):
            tiered[name].load_global_weights(value.detach())
        state_dict[key] = torch.empty(0)


class TieredShardedEmbeddingCollection(TieredTablesMixin, RoutedShardedEmbeddingCollection):
    """recpipe's routed ``ShardedEmbeddingCollection`` with tiered CUSTOMIZED_KERNEL tables."""

    TIERED_COLLECTION = "embeddings"
    _ROW_WISE_SHARDING = TieredRwSequenceEmbeddingSharding
    _TABLE_WISE_SHARDING = TieredTwSequenceEmbeddingSharding


@contextmanager
def state_dict_without_tiered_rows(model: nn.Module) -> Iterator[Dict[str, "TieredTablesMixin"]]:
    """While active, ``model.state_dict()`` leaves the tiered rows out, for formats storing them their own way.

    Yields ``{state_dict prefix: tiered collection}``, filled by ``state_dict()`` calls inside the block
    (only such a call knows a module's prefix).
    """
    found: Dict[str, TieredTablesMixin] = {}
    modules = [m for m in model.modules() if isinstance(m, TieredTablesMixin)]
    for m in modules:
        m._tiered_state_dict_sink = found
    try:
        yield found
    finally:
        for m in modules:
            m._tiered_state_dict_sink = None
