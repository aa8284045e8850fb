"""Row-wise sharding on CPU with recpipe routing: 2-rank gloo vs an unsharded reference.

For each dist_type, an EmbeddingBagCollection (and an EmbeddingCollection) is
sharded ROW_WISE by recpipe's sharders with torchrec's FUSED kernel (exact SGD).
Each rank feeds its own batch; outputs must equal the unsharded module's on
that batch, and after every step each rank's shard rows must equal the
reference weights updated with the gradient of both ranks' losses.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from harness.gloo import run_gloo
from harness.row_wise_tables import SEED, TABLES, UNEVEN, fused_row_wise_plan, owner_rows
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

LR = 0.1


def _batch(
    rank: int, step: int, features: list[str], n_of: dict[str, int], B: int = 6, vbe: bool = False
) -> KeyedJaggedTensor:
    """A random batch of B samples; ``vbe``: each feature has its own number of
    distinct bags (1..B), expanded to the B samples by ``inverse_indices``."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths, values, strides, inverse = [], [], [], []
    for f in features:
        b = int(torch.randint(1, B + 1, (1,), generator=g)) if vbe else B
        ln = torch.randint(0, 4, (b,), generator=g)
        lengths.append(ln)
        values.append(torch.randint(0, n_of[f], (int(ln.sum()),), generator=g))
        strides.append([b])
        inverse.append(torch.randint(0, b, (B,), generator=g))
    if not vbe:
        return KeyedJaggedTensor.from_lengths_sync(keys=features, values=torch.cat(values), lengths=torch.cat(lengths))
    return KeyedJaggedTensor(
        keys=features,
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        stride_per_key_per_rank=strides,
        inverse_indices=(features, torch.stack(inverse)),
    )


