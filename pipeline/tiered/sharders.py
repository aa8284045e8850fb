"""torchrec sharders that run recpipe tiered tables behind row-wise sharding.

Built on ``recpipe.pipeline.routing.sharding`` (recpipe's routed row-wise sharders: ROW_WISE
on CPU and CUDA, input dist through ``torch.ops.recpipe.block_bucketize_sparse_features``
with a per-table dist_type), extending torchrec's public extension points further:

* :class:`TieredEmbeddingBagCollectionSharder` (a ``RecpipeEmbeddingBagCollectionSharder``)
  and :class:`TieredEmbeddingCollectionSharder` (a ``RecpipeEmbeddingCollectionSharder``)
  also offer the ``CUSTOMIZED_KERNEL`` compute kernel for ROW_WISE tables.
* :class:`TieredShardedEmbeddingBagCollection` overrides the
  ``create_embedding_bag_sharding`` classmethod for ROW_WISE;
  :class:`TieredShardedEmbeddingCollection` overrides ``create_embedding_sharding``.
* :class:`TieredRwPooledEmbeddingSharding` / :class:`TieredRwSequenceEmbeddingSharding`
  resolve each tiered table's routing (default ``hash_roundrobin``; plain torchrec
  tables keep ``continuous``) and build a lookup whose CUSTOMIZED_KERNEL groups run
  :class:`TieredBatchedEmbeddingBag` (pooled) or :class:`TieredBatchedEmbedding`
  (sequence), one :class:`~recpipe.pipeline.tiered.shard.TieredEmbeddingShard` per table;
  other groups keep torchrec's kernels.

The sequence kernel reuses the pooled shard with one id per bag (offsets
``0, 1, ..., n``, sum pooling): each output row is the stored row itself (a sum of
one term is exact) and the backward gives each id the gradient of its own output
row, summed per unique row before the fused update, as fbgemm's sequence TBE does.

Placement reaches the kernel through the table's fused params: a
:class:`~recpipe.pipeline.placement.PlacementParams` written by the planner's
``PlacementParameterSharding.get_additional_fused_params`` (keys
``recpipe.pipeline.placement.FUSED_PARAM_KEYS``) and read back, validated, by
``PlacementParams.from_fused_params``. The fused optimizer comes from torchrec's
usual fused params (``optimizer`` as an ``EmbOptimType``, ``learning_rate``,
``eps``, ``beta1``, ``beta2``, ``weight_decay``), e.g. set by
``apply_optimizer_in_backward``; ``output_dtype`` sets the dtype of the tables' outputs, as
fbgemm's; fused params that would change fbgemm's update but that the tiered kernel does not
implement, and torch optimizer kwargs fbgemm's TBE does not take, are refused naming the
table (:func:`tiered_optimizer_from_fused_params`); the kernel refuses a table whose optimizer or
row dtype differs from the one its placement was sized for
(:class:`~recpipe.pipeline.placement.PlacementMismatchError`), since it would
allocate other bytes than the plan budgeted. A hand-written
``PlacementParameterSharding`` that names no optimizer / dtype was not sized for
one: the table's own are written into its fused params (as its routing is). The
tiered sharders' ``backend=`` (the shards' kernel, default the device's) is written
into their tiered tables' fused params the same way
(``recpipe.pipeline.placement.FUSED_PARAM_BACKEND``).

Limits: ROW_WISE only (the tiered kernel is refused for other sharding types);
no variable batch size per feature (VBE) for pooled tables: a VBE KJT reaching an
EBC with tiered tables is refused by its ``input_dist``, before any collective,
naming the tables, their features and the fixes (:func:`tiered_vbe_error`;
torchrec's EmbeddingCollection pads a VBE KJT to one batch size itself, so tiered
sequence tables take it); sequence tables ignore KJT weights (as torchrec's FUSED
sequence kernel does), pooled tables give them fbgemm's gradient (so the position
weights of torchrec's ``FeatureProcessedEmbeddingBagCollection`` train, its sharder
wrapping the tiered one: ``FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder=...)``); EC index dedup (``use_index_dedup``) is untested with them.
torchrec's sharded ``state_dict`` skips CUSTOMIZED_KERNEL tables (torchrec's rule;
an empty ``weight`` placeholder stays, as for tables without a local shard):
checkpoint them with ``tiered_state()`` / ``load_tiered_state()`` of
:class:`TieredShardedEmbeddingBagCollection` or
:class:`TieredShardedEmbeddingCollection`. Loading an unsharded EmbeddingCollection
``state_dict`` (full ``[num_embeddings, dim]`` weights, as torchrec does when it
shards a module) initializes the EC's tiered tables from it.
"""

from __future__ import annotations

import numbers
from contextlib import contextmanager
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
from torch import nn
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import (
    BaseEmbeddingLookup,
    BaseGroupedFeatureProcessor,
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    ShardedEmbeddingTable,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import (
    DataType,
    PoolingType,
    data_type_to_dtype,
    data_type_to_sparse_type,
    pooling_type_to_pooling_mode,
)
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizerModule
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer
from torchrec.optim.fused import FusedOptimizer as TorchrecFusedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from recpipe.pipeline.tiered.optim import SUPPORTED_OPTIMIZERS
from recpipe.pipeline.placement import (
    FUSED_PARAM_BACKEND,
    FUSED_PARAM_DIST_TYPE,
    FUSED_PARAM_DTYPE,
    FUSED_PARAM_OPTIMIZER,
    FUSED_PARAM_SEED,
    DistType,
    FusedOptimizer,
    PlacementParams,
    dtype_name,
)
from recpipe.pipeline.routing.sharding import (
    RecpipeEmbeddingBagCollectionSharder,
    RecpipeEmbeddingCollectionSharder,
    RecpipeRwPooledEmbeddingSharding,
    RecpipeRwSequenceEmbeddingSharding,
    RecpipeShardedEmbeddingBagCollection,
    RecpipeShardedEmbeddingCollection,
    ROW_ORDER_KEY,
    RoutingOverrides,
    RowOrder,
)
from recpipe.pipeline.tiered.shard import (
    BACKENDS,
    TieredEmbeddingShard,
    TieredOptimizerConfig,
    TieredShardState,
    bounds_check_mode_of,
    resolve_backend,
)

__all__ = [
    "TIERED_OUTPUT_DTYPES",
    "TORCH_OPTIMIZER_ONLY_KWARGS",
    "TieredBatchedEmbedding",
    "TieredBatchedEmbeddingBag",
    "TieredEmbeddingBagCollectionSharder",
    "TieredEmbeddingCollectionSharder",
    "TieredFusedOptimizer",
    "TieredRwPooledEmbeddingSharding",
    "TieredRwSequenceEmbeddingSharding",
    "TieredShardedEmbeddingBagCollection",
    "TieredShardedEmbeddingCollection",
    "OPTIMIZER_STATE_NAMES",
    "OPTIMIZER_STEP_KEY",
    "gather_full_optimizer_state",
    "gather_full_weights",
    "load_full_optimizer_state",
    "state_dict_without_tiered_rows",
    "tiered_optimizer_from_fused_params",
    "tiered_output_dtype",
    "tiered_placement",
    "tiered_vbe_error",
]

def tiered_optimizer_from_fused_params(fused_params: Optional[Dict[str, Any]]) -> TieredOptimizerConfig:
    """The tiered optimizer config for torchrec fused params.

    Args:
        fused_params (Dict[str, Any] | None): a table's fused params (``optimizer``
            is an ``EmbOptimType``; fbgemm's defaults apply to missing keys,
            ``EXACT_SGD`` for the optimizer).

    Returns:
        TieredOptimizerConfig: SGD / row-wise Adagrad / Adam with the same hyper-parameters.

    Raises:
        ValueError: the optimizer is not one the tiered kernel runs (or one fbgemm's TBE refuses as
            deprecated: ``EmbOptimType.SGD`` / ``ROWWISE_ADAGRAD``), a fused param is a
            torch optimizer argument fbgemm's TBE does not take (:data:`TORCH_OPTIMIZER_ONLY_KWARGS`,
            e.g. Adam's ``betas``), or a fused param changes fbgemm's update in a way the
            tiered kernel does not implement (:func:`_unsupported_update_params`).
    """
    if fused_params is not None and not isinstance(fused_params, Mapping):
        raise ValueError(f"fused_params must be a dict (or None), got {type(fused_params).__name__} {fused_params!r}.")
    fp = dict(fused_params or {})
    opt = fp.get("optimizer", EmbOptimType.EXACT_SGD)
    if opt in _DEPRECATED_OPTIMIZERS:
        exact = _DEPRECATED_OPTIMIZERS[opt]
        raise ValueError(
            f"fused optimizer EmbOptimType.{opt.name} is deprecated in fbgemm, whose TBE refuses it (torchrec's "
            f"FUSED tables fail with an AssertionError); tiered tables run the exact update only: use "
            f"EmbOptimType.{exact.name} in the fused params (what apply_optimizer_in_backward with "
            f"{'torch.optim.SGD' if exact is EmbOptimType.EXACT_SGD else 'torchrec RowWiseAdagrad'} gives)."
        )
    try:
        fused = FusedOptimizer.parse(opt)
    except ValueError:
        fused = None
    if fused not in SUPPORTED_OPTIMIZERS:
        raise ValueError(
            f"fused optimizer {opt} is not supported by tiered tables: use one of "
            f"{sorted(o.value for o in SUPPORTED_OPTIMIZERS)} (apply_optimizer_in_backward with SGD, "
            "RowWiseAdagrad or Adam)."
        )
    torch_only = {k: fp[k] for k in TORCH_OPTIMIZER_ONLY_KWARGS if k in fp}
    if torch_only:
        raise ValueError(
            f"fused params {torch_only} are torch optimizer arguments that fbgemm's TBE does not take "
            "(torchrec's FUSED tables refuse them: SplitTableBatchedEmbeddingBagsCodegen raises a TypeError), "
            f"and the tiered kernel would train {fused.value} without them. Possible solutions:\n  1. remove "
            "them from the optimizer kwargs of apply_optimizer_in_backward (or the fused params of the sharder "
            "/ the table's ParameterSharding);\n  2. give fbgemm's own fused params instead, e.g. beta1 / beta2 "
            "for Adam's betas (fused params learning_rate, eps, beta1, beta2, weight_decay)."
        )
    unsupported = _unsupported_update_params(fp, fused)
    if unsupported:
        raise ValueError(
            f"fused params {unsupported} change fbgemm's {fused.value} update of torchrec's FUSED tables, "
            "but the tiered kernel does not implement them (it would train without them). Possible "
            "solutions:\n  1. remove them from the fused params of the sharder / the table's "
            "ParameterSharding (or apply_optimizer_in_backward) for tiered tables;\n  2. plan this table "
            "as a torchrec FUSED table (e.g. ROW_WISE with compute_kernel 'fused') instead of a tiered "
            "placement."
        )

    def number(key: str, default: float) -> float:
        value = fp.get(key, default)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"fused param {key!r} must be a number, got {type(value).__name__} {value!r}; "
                             f"e.g. {key}={default}.")
        return float(value)

    return TieredOptimizerConfig(
        optimizer=fused,
        learning_rate=number("learning_rate", 0.01),
        eps=number("eps", 1.0e-8),
        beta1=number("beta1", 0.9),
        beta2=number("beta2", 0.999),
        weight_decay=number("weight_decay", 0.0) if fused is FusedOptimizer.ADAM else 0.0,
    )


