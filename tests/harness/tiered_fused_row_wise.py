"""The row-wise EBC of the tiered-vs-FUSED tests: t0 tiered or FUSED, t1 FUSED (no tests here).

Provides ``PLACEMENT`` (t0's tiered placement: CACHING, load factor 0.2, seed 3) and
``row_wise_model`` (the EBC of ``harness.tiered_ebc_models`` with row-wise Adagrad in
backward, sharded ROW_WISE by the tiered sharder: t0 tiered or torchrec's FUSED kernel, t1
FUSED, both from the same initial tables). The functions run inside gloo ranks (run_gloo
pickles module-level functions by module name).
"""

from __future__ import annotations

from typing import Any, Dict

import torch

import harness.tiered_ebc_models as pooled

PLACEMENT: Dict[str, Dict[str, Any]] = {"t0": dict(mode="CACHING", cache_load_factor=0.2, seed=3)}


def row_wise_model(world: int, tiered: bool) -> Any:
    """The EBC sharded ROW_WISE over ``world`` ranks by the tiered sharder.

    Args:
        world (int): the number of ranks (torch.distributed is initialised).
        tiered (bool): t0 tiered with ``PLACEMENT`` if True, else torchrec's FUSED kernel.

    Returns:
        Any: the DistributedModelParallel, its tables holding ``pooled.make_ebc()``'s weights.
    """
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    weights = {
        f"embedding_bags.{n}.weight": pooled.make_ebc().embedding_bags[n].weight.detach().clone()
        for n, *_ in pooled.TABLES
    }
    ebc = pooled.make_ebc()
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": pooled.LR})
    sharder = TieredEmbeddingBagCollectionSharder()
    plan = pooled.tiered_plan(ebc, sharder, world, PLACEMENT if tiered else {})
    model = DistributedModelParallel(
        ebc,
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )
    pooled.copy_global_weights(model.module.state_dict(), weights)
    for name, shard in model.module.tiered_tables().items():
        shard.load_global_weights(weights[f"embedding_bags.{name}.weight"])
    return model
