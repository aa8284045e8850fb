"""Row-wise MEAN pooling on CPU (recpipe's sharders) equals the unsharded torchrec module.

* A collection mixing a ROW_WISE MEAN table with TABLE_WISE tables: only the row-wise
  MEAN table's features are divided by their bag lengths.
* VBE KJTs whose keys are not in the shardings' feature order, with a row-wise MEAN
  table: each feature is divided by its own bag lengths.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from harness.gloo import run_gloo
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ParameterSharding,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

LR = 0.1
#: (table, rows, dim, features, pooling, sharding): a row-wise MEAN table between
#: table-wise SUM and MEAN tables
MIXED = [
    ("t0", 37, 8, ["f0"], PoolingType.SUM, "table_wise"),
    ("t1", 21, 4, ["f1", "f2"], PoolingType.MEAN, "row_wise"),
    ("t2", 11, 4, ["f3"], PoolingType.MEAN, "table_wise"),
]
#: every table row-wise MEAN
ALL_ROW_WISE_MEAN = [
    ("t0", 37, 8, ["f0"], PoolingType.MEAN, "row_wise"),
    ("t1", 21, 4, ["f1", "f2"], PoolingType.MEAN, "row_wise"),
    ("t2", 11, 4, ["f3"], PoolingType.MEAN, "row_wise"),
]
#: table-wise SUM tables only next to the row-wise MEAN one (VBE on CPU: fbgemm's TBE takes a
#: VBE batch only when a rank's tables fit one TBE, see README)
MIXED_SUM = [MIXED[0], MIXED[1], ("t2", 11, 4, ["f3"], PoolingType.SUM, "table_wise")]
TABLES = {"mixed": MIXED, "all_row_wise_mean": ALL_ROW_WISE_MEAN, "mixed_sum": MIXED_SUM}


def _plan(world: int, tables: list[tuple[Any, ...]]) -> dict[str, ParameterSharding]:
    out = {}
    for i, (name, n, dim, _, _, kind) in enumerate(tables):
        if kind == "row_wise":
            block = -(-n // world)
            sizes = [max(0, min(block, n - r * block)) for r in range(world)]
            shards = [
                ShardMetadata(shard_offsets=[sum(sizes[:r]), 0], shard_sizes=[sizes[r], dim], placement=f"rank:{r}/cpu")
                for r in range(world)
            ]
            ranks, st = list(range(world)), ShardingType.ROW_WISE.value
        else:
            r = (i + 1) % world
            shards = [ShardMetadata(shard_offsets=[0, 0], shard_sizes=[n, dim], placement=f"rank:{r}/cpu")]
            ranks, st = [r], ShardingType.TABLE_WISE.value
        out[name] = ParameterSharding(
            sharding_type=st,
            compute_kernel=EmbeddingComputeKernel.FUSED.value,
            ranks=ranks,
            sharding_spec=EnumerableShardingSpec(shards),
        )
    return out


def _batch(rank: int, step: int, keys: list[str], rows: dict[str, int], vbe: bool, B: int = 5) -> KeyedJaggedTensor:
    """B samples; ``vbe``: each key its own number of distinct bags, expanded by ``inverse_indices``."""
    g = torch.Generator().manual_seed(100 * step + rank)
    bags = [int(torch.randint(1, B + 1, (1,), generator=g)) if vbe else B for _ in keys]
    lengths = [torch.randint(0, 4, (b,), generator=g) for b in bags]
    values = [torch.randint(0, rows[k], (int(ln.sum()),), generator=g) for k, ln in zip(keys, lengths)]
    if not vbe:
        return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
    inverse = torch.stack([torch.randint(0, b, (B,), generator=g) for b in bags])
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        stride_per_key_per_rank=[[b] for b in bags],
        inverse_indices=(keys, inverse),
    )


def _mixed_pooling_body(rank: int, world: int, tables: str = "mixed", vbe: bool = False) -> dict[str, float]:
    from recpipe.pipeline.routing.routed_sharders import routed_sharders

    MIXED = TABLES[tables]

    configs = [
        EmbeddingBagConfig(name=t, num_embeddings=n, embedding_dim=d, feature_names=fs, pooling=p)
        for t, n, d, fs, p, _ in MIXED
    ]
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    model = DistributedModelParallel(
        EmbeddingBagCollection(tables=configs, device=torch.device("meta")),
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({"": EmbeddingModuleShardingPlan(_plan(world, MIXED))}),
        sharders=routed_sharders(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}),
        init_data_parallel=False,
    )
    ref_w = {t: ref.embedding_bags[t].weight.detach().clone() for t, *_ in MIXED}

    def shards() -> dict[str, list[Any]]:
        sd = model.state_dict()
        return {t: sd[f"embedding_bags.{t}.weight"].local_shards() for t, *_ in MIXED}

    for t, shard_list in shards().items():
        for s in shard_list:
            o, n = s.metadata.shard_offsets[0], s.metadata.shard_sizes[0]
            s.tensor.copy_(ref_w[t][o : o + n])
    rows = {f: n for _, n, _, fs, _, _ in MIXED for f in fs}
    keys = ["f3", "f2", "f0", "f1"]  # not the config's order
    out_err, w_err = 0.0, 0.0
    for step in range(3):
        batches = [_batch(r, step, keys, rows, vbe) for r in range(world)]
        out = model(batches[rank])
        params = {t: torch.nn.Parameter(ref_w[t].clone()) for t in ref_w}
        for t, p in params.items():
            ref.embedding_bags[t].weight = p
        total: Any = 0.0
        for r in range(world):
            ref_out = ref(batches[r])
            for k in sorted(rows):
                probe = torch.linspace(-1, 1, ref_out[k].numel()).view_as(ref_out[k])
                total = total + (ref_out[k] * probe).sum()
                if r == rank:
                    out_err = max(out_err, float((out[k].detach() - ref_out[k].detach()).abs().max()))
        total.backward()
        with torch.no_grad():  # torchrec divides sharded-embedding gradients by the world size
            for t in ref_w:
                ref_w[t] = ref_w[t] - LR * params[t].grad / world
        loss: Any = 0.0
        for k in sorted(rows):
            loss = loss + (out[k] * torch.linspace(-1, 1, out[k].numel()).view_as(out[k])).sum()
        loss.backward()
        for t, shard_list in shards().items():
            for s in shard_list:
                o, n = s.metadata.shard_offsets[0], s.metadata.shard_sizes[0]
                w_err = max(w_err, float((s.tensor - ref_w[t][o : o + n]).abs().max()))
    return {"out_err": out_err, "w_err": w_err}


def test_row_wise_mean_table_next_to_table_wise_tables_matches_unsharded() -> None:
    """An EBC with a ROW_WISE MEAN table and TABLE_WISE SUM and MEAN tables, KJT keys in
    another order than the config: 2 gloo ranks give the unsharded module's outputs and
    trained weights: only the row-wise MEAN table's features are divided by bag lengths."""
    for r in run_gloo(2, _mixed_pooling_body, timeout_s=300):
        assert r["out_err"] < 1e-5 and r["w_err"] < 1e-5, r


