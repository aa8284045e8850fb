"""Non-tiered sharders refuse a plan's tiered tables, naming the tiered sharder to use.

A planner plan marks tiered tables with compute kernel ``customized_kernel``; each of
``routed_sharders()`` refuses such a table naming it and the tiered sharder, while the
tiered sharders' own kernel check takes the same plan.
"""

from __future__ import annotations

import pytest
import torch
from harness.three_table_ebc import small_topology, three_table_ebc

from recpipe.pipeline.routing.routed_sharders import routed_sharders
from recpipe.pipeline.tiered.tiered_sharders import (
    TieredEmbeddingBagCollectionSharder,
    TieredEmbeddingCollectionSharder,
)
from recpipe.planner import PlacementPlanner


def test_non_tiered_sharders_refuse_tiered_tables_naming_the_tiered_sharders() -> None:
    planner = PlacementPlanner(small_topology(2), backend="native", sharding_types=("row_wise",))
    params = planner.plan(three_table_ebc("cpu")).to_sharding_plan(compute_device="cpu").plan[""]
    for sharder in routed_sharders():
        with pytest.raises(
            ValueError,
            match=r"table 'a' has compute_kernel customized_kernel .* which "
            f"{type(sharder).__name__} does not run: shard with "
            r"recpipe\.pipeline\.tiered\.tiered_sharders\.TieredEmbeddingBagCollectionSharder\(\)",
        ):
            sharder.shard(three_table_ebc("cpu"), params, env=None, device=torch.device("cpu"))  # type: ignore[arg-type]
    for tiered in (TieredEmbeddingBagCollectionSharder(), TieredEmbeddingCollectionSharder()):
        tiered._check_kernels(params, torch.device("cpu"))  # runs them: no error
