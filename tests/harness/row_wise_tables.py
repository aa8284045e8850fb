"""The FUSED tables of the row-wise sharding tests, their ROW_WISE plans and owner rows (no tests here).

Provides ``TABLES`` (t0 looked up by f0, t1 by f1 and f2), ``SEED`` (the routing
seed), ``UNEVEN`` (uneven shard sizes over 2 ranks), ``fused_row_wise_plan``
(ROW_WISE FUSED parameter shardings: routed, torchrec's contiguous blocks or
uneven) and ``owner_rows`` (the global ids a rank stores, in local-id order, from
the pure-Python reference routing). The functions run inside gloo ranks.
"""

from __future__ import annotations

from typing import Optional

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import EnumerableShardingSpec, ParameterSharding, ShardingType, ShardMetadata

from harness.routing_reference import route_one

TABLES = [("t0", 37, 8, ["f0"]), ("t1", 20, 4, ["f1", "f2"])]
SEED = 17
#: uneven row-wise shards of each table over 2 ranks (torchrec's blocks: 19 + 18, 10 + 10)
UNEVEN = {"t0": [10, 27], "t1": [15, 5]}


def fused_row_wise_plan(
    world: int, routed: bool, ec_dim: int = 0, uneven: bool = False
) -> dict[str, ParameterSharding]:
    out = {}
    for name, n, dim, _ in TABLES:
        dim = ec_dim or dim
        if uneven:
            sizes = UNEVEN[name]
        elif routed:  # roundrobin / hash: rank r owns ceil((n - r) / W) rows
            sizes = [(n - r + world - 1) // world for r in range(world)]
        else:  # torchrec's contiguous blocks
            block = -(-n // world)
            sizes = [max(0, min(block, n - r * block)) for r in range(world)]
        offs = [sum(sizes[:r]) for r in range(world)]
        shards = [
            ShardMetadata(shard_offsets=[offs[r], 0], shard_sizes=[sizes[r], dim], placement=f"rank:{r}/cpu")
            for r in range(world)
        ]
        out[name] = ParameterSharding(
            sharding_type=ShardingType.ROW_WISE.value,
            compute_kernel=EmbeddingComputeKernel.FUSED.value,
            ranks=list(range(world)),
            sharding_spec=EnumerableShardingSpec(shards),
        )
    return out


def owner_rows(n: int, world: int, rank: int, dist_type: str, sizes: Optional[list[int]] = None) -> torch.Tensor:
    """Global ids stored on `rank`, in local-id order (pure-Python reference routing);
    ``sizes``: uneven contiguous shards."""
    if sizes is not None:
        return torch.arange(sum(sizes[:rank]), sum(sizes[: rank + 1]), dtype=torch.int64)
    code = {"continuous": 0, "roundrobin": 1, "hash_roundrobin": 2}[dist_type]
    block = -(-n // world)
    pairs = [route_one(g, code, world, block, n, SEED, 64) for g in range(n)]
    mine = sorted((local, g) for g, (owner, local) in enumerate(pairs) if owner == rank)
    assert [loc for loc, _ in mine] == list(range(len(mine)))  # dense local ids
    return torch.tensor([g for _, g in mine], dtype=torch.int64)
