"""Single tiered shards and their fbgemm reference, shared by the tiered shard tests (no tests here).

Provides the table size and batch shape (``N``, ``D``, ``B``), the learning rate (``LR``),
the fp32 tolerance against fbgemm (``ATOL``, ``RTOL``), the placements every exactness
test runs (``MODES_X``), ``skewed_batch`` (ids with many duplicates in bags of 0..9 ids),
``fbgemm_tbe`` (fbgemm's CPU TBE, torchrec's FUSED kernel, holding given weights),
``roundrobin_shard`` (a W = 1 roundrobin ``TieredEmbeddingShard``: local id == global id)
and ``global_table`` (a shard's export as full weight and optimizer-state tables).
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig

N, D, B = 240, 8, 12
LR = 0.05
# fp32 tolerance: SGD matches fbgemm bit for bit; Adagrad/Adam differ by a few ulps
# (fbgemm accumulates the row mean of g^2 in a different order).
ATOL, RTOL = 2e-6, 1e-5

MODES_X: List[Tuple[str, float]] = [(m, x) for m in ("HYBRID", "CACHING") for x in (0.1, 0.5, 1.0)]


def skewed_batch(gen: torch.Generator, n_rows: int = N, batch: int = B) -> Tuple[torch.Tensor, torch.Tensor]:
    """Skewed ids (many duplicates) in bags of 0..9 ids, some empty.

    Args:
        gen (torch.Generator): the source of the ids and bag lengths.
        n_rows (int): ids are drawn from ``[0, n_rows)``.
        batch (int): the number of bags.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: the ids and the ``batch + 1`` offsets of the bags.
    """
    lengths = torch.randint(0, 10, (batch,), generator=gen)
    ids = (torch.rand(int(lengths.sum()), generator=gen) ** 3 * n_rows).long().clamp(max=n_rows - 1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return ids, offsets


def fbgemm_tbe(optimizer: str, pooling: str, w0: torch.Tensor) -> SplitTableBatchedEmbeddingBagsCodegen:
    """fbgemm's CPU TBE of one ``N`` x ``D`` table holding ``w0``, the reference of the exactness tests.

    Args:
        optimizer (str): ``"sgd"`` (``EXACT_SGD``) or ``"rowwise_adagrad"`` (``EXACT_ROWWISE_ADAGRAD``).
        pooling (str): ``"sum"`` or ``"mean"``.
        w0 (torch.Tensor): the initial ``[N, D]`` weights.

    Returns:
        SplitTableBatchedEmbeddingBagsCodegen: the TBE, learning rate ``LR``.
    """
    optim = {"sgd": OptimType.EXACT_SGD, "rowwise_adagrad": OptimType.EXACT_ROWWISE_ADAGRAD}[optimizer]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(N, D, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=optim,
        learning_rate=LR,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM if pooling == "sum" else PoolingMode.MEAN,
    )
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(w0)
    return tbe


def roundrobin_shard(mode: str, x: float, optimizer: str, pooling: str = "sum", **kw: object) -> TieredEmbeddingShard:
    """A W = 1 shard of an ``N`` x ``D`` table (roundrobin unless ``kw`` names a ``dist_type``).

    Args:
        mode (str): the tier mode, ``"HYBRID"`` or ``"CACHING"``.
        x (float): the cache load factor.
        optimizer (str): the fused optimizer, learning rate ``LR``.
        pooling (str): ``"sum"`` or ``"mean"``.
        **kw: further ``TieredEmbeddingShard`` arguments.

    Returns:
        TieredEmbeddingShard: the shard; with roundrobin routing its local id is the global id.
    """
    kw.setdefault("dist_type", "roundrobin")
    return TieredEmbeddingShard(
        num_embeddings=N,
        embedding_dim=D,
        mode=mode,
        cache_load_factor=x,
        optimizer=TieredOptimizerConfig(optimizer=optimizer, learning_rate=LR),
        pooling=pooling,
        **kw,  # type: ignore[arg-type]
    )


def global_table(shard: TieredEmbeddingShard) -> Tuple[torch.Tensor, torch.Tensor]:
    """The shard's export as full tables by global id (NaN rows where the shard holds none).

    Args:
        shard (TieredEmbeddingShard): the shard to export.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: the ``[num_embeddings, dim]`` weights and the
        ``[num_embeddings, state columns]`` optimizer state.
    """
    st = shard.export_state()
    w = torch.full((shard.num_embeddings, shard.embedding_dim), float("nan"))
    s = torch.full((shard.num_embeddings, st.optimizer_state.shape[1]), float("nan"))
    w[st.global_ids] = st.weights
    s[st.global_ids] = st.optimizer_state
    return w, s
