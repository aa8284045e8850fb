"""The planner sizes each table with the optimizer the model fuses into it, and records it.

The optimizer comes from the model (``apply_optimizer_in_backward``), falling back to the
sharders' fused params and then to the planner's ``optimizer=`` argument, in torchrec's
precedence; the default is the tiered sharders' own fallback. Each table's bytes equal
``recpipe.pipeline.placement.shard_storage`` for its optimizer (the reference); the plan's
``PlacementParams`` and its JSON keep the optimizer and dtype; an optimizer the planner
cannot size is refused, offering only the ones it plans.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import torchrec.optim
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from harness.three_table_ebc import small_topology, three_table_ebc
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec.distributed.utils import add_params_from_parameter_sharding
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim.optimizers import SGD as TorchrecSGD
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from recpipe.pipeline.placement import (
    FUSED_PARAM_OPTIMIZER,
    DistType,
    FusedOptimizerKind,
    Mode,
    PlacementParams,
    max_local_rows,
    row_bytes,
    shard_storage,
)
from recpipe.pipeline.tiered.fused_params import tiered_optimizer_from_fused_params
from recpipe.planner import (
    PlacementConstraints,
    PlacementErrorType,
    PlacementPlan,
    PlacementPlanner,
    PlacementPlannerError,
    TableSpec,
    tables_from_module,
)


def test_planner_sizes_each_table_with_the_models_fused_optimizer() -> None:
    ebc = three_table_ebc()
    apply_optimizer_in_backward(torch.optim.Adam, [ebc.embedding_bags["a"].weight], {"lr": 0.01})
    apply_optimizer_in_backward(RowWiseAdagrad, [ebc.embedding_bags["b"].weight], {"lr": 0.01})
    apply_optimizer_in_backward(torch.optim.SGD, [ebc.embedding_bags["c"].weight], {"lr": 0.01})
    model = torch.nn.Module()
    model.sparse = ebc
    pins = {
        t: PlacementConstraints(sharding_type="row_wise", mode="HYBRID", cache_load_factor=0.5) for t in ("a", "b", "c")
    }
    # optimizer= is only the fallback: the model's own optimizers win
    plan = PlacementPlanner(small_topology(), constraints=pins, optimizer="sgd", backend="native").plan(model)
    want = {"a": FusedOptimizerKind.ADAM, "b": FusedOptimizerKind.ROWWISE_ADAGRAD, "c": FusedOptimizerKind.SGD}
    assert {p.table: p.optimizer for p in plan.placements} == want
    rows = max_local_rows(1001, 4)
    for p in plan.placements:
        s = shard_storage(rows, 32, torch.float32, want[p.table], Mode.HYBRID, 0.5)
        assert (p.hbm_bytes_per_rank, p.ddr_bytes_per_rank) == (s.fast_bytes, s.slow_bytes)
        assert p.dtype is torch.float32
    by = {p.table: p.hbm_bytes_per_rank + p.ddr_bytes_per_rank for p in plan.placements}
    assert by["a"] == rows * row_bytes(32, torch.float32, "adam") == rows * (128 + 256)
    assert by["b"] == rows * (128 + 4) and by["c"] == rows * 128
    # recorded in the plan's PlacementParams, carried by the torchrec plan
    assert plan.placement_params("a") == PlacementParams(
        mode=Mode.HYBRID,
        cache_load_factor=0.5,
        dist_type=DistType.HASH_ROUNDROBIN,
        seed=0,
        optimizer=FusedOptimizerKind.ADAM,
        dtype=torch.float32,
    )
    sp = plan.to_sharding_plan().plan["sparse"]
    for table, opt in want.items():
        assert sp[table].params == plan.placement_params(table)
        assert add_params_from_parameter_sharding({}, sp[table])[FUSED_PARAM_OPTIMIZER] == opt.value
    assert "rowwise_adagrad" in plan.report()


def test_planner_optimizer_fallbacks_follow_torchrecs_precedence() -> None:
    ebc = three_table_ebc()
    apply_optimizer_in_backward(RowWiseAdagrad, [ebc.embedding_bags["a"].weight], {"lr": 0.01})
    # b, c carry none: the sharders' fused params name it, else the planner's optimizer=
    specs = {t.name: t.optimizer for t in tables_from_module(ebc, optimizer="sgd")}
    assert specs == {"a": "rowwise_adagrad", "b": "sgd", "c": "sgd"}
    fused = {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.1}
    specs = {t.name: t.optimizer for t in tables_from_module(ebc, optimizer="sgd", fused_params=fused)}
    assert specs == {"a": "rowwise_adagrad", "b": "adam", "c": "adam"}  # the parameter's wins, as in torchrec
    plan = PlacementPlanner(small_topology(), fused_params=fused).plan(ebc)
    assert [p.optimizer for p in plan.placements] == ["rowwise_adagrad", "adam", "adam"]
    # an explicit EmbOptimType in the optimizer kwargs wins over the class, as in torchrec's sharder
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="s", embedding_dim=8, num_embeddings=50, feature_names=["fs"])],
        device=torch.device("meta"),
    )
    apply_optimizer_in_backward(
        TorchrecSGD,
        ec.parameters(),  # torchrec's wrappers take fbgemm kwargs
        {"lr": 0.1, "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD},
    )
    assert [t.optimizer for t in tables_from_module(ec)] == [FusedOptimizerKind.ROWWISE_ADAGRAD]


def test_planner_default_optimizer_is_the_sharders_fallback() -> None:
    # A model that names no fused optimizer trains its tiered tables with the sharders'
    # fallback (fbgemm's EXACT_SGD, tiered_optimizer_from_fused_params(None)); the plan
    # must be sized for that, or sharding refuses it as a mismatch.
    fallback = tiered_optimizer_from_fused_params(None).optimizer
    assert [t.optimizer for t in tables_from_module(three_table_ebc())] == [fallback] * 3
    plan = PlacementPlanner(small_topology(), backend="native").plan(three_table_ebc())
    for p in plan.placements:
        assert p.optimizer is fallback
        plan.placement_params(p.table).check_runtime(p.table, optimizer=fallback, dtype=torch.float32, dim=32)


def test_planner_refuses_an_optimizer_it_cannot_size() -> None:
    ebc = three_table_ebc()
    apply_optimizer_in_backward(torch.optim.RMSprop, [ebc.embedding_bags["b"].weight], {"lr": 0.01})
    with pytest.raises(PlacementPlannerError) as e:
        PlacementPlanner(small_topology()).plan(ebc)
    assert e.value.planner_error_type is PlacementErrorType.INPUT_VALIDATION
    msg = str(e.value)
    assert "Table 'b'" in msg and "torch.optim.rmsprop.RMSprop" in msg and "Possible solutions" in msg
    # Solution 1 names torchrec.optim classes; each of them must be one the planner plans
    # (the per-element Adagrad, refused for tiered tables, must not be offered).
    offered = re.search(r"1\) fuse one of (.*?) \(", msg).group(1).replace(" or ", ", ").split(", ")
    assert offered == ["SGD", "RowWiseAdagrad", "Adam"], offered
    for name in offered:
        fixed = three_table_ebc()
        apply_optimizer_in_backward(getattr(torchrec.optim, name), [fixed.embedding_bags["b"].weight], {"lr": 0.01})
        expected = {
            "SGD": FusedOptimizerKind.SGD,
            "RowWiseAdagrad": FusedOptimizerKind.ROWWISE_ADAGRAD,
            "Adam": FusedOptimizerKind.ADAM,
        }[name]
        assert PlacementPlanner(small_topology()).plan(fixed).placement("b").optimizer is expected


def test_plan_json_keeps_optimizer_and_dtype(tmp_path: Path) -> None:
    tables = [
        TableSpec(name="x", rows=5000, dim=16, optimizer="rowwise_adagrad"),
        TableSpec(name="y", rows=3000, dim=8, optimizer=EmbOptimType.EXACT_SGD),
    ]
    plan = PlacementPlanner(small_topology(2), dist_type="roundrobin", seed=3, cache_policy="lru").plan(tables)
    # The planner plans float32 rows only (TIERED_DTYPES); the JSON keeps any dtype a plan
    # records, so x's is set by hand to one that is not the default.
    plan.placements[0] = dataclasses.replace(plan.placements[0], dtype=torch.float16)
    plan.save(tmp_path / "p.json")
    back = PlacementPlan.load(tmp_path / "p.json")
    assert back == plan
    assert back.placement_params("x") == PlacementParams(
        mode=back.placement("x").mode,
        cache_load_factor=back.placement("x").cache_load_factor,
        dist_type="roundrobin",
        seed=3,
        cache_policy="lru",
        optimizer="rowwise_adagrad",
        dtype=torch.float16,
    )
    raw = json.loads((tmp_path / "p.json").read_text())
    assert raw["placements"][0]["optimizer"] == "rowwise_adagrad" and raw["placements"][0]["dtype"] == "float16"
    for p in raw["placements"]:
        del p["optimizer"]
    with pytest.raises(ValueError, match=r"table 'x' has no \['optimizer'\].*Re-plan the model"):
        PlacementPlan.from_dict(raw)
