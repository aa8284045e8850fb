"""Tiered sequence (EmbeddingCollection) tables shared by the tiered tests (no tests here).

Provides the two sequence tables (``TABLES``: s0 looked up by f0 and f1, s1 by f2;
``FEATURES``, ``FEATURE_TABLE``, ``ROWS``, ``PLACEMENT``, ``B``, ``STEPS``, ``LR``,
``DIM``), ``make_ec``, the batches (``kjt_and_grads``: a KJT and exact upstream
gradients) and ``planner_plan`` (recpipe's planner, modes pinned by constraints).
The functions run inside gloo ranks (run_gloo pickles module-level functions by
module name).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

B, STEPS, LR, DIM = 4, 5, 0.125, 8  # samples per rank, steps, SGD lr (a power of two), embedding dim
TABLES = [("s0", 97, ["f0", "f1"]), ("s1", 61, ["f2"])]  # (table, rows, features)
FEATURES = ["f0", "f1", "f2"]
FEATURE_TABLE = {f: t for t, _, fs in TABLES for f in fs}
ROWS = {t: r for t, r, _ in TABLES}
PLACEMENT = {"s0": ("CACHING", 0.3), "s1": ("HYBRID", 0.5)}


def make_ec() -> Any:
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    torch.manual_seed(0)
    return EmbeddingCollection(
        tables=[EmbeddingConfig(name=t, num_embeddings=r, embedding_dim=DIM, feature_names=fs) for t, r, fs in TABLES],
        device=torch.device("cpu"),
    )


def kjt_and_grads(step: int, rank: int) -> Tuple[Any, Dict[str, torch.Tensor]]:
    """The KJT of ``rank`` at ``step`` and the upstream gradient of each feature's rows."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 5, (len(FEATURES) * B,), generator=gen)
    counts = [int(lengths[i * B : (i + 1) * B].sum()) for i in range(len(FEATURES))]
    # a few hot ids per table so rows repeat within and across ranks (cache hits, summed grads)
    values = torch.cat(
        [
            torch.where(
                torch.rand(n, generator=gen) < 0.4,
                torch.randint(0, 6, (n,), generator=gen),
                torch.randint(0, ROWS[FEATURE_TABLE[f]], (n,), generator=gen),
            )
            for f, n in zip(FEATURES, counts)
        ]
    )
    grads = {f: torch.randint(-8, 8, (n, DIM), generator=gen).float() / 16.0 for f, n in zip(FEATURES, counts)}
    kjt = KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths)
    return kjt, grads


def planner_plan(ec: Any, world: int) -> Any:
    from torchrec.distributed.planner.types import Topology

    from recpipe.planner import PlacementPlanner
    from recpipe.planner.specs import PlacementConstraints

    topo = Topology(world_size=world, local_world_size=world, compute_device="cuda", hbm_cap=1 << 30, ddr_cap=1 << 32)
    constraints = {
        t: PlacementConstraints(sharding_type="row_wise", mode=m, cache_load_factor=x)
        for t, (m, x) in PLACEMENT.items()
    }
    placement = PlacementPlanner(topo, constraints=constraints, optimizer="sgd", backend="native").plan(ec)
    return placement.to_sharding_plan(compute_device="cpu")
