"""A CACHING shard's LFU cache keeps the hot rows and writes dirty slots back on ``flush``.

The reference is the batch itself: every hot id is looked up twice a step, cold ids at
random, so after warm-up the hit rate is the hot share of the ids.
"""

from __future__ import annotations

import pytest
import torch
from harness.tiered_shards import N, roundrobin_shard


def test_lfu_cache_keeps_hot_rows_and_writes_back() -> None:
    shard = roundrobin_shard("CACHING", 0.1, "sgd")  # 24 slots
    hot = torch.arange(0, 24)
    cold_gen = torch.Generator().manual_seed(5)
    for step in range(20):
        cold = torch.randint(24, N, (8,), generator=cold_gen)
        ids = torch.cat([hot, hot, cold])
        out = shard(ids, torch.tensor([0, ids.numel()]))
        out.sum().backward()
    stats = shard.tier_stats()
    assert stats["hit_rate"] == pytest.approx(48 / 56)  # every hot id cached, cold ones not
    assert shard.tiers.row_map is not None
    assert bool((shard.tiers.row_map[hot] >= 0).all())
    before = shard.tiers.slow_weights[hot].clone()
    flushed = shard.flush()
    assert flushed == 24  # every hot slot was dirty
    assert not torch.equal(before, shard.tiers.slow_weights[hot])
    assert shard.flush() == 0  # clean after a flush