def _body(rank: int, world: int, kind: str, dist_type: str, uneven: bool = False, vbe: bool = False) -> dict[str, Any]:
    from recpipe.pipeline.routing.routed_sharders import routed_sharders

    torch.manual_seed(0)
    features = [f for *_, fs in TABLES for f in fs]
    n_of = {f: n for _, n, _, fs in TABLES for f in fs}
    if kind == "ebc":
        configs = [
            EmbeddingBagConfig(name=t, num_embeddings=n, embedding_dim=d, feature_names=fs) for t, n, d, fs in TABLES
        ]
        ref = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        module = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        prefix = "embedding_bags"
    else:
        configs = [
            EmbeddingConfig(name=t, num_embeddings=n, embedding_dim=4, feature_names=fs) for t, n, _, fs in TABLES
        ]
        ref = EmbeddingCollection(tables=configs, device=torch.device("cpu"))
        module = EmbeddingCollection(tables=configs, device=torch.device("meta"))
        prefix = "embeddings"
    routed = dist_type != "continuous"
    table_dist = {t: dist_type for t, *_ in TABLES}
    sharders = routed_sharders(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR},
        table_dist_types=table_dist if routed else None,
        seed=SEED,
    )
    plan = ShardingPlan(
        {"": EmbeddingModuleShardingPlan(fused_row_wise_plan(world, routed, 4 if kind == "ec" else 0, uneven))}
    )
    model = DistributedModelParallel(
        module,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=plan,
        sharders=sharders,
        init_data_parallel=False,
    )
    # Put the reference weights into the shards, row by row where routing says.
    ref_w = {t: getattr(ref, prefix)[t].weight.detach().clone() for t, *_ in TABLES}
    rows = {t: owner_rows(n, world, rank, dist_type, UNEVEN[t] if uneven else None) for t, n, *_ in TABLES}
    sd = model.state_dict()
    for t, *_ in TABLES:
        key = next(k for k in sd if k.endswith(f"{prefix}.{t}.weight"))
        sd[key].local_shards()[0].tensor.copy_(ref_w[t][rows[t]])
    max_out_err = 0.0
    max_w_err = 0.0
    for step in range(4):
        batches = [_batch(r, step, features, n_of, vbe=vbe) for r in range(world)]
        out = model(batches[rank])
        # reference forward on this rank's batch, and the global gradient
        ref_params = {t: ref_w[t].clone().requires_grad_(True) for t in ref_w}
        for t in ref_params:
            getattr(ref, prefix)[t].weight = torch.nn.Parameter(ref_params[t])
        total = 0.0
        for r in range(world):
            ref_out = ref(batches[r])
            if kind == "ebc":
                vals = ref_out.values()
                probe = torch.linspace(-1, 1, vals.numel()).view_as(vals)
                total = total + (vals * probe).sum()
                if r == rank:
                    max_out_err = max(max_out_err, float((out.values().detach() - vals).abs().max()))
                    my_probe = probe
            else:
                loss_r = 0.0
                for f in features:
                    v = ref_out[f].values()
                    probe = torch.linspace(-1, 1, v.numel()).view_as(v) if v.numel() else v
                    loss_r = loss_r + (v * probe).sum()
                    if r == rank and v.numel():
                        max_out_err = max(max_out_err, float((out[f].values().detach() - v.detach()).abs().max()))
                total = total + loss_r
        total.backward()
        with torch.no_grad():
            # torchrec divides sharded-embedding gradients by the world size
            # (comm_ops gradient division, on by default) to match DDP averaging.
            for t in ref_w:
                ref_w[t] = ref_w[t] - LR * getattr(ref, prefix)[t].weight.grad / world
        # sharded backward with the same loss on this rank's batch
        if kind == "ebc":
            (out.values() * my_probe).sum().backward()
        else:
            loss = 0.0
            for f in features:
                v = out[f].values()
                if v.numel():
                    loss = loss + (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum()
            loss.backward()
        sd = model.state_dict()
        for t, *_ in TABLES:
            key = next(k for k in sd if k.endswith(f"{prefix}.{t}.weight"))
            local = sd[key].local_shards()[0].tensor
            max_w_err = max(max_w_err, float((local - ref_w[t][rows[t]]).abs().max()))
    return {"out_err": max_out_err, "w_err": max_w_err}


@pytest.mark.parametrize("dist_type", ["continuous", "roundrobin", "hash_roundrobin"])
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_row_wise_on_cpu_matches_unsharded_reference(kind: str, dist_type: str) -> None:
    results = run_gloo(2, _body, kind, dist_type, timeout_s=300)
    for r in results:
        assert r["out_err"] < 1e-5, results
        assert r["w_err"] < 1e-5, results


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_uneven_row_wise_shards_match_unsharded_reference(kind: str) -> None:
    """A plan that cuts tables into uneven shards (37 rows as 10 + 27, 20 as 15 + 5):
    ids are routed by the shard bounds (fbgemm's block_bucketize_pos), so 2 gloo
    ranks train exactly as the unsharded module does."""
    for r in run_gloo(2, _body, kind, "continuous", True, timeout_s=300):
        assert r["out_err"] < 1e-5 and r["w_err"] < 1e-5, r


@pytest.mark.parametrize("dist_type", ["continuous", "hash_roundrobin"])
def test_variable_batch_per_feature_matches_unsharded_reference(dist_type: str) -> None:
    """VBE KJTs (each feature its own batch size, expanded by inverse_indices) through
    recpipe's row-wise routing on 2 gloo ranks equal the unsharded module."""
    for r in run_gloo(2, _body, "ebc", dist_type, False, True, timeout_s=300):
        assert r["out_err"] < 1e-5 and r["w_err"] < 1e-5, r


def test_routed_table_with_torchrec_block_layout_is_refused() -> None:
    """hash routing on torchrec's contiguous shards would index past the last rank's shard."""
    from recpipe.pipeline.routing.features import check_routed_layout

    class _Spec:
        shards_metadata = [
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[4, 2], placement="rank:0/cpu"),
            ShardMetadata(shard_offsets=[4, 0], shard_sizes=[3, 2], placement="rank:1/cpu"),
        ]

    class _Table:
        name = "t"
        global_metadata = _Spec()

    check_routed_layout(_Table(), 7, 2, "hash_roundrobin")  # 4 + 3 is the routed layout
    _Spec.shards_metadata[0].shard_sizes = [5, 2]
    _Spec.shards_metadata[1].shard_sizes = [2, 2]
    with pytest.raises(ValueError, match=r"puts \[4, 3\] rows .* shards of \[5, 2\] rows"):
        check_routed_layout(_Table(), 7, 2, "hash_roundrobin")