@pytest.mark.parametrize("tables", ["all_row_wise_mean", "mixed_sum"])
def test_vbe_kjt_in_another_key_order_with_row_wise_mean_matches_unsharded(tables: str) -> None:
    """VBE KJTs (each key its own batch, expanded by inverse_indices) whose keys are not in
    the shardings' order, through row-wise MEAN tables: 2 gloo ranks give the unsharded
    module's outputs and trained weights: each inverse_indices row is paired with its own
    feature's lengths in the MEAN divisor."""
    for r in run_gloo(2, _mixed_pooling_body, tables, True, timeout_s=300):
        assert r["out_err"] < 1e-5 and r["w_err"] < 1e-5, r


def _shared_feature_body(rank: int, world: int) -> str:
    from recpipe.pipeline.routing.routed_sharders import routed_sharders

    tables = [("ta", 10, 4, ["f"], PoolingType.MEAN, "row_wise"), ("tb", 12, 4, ["f"], PoolingType.SUM, "row_wise")]
    configs = [
        EmbeddingBagConfig(name=t, num_embeddings=n, embedding_dim=d, feature_names=fs, pooling=p)
        for t, n, d, fs, p, _ in tables
    ]
    try:
        DistributedModelParallel(
            EmbeddingBagCollection(tables=configs, device=torch.device("meta")),
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=torch.device("cpu"),
            plan=ShardingPlan({"": EmbeddingModuleShardingPlan(_plan(world, tables))}),
            sharders=routed_sharders(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}),
            init_data_parallel=False,
        )
    except ValueError as e:
        return str(e)
    return "accepted"


def test_feature_shared_by_row_wise_mean_and_sum_tables_is_refused() -> None:
    """One divisor per feature: a feature read by a row-wise MEAN table and a row-wise SUM
    table cannot be pooled right by torchrec's callback (the MEAN table came out as a sum);
    the sharder refuses it, naming the feature, the tables and the fix."""
    for msg in run_gloo(2, _shared_feature_body, timeout_s=300):
        assert "feature 'f' is read by the row-wise MEAN table(s) ['ta'] and by ['tb']" in msg, msg
        assert "Possible solutions:\n  1) give each of these tables its own feature name" in msg, msg
