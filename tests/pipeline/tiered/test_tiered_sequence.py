"""TieredEmbeddingCollectionSharder: tiered sequence (EmbeddingCollection) tables on 2 gloo CPU ranks.

An EmbeddingCollection with two tables, both recpipe tiered tables sharded ROW_WISE
with the CUSTOMIZED_KERNEL and hash_roundrobin routing: ``s0`` (two features) in
CACHING 0.3 and ``s1`` in HYBRID 0.5. The plan comes from recpipe's planner
(``PlacementPlanner(topology).plan(ec).to_sharding_plan(compute_device="cpu")``,
modes pinned by constraints). Reference: the unsharded table computed in the test
from the same initial weights, stepping plain SGD over both ranks' batches with
the gradient averaged over ranks (torchrec's default gradient division).

Exactness: upstream gradients are multiples of 1/16 in [-1/2, 1/2) and the learning
rate is 1/8, so every gradient sum, the division by the 2 ranks and ``lr * g`` are
exact in float32 whatever the summation order: outputs and updated weights must be bit-identical (torch.equal)
to the reference at every step.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch
from harness.gloo import run_gloo
from harness.tiered_ec_models import (
    DIM,
    FEATURE_TABLE,
    FEATURES,
    LR,
    PLACEMENT,
    STEPS,
    TABLES,
    B,
    kjt_and_grads,
    make_ec,
    planner_plan,
)

VBE_BAGS = {"f0": B, "f1": B - 1, "f2": B // 2}  # bags per feature of the VBE batches


def _vbe_batch(step: int, rank: int) -> Tuple[Any, Any, Dict[str, torch.Tensor]]:
    """A VBE KJT of ``rank`` at ``step`` (feature f keeps its first ``VBE_BAGS[f]`` bags of
    :func:`kjt_and_grads`, and ``inverse_indices`` map each of the B samples to one of them), its
    expansion (sample s takes its bag's ids: what sharded EmbeddingCollections look up for
    a VBE KJT) and the upstream gradient of each feature's expanded rows."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt, _ = kjt_and_grads(step, rank)
    gen = torch.Generator().manual_seed(7 + 100 * step + rank)
    inverse = torch.stack([torch.randint(0, VBE_BAGS[f], (B,), generator=gen) for f in FEATURES])
    lengths, values, wide_lengths, wide_values, grads = [], [], [], [], {}
    for i, f in enumerate(FEATURES):
        bag_lengths = kjt[f].lengths()[: VBE_BAGS[f]]
        bag_ids = torch.split(kjt[f].values()[: int(bag_lengths.sum())], bag_lengths.tolist())
        lengths.append(bag_lengths)
        values.extend(bag_ids)
        wide_lengths.append(bag_lengths[inverse[i]])
        wide_values.extend(bag_ids[int(b)] for b in inverse[i])
        n = int(bag_lengths[inverse[i]].sum())
        grads[f] = torch.randint(-8, 8, (n, DIM), generator=gen).float() / 16.0
    vbe = KeyedJaggedTensor(
        keys=FEATURES,
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        stride_per_key_per_rank=[[VBE_BAGS[f]] for f in FEATURES],
        inverse_indices=(FEATURES, inverse),
    )
    wide = KeyedJaggedTensor(keys=FEATURES, values=torch.cat(wide_values), lengths=torch.cat(wide_lengths))
    return vbe, wide, grads


def _inputs(step: int, rank: int, vbe: bool) -> Tuple[Any, Any, Dict[str, torch.Tensor]]:
    """(model input, the KJT whose ids the outputs must equal, gradients) of a step."""
    if vbe:
        return _vbe_batch(step, rank)
    kjt, grads = kjt_and_grads(step, rank)
    return kjt, kjt, grads