def test_fused_row_wise_table_with_an_empty_shard_is_refused_on_cpu() -> None:
    """fbgemm-gpu-cpu's fused TBE backward mis-updates the table after a 0-row one (another
    dim) and can corrupt the heap: recpipe's sharders refuse such a plan on CPU, naming
    the table and the empty ranks; tiered tables (recpipe's own CPU kernel) are not refused."""
    from recpipe.pipeline.routing.routed_sharders import routed_sharders
    from recpipe.pipeline.tiered.tiered_sharders import (
        TieredEmbeddingBagCollectionSharder,
        TieredEmbeddingCollectionSharder,
    )

    params = fused_row_wise_plan(2, routed=False)
    t0 = params["t0"]
    t0.sharding_spec.shards[0].shard_sizes = [37, 8]  # t0 (37 rows) all on rank 0
    t0.sharding_spec.shards[1].shard_offsets = [37, 0]
    t0.sharding_spec.shards[1].shard_sizes = [0, 8]
    cfg = [
        EmbeddingBagConfig(name=n, num_embeddings=rows, embedding_dim=dim, feature_names=fs)
        for n, rows, dim, fs in TABLES
    ]
    for sharder in (*routed_sharders(), TieredEmbeddingBagCollectionSharder(), TieredEmbeddingCollectionSharder()):
        with pytest.raises(
            ValueError,
            match=r"table 't0' is ROW_WISE with row-wise shards of \[37, 0\] rows: "
            r"rank\(s\) \[1\] hold 0 rows.*Possible solutions:\n  1\) .*\n  2\) shard it TABLE_WISE",
        ):
            sharder._check_kernels(params, torch.device("cpu"))  # type: ignore[attr-defined]
        sharder._check_kernels(params, torch.device("cuda"))  # type: ignore[attr-defined]  # CPU only
    with pytest.raises(ValueError, match="table 't0' is ROW_WISE"):  # through shard(), before any collective
        routed_sharders()[0].shard(
            EmbeddingBagCollection(tables=cfg, device=torch.device("meta")),
            params,
            env=None,
            device=torch.device("cpu"),
        )  # type: ignore[arg-type]
    t0.compute_kernel = EmbeddingComputeKernel.DENSE.value  # the dense TBE backward is right
    routed_sharders()[0]._check_kernels(params, torch.device("cpu"))  # type: ignore[attr-defined]


