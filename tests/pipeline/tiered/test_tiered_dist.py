"""Tiered shards on 2 gloo ranks: routed row-wise lookups equal one untiered FUSED table.

Each rank owns one shard of a hash_roundrobin-routed table (rank 0 HYBRID 0.3,
rank 1 CACHING 0.5). Ids are routed with ``recpipe.pipeline.routing.kjt.bucketize_kjt``
and exchanged with ``all_to_all_single``; pooled partial embeddings come back
the same way and are summed (row-wise sharding), gradients travel to the owners.
The reference is fbgemm's CPU TBE (torchrec's FUSED kernel) over the global batch.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from harness.gloo import run_gloo

N, D, B, STEPS, SEED, LR = 301, 8, 6, 4, 5, 0.05
PLACEMENTS = [("HYBRID", 0.3), ("CACHING", 0.5)]


def _batch(step: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 8, (B,), generator=gen)
    ids = (torch.rand(int(lengths.sum()), generator=gen) ** 2 * N).long().clamp(max=N - 1)
    grad = torch.randn(B, D, generator=gen)
    return ids, lengths, grad


def _initial_weights() -> torch.Tensor:
    return torch.randn(N, D, generator=torch.Generator().manual_seed(0))


def _body(rank: int, world: int) -> Dict[str, Any]:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recpipe.pipeline.routing.kjt import bucketize_kjt
    from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig

    mode, x = PLACEMENTS[rank]
    shard = TieredEmbeddingShard(
        num_embeddings=N,
        embedding_dim=D,
        mode=mode,
        cache_load_factor=x,
        optimizer=TieredOptimizerConfig(optimizer="rowwise_adagrad", learning_rate=LR),
        rank=rank,
        world_size=world,
        dist_type="hash_roundrobin",
        routing_seed=SEED,
        split_seed=rank,
    )
    shard.load_global_weights(_initial_weights())
    outs: List[torch.Tensor] = []
    for step in range(STEPS):
        ids, lengths, grad = _batch(step, rank)
        kjt = KeyedJaggedTensor(keys=["f"], values=ids, lengths=lengths)
        routed, _ = bucketize_kjt(kjt, world, {"f": "hash_roundrobin"}, {"f": N}, seed=SEED)
        send_lengths = routed.lengths().view(world, B)
        send_counts = send_lengths.sum(dim=1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        recv_lengths = torch.empty_like(send_lengths)
        dist.all_to_all_single(recv_lengths, send_lengths)
        recv_ids = torch.empty(int(recv_counts.sum()), dtype=routed.values().dtype)
        dist.all_to_all_single(recv_ids, routed.values(), recv_counts.tolist(), send_counts.tolist())
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), recv_lengths.view(-1).cumsum(0)])
        pooled = shard(recv_ids, offsets)  # [world * B, D], source-rank major
        back = torch.empty_like(pooled)
        dist.all_to_all_single(back, pooled.detach().contiguous())
        outs.append(back.view(world, B, D).sum(dim=0))
        grad_to_owners = torch.empty(world * B, D)
        dist.all_to_all_single(grad_to_owners, grad.repeat(world, 1))
        pooled.backward(grad_to_owners)
    st = shard.export_state()
    # numpy arrays pickle by value (torch tensors would travel as shared memory
    # handles that die with the rank process)
    return {
        "outs": [o.numpy() for o in outs],
        "gids": st.global_ids.numpy(),
        "weights": st.weights.numpy(),
        "state": st.optimizer_state.numpy(),
        "stats": shard.tier_stats(),
    }


def test_two_rank_tiered_rowwise_equals_fused_reference() -> None:
    results = run_gloo(2, _body)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(N, D, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
    )
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(_initial_weights())
    for step in range(STEPS):
        batches = [_batch(step, r) for r in range(2)]
        ids = torch.cat([b[0] for b in batches])
        lengths = torch.cat([b[1] for b in batches])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        ref = tbe(ids, offsets)
        for r in range(2):
            torch.testing.assert_close(
                torch.from_numpy(results[r]["outs"][step]), ref[r * B : (r + 1) * B], atol=2e-6, rtol=1e-5
            )
        ref.backward(torch.cat([b[2] for b in batches]))
    w = torch.full((N, D), float("nan"))
    mom = torch.full((N,), float("nan"))
    for r in range(2):
        gids = torch.from_numpy(results[r]["gids"])
        w[gids] = torch.from_numpy(results[r]["weights"])
        mom[gids] = torch.from_numpy(results[r]["state"][:, 0])
    assert sum(results[r]["gids"].size for r in range(2)) == N
    assert results[1]["stats"]["cumulative_hit_rate"] > 0.0  # the CACHING rank did use its cache
    torch.testing.assert_close(w, tbe.split_embedding_weights()[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(mom, tbe.split_optimizer_states()[0][0], atol=2e-6, rtol=1e-5)
