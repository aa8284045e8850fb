"""The tiered sharders enforce the placement contract, on 2 gloo CPU ranks under DMP.

* A plan made from the model (``PlacementPlanner(...).plan(model)`` after
  ``apply_optimizer_in_backward``) builds, and every tiered shard allocates exactly
  the bytes the plan budgeted for its rank (``shard_storage`` with the planned
  optimizer and dtype; rank 0 equals the plan's per-rank bytes).
* A plan whose optimizer differs from the model's (planned for row-wise Adagrad,
  trained with Adam) or whose dtype differs from the table's is refused with a
  ``PlacementMismatchError`` naming the table, both values and the fix; nothing is
  allocated silently.
* A tiered table whose ParameterSharding carries no placement is refused with a
  ``PlacementContractError`` naming the table and the missing keys.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Tuple

import torch
from harness.gloo import run_gloo

TABLES = [("t0", 301, 8), ("t1", 120, 8)]  # name, rows, dim
GiB = 1024**3


def _ebc() -> Any:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f_{n}"])
            for n, r, d in TABLES
        ],
        device=torch.device("cpu"),
    )


def _planner(world: int) -> Any:
    from torchrec.distributed.planner.types import Topology

    from recpipe.planner import PlacementConstraints, PlacementPlanner

    topo = Topology(world_size=world, local_world_size=world, compute_device="cuda", hbm_cap=GiB, ddr_cap=GiB)
    pins = {
        "t0": PlacementConstraints(mode="CACHING", cache_load_factor=0.3),
        "t1": PlacementConstraints(mode="HYBRID", cache_load_factor=0.5),
    }
    # row-wise: every rank allocates a shard of every table, whose bytes the test checks
    return PlacementPlanner(topo, constraints=pins, seed=4, backend="native", sharding_types=("row_wise",))


def _shard(ebc: Any, sharding_plan: Any) -> Any:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    return DistributedModelParallel(
        ebc,
        plan=sharding_plan,
        sharders=[TieredEmbeddingBagCollectionSharder()],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )


def _refusal(fn: Any) -> Tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type and message are the result
        return type(e).__name__, str(e)
    return "", "no error"


def _body(rank: int, world: int) -> Dict[str, Any]:
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.types import ParameterSharding, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.placement import local_rows, shard_storage
    from recpipe.planner import TableSpec

    out: Dict[str, Any] = {}

    # 1) planned from the model: builds, and allocates what the plan budgeted
    ebc = _ebc()
    apply_optimizer_in_backward(torch.optim.Adam, ebc.parameters(), {"lr": 0.01})
    plan = _planner(world).plan(ebc)
    model = _shard(ebc, plan.to_sharding_plan(compute_device="cpu"))
    tiered = model.module.tiered_tables()
    allocated: List[bool] = []
    for p in plan.placements:
        shard = tiered[p.table]
        want = shard_storage(local_rows(p.rows, world, rank), p.dim, p.dtype, p.optimizer, p.mode, p.cache_load_factor)
        got = shard.tier_bytes()
        allocated.append(got == want and shard.optimizer.name == p.optimizer.value)
        if rank == 0:  # the most loaded rank: the plan's per-rank bytes
            allocated.append((got.fast_bytes, got.slow_bytes) == (p.hbm_bytes_per_rank, p.ddr_bytes_per_rank))
    out["allocated_as_planned"] = allocated
    out["optimizers"] = {p.table: p.optimizer.value for p in plan.placements}

    # 2) planned for row-wise Adagrad, trained with Adam: refused
    planned = _ebc()
    apply_optimizer_in_backward(RowWiseAdagrad, planned.parameters(), {"lr": 0.01})
    stale_plan = _planner(world).plan(planned).to_sharding_plan(compute_device="cpu")
    trained = _ebc()
    apply_optimizer_in_backward(torch.optim.Adam, trained.parameters(), {"lr": 0.01})
    out["optimizer_mismatch"] = _refusal(lambda: _shard(trained, stale_plan))

    # 3) planned for float16 rows, the table is float32: refused
    # (the planner plans float32 rows only: the plan's dtype is edited, as a stale or
    # hand-written plan would carry it)
    specs = [TableSpec(name=n, rows=r, dim=d, optimizer="adam") for n, r, d in TABLES]
    planned16 = _planner(world).plan(specs)
    planned16.placements = [dataclasses.replace(p, dtype=torch.float16) for p in planned16.placements]
    fp16_plan = planned16.to_sharding_plan(compute_device="cpu")
    out["dtype_mismatch"] = _refusal(lambda: _shard(trained, fp16_plan))

    # 4) a tiered table whose ParameterSharding carries no placement: refused
    good = plan.to_sharding_plan(compute_device="cpu")
    ps = good.plan[""]["t1"]
    good.plan[""]["t1"] = ParameterSharding(
        sharding_type=ps.sharding_type,
        compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
        ranks=ps.ranks,
        sharding_spec=ps.sharding_spec,
    )
    fresh = _ebc()
    apply_optimizer_in_backward(torch.optim.Adam, fresh.parameters(), {"lr": 0.01})
    out["no_placement"] = _refusal(lambda: _shard(fresh, ShardingPlan(good.plan)))
    return out


def test_sharders_build_planned_tables_and_refuse_disagreeing_ones() -> None:
    for rank, res in enumerate(run_gloo(2, _body)):
        assert res["allocated_as_planned"] and all(res["allocated_as_planned"]), (rank, res["allocated_as_planned"])
        assert res["optimizers"] == {"t0": "adam", "t1": "adam"}

        kind, msg = res["optimizer_mismatch"]
        assert kind == "PlacementMismatchError", (kind, msg)
        assert re.search(
            r"table 't[01]' was planned for fused optimizer rowwise_adagrad, but the model trains "
            r"it with adam",
            msg,
        ), msg
        # dim 8, fp32: 32 + 4 bytes planned, 32 + 64 allocated
        assert "would allocate 96 bytes per row where the plan budgeted 36" in msg
        assert "Possible solutions" in msg and "re-plan with the model" in msg
        assert "change apply_optimizer_in_backward" in msg

        kind, msg = res["dtype_mismatch"]
        assert kind == "PlacementMismatchError", (kind, msg)
        assert re.search(
            r"table 't[01]' was planned for row dtype float16, but the table's data_type is float32", msg
        ), msg

        kind, msg = res["no_placement"]
        assert kind == "PlacementContractError", (kind, msg)
        assert "table 't1'" in msg and "'recpipe_mode'" in msg and "PlacementParameterSharding" in msg