def _body(rank: int, world: int, vbe: bool) -> Dict[str, Any]:
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from recpipe.pipeline.tiered.kernels import TieredBatchedEmbedding
    from recpipe.pipeline.tiered.tiered_collections import TieredShardedEmbeddingCollection
    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingCollectionSharder

    ec = make_ec()
    reference = {t: ec.embeddings[t].weight.detach().clone() for t, _, _ in TABLES}
    apply_optimizer_in_backward(torch.optim.SGD, ec.parameters(), {"lr": LR})
    sharder = TieredEmbeddingCollectionSharder()
    plan = planner_plan(ec, world)
    ps = plan.plan[""]
    out: Dict[str, Any] = {
        "plan": {
            t: (p.sharding_type, p.compute_kernel, p.mode, p.cache_load_factor, p.dist_type) for t, p in ps.items()
        },
        "kernels_cpu": sharder.compute_kernels("row_wise", "cpu"),
    }
    model = DistributedModelParallel(ec, plan=plan, sharders=[sharder], device=torch.device("cpu"))  # type: ignore[list-item]
    sharded = model.module
    assert isinstance(sharded, TieredShardedEmbeddingCollection), type(sharded)
    tiered = sharded.tiered_tables()
    out["tiered"] = {
        n: (s.mode.name, s.cache_load_factor, s.dist_type, s.num_rows, s.cache_slots, s.fast_rows)
        for n, s in sorted(tiered.items())
    }
    out["kernel_types"] = sorted(
        {
            type(m).__name__
            for lookup in sharded._lookups
            for m in lookup.modules()
            if isinstance(m, TieredBatchedEmbedding)
        }
    )
    out["plan_kernel"] = (
        sharded.module_sharding_plan["s0"].compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
    )
    # VBE: torchrec's own sharded EC (TABLE_WISE FUSED, torchrec's sharder) on the same
    # batches is the reference: its backward of a VBE lookup is not that of the expanded
    # KJT (measured: the two differ from step 1 on), so the plain-SGD reference is not
    torchrec_model = _torchrec_table_wise(world) if vbe else None

    out_equal: List[bool] = []
    max_diff: List[float] = []
    loaded = 0.0
    hits: List[float] = []
    for step in range(STEPS):
        kjt, wide, grads = _inputs(step, rank, vbe)
        emb = model(kjt)
        torchrec_emb = torchrec_model(kjt) if torchrec_model is not None else None
        loss = torch.zeros(())
        for f in FEATURES:
            got = emb[f].values()
            plain = got.detach()
            ids = wide[f].values()
            assert torch.equal(emb[f].lengths(), wide[f].lengths()), (f, emb[f].lengths(), wide[f].lengths())
            if torchrec_emb is not None:
                want = torchrec_emb[f].values().detach()
                loss = loss + (torchrec_emb[f].values() * grads[f]).sum()
            else:
                want = reference[FEATURE_TABLE[f]].index_select(0, ids)
            out_equal.append(bool(torch.equal(plain, want)))
            max_diff.append(float((plain - want).abs().max()) if plain.numel() else 0.0)
            loss = loss + (got * grads[f]).sum()
        loss.backward()
        stats = sharded.tier_stats()
        loaded += stats["s0"]["rows_loaded"]
        hits.append(stats["s0"]["hit_rate"])
        # reference SGD step over every rank's batch of this step (same formula as the kernel)
        full = {t: torch.zeros_like(w) for t, w in reference.items()}
        for r in range(world):
            _, r_wide, r_grads = _inputs(step, r, vbe)
            for f in FEATURES:
                full[FEATURE_TABLE[f]].index_add_(0, r_wide[f].values(), r_grads[f])
        for t in reference:
            # torchrec divides embedding gradients by the world size in its all-to-all
            # backward (torchrec.distributed.comm_ops gradient division, on by default)
            reference[t].sub_(full[t] / world, alpha=LR)
    out["out_equal"] = out_equal
    out["max_diff"] = max_diff
    out["rows_loaded"] = loaded
    out["hit_rate"] = hits
    # updated weights: every rank exports its rows (global ids, values) after a flush
    out["export"] = {
        n: (st.global_ids.numpy(), st.weights.numpy(), st.metadata["placement"]["mode"])
        for n, st in sharded.tiered_state().items()
    }
    out["reference"] = {t: w.numpy() for t, w in reference.items()}
    # torchrec's own state_dict keeps an empty placeholder for tiered tables
    out["state_dict_weight"] = list(model.state_dict()["embeddings.s0.weight"].shape)
    return out


