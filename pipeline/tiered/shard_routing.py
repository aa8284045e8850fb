"""The ``ShardRouting``s of a tiered shard: row-wise over ``W`` ranks, or a whole table on one.

May import ``recpipe.pipeline.placement``, ``recpipe.pipeline.interfaces`` and ``recpipe.pipeline.routing``.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import torch

from recpipe.pipeline.interfaces import ShardRouting
from recpipe.pipeline.placement import check_int
from recpipe.pipeline.routing.ops import ROUTING_VERSION, route_ids
from recpipe.pipeline.routing.rows import check_dist_type, global_row_ids, shard_num_rows

__all__ = ["RowWiseRouting", "WholeTableRouting", "routing_of_export"]


class RowWiseRouting(ShardRouting):
    """Rank ``rank``'s rows of a table routed row-wise (``hash_roundrobin``, ``roundrobin`` or
    ``continuous``) over ``world_size`` ranks."""

    def __init__(self, num_embeddings: int, world_size: int, rank: int, dist_type: str, seed: int) -> None:
        self.dist_type = check_dist_type(dist_type)
        self.num_embeddings = num_embeddings
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self._num_rows = shard_num_rows(num_embeddings, world_size, rank, dist_type)

    @property
    def num_rows(self) -> int:
        return self._num_rows

    def global_ids(self, local: torch.Tensor) -> torch.Tensor:
        return global_row_ids(local, self.num_embeddings, self.world_size, self.rank, self.dist_type, self.seed)

    def route(self, global_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return route_ids(global_ids, self.num_embeddings, self.world_size, self.dist_type, self.seed)

    def metadata(self) -> Dict[str, Any]:
        return {
            "dist_type": self.dist_type,
            "routing_seed": self.seed,
            "routing_version": ROUTING_VERSION,
            "world_size": self.world_size,
            "rank": self.rank,
        }


class WholeTableRouting(RowWiseRouting):
    """Every row of a table on one rank, local id = global id (exported as ``continuous`` over one rank)."""

    def __init__(self, num_embeddings: int) -> None:
        self.num_embeddings = self._num_rows = check_int(num_embeddings, "num_embeddings", 0)
        self.world_size, self.rank, self.dist_type, self.seed = 1, 0, "continuous", 0

    def global_ids(self, local: torch.Tensor) -> torch.Tensor:
        return local.to(torch.int64).clone()

    def route(self, global_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        ids = global_ids.to(torch.int64)
        return torch.zeros_like(ids), ids.clone()


def routing_of_export(metadata: Mapping[str, Any]) -> RowWiseRouting:
    """The routing an export's metadata records."""
    return RowWiseRouting(*(metadata[k] for k in ("num_embeddings", "world_size", "rank", "dist_type", "routing_seed")))
