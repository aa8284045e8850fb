"""Non-tiered sharders refuse a plan's tiered tables, naming the tiered sharder to use.

A planner plan marks tiered tables with compute kernel ``customized_kernel``; each of
``routed_sharders()`` refuses such a table naming it and the tiered sharder, while the
tiered sharders' own kernel check takes the same plan.
"""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed.planner.types import Topology
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recpipe.pipeline.routing.routed_sharders import routed_sharders
from recpipe.pipeline.tiered.tiered_sharders import (
    TieredEmbeddingBagCollectionSharder,
    TieredEmbeddingCollectionSharder,
)
from recpipe.planner import PlacementPlanner

GiB = 1024**3


def _topology(world: int = 4) -> Topology:
    return Topology(world_size=world, local_world_size=world, compute_device="cuda", hbm_cap=8 * GiB, ddr_cap=8 * GiB)


def _ebc(device: str = "meta") -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, embedding_dim=32, num_embeddings=1001, feature_names=[f"f_{n}"])
            for n in ("a", "b", "c")
        ],
        device=torch.device(device),
    )


def test_non_tiered_sharders_refuse_tiered_tables_naming_the_tiered_sharders() -> None:
    planner = PlacementPlanner(_topology(2), backend="native", sharding_types=("row_wise",))
    params = planner.plan(_ebc("cpu")).to_sharding_plan(compute_device="cpu").plan[""]
    for sharder in routed_sharders():
        with pytest.raises(
            ValueError,
            match=r"table 'a' has compute_kernel customized_kernel .* which "
            f"{type(sharder).__name__} does not run: shard with "
            r"recpipe\.pipeline\.tiered\.tiered_sharders\.TieredEmbeddingBagCollectionSharder\(\)",
        ):
            sharder.shard(_ebc("cpu"), params, env=None, device=torch.device("cpu"))  # type: ignore[arg-type]
    for tiered in (TieredEmbeddingBagCollectionSharder(), TieredEmbeddingCollectionSharder()):
        tiered._check_kernels(params, torch.device("cpu"))  # runs them: no error
