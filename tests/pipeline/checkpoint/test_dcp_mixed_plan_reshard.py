"""DCP checkpoints of planner-made mixed plans: table-wise tiered and column-wise FUSED tables save,
resume, and reshard to and from row-wise tiered tables and table-wise FUSED tables.

Tables with fused row-wise Adagrad, planned by ``PlacementPlanner`` on 2 gloo ranks with pins, trained 3
steps and saved under plan A, then loaded under every plan of the set:

* ``dcp_models``' three tables: A = t0 table-wise CACHING 0.3, t1 row-wise HYBRID 0.5, t2 table-wise
  FUSED; B = t0 row-wise HYBRID 0.5, t1 table-wise CACHING 0.4, t2 table-wise CACHING 0.5;
* two 256-wide tables and a narrow one: A = w0 column-wise FUSED (2 shards of 128 columns, one per
  rank), w1 table-wise CACHING 0.4, n0 row-wise HYBRID 0.5, loaded under A.

Every table's full weights after the load must equal the saved ones bit for bit (gathered by global row
id), and the next step's outputs must equal the saving job's (exactly under plan A; to float rounding
under plan B, whose pooling order differs). torchrec keeps a column-wise table's row-wise Adagrad state
per row and column shard, which a tiered table cannot hold: loading such a table tiered (B: w0 table-wise
CACHING 0.3), or a tiered table as a column-wise one (C: w1 column-wise FUSED), is refused before anything
is read, naming the table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
from harness.dcp_models import LR, TABLES, TRAIN_STEPS, Model, dense_opt, make_ebc, train_step
from harness.gloo import run_gloo

Tables = List[Tuple[str, int, int, List[str]]]
Plans = Dict[str, Dict[str, Dict[str, Any]]]
PLANS: Plans = {
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

WIDE_TABLES: Tables = [("w0", 40, 256, ["g0"]), ("w1", 30, 256, ["g1", "g2"]), ("n0", 50, 8, ["g3"])]
WIDE_PLANS: Plans = {
    "A": {
        "w0": dict(sharding_type="column_wise"),
        "w1": dict(sharding_type="table_wise", mode="CACHING", cache_load_factor=0.4),
        "n0": dict(sharding_type="row_wise", mode="HYBRID", cache_load_factor=0.5),
    },
    "B": {
        "w0": dict(sharding_type="table_wise", mode="CACHING", cache_load_factor=0.3),
        "w1": dict(sharding_type="table_wise", mode="CACHING", cache_load_factor=0.4),
        "n0": dict(sharding_type="row_wise", mode="HYBRID", cache_load_factor=0.5),
    },
    "C": {
        "w0": dict(sharding_type="column_wise"),
        "w1": dict(sharding_type="column_wise"),
        "n0": dict(sharding_type="row_wise", mode="HYBRID", cache_load_factor=0.5),
    },
}
# name -> (tables, plans, the plans a checkpoint saved under A loads under)
SETS: Dict[str, Tuple[Tables, Plans, Tuple[str, ...]]] = {
    "tiered": (TABLES, PLANS, ("A", "B")),
    "column_wise": (WIDE_TABLES, WIDE_PLANS, ("A",)),
}


def _model(world: int, set_name: str, plan_name: str) -> Any:
    import torch
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder
    from recpipe.planner import PlacementConstraints, PlacementPlanner, make_topology

    tables, plans, _ = SETS[set_name]
    ebc = make_ebc(tables)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": LR})
    model = Model(ebc, sum(d * len(f) for _, _, d, f in tables))
    pins = {name: PlacementConstraints(**pin) for name, pin in plans[plan_name].items()}
    topology = make_topology(world_size=world, local_world_size=world, hbm_cap=2**30, ddr_cap=2**30)
    plan = PlacementPlanner(topology, backend="native", constraints=pins, seed=3).plan(model)
    assert [(p.table, p.sharding_type) for p in plan.placements] == [
        (name, pin.get("sharding_type", "table_wise")) for name, pin in plans[plan_name].items()
    ]
    assert all(sorted(p.ranks) == [0, 1] for p in plan.placements if p.sharding_type == "column_wise")
    sharded = DistributedModelParallel(
        model,
        plan=plan.to_sharding_plan(compute_device="cpu"),
        sharders=[TieredEmbeddingBagCollectionSharder()],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )
    # tiered tables start from the module's initial weights, as the FUSED one does
    full = make_ebc(tables)
    for name, shard in sharded.module.ebc.tiered_tables().items():
        shard.load_global_weights(full.embedding_bags[name].weight.detach())
    return sharded


def _weights(model: Any) -> Dict[str, np.ndarray]:
    from recpipe.pipeline.tiered.migration import gather_full_weights

    return {k: v.numpy() for k, v in sorted(gather_full_weights(model).items())}


def _save_body(rank: int, world: int, root: str, set_name: str) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    tables = SETS[set_name][0]
    model = _model(world, set_name, "A")
    opt = dense_opt(model)
    for step in range(TRAIN_STEPS):
        train_step(model, opt, tables, step, [rank])
    recpipe_dcp.save(model, root)
    return {"weights": _weights(model), "next": train_step(model, opt, tables, TRAIN_STEPS, [rank])}


def _load_body(rank: int, world: int, root: str, set_name: str, plan_name: str) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    model = _model(world, set_name, plan_name)
    recpipe_dcp.load(model, root)
    weights = _weights(model)
    next_step = train_step(model, dense_opt(model), SETS[set_name][0], TRAIN_STEPS, [rank])
    return {"weights": weights, "next": next_step}


@pytest.mark.parametrize("set_name", list(SETS))
def test_owned_tables_resume_and_reshard_through_dcp(tmp_path: Path, set_name: str) -> None:
    saved = run_gloo(2, _save_body, str(tmp_path / "ckpt"), set_name)
    names = [t for t, _, _, _ in SETS[set_name][0]]
    assert sorted(saved[0]["weights"]) == sorted(f"ebc.embedding_bags.{t}.weight" for t in names)
    for plan_name in SETS[set_name][2]:
        loaded = run_gloo(2, _load_body, str(tmp_path / "ckpt"), set_name, plan_name)
        for rank in range(2):
            for key, want in saved[0]["weights"].items():
                np.testing.assert_array_equal(loaded[rank]["weights"][key], want, err_msg=f"{plan_name} {key}")
            for out in ("emb", "pred"):
                got, want = loaded[rank]["next"][out], saved[rank]["next"][out]
                if plan_name == "A":
                    np.testing.assert_array_equal(got, want, err_msg=f"A rank {rank} {out}")
                else:
                    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"B rank {rank} {out}")


def _refused_load_body(rank: int, world: int, root: str, plan_name: str) -> str:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    model = _model(world, "column_wise", plan_name)
    before = _weights(model)
    try:
        recpipe_dcp.load(model, root)
    except recpipe_dcp.CheckpointTableError as e:
        after = _weights(model)
        assert all(np.array_equal(before[k], after[k]) for k in before), "a refused load changed the model"
        return str(e)
    return "loaded"


def test_column_wise_row_wise_adagrad_tables_and_tiered_tables_do_not_reshard_into_each_other(tmp_path: Path) -> None:
    run_gloo(2, _save_body, str(tmp_path / "ckpt"), "column_wise")
    to_tiered = run_gloo(2, _refused_load_body, str(tmp_path / "ckpt"), "B")
    for message in to_tiered:
        assert "'module.ebc.embedding_bags.w0'" in message and "column-wise table (2 accumulators per row" in message
        assert "Nothing was loaded" in message, message
    to_column_wise = run_gloo(2, _refused_load_body, str(tmp_path / "ckpt"), "C")
    for message in to_column_wise:
        assert "'module.ebc.embedding_bags.w1' was tiered when saved" in message, message
        assert "column-wise sharded" in message and "Nothing was loaded" in message, message
