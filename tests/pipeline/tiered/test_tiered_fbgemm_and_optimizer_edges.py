"""Tiered tables vs torchrec's FUSED row-wise tables: checkpoint migration and refusals.

* A user swapping FUSED row-wise tables for tiered ones (and back) loads the other model's
  ``state_dict()``. Tiered rows are hash-routed and exported per rank, FUSED rows are a
  contiguous ShardedTensor range per rank, so neither loads the other's entries: both are
  refused before anything changes, naming the table, with fixes that the test then runs
  (a full ``[num_embeddings, dim]`` table gathered on every rank), checked against torchrec's
  own FUSED table (its ShardedTensor).
* backend ``fbgemm`` with a dim that is not a multiple of 4 (fbgemm's TBE, as torchrec's FUSED
  tables, needs one) is refused on every rank, also on a rank holding none of the table's rows.
* the fused optimizer's learning rates under torch LR schedulers, fbgemm's step counter on a
  rank without rows, and fused params the tiered kernel refuses.
"""

from __future__ import annotations

from typing import Any, Dict, List

import harness.tiered_ebc_models as pooled
import numpy as np
import pytest
import torch
from harness.gloo import run_gloo

STEPS = 2
PLACEMENT = {"t0": dict(mode="CACHING", cache_load_factor=0.2, seed=3)}


