"""TieredEmbeddingBagCollectionSharder on 2 gloo CPU ranks under DistributedModelParallel.

Table t0 is a recpipe tiered table (ROW_WISE, CUSTOMIZED_KERNEL, hash_roundrobin,
HYBRID 0.3, looked up by two features); t1 a plain torchrec table (ROW_WISE FUSED,
continuous routing through recpipe's op), both on CPU where torchrec's own sharder
offers no ROW_WISE. Reference: the same EBC sharded TABLE_WISE with torchrec's own
sharder and FUSED kernels, same initial weights and fused row-wise Adagrad; the
pooled outputs must agree step by step (they depend on every earlier update).

A KJT with a variable batch size per feature (VBE) is refused for tiered tables (one,
one beside a FUSED table, two) by the sharded EBC's ``input_dist`` on every rank, with
one ValueError naming the tiered tables, their features and the possible solutions,
both of which the test then runs.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import pytest
import torch
from harness.gloo import run_gloo
from harness.tiered_ebc_models import (
    FEATURES,
    LR,
    TABLES,
    WARMUP_STEPS,
    B,
    EbcWithHead,
    copy_global_weights,
    kjt_and_grad,
    make_ebc,
    table_wise_plan,
    tiered_plan,
    warmup_batches,
    warmup_model,
)

STEPS = 4


def _body(rank: int, world: int, pooling: str, backend: Optional[str] = None) -> Dict[str, List[Any]]:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    global_weights = {
        f"embedding_bags.{n}.weight": make_ebc().embedding_bags[n].weight.detach().clone() for n, *_ in TABLES
    }
    device = torch.device("cpu")
    results: Dict[str, List[Any]] = {"tiered": [], "ref": [], "stats": [], "backend": []}
    for kind in ("tiered", "ref"):
        ebc = make_ebc(pooling)
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": LR})
        if kind == "tiered":
            sharder = TieredEmbeddingBagCollectionSharder(backend=backend)
            plan = tiered_plan(ebc, sharder, world, {"t0": dict(mode="HYBRID", cache_load_factor=0.3, seed=3)})
        else:
            sharder = EmbeddingBagCollectionSharder()
            plan = table_wise_plan(ebc, sharder, world)
        model = DistributedModelParallel(
            ebc,
            plan=ShardingPlan({"": plan}),
            sharders=[sharder],  # type: ignore[list-item]
            device=device,
        )
        copy_global_weights(model.module.state_dict(), global_weights)
        if kind == "tiered":
            tiered = model.module.tiered_tables()
            assert set(tiered) == {"t0"}
            # an unsharded module's full weight loads into the tiered rows (by global id)
            # through the sharded module's load_state_dict pre-hook
            model.module.load_state_dict(
                {"embedding_bags.t0.weight": global_weights["embedding_bags.t0.weight"].clone()}, strict=False
            )
            assert tiered["t0"].dist_type == "hash_roundrobin" and tiered["t0"].fast_rows == int(0.3 * 49)
            results["backend"].append(tiered["t0"].backend)
        for step in range(STEPS):
            kjt, grad = kjt_and_grad(step, rank)
            out = model(kjt).values()
            results[kind].append(out.detach().numpy().copy())
            out.backward(grad)
        if kind == "tiered":
            results["stats"].append(model.module.tiered_tables()["t0"].tier_stats())
    return results


@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
def test_dmp_row_wise_tiered_equals_torchrec_table_wise_fused(pooling: str) -> None:
    """MEAN: each rank pools part of a bag; torchrec divides by the whole bag's length
    after the output all-to-all, so the tiered shard must pool with SUM."""
    results = run_gloo(2, _body, pooling)
    for rank, res in enumerate(results):
        for step in range(STEPS):
            torch.testing.assert_close(
                torch.from_numpy(res["tiered"][step]),
                torch.from_numpy(res["ref"][step]),
                atol=2e-6,
                rtol=1e-5,
                msg=f"rank {rank} step {step}",
            )
        assert res["stats"][0]["lookups"] > 0


def _fp_body(rank: int, world: int, backend: Optional[str]) -> Dict[str, List[Any]]:
    """A FeatureProcessedEmbeddingBagCollection (position weights on every feature) sharded
    by torchrec's FP sharder around the tiered sharder, t0 tiered (CACHING, continuous
    routing) and t1 FUSED, both row-wise; position weights train with SGD. Reference: on
    1 rank torchrec's own FP sharder (TABLE_WISE FUSED); on 2 ranks t0 FUSED too (each
    rank trains its own copy of the position weights, torchrec's rule, from the ids routed
    to it, so the routing must be the same)."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan, ShardingType
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder
    from recpipe.planner.torchrec_plan import PlacementParameterSharding, row_wise_sharding_spec

    prefix = "_embedding_bag_collection.embedding_bags."
    global_weights = {f"{prefix}{n}.weight": make_ebc().embedding_bags[n].weight.detach().clone() for n, *_ in TABLES}
    results: Dict[str, List[Any]] = {}
    for kind in ("tiered", "ref"):
        ebc = make_ebc(is_weighted=True)
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": LR})
        module = FeatureProcessedEmbeddingBagCollection(
            ebc, PositionWeightedModuleCollection(max_feature_lengths={f: 5 for f in FEATURES})
        )
        if kind == "ref" and world == 1:
            sharder: Any = FeatureProcessedEmbeddingBagCollectionSharder()
            plan = construct_module_sharding_plan(
                module,
                {"t0": table_wise(rank=0), "t1": table_wise(rank=0)},
                sharder=sharder,
                local_size=1,
                world_size=1,
                device_type="cpu",
            )
        else:
            sharder = FeatureProcessedEmbeddingBagCollectionSharder(
                ebc_sharder=TieredEmbeddingBagCollectionSharder(backend=backend)
            )  # type: ignore[arg-type]
            plan = construct_module_sharding_plan(
                module,
                {"t0": row_wise(), "t1": row_wise()},
                sharder=sharder,
                local_size=world,
                world_size=world,
                device_type="cpu",
            )
            if kind == "tiered":
                plan["t0"] = PlacementParameterSharding(
                    sharding_type=ShardingType.ROW_WISE.value,
                    compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
                    ranks=list(range(world)),
                    sharding_spec=row_wise_sharding_spec(97, 8, world, world, "cpu"),
                    dist_type="continuous",
                    mode="CACHING",
                    cache_load_factor=0.3,
                    seed=3,
                )
        model = DistributedModelParallel(
            module, plan=ShardingPlan({"": plan}), sharders=[sharder], device=torch.device("cpu")
        )
        copy_global_weights(
            {k: v for k, v in model.module.state_dict().items() if "position_weight" not in k}, global_weights
        )
        if kind == "tiered":
            model.module.load_state_dict({f"{prefix}t0.weight": global_weights[f"{prefix}t0.weight"]}, strict=False)
            assert set(model.module._embedding_bag_collection.tiered_tables()) == {"t0"}
        positions = [p for n, p in sorted(model.named_parameters()) if "position_weight" in n]
        assert len(positions) == len(FEATURES)
        dense = torch.optim.SGD(positions, lr=0.5)
        results[kind] = []
        for step in range(STEPS):
            kjt, grad = kjt_and_grad(step, rank)
            dense.zero_grad()
            out = model(kjt).values()
            results[kind].append(out.detach().numpy().copy())
            out.backward(grad)
            dense.step()
        results[f"pos_{kind}"] = [p.detach().numpy().copy() for p in positions]
    return results


