"""Byte accounting for tiered embedding tables: re-exported from the placement contract.

The formulas live in :mod:`recpipe.pipeline.placement` (the bottom of the
runtime, which sizes its tiers with them); the planner budgets with the same
functions (and, for fbgemm's CUDA tables, with
``recpipe.pipeline.tiered.fbgemm.fbgemm_shard_storage``). This module keeps the
``recpipe.planner.storage`` names importable.
"""

from __future__ import annotations

from recpipe.pipeline.placement import (
    CACHE_ROW_MAP_BYTES,
    CACHE_SLOT_BYTES,
    ShardStorage,
    local_rows,
    machine_storage,
    machine_sum,
    max_local_rows,
    optimizer_state_bytes_per_row,
    row_bytes,
    shard_storage,
    tier_rows,
)

__all__ = [
    "CACHE_ROW_MAP_BYTES",
    "CACHE_SLOT_BYTES",
    "ShardStorage",
    "local_rows",
    "machine_storage",
    "machine_sum",
    "max_local_rows",
    "optimizer_state_bytes_per_row",
    "row_bytes",
    "shard_storage",
    "tier_rows",
]
