"""Pipelines over a planner-made mixed plan: table-wise FUSED, column-wise FUSED, table-wise tiered and
row-wise tiered tables in one model.

The pipeline tests' two-module model (``pipeline_harness``: an EBC with tables t0 and t1, an EC with
table s0) planned by ``PlacementPlanner`` on 2 gloo ranks with fused RowWiseAdagrad. Two plans:

* pinned: t0 table-wise all in the fast tier (torchrec's FUSED table on one rank), t1 row-wise CACHING
  0.5 (a tiered table on every rank), s0 table-wise CACHING 0.3 (a tiered sequence table on one rank);
* budget: no pins, a fast tier too small for every table whole, so the planner itself mixes
  placements (all-fast and HYBRID / CACHING tables);
* column: the same model with 256-wide tables, t0 pinned to torchrec's FUSED table and a fast tier too
  small to hold it whole on one rank, so the planner shards it by columns (2 shards of 128 columns), next to
  t1 row-wise CACHING 0.5 and s0 table-wise CACHING 0.3.

Non-pipelined training, torchrec's ``TrainPipelineSparseDist`` and ``TrainPipelineFusedSparseDist``
(both ``embedding_lookup_after_opt`` values) must give bit-identical losses and predictions at every
step, and the sharded model must hold the plan (table-wise tables on their owner, tiered tables on
every rank).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from harness.gloo import run_gloo
from harness.pipelines import (
    EBC_TABLES,
    EC_TABLES,
    EMB_DIM,
    N_BATCHES,
    TwoModuleModel,
    assert_same,
    make_batches,
    on_cpu,
    run_pipeline,
    run_reference,
    shard_with_dense_adam,
)

WORLD = 2
SEED = 3
# Bytes of one row with RowWiseAdagrad's state (fp32 values + one fp32): the budget arithmetic.
ROW_BYTES = EMB_DIM * 4 + 4
TOTAL_BYTES = sum(rows for _, rows in EBC_TABLES + EC_TABLES) * ROW_BYTES
# The column plan's table width (2 column shards of 128) and t0's bytes whole (fp32 row + RowWiseAdagrad state).
WIDE_DIM = 256
WIDE_T0_BYTES = dict(EBC_TABLES)["t0"] * (WIDE_DIM * 4 + 4)


def _plan(kind: str, model: Any) -> Any:
    """The planner's plan of ``model`` for ``kind`` (see the module docstring)."""
    from recpipe.planner import PlacementConstraints, PlacementPlanner, make_topology

    if kind in ("pinned", "column"):
        fast = 10 * TOTAL_BYTES if kind == "pinned" else int(0.8 * WIDE_T0_BYTES)  # column: t0 not whole
        constraints: Optional[Dict[str, PlacementConstraints]] = {
            "t0": PlacementConstraints(fused=True),
            "t1": PlacementConstraints(sharding_type="row_wise", mode="CACHING", cache_load_factor=0.5),
            "s0": PlacementConstraints(sharding_type="table_wise", mode="CACHING", cache_load_factor=0.3),
        }
    else:  # the largest table (t0, 300 rows) does not fit whole next to the others' shards
        fast, constraints = int(0.45 * TOTAL_BYTES), None
    topology = make_topology(world_size=WORLD, local_world_size=WORLD, hbm_cap=fast, ddr_cap=2**30)
    planner = PlacementPlanner(
        topology, hbm_reservation=0.0, backend="native", communication="gloo_cpu", constraints=constraints, seed=7
    )
    return planner.plan(model)