@pytest.mark.parametrize("world, backend", [(1, "native"), (2, "native"), (2, "torch"), (2, "fbgemm")])
def test_feature_processed_ebc_trains_position_weights_on_tiered_tables(world: int, backend: str) -> None:
    """Position weights of a feature processor train through tiered tables as through
    FUSED ones (the per-sample weights' gradient): the outputs, which depend on every
    earlier update of the rows and of the position weights, and the trained position
    weights equal the reference's step by step."""
    for rank, res in enumerate(run_gloo(world, _fp_body, backend)):
        for step in range(STEPS):
            torch.testing.assert_close(
                torch.from_numpy(res["tiered"][step]),
                torch.from_numpy(res["ref"][step]),
                atol=2e-6,
                rtol=1e-5,
                msg=f"rank {rank} step {step}",
            )
        assert any(not np.array_equal(w, np.ones_like(w)) for w in res["pos_ref"])  # they did train
        for got, want in zip(res["pos_tiered"], res["pos_ref"]):
            np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5, err_msg=f"rank {rank}")


def _init_body(rank: int, world: int, init: Optional[Sequence[float]]) -> Dict[str, Any]:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    ebc = make_ebc(init=init)
    sharder = TieredEmbeddingBagCollectionSharder()
    plan = tiered_plan(ebc, sharder, world, {"t0": dict(mode="CACHING", cache_load_factor=0.3, seed=3)})
    model = DistributedModelParallel(
        ebc,
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )
    fused = model.module.state_dict()["embedding_bags.t1.weight"].local_shards()[0].tensor
    return {
        "tiered": model.module.tiered_tables()["t0"].export_state().weights.numpy().copy(),
        "fused": fused.detach().numpy().copy(),
    }