def _model(world: int, tiered: bool) -> Any:
    """The EBC of ``test_tiered_sharders`` (row-wise Adagrad) sharded ROW_WISE by the tiered
    sharder: t0 tiered CACHING (``tiered``) or torchrec's FUSED kernel; t1 FUSED; both from
    the same initial tables."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    weights = {
        f"embedding_bags.{n}.weight": pooled.make_ebc().embedding_bags[n].weight.detach().clone()
        for n, *_ in pooled.TABLES
    }
    ebc = pooled.make_ebc()
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": pooled.LR})
    sharder = TieredEmbeddingBagCollectionSharder()
    plan = pooled.tiered_plan(ebc, sharder, world, PLACEMENT if tiered else {})
    model = DistributedModelParallel(
        ebc,
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )
    pooled.copy_global_weights(model.module.state_dict(), weights)
    for name, shard in model.module.tiered_tables().items():
        shard.load_global_weights(weights[f"embedding_bags.{name}.weight"])
    return model


def _train(model: Any, rank: int, first_step: int) -> None:
    for step in range(first_step, first_step + STEPS):
        kjt, grad = pooled.kjt_and_grad(step, rank)
        model(kjt).values().backward(grad)


def _full(model: Any, name: str) -> torch.Tensor:
    """Table ``name`` of ``model`` gathered on every rank: a tiered table's rows by global id,
    a FUSED table's from its ShardedTensor (torchrec's own state)."""
    import torch.distributed as dist

    rows, dim = {n: (r, d) for n, r, d, _ in pooled.TABLES}[name]
    full = torch.zeros(rows, dim)
    tiered = model.module.tiered_state()
    if name in tiered:
        full[tiered[name].global_ids] = tiered[name].weights
    else:
        for shard in model.module.state_dict()[f"embedding_bags.{name}.weight"].local_shards():
            r0, c0 = shard.metadata.shard_offsets
            full[r0 : r0 + shard.tensor.shape[0], c0 : c0 + shard.tensor.shape[1]] = shard.tensor
    dist.all_reduce(full)
    return full


def _migration_body(rank: int, world: int) -> Dict[str, Any]:
    from recpipe.pipeline.tiered.migration import gather_full_weights

    fused, tiered = _model(world, tiered=False), _model(world, tiered=True)
    _train(fused, rank, 0)
    _train(tiered, rank, 10)  # other batches: the two models' tables differ
    out: Dict[str, Any] = {}

    # FUSED -> tiered: refused, nothing changed; the fix (a full table gathered from the
    # ShardedTensor) loads it
    fused_state = fused.state_dict()
    before = _full(tiered, "t0")
    try:
        tiered.load_state_dict(fused_state)
        out["to_tiered_error"] = None
    except Exception as e:  # noqa: BLE001 - the message is the result
        out["to_tiered_error"] = (type(e).__name__, str(e))
    out["to_tiered_unchanged"] = bool(torch.equal(_full(tiered, "t0"), before))
    full = gather_full_weights(fused)  # the fix the refusal names
    out["gathered_fused"] = {
        n: (full[f"embedding_bags.{n}.weight"].numpy(), _full(fused, n).numpy()) for n in ("t0", "t1")
    }
    tiered.module.load_state_dict({"embedding_bags.t0.weight": full["embedding_bags.t0.weight"]}, strict=False)
    out["to_tiered_fixed"] = (_full(tiered, "t0").numpy(), _full(fused, "t0").numpy())

    # tiered -> FUSED: refused, nothing changed; the fix (the tiered rows gathered by global id)
    # loads it, with the rest of the state dict
    _train(tiered, rank, 20)
    tiered_state = tiered.state_dict()
    before = _full(fused, "t0")
    try:
        fused.load_state_dict(tiered_state)
        out["to_fused_error"] = None
    except Exception as e:  # noqa: BLE001
        out["to_fused_error"] = (type(e).__name__, str(e))
    out["to_fused_unchanged"] = bool(torch.equal(_full(fused, "t0"), before))
    full = gather_full_weights(tiered)
    out["gathered_tiered"] = {
        n: (full[f"embedding_bags.{n}.weight"].numpy(), _full(tiered, n).numpy()) for n in ("t0", "t1")
    }
    state = {k: v for k, v in tiered_state.items() if ".tiered." not in k}
    state["embedding_bags.t0.weight"] = full["embedding_bags.t0.weight"]
    fused.load_state_dict(state)  # strict: every key of the FUSED model
    out["to_fused_fixed"] = {n: (_full(fused, n).numpy(), _full(tiered, n).numpy()) for n in ("t0", "t1")}
    return out


def test_checkpoint_migration_between_fused_and_tiered_tables_refused_with_working_fixes() -> None:
    """``load_state_dict`` of a FUSED row-wise model's state into the tiered model (and back)
    is refused before anything changes, naming the table and the fix; the fix loads the other
    model's table exactly (compared with torchrec's FUSED table's ShardedTensor)."""
    for rank, res in enumerate(run_gloo(2, _migration_body)):
        assert res["to_tiered_error"] is not None, f"rank {rank}: a ShardedTensor loaded into a tiered table"
        kind, msg = res["to_tiered_error"]
        assert kind == "ValueError", (kind, msg)
        assert "tiered table 't0' cannot load a ShardedTensor" in msg, msg
        assert "Possible solutions:\n  1. pass the full [num_embeddings, dim] tensor" in msg, msg
        assert "gather_full_weights(<the saving model>)" in msg and "optimizer state then starts from zero" in msg, msg
        assert res["to_tiered_unchanged"], f"rank {rank}"
        got, want = res["to_tiered_fixed"]
        np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}: FUSED t0 -> tiered t0")

        assert res["to_fused_error"] is not None, f"rank {rank}: tiered entries loaded into a FUSED table"
        kind, msg = res["to_fused_error"]
        assert kind == "ValueError", f"rank {rank}: {kind}: {msg}"  # not an IndexError from torchrec's hook
        assert msg.startswith(
            "TieredShardedEmbeddingBagCollection.load_state_dict: table 't0' is planned row_wise "
            "fused (not tiered) in this model"
        ), msg
        assert "'embedding_bags.t0.tiered.weights'" in msg and "placeholder embedding_bags.t0.weight" in msg, msg
        assert "Possible solutions:\n  1. load it into a model that plans 't0' as it was saved" in msg, msg
        assert "\n  2. move the saved rows as a full table" in msg and "gather_full_weights(" in msg, msg
        assert res["to_fused_unchanged"], f"rank {rank}"
        for name, (got, want) in res["to_fused_fixed"].items():
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}: tiered {name} -> FUSED {name}")
        # gather_full_weights (FUSED shards at their offsets, tiered rows by global id) against
        # the hand gather of _full
        for which in ("gathered_fused", "gathered_tiered"):
            for name, (got, want) in res[which].items():
                np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}: {which} {name}")


