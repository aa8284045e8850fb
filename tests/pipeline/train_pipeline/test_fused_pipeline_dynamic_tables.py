"""TrainPipelineFusedSparseDist over dynamic tables: bit-identical to TrainPipelineSparseDist and to a plain loop.

Every table of the pipeline tests' two-module model is dynamic (``harness.dynamic_models``: raw int64 keys,
capacities below the distinct keys, so buckets fill and keys are evicted during the run), on 2 gloo ranks.
The fused pipeline inserts batch i+1's new keys right after batch i's backward; torchrec's inside its
forward: losses and predictions must be equal bit for bit over 10 batches, with evictions.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch
from harness.dynamic_models import build_dynamic, dynamic_shards, raw_key_batches
from harness.gloo import run_gloo
from harness.pipelines import N_BATCHES, run_pipeline, run_reference


def _numpy(trace: Tuple[List[torch.Tensor], ...]) -> List[List[np.ndarray]]:
    return [[t.detach().cpu().numpy() for t in part] for part in trace[:2]]


def _body(rank: int, world: int, sharding: str, eviction: str) -> Dict[str, Any]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline import gather_dynamic_table, route_ids
    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    batches = raw_key_batches(rank, N_BATCHES, 3)
    device = torch.device("cpu")
    out: Dict[str, Any] = {}
    dmp, opt = build_dynamic(world, sharding, eviction=eviction)
    out["reference"] = _numpy(run_reference(dmp, opt, batches))
    out["stats"] = {n: s.tier_stats() for n, s in dynamic_shards(dmp).items()}
    dmp, opt = build_dynamic(world, sharding, eviction=eviction)
    out["sparse_dist"] = _numpy(run_pipeline(TrainPipelineSparseDist(dmp, opt, device), batches))
    for after_opt in (False, True):
        dmp, opt = build_dynamic(world, sharding, eviction=eviction)
        pipeline = TrainPipelineFusedSparseDist(dmp, opt, device, embedding_lookup_after_opt=after_opt)
        out[f"fused_after_opt_{after_opt}"] = _numpy(run_pipeline(pipeline, batches))
        out[f"rows_{after_opt}"] = {n: s.dynamic_rows() for n, s in dynamic_shards(dmp).items()}
    out["gathered"] = {t: gather_dynamic_table(dmp, t) for t in ("t0", "t1", "s0")}
    if sharding == "row_wise":  # each rank holds exactly the keys the raw-key routing sends it
        for table, (keys, *_) in out["rows_True"].items():
            owner, _ = route_ids(keys, 0, world, "hash_roundrobin", 7)
            assert bool((owner == rank).all()), table
    # eval lookups (model.eval(), grad enabled) insert nothing
    pipeline.detach()
    dmp.eval()
    fresh = raw_key_batches(rank, 1, 99)[0]
    before = {n: s.tier_stats()["inserted"] for n, s in dynamic_shards(dmp).items()}
    dmp(fresh)
    out["eval_inserted"] = {n: s.tier_stats()["inserted"] - before[n] for n, s in dynamic_shards(dmp).items()}
    return out


@pytest.mark.parametrize("sharding,eviction", [("table_wise", "lru"), ("row_wise", "lfu"), ("row_wise", "lru")])
def test_fused_pipeline_equals_sparse_dist_on_dynamic_tables(sharding: str, eviction: str) -> None:
    results = run_gloo(2, _body, sharding, eviction)
    evicted = 0.0
    for rank, res in enumerate(results):
        want = res["reference"]
        for name in ("sparse_dist", "fused_after_opt_False", "fused_after_opt_True"):
            got = res[name]
            assert len(got[0]) == N_BATCHES
            for part, what in zip(range(2), ("loss", "prediction")):
                for step, (a, b) in enumerate(zip(got[part], want[part])):
                    assert np.array_equal(a, b), f"rank {rank} {name}: {what} of step {step}"
        for table, rows in res["rows_False"].items():
            for a, b in zip(rows, res["rows_True"][table]):
                assert torch.equal(a, b), table
        evicted += sum(s["evicted"] for s in res["stats"].values())
        assert all(v == 0 for v in res["eval_inserted"].values()), res["eval_inserted"]
        for table, dump in res["gathered"].items():
            # every rank gets every key once: the union of the shards' rows (table-wise: the owner's)
            local = [r["rows_True"].get(table) for r in results]
            keys = torch.cat([p[0] for p in local if p is not None])
            assert torch.equal(dump.keys, keys) and dump.keys.unique().numel() == dump.keys.numel()
            assert torch.equal(dump.weights, torch.cat([p[1] for p in local if p is not None]))
            assert dump.scores.numel() == keys.numel() > 0
        assert all(s["occupancy"] > 0 for s in res["stats"].values() if s["cumulative_lookups"] > 0)
    assert evicted > 0, "the run must evict keys"
