"""Saving and resuming through recpipe.pipeline.checkpoint.

* ``save`` refuses tiered rows holding NaN / inf on every rank before it writes anything
  (the directory keeps its older save, which loads back bit for bit).
* Saving again into a directory leaves none of the older save's DCP files.
* ``load`` of a file (e.g. the checkpoint's ``.metadata``) says it is not the directory.
* ``async_save`` of tiered tables loads back what was saved.
* Resuming fused Adam tiered tables equals the uninterrupted run.

The models and batches are those of ``tests/harness/dcp_models.py`` (tiered t0 HYBRID, t1 CACHING,
a torchrec ROW_WISE FUSED t2, row-wise Adagrad, a dense head; 2 gloo ranks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest
import torch
from harness.dcp_models import (
    SAVE_PLACEMENTS,
    SWAPPED_PLACEMENTS,
    TABLES,
    TRAIN_STEPS,
    Model,
    dense_opt,
    make_ebc,
    poison_a_row_of_rank1,
    tiered_model,
    train_step,
)
from harness.gloo import run_gloo


def _tiered_rows(model: Any) -> Dict[str, Any]:
    return {
        name: (st.global_ids.numpy().copy(), st.weights.numpy().copy(), st.optimizer_state.numpy().copy(), st.step)
        for name, st in model.module.ebc.tiered_state().items()
    }


def _nan_save_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    model = tiered_model(world, SAVE_PLACEMENTS)
    opt = dense_opt(model)
    for step in range(TRAIN_STEPS):
        train_step(model, opt, TABLES, step, [rank])
    recpipe_dcp.save(model, root)
    good = _tiered_rows(model)
    head = model.module.head.weight.detach().numpy().copy()
    gid = poison_a_row_of_rank1(model)
    out: Dict[str, Any] = {"gid": gid, "good": good, "head": head}
    try:
        recpipe_dcp.save(model, root)
        out["error"] = None
    except recpipe_dcp.CheckpointSaveError as e:
        out["error"] = str(e)
    fresh = tiered_model(world, SAVE_PLACEMENTS)
    recpipe_dcp.load(fresh, root)  # the older save is still there and committed
    out["loaded"] = _tiered_rows(fresh)
    out["loaded_head"] = fresh.module.head.weight.detach().numpy().copy()
    return out


def test_dcp_save_refuses_nan_tiered_rows_on_every_rank_and_keeps_the_older_save(tmp_path: Path) -> None:
    for rank, out in enumerate(run_gloo(2, _nan_save_body, str(tmp_path / "ckpt"))):
        assert out["error"] is not None, f"rank {rank}: a tiered row holding NaN was saved"
        assert "'module.ebc.embedding_bags.t1'" in out["error"] and "(rank 1)" in out["error"], out["error"]
        assert "NaN" in out["error"] and "Possible solutions" in out["error"], out["error"]
        assert "t0" not in out["error"], out["error"]  # only the poisoned table is named
        # the directory still holds the first save: what the model held then, bit for bit
        assert sorted(out["loaded"]) == sorted(out["good"])
        for name, saved in out["good"].items():
            for a, b in zip(out["loaded"][name], saved):
                np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} {name}")
        np.testing.assert_array_equal(out["loaded_head"], out["head"])


def _resave_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader

    from recpipe.pipeline import checkpoint as recpipe_dcp

    model = tiered_model(world, SAVE_PLACEMENTS)
    opt = dense_opt(model)
    train_step(model, opt, TABLES, 0, [rank])
    recpipe_dcp.save(model, root, thread_count=2)
    first = sorted(p.name for p in Path(root).iterdir())
    train_step(model, opt, TABLES, 1, [rank])
    recpipe_dcp.save(model, root, thread_count=1)
    md = FileSystemReader(root).read_metadata()
    referenced = sorted({info.relative_path for info in md.storage_data.values()})
    fresh = tiered_model(world, SAVE_PLACEMENTS)
    recpipe_dcp.load(fresh, root)
    return {
        "first": first,
        "after": sorted(p.name for p in Path(root).iterdir()),
        "referenced": referenced,
        "saved": _tiered_rows(model),
        "loaded": _tiered_rows(fresh),
    }


def test_dcp_save_into_an_older_saves_directory_leaves_none_of_its_files(tmp_path: Path) -> None:
    from recpipe.pipeline.checkpoint import DIGESTS_NAME

    for rank, out in enumerate(run_gloo(2, _resave_body, str(tmp_path / "ckpt"))):
        assert len([n for n in out["first"] if n.endswith(".distcp")]) == 4, out["first"]  # 2 threads x 2 ranks
        # the directory holds exactly what DCP's metadata of the new save references
        assert out["after"] == sorted(out["referenced"] + [".metadata", DIGESTS_NAME]), out
        for name, saved in out["saved"].items():
            for a, b in zip(out["loaded"][name], saved):
                np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} {name}")


def test_dcp_load_of_a_file_says_it_is_not_the_directory(tmp_path: Path) -> None:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    f = tmp_path / ".metadata"
    f.write_bytes(b"x")
    with pytest.raises(
        recpipe_dcp.CheckpointNotADirectoryError, match=r"is a file, not a directory.*pass the directory"
    ):
        recpipe_dcp.load(torch.nn.Linear(1, 1), f)
    with pytest.raises(recpipe_dcp.CheckpointNotFoundError, match="does not exist"):
        recpipe_dcp.load(torch.nn.Linear(1, 1), tmp_path / "absent")


def _async_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from recpipe.pipeline import checkpoint as recpipe_dcp

    every_table_tiered = dict(SAVE_PLACEMENTS, t2=dict(mode="HYBRID", cache_load_factor=0.5, seed=3))
    model = tiered_model(world, every_table_tiered)
    opt = dense_opt(model)
    for step in range(TRAIN_STEPS):
        train_step(model, opt, TABLES, step, [rank])
    saved = _tiered_rows(model)
    head = model.module.head.weight.detach().numpy().copy()
    group = dist.new_group(backend="gloo")  # the save's collectives stay off the training's group
    future = dcp.async_save(recpipe_dcp.dcp_state_dict(model), checkpoint_id=root, process_group=group)
    train_step(model, opt, TABLES, TRAIN_STEPS, [rank])  # training goes on while it writes
    future.result()
    recpipe_dcp.write_digests(root, process_group=group)
    fresh = tiered_model(world, every_table_tiered)
    recpipe_dcp.load(fresh, root)
    return {
        "saved": saved,
        "loaded": _tiered_rows(fresh),
        "head": head,
        "loaded_head": fresh.module.head.weight.detach().numpy().copy(),
    }


def test_async_save_of_tiered_tables_loads_back_what_was_saved(tmp_path: Path) -> None:
    """The README's async_save recipe: the state of the moment it was called, bit for bit."""
    for rank, out in enumerate(run_gloo(2, _async_body, str(tmp_path / "ckpt"))):
        assert sorted(out["loaded"]) == ["t0", "t1", "t2"]
        for name, saved in out["saved"].items():
            for a, b in zip(out["loaded"][name], saved):
                np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} {name}")
        np.testing.assert_array_equal(out["loaded_head"], out["head"])


