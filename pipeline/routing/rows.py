"""Row math of the routings: continuous blocks, rows per rank, global ids of local rows.

May import ``recpipe.pipeline.placement`` and ``recpipe.pipeline.routing.ops`` only.
"""

from __future__ import annotations

import torch

from recpipe.pipeline.placement import DIST_TYPES, check_int, local_rows
from recpipe.pipeline.routing.ops import hash_roundrobin_global_ids

__all__ = ["check_dist_type", "continuous_block_rows", "global_row_ids", "shard_num_rows"]


def continuous_block_rows(num_embeddings: int, world_size: int) -> int:
    """Rows per rank of a continuous table in torchrec's blocks: ``ceil(N / W)``, at least 1."""
    num_embeddings = check_int(num_embeddings, "num_embeddings", 0)
    world_size = check_int(world_size, "world_size", 1)
    return max(1, -(-num_embeddings // world_size))


def check_dist_type(dist_type: str) -> str:
    """``dist_type`` if it names a distribution type (:data:`DIST_TYPES`), else a ValueError."""
    if not isinstance(dist_type, str) or dist_type not in DIST_TYPES:
        raise ValueError(f"dist_type must be one of {sorted(DIST_TYPES)}, got {dist_type!r}.")
    return dist_type


def shard_num_rows(num_embeddings: int, world_size: int, rank: int, dist_type: str) -> int:
    """Rows rank ``rank`` owns of a table of ``num_embeddings`` rows routed by ``dist_type``."""
    check_dist_type(dist_type)
    num_embeddings = check_int(num_embeddings, "num_embeddings", 0)
    world_size = check_int(world_size, "world_size", 1)
    rank = check_int(rank, "rank")
    if dist_type == "continuous":
        local_rows(num_embeddings, world_size, rank)  # validates the arguments
        block = continuous_block_rows(num_embeddings, world_size)
        return max(0, min(block, num_embeddings - rank * block))
    return local_rows(num_embeddings, world_size, rank)


def global_row_ids(
    local_ids: torch.Tensor, num_embeddings: int, world_size: int, rank: int, dist_type: str, seed: int
) -> torch.Tensor:
    """int64 global ids of local rows of shard ``rank`` (inverse of the routing), shaped like ``local_ids``.

    Raises:
        ValueError: a bad rank, or a local id that is not a row of the shard.
    """
    check_dist_type(dist_type)
    if (
        not isinstance(local_ids, torch.Tensor)
        or local_ids.is_floating_point()
        or local_ids.is_complex()
        or local_ids.dtype == torch.bool
    ):
        got = f"a {local_ids.dtype} tensor" if isinstance(local_ids, torch.Tensor) else type(local_ids).__name__
        raise ValueError(
            f"global_row_ids: `local_ids` must be an integer tensor of local row ids, got {got}; pass e.g. "
            "torch.as_tensor(ids, dtype=torch.int64) (a float tensor would be truncated)."
        )
    local_ids = local_ids.to(torch.int64)
    num_embeddings = check_int(num_embeddings, "num_embeddings", 0)
    world_size = check_int(world_size, "world_size", 1)
    rank = check_int(rank, "rank")
    rows = shard_num_rows(num_embeddings, world_size, rank, dist_type)  # validates rank and world_size
    if dist_type != "hash_roundrobin" and local_ids.numel() > 0:  # an export path, not a step: may sync
        lo, hi = int(local_ids.min()), int(local_ids.max())
        if lo < 0 or hi >= rows:
            raise ValueError(
                f"global_row_ids: `local_ids` in [{lo}, {hi}] are not all rows of shard {rank} ({rows} rows of a "
                f"{dist_type} table of {num_embeddings} rows over {world_size} ranks): pass local ids in "
                f"[0, {rows}), or check the checkpoint's world size and routing."
            )
    if dist_type == "roundrobin":
        return local_ids * world_size + rank
    if dist_type == "continuous":
        return local_ids + rank * continuous_block_rows(num_embeddings, world_size)
    if local_ids.numel() == 0:
        return local_ids.clone()
    flat = local_ids.reshape(-1)  # any shape, as the other routings (the op takes 1-D ids)
    ranks = torch.full_like(flat, rank)
    return hash_roundrobin_global_ids(ranks, flat, num_embeddings, world_size, seed).view(local_ids.shape)
