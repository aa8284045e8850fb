"""Table specs read from a torchrec model: each EBC / EC table with the fused optimizer torchrec's
sharders will give it."""

from __future__ import annotations

import math
import numbers
from typing import Any, List, Mapping, Optional, Union

from torch import nn
from torchrec.distributed.planner.constants import BATCH_SIZE, POOLING_FACTOR
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
from torchrec.modules.embedding_configs import data_type_to_dtype
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from recpipe.pipeline.placement import FusedOptimizerKind
from recpipe.planner.errors import PlacementErrorType, PlacementPlannerError
from recpipe.planner.specs import TableSpec


def _optimizer_error(table: str, message: str) -> PlacementPlannerError:
    return PlacementPlannerError(
        f"Table {table!r}: {message}\n"
        "Possible solutions:\n"
        "  1) fuse one of SGD, RowWiseAdagrad or Adam (the optimizers tiered tables run) into the table's backward: "
        "apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, ebc.parameters(), {'lr': 0.01});\n"
        "  2) plan a list of TableSpec with the optimizer the table will train with.",
        PlacementErrorType.INPUT_VALIDATION,
    )


def table_fused_optimizer(
    param: Optional[nn.Parameter], table: str, fused_params: Optional[Mapping[str, Any]] = None
) -> Optional[FusedOptimizerKind]:
    """The fused optimizer torchrec's sharders will give a table, read as they read it, or None.

    ``apply_optimizer_in_backward`` stores the optimizer class on the weight; the sharder turns it into an
    fbgemm ``EmbOptimType`` (unless the kwargs name an ``optimizer``) and merges it over its own
    ``fused_params``, so the parameter's optimizer wins over the sharder's.

    Raises:
        PlacementPlannerError: the optimizer has no fused equivalent the byte formulas know, or the weight has several.
    """
    classes = list(getattr(param, "_optimizer_classes", None) or [])
    kwargs = list(getattr(param, "_optimizer_kwargs", None) or [{}])
    if len(classes) > 1:
        raise _optimizer_error(
            table,
            f"its weight carries {len(classes)} in-backward optimizers {[c.__name__ for c in classes]}; "
            "torchrec's sharders fuse exactly one.",
        )
    emb_opt: Any = None
    if classes:
        emb_opt = kwargs[0].get("optimizer") if kwargs else None
        if emb_opt is None:
            try:
                emb_opt = optimizer_type_to_emb_opt_type(classes[0])
            except ValueError:
                raise _optimizer_error(
                    table,
                    f"its in-backward optimizer {classes[0].__module__}.{classes[0].__qualname__} has no "
                    "fused (fbgemm EmbOptimType) equivalent.",
                ) from None
    elif fused_params is not None and fused_params.get("optimizer") is not None:
        emb_opt = fused_params["optimizer"]
    if emb_opt is None:
        return None
    try:
        return FusedOptimizerKind.parse(emb_opt)
    except ValueError as e:
        raise _optimizer_error(table, f"its fused optimizer {emb_opt} cannot be sized: {e}") from None


def tables_from_module(
    module: nn.Module,
    *,
    optimizer: Union[FusedOptimizerKind, str] = FusedOptimizerKind.SGD,
    fused_params: Optional[Mapping[str, Any]] = None,
    batch_size: int = BATCH_SIZE,
    pooling_factor: float = POOLING_FACTOR,
) -> List[TableSpec]:
    """Table specs of every EmbeddingBagCollection / EmbeddingCollection in ``module`` (meta modules fine).

    Each table's optimizer is the one the model fuses into it (:func:`table_fused_optimizer`), else
    ``optimizer`` (default SGD, fbgemm's ``EXACT_SGD`` default). ``lookups_per_step = batch_size x
    pooling_factor x features of the table``, ``bags_per_step = batch_size x features``.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"module must be a torch.nn.Module (a model, or an EBC / EC), got {type(module).__name__}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int (samples per rank), got {batch_size!r}.")
    if (
        isinstance(pooling_factor, bool)
        or not isinstance(pooling_factor, numbers.Real)
        or not 0 <= pooling_factor < math.inf
    ):
        raise ValueError(
            f"pooling_factor must be a finite number >= 0 (ids per feature per sample), got {pooling_factor!r}."
        )
    if fused_params is not None and not isinstance(fused_params, Mapping):
        raise ValueError(f"fused_params must be a dict (or None), got {type(fused_params).__name__}.")
    fallback = FusedOptimizerKind.parse(optimizer)
    specs: List[TableSpec] = []
    for path, sub in module.named_modules():
        if isinstance(sub, EmbeddingBagCollection):
            configs, holders = sub.embedding_bag_configs(), sub.embedding_bags
        elif isinstance(sub, EmbeddingCollection):
            configs, holders = sub.embedding_configs(), sub.embeddings
        else:
            continue
        for cfg in configs:
            holder = holders[cfg.name] if cfg.name in holders else None
            weight = getattr(holder, "weight", None)
            fqn = f"{path}.{cfg.name}" if path else cfg.name
            fused = table_fused_optimizer(weight, fqn, fused_params)
            specs.append(
                TableSpec(
                    name=cfg.name,
                    rows=int(cfg.num_embeddings),
                    dim=int(cfg.embedding_dim),
                    dtype=data_type_to_dtype(cfg.data_type),
                    optimizer=fused if fused is not None else fallback,
                    lookups_per_step=float(batch_size * pooling_factor * max(len(cfg.feature_names), 1)),
                    bags_per_step=float(batch_size * max(len(cfg.feature_names), 1)),
                    module_path=path,
                    feature_names=tuple(cfg.feature_names),
                )
            )
    return specs


__all__ = ["table_fused_optimizer", "tables_from_module"]