@pytest.mark.parametrize("init", [None, (0.5, 0.75)])
def test_tiered_tables_initialize_in_the_configs_range_as_torchrec(init: Optional[Sequence[float]]) -> None:
    """A tiered table draws its rows from the table config's ``weight_init_min`` /
    ``weight_init_max`` (default +-sqrt(1 / rows)), the range torchrec's FUSED table t1
    beside it uses; bad ranges are refused naming the table."""
    from recpipe.pipeline.tiered.shard import TieredEmbeddingShard

    for res in run_gloo(2, _init_body, init):
        for name, rows in (("tiered", 97), ("fused", 50)):
            lo, hi = init or (-((1 / rows) ** 0.5), (1 / rows) ** 0.5)
            values = res[name]
            assert values.size > 0 and lo <= values.min() and values.max() <= hi, (name, values.min(), values.max())
            assert values.max() - values.min() > 0.8 * (hi - lo), name  # the whole range, not a corner of it
    with pytest.raises(ValueError, match=r"tiered table 't': weight_init_min=1.0 exceeds weight_init_max=0.5; swap"):
        TieredEmbeddingShard(
            num_embeddings=10,
            embedding_dim=4,
            mode="HYBRID",
            cache_load_factor=0.5,
            table_name="t",
            weight_init_min=1.0,
            weight_init_max=0.5,
        )
    shard = TieredEmbeddingShard(
        num_embeddings=10,
        embedding_dim=4,
        mode="HYBRID",
        cache_load_factor=0.5,
        weight_init_min=np.float32(0.5),
        weight_init_max=np.float32(0.75),
    )  # numpy reals too
    rows = shard.export_state().weights
    assert shard.weight_init_range == (0.5, 0.75) and 0.5 <= rows.min() and rows.max() <= 0.75
    with pytest.raises(ValueError, match=r"tiered table 't': weight_init_max must be a finite number or None, got nan"):
        TieredEmbeddingShard(
            num_embeddings=10,
            embedding_dim=4,
            mode="HYBRID",
            cache_load_factor=0.5,
            table_name="t",
            weight_init_max=float("nan"),
        )


def test_sharder_backend_fbgemm_runs_tiered_tables_on_fbgemm_tbe() -> None:
    """``TieredEmbeddingBagCollectionSharder(backend="fbgemm")``: the tiered table t0 runs
    fbgemm's TBE (HOST tables on CPU, the CUDA path's kernel; CPU's default is the native
    kernel), the FUSED table t1 beside it is untouched (its fbgemm TBE would refuse the
    backend fused param), and the outputs equal torchrec's own TABLE_WISE FUSED EBC step by
    step (MEAN pooling: the fbgemm tier pools with SUM, torchrec divides after the all-to-all)."""
    for rank, res in enumerate(run_gloo(2, _body, "MEAN", "fbgemm")):
        assert res["backend"] == ["fbgemm"], res["backend"]
        for step in range(STEPS):
            torch.testing.assert_close(
                torch.from_numpy(res["tiered"][step]),
                torch.from_numpy(res["ref"][step]),
                atol=2e-6,
                rtol=1e-5,
                msg=f"rank {rank} step {step}",
            )
        assert res["stats"][0]["lookups"] > 0


def test_sharder_backend_is_validated() -> None:
    """An unknown ``backend`` is refused by the sharders' constructors, and one the device
    cannot run by ``shard()`` before anything is built, each naming the sharder and the
    argument; None is the device's default."""
    from recpipe.pipeline.tiered.tiered_sharders import (
        TieredEmbeddingBagCollectionSharder,
        TieredEmbeddingCollectionSharder,
    )

    for cls in (TieredEmbeddingBagCollectionSharder, TieredEmbeddingCollectionSharder):
        with pytest.raises(
            ValueError,
            match=rf"^{cls.__name__}: backend must be one of \['native', 'fbgemm', "
            r"'torch'\] or None \(the device's default\), got 'uvm'\.",
        ):
            cls(backend="uvm")
        sharder = cls(backend="native")
        with pytest.raises(
            ValueError,
            match=rf"^{cls.__name__}\(backend='native'\): backend 'native' \(the "
            r"compiled CPU kernel\) cannot run on meta",
        ):
            sharder.shard(torch.nn.Module(), {}, None, torch.device("meta"))  # type: ignore[arg-type]
        assert cls().sharded_module_type is cls(backend="fbgemm").sharded_module_type


def _pipeline_body(rank: int, world: int) -> Dict[str, List[float]]:
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    batches = []
    for step in range(STEPS + 1):
        kjt, _ = kjt_and_grad(step, rank)
        labels = torch.randn(B, generator=torch.Generator().manual_seed(7 * step + rank))
        batches.append(Batch(dense_features=torch.zeros(B, 1), sparse_features=kjt, labels=labels))
    out: Dict[str, List[float]] = {}
    for kind in ("plain", "pipelined"):
        ebc = make_ebc()
        apply_optimizer_in_backward(torch.optim.Adam, ebc.parameters(), {"lr": LR})
        sharder = TieredEmbeddingBagCollectionSharder()
        plan = tiered_plan(
            ebc,
            sharder,
            world,
            {  # both tiered: CACHING on t0, HYBRID on t1
                "t0": dict(mode="CACHING", cache_load_factor=0.2, seed=11),
                "t1": dict(mode="HYBRID", cache_load_factor=0.5, seed=11),
            },
        )
        model = DistributedModelParallel(
            EbcWithHead(ebc),
            plan=ShardingPlan({"ebc": plan}),
            sharders=[sharder],  # type: ignore[list-item]
            device=torch.device("cpu"),
        )
        tiered = model.module.ebc.tiered_tables()
        for name, *_ in TABLES:
            tiered[name].load_global_weights(make_ebc().embedding_bags[name].weight.detach())
        dense = [p for n, p in model.named_parameters() if "head" in n]
        opt = torch.optim.SGD(dense, lr=0.01)
        losses: List[float] = []
        if kind == "plain":
            for b in batches:
                opt.zero_grad()
                loss, _ = model(b)
                loss.backward()
                opt.step()
                losses.append(float(loss))
        else:
            pipeline = TrainPipelineSparseDist(model, opt, torch.device("cpu"), execute_all_batches=True)
            it = iter(batches)
            while True:
                try:
                    loss, _ = pipeline.progress(it)  # type: ignore[misc]
                except StopIteration:
                    break
                losses.append(float(loss))
        out[kind] = losses
        out[kind + "_adam_step"] = [float(tiered["t0"].step)]
    return out


