"""Tiered tables on the fbgemm backend behave as fbgemm's TBE on every rank, one without rows too.

A table with fewer rows than ranks leaves a rank holding none of its rows:
* a dim that is not a multiple of 4 (fbgemm's TBE, as torchrec's FUSED tables, needs one)
  is refused on every rank, naming the table and the fixes;
* the rank without rows counts optimizer steps as torchrec's FUSED table's TBE does
  (its ``iter``: the reference), so reloading every rank's export agrees on the step;
* ``lookup_counters`` / ``undo_lookup`` move its step as those of the rank with rows.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
from harness.gloo import run_gloo

from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig


@pytest.mark.parametrize("rank", [0, 1])
def test_fbgemm_backend_refuses_dim_not_multiple_of_4_on_every_rank(rank: int) -> None:
    """A 1-row table on 2 ranks: one rank holds its row, the other none. torchrec's FUSED
    tables refuse a dim that is not a multiple of 4 (fbgemm's TBE needs one); the tiered
    table on backend ``fbgemm`` is refused on both ranks (the rank without rows too), naming
    the table, with the fixes."""
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