def _adam_model(world: int, placements: Dict[str, Dict[str, Any]]) -> Any:
    """``dcp_models``' model with every table tiered and fused Adam (fbgemm's CPU TBE has no
    Adam, so FUSED tables cannot run it here)."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan, ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder
    from recpipe.planner.torchrec_plan import PlacementParameterSharding, row_wise_sharding_spec

    ebc = make_ebc(TABLES)
    apply_optimizer_in_backward(torch.optim.Adam, ebc.parameters(), {"lr": 0.05})
    sharder = TieredEmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        ebc,
        {n: row_wise() for n, *_ in TABLES},
        sharder=sharder,  # type: ignore[arg-type]
        local_size=world,
        world_size=world,
        device_type="cpu",
    )
    for name, rows, dim, _ in TABLES:
        plan[name] = PlacementParameterSharding(
            sharding_type=ShardingType.ROW_WISE.value,
            compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
            ranks=list(range(world)),
            sharding_spec=row_wise_sharding_spec(rows, dim, world, world, "cpu"),
            dist_type="hash_roundrobin",
            **placements[name],
        )
    model = DistributedModelParallel(
        Model(ebc, sum(d * len(f) for _, _, d, f in TABLES)),
        plan=ShardingPlan({"ebc": plan}),
        sharders=[sharder],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )
    for name, shard in model.module.ebc.tiered_tables().items():
        shard.load_global_weights(make_ebc(TABLES).embedding_bags[name].weight.detach())
    return model


def _adam_resume_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    import copy

    from recpipe.pipeline import checkpoint as recpipe_dcp

    saving = dict(SAVE_PLACEMENTS, t2=dict(mode="HYBRID", cache_load_factor=0.5, seed=3))
    loading = dict(SWAPPED_PLACEMENTS, t2=dict(mode="CACHING", cache_load_factor=0.3, seed=3))

    def dense_adam(model: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for n, p in model.named_parameters() if "head" in n], lr=0.01)

    model = _adam_model(world, saving)
    opt = dense_adam(model)
    for step in range(TRAIN_STEPS):
        train_step(model, opt, TABLES, step, [rank])
    recpipe_dcp.save(model, root)
    dense_state = copy.deepcopy(opt.state_dict())  # the dense optimizer is the caller's to save
    uninterrupted = [train_step(model, opt, TABLES, step, [rank]) for step in range(TRAIN_STEPS, TRAIN_STEPS + 3)]
    fresh = _adam_model(world, loading)
    fresh_opt = dense_adam(fresh)
    fresh_opt.load_state_dict(dense_state)
    recpipe_dcp.load(fresh, root)
    resumed = [train_step(fresh, fresh_opt, TABLES, step, [rank]) for step in range(TRAIN_STEPS, TRAIN_STEPS + 3)]
    return {
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "steps": {n: s.step for n, s in fresh.module.ebc.tiered_state().items()},
        "steps_ref": {n: s.step for n, s in model.module.ebc.tiered_state().items()},
    }


def test_adam_resume_from_a_dcp_checkpoint_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """Adam's moments and step counter (its bias correction) come back, under the other
    tier placement: the next steps' outputs equal the run that never stopped, bit for bit."""
    for rank, out in enumerate(run_gloo(2, _adam_resume_body, str(tmp_path / "ckpt"))):
        assert (
            out["steps"] == out["steps_ref"] == {"t0": TRAIN_STEPS + 3, "t1": TRAIN_STEPS + 3, "t2": TRAIN_STEPS + 3}
        ), out
        for i, (a, b) in enumerate(zip(out["resumed"], out["uninterrupted"])):
            for key in ("emb", "pred"):
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"rank {rank} step {TRAIN_STEPS + i} {key}")