def test_train_pipeline_sparse_dist_with_tiered_tables_matches_plain_loop() -> None:
    results = run_gloo(2, _pipeline_body)
    for rank, res in enumerate(results):
        assert len(res["plain"]) == len(res["pipelined"]) == STEPS + 1
        torch.testing.assert_close(
            torch.tensor(res["pipelined"]), torch.tensor(res["plain"]), atol=1e-5, rtol=1e-5, msg=f"rank {rank}"
        )
        assert res["pipelined_adam_step"] == [float(STEPS + 1)]


def _state_dict_body(rank: int, world: int) -> Dict[str, Any]:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    def build(seed: int) -> Any:
        torch.manual_seed(seed)
        ebc = make_ebc()
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": LR})
        sharder = TieredEmbeddingBagCollectionSharder()
        plan = tiered_plan(ebc, sharder, world, {"t0": dict(mode="CACHING", cache_load_factor=0.2, seed=5)})
        return DistributedModelParallel(
            ebc,
            plan=ShardingPlan({"": plan}),
            sharders=[sharder],  # type: ignore[list-item]
            device=torch.device("cpu"),
        )

    trained = build(0)
    trained.module.load_state_dict(
        {"embedding_bags.t0.weight": torch.randn(97, 8, generator=torch.Generator().manual_seed(9))}, strict=False
    )
    for step in range(3):  # moves rows through the cache and fills optimizer state
        kjt, grad = kjt_and_grad(step, rank)
        trained(kjt).values().backward(grad)
    sd = trained.state_dict()
    keys = sorted(k for k in sd if ".tiered." in k)
    fresh = build(1)  # other init: equal outputs below can only come from the load
    kjt, _ = kjt_and_grad(10, rank)
    before = fresh(kjt).values().detach().numpy().copy()
    fresh.load_state_dict(sd, strict=True)
    a = trained(kjt).values().detach().numpy().copy()
    b = fresh(kjt).values().detach().numpy().copy()
    ta, tb = trained.module.tiered_state()["t0"], fresh.module.tiered_state()["t0"]
    return {
        "keys": keys,
        "equal_out": bool((a == b).all()),
        "differed_before": bool((a != before).any()),
        "equal_rows": bool(
            torch.equal(ta.global_ids, tb.global_ids)
            and torch.equal(ta.weights, tb.weights)
            and torch.equal(ta.optimizer_state, tb.optimizer_state)
        ),
    }


def test_state_dict_round_trip_carries_tiered_rows() -> None:
    """model.state_dict() holds tiered tables' rows; load_state_dict(strict=True) restores them."""
    for res in run_gloo(2, _state_dict_body):
        assert res["keys"] == [
            f"embedding_bags.t0.tiered.{f}"
            for f in ("_extra_state", "global_ids", "optimizer_state", "step", "weights")
        ]
        assert res["differed_before"], "the fresh model must start from other weights"
        assert res["equal_out"] and res["equal_rows"], res


# --- VBE refusal ---------------------------------------------------------------------------
VBE_SIZES = {"f0": B, "f1": 2, "f2": 3}  # batch size per feature of the VBE batches
VBE_CASES = {  # case -> (the EBC's tables, its tiered tables)
    "one_table": (("t0",), ("t0",)),  # one kernel group
    "tiered_and_fused": (("t0", "t1"), ("t0",)),  # two groups
    "two_tables": (("t0", "t1"), ("t0", "t1")),  # two tiered tables
}