def test_dense_sequence_table_is_refused_on_cpu() -> None:
    """fbgemm-gpu-cpu's dense TBE pools a sequence (EmbeddingCollection) lookup on CPU (one
    row per bag, not per id), which breaks torchrec's sequence output dist (a split-size
    error, or heap corruption): recpipe's EC sharders refuse DENSE-kernel tables on CPU,
    under every sharding, naming the table; EBC (pooled) dense tables stay accepted."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen

    from recpipe.pipeline.routing.routed_sharders import routed_sharders
    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingCollectionSharder

    # the upstream behaviour the refusal is for: 5 ids in 3 bags come back as 3 rows
    tbe = DenseTableBatchedEmbeddingBagsCodegen([(30, 8)], pooling_mode=PoolingMode.NONE, use_cpu=True)
    out = tbe(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 2, 5]))
    assert out.shape == (3, 8), f"fbgemm's CPU dense TBE now returns {tuple(out.shape)}: revisit this refusal"

    ebc_sharder, ec_sharder = routed_sharders()
    for kind in (ShardingType.ROW_WISE, ShardingType.TABLE_WISE, ShardingType.DATA_PARALLEL):
        params = fused_row_wise_plan(2, routed=True)
        params["t1"].sharding_type = kind.value
        params["t1"].compute_kernel = EmbeddingComputeKernel.DENSE.value
        for sharder in (ec_sharder, TieredEmbeddingCollectionSharder()):
            with pytest.raises(
                ValueError,
                match=rf"EmbeddingCollection table 't1' is {kind.value} with "
                r"compute_kernel dense on CPU.*Possible solutions:\n  1\) .*fused.*\n  2\) .*tiered",
            ):
                sharder._check_kernels(params, torch.device("cpu"))  # type: ignore[attr-defined]
            sharder._check_kernels(params, torch.device("cuda"))  # type: ignore[attr-defined]  # CPU only
        ebc_sharder._check_kernels(params, torch.device("cpu"))  # type: ignore[attr-defined]  # pooled: fine
    cfg = [EmbeddingConfig(name=n, num_embeddings=rows, embedding_dim=8, feature_names=fs) for n, rows, _, fs in TABLES]
    with pytest.raises(ValueError, match="EmbeddingCollection table 't1'"):  # through shard(), before any collective
        ec_sharder.shard(
            EmbeddingCollection(tables=cfg, device=torch.device("meta")), params, env=None, device=torch.device("cpu")
        )  # type: ignore[arg-type]


def test_sharder_rejects_unknown_dist_type() -> None:
    from recpipe.pipeline.routing.routed_sharders import RoutedEmbeddingBagCollectionSharder

    with pytest.raises(ValueError, match=r"`table_dist_types\['t0'\]`: unknown dist_type 'hash'"):
        RoutedEmbeddingBagCollectionSharder(table_dist_types={"t0": "hash"})


def test_row_wise_offered_on_cpu() -> None:
    from recpipe.pipeline.routing.routed_sharders import (
        RoutedEmbeddingBagCollectionSharder,
        RoutedEmbeddingCollectionSharder,
    )

    for s in (RoutedEmbeddingBagCollectionSharder(), RoutedEmbeddingCollectionSharder()):
        assert ShardingType.ROW_WISE.value in s.sharding_types("cpu")


def _output_dist_body(rank: int, world: int) -> dict[str, Any]:
    from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
    from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist

    from recpipe.pipeline.routing.dists import RoutedRwPooledEmbeddingDist

    pg = dist.group.WORLD
    dims = [4, 3]
    ours = RoutedRwPooledEmbeddingDist(pg, embedding_dims=dims)
    theirs = RwPooledEmbeddingDist(pg, embedding_dims=dims)
    out: dict[str, Any] = {"uses_all_to_all": ours._a2a is not None}
    for splits in ([5, 5], [3, 6]):  # even, and uneven batch sizes per rank
        # every rank can rebuild every rank's partial sums and output gradient (seeded)
        partials = [
            torch.randn(sum(splits), sum(dims), generator=torch.Generator().manual_seed(100 + r)) for r in range(world)
        ]
        grads = [
            torch.randn(splits[r], sum(dims), generator=torch.Generator().manual_seed(200 + r)) for r in range(world)
        ]
        lo = sum(splits[:rank])
        want_y = partials[0][lo : lo + splits[rank]] + partials[1][lo : lo + splits[rank]]
        want_grad = torch.cat(grads) / world  # torchrec divides sharded gradients by W
        ctx = EmbeddingShardingContext(batch_size_per_rank=splits)
        modules = [ours, theirs] if splits[0] == splits[1] else [ours]  # gloo's all-gather needs even splits
        for name, module in zip(("ours", "torchrec"), modules):
            x = partials[rank].clone().requires_grad_(True)
            y = module(x, ctx).wait()
            y.backward(grads[rank])
            out[f"{name} {splits}"] = [torch.equal(y.detach(), want_y), torch.equal(x.grad, want_grad)]
    return out


def test_gloo_output_dist_all_to_all_equals_reduce_scatter() -> None:
    """On gloo recpipe returns pooled row-wise sums by all-to-all + local sum: output and
    gradient bit-identical to the sum of the ranks' partial sums and to torchrec's
    reduce-scatter (W = 2), for uneven batches per rank too."""
    for res in run_gloo(2, _output_dist_body, timeout_s=120):
        assert res == {
            "uses_all_to_all": True,
            "ours [5, 5]": [True, True],
            "torchrec [5, 5]": [True, True],
            "ours [3, 6]": [True, True],
        }