#: fbgemm's non-exact ``EmbOptimType`` members, which its TBE refuses ("deprecated in the CPU + GPU
#: modes"), and their exact counterparts (the update the tiered kernel runs).
_DEPRECATED_OPTIMIZERS: Dict[EmbOptimType, EmbOptimType] = {
    EmbOptimType.SGD: EmbOptimType.EXACT_SGD,
    EmbOptimType.ROWWISE_ADAGRAD: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}


#: Keyword arguments of torch.optim.SGD / Adam / Adagrad and torchrec's RowWiseAdagrad that
#: fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` does not take (``lr`` aside, which torchrec
#: renames ``learning_rate``): ``apply_optimizer_in_backward`` hands them to the fused params,
#: where torchrec's FUSED tables refuse them (fbgemm's TypeError) and tiered tables refuse them too.
TORCH_OPTIMIZER_ONLY_KWARGS: Tuple[str, ...] = (
    "amsgrad", "betas", "capturable", "dampening", "decoupled_weight_decay", "differentiable", "foreach",
    "fused", "initial_accumulator_value", "lr_decay", "maximize", "nesterov",
)


def _unsupported_update_params(fp: Dict[str, Any], optimizer: FusedOptimizer) -> Dict[str, Any]:
    """The fused params (with their values) by which fbgemm's TBE updates a table
    differently from the tiered kernel:

    * ``gradient_clipping`` (fbgemm clamps each element of a row's summed gradient to
      ``[-max_gradient, max_gradient]``, SGD and row-wise Adagrad, CPU too);
    * row-wise Adagrad's ``weight_decay_mode`` (``L2`` / ``DECOUPLE`` with a nonzero
      ``weight_decay``, or ``COUNTER`` / ``COWCLIP`` / ``DECOUPLE_GLOBAL``) and ``max_norm > 0``
      (fbgemm's CUDA update decays / renormalizes the rows; fbgemm-gpu-cpu 1.9's CPU update
      ignores them, newer CPU builds apply the weight decay);
    * ``extra_optimizer_config`` with ``use_rowwise_bias_correction`` (fbgemm's CUDA Adam then
      corrects each row's moments by that row's own update count; the tiered kernel by the
      table's step).

    Their defaults (fbgemm's: ``False``, ``WeightDecayMode.NONE``, ``0.0``) are accepted, so
    is a ``weight_decay`` that fbgemm ignores (row-wise Adagrad without a mode, SGD).

    Args:
        fp (Dict[str, Any]): a table's fused params.
        optimizer (FusedOptimizer): the table's fused optimizer.

    Returns:
        Dict[str, Any]: name -> value of each unsupported non-default param (empty if none).
    """
    out: Dict[str, Any] = {}
    extra = fp.get("extra_optimizer_config")
    if getattr(extra, "use_rowwise_bias_correction", False):  # fbgemm's per-row Adam step counts
        out["extra_optimizer_config"] = extra
    if fp.get("gradient_clipping", False):
        out["gradient_clipping"] = fp["gradient_clipping"]
        out["max_gradient"] = fp.get("max_gradient", 1.0)  # fbgemm's default
    if optimizer is FusedOptimizer.ROWWISE_ADAGRAD:
        mode = fp.get("weight_decay_mode", WeightDecayMode.NONE)
        decays = fp.get("weight_decay", 0.0) != 0.0 or mode not in (WeightDecayMode.L2, WeightDecayMode.DECOUPLE)
        if mode not in (None, WeightDecayMode.NONE) and decays:
            out["weight_decay_mode"] = mode
            out["weight_decay"] = fp.get("weight_decay", 0.0)
        if fp.get("max_norm", 0.0):
            out["max_norm"] = fp["max_norm"]
    return out


#: Output dtypes of tiered tables (fused param ``output_dtype``): the float ones fbgemm's TBE outputs
#: (its CPU build: FP32 / FP16; its CUDA build adds BF16; its INT8 output is CUDA inference only).
TIERED_OUTPUT_DTYPES: Tuple[SparseType, ...] = (SparseType.FP32, SparseType.FP16, SparseType.BF16)


def tiered_output_dtype(fused_params: Optional[Dict[str, Any]], table_name: str) -> torch.dtype:
    """The dtype a tiered table's lookups output: its fused param ``output_dtype``, as
    fbgemm's TBE outputs torchrec's FUSED tables in it (the rows are summed in float32 and
    the pooled / sequence output cast to it; its gradient is cast back to float32).

    Args:
        fused_params (Dict[str, Any] | None): the table's fused params (``output_dtype`` a
            ``SparseType`` or torchrec ``DataType``; absent: ``SparseType.FP32``).
        table_name (str): the table, named in errors.

    Returns:
        torch.dtype: ``torch.float32``, ``torch.float16`` or ``torch.bfloat16``.

    Raises:
        ValueError: naming the table, for another ``output_dtype``.
    """
    value = (fused_params or {}).get("output_dtype", SparseType.FP32)
    sparse = data_type_to_sparse_type(value) if isinstance(value, DataType) else value
    if sparse not in TIERED_OUTPUT_DTYPES:
        raise ValueError(
            f"tiered table {table_name!r}: fused param 'output_dtype'={value!r} is not supported by tiered "
            f"tables: use one of {[t.name for t in TIERED_OUTPUT_DTYPES]} (SparseType) in the fused params of the "
            "sharder / the table's ParameterSharding, or plan this table as a torchrec FUSED table."
        )
    return sparse.as_dtype()


def _table_optimizer(fused_params: Optional[Dict[str, Any]], table_name: str) -> TieredOptimizerConfig:
    """:func:`tiered_optimizer_from_fused_params`, its errors naming the table."""
    try:
        return tiered_optimizer_from_fused_params(fused_params)
    except ValueError as e:
        raise ValueError(f"tiered table {table_name!r}: {e}") from None


def tiered_placement(table: ShardedEmbeddingTable) -> Tuple[PlacementParams, TieredOptimizerConfig]:
    """The validated placement of a tiered table and the optimizer it trains with.

    Args:
        table (ShardedEmbeddingTable): a CUSTOMIZED_KERNEL table (its fused params
            carry the placement and torchrec's fused optimizer).

    Returns:
        Tuple[PlacementParams, TieredOptimizerConfig]: the placement, and the
        optimizer (equal to the placement's).

    Raises:
        PlacementContractError: the placement keys are missing or invalid.
        PlacementMismatchError: the table's fused optimizer or dtype is not the
            one the placement was sized for.
    """
    params = PlacementParams.from_fused_params(table.fused_params, table.name)
    optimizer = _table_optimizer(table.fused_params, table.name)
    params.check_runtime(
        table.name,
        optimizer=optimizer.optimizer,
        dtype=data_type_to_dtype(table.data_type),
        dim=table.embedding_dim,
    )
    return params, optimizer


def tiered_vbe_error(where: str, table_features: Dict[str, List[str]], features: KeyedJaggedTensor) -> ValueError:
    """The error for a KJT with a variable batch size per feature (VBE) sent to pooled tiered tables.

    The tiered pooled kernel pools ``stride`` bags of every feature (one batch
    size), and torchrec hands a VBE KJT to several kernels of one lookup through
    ``vbe_output`` / ``vbe_output_offsets``, which the tiered kernel does not take.
    :class:`TieredShardedEmbeddingBagCollection` raises it from ``input_dist``
    (before any collective, so every rank given a VBE KJT raises it and none waits);
    :class:`TieredBatchedEmbeddingBag` raises it too when called directly.

    Args:
        where (str): the refusing call, e.g. ``"TieredShardedEmbeddingBagCollection.input_dist"``.
        table_features (Dict[str, List[str]]): tiered table name -> its feature names.
        features (KeyedJaggedTensor): the VBE KJT (its batch size per feature is
            read from host metadata: no device sync).

    Returns:
        ValueError: naming the tables, their features and the possible solutions.
    """
    strides = dict(zip(features.keys(), features.stride_per_key()))
    named = ", ".join(f"{t!r} (features {fs})" for t, fs in table_features.items())
    sizes = {f: strides[f] for fs in table_features.values() for f in fs if f in strides}
    return ValueError(
        f"{where}: features is a KeyedJaggedTensor with a variable batch size per feature (VBE, "
        f"stride_per_key_per_rank / inverse_indices; batch size per feature {sizes}), but tiered "
        f"tables (CUSTOMIZED_KERNEL) do not support VBE: {named}. Possible solutions:\n"
        "  1. pass a KeyedJaggedTensor with the same batch size for every feature (torchrec's "
        "non-VBE KJT, built without stride_per_key_per_rank / inverse_indices; e.g. expand each "
        "feature's bags to the full batch by its inverse_indices);\n"
        "  2. place these tables as torchrec FUSED tables with recpipe's row-wise sharding (a "
        "ROW_WISE ParameterSharding with compute_kernel 'fused', e.g. torchrec's "
        "sharding_plan.row_wise(), instead of the tiered placement; sharded by "
        "TieredEmbeddingBagCollectionSharder or RecpipeEmbeddingBagCollectionSharder), which "
        "route VBE KJTs."
    )