@pytest.mark.parametrize("rank", [0, 1])
def test_fbgemm_backend_refuses_dim_not_multiple_of_4_on_every_rank(rank: int) -> None:
    """A 1-row table on 2 ranks: one rank holds its row, the other none. torchrec's FUSED
    tables refuse a dim that is not a multiple of 4 (fbgemm's TBE needs one); the tiered
    table on backend ``fbgemm`` is refused on both ranks (the rank without rows too), naming
    the table, with the fixes."""
    from recpipe.pipeline.tiered.shard import TieredEmbeddingShard

    with pytest.raises(ValueError) as info:
        TieredEmbeddingShard(
            num_embeddings=1,
            embedding_dim=6,
            mode="HYBRID",
            cache_load_factor=0.5,
            rank=rank,
            world_size=2,
            backend="fbgemm",
            table_name="tiny",
        )
    msg = str(info.value)
    assert msg.startswith("tiered table 'tiny': embedding_dim=6 is not a multiple of 4"), msg
    assert "1. use a dim that is a multiple of 4" in msg and "backend='native'" in msg, msg
    # the native kernel takes the dim on both ranks
    shard = TieredEmbeddingShard(
        num_embeddings=1,
        embedding_dim=6,
        mode="HYBRID",
        cache_load_factor=0.5,
        rank=rank,
        world_size=2,
        table_name="tiny",
    )
    assert shard.num_rows in (0, 1)


# --- a torch LR scheduler over model.fused_optimizer -------------------------------------------
GAMMA = 0.3  # StepLR's factor: 0.05 * 0.3 rounds to another float32 than float32(0.05) * 0.3


