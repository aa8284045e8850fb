"""DCP checkpoints of planner-made mixed plans: table-wise tiered tables save, resume, and reshard to
and from row-wise tiered tables and torchrec FUSED tables.

``dcp_models``' three tables (t0, t1, t2) with fused row-wise Adagrad, planned by ``PlacementPlanner``
on 2 gloo ranks with pins. Saved under plan A (t0 table-wise CACHING 0.3, t1 row-wise HYBRID 0.5, t2
table-wise FUSED) after 3 steps; loaded under plan A and under plan B (t0 row-wise HYBRID 0.5, t1
table-wise CACHING 0.4, t2 table-wise CACHING 0.5). Every table's full weights after the load must equal
the saved ones bit for bit (gathered by global row id), and the next step's outputs must equal the saving
job's (exactly under plan A; to float rounding under plan B, whose pooling order differs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import numpy as np
from dcp_models import LR, TABLES, TRAIN_STEPS, Model, dense_opt, make_ebc, train_step
from gloo_harness import run_gloo

PLANS: Dict[str, Dict[str, Dict[str, Any]]] = {
    "A": {
        "t0": dict(sharding_type="table_wise", mode="CACHING", cache_load_factor=0.3),
        "t1": dict(sharding_type="row_wise", mode="HYBRID", cache_load_factor=0.5),
        "t2": dict(fused=True),
    },
    "B": {
        "t0": dict(sharding_type="row_wise", mode="HYBRID", cache_load_factor=0.5),
        "t1": dict(sharding_type="table_wise", mode="CACHING", cache_load_factor=0.4),
        "t2": dict(sharding_type="table_wise", mode="CACHING", cache_load_factor=0.5),
    },
}


def _model(world: int, plan_name: str) -> Any:
    import torch
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.sharders import TieredEmbeddingBagCollectionSharder
    from recpipe.planner import PlacementConstraints, PlacementPlanner, make_topology

    ebc = make_ebc(TABLES)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": LR})
    model = Model(ebc, sum(d * len(f) for _, _, d, f in TABLES))
    pins = {name: PlacementConstraints(**pin) for name, pin in PLANS[plan_name].items()}
    topology = make_topology(world_size=world, local_world_size=world, hbm_cap=2**30, ddr_cap=2**30)
    plan = PlacementPlanner(topology, backend="native", constraints=pins, seed=3).plan(model)
    assert [(p.table, p.sharding_type) for p in plan.placements] == [
        (name, pin.get("sharding_type", "table_wise")) for name, pin in PLANS[plan_name].items()
    ]
    sharded = DistributedModelParallel(
        model,
        plan=plan.to_sharding_plan(compute_device="cpu"),
        sharders=[TieredEmbeddingBagCollectionSharder()],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )
    # tiered tables start from the module's initial weights, as the FUSED one does
    full = make_ebc(TABLES)
    for name, shard in sharded.module.ebc.tiered_tables().items():
        shard.load_global_weights(full.embedding_bags[name].weight.detach())
    return sharded


def _weights(model: Any) -> Dict[str, np.ndarray]:
    from recpipe.pipeline.tiered.migration import gather_full_weights

    return {k: v.numpy() for k, v in sorted(gather_full_weights(model).items())}


def _save_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    model = _model(world, "A")
    opt = dense_opt(model)
    for step in range(TRAIN_STEPS):
        train_step(model, opt, TABLES, step, [rank])
    recpipe_dcp.save(model, root)
    return {"weights": _weights(model), "next": train_step(model, opt, TABLES, TRAIN_STEPS, [rank])}


def _load_body(rank: int, world: int, root: str, plan_name: str) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    model = _model(world, plan_name)
    recpipe_dcp.load(model, root)
    weights = _weights(model)
    return {"weights": weights, "next": train_step(model, dense_opt(model), TABLES, TRAIN_STEPS, [rank])}


def test_table_wise_tiered_tables_resume_and_reshard_through_dcp(tmp_path: Path) -> None:
    saved = run_gloo(2, _save_body, str(tmp_path / "ckpt"))
    assert sorted(saved[0]["weights"]) == [f"ebc.embedding_bags.{t}.weight" for t in ("t0", "t1", "t2")]
    for plan_name in ("A", "B"):
        loaded = run_gloo(2, _load_body, str(tmp_path / "ckpt"), plan_name)
        for rank in range(2):
            for key, want in saved[0]["weights"].items():
                np.testing.assert_array_equal(loaded[rank]["weights"][key], want, err_msg=f"{plan_name} {key}")
            for out in ("emb", "pred"):
                got, want = loaded[rank]["next"][out], saved[rank]["next"][out]
                if plan_name == "A":
                    np.testing.assert_array_equal(got, want, err_msg=f"A rank {rank} {out}")
                else:
                    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"B rank {rank} {out}")
