"""``gather_dynamic_table``: every key of a dynamic table with its row, optimizer state and score, on every rank.

A collective, like dynamicemb's dump: each rank contributes its shard's keys (row-wise: its share;
table-wise: the owner all of them) and every rank receives them all, in rank order.
Imports ``recpipe.pipeline.tiered`` modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from recpipe.pipeline.tiered.dynamic.dynamic_shard import DynamicEmbeddingShard
from recpipe.pipeline.tiered.tiered_collections import TieredTablesMixin

__all__ = ["DynamicTableDump", "gather_dynamic_table"]


@dataclass
class DynamicTableDump:
    """A dynamic table's content: ``keys`` (int64 ``[N]``), ``weights`` (``[N, dim]``), ``optimizer_state``
    (fp32 ``[N, state columns]``) and ``scores`` (int64 ``[N]``), rows in rank order then slot order."""

    keys: torch.Tensor
    weights: torch.Tensor
    optimizer_state: torch.Tensor
    scores: torch.Tensor


def _local_shard(model: nn.Module, table: str) -> Tuple[Optional[DynamicEmbeddingShard], bool]:
    """``(this rank's shard of table, whether the model plans the table at all)``."""
    planned = False
    for module in model.modules():
        if isinstance(module, TieredTablesMixin):
            names = module._tiered_names()
            planned |= table in names
            shard = module.tiered_tables().get(table)
            if shard is not None:
                if not isinstance(shard, DynamicEmbeddingShard):
                    raise ValueError(
                        f"gather_dynamic_table: table {table!r} is a tiered table of fixed ids, not dynamic; use "
                        "recpipe.pipeline.gather_full_weights for it."
                    )
                return shard, True
    return None, planned


def gather_dynamic_table(model: nn.Module, table: str, group: Optional[dist.ProcessGroup] = None) -> DynamicTableDump:
    """Every key of dynamic table ``table`` of a sharded ``model`` (DMP or its module), gathered on every rank.

    A collective: every rank of ``group`` (default: the world) calls it.

    Args:
        model (nn.Module): the sharded model.
        table (str): the table's name (its ``EmbeddingBagConfig.name``).
        group (Optional[dist.ProcessGroup]): the ranks that hold the model.

    Returns:
        DynamicTableDump: on CPU.

    Raises:
        ValueError: no such dynamic table in ``model``.
    """
    shard, planned = _local_shard(model, table)
    mine: Optional[Tuple[torch.Tensor, ...]] = shard.dynamic_rows() if shard is not None else None
    parts: List[Any] = [mine]
    if dist.is_available() and dist.is_initialized():
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, mine, group=group)
        planned = any(p is not None for p in parts) or planned
    found = [p for p in parts if p is not None]
    if not found:
        raise ValueError(
            f"gather_dynamic_table: the model has no dynamic table {table!r}"
            + ("" if planned else "; pass the name of a table planned with PlacementConstraints(dynamic=...)")
            + "."
        )
    keys, weights, state, scores = (torch.cat([p[i] for p in found]) for i in range(4))
    return DynamicTableDump(keys, weights, state, scores)