def _scheduler_body(rank: int, world: int) -> Dict[str, Any]:
    """torch's StepLR over ``model.fused_optimizer`` (``step()`` then the scheduler's ``step()``
    after each backward) on the tiered model (t0 tiered CACHING, t1 FUSED, row-wise) and on
    torchrec's own TABLE_WISE FUSED EBC; per step every param group's lr and the output."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    out: Dict[str, Any] = {}
    for kind in ("tiered", "ref"):
        if kind == "tiered":
            model = _model(world, tiered=True)
        else:
            weights = {
                f"embedding_bags.{n}.weight": pooled.make_ebc().embedding_bags[n].weight.detach().clone()
                for n, *_ in pooled.TABLES
            }
            ebc = pooled.make_ebc()
            apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": pooled.LR})
            sharder = EmbeddingBagCollectionSharder()
            plan = pooled.table_wise_plan(ebc, sharder, world)
            model = DistributedModelParallel(
                ebc,
                plan=ShardingPlan({"": plan}),
                sharders=[sharder],  # type: ignore[list-item]
                device=torch.device("cpu"),
            )
            pooled.copy_global_weights(model.module.state_dict(), weights)
        scheduler = torch.optim.lr_scheduler.StepLR(model.fused_optimizer, step_size=1, gamma=GAMMA)
        lrs, outs = [], []
        for step in range(4):
            lrs.append([float(g["lr"]) for g in model.fused_optimizer.param_groups])
            kjt, grad = pooled.kjt_and_grad(step, rank)
            result = model(kjt).values()
            outs.append(result.detach().numpy().copy())
            result.backward(grad)
            model.fused_optimizer.step()
            scheduler.step()
        out[kind] = (lrs, outs)
    return out


def test_torch_lr_scheduler_over_fused_optimizer_gives_tiered_tables_torchrecs_lrs() -> None:
    """A torch LR scheduler over ``model.fused_optimizer`` starts from each param group's
    ``lr``: torchrec's FUSED groups hold fbgemm's float32 learning rate (``get_learning_rate``),
    so the tiered groups hold it too (not the float64 fused param), and the schedule gives
    every tiered table torchrec's learning rates bit for bit; outputs equal torchrec's."""
    for rank, res in enumerate(run_gloo(2, _scheduler_body)):
        (lrs, outs), (ref_lrs, ref_outs) = res["tiered"], res["ref"]
        for step, (got, want) in enumerate(zip(lrs, ref_lrs)):
            assert len(want) == 1 and len(got) == 2, (got, want)  # one FUSED TBE; tiered t0 + FUSED t1
            assert got == [want[0]] * 2, f"rank {rank} step {step}: {got} != {want}"
        for step, (got, want) in enumerate(zip(outs, ref_outs)):
            np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5, err_msg=f"rank {rank} step {step}")


# --- a tiered table with fewer rows than ranks on the fbgemm backend ---------------------------
def _tiny_ebc() -> Any:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="tiny", num_embeddings=1, embedding_dim=8, feature_names=["f0"])],
        device=torch.device("cpu"),
    )


def _tiny_body(rank: int, world: int) -> Dict[str, Any]:
    """A 1-row table (one rank holds its row, the other none), row-wise Adagrad: tiered on the
    fbgemm backend (fbgemm HOST tables on CPU) and torchrec's own TABLE_WISE FUSED table, the
    same steps (3 training steps, one eval forward); each rank's exported step vs the FUSED
    TBE's step counter (``iter``), and a reload of every rank's export."""
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder
    from recpipe.planner.torchrec_plan import PlacementParameterSharding, row_wise_sharding_spec

    out: Dict[str, Any] = {}
    for kind in ("tiered", "ref"):
        ebc = _tiny_ebc()
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
        if kind == "tiered":
            sharder: Any = TieredEmbeddingBagCollectionSharder(backend="fbgemm")
            plan = {
                "tiny": PlacementParameterSharding(
                    sharding_type="row_wise",
                    compute_kernel="customized_kernel",
                    ranks=list(range(world)),
                    sharding_spec=row_wise_sharding_spec(1, 8, world, world, "cpu"),
                    dist_type="hash_roundrobin",
                    mode="HYBRID",
                    cache_load_factor=0.5,
                    seed=0,
                )
            }
        else:
            sharder = EmbeddingBagCollectionSharder()
            plan = construct_module_sharding_plan(
                ebc,
                {"tiny": table_wise(rank=0)},
                sharder=sharder,
                local_size=world,
                world_size=world,
                device_type="cpu",
            )
        model = DistributedModelParallel(
            ebc,
            plan=ShardingPlan({"": plan}),
            sharders=[sharder],  # type: ignore[list-item]
            device=torch.device("cpu"),
        )
        for step in range(4):
            kjt = KeyedJaggedTensor(
                keys=["f0"], values=torch.zeros(2, dtype=torch.int64), lengths=torch.tensor([1, 0, 1])
            )
            if step == 3:
                with torch.no_grad():
                    model(kjt)
            else:
                model(kjt).values().sum().backward()
        if kind == "ref":  # fbgemm's step counter of the FUSED table (on rank 0, its owner)
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

            tbes = [
                m.emb_module
                for lookup in model.module._lookups
                for m in lookup.modules()
                if isinstance(getattr(m, "emb_module", None), SplitTableBatchedEmbeddingBagsCodegen)
            ]
            out["ref_iter"] = int(tbes[0].iter.item()) if tbes else None
            continue
        shard = model.module.tiered_tables()["tiny"]
        out["rows"] = shard.num_rows
        export = model.module.tiered_state()["tiny"]
        out["step"] = export.step
        exports: List[Any] = [None] * world
        dist.all_gather_object(exports, export)
        try:
            model.module.load_tiered_state({"tiny": exports})  # every saving rank's export, as a reshard
            out["reload"] = model.module.tiered_state()["tiny"].step
        except Exception as e:  # noqa: BLE001
            out["reload"] = f"{type(e).__name__}: {e}"
    return out


def test_fbgemm_backend_shard_without_rows_counts_steps_as_fbgemm() -> None:
    """On the fbgemm backend, both ranks of a 1-row tiered table (one holding none of its rows)
    export torchrec's FUSED table's fbgemm step counter, so reloading every rank's export (a
    resharding load, recpipe's DCP load) agrees on the optimizer step and succeeds."""
    results = run_gloo(2, _tiny_body)
    want = results[0]["ref_iter"]
    assert want == 4, want  # fbgemm's iter counts every lookup of a row-wise Adagrad table
    assert sorted(res["rows"] for res in results) == [0, 1]
    for rank, res in enumerate(results):
        assert res["step"] == want, f"rank {rank} ({res['rows']} rows): step {res['step']}, fbgemm's {want}"
        assert res["reload"] == want, f"rank {rank}: {res['reload']}"


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_fbgemm_backend_shard_without_rows_undoes_a_discarded_lookup_as_fbgemm(optimizer: str) -> None:
    """``lookup_counters`` / ``undo_lookup`` (TrainPipelineFusedSparseDist takes back a
    discarded early lookup) of a fbgemm shard without rows move its step as those of the
    table's shard with rows (fbgemm's TBE): a lookup, its undo, and an undo after a load."""
    from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig

    steps: Dict[int, List[int]] = {}
    for rank in (0, 1):
        shard = TieredEmbeddingShard(
            num_embeddings=1,
            embedding_dim=8,
            mode="HYBRID",
            cache_load_factor=0.5,
            rank=rank,
            world_size=2,
            backend="fbgemm",
            optimizer=TieredOptimizerConfig(optimizer=optimizer),
        )
        ids, offsets = torch.zeros(shard.num_rows, dtype=torch.int64), torch.tensor([0, shard.num_rows])
        seen = []
        for undo, load in ((False, False), (True, False), (True, True)):
            before = shard.lookup_counters()
            shard(ids, offsets)
            after = shard.lookup_counters()
            if load:
                shard.load_states([shard.export_state()])
            if undo:
                shard.undo_lookup(before, after)
            seen.append(shard.export_state().step)
        steps[shard.num_rows] = seen
    assert steps[0] == steps[1], steps


