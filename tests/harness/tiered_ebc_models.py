"""Tiered and torchrec FUSED EmbeddingBagCollections shared by the tiered tests (no tests here).

Provides the two pooled tables (``TABLES``: t0 looked up by f0 and f1, t1 by f2;
``FEATURES``, ``B``, ``LR``), ``make_ebc``, the batches (``kjt_and_grad``), the plans
(``table_wise_plan``: torchrec's TABLE_WISE reference; ``tiered_plan``: row-wise with
tiered tables), ``copy_global_weights`` (full tables into a rank's shards), the
warm-up model of the optimizer tests (``EbcWithHead``, ``warmup_model``,
``warmup_batches``) and the fused-vs-tiered models of the migration tests
(``fused_model``, ``tiered_model``, ``initial_weights``, ``train_step``,
``max_divergence``, ``K``, ``K2``, ``ATOL``, ``RTOL``). The builders read ``TABLES``
when called. The functions run inside gloo ranks (run_gloo pickles module-level
functions by module name).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

B, LR = 4, 0.05  # samples per rank per batch, learning rate of the fused optimizers
TABLES = [("t0", 97, 8, ["f0", "f1"]), ("t1", 50, 4, ["f2"])]
FEATURES = ["f0", "f1", "f2"]
K, K2 = 3, 4  # steps before / after a migration or a checkpoint
ATOL, RTOL = 2e-6, 1e-5  # tolerance of tiered vs FUSED tables (test_tiered_sharders)


def make_ebc(
    pooling: str = "SUM",
    tables: Sequence[str] = ("t0", "t1"),
    is_weighted: bool = False,
    init: Optional[Sequence[float]] = None,
) -> Any:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=n,
                num_embeddings=r,
                embedding_dim=d,
                feature_names=f,
                pooling=PoolingType[pooling],
                weight_init_min=init[0] if init else None,
                weight_init_max=init[1] if init else None,
            )
            for n, r, d, f in TABLES
            if n in tables
        ],
        device=torch.device("cpu"),
        is_weighted=is_weighted,
    )


def kjt_and_grad(step: int, rank: int) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(100 * step + rank)
    sizes = {"f0": 97, "f1": 97, "f2": 50}
    lengths = torch.randint(0, 5, (len(FEATURES) * B,), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, sizes[f], (int(lengths[i * B : (i + 1) * B].sum()),), generator=gen)
            for i, f in enumerate(FEATURES)
        ]
    )
    return KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths), torch.randn(B, 20, generator=gen)


def copy_global_weights(local: Dict[str, Any], global_weights: Dict[str, torch.Tensor]) -> None:
    """Copies global tables into this rank's ShardedTensor shards (views of the FUSED weights)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for name, t in local.items():
        if ".tiered." in name:  # tiered rows' export (checked by the state_dict test)
            continue
        if name.endswith("embedding_bags.t0.weight") and not isinstance(t, ShardedTensor):
            assert t.numel() == 0  # tiered table: torchrec-style empty placeholder
            continue
        assert isinstance(t, ShardedTensor), name
        for shard in t.local_shards():
            r0, c0 = shard.metadata.shard_offsets
            rows, cols = shard.tensor.shape
            with torch.no_grad():
                shard.tensor.copy_(global_weights[name][r0 : r0 + rows, c0 : c0 + cols])


def table_wise_plan(ebc: Any, sharder: Any, world: int) -> Any:
    """torchrec's reference plan of the two tables: t0 TABLE_WISE on rank 0, t1 on rank 1."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise

    return construct_module_sharding_plan(
        ebc,
        {"t0": table_wise(rank=0), "t1": table_wise(rank=1)},
        sharder=sharder,
        local_size=world,
        world_size=world,
        device_type="cpu",
    )


def tiered_plan(
    ebc: Any, sharder: Any, world: int, placements: Dict[str, Dict[str, Any]], tables: Optional[Sequence[Any]] = None
) -> Any:
    """Row-wise plan of the EBC's tables (``tables``, default :data:`TABLES`); the tables in
    ``placements`` become tiered (CUSTOMIZED_KERNEL, hash_roundrobin) with the given mode /
    load factor / seed."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingType

    from recpipe.planner.torchrec_plan import PlacementParameterSharding, row_wise_sharding_spec

    plan = construct_module_sharding_plan(
        ebc,
        {name: row_wise() for name in ebc.embedding_bags},
        sharder=sharder,  # type: ignore[arg-type]
        local_size=world,
        world_size=world,
        device_type="cpu",
    )
    shapes = {name: (rows, dim) for name, rows, dim, _ in (TABLES if tables is None else tables)}
    for name, placement in placements.items():
        rows, dim = shapes[name]
        plan[name] = PlacementParameterSharding(
            sharding_type=ShardingType.ROW_WISE.value,
            compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
            ranks=list(range(world)),
            sharding_spec=row_wise_sharding_spec(rows, dim, world, world, "cpu"),
            dist_type="hash_roundrobin",
            **placement,
        )
    return plan


