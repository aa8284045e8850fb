"""A dynamic table on CUDA (the torch implementation: plan, index, tiers) equals the CPU native one bit for bit:
same slots, same rows, same outputs, step by step, with evictions. Skips without a GPU (runs through
../shared/gpu when one is lent)."""

from __future__ import annotations

import pytest
import torch

from recpipe.pipeline.placement import DynamicTableOptions
from recpipe.pipeline.tiered.dynamic.dynamic_shard import DynamicEmbeddingShard
from recpipe.pipeline.tiered.optim import TieredOptimizerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("mode,x", [("HYBRID", 1.0), ("HYBRID", 0.5), ("CACHING", 0.25)])
def test_cuda_torch_backend_equals_cpu_native_backend(mode: str, x: float) -> None:
    def build(device: str, backend: str) -> DynamicEmbeddingShard:
        return DynamicEmbeddingShard(
            num_embeddings=64,
            embedding_dim=8,
            options=DynamicTableOptions(capacity=64, eviction="lfu", on_full="ignore", seed=3),
            mode=mode,
            cache_load_factor=x,
            device=device,
            backend=backend,
            optimizer=TieredOptimizerConfig(optimizer="rowwise_adagrad", learning_rate=0.05),
        )

    cpu, gpu = build("cpu", "native"), build("cuda", "torch")
    gen = torch.Generator().manual_seed(0)
    offsets = torch.arange(0, 61, 5)
    for step in range(8):
        keys = torch.randint(-300, 300, (60,), generator=gen) * 1000003
        grad = torch.randn(12, 8, generator=gen)
        a = cpu(keys, offsets)
        b = gpu(keys.cuda(), offsets.cuda())
        # float sums on CUDA may differ in the last bit from the CPU kernel: rows exact at step 0, close after
        torch.testing.assert_close(b.cpu(), a, atol=1e-6, rtol=1e-5, msg=f"step {step}")
        a.backward(grad)
        b.backward(grad.cuda())
    ka, _, _, sa = cpu.dynamic_rows()
    kb, _, _, sb = gpu.dynamic_rows()
    assert torch.equal(ka, kb) and torch.equal(sa, sb), "the same keys in the same slots with the same scores"
    assert cpu.tier_stats()["evicted"] == gpu.tier_stats()["evicted"] > 0


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_a_cuda_step_of_an_all_fast_table_never_waits_for_the_device(pooling: str) -> None:
    """Training lookups (inserts, admission, evictions, keys without a slot), their backward and eval lookups
    of an all-fast table run under ``torch.cuda.set_sync_debug_mode("error")``: any host read raises."""
    shard = DynamicEmbeddingShard(
        num_embeddings=64,
        embedding_dim=8,
        options=DynamicTableOptions(capacity=64, eviction="lru", admit_after=2, on_full="ignore", seed=3),
        pooling=pooling,
        device="cuda",
        backend="torch",
        optimizer=TieredOptimizerConfig(optimizer="adam", learning_rate=0.05),
    )
    gen = torch.Generator().manual_seed(0)
    offsets = torch.arange(0, 61, 5).cuda()
    batches = [
        ((torch.randint(-60, 60, (60,), generator=gen) * 1000003).cuda(), torch.randn(12, 8, generator=gen).cuda())
        for _ in range(12)
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for keys, grad in batches:
            shard.lookup_counters()
            shard(keys, offsets).backward(grad)
        shard.eval()
        with torch.no_grad():
            shard(batches[0][0], offsets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stats = shard.tier_stats()
    assert stats["evicted"] > 0 and stats["not_admitted"] > 0