def _build(kind: str) -> Tuple[Any, Any, Any]:
    """A DMP of the planned model, its dense optimizer, the plan."""
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.tiered_sharders import (
        TieredEmbeddingBagCollectionSharder,
        TieredEmbeddingCollectionSharder,
    )

    torch.manual_seed(SEED)
    model = TwoModuleModel(emb_dim=WIDE_DIM if kind == "column" else EMB_DIM)
    apply_optimizer_in_backward(
        RowWiseAdagrad, list(model.ebc.parameters()) + list(model.ec.parameters()), {"lr": 0.05}
    )
    plan = _plan(kind, model)
    sharders: List[Any] = [TieredEmbeddingBagCollectionSharder(), TieredEmbeddingCollectionSharder()]
    dmp, opt = shard_with_dense_adam(
        model, dict(plan.to_sharding_plan(compute_device="cpu").plan), sharders, torch.device("cpu")
    )
    return dmp, opt, plan


def _layout(dmp: Any, plan: Any) -> Dict[str, Any]:
    """What this rank holds of each table: ``tiered`` / ``fused`` / ``none``."""
    tiered = {**dmp.module.ebc.tiered_tables(), **dmp.module.ec.tiered_tables()}
    state = dmp.state_dict()
    out: Dict[str, Any] = {}
    for p in plan.placements:
        collection = "embedding_bags" if p.module_path == "ebc" else "embeddings"
        weight = state.get(f"{p.module_path}.{collection}.{p.table}.weight")
        local = weight.local_shards() if hasattr(weight, "local_shards") else []
        out[p.table] = "tiered" if p.table in tiered else ("fused" if local else "none")
    return out


def _body(rank: int, world: int, kind: str) -> Dict[str, Any]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    batches = make_batches(rank, n=N_BATCHES, seed=11)
    device = torch.device("cpu")
    dmp, opt, plan = _build(kind)
    out: Dict[str, Any] = {
        "plan": {p.table: (p.sharding_type, p.owner_ranks, p.storage) for p in plan.placements},
        "layout": _layout(dmp, plan),
        "reference": on_cpu(run_reference(dmp, opt, batches)),
    }
    dmp, opt, _ = _build(kind)
    out["torchrec"] = on_cpu(run_pipeline(TrainPipelineSparseDist(dmp, opt, device), batches)[:2])
    for after_opt in (True, False):
        dmp, opt, _ = _build(kind)
        pipe = TrainPipelineFusedSparseDist(dmp, opt, device, embedding_lookup_after_opt=after_opt)
        out[f"fused after_opt={after_opt}"] = on_cpu(run_pipeline(pipe, batches)[:2])
    return out


@pytest.mark.parametrize("kind", ["pinned", "budget", "column"])
def test_mixed_plan_pipelines_bit_identical(kind: str) -> None:
    results = run_gloo(WORLD, _body, kind)
    plan = results[0]["plan"]
    kinds = {(sharding, storage) for sharding, _, storage in plan.values()}
    assert len(kinds) > 1 and {s for _, s in kinds} & {"HYBRID", "CACHING"}, f"{kind}: not a mixed plan: {plan}"
    if kind in ("pinned", "column"):
        t0 = ("table_wise", "FUSED") if kind == "pinned" else ("column_wise", "FUSED")
        assert plan["t0"][::2] == t0 and plan["t1"] == ("row_wise", (), "CACHING"), plan
        assert plan["s0"][::2] == ("table_wise", "CACHING"), plan
    if kind == "column":
        assert sorted(plan["t0"][1]) == [0, 1], plan  # one column shard on each rank
    for rank, res in enumerate(results):
        assert res["plan"] == plan, "the ranks planned differently"
        for table, (sharding, owners, storage) in plan.items():
            kind_here = "fused" if storage == "FUSED" else "tiered"
            want = kind_here if sharding == "row_wise" or rank in owners else "none"
            assert res["layout"][table] == want, (kind, rank, table, res["layout"], plan)
        losses = [float(x) for x in res["reference"][0]]
        assert len(set(losses)) > 1, "constant losses: the comparison has no teeth"
        assert_same(f"{kind} rank {rank} TrainPipelineSparseDist", res["torchrec"], res["reference"])
        for after_opt in (True, False):
            key = f"fused after_opt={after_opt}"
            assert_same(f"{kind} rank {rank} {key}", res[key], res["reference"])
