"""A tiered shard's tier bytes equal the planner's estimate (``recpipe.pipeline.placement.shard_storage``).

For every optimizer, mode and load factor, on one rank and per rank of a sharded table; no
tensor of the shard hides outside ``tier_tensors()``.
"""

from __future__ import annotations

import pytest
import torch
from harness.tiered_shards import D

from recpipe.pipeline.placement import local_rows, shard_storage
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("mode", ["HYBRID", "CACHING"])
def test_tier_bytes_equal_planner_estimate(optimizer: str, mode: str) -> None:
    for rows in (1, 7, 240, 1000):
        for x in (0.1, 0.2, 0.3, 0.5, 0.7, 1.0):
            shard = TieredEmbeddingShard(
                num_embeddings=rows,
                embedding_dim=D,
                mode=mode,
                cache_load_factor=x,
                optimizer=TieredOptimizerConfig(optimizer=optimizer),
            )
            got = shard.tier_bytes()
            want = shard_storage(rows, D, torch.float32, optimizer, mode, x)
            assert (got.fast_bytes, got.slow_bytes) == (want.fast_bytes, want.slow_bytes), (rows, x)
            # no other tensor hides in the module
            listed = {id(t) for ts in shard.tier_tensors().values() for _, t in ts}
            held = {id(v) for v in vars(shard).values() if isinstance(v, torch.Tensor)}
            assert held <= listed


def test_tier_bytes_sharded_match_planner_per_rank() -> None:
    for world in (2, 3):
        for rank in range(world):
            shard = TieredEmbeddingShard(
                num_embeddings=1001, embedding_dim=4, mode="CACHING", cache_load_factor=0.3, rank=rank, world_size=world
            )
            want = shard_storage(local_rows(1001, world, rank), 4, torch.float32, "sgd", "CACHING", 0.3)
            assert shard.tier_bytes() == want
