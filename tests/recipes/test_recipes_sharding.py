"""The recipe's sharding: ``--placement planned`` lets the planner choose each table's sharding type
(``--sharding-types`` restricts it) and ``--placement torchrec_planner`` runs torchrec's planner.

The small synthetic DLRM of the recipe tests (26 tables) sharded on 2 gloo ranks with the recipe's
default fast tier (half the tables' bytes, so placements are tiered): the torchrec plan the model
was sharded with must hold, per table, the sharding type and kernel the planner's report names, and
every table a restricted planner may not choose must be absent.
"""

from __future__ import annotations

from typing import Dict, Tuple

import pytest
import torch
import torch.distributed as dist
from harness.gloo import run_gloo
from harness.recipe_configs import SYNTHETIC
from torchrec.distributed.types import ShardingEnv

from recpipe.recipes.build import shard_model
from recpipe.recipes.config import ConfigError, TrainConfig
from recpipe.recipes.data.registry import make_data_source
from recpipe.recipes.models import EBC_PATH, build_model


def _body(rank: int, world: int, placement: str, sharding_types: str) -> Dict[str, Tuple[str, str]]:
    cfg = TrainConfig(**SYNTHETIC, max_steps=2, placement=placement, sharding_types=sharding_types)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, make_data_source(cfg, rank, world).spec, torch.device("cpu"))
    sharded = shard_model(cfg, model, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    return {name: (ps.sharding_type, ps.compute_kernel) for name, ps in sharded.plan.plan[EBC_PATH].items()}


@pytest.mark.parametrize(
    "sharding_types, allowed",
    [
        ("table_wise,row_wise,column_wise", {"table_wise", "row_wise"}),  # 64-wide tables: no column shards
        ("table_wise,row_wise", {"table_wise", "row_wise"}),
        ("row_wise", {"row_wise"}),
        ("table_wise", {"table_wise"}),
        ("row_wise,table_wise", {"table_wise", "row_wise"}),  # any order
    ],
)
def test_planned_placement_chooses_among_the_allowed_sharding_types(sharding_types: str, allowed: set) -> None:
    plans = run_gloo(2, _body, "planned", sharding_types)
    assert plans[0] == plans[1], "the ranks sharded differently"
    kinds = set(plans[0].values())
    assert {s for s, _ in kinds} <= allowed, kinds
    # the default fast tier binds: the recipe still demonstrates tiered tables
    assert "customized_kernel" in {k for _, k in kinds}, kinds
    if {"table_wise", "row_wise"} <= set(sharding_types.split(",")):
        assert {s for s, _ in kinds} == {"table_wise"}, kinds  # whole tables move W times fewer pooled bytes


def test_torchrec_planner_placement_shards_with_torchrec_kernels() -> None:
    plans = run_gloo(2, _body, "torchrec_planner", "table_wise,row_wise,column_wise")
    assert plans[0] == plans[1] and len(plans[0]) == 26
    assert {k for _, k in plans[0].values()} <= {"fused", "dense"}, plans[0]


def test_an_unknown_sharding_types_value_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(
        ConfigError,
        match=r"sharding_types='data_parallel': unknown sharding type\(s\) 'data_parallel'\. "
        r"Fix: pass a comma-separated subset of table_wise, row_wise, column_wise in any order",
    ):
        TrainConfig(**SYNTHETIC, max_steps=2, sharding_types="data_parallel")
