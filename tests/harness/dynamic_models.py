"""The pipeline tests' two-module model with every table dynamic (no tests here).

``raw_key_batches`` turns ``harness.pipelines.make_batches``' ids into raw int64 keys (a fixed odd
multiplier, wrapping: large and negative keys, still distinct); ``build_dynamic`` shards the model with
every table (t0, t1 of the EBC, s0 of the EC) dynamic under one sharding type, capacities small enough
that buckets fill and keys are evicted. Runs inside gloo ranks (module-level functions).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from harness.pipelines import EMB_DIM, TwoModuleModel, TwoSparseBatch, make_batches

#: table -> (module, rows of the config, placement mode, cache load factor, capacity over all ranks)
DYNAMIC_TABLES: Dict[str, Tuple[str, int, str, float, int]] = {
    "t0": ("ebc", 300, "CACHING", 0.25, 64),
    "t1": ("ebc", 200, "HYBRID", 0.5, 256),
    "s0": ("ec", 100, "HYBRID", 1.0, 32),
}
#: Odd, so ``id * KEY_MULTIPLIER`` (mod 2^64) is a bijection of the ids: distinct raw keys, many negative.
KEY_MULTIPLIER: int = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64


def _raw(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() * KEY_MULTIPLIER, lengths=kjt.lengths())


def raw_key_batches(rank: int, n: int, seed: int) -> List[TwoSparseBatch]:
    """``make_batches(rank, n, seed)`` with every id replaced by a raw int64 key."""
    return [
        TwoSparseBatch(b.dense, _raw(b.ebc_features), _raw(b.ec_features), b.labels)
        for b in make_batches(rank, n=n, seed=seed)
    ]


def build_dynamic(
    world: int,
    sharding: str,
    *,
    eviction: str = "lru",
    fused: str = "rowwise_adagrad",
    capacity_scale: float = 1.0,
    backend: Optional[str] = None,
    static: bool = False,
    admit_after: int = 1,
    admission_capacity: Optional[int] = None,
) -> Tuple[Any, Any]:
    """A DMP of ``TwoModuleModel`` with every table dynamic (``sharding``: ``table_wise`` (t0, s0 on rank 0,
    t1 on rank ``1 % world``) or ``row_wise``; keys admitted after ``admit_after`` sightings, counted in ``admission_capacity`` counters), and its dense
    Adam; ``static``: the same plan with the tables
    static tiered (ids in ``[0, num_embeddings)``)."""
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan, ShardingType
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.placement import DynamicTableOptions
    from recpipe.pipeline.tiered.tiered_sharders import (
        TieredEmbeddingBagCollectionSharder,
        TieredEmbeddingCollectionSharder,
    )
    from recpipe.planner.torchrec_plan import (
        PlacementParameterSharding,
        row_wise_sharding_spec,
        table_wise_sharding_spec,
    )

    torch.manual_seed(5)
    model = TwoModuleModel()
    weights = [model.ebc.embedding_bags["t0"].weight, model.ebc.embedding_bags["t1"].weight]
    weights.append(model.ec.embeddings["s0"].weight)
    cls, kwargs = {"sgd": (torch.optim.SGD, {"lr": 0.1}), "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.05})}[fused]
    apply_optimizer_in_backward(cls, weights, dict(kwargs))
    plan: Dict[str, Dict[str, Any]] = {"ebc": {}, "ec": {}}
    for i, (table, (module, rows, mode, x, capacity)) in enumerate(DYNAMIC_TABLES.items()):
        options = DynamicTableOptions(
            capacity=max(int(capacity * capacity_scale), 1),
            eviction=eviction,
            seed=11,
            on_full="ignore",
            admit_after=admit_after,
            admission_capacity=admission_capacity,
        )
        if sharding == "row_wise":
            where: Dict[str, Any] = dict(
                sharding_type=ShardingType.ROW_WISE.value,
                ranks=list(range(world)),
                sharding_spec=row_wise_sharding_spec(rows, EMB_DIM, world, world, "cpu"),
            )
        else:
            owner = i % world if table != "s0" else 0
            where = dict(
                sharding_type=ShardingType.TABLE_WISE.value,
                ranks=[owner],
                sharding_spec=table_wise_sharding_spec(rows, EMB_DIM, owner, world, "cpu"),
            )
        plan[module][table] = PlacementParameterSharding(
            compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
            mode=mode,
            cache_load_factor=x,
            dist_type="hash_roundrobin",
            seed=7,
            dynamic=None if static else options,
            **where,
        )
    dmp = DistributedModelParallel(
        module=model,
        device=torch.device("cpu"),
        plan=ShardingPlan({k: EmbeddingModuleShardingPlan(v) for k, v in plan.items()}),
        sharders=[
            TieredEmbeddingBagCollectionSharder(backend=backend),  # type: ignore[list-item]
            TieredEmbeddingCollectionSharder(backend=backend),
        ],
    )
    opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: torch.optim.Adam(params, lr=0.01)
    )
    return dmp, opt


def dynamic_shards(dmp: Any) -> Dict[str, Any]:
    """Table -> this rank's dynamic shard."""
    return {**dmp.module.ebc.tiered_tables(), **dmp.module.ec.tiered_tables()}
