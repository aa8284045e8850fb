"""A tiered shard's lookups and fused updates equal torchrec's FUSED kernel step by step.

References are independent of the code under test:
* fbgemm's CPU TBE ``SplitTableBatchedEmbeddingBagsCodegen`` (torchrec's FUSED kernel)
  for SGD (``EXACT_SGD``) and row-wise Adagrad (``EXACT_ROWWISE_ADAGRAD``), also with
  per-sample weights, hashed local ids and pipelined lookups (forward(i+1) before backward(i));
* for Adam (fbgemm-gpu-cpu has no CPU Adam) a dense table whose gradient comes
  from torch autograd through ``F.embedding_bag``, updated with fbgemm's Adam
  formula on the rows the batch touched.
"""

from __future__ import annotations

from typing import Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from harness.tiered_shards import (
    ATOL,
    LR,
    MODES_X,
    RTOL,
    B,
    D,
    N,
    fbgemm_tbe,
    global_table,
    roundrobin_shard,
    skewed_batch,
)

from recpipe.pipeline.routing.ops import route_ids
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig


@pytest.mark.parametrize("mode,x", MODES_X)
@pytest.mark.parametrize("optimizer,pooling", [("sgd", "sum"), ("rowwise_adagrad", "sum"), ("rowwise_adagrad", "mean")])
def test_matches_fbgemm_fused_step_by_step(mode: str, x: float, optimizer: str, pooling: str) -> None:
    torch.manual_seed(0)
    w0 = torch.randn(N, D)
    tbe = fbgemm_tbe(optimizer, pooling, w0)
    shard = roundrobin_shard(mode, x, optimizer, pooling)
    shard.load_global_weights(w0)
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        ids, offsets = skewed_batch(gen)
        grad = torch.randn(B, D, generator=gen)
        ref = tbe(ids, offsets)
        out = shard(ids, offsets)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL, msg=f"forward step {step}")
        ref.backward(grad)
        out.backward(grad)
        w, s = global_table(shard)
        torch.testing.assert_close(w, tbe.split_embedding_weights()[0], atol=ATOL, rtol=RTOL)
        if optimizer == "rowwise_adagrad":
            mom = tbe.split_optimizer_states()[0][0]
            torch.testing.assert_close(s[:, 0], mom, atol=ATOL, rtol=RTOL)
    if mode == "CACHING" and x < 1.0:
        assert shard.tier_stats()["rows_loaded"] >= 0
        assert 0.0 < shard.tier_stats()["cumulative_hit_rate"] < 1.0


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("mode,x", [("HYBRID", 0.5), ("CACHING", 0.1), ("CACHING", 1.0)])
def test_per_sample_weights_get_fbgemms_gradient(backend: str, mode: str, x: float) -> None:
    """Per-sample weights that need a gradient (a feature processor's position weights)
    get fbgemm's TBE gradient, <grad_out of the bag, row before the update>, step by step;
    float64 weights are cast to float32 as fbgemm does (their gradient comes back float64)."""
    torch.manual_seed(0)
    w0 = torch.randn(N, D)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(N, D, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
    )
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(w0)
    shard = roundrobin_shard(mode, x, "rowwise_adagrad", backend=backend)
    shard.load_global_weights(w0)
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        ids, offsets = skewed_batch(gen)
        grad = torch.randn(B, D, generator=gen)
        psw = torch.rand(ids.numel(), generator=gen, dtype=torch.float64 if step % 2 else torch.float32)
        ref_psw = psw.float().clone().requires_grad_(True)
        got_psw = psw.clone().requires_grad_(True)
        tbe(ids, offsets, per_sample_weights=ref_psw).backward(grad)
        shard(ids, offsets, got_psw).backward(grad)
        assert got_psw.grad is not None and got_psw.grad.dtype == psw.dtype, f"step {step}"
        torch.testing.assert_close(got_psw.grad.float(), ref_psw.grad, atol=ATOL, rtol=RTOL, msg=f"step {step}")
        torch.testing.assert_close(global_table(shard)[0], tbe.split_embedding_weights()[0], atol=ATOL, rtol=RTOL)


