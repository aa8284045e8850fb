"""Planned models at the edges of the planner's input train under torchrec's DMP like plain torch.

A table with fewer rows than ranks next to a table read by three features, weighted
features and EmbeddingCollection tables, each table pinned to a CACHING tier by the
planner: sharded by the tiered sharders on 2 gloo ranks, one fused SGD step gives the
outputs of the unsharded module under plain SGD (the reference).
"""

from __future__ import annotations

from typing import Any

import torch
from harness.gloo import run_gloo

from recpipe.planner import PlacementPlanner, make_topology

GiB = 2**30


def _edge_models() -> dict[str, Any]:
    """Models at the edges of what the planner is given: a table with fewer rows than ranks,
    a table read by several features, weighted features, EmbeddingCollection tables."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    cpu = torch.device("cpu")
    return {
        "tiny_and_multi": lambda: EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="t0", num_embeddings=1, embedding_dim=4, feature_names=["f0"]),
                EmbeddingBagConfig(name="t1", num_embeddings=40, embedding_dim=8, feature_names=["f1", "f2", "f3"]),
            ],
            device=cpu,
        ),
        "weighted": lambda: EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="t0", num_embeddings=40, embedding_dim=4, feature_names=["f0"]),
                EmbeddingBagConfig(name="t1", num_embeddings=30, embedding_dim=4, feature_names=["f1", "f2"]),
            ],
            is_weighted=True,
            device=cpu,
        ),
        "ec": lambda: EmbeddingCollection(
            tables=[
                EmbeddingConfig(name="t0", num_embeddings=40, embedding_dim=4, feature_names=["f0", "f1"]),
                EmbeddingConfig(name="t1", num_embeddings=1, embedding_dim=4, feature_names=["f2"]),
            ],
            device=cpu,
        ),
    }


def _edge_features(module: Any, rank: int, weighted: bool) -> Any:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    cfgs = module.embedding_bag_configs() if isinstance(module, EmbeddingBagCollection) else module.embedding_configs()
    gen = torch.Generator().manual_seed(100 + rank)
    keys, lengths, values = [], [], []
    for c in cfgs:
        for f in c.feature_names:
            n = torch.randint(0, 3, (4,), generator=gen)
            keys.append(f)
            lengths.append(n)
            values.append(torch.randint(0, c.num_embeddings, (int(n.sum()),), generator=gen))
    ids = torch.cat(values)
    return KeyedJaggedTensor(
        keys=keys,
        values=ids,
        lengths=torch.cat(lengths),
        weights=torch.rand(ids.numel(), generator=gen) if weighted else None,
    )


def _edge_outputs(out: Any) -> dict[str, torch.Tensor]:
    from torchrec.sparse.jagged_tensor import JaggedTensor

    return {k: (out[k].values() if isinstance(out[k], JaggedTensor) else out[k]) for k in out.keys()}


def _edge_body(rank: int, world: int) -> dict[str, float]:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from recpipe.pipeline.tiered.tiered_sharders import (
        TieredEmbeddingBagCollectionSharder,
        TieredEmbeddingCollectionSharder,
    )
    from recpipe.planner import PlacementConstraints

    lr = 0.1
    worst: dict[str, float] = {}
    for kind, make in _edge_models().items():
        torch.manual_seed(0)
        weights = make().state_dict()
        weighted = kind == "weighted"
        kjts = [_edge_features(make(), r, weighted) for r in range(world)]
        # the reference: the unsharded module, one plain SGD step on the mean over ranks of each
        # rank's summed outputs (torchrec's DMP divides embedding gradients by the world size,
        # torchrec.distributed.comm_ops.GRADIENT_DIVISION)
        plain = make()
        plain.load_state_dict(weights)
        first_ref = _edge_outputs(plain(kjts[rank]))
        loss = sum(sum(v.sum() for v in _edge_outputs(plain(k)).values()) for k in kjts) / world
        loss.backward()
        with torch.no_grad():
            for p in plain.parameters():
                p -= lr * p.grad
        second_ref = _edge_outputs(plain(kjts[rank]))
        # the planner's plan, each table pinned to a cache over a slow-tier copy
        module = make()
        apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": lr})
        cfgs = (
            module.embedding_bag_configs() if isinstance(module, EmbeddingBagCollection) else module.embedding_configs()
        )
        pins = {c.name: PlacementConstraints(mode="CACHING", cache_load_factor=0.3) for c in cfgs}
        topo = make_topology(world_size=world, local_world_size=world, hbm_cap=GiB, ddr_cap=GiB)
        plan = PlacementPlanner(topo, constraints=pins, backend="native").plan(module)
        dmp = DistributedModelParallel(
            module,
            plan=plan.to_sharding_plan(compute_device="cpu"),
            device=torch.device("cpu"),
            sharders=[TieredEmbeddingBagCollectionSharder(), TieredEmbeddingCollectionSharder()],  # type: ignore[list-item]
        )
        dmp.load_state_dict(weights)  # the full tables, as the unsharded module holds them
        first = _edge_outputs(dmp(kjts[rank]))
        sum(v.sum() for v in first.values()).backward()  # one fused SGD step
        second = _edge_outputs(dmp(kjts[rank]))
        worst[kind] = max(
            float((got[k].detach() - want[k].detach()).abs().max()) if want[k].numel() else 0.0
            for got, want in ((first, first_ref), (second, second_ref))
            for k in want
        )
    return worst


def test_planned_edge_models_train_like_plain_torch() -> None:
    """Checked, found correct: a plan for a table with fewer rows than ranks next to a table read
    by three features, weighted features and EmbeddingCollection tables shards under torchrec's
    DMP and trains one step to the outputs of the unsharded module under plain SGD. (torchrec's
    own row-wise FUSED tables miss that step for the multi-feature table when a 1-row table of
    another dim sits in the same EBC: that reference would have been wrong here.)"""
    for rank, worst in enumerate(run_gloo(2, _edge_body)):
        assert set(worst) == {"tiny_and_multi", "weighted", "ec"}
        assert all(v <= 1e-5 for v in worst.values()), (rank, worst)