class TieredFusedOptimizer(TorchrecFusedOptimizer):
    """The fused optimizer of a tiered kernel group, as torchrec's ``EmbeddingFusedOptimizer``
    is of a FUSED one: the optimizer itself runs in the backward, and this
    ``KeyedOptimizer`` carries its learning rate.

    One param group per table (key ``<table>.weight``, prefixed by the sharded
    collection like torchrec's), whose ``lr`` starts at the table's fused
    ``learning_rate`` as fbgemm holds it (float32, what torchrec's FUSED groups start from, so
    a torch LR scheduler scales both alike). :meth:`step` and :meth:`zero_grad` push each group's
    ``lr`` into its shard (:meth:`TieredEmbeddingShard.set_learning_rate`), as
    torchrec's do into fbgemm's TBE, so an LR schedule on ``model.fused_optimizer``
    (e.g. torchrec's ``WarmupOptimizer``) reaches tiered tables at the same step
    as FUSED ones. Its ``state`` is empty: the rows' optimizer state moves with the
    rows and is checkpointed with them (``state_dict()`` / ``tiered_state()``).
    :meth:`set_optimizer_step` and :meth:`update_hyper_parameters` reach every table as
    torchrec's do fbgemm's TBE; a group's ``lr`` may be a 0-dim tensor, as there.

    Args:
        shards (Dict[str, TieredEmbeddingShard]): table name -> this rank's shard.

    Example::

        for group in model.fused_optimizer.param_groups:
            group["lr"] = 0.01
        model.fused_optimizer.step()  # the next backward updates with lr 0.01
    """

    def __init__(self, shards: Dict[str, TieredEmbeddingShard]) -> None:
        if not isinstance(shards, Mapping) or not all(isinstance(s, TieredEmbeddingShard) for s in shards.values()):
            got = (f"a dict of {sorted({type(s).__name__ for s in shards.values()})}" if isinstance(shards, Mapping)
                   else type(shards).__name__)
            raise ValueError(f"TieredFusedOptimizer: `shards` must be a dict of table name -> TieredEmbeddingShard, "
                             f"got {got}.")
        self._shards: List[TieredEmbeddingShard] = list(shards.values())
        # a key tensor per table: torchrec keys optimizer params (and their groups) by tensor
        keys = {f"{name}.weight": torch.empty(0) for name in shards}
        # fbgemm's float32 learning rate, as torchrec's FUSED groups start from its get_learning_rate():
        # an LR scheduler scales the groups' lr, so both must start from the same value
        groups = [{"params": [keys[f"{name}.weight"]],
                   "lr": float(torch.tensor(shard.optimizer.learning_rate, dtype=torch.float32))}
                  for name, shard in shards.items()]
        super().__init__(params=keys, state={}, param_groups=groups)

    def _push_learning_rates(self) -> None:
        for group, shard in zip(self.param_groups, self._shards):
            shard.set_learning_rate(group["lr"])

    def step(self, closure: Any = None) -> None:
        """Sets each table's learning rate from its param group (the update ran in backward)."""
        self._push_learning_rates()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Sets each table's learning rate from its param group (no gradients to zero)."""
        self._push_learning_rates()

    def set_optimizer_step(self, step: int) -> None:
        """Sets every table's optimizer step (:meth:`TieredEmbeddingShard.set_optimizer_step`),
        as torchrec's ``EmbeddingFusedOptimizer`` does in fbgemm's TBE
        (``CombinedOptimizer.set_optimizer_step`` reaches both), with fbgemm's semantics:
        after it, a fresh model's next update is step ``step + 1`` (Adam's bias correction).

        Args:
            step (int): the step, an int >= 0.

        Raises:
            ValueError: naming the table when ``step`` is not an int >= 0 (nothing is set).
        """
        for shard in self._shards:
            shard.set_optimizer_step(step)

    def update_hyper_parameters(self, params_dict: Dict[str, float]) -> None:
        """Sets hyper-parameters of every table's fused optimizer
        (:meth:`TieredEmbeddingShard.update_hyper_parameters`), as torchrec's fused
        optimizers do into fbgemm's TBE (``CombinedOptimizer.update_hyper_parameters``
        reaches both). As there, ``lr`` is not written into the param groups: their
        ``lr`` is set again by the next :meth:`step` / :meth:`zero_grad`.

        Args:
            params_dict (Dict[str, float]): ``lr``, ``eps``, ``beta1``, ``beta2``, ``weight_decay``.
        """
        for shard in self._shards:
            shard.update_hyper_parameters(params_dict)