def _adam_reference(
    w: torch.Tensor,
    m1: torch.Tensor,
    m2: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    grad_out: torch.Tensor,
    t: int,
    b1: float,
    b2: float,
    eps: float,
    wd: float,
) -> torch.Tensor:
    """fbgemm ADAM on the rows the batch touched; gradient from torch autograd."""
    wv = w.clone().requires_grad_(True)
    out = F.embedding_bag(ids, wv, offsets, mode="sum", include_last_offset=True)
    out.backward(grad_out)
    g = wv.grad
    assert g is not None
    rows = torch.unique(ids)
    for r in rows.tolist():
        m1[r] = b1 * m1[r] + (1 - b1) * g[r]
        m2[r] = b2 * m2[r] + (1 - b2) * g[r] * g[r]
        w[r] -= LR * (m1[r] / (1 - b1**t) / (torch.sqrt(m2[r] / (1 - b2**t)) + eps) + wd * w[r])
    return out.detach()


@pytest.mark.parametrize("mode,x", MODES_X)
def test_adam_matches_fbgemm_formula(mode: str, x: float) -> None:
    torch.manual_seed(0)
    w_ref = torch.randn(N, D)
    m1 = torch.zeros(N, D)
    m2 = torch.zeros(N, D)
    cfg = TieredOptimizerConfig(optimizer="adam", learning_rate=LR, weight_decay=0.01)
    shard = TieredEmbeddingShard(
        num_embeddings=N, embedding_dim=D, mode=mode, cache_load_factor=x, optimizer=cfg, dist_type="roundrobin"
    )
    shard.load_global_weights(w_ref)
    gen = torch.Generator().manual_seed(2)
    for t in range(1, 5):
        ids, offsets = skewed_batch(gen)
        grad = torch.randn(B, D, generator=gen)
        out = shard(ids, offsets)
        ref = _adam_reference(w_ref, m1, m2, ids, offsets, grad, t, cfg.beta1, cfg.beta2, cfg.eps, 0.01)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
        out.backward(grad)
        w, s = global_table(shard)
        torch.testing.assert_close(w, w_ref, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(s[:, :D], m1, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(s[:, D:], m2, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_caching_pipelined_lookups_match_fbgemm(policy: str) -> None:
    """forward(i+1) runs before backward(i) (pipeline order) and moves rows in between."""
    torch.manual_seed(0)
    w0 = torch.randn(N, D)
    tbe = fbgemm_tbe("rowwise_adagrad", "sum", w0)
    shard = roundrobin_shard("CACHING", 0.1, "rowwise_adagrad", cache_policy=policy)
    shard.load_global_weights(w0)
    gen = torch.Generator().manual_seed(3)
    batches = [skewed_batch(gen) for _ in range(6)]
    grads = [torch.randn(B, D, generator=gen) for _ in range(6)]
    prev: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    moved = 0.0
    for (ids, offsets), grad in zip(batches, grads):
        ref = tbe(ids, offsets)
        out = shard(ids, offsets)
        moved += shard.tier_stats()["rows_loaded"]
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
        if prev is not None:
            prev[0].backward(prev[2])
            prev[1].backward(prev[2])
        prev = (ref, out, grad)
    assert prev is not None
    prev[0].backward(prev[2])
    prev[1].backward(prev[2])
    w, _ = global_table(shard)
    torch.testing.assert_close(w, tbe.split_embedding_weights()[0], atol=ATOL, rtol=RTOL)
    assert moved > 0


def test_per_sample_weights_and_hashed_local_ids() -> None:
    """Default hash_roundrobin routing: the lookup takes local ids from route_ids."""
    torch.manual_seed(0)
    w0 = torch.randn(N, D)
    tbe = fbgemm_tbe("sgd", "sum", w0)
    shard = TieredEmbeddingShard(
        num_embeddings=N,
        embedding_dim=D,
        mode="HYBRID",
        cache_load_factor=0.3,
        optimizer=TieredOptimizerConfig(optimizer="sgd", learning_rate=LR),
        routing_seed=7,
        split_seed=11,
    )
    shard.load_global_weights(w0)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        ids, offsets = skewed_batch(gen)
        psw = torch.rand(ids.numel(), generator=gen)
        grad = torch.randn(B, D, generator=gen)
        owner, local = route_ids(ids, N, 1, "hash_roundrobin", seed=7)
        assert bool((owner == 0).all())
        ref = tbe(ids, offsets, per_sample_weights=psw)
        out = shard(local, offsets, per_sample_weights=psw)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
        ref.backward(grad)
        out.backward(grad)
    w, _ = global_table(shard)
    torch.testing.assert_close(w, tbe.split_embedding_weights()[0], atol=ATOL, rtol=RTOL)
