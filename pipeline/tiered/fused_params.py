"""Reading a tiered table's fused params: optimizer, output dtype, placement, backend.

The placement (``PlacementParams``, keys ``FUSED_PARAM_KEYS``) is written by the planner and
validated here; the optimizer comes from torchrec's usual fused params. Params the tiered kernel
does not implement, and a placement sized for another optimizer or dtype, are refused. May import
``recpipe.pipeline.placement``, ``recpipe.pipeline.routing`` and other ``recpipe.pipeline.tiered`` modules.
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, ShardedEmbeddingTable
from torchrec.modules.embedding_configs import DataType, data_type_to_dtype, data_type_to_sparse_type
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.pipeline.placement import (
    FUSED_PARAM_BACKEND,
    FUSED_PARAM_DIST_TYPE,
    FUSED_PARAM_DTYPE,
    FUSED_PARAM_OPTIMIZER,
    FUSED_PARAM_SEED,
    SUPPORTED_OPTIMIZERS,
    DistType,
    FusedOptimizerKind,
    PlacementParams,
    dtype_name,
)
from recpipe.pipeline.routing.features import RoutingOverrides
from recpipe.pipeline.tiered.backends import resolve_backend
from recpipe.pipeline.tiered.optim import HYPER_PARAMETERS, TieredOptimizerConfig


def tiered_optimizer_from_fused_params(fused_params: Optional[Dict[str, Any]]) -> TieredOptimizerConfig:
    """The tiered optimizer config for torchrec fused params (fbgemm's defaults for missing keys).

    ValueError for an optimizer the tiered kernel does not run, a torch-only optimizer kwarg, or a
    fused param changing fbgemm's update in a way the tiered kernel does not implement.
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
        fused = FusedOptimizerKind.parse(opt)
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
            raise ValueError(
                f"fused param {key!r} must be a number, got {type(value).__name__} {value!r}; e.g. {key}={default}."
            )
        return float(value)

    defaults, adam = TieredOptimizerConfig(), fused is FusedOptimizerKind.ADAM  # fbgemm's defaults
    values = {k: number(k, getattr(defaults, k)) for k in HYPER_PARAMETERS if adam or k != "weight_decay"}
    return TieredOptimizerConfig(optimizer=fused, **values)


#: fbgemm's deprecated (refused) non-exact ``EmbOptimType`` members -> their exact counterparts.
_DEPRECATED_OPTIMIZERS: Dict[EmbOptimType, EmbOptimType] = {
    EmbOptimType.SGD: EmbOptimType.EXACT_SGD,
    EmbOptimType.ROWWISE_ADAGRAD: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}


#: torch optimizer kwargs that fbgemm's TBE does not take (torchrec's FUSED tables fail on them too).
TORCH_OPTIMIZER_ONLY_KWARGS: Tuple[str, ...] = (
    "amsgrad",
    "betas",
    "capturable",
    "dampening",
    "decoupled_weight_decay",
    "differentiable",
    "foreach",
    "fused",
    "initial_accumulator_value",
    "lr_decay",
    "maximize",
    "nesterov",
)


def _unsupported_update_params(fp: Dict[str, Any], optimizer: FusedOptimizerKind) -> Dict[str, Any]:
    """The non-default fused params by which fbgemm's TBE updates differently from the tiered kernel.

    Gradient clipping, row-wise Adagrad's weight decay modes and ``max_norm``, and Adam's per-row
    bias correction; a ``weight_decay`` fbgemm ignores is accepted.
    """
    out: Dict[str, Any] = {}
    extra = fp.get("extra_optimizer_config")
    if getattr(extra, "use_rowwise_bias_correction", False):  # fbgemm's per-row Adam step counts
        out["extra_optimizer_config"] = extra
    if fp.get("gradient_clipping", False):
        out["gradient_clipping"] = fp["gradient_clipping"]
        out["max_gradient"] = fp.get("max_gradient", 1.0)  # fbgemm's default
    if optimizer is FusedOptimizerKind.ROWWISE_ADAGRAD:
        mode = fp.get("weight_decay_mode", WeightDecayMode.NONE)
        decays = fp.get("weight_decay", 0.0) != 0.0 or mode not in (WeightDecayMode.L2, WeightDecayMode.DECOUPLE)
        if mode not in (None, WeightDecayMode.NONE) and decays:
            out["weight_decay_mode"] = mode
            out["weight_decay"] = fp.get("weight_decay", 0.0)
        if fp.get("max_norm", 0.0):
            out["max_norm"] = fp["max_norm"]
    return out


#: Output dtypes of tiered tables (fused param ``output_dtype``): fbgemm's float training outputs.
TIERED_OUTPUT_DTYPES: Tuple[SparseType, ...] = (SparseType.FP32, SparseType.FP16, SparseType.BF16)


def tiered_output_dtype(fused_params: Optional[Dict[str, Any]], table_name: str) -> torch.dtype:
    """The dtype of a tiered table's outputs: fused param ``output_dtype`` (default FP32), as fbgemm's."""
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
    """The validated placement of a CUSTOMIZED_KERNEL table and the optimizer it trains with.

    Raises ``PlacementContractError`` (missing / invalid keys) or ``PlacementMismatchError`` (other sizing).
    """
    params = PlacementParams.from_fused_params(table.fused_params, table.name)
    optimizer = _table_optimizer(table.fused_params, table.name)
    params.check_runtime(
        table.name, optimizer=optimizer.optimizer, dtype=data_type_to_dtype(table.data_type), dim=table.embedding_dim
    )
    return params, optimizer


def tiered_vbe_error(where: str, table_features: Dict[str, List[str]], features: KeyedJaggedTensor) -> ValueError:
    """The error for a variable-batch-size-per-feature (VBE) KJT sent to pooled tiered tables.

    The tiered pooled kernel pools ``stride`` bags of every feature and does not take torchrec's
    ``vbe_output``. ``where`` names the refusing call; batch sizes come from host metadata (no sync).
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
        "TieredEmbeddingBagCollectionSharder or RoutedEmbeddingBagCollectionSharder), which "
        "route VBE KJTs."
    )


def resolve_tiered_fused_params(
    sharding_infos: List[EmbeddingShardingInfo], routing: Optional[RoutingOverrides], backend: Optional[str] = None
) -> None:
    """Completes each tiered table's placement in its fused params (in place).

    Each key keeps the table's own value, else takes the sharder's (routing, ``backend``), else the
    default (``hash_roundrobin``, seed 0; the table's own optimizer and dtype; the device's backend).
    Other tables lose ``FUSED_PARAM_BACKEND``, which fbgemm's TBEs would refuse.
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


def table_backend(table: ShardedEmbeddingTable, device: Optional[torch.device]) -> Optional[str]:
    """The table's ``FUSED_PARAM_BACKEND`` (None: the device's default), validated for ``device`` (None: CPU)."""
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
