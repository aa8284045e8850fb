"""A small model to plan: an EmbeddingBagCollection of three tables (``a``, ``b``, ``c``: 1001 rows
x 32) and a ``cuda`` topology with 8 GiB of HBM and DDR per rank, for planner and sharder tests
that need a plan, not a particular workload."""

from __future__ import annotations

import torch
from torchrec.distributed.planner.types import Topology
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

GiB = 1024**3


def small_topology(world: int = 4) -> Topology:
    """``world`` ranks on one machine, each with 8 GiB of HBM and of DDR."""
    return Topology(world_size=world, local_world_size=world, compute_device="cuda", hbm_cap=8 * GiB, ddr_cap=8 * GiB)


def three_table_ebc(device: str = "meta") -> EmbeddingBagCollection:
    """Tables ``a``, ``b``, ``c`` (1001 x 32, one feature ``f_<name>`` each) on ``device``."""
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, embedding_dim=32, num_embeddings=1001, feature_names=[f"f_{n}"])
            for n in ("a", "b", "c")
        ],
        device=torch.device(device),
    )