def _vbe_kjt(rank: int, features: Sequence[str]) -> Any:
    """A KJT with a variable batch size per feature (``VBE_SIZES``), expanded to ``B`` by
    its inverse_indices, as torchrec's VBE inputs are."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(50 + rank)
    sizes = {"f0": 97, "f1": 97, "f2": 50}
    lengths = [torch.randint(0, 5, (VBE_SIZES[f],), generator=gen) for f in features]
    values = torch.cat([torch.randint(0, sizes[f], (int(n.sum()),), generator=gen) for f, n in zip(features, lengths)])
    inverse = torch.stack([torch.randint(0, VBE_SIZES[f], (B,), generator=gen) for f in features])
    return KeyedJaggedTensor(
        keys=list(features),
        values=values,
        lengths=torch.cat(lengths),
        stride_per_key_per_rank=[[VBE_SIZES[f]] for f in features],
        inverse_indices=(list(features), inverse),
    )


def _expand_vbe(kjt: Any) -> Any:
    """The non-VBE KJT of a VBE one (possible solution 1): bag ``i`` of feature ``f`` is
    bag ``inverse_indices[f][i]`` of the VBE KJT."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    _, inverse = kjt.inverse_indices()
    lengths: List[torch.Tensor] = []
    values: List[torch.Tensor] = []
    for f, jt in enumerate(kjt.split([1] * len(kjt.keys()))):
        offsets = jt.offsets()
        for i in inverse[f].tolist():
            lengths.append(offsets[i + 1] - offsets[i])
            values.append(jt.values()[offsets[i] : offsets[i + 1]])
    return KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat(values), lengths=torch.stack(lengths))


def _vbe_body(rank: int, world: int, case: str) -> Dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    tables, tiered_tables = VBE_CASES[case]
    features = [f for n, _, _, fs in TABLES if n in tables for f in fs]
    global_weights = {n: make_ebc().embedding_bags[n].weight.detach().clone() for n in tables}
    kjt = _vbe_kjt(rank, features)
    out: Dict[str, Any] = {}
    for kind in ("tiered", "fused"):  # "fused": possible solution 2, no tiered placement
        ebc = make_ebc(tables=tables)
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": LR})
        sharder = TieredEmbeddingBagCollectionSharder()
        placements = {
            n: dict(mode="HYBRID" if n == "t0" else "CACHING", cache_load_factor=0.3, seed=3)
            for n in (tiered_tables if kind == "tiered" else ())
        }
        model = DistributedModelParallel(
            ebc,
            plan=ShardingPlan({"": tiered_plan(ebc, sharder, world, placements)}),
            sharders=[sharder],
            device=torch.device("cpu"),
        )  # type: ignore[list-item]
        copy_global_weights(
            {k: v for k, v in model.module.state_dict().items() if isinstance(v, ShardedTensor)},
            {f"embedding_bags.{n}.weight": w for n, w in global_weights.items()},
        )
        for name, shard in model.module.tiered_tables().items():
            shard.load_global_weights(global_weights[name])
        if kind == "tiered":
            try:
                model(kjt)
                out["error"] = None
            except Exception as e:  # noqa: BLE001 - type and message are asserted by the test
                out["error"] = (type(e).__name__, str(e))
            # the refusal left the model usable on every rank (no collective half done):
            # the same rows in a non-VBE KJT (possible solution 1)
            out["expanded"] = model(_expand_vbe(kjt)).values().detach().numpy().copy()
        else:
            out["fused_vbe"] = model(kjt).values().detach().numpy().copy()
    return out


@pytest.mark.parametrize("case", sorted(VBE_CASES))
def test_vbe_kjt_refused_for_tiered_tables_with_possible_solutions(case: str) -> None:
    """A KJT with a variable batch size per feature (VBE) reaching an EBC with tiered
    tables raises one ValueError from the sharded EBC's input_dist on every rank, for
    one or several tiered tables, naming the tiered tables and their features (not the
    FUSED ones) and numbered possible solutions; both solutions are then run: the same
    model fed the VBE batch expanded to one batch size (1.) and the tables planned
    ROW_WISE FUSED fed the VBE KJT itself (2.) give the same pooled outputs."""
    tables, tiered_tables = VBE_CASES[case]
    results = run_gloo(2, _vbe_body, case)
    for rank, res in enumerate(results):
        assert res["error"] is not None, f"rank {rank}: the VBE KJT was accepted"
        kind, msg = res["error"]
        assert kind == "ValueError", f"rank {rank}: {kind}: {msg}"
        assert msg.startswith(
            "TieredShardedEmbeddingBagCollection.input_dist: features is a KeyedJaggedTensor "
            "with a variable batch size per feature (VBE"
        ), msg
        for name, _, _, feats in TABLES:
            named = f"{name!r} (features {feats})"
            assert (named in msg) == (name in tiered_tables), (name, msg)
        sizes = {f: VBE_SIZES[f] for n, _, _, fs in TABLES if n in tiered_tables for f in fs}
        assert f"batch size per feature {sizes}" in msg, msg
        assert "Possible solutions:\n  1. pass a KeyedJaggedTensor with the same batch size for every feature" in msg
        assert "\n  2. place these tables as torchrec FUSED tables with recpipe's row-wise sharding" in msg
        dims = sum(d * len(fs) for n, _, d, fs in TABLES if n in tables)
        assert res["expanded"].shape == res["fused_vbe"].shape == (B, dims)
        torch.testing.assert_close(
            torch.from_numpy(res["expanded"]),
            torch.from_numpy(res["fused_vbe"]),
            atol=2e-6,
            rtol=1e-5,
            msg=f"rank {rank}",
        )


