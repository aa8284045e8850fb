"""The torchrec breadth model of the pipeline tests and its batches (no tests here).

Provides ``BreadthModel`` (two EBCs sharing a feature, a weighted EBC and an EC;
``PostprocBreadthModel`` adds a postproc module), its batches (``BreadthBatch``,
``make_breadth_batches``), ``build_breadth`` (the model sharded by an explicit
plan with fused optimizers, and a dense Adam), ``flatten_outputs`` (nested outputs
as a flat tensor list), ``tbe_counters`` (fbgemm TBEs' ``step`` / ``iter``) and
``final_state`` (parameters, fused optimizer state and TBE counters as numpy).
The functions run inside gloo ranks (run_gloo pickles module-level functions by
module name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

FEATURES: Tuple[Tuple[str, int], ...] = (("a", 50), ("b", 40), ("c", 60), ("unused", 30), ("s", 45))
"""(feature, id range) of the unweighted KJT; no table reads "unused"."""

WEIGHTED: Tuple[Tuple[str, int], ...] = (("a", 50), ("w", 70))
"""(feature, id range) of the weighted KJT ("a" is also in the unweighted one)."""

OVER_IN = 4 + 8 + 16 + 2 * 4 + 8 + 8 + 2 * 3 * 8
"""Dense features + ebc1 (ta 8, tb 16) + ebc2 (tc 4 for c and a) + weighted (8 + 8) + EC (2 features x 3 x 8)."""


@dataclass
class BreadthBatch(Pipelineable):
    """A custom batch: dense features, two KJTs (one weighted), labels and an extra tensor."""

    dense: torch.Tensor
    features: KeyedJaggedTensor
    weighted: KeyedJaggedTensor
    labels: torch.Tensor
    extra: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "BreadthBatch":
        return BreadthBatch(
            self.dense.to(device, non_blocking=non_blocking),
            self.features.to(device, non_blocking=non_blocking),
            self.weighted.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.extra.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self.dense, self.features, self.weighted, self.labels, self.extra):
            t.record_stream(stream)

    def pin_memory(self) -> "BreadthBatch":
        return self


def _kjt(g: torch.Generator, features: Sequence[Tuple[str, int]], bs: int, weighted: bool) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (len(features) * bs,), generator=g)
    values = torch.cat(
        [
            torch.randint(0, rows, (int(lengths[i * bs : (i + 1) * bs].sum()),), generator=g)
            for i, (_, rows) in enumerate(features)
        ]
    )
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f for f, _ in features],
        values=values,
        lengths=lengths,
        weights=torch.rand(values.numel(), generator=g) if weighted else None,
    )


def make_breadth_batches(rank: int, sizes: Sequence[int], seed: int = 0) -> List[BreadthBatch]:
    """One batch per entry of ``sizes`` (its batch size), different data per rank."""
    g = torch.Generator().manual_seed(100 * seed + rank)
    return [
        BreadthBatch(
            dense=torch.randn(bs, 4, generator=g),
            features=_kjt(g, FEATURES, bs, weighted=False),
            weighted=_kjt(g, WEIGHTED, bs, weighted=True),
            labels=torch.randint(0, 2, (bs,), generator=g).float(),
            extra=torch.randn(bs, generator=g),
        )
        for bs in sizes
    ]


class BreadthModel(nn.Module):
    """Two EBCs sharing feature "a", a weighted EBC and an EC; returns (loss, nested outputs).

    Args:
        data_type (DataType): weights of ebc1 / ebc2's tables (FP32 or FP16).
    """

    def __init__(self, data_type: DataType = DataType.FP32) -> None:
        super().__init__()
        cpu = torch.device("cpu")
        self.ebc1 = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="ta", embedding_dim=8, num_embeddings=50, feature_names=["a"], data_type=data_type
                ),
                EmbeddingBagConfig(
                    name="tb",
                    embedding_dim=16,
                    num_embeddings=40,
                    feature_names=["b"],
                    pooling=PoolingType.MEAN,
                    data_type=data_type,
                ),
            ],
            device=cpu,
        )
        self.ebc2 = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="tc", embedding_dim=4, num_embeddings=60, feature_names=["c", "a"], data_type=data_type
                )
            ],
            device=cpu,
        )
        self.wbc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="wa", embedding_dim=8, num_embeddings=50, feature_names=["a"]),
                EmbeddingBagConfig(name="ww", embedding_dim=8, num_embeddings=70, feature_names=["w"]),
            ],
            is_weighted=True,
            device=cpu,
        )
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name="ts", embedding_dim=8, num_embeddings=45, feature_names=["s"]),
                EmbeddingConfig(name="tsa", embedding_dim=8, num_embeddings=50, feature_names=["a"]),
            ],
            device=cpu,
        )
        self.dense = nn.Linear(4, 4)
        self.over = nn.Sequential(nn.Linear(OVER_IN, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, batch: BreadthBatch) -> Tuple[torch.Tensor, Tuple[Any, ...]]:
        pooled = [
            self.ebc1(batch.features).values(),
            self.ebc2(batch.features).values(),
            self.wbc(batch.weighted).values(),
        ]
        seq = self.ec(batch.features)
        seq_flat = [seq[f].to_padded_dense(desired_length=3).flatten(1) for f in ("s", "a")]
        x = torch.cat([self.dense(batch.dense)] + pooled + seq_flat, dim=1)
        logits = self.over(x).squeeze(1) + 0.1 * batch.extra
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), (logits.detach(), {"extra": batch.extra.clone()}))


class IdHalving(nn.Module):
    """A postproc module without parameters (torchrec pipelines it with pipeline_postproc=True)."""

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() // 2, lengths=kjt.lengths())


class PostprocBreadthModel(BreadthModel):
    """``BreadthModel`` whose unweighted KJT goes through a postproc module first."""

    def __init__(self, data_type: DataType = DataType.FP32) -> None:
        super().__init__(data_type)
        self.postproc = IdHalving()

    def forward(self, batch: BreadthBatch) -> Tuple[torch.Tensor, Tuple[Any, ...]]:
        features = self.postproc(batch.features)
        return super().forward(BreadthBatch(batch.dense, features, batch.weighted, batch.labels, batch.extra))


def _generator(kind: str, idx: int, world_size: int) -> Callable[..., ParameterSharding]:
    if kind == "table_wise":
        return table_wise(rank=idx % world_size, compute_kernel="fused")
    if kind == "column_wise":
        return column_wise(ranks=list(range(world_size)), compute_kernel="fused")
    if kind == "row_wise":
        return row_wise(compute_kernel="fused")
    if kind == "table_row_wise":
        inner = table_row_wise(host_index=0)  # torchrec's generator takes no compute kernel

        def fused(*args: Any, **kwargs: Any) -> ParameterSharding:
            ps = inner(*args, **kwargs)
            ps.compute_kernel = "fused"
            return ps

        return fused
    raise ValueError(kind)


def build_breadth(
    shardings: Dict[str, str], fused_params: Dict[str, Any], data_type: DataType = DataType.FP32, postproc: bool = False
) -> Tuple[DistributedModelParallel, KeyedOptimizerWrapper]:
    """The sharded breadth model (tables TABLE_WISE unless ``shardings`` says otherwise)
    and a dense Adam with weight decay over the non-embedding parameters.

    Args:
        shardings (Dict[str, str]): table name -> sharding type.
        fused_params (Dict[str, Any]): the sharders' fused params (optimizer, lr, ...).
        data_type (DataType): ebc1 / ebc2 table weights.
        postproc (bool): build ``PostprocBreadthModel``.
    """
    from recpipe.pipeline.routing.routed_sharders import routed_sharders  # ROW_WISE on CPU

    world_size = dist.get_world_size()
    torch.manual_seed(0)
    model = (PostprocBreadthModel if postproc else BreadthModel)(data_type)
    ebc_sharder, ec_sharder = routed_sharders(fused_params=fused_params)
    plan: Dict[str, Any] = {}
    idx = 0
    for name, sharder in (("ebc1", ebc_sharder), ("ebc2", ebc_sharder), ("wbc", ebc_sharder), ("ec", ec_sharder)):
        module = getattr(model, name)
        tables = module.embedding_bags if hasattr(module, "embedding_bags") else module.embeddings
        per_table = {}
        for table in tables:
            per_table[table] = _generator(shardings.get(table, "table_wise"), idx, world_size)
            idx += 1
        plan[name] = construct_module_sharding_plan(
            module, per_table, sharder=sharder, local_size=world_size, world_size=world_size, device_type="cpu"
        )
    dmp = DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan(plan),
        sharders=[ebc_sharder, ec_sharder],
    )
    opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=0.01, weight_decay=0.01),
    )
    return dmp, opt


def flatten_outputs(out: Any) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out.detach().clone()]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in flatten_outputs(out[k])]
    return [t for o in out for t in flatten_outputs(o)]


def tbe_counters(dmp: nn.Module) -> List[Tuple[int, int]]:
    """(step, iter) of every fbgemm TBE of the sharded modules (torchrec keeps the
    lookups in plain ``_lookups`` lists)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    found: Dict[int, Tuple[int, int]] = {}
    for module in dmp.module.modules():  # a managed-collision module nests its sharded EBC
        for lookup in getattr(module, "_lookups", None) or ():
            for m in lookup.modules():
                if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen):
                    found.setdefault(id(m), (int(m.step), int(m.iter)))
    return list(found.values())


def _flat_state(obj: Any, prefix: str, out: Dict[str, Any]) -> None:
    if hasattr(obj, "local_shards"):
        for j, shard in enumerate(obj.local_shards()):
            out[f"{prefix}#{j}"] = shard.tensor.detach().float().numpy().copy()
    elif isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().float().numpy().copy()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flat_state(v, f"{prefix}/{k}", out)
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            _flat_state(v, f"{prefix}/{k}", out)
    elif isinstance(obj, (int, float)):
        out[prefix] = float(obj)


def final_state(dmp: DistributedModelParallel) -> Dict[str, Any]:
    """Parameters (local shards), fused optimizer state and TBE counters, as numpy / numbers."""
    out: Dict[str, Any] = {}
    _flat_state(dmp.state_dict(), "model", out)
    _flat_state(dmp.fused_optimizer.state_dict(), "fused_optimizer", out)
    out["tbe (step, iter)"] = tbe_counters(dmp)
    return out
