"""Row order of roundrobin / hash_roundrobin FUSED tables in state dicts and checkpoints.

Such a table's shard on rank r holds the global rows routing gives r, in local-id
order, while its ShardedTensor offsets name contiguous rows. Pinned: a routed state
is refused by a continuous (torchrec) table of the same shard sizes and a continuous
state by a routed table, naming both row orders; an unsharded module's weights load
into a routed table by global row id. 2-rank gloo runs, checked against the
pure-Python reference routing (``routing_reference.route_one``) and plain full tensors.
"""

from __future__ import annotations

import os
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from harness.gloo import run_gloo
from harness.row_wise_tables import SEED, TABLES, fused_row_wise_plan, owner_rows
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

EC_DIM = 4


def _model(kind: str, dist_type: str, world: int, seed: int = SEED) -> DistributedModelParallel:
    from recpipe.pipeline.routing.routed_sharders import routed_sharders

    if kind == "ebc":
        module: Any = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=t, num_embeddings=n, embedding_dim=d, feature_names=fs)
                for t, n, d, fs in TABLES
            ],
            device=torch.device("meta"),
        )
    else:
        module = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name=t, num_embeddings=n, embedding_dim=EC_DIM, feature_names=fs)
                for t, n, _, fs in TABLES
            ],
            device=torch.device("meta"),
        )
    routed = dist_type != "continuous"
    sharders = routed_sharders(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1},
        table_dist_types={t: dist_type for t, *_ in TABLES} if routed else None,
        seed=seed,
    )
    plan = ShardingPlan(
        {"": EmbeddingModuleShardingPlan(fused_row_wise_plan(world, routed, EC_DIM if kind == "ec" else 0))}
    )
    return DistributedModelParallel(
        module,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=plan,
        sharders=sharders,
        init_data_parallel=False,
    )


def _reference(kind: str) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {t: torch.randn(n, EC_DIM if kind == "ec" else d, generator=g) for t, n, d, _ in TABLES}


def _key(kind: str, table: str, field: str = "weight") -> str:
    return f"{'embedding_bags' if kind == 'ebc' else 'embeddings'}.{table}.{field}"


def _locals(model: DistributedModelParallel, kind: str) -> Dict[str, torch.Tensor]:
    sd = model.state_dict()
    return {t: sd[_key(kind, t)].local_shards()[0].tensor.clone() for t, *_ in TABLES}


def _rows_of(dist_type: str, world: int, rank: int) -> Dict[str, torch.Tensor]:
    return {t: owner_rows(n, world, rank, dist_type) for t, n, *_ in TABLES}


def _refusal(model: DistributedModelParallel, state: Dict[str, Any], **kwargs: Any) -> str:
    from recpipe.pipeline.routing.row_order import RowOrderMismatchError

    try:
        model.load_state_dict(state, **kwargs)
    except RowOrderMismatchError as e:
        return str(e)
    return ""


def _state_dict_body(rank: int, world: int, kind: str, dist_type: str) -> Dict[str, Any]:
    from recpipe.pipeline.tiered.migration import gather_full_weights

    ref = _reference(kind)
    routed = _model(kind, dist_type, world)
    out: Dict[str, Any] = {}
    # an unsharded module's full weights: each rank gets its routed rows
    routed.load_state_dict({_key(kind, t): ref[t] for t in ref}, strict=False)
    mine = _rows_of(dist_type, world, rank)
    out["full_load_exact"] = all(torch.equal(w, ref[t][mine[t]]) for t, w in _locals(routed, kind).items())
    state = routed.state_dict()
    out["records"] = {t: state[_key(kind, t, "row_order")] for t in ref}
    full = gather_full_weights(routed)
    out["gather_exact"] = sorted(full) == sorted(_key(kind, t) for t in ref) and all(
        torch.equal(full[_key(kind, t)], ref[t]) for t in ref
    )

    # continuous (torchrec's layout, same shard sizes) <-> routed: refused, nothing changed
    cont = _model(kind, "continuous", world)
    cont_before = _locals(cont, kind)
    out["routed_into_continuous"] = _refusal(cont, state)
    out["continuous_unchanged"] = all(torch.equal(cont_before[t], w) for t, w in _locals(cont, kind).items())
    routed_before = _locals(routed, kind)
    out["continuous_into_routed"] = _refusal(routed, cont.state_dict())
    out["routed_unchanged"] = all(torch.equal(routed_before[t], w) for t, w in _locals(routed, kind).items())
    # another routing or seed: refused
    other = (
        _model(kind, "hash_roundrobin", world)
        if dist_type == "roundrobin"
        else _model(kind, "hash_roundrobin", world, seed=SEED + 1)
    )
    out["into_other_routing"] = _refusal(other, state)
    # the same routing: loads exactly
    same = _model(kind, dist_type, world)
    same.load_state_dict(state)
    out["same_routing_exact"] = all(torch.equal(routed_before[t], w) for t, w in _locals(same, kind).items())
    # full tables gathered from the routed model load into the continuous one by global id
    cont.load_state_dict(full, strict=False)
    blocks = _rows_of("continuous", world, rank)
    out["full_into_continuous_exact"] = all(torch.equal(w, ref[t][blocks[t]]) for t, w in _locals(cont, kind).items())
    return out