# --- learning rate schedule through model.fused_optimizer ----------------------------------
LR_SCHEDULE = [0.05, 0.2, 0.01, 0.5]  # the lr set before each step's backward


def _lr_schedule_body(rank: int, world: int) -> Dict[str, Any]:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    global_weights = {
        f"embedding_bags.{n}.weight": make_ebc().embedding_bags[n].weight.detach().clone() for n, *_ in TABLES
    }
    out: Dict[str, Any] = {"tiered": [], "ref": []}
    for kind in ("tiered", "ref"):
        ebc = make_ebc()
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": LR_SCHEDULE[0]})
        if kind == "tiered":  # t0 tiered (CACHING), t1 recpipe ROW_WISE FUSED
            sharder: Any = TieredEmbeddingBagCollectionSharder()
            plan = tiered_plan(ebc, sharder, world, {"t0": dict(mode="CACHING", cache_load_factor=0.2, seed=3)})
        else:  # torchrec's own sharder, TABLE_WISE FUSED
            sharder = EmbeddingBagCollectionSharder()
            plan = table_wise_plan(ebc, sharder, world)
        model = DistributedModelParallel(
            ebc,
            plan=ShardingPlan({"": plan}),
            sharders=[sharder],  # type: ignore[list-item]
            device=torch.device("cpu"),
        )
        copy_global_weights(model.module.state_dict(), global_weights)
        if kind == "tiered":
            for name, shard in model.module.tiered_tables().items():
                shard.load_global_weights(global_weights[f"embedding_bags.{name}.weight"])
            out["lrs"] = [g["lr"] for g in model.fused_optimizer.param_groups]  # type: ignore[union-attr]
        for step, lr in enumerate(LR_SCHEDULE):
            # as torchrec's WarmupOptimizer / an LR scheduler: set the groups' lr, then step()
            for group in model.fused_optimizer.param_groups:  # type: ignore[union-attr]
                group["lr"] = lr
            model.fused_optimizer.step()  # type: ignore[operator]
            kjt, grad = kjt_and_grad(step, rank)
            result = model(kjt).values()
            out[kind].append(result.detach().numpy().copy())
            result.backward(grad)
    return out


def test_lr_schedule_on_fused_optimizer_reaches_tiered_tables() -> None:
    """An LR schedule applied to ``model.fused_optimizer`` (param groups' ``lr``, then
    ``step()``, as torchrec's ``WarmupOptimizer`` does) changes the tiered tables'
    learning rate at the same step as torchrec's FUSED tables': every step's outputs
    equal torchrec's own TABLE_WISE FUSED EBC (the tiered table has a param group of its own)."""
    for rank, res in enumerate(run_gloo(2, _lr_schedule_body)):
        assert len(res["lrs"]) >= 2, res["lrs"]  # the tiered table's group next to the FUSED table's
        for step in range(len(LR_SCHEDULE)):
            torch.testing.assert_close(
                torch.from_numpy(res["tiered"][step]),
                torch.from_numpy(res["ref"][step]),
                atol=2e-6,
                rtol=1e-5,
                msg=f"rank {rank} step {step} (lr {LR_SCHEDULE[step]})",
            )