# --- fbgemm's deprecated non-exact optimizers ----------------------------------------------------
def _deprecated_body(rank: int, world: int, name: str) -> Dict[str, str]:
    """The EBC sharded with fused params ``optimizer=EmbOptimType.<name>`` (the sharder's, no
    in-backward optimizer): every table tiered by the tiered sharder, and torchrec's own
    TABLE_WISE FUSED."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    fused_params = {"optimizer": EmbOptimType[name], "learning_rate": 0.05}
    out: Dict[str, str] = {}
    for kind in ("tiered", "ref"):
        ebc = pooled.make_ebc()
        if kind == "tiered":
            sharder: Any = TieredEmbeddingBagCollectionSharder(fused_params=dict(fused_params))
            plan = pooled.tiered_plan(
                ebc, sharder, world, {**PLACEMENT, "t1": dict(mode="HYBRID", cache_load_factor=0.5, seed=3)}
            )
        else:
            sharder = EmbeddingBagCollectionSharder(fused_params=dict(fused_params))
            plan = construct_module_sharding_plan(
                ebc,
                {"t0": table_wise(rank=0, compute_kernel="fused"), "t1": table_wise(rank=1, compute_kernel="fused")},
                sharder=sharder,
                local_size=world,
                world_size=world,
                device_type="cpu",
            )
        try:
            DistributedModelParallel(
                ebc,
                plan=ShardingPlan({"": plan}),
                sharders=[sharder],  # type: ignore[list-item]
                device=torch.device("cpu"),
            )
            out[kind] = "accepted"
        except (AssertionError, ValueError) as e:
            out[kind] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.parametrize("name, exact", [("SGD", "EXACT_SGD"), ("ROWWISE_ADAGRAD", "EXACT_ROWWISE_ADAGRAD")])
def test_deprecated_non_exact_fbgemm_optimizers_refused_as_by_torchrec(name: str, exact: str) -> None:
    """fbgemm's TBE refuses ``EmbOptimType.SGD`` / ``ROWWISE_ADAGRAD`` (deprecated), so torchrec's
    FUSED tables fail on them; tiered tables refuse them too (rather than train the exact
    optimizer), naming the table and the exact optimizer to use."""
    for rank, res in enumerate(run_gloo(2, _deprecated_body, name)):
        assert res["ref"].startswith("AssertionError") and "deprecated" in res["ref"], res["ref"]
        assert res["tiered"].startswith(
            f"ValueError: tiered table 't0': fused optimizer EmbOptimType.{name} is deprecated in fbgemm"
        ), f"rank {rank}: {res['tiered']}"
        assert f"use EmbOptimType.{exact} in the fused params" in res["tiered"], res["tiered"]


def test_adam_rowwise_bias_correction_refused_for_tiered_tables() -> None:
    """fbgemm's ``extra_optimizer_config`` with ``use_rowwise_bias_correction`` makes its Adam
    correct each row's moments by that row's own update count (fbgemm's TBE takes the knob and
    keeps it: the reference below); the tiered kernel corrects by the table's step, so the
    config is refused, naming it; the knob off is accepted and changes nothing."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.tbe.config.optimizer_config import UserEnabledConfigDefinition

    from recpipe.pipeline.tiered.fused_params import tiered_optimizer_from_fused_params

    on = UserEnabledConfigDefinition(use_rowwise_bias_correction=True)
    assert on.use_rowwise_bias_correction  # fbgemm's own definition of the knob
    with pytest.raises(
        ValueError,
        match=r"fused params \{'extra_optimizer_config': .*use_rowwise_bias_correction=True"
        r".*change fbgemm's adam update",
    ):
        tiered_optimizer_from_fused_params({"optimizer": EmbOptimType.ADAM, "extra_optimizer_config": on})
    off = UserEnabledConfigDefinition(use_rowwise_bias_correction=False)
    assert tiered_optimizer_from_fused_params(
        {"optimizer": EmbOptimType.ADAM, "extra_optimizer_config": off}
    ) == tiered_optimizer_from_fused_params({"optimizer": EmbOptimType.ADAM})