@pytest.mark.parametrize("dist_type", ["roundrobin", "hash_roundrobin"])
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_routed_fused_state_dict_keeps_rows_on_their_ids(kind: str, dist_type: str) -> None:
    results = run_gloo(2, _state_dict_body, kind, dist_type, timeout_s=300)
    from recpipe.pipeline.routing import ops

    for rank, r in enumerate(results):
        assert r["full_load_exact"], (rank, r)
        assert r["gather_exact"], (rank, r)
        for t, n, *_ in TABLES:
            assert r["records"][t] == {
                "dist_type": dist_type,
                "world_size": 2,
                "routing_seed": SEED if dist_type == "hash_roundrobin" else 0,
                "num_embeddings": n,
                "routing_version": ops.ROUTING_VERSION,
            }
        for case in ("routed_into_continuous", "continuous_into_routed", "into_other_routing"):
            msg = r[case]
            assert "rows routed with dist_type=" in msg and "gather_full_weights" in msg, (case, msg)
            assert "table 't0'" in msg and "table 't1'" in msg, (case, msg)
            # load_state_dict cannot tell whether torch's dcp.load already wrote the rows in place: it says so
            assert "If torch.distributed.checkpoint.load filled this state dict in place" in msg, (case, msg)
            assert "recpipe.pipeline.checkpoint.load checks the routing before it reads any row" in msg, (case, msg)
        assert "contiguous row blocks" in r["routed_into_continuous"]
        assert "contiguous row blocks" in r["continuous_into_routed"]
        assert r["continuous_unchanged"] and r["routed_unchanged"], (rank, r)
        assert r["same_routing_exact"], (rank, r)
        assert r["full_into_continuous_exact"], (rank, r)


def _dcp_body(rank: int, world: int, kind: str, dist_type: str, path: str) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint as recpipe_dcp
    from recpipe.pipeline.routing.row_order import RowOrderMismatchError

    ref = _reference(kind)
    routed = _model(kind, dist_type, world)
    routed.load_state_dict({_key(kind, t): ref[t] for t in ref}, strict=False)
    recpipe_dcp.save(routed, path)
    out: Dict[str, Any] = {}
    mine = _rows_of(dist_type, world, rank)
    for name, target in (
        ("continuous", _model(kind, "continuous", world)),
        ("other_seed", _model(kind, dist_type, world, seed=SEED + 1)),
        ("same", _model(kind, dist_type, world)),
    ):
        before = _locals(target, kind)
        try:
            recpipe_dcp.load(target, path)
            out[name] = ""
        except RowOrderMismatchError as e:
            out[name] = str(e)
        after = _locals(target, kind)
        out[name + "_unchanged"] = all(torch.equal(before[t], w) for t, w in after.items())
        out[name + "_exact"] = all(torch.equal(w, ref[t][mine[t]]) for t, w in after.items())
    return out


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_dcp_load_refuses_routed_rows_before_writing_them(kind: str, tmp_path: Any) -> None:
    results = run_gloo(2, _dcp_body, kind, "roundrobin", os.fspath(tmp_path / "ckpt"), timeout_s=300)
    for r in results:
        assert "recpipe.pipeline.checkpoint.load" in r["continuous"] and "contiguous row blocks" in r["continuous"], r
        assert "filled this state dict in place" not in r["continuous"], r  # refused before any row was read
        assert r["continuous_unchanged"], r
        # roundrobin has no seed (recorded as 0): another sharder seed loads exactly
        assert r["other_seed"] == "" and r["other_seed_exact"], r
        assert r["same"] == "" and r["same_exact"], r


def test_dcp_load_refuses_another_hash_seed(tmp_path: Any) -> None:
    results = run_gloo(2, _dcp_body, "ebc", "hash_roundrobin", os.fspath(tmp_path / "ckpt"), timeout_s=300)
    for r in results:
        assert "routing_seed=17" in r["other_seed"] and "routing_seed=18" in r["other_seed"], r
        assert r["continuous"] and r["continuous_unchanged"] and r["other_seed_unchanged"], r
        assert r["same"] == "" and r["same_exact"], r


def _torchrec_layouts_body(rank: int, world: int) -> Dict[str, Any]:
    """t0 TABLE_WISE on rank 1, t1 COLUMN_WISE (two column shards) on ranks 0 and 1."""
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, table_wise

    from recpipe.pipeline.routing.routed_sharders import RoutedEmbeddingBagCollectionSharder
    from recpipe.pipeline.tiered.migration import gather_full_weights

    ref = _reference("ebc")
    module = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=t, num_embeddings=n, embedding_dim=d, feature_names=fs) for t, n, d, fs in TABLES
        ],
        device=torch.device("meta"),
    )
    sharder = RoutedEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    )
    plan = construct_module_sharding_plan(
        module,
        {"t0": table_wise(rank=1), "t1": column_wise(ranks=[0, 1])},
        sharder=sharder,
        local_size=world,
        world_size=world,
        device_type="cpu",
    )
    model = DistributedModelParallel(
        module,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],
        init_data_parallel=False,
    )
    model.load_state_dict({_key("ebc", t): ref[t] for t in ref}, strict=False)  # torchrec slices by offsets
    full = gather_full_weights(model)
    routed = _model("ebc", "hash_roundrobin", world)
    routed.load_state_dict(full, strict=False)
    mine = _rows_of("hash_roundrobin", world, rank)
    return {
        "gather_exact": all(torch.equal(full[_key("ebc", t)], ref[t]) for t in ref),
        "into_routed_exact": all(torch.equal(w, ref[t][mine[t]]) for t, w in _locals(routed, "ebc").items()),
    }


def test_gather_full_weights_of_table_and_column_wise_tables_loads_into_a_routed_model() -> None:
    for rank, r in enumerate(run_gloo(2, _torchrec_layouts_body, timeout_s=300)):
        assert r["gather_exact"] and r["into_routed_exact"], (rank, r)
