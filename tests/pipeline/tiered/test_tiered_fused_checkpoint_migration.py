"""Checkpoints move between FUSED row-wise tables and tiered ones only through a full table.

A user swapping FUSED row-wise tables for tiered ones (and back) loads the other model's
``state_dict()``. Tiered rows are hash-routed and exported per rank, FUSED rows are a
contiguous ShardedTensor range per rank, so neither loads the other's entries: both are
refused before anything changes, naming the table, with fixes that the test then runs
(a full ``[num_embeddings, dim]`` table gathered on every rank, ``gather_full_weights``),
checked against torchrec's own FUSED table (its ShardedTensor).
"""

from __future__ import annotations

from typing import Any, Dict

import harness.tiered_ebc_models as pooled
import numpy as np
import torch
from harness.gloo import run_gloo
from harness.tiered_fused_row_wise import row_wise_model

STEPS = 2


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

    fused, tiered = row_wise_model(world, tiered=False), row_wise_model(world, tiered=True)
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