class EbcWithHead(torch.nn.Module):
    """EBC + a linear head; returns (loss, output) as torchrec pipelines expect (output
    = (loss, prediction): ``TrainPipelineSparseDist.progress`` returns the output only)."""

    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        torch.manual_seed(1)
        self.head = torch.nn.Linear(20, 1)

    def forward(self, batch: Any) -> Any:
        pred = self.head(self.ebc(batch.sparse_features).values()).squeeze(1)
        loss = ((pred - batch.labels) ** 2).sum()
        return loss, (loss.detach(), pred.detach())


WARMUP_STEPS = 6  # batches of warmup_batches


def warmup_batches(rank: int) -> List[Any]:
    from torchrec.datasets.utils import Batch

    batches = []
    for step in range(WARMUP_STEPS):
        kjt, _ = kjt_and_grad(step, rank)
        labels = torch.randn(B, generator=torch.Generator().manual_seed(7 * step + rank))
        batches.append(Batch(dense_features=torch.zeros(B, 1), sparse_features=kjt, labels=labels))
    return batches


def warmup_model(
    world: int, placements: Any, backend: Optional[str] = None, fused_params: Optional[Dict[str, Any]] = None
) -> Any:
    """``EbcWithHead`` over the EBC with row-wise Adagrad (lr 0.05): ``placements`` None is
    torchrec's own TABLE_WISE FUSED sharding (the reference; t0 on rank 0, t1 on rank 1),
    else recpipe's row-wise plan with those tables tiered (on ``backend``, with the tiered
    sharder's ``fused_params``); both from the same initial tables."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    weights = {f"embedding_bags.{n}.weight": make_ebc().embedding_bags[n].weight.detach().clone() for n, *_ in TABLES}
    ebc = make_ebc()
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.05})
    if placements is None:
        sharder: Any = EmbeddingBagCollectionSharder()
        plan = table_wise_plan(ebc, sharder, world)
    else:
        sharder = TieredEmbeddingBagCollectionSharder(backend=backend, fused_params=fused_params)
        plan = tiered_plan(ebc, sharder, world, placements)
    model = DistributedModelParallel(
        EbcWithHead(ebc),
        plan=ShardingPlan({"ebc": plan}),
        sharders=[sharder],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )
    copy_global_weights(
        {
            k[len("ebc.") :]: v
            for k, v in model.module.state_dict().items()
            if k.startswith("ebc.") and isinstance(v, ShardedTensor)
        },
        weights,
    )
    for name, shard in getattr(model.module.ebc, "tiered_tables", dict)().items():
        shard.load_global_weights(weights[f"embedding_bags.{name}.weight"])
    return model


def initial_weights() -> Dict[str, torch.Tensor]:
    return {f"embedding_bags.{n}.weight": make_ebc().embedding_bags[n].weight.detach().clone() for n, *_ in TABLES}


def apply_optimizer(ebc: Any, optimizer: str) -> None:
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    cls = RowWiseAdagrad if optimizer == "rowwise_adagrad" else torch.optim.Adam
    apply_optimizer_in_backward(cls, ebc.parameters(), {"lr": LR})


def fused_model(world: int, optimizer: str, kind: str = "table_wise") -> Any:
    """torchrec FUSED tables: ``table_wise``, torchrec's own sharder (t0 on rank 0, t1 on rank 1);
    ``row_wise_routed``, ROW_WISE with recpipe's routing (t0 hash_roundrobin, t1 roundrobin:
    each shard holds routed rows, not its offsets' range)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    ebc = make_ebc()
    apply_optimizer(ebc, optimizer)
    if kind == "table_wise":
        sharder: Any = EmbeddingBagCollectionSharder()
        plan = table_wise_plan(ebc, sharder, world)
    else:
        sharder = TieredEmbeddingBagCollectionSharder(
            table_dist_types={"t0": "hash_roundrobin", "t1": "roundrobin"}, seed=11
        )
        plan = tiered_plan(ebc, sharder, world, {})
    model = DistributedModelParallel(
        ebc,
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )
    model.load_state_dict(initial_weights(), strict=False)  # torchrec slices, routed tables pick their rows
    return model


def tiered_model(world: int, optimizer: str, placements: Dict[str, Dict[str, Any]], backend: str = "native") -> Any:
    """recpipe's model: every table tiered (ROW_WISE, hash_roundrobin) with ``placements``, on
    ``backend`` (``fbgemm``: fbgemm's CPU TBE holds the rows and their state, in its layout)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    ebc = make_ebc()
    apply_optimizer(ebc, optimizer)
    sharder = TieredEmbeddingBagCollectionSharder(backend=backend)
    plan = tiered_plan(ebc, sharder, world, placements)
    model = DistributedModelParallel(
        ebc,
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )
    model.load_state_dict(initial_weights(), strict=False)
    return model


def train_step(model: Any, step: int, rank: int) -> np.ndarray:
    kjt, grad = kjt_and_grad(step, rank)
    out = model(kjt).values()
    out.backward(grad)
    return out.detach().numpy().copy()


def max_divergence(got: List[np.ndarray], want: List[np.ndarray]) -> float:
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want))