# --- learning rate set between a lookup and its backward ------------------------------------
def _warmup_optimizer(model: Any) -> Any:
    """torchrec's WarmupOptimizer (linear warm-up over 4 steps) over the fused optimizer
    and an SGD of the dense head, as torchrec's examples combine them."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), lambda params: torch.optim.SGD(params, lr=0.05)
    )
    return WarmupOptimizer(
        CombinedOptimizer([model.fused_optimizer, dense]),
        [WarmupStage(WarmupPolicy.LINEAR, max_iters=4, value=0.1)],
        lr=0.3,
    )


def _full_tables(model: Any) -> Dict[str, np.ndarray]:
    """Every table gathered on every rank (FUSED shards from state_dict, tiered rows by global id)."""
    import torch.distributed as dist

    ebc = model.module.ebc
    tiered = ebc.tiered_state() if hasattr(ebc, "tiered_state") else {}
    out: Dict[str, np.ndarray] = {}
    for name, rows, dim, _ in TABLES:
        full = torch.zeros(rows, dim)
        if name in tiered:
            full[tiered[name].global_ids] = tiered[name].weights
        else:
            for shard in ebc.state_dict()[f"embedding_bags.{name}.weight"].local_shards():
                r0, c0 = shard.metadata.shard_offsets
                full[r0 : r0 + shard.tensor.shape[0], c0 : c0 + shard.tensor.shape[1]] = shard.tensor
        dist.all_reduce(full)
        out[name] = full.numpy().copy()  # tensors do not cross the harness's queue
    return out


def _runs_against_torchrec(
    rank: int,
    world: int,
    make_optimizer: Callable[[Any], Any],
    loop_step: Callable[[int, Any, Any, Any], Any],
    before_progress: Callable[[int, Any], None] = lambda done, model: None,
) -> Dict[str, Any]:
    """Trains ``warmup_model`` on ``warmup_batches`` four ways and returns each run's
    (losses, full tables), keyed ``ref_loop`` / ``tiered_loop`` (a plain loop of
    ``loop_step(step, model, optimizer, batch) -> loss``; t0 CACHING) and ``ref_pipeline``
    / ``tiered_pipeline`` (torchrec's TrainPipelineSparseDist on the reference,
    TrainPipelineFusedSparseDist with every table tiered, ``embedding_lookup_after_opt=False``;
    ``before_progress(steps done, model)`` runs before each ``progress()``), plus the fused
    pipeline's ``relookups``. The reference is torchrec's own TABLE_WISE FUSED EBC."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline import TrainPipelineFusedSparseDist

    out: Dict[str, Any] = {}
    cached = {"t0": dict(mode="CACHING", cache_load_factor=0.2, seed=3)}
    hybrid = {"t1": dict(mode="HYBRID", cache_load_factor=0.5, seed=3)}
    for kind, placements in (("ref_loop", None), ("tiered_loop", cached)):
        model = warmup_model(world, placements)
        opt = make_optimizer(model)
        batches = warmup_batches(rank)
        losses = [float(loop_step(step, model, opt, batch).detach()) for step, batch in enumerate(batches)]
        out[kind] = (losses, _full_tables(model))
    for kind, placements in (("ref_pipeline", None), ("tiered_pipeline", {**cached, **hybrid})):
        model = warmup_model(world, placements)
        opt = make_optimizer(model)
        if placements is None:
            pipeline: Any = TrainPipelineSparseDist(model, opt, torch.device("cpu"))
        else:
            pipeline = TrainPipelineFusedSparseDist(model, opt, torch.device("cpu"), embedding_lookup_after_opt=False)
        losses = []
        it = iter(warmup_batches(rank))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # repeated relookups (counted, asserted by the tests)
            while True:
                before_progress(len(losses), model)
                try:
                    loss, _ = pipeline.progress(it)
                except StopIteration:
                    break
                losses.append(float(loss))
        out[kind] = (losses, _full_tables(model))
        if placements is not None:
            out["relookups"] = pipeline.stats.relookups
    return out


def _assert_runs_equal_torchrec(rank: int, res: Dict[str, Any], relookups: int) -> None:
    """Every loss and final table of the tiered runs of :func:`_runs_against_torchrec` equals
    the torchrec reference's, and the fused pipeline redid ``relookups`` early lookups."""
    for ref, got in (("ref_loop", "tiered_loop"), ("ref_pipeline", "tiered_pipeline")):
        (ref_losses, ref_tables), (losses, tables) = res[ref], res[got]
        assert len(losses) == len(ref_losses) == WARMUP_STEPS
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), atol=1e-6, rtol=1e-6, msg=f"rank {rank} {got}"
        )
        for name in ref_tables:
            torch.testing.assert_close(
                torch.from_numpy(tables[name]),
                torch.from_numpy(ref_tables[name]),
                atol=1e-6,
                rtol=1e-6,
                msg=f"rank {rank} {got} table {name}",
            )
    assert res["relookups"] == relookups, res["relookups"]


