"""Models, batches and training helpers shared by the DCP checkpoint tests (no tests here).

Provides the tables (``TABLES``, ``IO_TABLES``), the tiered placements saved and
loaded (``SAVE_PLACEMENTS``, ``SWAPPED_PLACEMENTS``), the step count and learning
rate (``TRAIN_STEPS``, ``LR``), the model builders (``make_ebc``, ``Model``: an EBC
with a dense head; ``tiered_model``: t0/t1 tiered, t2 torchrec ROW_WISE, fused
row-wise Adagrad; ``plain_torchrec_model``), one deterministic training step
(``train_step``, with ``dense_opt`` for the head), ``shard_arrays`` (the local
shards of a ShardedTensor as numpy) and ``poison_a_row_of_rank1`` (a NaN row in
rank 1's part of t1). Imported by the tests of tests/pipeline/checkpoint/; the
functions run inside gloo ranks (run_gloo pickles module-level functions by module
name, so everything here is module level and importable as ``harness.dcp_models``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

B, LR, TRAIN_STEPS = 4, 0.05, 3
TABLES = [("t0", 97, 8, ["f0", "f1"]), ("t1", 61, 4, ["f2"]), ("t2", 50, 4, ["f3"])]
SAVE_PLACEMENTS = {
    "t0": dict(mode="HYBRID", cache_load_factor=0.5, seed=3),
    "t1": dict(mode="CACHING", cache_load_factor=0.3, seed=3),
}
SWAPPED_PLACEMENTS = {
    "t0": dict(mode="CACHING", cache_load_factor=0.4, seed=3),
    "t1": dict(mode="HYBRID", cache_load_factor=0.5, seed=3),
}


def make_ebc(tables: List[Tuple[str, int, int, List[str]]], seed: int = 0) -> Any:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(seed)
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=f) for n, r, d, f in tables
        ],
        device=torch.device("cpu"),
    )


class Model(torch.nn.Module):
    def __init__(self, ebc: torch.nn.Module, width: int) -> None:
        super().__init__()
        self.ebc = ebc
        torch.manual_seed(1)
        self.head = torch.nn.Linear(width, 1)

    def forward(self, kjt: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        kt = self.ebc(kjt).to_dict()  # by feature: the KeyedTensor's order follows the sharding
        emb = torch.cat([kt[k] for k in sorted(kt)], dim=1)
        return emb, self.head(emb).squeeze(1)


def _kjt(tables: List[Tuple[str, int, int, List[str]]], step: int, ranks: List[int]) -> Any:
    """The batches of ``ranks`` at ``step``, concatenated (a rank's batch is B samples)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    sizes = {f: rows for _, rows, _, feats in tables for f in feats}
    keys = list(sizes)
    lengths, values = [], []
    for f_i, f in enumerate(keys):
        for r in ranks:
            gen = torch.Generator().manual_seed(1000 * step + 10 * r + f_i)
            ln = torch.randint(0, 5, (B,), generator=gen)
            lengths.append(ln)
            values.append((torch.rand(int(ln.sum()), generator=gen) ** 2 * sizes[f]).long())
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _targets(step: int, ranks: List[int]) -> torch.Tensor:
    return torch.cat([torch.randn(B, generator=torch.Generator().manual_seed(7 * step + r)) for r in ranks])


def tiered_model(
    world: int, placements: Dict[str, Dict[str, Any]], tables: Optional[List[Tuple[str, int, int, List[str]]]] = None
) -> Any:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from harness.tiered_ebc_models import tiered_plan
    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    tables = TABLES if tables is None else tables
    ebc = make_ebc(tables)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": LR})
    sharder = TieredEmbeddingBagCollectionSharder()
    plan = tiered_plan(ebc, sharder, world, placements, tables)
    model = DistributedModelParallel(
        Model(ebc, sum(d * len(f) for _, _, d, f in tables)),
        plan=ShardingPlan({"ebc": plan}),
        sharders=[sharder],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )
    tiered = model.module.ebc.tiered_tables()
    for name in placements:
        tiered[name].load_global_weights(make_ebc(tables).embedding_bags[name].weight.detach())
    return model


def train_step(
    model: Any, opt: torch.optim.Optimizer, tables: List[Any], step: int, ranks: List[int]
) -> Dict[str, Any]:
    emb, pred = model(_kjt(tables, step, ranks))
    loss = ((pred - _targets(step, ranks)) ** 2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"emb": emb.detach().numpy().copy(), "pred": pred.detach().numpy().copy()}


def dense_opt(model: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for n, p in model.named_parameters() if "head" in n], lr=0.01)


def shard_arrays(value: Any) -> List[Tuple[List[int], np.ndarray]]:
    """(offsets, local tensor) of every local shard of a ShardedTensor (or a full tensor)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        return [(list(s.metadata.shard_offsets), s.tensor.detach().numpy().copy()) for s in value.local_shards()]
    return [([0] * value.dim(), value.detach().numpy().copy())]


IO_TABLES = [("a0", 40, 4, ["g0"]), ("a1", 30, 4, ["g1"]), ("a2", 50, 8, ["g2", "g3"])]


def plain_torchrec_model(world: int, owners: Dict[str, int], recpipe_sharder: bool, seed: int) -> Any:
    """a0 / a1 TABLE_WISE on ``owners``, a2 ROW_WISE, all FUSED with row-wise Adagrad;
    torchrec's own EmbeddingBagCollectionSharder, or recpipe's CPU row-wise subclass."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.routing.routed_sharders import routed_sharders

    ebc = make_ebc(IO_TABLES, seed=seed)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": LR})
    sharder: Any = EmbeddingBagCollectionSharder()
    if recpipe_sharder:
        sharder = next(s for s in routed_sharders() if isinstance(s, EmbeddingBagCollectionSharder))
    per = {"a0": table_wise(rank=owners["a0"]), "a1": table_wise(rank=owners["a1"]), "a2": row_wise()}
    plan = construct_module_sharding_plan(
        ebc, per, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
    )
    return DistributedModelParallel(
        Model(ebc, sum(d * len(f) for _, _, d, f in IO_TABLES)),
        plan=ShardingPlan({"ebc": plan}),
        sharders=[sharder],
        device=torch.device("cpu"),
    )


def poison_a_row_of_rank1(model: Any) -> int:
    """Sets one row of tiered table t1 that rank 1 owns to NaN (public API: the full
    table through ``load_global_weights``, whose other rows keep their values);
    returns its global id."""
    import torch.distributed as dist

    shard = model.module.ebc.tiered_tables()["t1"]
    mine = shard.global_ids()
    ids: List[Any] = [None, None]
    dist.all_gather_object(ids, int(mine[0]))
    gid = ids[1]
    full = torch.zeros(shard.num_embeddings, shard.embedding_dim)
    st = shard.export_state()
    full[st.global_ids] = st.weights
    parts: List[Any] = [None, None]
    dist.all_gather_object(parts, (st.global_ids, st.weights))
    for g, w in parts:
        full[g] = w
    full[gid] = float("nan")
    shard.load_global_weights(full)
    return gid