@pytest.mark.parametrize("vbe", [False, True], ids=["kjt", "vbe_kjt"])
def test_dmp_row_wise_tiered_ec_equals_unsharded_sgd(vbe: bool) -> None:
    """Outputs and updated weights bit-identical to the unsharded SGD reference. A VBE KJT
    (variable batch per feature) is looked up as its expansion to the full batch, as
    torchrec's sharded EmbeddingCollection does, and every step's outputs equal torchrec's
    own TABLE_WISE FUSED EC on the same batches (tiered EBCs refuse VBE; ECs take it)."""
    results = run_gloo(2, _body, vbe)
    for rank, res in enumerate(results):
        assert "customized_kernel" in res["kernels_cpu"], res["kernels_cpu"]
        for t, (mode, x) in PLACEMENT.items():
            assert res["plan"][t] == ("row_wise", "customized_kernel", mode, x, "hash_roundrobin"), res["plan"][t]
            assert res["tiered"][t][:3] == (mode, x, "hash_roundrobin")
        rows0 = res["tiered"]["s0"][3]
        assert res["tiered"]["s0"][4] == int(0.3 * rows0) > 0  # CACHING slots
        assert res["tiered"]["s1"][5] == int(0.5 * res["tiered"]["s1"][3])  # HYBRID fast rows
        assert res["kernel_types"] == ["TieredBatchedEmbedding"] and res["plan_kernel"]
        assert all(res["out_equal"]), f"rank {rank}: outputs differ, max |diff| per lookup {res['max_diff']}"
        assert res["rows_loaded"] > 0  # the cache really moved rows between the tiers
        assert res["state_dict_weight"] == [0]
    if vbe:  # every step's outputs equal torchrec's, so the rows looked up were updated alike
        return
    # gather both ranks' exports into full tables and compare with the reference SGD
    for t, rows, _ in TABLES:
        got = np.full((rows, DIM), np.nan, dtype=np.float32)
        seen = np.zeros(rows, dtype=np.int64)
        for res in results:
            gids, w, mode = res["export"][t]
            assert mode == PLACEMENT[t][0]
            got[gids] = w
            seen[gids] += 1
        assert (seen == 1).all(), f"{t}: rows exported {seen.min()}..{seen.max()} times"
        want = results[0]["reference"][t]
        np.testing.assert_array_equal(results[1]["reference"][t], want)
        moved = int((want != _initial(t)).any(axis=1).sum())
        assert moved > 10, f"{t}: only {moved} rows were updated; the comparison has no teeth"
        np.testing.assert_array_equal(got, want, err_msg=f"table {t}: updated weights differ")


def _torchrec_table_wise(world: int) -> Any:
    """The EC of :func:`make_ec` (same initial weights) sharded by torchrec's own sharder,
    TABLE_WISE with the FUSED kernel and in-backward SGD at ``LR``."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    ec = make_ec()
    apply_optimizer_in_backward(torch.optim.SGD, ec.parameters(), {"lr": LR})
    sharder = EmbeddingCollectionSharder()
    per = {t: table_wise(rank=i % world) for i, (t, _, _) in enumerate(TABLES)}
    plan = ShardingPlan(
        {
            "": construct_module_sharding_plan(
                ec, per, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
            )
        }
    )
    return DistributedModelParallel(ec, plan=plan, sharders=[sharder], device=torch.device("cpu"))  # type: ignore[list-item]


def _initial(table: str) -> np.ndarray:
    return make_ec().embeddings[table].weight.detach().numpy()