def _lookup_lr_body(rank: int, world: int) -> Dict[str, Any]:
    def zero_grad_after_forward(step: int, model: Any, opt: Any, batch: Any) -> Any:
        # WarmupOptimizer's new lr reaches the fused tables here, after this step's lookup;
        # fbgemm's TBE takes it at lookup time
        loss, _ = model(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    # in the fused pipeline, the early lookup of the next batch precedes the warm-up's new lr
    return _runs_against_torchrec(rank, world, _warmup_optimizer, zero_grad_after_forward)


def test_lr_changed_between_lookup_and_backward_applies_from_next_lookup() -> None:
    """A tiered table updates with the learning rate of its lookup, as fbgemm's TBE (torchrec's
    FUSED tables) does: with torchrec's WarmupOptimizer over CombinedOptimizer([fused, dense]),
    a loop calling ``zero_grad()`` after the forward (the warm-up's lr is pushed then) and
    ``TrainPipelineFusedSparseDist`` with every table tiered (its early lookup precedes the
    warm-up's new lr: redone) give every loss and final table of torchrec's own TABLE_WISE FUSED
    EBC (in a plain loop / torchrec's TrainPipelineSparseDist): the lr is read at the lookup,
    not in the backward, and the pipeline redoes an early lookup whose tiered lr changed."""
    for rank, res in enumerate(run_gloo(2, _lookup_lr_body)):
        _assert_runs_equal_torchrec(rank, res, relookups=4)  # the 4 warm-up lr changes after step 1


# --- fused params the tiered kernel does not implement ------------------------------------
CLIPPING = {"gradient_clipping": True, "max_gradient": 0.01}


def _clipping_body(rank: int, world: int) -> Dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    weights = {f"embedding_bags.{n}.weight": make_ebc().embedding_bags[n].weight.detach().clone() for n, *_ in TABLES}
    out: Dict[str, Any] = {}
    # "tiered": t0 tiered (refused); "fused": solution 2, t0 and t1 recpipe ROW_WISE FUSED
    for kind in ("tiered", "fused", "ref"):
        ebc = make_ebc()
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": LR})
        if kind == "ref":
            sharder: Any = EmbeddingBagCollectionSharder(fused_params=dict(CLIPPING))
            plan = table_wise_plan(ebc, sharder, world)
        else:
            sharder = TieredEmbeddingBagCollectionSharder(fused_params=dict(CLIPPING))
            plan = tiered_plan(
                ebc,
                sharder,
                world,
                {"t0": dict(mode="CACHING", cache_load_factor=0.2, seed=3)} if kind == "tiered" else {},
            )
        try:
            model = DistributedModelParallel(
                ebc,
                plan=ShardingPlan({"": plan}),
                sharders=[sharder],  # type: ignore[list-item]
                device=torch.device("cpu"),
            )
        except ValueError as e:
            out[kind] = str(e)
            continue
        copy_global_weights(
            {k: v for k, v in model.module.state_dict().items() if isinstance(v, ShardedTensor)}, weights
        )
        outputs = []
        for step in range(STEPS):
            kjt, grad = kjt_and_grad(step, rank)
            result = model(kjt).values()
            outputs.append(result.detach().numpy().copy())
            result.backward(grad)
        out[kind] = outputs
    return out


def test_gradient_clipping_fused_params_refused_for_tiered_tables() -> None:
    """fbgemm clips the gradients of torchrec's FUSED tables given ``gradient_clipping`` in the
    fused params (CPU too); the tiered kernel does not, so a tiered table given it is refused on
    every rank when sharded, naming the table, the params and the possible solutions. Solution
    2, the table as a recpipe ROW_WISE FUSED table with the same fused params, equals torchrec's
    own TABLE_WISE FUSED EBC step by step (outputs depend on every earlier clipped update)."""
    for rank, res in enumerate(run_gloo(2, _clipping_body)):
        msg = res["tiered"]
        assert isinstance(msg, str), f"rank {rank}: the tiered table with gradient clipping was accepted"
        assert msg.startswith(
            "tiered table 't0': fused params {'gradient_clipping': True, 'max_gradient': 0.01} "
            "change fbgemm's rowwise_adagrad update"
        ), msg
        assert "Possible solutions:\n  1. remove them" in msg and "\n  2. plan this table as a torchrec FUSED" in msg
        for step in range(STEPS):
            torch.testing.assert_close(
                torch.from_numpy(res["fused"][step]),
                torch.from_numpy(res["ref"][step]),
                atol=2e-6,
                rtol=1e-5,
                msg=f"rank {rank} step {step}",
            )


# --- update_hyper_parameters through model.fused_optimizer ---------------------------------
HYPER = {"eps": 0.5, "lr": 0.3}  # set before step 2; "lr" lasts until the next zero_grad() / step()


def _hyper_body(rank: int, world: int) -> Dict[str, Any]:
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    def optimizer(model: Any) -> Any:
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(model.named_parameters())),
            lambda params: torch.optim.SGD(params, lr=0.05),
        )
        return CombinedOptimizer([model.fused_optimizer, dense])

    def set_after_zero_grad(step: int, model: Any, opt: Any, batch: Any) -> Any:
        # this step's lookup takes lr 0.3 (step() sets the group's lr back), every later one eps 0.5
        opt.zero_grad()
        if step == 2:
            model.fused_optimizer.update_hyper_parameters(dict(HYPER))
        loss, _ = model(batch)
        loss.backward()
        opt.step()
        return loss

    def set_between_progress_calls(done: int, model: Any) -> None:
        # the fused pipeline's early lookup of every tiered table predates the new eps and is
        # redone (the pipeline's zero_grad() resets the lr)
        if done == 2:
            model.fused_optimizer.update_hyper_parameters(dict(HYPER))

    return _runs_against_torchrec(rank, world, optimizer, set_after_zero_grad, set_between_progress_calls)


def test_update_hyper_parameters_on_fused_optimizer_reaches_tiered_tables() -> None:
    """``model.fused_optimizer.update_hyper_parameters({"eps": ..., "lr": ...})`` (torchrec's
    ``CombinedOptimizer`` API, which sets them in fbgemm's TBE) reaches tiered tables too: in a
    plain loop and in ``TrainPipelineFusedSparseDist`` (every table tiered, its early lookup
    redone once), every loss and final table equal torchrec's own TABLE_WISE FUSED EBC's (in a
    loop / torchrec's TrainPipelineSparseDist)."""
    for rank, res in enumerate(run_gloo(2, _hyper_body)):
        _assert_runs_equal_torchrec(rank, res, relookups=1)