class _TieredKernelBase(BaseEmbedding, FusedOptimizerModule):
    """A CUSTOMIZED_KERNEL group: one :class:`TieredEmbeddingShard` per table.

    Shared by the pooled (:class:`TieredBatchedEmbeddingBag`) and the sequence
    (:class:`TieredBatchedEmbedding`) kernels, which differ only in ``forward``.
    Its :attr:`fused_optimizer` (:class:`TieredFusedOptimizer`) joins the sharded
    collection's ``fused_optimizer``, as torchrec's FUSED kernels' do.

    Each shard runs the backend its table's fused params name
    (``FUSED_PARAM_BACKEND``, written from the sharder's ``backend=``), else the
    device's default (``native`` on CPU, ``fbgemm`` on CUDA).

    Args:
        config (GroupedEmbeddingConfig): the group's tables (all CUSTOMIZED_KERNEL).
        pg (dist.ProcessGroup | None): the sharding process group (rank, world size).
        device (torch.device | None): fast-tier device.
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self._config = config
        rank = dist.get_rank(pg) if pg is not None else 0
        world = dist.get_world_size(pg) if pg is not None else 1
        self.tables: nn.ModuleDict = nn.ModuleDict()
        self._feature_table: List[str] = []
        self._output_dtypes: Dict[str, torch.dtype] = {}
        for table in config.embedding_tables:
            params, optimizer = tiered_placement(table)
            self._output_dtypes[table.name] = tiered_output_dtype(table.fused_params, table.name)
            backend = _table_backend(table, device)
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
                weight_init_min=table.get_weight_init_min(),  # torchrec's fused kernels' init range
                weight_init_max=table.get_weight_init_max(),
                # fbgemm's rule for torchrec's FUSED tables: the fused param, default WARNING
                bounds_check_mode=bounds_check_mode_of(table.fused_params, table.name),
            )
            self.tables[table.name] = shard
            self._feature_table += [table.name] * table.num_features()
        self._fused_optimizer: TieredFusedOptimizer = TieredFusedOptimizer(
            {name: shard for name, shard in self.tables.items()}  # type: ignore[misc]
        )

    @property
    def fused_optimizer(self) -> TorchrecFusedOptimizer:
        """The group's :class:`TieredFusedOptimizer` (torchrec ``FusedOptimizerModule`` interface)."""
        return self._fused_optimizer

    def _shard_pooling(self, table: ShardedEmbeddingTable) -> str:
        """Pooling of the table's shard (``sum`` or ``mean``)."""
        raise NotImplementedError

    def _table_runs(self) -> Iterator[Tuple[str, int, int]]:
        """Yields ``(table, first feature, end feature)`` for each table's run of features."""
        f = 0
        n_features = len(self._feature_table)
        while f < n_features:
            name = self._feature_table[f]
            g = f
            while g < n_features and self._feature_table[g] == name:
                g += 1
            yield name, f, g
            f = g

    @property
    def config(self) -> GroupedEmbeddingConfig:
        """The group's config (torchrec ``BaseEmbedding`` interface)."""
        return self._config

    def state_dict(  # type: ignore[override]
        self,
        destination: Optional[Dict[str, Any]] = None,
        prefix: str = "",
        keep_vars: bool = False,
    ) -> Dict[str, Any]:
        """Adds nothing: torchrec skips CUSTOMIZED_KERNEL tables in its sharded
        ``state_dict`` (it maps every key to a ``<table>.weight``), so tiered tables
        are checkpointed through ``tiered_state()`` of the sharded module.

        Returns:
            Dict[str, Any]: ``destination`` unchanged (a new dict when None).
        """
        self.flush()
        return destination if destination is not None else {}

    def named_parameters_by_table(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Yields nothing: tiered rows are not ``nn.Parameter`` slices (the optimizer is
        fused into the backward and rows move between tiers).

        Returns:
            Iterator[Tuple[str, torch.Tensor]]: empty.
        """
        return iter(())

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load from a torchrec state dict (see :meth:`state_dict`)."""

    def flush(self) -> None:
        """Writes back every dirty cached row (torchrec calls it before ``state_dict``)."""
        for shard in self.tables.values():
            shard.flush()

    def purge(self) -> None:
        """No cached state to drop beyond a flush (torchrec interface)."""
        self.flush()

    def tier_stats(self) -> Dict[str, Dict[str, float]]:
        """Per-table statistics of the last step.

        Returns:
            Dict[str, Dict[str, float]]: table name -> ``TieredEmbeddingShard.tier_stats()``.
        """
        return {name: shard.tier_stats() for name, shard in self.tables.items()}


class TieredBatchedEmbeddingBag(_TieredKernelBase):
    """Pooled CUSTOMIZED_KERNEL group: one :class:`TieredEmbeddingShard` per table.

    Args:
        config (GroupedEmbeddingConfig): the group's tables (all CUSTOMIZED_KERNEL,
            pooling SUM or MEAN).
        pg (dist.ProcessGroup | None): the sharding process group (rank, world size).
        device (torch.device | None): fast-tier device.
        sharding_type (ShardingType | None): the group's sharding. Under ROW_WISE (the
            only sharding of tiered tables) a MEAN table pools with SUM here and
            torchrec's EBC divides by the bag lengths after the output all-to-all,
            as for its own TBEs (``pooling_type_to_pooling_mode``): each rank holds
            part of a bag, so a local mean would average partial sums.
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        sharding_type: Optional[ShardingType] = ShardingType.ROW_WISE,
    ) -> None:
        self._sharding_type = sharding_type  # read by _shard_pooling during super().__init__
        super().__init__(config, pg=pg, device=device)

    def _shard_pooling(self, table: ShardedEmbeddingTable) -> str:
        if table.pooling not in (PoolingType.SUM, PoolingType.MEAN):
            raise ValueError(f"table {table.name}: pooling {table.pooling} is not supported; use SUM or MEAN.")
        mode = pooling_type_to_pooling_mode(table.pooling, self._sharding_type)  # torchrec's rule
        return "sum" if mode == PoolingMode.SUM else "mean"

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """Pooled lookups of the group's features, concatenated in feature order.

        Args:
            features (KeyedJaggedTensor): local ids of this group's features (one key
                per feature, every rank's bags, ``stride`` bags per key).

        Returns:
            torch.Tensor: ``[stride, sum of dims]``.

        Raises:
            ValueError: ``features`` has a variable batch size per feature (VBE), see
                :func:`tiered_vbe_error` (the sharded EBC refuses it before its input dist).
        """
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
            pooled = self.tables[name](values[lo:hi], offsets[f * B:g * B + 1] - lo, psw)  # [(g - f) * B, D]
            pooled = pooled.to(self._output_dtypes[name])  # fused param output_dtype, as fbgemm's TBE
            D = pooled.shape[-1]  # explicit: an empty batch (B = 0) leaves no -1 to infer
            outs.append(pooled.view(g - f, B, D).transpose(0, 1).reshape(B, (g - f) * D))  # feature-major columns
        return torch.cat(outs, dim=1)


class TieredBatchedEmbedding(_TieredKernelBase):
    """Sequence (unpooled) CUSTOMIZED_KERNEL group: one :class:`TieredEmbeddingShard` per table.

    Each id is a bag of its own (offsets ``0, 1, ..., n``, sum pooling), so the
    output row of an id is its stored row, bit for bit, and the fused backward
    sums the gradients of an id's occurrences per unique row. KJT weights are
    ignored, as by torchrec's FUSED sequence kernel.

    Args:
        config (GroupedEmbeddingConfig): the group's tables (all CUSTOMIZED_KERNEL,
            one embedding dim for the whole group, as torchrec's sequence sharding requires).
        pg (dist.ProcessGroup | None): the sharding process group (rank, world size).
        device (torch.device | None): fast-tier device.

    Example::

        kernel = TieredBatchedEmbedding(grouped_config, pg=pg)
        rows = kernel(local_kjt)   # [len(local_kjt.values()), dim]
    """

    def _shard_pooling(self, table: ShardedEmbeddingTable) -> str:
        return "sum"  # one id per bag: the sum is the row itself

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """One embedding row per id of the group's features, in ``values()`` order.

        Args:
            features (KeyedJaggedTensor): local ids of this group's features.

        Returns:
            torch.Tensor: ``[len(features.values()), dim]``.
        """
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


def _resolve_tiered_fused_params(
    sharding_infos: List[EmbeddingShardingInfo],
    routing: Optional[RoutingOverrides],
    backend: Optional[str] = None,
) -> None:
    """Completes each tiered table's placement in its fused params (in place).

    Routing: the table's own ``recpipe_dist_type`` / ``recpipe_seed``, else the
    sharder's ``RoutingOverrides``, else ``hash_roundrobin`` with seed 0. Optimizer
    and dtype: a hand-written ``PlacementParameterSharding`` that names none was not
    sized for one, so the table's own fused optimizer and dtype are written in;
    a placement that names them keeps them (the kernel then checks the model agrees).
    Backend: the table's own ``FUSED_PARAM_BACKEND``, else the sharder's ``backend``
    (None writes nothing: the device's default). Only tiered tables keep the key: it is
    removed from other tables' fused params (e.g. given in the sharder's ``fused_params``),
    as fbgemm's FUSED TBEs would refuse it.
    """
    for info in sharding_infos:
        if info.param_sharding.compute_kernel != EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value:
            if info.fused_params and FUSED_PARAM_BACKEND in info.fused_params:
                # a sharder-wide fused param meant for the tiered tables: fbgemm's TBE refuses it
                info.fused_params = {k: v for k, v in info.fused_params.items() if k != FUSED_PARAM_BACKEND}
            continue
        fp = dict(info.fused_params or {})
        name = info.embedding_config.name
        if FUSED_PARAM_DIST_TYPE not in fp:
            if routing is not None and name in routing.table_dist_types:
                fp[FUSED_PARAM_DIST_TYPE] = routing.table_dist_types[name].value
                fp.setdefault(FUSED_PARAM_SEED, routing.seed)
            else:
                fp[FUSED_PARAM_DIST_TYPE] = DistType.HASH_ROUNDROBIN.value
        fp.setdefault(FUSED_PARAM_SEED, 0)
        if FUSED_PARAM_OPTIMIZER not in fp:
            fp[FUSED_PARAM_OPTIMIZER] = _table_optimizer(fp, name).name
        if FUSED_PARAM_DTYPE not in fp:
            fp[FUSED_PARAM_DTYPE] = dtype_name(data_type_to_dtype(info.embedding_config.data_type))
        if backend is not None:
            fp.setdefault(FUSED_PARAM_BACKEND, backend)
        info.fused_params = fp


def _table_backend(table: ShardedEmbeddingTable, device: Optional[torch.device]) -> Optional[str]:
    """The tiered table's backend from its fused params (``FUSED_PARAM_BACKEND``; absent or
    None: the device's default), validated for ``device``.

    Args:
        table (ShardedEmbeddingTable): a CUSTOMIZED_KERNEL table.
        device (Optional[torch.device]): the kernel's device (None: CPU).

    Returns:
        Optional[str]: the backend, or None for the device's default.

    Raises:
        ValueError: naming the table, the fused param, its value and the fix, for a backend
            that is unknown or cannot run on ``device``.
    """
    backend = (table.fused_params or {}).get(FUSED_PARAM_BACKEND)
    try:
        resolve_backend(backend, device if device is not None else torch.device("cpu"))
    except ValueError as e:
        raise ValueError(
            f"tiered table {table.name!r}: fused param {FUSED_PARAM_BACKEND!r}={backend!r} is refused: {e} Set the "
            f"backend with the tiered sharders' backend= argument (e.g. TieredEmbeddingBagCollectionSharder("
            f"backend='fbgemm')), or fix or remove {FUSED_PARAM_BACKEND!r} in the fused params of the sharder / "
            "the table's ParameterSharding."
        ) from None
    return backend


class _TieredGroupedPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """torchrec's grouped lookup; CUSTOMIZED_KERNEL groups get the tiered kernel."""

    def _create_embedding_kernel(  # type: ignore[override]
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


class _TieredGroupedEmbeddingsLookup(GroupedEmbeddingsLookup):
    """torchrec's grouped sequence lookup; CUSTOMIZED_KERNEL groups get the tiered kernel."""

    def _create_embedding_kernel(  # type: ignore[override]
        self,
        config: GroupedEmbeddingConfig,
        pg: Optional[dist.ProcessGroup],
        device: Optional[torch.device],
        env: Optional[ShardingEnv] = None,
    ) -> BaseEmbedding:
        if config.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return TieredBatchedEmbedding(config=config, pg=pg, device=device)
        return super()._create_embedding_kernel(config, pg, device, env)


class _TieredRoutingMixin:
    """Completes the placement of tiered tables before the row-wise sharding is built.

    The routing of a tiered table is resolved once, here, and written into its
    fused params so the input dist (``recpipe.pipeline.routing.sharding.feature_routing``)
    and the tiered kernel agree: the table's own ``recpipe_dist_type`` /
    ``recpipe_seed``, else the sharder's ``RoutingOverrides``, else
    ``hash_roundrobin`` with seed 0 (recpipe's default for its tables). See
    :func:`_resolve_tiered_fused_params` for the optimizer, dtype and backend
    (``_backend``: the sharder's, set on a per-sharder subclass by
    ``_TieredTablesMixin.with_backend``).
    """

    _backend: ClassVar[Optional[str]] = None

    def __init__(
        self,
        sharding_infos: List[EmbeddingShardingInfo],
        *args: Any,
        routing: Optional[RoutingOverrides] = None,
        **kwargs: Any,
    ) -> None:
        _resolve_tiered_fused_params(sharding_infos, routing, self._backend)
        super().__init__(sharding_infos, *args, routing=routing, **kwargs)  # type: ignore[call-arg]


class TieredRwPooledEmbeddingSharding(_TieredRoutingMixin, RecpipeRwPooledEmbeddingSharding):
    """recpipe's routed row-wise pooled sharding whose CUSTOMIZED_KERNEL tables are tiered.

    Args: as ``RecpipeRwPooledEmbeddingSharding``; routing as :class:`_TieredRoutingMixin`.
    """

    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> BaseEmbeddingLookup:
        return _TieredGroupedPooledEmbeddingsLookup(
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            feature_processor=feature_processor,
            sharding_type=ShardingType.ROW_WISE,
            env=self._env,
        )


class TieredRwSequenceEmbeddingSharding(_TieredRoutingMixin, RecpipeRwSequenceEmbeddingSharding):
    """recpipe's routed row-wise sequence sharding whose CUSTOMIZED_KERNEL tables are tiered.

    Args: as ``RecpipeRwSequenceEmbeddingSharding``; routing as :class:`_TieredRoutingMixin`.
    """

    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> BaseEmbeddingLookup:
        return _TieredGroupedEmbeddingsLookup(
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            env=self._env,
        )


#: state_dict key infix of a tiered table's rows: ``<collection>.<table>.tiered.<field>``.
TIERED_STATE_KEY = "tiered"
_TIERED_FIELDS = ("global_ids", "weights", "optimizer_state", "step", "_extra_state")


class _TieredTablesMixin:
    """Access to the tiered shards of a sharded module's lookups (EBC and EC).

    Also makes ``state_dict()`` carry every tiered table's rows, so a plain
    ``model.state_dict()`` checkpoint never loses them (torchrec's sharded
    state_dict skips CUSTOMIZED_KERNEL tables): for each table this rank's export
    (global row ids, values, optimizer state, step, routing/placement metadata)
    appears under ``<collection>.<table>.tiered.<field>``; ``load_state_dict``
    consumes those keys and loads the rows, validating the metadata (another
    world size needs every rank's export: :meth:`load_tiered_state`).
    """

    _lookups: List[nn.Module]
    _TIERED_COLLECTION: str = "embedding_bags"
    _ROW_WISE_SHARDING: ClassVar[type]

    @classmethod
    def with_backend(cls, backend: str) -> type:
        """A subclass whose tiered tables run ``backend`` (the sharders' ``backend=``;
        see ``recpipe.pipeline.tiered.shard.TieredEmbeddingShard``), as ``with_routing``
        carries the sharder's routing."""
        sharding = type(cls._ROW_WISE_SHARDING.__name__, (cls._ROW_WISE_SHARDING,), {"_backend": backend})
        return type(cls.__name__, (cls,), {"_ROW_WISE_SHARDING": sharding})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        # set by state_dict_without_tiered_rows(): collects the state_dict prefix instead of rows
        self._tiered_state_dict_sink: Optional[Dict[str, "_TieredTablesMixin"]] = None
        self._register_state_dict_hook(_TieredTablesMixin._tiered_post_state_dict_hook)  # type: ignore[attr-defined]

    @staticmethod
    def _tiered_post_state_dict_hook(
        module: "_TieredTablesMixin", destination: Dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        if module._tiered_state_dict_sink is not None:
            module._tiered_state_dict_sink[prefix] = module
            return
        for name, shard in module.tiered_tables().items():
            st = shard.export_state()
            base = f"{prefix}{module._TIERED_COLLECTION}.{name}.{TIERED_STATE_KEY}."
            destination[base + "global_ids"] = st.global_ids
            destination[base + "weights"] = st.weights
            destination[base + "optimizer_state"] = st.optimizer_state
            destination[base + "step"] = torch.tensor(st.step, dtype=torch.int64)
            destination[base + "_extra_state"] = st.metadata

    def _tiered_names(self) -> List[str]:
        """Tables of this module planned with the tiered (CUSTOMIZED_KERNEL) kernel."""
        plan = self.module_sharding_plan  # type: ignore[attr-defined]
        return [name for name, ps in plan.items()
                if ps.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value]

    def reset_parameters(self) -> None:
        """torchrec's init for its own tables; tiered tables initialize themselves.

        Like torchrec does for tables without a shard on this rank, a tiered table
        gets an empty ``weight`` placeholder with an ``EmptyFusedOptimizer``.
        """
        collection = getattr(self, self._TIERED_COLLECTION)
        for name in self._tiered_names():
            holder = collection[name]
            if not hasattr(holder, "weight"):
                placeholder = nn.Parameter(torch.empty(0))
                placeholder._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
                holder.register_parameter("weight", placeholder)
        super().reset_parameters()  # type: ignore[misc]

    @staticmethod
    def _pre_load_state_dict_hook(
        self: "_TieredTablesMixin",
        state_dict: Dict[str, Any],
        prefix: str,
        *args: Any,
    ) -> None:
        """Loads tiered rows from ``state_dict``, then runs torchrec's hook.

        Consumes the ``...tiered.*`` export entries (:meth:`_load_tiered_entries`)
        and full ``[num_embeddings, dim]`` weights (:func:`_load_full_tiered_weights`),
        after :meth:`_check_entries_fit_tables` refused (before any table changed) entries
        that a table's kernel cannot load.
        """
        self._check_entries_fit_tables(state_dict, prefix)
        self._load_tiered_entries(state_dict, prefix)
        _load_full_tiered_weights(
            self, state_dict, f"{prefix}{self._TIERED_COLLECTION}.", self._tiered_names()
        )
        # the next class's hook in the MRO (torchrec's ShardedEmbedding[Bag]Collection)
        super(_TieredTablesMixin, type(self))._pre_load_state_dict_hook(  # type: ignore[misc]
            self, state_dict, prefix, *args
        )

    def _check_entries_fit_tables(self, state_dict: Dict[str, Any], prefix: str) -> None:
        """Refuses, naming the table and the fixes, the state dict entries of a table saved
        under the other kernel (users migrating checkpoints between torchrec's FUSED tables and
        tiered ones), before any table is loaded:

        * a tiered table given a ``ShardedTensor`` / ``DTensor`` ``weight`` (a FUSED table's
          shards: this rank holds a contiguous row range, the tiered shard hash-routed rows);
        * a table that is not tiered here given a tiered export (``<table>.tiered.*``) or the
          tiered tables' empty ``weight`` placeholder, which torchrec's hook failed on with
          ``IndexError: too many indices for tensor of dimension 1`` (the export holds this
          rank's hash-routed rows, not the table's shard).

        Args:
            state_dict (Dict[str, Any]): the state dict being loaded.
            prefix (str): this module's key prefix in it.

        Raises:
            ValueError: naming the table, the entries and the possible solutions.
        """
        tiered = set(self._tiered_names())
        plan = self.module_sharding_plan  # type: ignore[attr-defined]
        collection = f"{prefix}{self._TIERED_COLLECTION}."
        for name in (n for n in plan if n in tiered):  # plan order: every rank names the same table
            key = f"{collection}{name}.weight"
            if isinstance(state_dict.get(key), (ShardedTensor, DTensor)):
                raise ValueError(_sharded_weight_error(key, name, state_dict[key]))
        local = getattr(self, "_model_parallel_name_to_local_shards", {})
        wrappers = getattr(self, "_model_parallel_name_to_shards_wrapper", {})
        for name, ps in plan.items():
            if name in tiered:
                continue
            key = f"{collection}{name}.weight"
            base = f"{collection}{name}.{TIERED_STATE_KEY}."
            exported = sorted(k for k in state_dict if k.startswith(base))
            value = state_dict.get(key)
            has_shard = bool(local.get(name)) or bool((wrappers.get(name) or {}).get("local_tensors"))
            placeholder = (isinstance(value, torch.Tensor) and not isinstance(value, (ShardedTensor, DTensor))
                           and value.dim() != 2 and has_shard)
            if not exported and not placeholder:
                continue
            found = (f"its tiered export {exported}" if exported else "") + (" and " if exported and placeholder
                                                                              else "")
            found += f"the tiered tables' empty placeholder {key} (shape {list(value.shape)})" if placeholder else ""
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: table {name!r} is planned {ps.sharding_type} "
                f"{ps.compute_kernel} (not tiered) in this model, but the state dict holds it as a tiered model "
                f"saved it: {found}. A tiered export is one rank's hash-routed rows (global ids, values, "
                f"optimizer state), not this table's {ps.sharding_type} shard, so it cannot be loaded here. "
                "Possible solutions:\n"
                f"  1. load it into a model that plans {name!r} as it was saved (a tiered placement, "
                "compute_kernel 'customized_kernel');\n"
                "  2. move the saved rows as a full table: full = recpipe.pipeline.tiered.sharders.gather_full_weights("
                "<the saving (tiered) model>) on every rank, then pass the state dict with full["
                f"{key!r}] instead of the tiered entries (the table's optimizer state then starts from zero: "
                "migrate it with opt = gather_full_optimizer_state(<the saving model>) on every rank, then "
                "load_full_optimizer_state(<this model>, opt) after the weights)."
            )

    def _load_tiered_entries(self, state_dict: Dict[str, Any], prefix: str) -> None:
        """Loads and removes the ``...tiered.*`` entries written by the state_dict hook."""
        tables = self.tiered_tables()
        for name, shard in tables.items():
            base = f"{prefix}{self._TIERED_COLLECTION}.{name}.{TIERED_STATE_KEY}."
            present = [f for f in _TIERED_FIELDS if base + f in state_dict]
            if not present:
                continue
            if len(present) != len(_TIERED_FIELDS):
                absent = [base + f for f in _TIERED_FIELDS if f not in present]
                raise ValueError(
                    f"tiered table {name!r}: state_dict has {sorted(base + f for f in present)} but not "
                    f"{absent}; pass the complete export written by state_dict()."
                )
            shard.load_states([
                TieredShardState(
                    global_ids=state_dict.pop(base + "global_ids"),
                    weights=state_dict.pop(base + "weights"),
                    optimizer_state=state_dict.pop(base + "optimizer_state"),
                    step=int(state_dict.pop(base + "step")),
                    metadata=dict(state_dict.pop(base + "_extra_state")),
                )
            ])

    def tiered_tables(self) -> Dict[str, TieredEmbeddingShard]:
        """This rank's tiered shards by table name (for stats, init and checkpoints).

        Returns:
            Dict[str, TieredEmbeddingShard]: table name -> shard.
        """
        out: Dict[str, TieredEmbeddingShard] = {}
        for lookup in self._lookups:
            while hasattr(lookup, "module") and not isinstance(lookup, BaseEmbeddingLookup):
                lookup = lookup.module
            for module in lookup.modules():
                if isinstance(module, _TieredKernelBase):
                    out.update({name: shard for name, shard in module.tables.items()})  # type: ignore[misc]
        return out

    def tier_stats(self) -> Dict[str, Dict[str, float]]:
        """Per-table statistics of this rank's tiered shards (last step).

        Returns:
            Dict[str, Dict[str, float]]: table name -> ``TieredEmbeddingShard.tier_stats()``
            (recipes log them as ``tier/<table>/<stat>``).
        """
        return {name: shard.tier_stats() for name, shard in self.tiered_tables().items()}

    def tiered_state(self) -> Dict[str, TieredShardState]:
        """Exports every tiered table of this rank (global ids, values, optimizer state).

        Returns:
            Dict[str, TieredShardState]: table name -> export; gather them over ranks
            and pass each table's list to :meth:`load_tiered_state` of any world size.
        """
        return {name: shard.export_state() for name, shard in self.tiered_tables().items()}

    def load_tiered_state(self, states: Dict[str, Sequence[TieredShardState]]) -> None:
        """Loads (and reshards) tiered tables from the exports of every saving rank.

        Args:
            states (Dict[str, Sequence[TieredShardState]]): table name -> exports.
        """
        tables = self.tiered_tables()
        missing = sorted(set(tables) - set(states))
        if missing:
            raise ValueError(f"load_tiered_state: no exports for tiered tables {missing}; pass every table.")
        for name, shard in tables.items():
            shard.load_states(states[name])


class TieredShardedEmbeddingBagCollection(_TieredTablesMixin, RecpipeShardedEmbeddingBagCollection):
    """recpipe's routed ``ShardedEmbeddingBagCollection`` with tiered CUSTOMIZED_KERNEL tables.

    A KJT with a variable batch size per feature (VBE) is refused by :meth:`input_dist`
    when the collection has tiered tables (:func:`tiered_vbe_error`); its other tables
    alone route VBE KJTs as recpipe's row-wise sharding does.
    """

    _ROW_WISE_SHARDING = TieredRwPooledEmbeddingSharding

    def input_dist(self, ctx: Any, features: Any) -> Any:
        """torchrec's input dist, after refusing VBE KJTs for tiered tables.

        Every caller reaches the lookup through here (``forward``, torchrec's and
        recpipe's pipelines), and nothing before this point communicates: a rank
        given a VBE KJT raises before its first collective.

        Args:
            ctx (EmbeddingBagCollectionContext): the step's context.
            features (KeyedJaggedTensor | TensorDict): the collection's input features.

        Returns:
            Awaitable[Awaitable[KJTList]]: as ``ShardedEmbeddingBagCollection.input_dist``.

        Raises:
            ValueError: ``features`` is a VBE KJT and the collection has tiered tables.
        """
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
    """The refusal of a ``ShardedTensor`` / ``DTensor`` weight (e.g. a torchrec FUSED table's
    ``state_dict()``) given to tiered table ``name``, with the possible solutions."""
    return (
        f"{key}: tiered table {name!r} cannot load a {type(value).__name__} (e.g. the state_dict() of a model "
        "whose table is a torchrec FUSED table): this rank holds a contiguous range of its rows, while the "
        "tiered shard owns hash-routed rows held by every rank. Possible solutions:\n"
        "  1. pass the full [num_embeddings, dim] tensor: full = recpipe.pipeline.tiered.sharders.gather_full_weights("
        f"<the saving model>) on every rank, then load_state_dict(full, strict=False) (the table's "
        "optimizer state then starts from zero: FUSED tables keep it in fused_optimizer.state_dict(), which tiered "
        "tables do not load; migrate it with opt = recpipe.pipeline.tiered.sharders.gather_full_optimizer_state(<the "
        "saving model>) on every rank, then load_full_optimizer_state(<this model>, opt) after the weights);\n"
        "  2. load the state_dict() (or tiered_state() exports, with load_tiered_state()) of a model that planned "
        "the table tiered."
    )


def _load_full_tiered_weights(
    module: Any, state_dict: Dict[str, Any], key_prefix: str, tiered_names: List[str]
) -> None:
    """Loads full ``[num_embeddings, dim]`` weights of tiered tables from ``state_dict``.

    A tiered table's ``<key_prefix><table>.weight`` that is a full tensor (an
    unsharded module's state, e.g. pretrained weights) is loaded into the tiered
    shard (rows picked by global id, whatever the routing) and replaced by the
    empty placeholder, so torchrec's own hook and the strict key check see what
    they expect; an empty tensor (the sharded ``state_dict`` of a tiered table) is
    left alone. Sharded inputs were refused before any table loaded
    (:meth:`_TieredTablesMixin._check_entries_fit_tables`).
    """
    tiered = module.tiered_tables()
    for name in tiered_names:
        key = f"{key_prefix}{name}.weight"
        if key not in state_dict or name not in tiered:
            continue
        value = state_dict[key]
        if value.numel() == 0:
            continue
        tiered[name].load_global_weights(value.detach())
        state_dict[key] = torch.empty(0)


class _TieredSharderMixin:
    """Offers the tiered CUSTOMIZED_KERNEL for ROW_WISE tables and refuses it elsewhere.

    Args:
        *args: as the recpipe sharder.
        backend (Optional[str]): keyword-only. The tiered shards' kernel: ``native``
            (recpipe's compiled CPU kernel), ``fbgemm`` (fbgemm's TBE; on CPU as
            fbgemm HOST tables without a cache), ``torch`` (device-generic torch ops),
            or None (default): the device's (``native`` on CPU, ``fbgemm`` on CUDA,
            ``torch`` elsewhere). Carried to the kernel in the tiered tables' fused
            params (``recpipe.pipeline.placement.FUSED_PARAM_BACKEND``).
        **kwargs: as the recpipe sharder.

    Raises:
        ValueError: ``backend`` is not one of those (here), or cannot run on the
            device the module is sharded to (in :meth:`shard`).
    """

    _SHARDED_MODULE: Any

    def __init__(self, *args: Any, backend: Optional[str] = None, **kwargs: Any) -> None:
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"{type(self).__name__}: backend must be one of {list(BACKENDS)} or None (the "
                             f"device's default), got {backend!r}.")
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._backend: Optional[str] = backend
        if backend is not None:  # shard() builds this class (the base sharder reads _SHARDED_MODULE)
            self._SHARDED_MODULE = type(self)._SHARDED_MODULE.with_backend(backend)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        kernels: List[str] = super().compute_kernels(sharding_type, compute_device_type)  # type: ignore[misc]
        if sharding_type == ShardingType.ROW_WISE.value:
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
        return super().shard(module, params, env, device, module_fqn)  # type: ignore[misc]

    @property
    def sharded_module_type(self) -> type:
        return type(self)._SHARDED_MODULE


class TieredEmbeddingBagCollectionSharder(_TieredSharderMixin, RecpipeEmbeddingBagCollectionSharder):
    """recpipe's EBC sharder (ROW_WISE on CPU and CUDA, routed by recpipe's op) whose
    CUSTOMIZED_KERNEL row-wise tables run the tiered kernel.

    Args: as ``recpipe.pipeline.routing.sharding.RecpipeEmbeddingBagCollectionSharder``, plus
        ``backend`` (keyword-only, see :class:`_TieredSharderMixin`).

    Example::

        plan = PlacementPlanner(topology).plan(model).to_sharding_plan()  # recpipe.planner
        model = DistributedModelParallel(model, plan=plan,
                                         sharders=[TieredEmbeddingBagCollectionSharder()])
    """

    _SHARDED_MODULE = TieredShardedEmbeddingBagCollection


def _check_tiered_params(params: Dict[str, ParameterSharding]) -> None:
    for name, ps in params.items():
        if (ps.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
                and ps.sharding_type != ShardingType.ROW_WISE.value):
            raise ValueError(
                f"table {name}: CUSTOMIZED_KERNEL (tiered) needs sharding_type row_wise, got "
                f"{ps.sharding_type}; build the plan with recpipe.planner (PlacementPlan.to_sharding_plan())."
            )


class TieredShardedEmbeddingCollection(_TieredTablesMixin, RecpipeShardedEmbeddingCollection):
    """recpipe's routed ``ShardedEmbeddingCollection`` with tiered CUSTOMIZED_KERNEL tables.

    Tiered tables get an empty ``weight`` placeholder (torchrec skips
    CUSTOMIZED_KERNEL tables in its sharded ``state_dict``); loading a state dict
    that holds a table's full ``[num_embeddings, dim]`` weight (the unsharded
    module's, as torchrec does when sharding) sets the tiered rows from it and
    zeroes their optimizer state. Checkpoint tiered tables with
    :meth:`tiered_state` / :meth:`load_tiered_state`.
    """

    _TIERED_COLLECTION = "embeddings"
    _ROW_WISE_SHARDING = TieredRwSequenceEmbeddingSharding


class TieredEmbeddingCollectionSharder(_TieredSharderMixin, RecpipeEmbeddingCollectionSharder):
    """recpipe's EC sharder (ROW_WISE on CPU and CUDA, routed by recpipe's op) whose
    CUSTOMIZED_KERNEL row-wise tables run the tiered sequence kernel.

    Args: as ``recpipe.pipeline.routing.sharding.RecpipeEmbeddingCollectionSharder``, plus
        ``backend`` (keyword-only, see :class:`_TieredSharderMixin`).

    Example::

        # a CPU run: size the tables in the layout the CPU kernel runs (backend="native")
        plan = PlacementPlanner(topology, backend="native").plan(ec).to_sharding_plan(compute_device="cpu")
        model = DistributedModelParallel(ec, plan=plan, device=torch.device("cpu"),
                                         sharders=[TieredEmbeddingCollectionSharder()])
        model.module.tier_stats()
    """

    _SHARDED_MODULE = TieredShardedEmbeddingCollection


@contextmanager
def state_dict_without_tiered_rows(model: nn.Module) -> Iterator[Dict[str, "_TieredTablesMixin"]]:
    """While active, ``model.state_dict()`` leaves the tiered tables' rows out.

    Instead of exporting its tiered rows, every sharded collection with tiered
    tables records the prefix its entries take in the state dict (DMP strips its
    own wrapper prefix, so a module's prefix is only known from a ``state_dict()``
    call). Checkpoint formats that store tiered rows their own way (e.g.
    :mod:`recpipe.pipeline.checkpoint.dcp`) use it.

    Args:
        model (nn.Module): the (DMP-wrapped) model.

    Yields:
        Dict[str, _TieredTablesMixin]: ``{state_dict prefix: sharded collection}``,
        filled by the ``state_dict()`` calls made inside the block.

    Example::

        with state_dict_without_tiered_rows(model) as tiered:
            state = model.state_dict()
    """
    found: Dict[str, _TieredTablesMixin] = {}
    modules = [m for m in model.modules() if isinstance(m, _TieredTablesMixin)]
    for m in modules:
        m._tiered_state_dict_sink = found
    try:
        yield found
    finally:
        for m in modules:
            m._tiered_state_dict_sink = None


def gather_full_weights(
    model: nn.Module, *, process_group: Optional[dist.ProcessGroup] = None
) -> Dict[str, torch.Tensor]:
    """Every sharded embedding table of ``model`` as one full tensor in global row order.

    The way to move tables between layouts that their sharded ``state_dict()`` cannot
    cross: another world size or routing of a roundrobin / hash_roundrobin FUSED table
    (whose shards hold routed rows, see ``recpipe.pipeline.routing.sharding.RowOrder``), tiered
    <-> torchrec tables, or an unsharded module. ``model.load_state_dict(full,
    strict=False)`` then loads each table by global row id into any of them (torchrec
    slices a full tensor by its shards' offsets; recpipe's routed and tiered tables pick
    their own rows). Optimizer state is not included: migrate it with
    :func:`gather_full_optimizer_state` / :func:`load_full_optimizer_state` (after the weights).

    Collective over ``process_group``: every rank calls it and gets every table
    (``[num_embeddings, dim]`` on CPU each, so it needs that much host memory): each rank
    writes its rows (ShardedTensor local shards at their offsets, or at their routed
    global ids; tiered exports at their global ids) into zeros, then the tensors are
    summed over ranks (exact: every row has one owner; a ``-0.0`` comes back ``0.0``).

    Args:
        model (nn.Module): the (DMP-wrapped) sharded model.
        process_group (dist.ProcessGroup | None): the group the tables are sharded over
            (default: the world, when torch.distributed is initialized).

    Returns:
        Dict[str, torch.Tensor]: ``{<collection>.<table>.weight key of model.state_dict():
        full table}``; tables that are plain tensors already (data-parallel) are left out.

    Raises:
        ValueError: a DTensor weight of a routed table (torchrec's DTensor state_dict
            option): use its ShardedTensor state_dict.

    Example::

        full = gather_full_weights(model)          # every rank, in the saving job's sharding
        other_model.load_state_dict(full, strict=False)
    """
    state = model.state_dict()
    tiered_suffix = f".{TIERED_STATE_KEY}.global_ids"
    full: Dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(tiered_suffix):
            base = key[: -len(tiered_suffix)]
            md = state[f"{base}.{TIERED_STATE_KEY}._extra_state"]
            weights = state[f"{base}.{TIERED_STATE_KEY}.weights"]
            out = torch.zeros(int(md["num_embeddings"]), int(md["embedding_dim"]), dtype=weights.dtype)
            out[value.cpu()] = weights.cpu()
            full[f"{base}.weight"] = out
        elif not key.endswith(".weight") or not isinstance(value, (ShardedTensor, DTensor)):
            continue
        else:
            order = _row_order(state, key[: -len(".weight")])
            if isinstance(value, DTensor):
                if order is not None:
                    raise ValueError(f"gather_full_weights: {key} is a DTensor of a routed table; gather the "
                                     "model's ShardedTensor state_dict (torchrec's default) instead.")
                full[key] = value.full_tensor().cpu()
                continue
            out = torch.zeros(tuple(value.size()), dtype=value.dtype)
            for shard in value.local_shards():
                t = shard.tensor.detach().cpu()
                c0 = shard.metadata.shard_offsets[1]
                out[_shard_global_rows(shard.metadata, t.shape[0], order), c0:c0 + t.shape[1]] = t
            full[key] = out
    if dist.is_initialized():
        for key in sorted(full):  # same order on every rank (DTensors are complete already)
            if not isinstance(state.get(key), DTensor):
                full[key] = _all_reduce_cpu(full[key], dist.ReduceOp.SUM, process_group)
    return full


def _row_order(state: Mapping[str, Any], base: str) -> Optional[RowOrder]:
    """The ``RowOrder`` recorded beside routed FUSED table ``base``'s weight in ``state``
    (None: its shards hold contiguous rows at their offsets)."""
    record = state.get(f"{base}.{ROW_ORDER_KEY}")
    return RowOrder(*(record[f] for f in RowOrder._fields)) if record is not None else None


def _shard_global_rows(metadata: Any, rows: int, order: Optional[RowOrder]) -> Any:
    """The global rows of a ShardedTensor shard of ``rows`` rows (its ``ShardMetadata``):
    its routed global ids (``order``), else the contiguous range at its row offset."""
    if order is not None:
        return order.global_ids(metadata.placement.rank())
    r0 = int(metadata.shard_offsets[0])
    return slice(r0, r0 + rows)


def _all_reduce_cpu(t: torch.Tensor, op: Any, process_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``t`` all-reduced over ``process_group`` (through CUDA for nccl), on CPU."""
    out = t.cuda() if dist.get_backend(process_group) == "nccl" else t
    dist.all_reduce(out, op=op, group=process_group)
    return out.cpu()


#: torchrec's names of a table's fused optimizer state (``EmbeddingFusedOptimizer``: fbgemm's
#: first state is named ``momentum1``, the others keep fbgemm's ``get_optimizer_state()`` names),
#: per optimizer a migration carries; each entry of :func:`gather_full_optimizer_state` is
#: ``<table>.<name>``, plus :data:`OPTIMIZER_STEP_KEY`.
OPTIMIZER_STATE_NAMES: Dict[FusedOptimizer, Tuple[str, ...]] = {
    FusedOptimizer.SGD: (),
    FusedOptimizer.ROWWISE_ADAGRAD: ("momentum1",),
    FusedOptimizer.ADAM: ("momentum1", "exp_avg_sq"),
}
#: The entry of a table's :func:`gather_full_optimizer_state` holding its optimizer step (fbgemm's
#: ``iter``, a tiered table's ``step``): a 0-dim int64 tensor.
OPTIMIZER_STEP_KEY = "step"


class _OptTable(NamedTuple):
    """A table's fused optimizer as the migration sees it: ``optimizer`` is a
    :class:`FusedOptimizer` value the migration carries, else a description of another."""

    optimizer: str
    rows: int
    dim: int


def _state_shapes(table: str, desc: _OptTable) -> Dict[str, Tuple[int, ...]]:
    """torchrec's name -> full shape of each optimizer state of ``table``."""
    opt = FusedOptimizer(desc.optimizer)
    row = opt is FusedOptimizer.ROWWISE_ADAGRAD  # one momentum per row; Adam: one per element
    return {f"{table}.{n}": (desc.rows,) if row else (desc.rows, desc.dim) for n in OPTIMIZER_STATE_NAMES[opt]}


def _fused_leaf_optimizer(leaf: Any) -> str:
    """The optimizer of a torchrec fused optimizer (``EmbeddingFusedOptimizer``: its fbgemm TBE's)."""
    tbe = getattr(leaf, "_emb_module", None)
    opt = getattr(tbe, "optimizer", None)
    if opt is None:
        return f"the fused optimizer of a {type(leaf).__name__} (not an fbgemm TBE's)"
    if getattr(tbe, "use_rowwise_bias_correction", False):
        return "adam with use_rowwise_bias_correction"
    try:
        parsed = FusedOptimizer.parse(opt)
    except ValueError:
        return str(getattr(opt, "name", opt)).lower()
    return parsed.value


def _optimizer_tables(model: nn.Module) -> Dict[str, Tuple[Any, ...]]:
    """This rank's embedding tables with a fused optimizer, by ``<collection>.<table>`` key (the
    ``.weight`` key of ``model.state_dict()`` without ``.weight``), from ``model.fused_optimizer``:
    ``("tiered", shard)``, ``("fused", leaf optimizer, ShardedTensor weight, table name)`` (torchrec
    names the state of a table by its config name, the key's last part), or ``("unsupported",
    reason, rows, dim)``."""
    root = getattr(model, "fused_optimizer", None)
    if not isinstance(root, KeyedOptimizer):
        raise ValueError(
            f"model must be a sharded model with a fused_optimizer (torchrec's DistributedModelParallel, or a "
            f"sharded EmbeddingBagCollection / EmbeddingCollection), got a {type(model).__name__} whose "
            f"fused_optimizer is {type(root).__name__}; pass the DistributedModelParallel-wrapped model.")
    out: Dict[str, Tuple[Any, ...]] = {}

    def walk(opt: KeyedOptimizer, prefix: str) -> None:
        if isinstance(opt, CombinedOptimizer):
            for key, sub in opt.optimizers:
                walk(sub, CombinedOptimizer.prepend_opt_key(key, prefix))
            return
        shards = opt._shards if isinstance(opt, TieredFusedOptimizer) else None
        for i, (param_key, param) in enumerate(opt.params.items()):
            full_key = CombinedOptimizer.prepend_opt_key(param_key, prefix)
            if not full_key.endswith(".weight"):
                continue
            base = full_key[: -len(".weight")]
            if shards is not None:
                out[base] = ("tiered", shards[i])
            elif isinstance(param, DTensor):  # refused for every rank alike (_describe_tables)
                out[base] = ("unsupported", "a DTensor weight and state (torchrec's DTensor state_dict option; "
                             "use its ShardedTensor default)", *(int(x) for x in param.size()))
            elif isinstance(param, ShardedTensor):
                out[base] = ("fused", opt, param, base.rsplit(".", 1)[-1])

    walk(root, "")
    return out


def _describe_tables(
    tables: Dict[str, Tuple[Any, ...]], process_group: Optional[dist.ProcessGroup]
) -> Dict[str, _OptTable]:
    """Every table's optimizer and shape, the same on every rank (collective when
    torch.distributed is initialized): a rank holding no shard of a TABLE_WISE table learns it
    from the rank that does."""
    local: Dict[str, _OptTable] = {}
    for base, entry in tables.items():
        if entry[0] == "tiered":
            shard = entry[1]
            local[base] = _OptTable(shard.optimizer.name, shard.num_embeddings, shard.embedding_dim)
        elif entry[0] == "unsupported":
            local[base] = _OptTable(*entry[1:])
        else:
            rows, dim = (int(x) for x in entry[2].size())
            opt = _fused_leaf_optimizer(entry[1])
            if any(int(w.tensor.shape[1]) != dim for w in entry[2].local_shards()):
                opt = (f"{opt}, column-wise sharded (torchrec keeps its row-wise optimizer state per column "
                       "shard; plan it TABLE_WISE or ROW_WISE)")
            local[base] = _OptTable(opt, rows, dim)
    if not dist.is_initialized():
        return local
    gathered: List[Dict[str, _OptTable]] = [{} for _ in range(dist.get_world_size(process_group))]
    dist.all_gather_object(gathered, {k: tuple(v) for k, v in local.items()}, group=process_group)
    merged: Dict[str, _OptTable] = {}
    for part in gathered:  # a column-wise table's description on a rank holding a column shard wins
        merged.update({k: _OptTable(*v) for k, v in part.items() if k not in merged or "column-wise" in v[0]})
    return dict(sorted(merged.items()))


def _unsupported_error(where: str, unsupported: Dict[str, _OptTable]) -> ValueError:
    named = ", ".join(f"{k!r} ({d.optimizer})" for k, d in unsupported.items())
    return ValueError(
        f"{where}: the fused optimizer state of tables {named} cannot be migrated (the migration carries the "
        f"state of {sorted(o.value for o in OPTIMIZER_STATE_NAMES)}, what tiered tables run, from TABLE_WISE / "
        "ROW_WISE ShardedTensor tables). Possible solutions:\n"
        "  1. train them with SGD, row-wise Adagrad or Adam (apply_optimizer_in_backward), planned TABLE_WISE or "
        "ROW_WISE;\n"
        "  2. plan them data-parallel or without a fused optimizer, so that the migration leaves them out.")


def gather_full_optimizer_state(
    model: nn.Module, *, process_group: Optional[dist.ProcessGroup] = None
) -> Dict[str, Dict[str, torch.Tensor]]:
    """Every sharded embedding table's fused optimizer state, full tables in global row order.

    The optimizer-state counterpart of :func:`gather_full_weights`: torchrec FUSED tables
    (their ``model.fused_optimizer`` ShardedTensor state, shards at their offsets or at their
    routed global ids) and tiered tables (each row's state, by global id) give the same
    entries, so :func:`load_full_optimizer_state` loads them into a model whose tables are
    tiered, FUSED, of another world size or routing. Collective over ``process_group`` (every
    rank calls it and gets every table, on CPU), as :func:`gather_full_weights`.

    Args:
        model (nn.Module): the (DMP-wrapped) sharded model.
        process_group (dist.ProcessGroup | None): the group the tables are sharded over
            (default: the world, when torch.distributed is initialized).

    Returns:
        Dict[str, Dict[str, torch.Tensor]]: ``{<collection>.<table> (the weight's key in
        model.state_dict() without .weight): {<table>.<name>: full state, "step": step}}``, with
        torchrec's names (:data:`OPTIMIZER_STATE_NAMES`): SGD none; row-wise Adagrad
        ``<table>.momentum1`` ``[num_embeddings]``; Adam ``<table>.momentum1`` (``exp_avg``) and
        ``<table>.exp_avg_sq``, ``[num_embeddings, dim]`` each; ``step`` (:data:`OPTIMIZER_STEP_KEY`)
        a 0-dim int64 tensor, the optimizer step of the table (fbgemm's ``iter``, the tiered
        table's ``step``; Adam's bias correction continues from it).

    Raises:
        ValueError: ``model`` has no ``fused_optimizer``; a table trains with another fused
            optimizer (naming it), or is column-wise sharded (its row-wise state is per column
            shard), or its state is a DTensor.

    Example::

        full = gather_full_weights(model)             # every rank, in the saving job's sharding
        opt = gather_full_optimizer_state(model)
        other_model.load_state_dict(full, strict=False)
        load_full_optimizer_state(other_model, opt)   # after the weights
    """
    tables = _optimizer_tables(model)
    desc = _describe_tables(tables, process_group)
    unsupported = {k: d for k, d in desc.items() if d.optimizer not in {o.value for o in OPTIMIZER_STATE_NAMES}}
    if unsupported:
        raise _unsupported_error("gather_full_optimizer_state", unsupported)
    with state_dict_without_tiered_rows(model):
        state = model.state_dict()  # the row orders of routed FUSED tables
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    steps = torch.full((len(desc),), -1, dtype=torch.int64)
    for i, (base, d) in enumerate(desc.items()):
        table = base.rsplit(".", 1)[-1]
        full = {k: torch.zeros(shape, dtype=torch.float32) for k, shape in _state_shapes(table, d).items()}
        entry = tables.get(base)
        if entry is not None and entry[0] == "tiered":
            st = entry[1].export_state()
            cols = _named_to_columns(d, st.optimizer_state, table)
            for k, v in cols.items():
                full[k][st.global_ids] = v
            steps[i] = st.step
        elif entry is not None:
            _, leaf, weight, name = entry
            for k, src in _fused_state_shards(base, d, leaf, weight, name, _row_order(state, base)):
                for rows, shard in src:
                    full[k][rows] = shard.detach().cpu().to(torch.float32)
            steps[i] = _fused_step(leaf)
        out[base] = full
    if dist.is_initialized():
        for base in desc:  # sorted, the same on every rank
            for k in sorted(out[base]):
                out[base][k] = _all_reduce_cpu(out[base][k], dist.ReduceOp.SUM, process_group)
        steps = _all_reduce_cpu(steps, dist.ReduceOp.MAX, process_group)
    for i, base in enumerate(desc):
        out[base][OPTIMIZER_STEP_KEY] = torch.tensor(max(int(steps[i]), 0), dtype=torch.int64)
    return out


def _named_to_columns(d: _OptTable, state: torch.Tensor, table: str) -> Dict[str, torch.Tensor]:
    """A tiered table's ``[n, state_cols]`` rows of state as torchrec's named states
    (row-wise Adagrad: the momentum column; Adam: ``exp_avg`` then ``exp_avg_sq`` columns)."""
    names = list(_state_shapes(table, d))
    if FusedOptimizer(d.optimizer) is FusedOptimizer.ROWWISE_ADAGRAD:
        return {names[0]: state[:, 0]}
    return {k: state[:, j * d.dim:(j + 1) * d.dim] for j, k in enumerate(names)}


def _columns_from_named(d: _OptTable, table: str, given: Mapping[str, Any]) -> torch.Tensor:
    """torchrec's named full states of a table as a tiered shard's ``[rows, state_cols]`` layout."""
    names = list(_state_shapes(table, d))
    if not names:
        return torch.zeros((d.rows, 0), dtype=torch.float32)
    return torch.cat([given[k].detach().reshape(d.rows, -1).to(torch.float32) for k in names], dim=1)


def _fused_state_shards(
    base: str, d: _OptTable, leaf: Any, weight: ShardedTensor, name: str, order: Optional[RowOrder]
) -> Iterator[Tuple[str, List[Tuple[Any, torch.Tensor]]]]:
    """For each named state of FUSED table ``base``: (global rows, local state tensor) of every
    local shard (torchrec builds the state's local shards in the order of the weight's)."""
    state = leaf.state.get(weight, {})
    w_shards = weight.local_shards()  # whole rows: column-wise tables were refused (_describe_tables)
    for k in _state_shapes(name, d):
        st = state.get(k)
        if not isinstance(st, ShardedTensor):
            raise ValueError(f"{base}: the fused optimizer state of table {name!r} has no ShardedTensor {k!r} (it "
                             f"has {sorted(state)}); migrate it from torchrec's ShardedTensor optimizer state.")
        o_shards = st.local_shards()
        if len(o_shards) != len(w_shards):
            raise ValueError(f"{base}: {k!r} has {len(o_shards)} local shards, the weight {len(w_shards)}.")
        yield k, [(_shard_global_rows(w.metadata, int(w.tensor.shape[0]), order), o.tensor)
                  for w, o in zip(w_shards, o_shards)]


def _fused_step(leaf: Any) -> int:
    """The optimizer step of a torchrec fused optimizer's fbgemm TBE (``iter``, what its
    ``set_optimizer_step`` sets)."""
    it = getattr(getattr(leaf, "_emb_module", None), "iter", None)
    return int(it.reshape(-1)[0]) if isinstance(it, torch.Tensor) and it.numel() else 0


def _given_optimizer(table: str, given: Mapping[str, Any]) -> str:
    """What optimizer's state ``given`` holds, for error messages."""
    m1, m2 = given.get(f"{table}.momentum1"), given.get(f"{table}.exp_avg_sq")
    dims = lambda t: t.dim() if isinstance(t, torch.Tensor) else None  # noqa: E731
    if m1 is None and m2 is None:
        return "sgd"
    if dims(m1) == 1 and m2 is None:
        return "rowwise_adagrad"
    if dims(m1) == 2 and dims(m2) == 2:
        return "adam"
    return "unrecognised"


def _check_table_state(base: str, d: _OptTable, given: Any) -> None:
    """Refuses ``given`` (a :func:`gather_full_optimizer_state` entry) for table ``base``
    unless it is the state of the table's optimizer and shape, naming both and the fixes."""
    table = base.rsplit(".", 1)[-1]
    shapes = _state_shapes(table, d)
    want = {**{k: list(v) for k, v in shapes.items()}, OPTIMIZER_STEP_KEY: "int >= 0"}
    if not isinstance(given, Mapping):
        raise ValueError(f"load_full_optimizer_state: states[{base!r}] must be a dict {want} (an entry of "
                         f"gather_full_optimizer_state), got {type(given).__name__}.")
    got = {k: (list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__) for k, v in given.items()}
    step = given.get(OPTIMIZER_STEP_KEY)
    step_ok = (isinstance(step, numbers.Integral) and not isinstance(step, bool)) or (
        isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point()
        and step.dtype is not torch.bool)
    step_ok = step_ok and int(step) >= 0
    ok = step_ok and set(given) == set(want) and all(
        isinstance(given[k], torch.Tensor) and given[k].is_floating_point() and tuple(given[k].shape) == s
        for k, s in shapes.items())
    if not ok:
        source = _given_optimizer(table, given)
        raise ValueError(
            f"load_full_optimizer_state: table {base!r} of the model trains with {d.optimizer} "
            f"([{d.rows}, {d.dim}], optimizer state {want}), but states[{base!r}] holds {source} state {got}. "
            "Possible solutions:\n"
            f"  1. load the state gathered (gather_full_optimizer_state) from a model whose table {table!r} has "
            f"the same shape and trains with {d.optimizer};\n"
            f"  2. train this model's table with the saving model's optimizer ({source}: the optimizer of "
            "apply_optimizer_in_backward, or the sharder's fused_params);\n"
            f"  3. leave {base!r} out of states and pass strict=False (its optimizer state is then left as it is, "
            "zero after loading its weights).")
    bad = [k for k in shapes if not bool(torch.isfinite(given[k]).all())]
    if bad:
        raise ValueError(f"load_full_optimizer_state: states[{base!r}] {bad} hold NaN or inf values; load the "
                         "state of a healthy run (an earlier checkpoint).")


def load_full_optimizer_state(
    model: nn.Module,
    states: Mapping[str, Mapping[str, Any]],
    *,
    strict: bool = True,
    process_group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Loads full fused optimizer state (:func:`gather_full_optimizer_state`) into ``model``'s tables.

    Each rank picks the rows it holds: a tiered table's rows by global id (their state moves
    with them), a torchrec FUSED table's into its ``model.fused_optimizer`` ShardedTensor state
    (fbgemm's buffers) at its shards' offsets or routed global ids. The step is set as
    torchrec's ``set_optimizer_step`` sets it (a FUSED TBE's step is shared by its tables: it is
    set to the largest of theirs); on a model that has not trained since it was built or its
    weights were loaded, Adam's next update is step ``step + 1``, as in the saving run. Load the
    weights first: ``load_state_dict`` of a full weight zeroes a tiered table's optimizer state.

    Collective over ``process_group`` (the tables' optimizers and shapes are gathered, so every
    rank refuses alike); every table is checked before any is loaded.

    Args:
        model (nn.Module): the (DMP-wrapped) sharded model to load into.
        states (Mapping[str, Mapping[str, Any]]): :func:`gather_full_optimizer_state` of the saving
            model (on every rank).
        strict (bool): refuse a model table missing from ``states`` (default). With False, such
            tables keep their state.
        process_group (dist.ProcessGroup | None): the group the tables are sharded over
            (default: the world, when torch.distributed is initialized).

    Raises:
        ValueError: naming the table, both optimizers and shapes and the fixes: a table's
            entry is not the state of its optimizer and shape (e.g. row-wise Adagrad state for
            an Adam table), a key names no table of the model, a table is missing (``strict``),
            or a table trains with an optimizer the migration does not carry. Nothing is changed.

    Example::

        other_model.load_state_dict(gather_full_weights(model), strict=False)
        load_full_optimizer_state(other_model, gather_full_optimizer_state(model))
    """
    tables = _optimizer_tables(model)
    desc = _describe_tables(tables, process_group)
    if not isinstance(states, Mapping):
        raise ValueError(f"load_full_optimizer_state: states must be the dict gather_full_optimizer_state returns "
                         f"({{<collection>.<table>: {{...}}}}), got {type(states).__name__}.")
    unknown = sorted(k for k in states if k not in desc)
    if unknown:
        raise ValueError(f"load_full_optimizer_state: states has {unknown}, which are no table of the model with a "
                         f"fused optimizer (its tables: {list(desc)}); pass the keys gather_full_optimizer_state "
                         "gives (<collection>.<table>, as the weight keys of model.state_dict()), or remove them.")
    missing = [k for k in desc if k not in states]
    if strict and missing:
        raise ValueError(f"load_full_optimizer_state: states has no entry for tables {missing} of the model; "
                         "pass the whole gather_full_optimizer_state of the saving model, or strict=False to "
                         "leave these tables' optimizer state as it is.")
    unsupported = {k: desc[k] for k in states if desc[k].optimizer not in {o.value for o in OPTIMIZER_STATE_NAMES}}
    if unsupported:
        raise _unsupported_error("load_full_optimizer_state", unsupported)
    for base in sorted(states):  # the same first refusal on every rank
        _check_table_state(base, desc[base], states[base])
    _write_optimizer_rows(model, tables, desc, {
        base: (lambda k, rows, given=given: given[k].detach()[rows], int(given[OPTIMIZER_STEP_KEY]))
        for base, given in states.items()})


#: Where :func:`_write_optimizer_rows` reads a table's state: ``rows_of(name, rows)`` gives the
#: named state (torchrec's name) of ``rows`` (a slice or int64 global ids), and the step.
_StateSource = Tuple[Callable[[str, Any], torch.Tensor], int]


@torch.no_grad()
def _write_optimizer_rows(model: nn.Module, tables: Dict[str, Tuple[Any, ...]], desc: Dict[str, _OptTable],
                          sources: Mapping[str, _StateSource]) -> None:
    """Writes the fused optimizer state of the tables named in ``sources`` (checked by the caller)
    into ``model``: a tiered table's rows by global id (it asks for every row), a FUSED table's
    into its ``model.fused_optimizer`` ShardedTensor state (fbgemm's buffers) at its shards'
    offsets or routed global ids (only those rows are asked for); then sets each FUSED TBE's
    step to the largest of its tables' (torchrec's ``set_optimizer_step``)."""
    with state_dict_without_tiered_rows(model):
        sd = model.state_dict()  # the row orders of routed FUSED tables
    leaf_steps: Dict[int, Tuple[Any, int]] = {}
    for base, entry in tables.items():
        if base not in sources:
            continue
        rows_of, step = sources[base]
        d, table = desc[base], base.rsplit(".", 1)[-1]
        if entry[0] == "tiered":
            every = {k: rows_of(k, slice(None)) for k in _state_shapes(table, d)}
            entry[1].load_global_optimizer_state(_columns_from_named(d, table, every), step)
            continue
        _, leaf, weight, name = entry
        for k, dst in _fused_state_shards(base, d, leaf, weight, name, _row_order(sd, base)):
            for rows, shard in dst:
                shard.copy_(rows_of(k, rows).to(shard.device, shard.dtype))
        prev = leaf_steps.get(id(leaf), (leaf, -1))[1]
        leaf_steps[id(leaf)] = (leaf, max(prev, step))
    for leaf, step in leaf_steps.values():
        leaf.set_optimizer_step(step)
