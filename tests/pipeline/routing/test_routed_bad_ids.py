"""Out-of-range and negative ids on recpipe's row-wise tables, against torchrec's own.

torchrec's FUSED tables leave a bad id (``>= num_embeddings`` or negative) to the fused
param ``bounds_check_mode`` of the TBE that owns it (fbgemm's ``BoundsCheckMode``,
default ``WARNING``): on CPU, ``FATAL`` (and ``NONE``, whose CPU kernel checks anyway)
raise on the rank owning the row, in the lookup of that batch; ``WARNING`` / ``IGNORE``
look the owner's local row 0 up in its place (and train it). torchrec's row-wise routing
(fbgemm's ``block_bucketize_sparse_features``) sends an id past the blocks, a negative
one read as unsigned, to rank ``u % W`` as local id ``u // W``.

recpipe's roundrobin / hash_roundrobin routing sends such an id the same way, past the
owner's rows, so the owner's table applies its mode (tiered tables too). Pinned on 2
gloo ranks with one bad id on rank 1 at step 1:

* ``WARNING`` / ``IGNORE``: outputs of every step equal those of torchrec's TABLE_WISE
  FUSED table fed the batch with the bad id replaced by the global id of local row 0 of
  rank ``u % W`` (computed with the pure-Python routing reference);
* ``FATAL`` / ``NONE``: the owner rank ``u % W`` raises in step 1's lookup (fbgemm's
  error for FUSED tables, the tiered table's ``IndexError`` naming it), not the feeding
  rank's router.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
from harness.gloo import run_gloo
from harness.routing_reference import DIST_CODES, route_one

N, DIM, B, STEPS, LR, SEED = 37, 4, 2, 3, 0.1, 5
BAD_STEP, BAD_RANK, BAD_POS = 1, 1, 2


def _bad_value(kind: str) -> int:
    return N + 5 if kind == "oor" else -1


def _owner(value: int, world: int) -> int:
    """Rank torchrec's row-wise routing sends an id past the table to (``u % W``)."""
    return (value & ((1 << 64) - 1)) % world


def _row_zero_of(owner: int, dist_type: str, world: int, seed: int) -> int:
    """Global id of local row 0 of ``owner`` (pure-Python routing reference)."""
    return next(
        g for g in range(N) if route_one(g, DIST_CODES[dist_type], world, -(-N // world), N, seed, 64) == (owner, 0)
    )


def _ids(step: int, rank: int) -> List[int]:
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randint(0, N, (4,), generator=gen).tolist()


def _kjt(ids: List[int], dtype: torch.dtype = torch.int64) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=["f0"], values=torch.tensor(ids, dtype=dtype), lengths=torch.tensor([2, 2]))


def _model(rank: int, world: int, kind: str, dist_type: str, mode: Optional[str]) -> Any:
    """A one-table EBC (t0, N rows) sharded as ``kind``: ``tw`` (torchrec's sharder,
    TABLE_WISE FUSED on rank 0), ``fused`` (recpipe's, ROW_WISE FUSED routed by
    ``dist_type``) or ``tiered_<MODE>_<backend>`` (hash_roundrobin tiered table)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan, ShardingType
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from recpipe.pipeline.routing.routed_sharders import RoutedEmbeddingBagCollectionSharder
    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder
    from recpipe.planner.torchrec_plan import PlacementParameterSharding, row_wise_sharding_spec

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t0", num_embeddings=N, embedding_dim=DIM, feature_names=["f0"])],
        device=torch.device("cpu"),
    )
    weight = ebc.embedding_bags["t0"].weight.detach().clone()
    fp: Dict[str, Any] = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    if mode is not None:
        fp["bounds_check_mode"] = BoundsCheckMode[mode]
    fused = EmbeddingComputeKernel.FUSED.value
    sharder: Any
    if kind == "tw":
        sharder = EmbeddingBagCollectionSharder(fused_params=fp)
        plan = construct_module_sharding_plan(
            ebc,
            {"t0": table_wise(rank=0, compute_kernel=fused)},
            sharder=sharder,
            local_size=world,
            world_size=world,
            device_type="cpu",
        )
    elif kind == "fused":
        sharder = RoutedEmbeddingBagCollectionSharder(fused_params=fp, table_dist_types={"t0": dist_type}, seed=SEED)
        plan = construct_module_sharding_plan(
            ebc,
            {"t0": row_wise(compute_kernel=fused)},
            sharder=sharder,
            local_size=world,
            world_size=world,
            device_type="cpu",
        )
        plan["t0"].sharding_spec = row_wise_sharding_spec(N, DIM, world, world, "cpu")  # ceil((N - r) / W) rows
    else:
        _, tier_mode, backend = kind.split("_")
        sharder = TieredEmbeddingBagCollectionSharder(fused_params=fp, backend=backend)
        plan = construct_module_sharding_plan(
            ebc, {"t0": row_wise()}, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
        )
        plan["t0"] = PlacementParameterSharding(
            sharding_type=ShardingType.ROW_WISE.value,
            compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
            ranks=list(range(world)),
            sharding_spec=row_wise_sharding_spec(N, DIM, world, world, "cpu"),
            dist_type="hash_roundrobin",
            mode=tier_mode,
            cache_load_factor=0.3,
            seed=SEED,
        )
    model = DistributedModelParallel(ebc, plan=ShardingPlan({"": plan}), sharders=[sharder], device=torch.device("cpu"))
    # the same initial rows in every model: by global id (tiered, routed) or by shard offset (TABLE_WISE)
    if kind != "tw":
        model.module.load_state_dict({"embedding_bags.t0.weight": weight}, strict=False)
    else:
        for shard in model.module.state_dict()["embedding_bags.t0.weight"].local_shards():
            with torch.no_grad():
                shard.tensor.copy_(weight)
    return model


def _run(model: Any, batches: List[List[int]], dtype: torch.dtype = torch.int64) -> Tuple[List[Any], List[str]]:
    """Steps over ``batches``: per step the pooled output (or the error that stopped the
    run), and the warnings raised."""
    results: List[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, ids in enumerate(batches):
            try:
                out = model(_kjt(ids, dtype)).values()
                (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            except Exception as e:  # noqa: BLE001 - reported to the parent
                results.append((step, type(e).__name__, str(e)))
                break
            results.append(out.detach().numpy().copy())
    return results, [str(w.message) for w in caught]


def _substitute_body(
    rank: int, world: int, kind: str, dist_type: str, mode: Optional[str], bad: str, dtype: torch.dtype
) -> Dict[str, Any]:
    batches = [_ids(s, rank) for s in range(STEPS)]
    ref_batches = [list(b) for b in batches]
    if rank == BAD_RANK:
        value = _bad_value(bad)
        batches[BAD_STEP][BAD_POS] = value
        ref_batches[BAD_STEP][BAD_POS] = _row_zero_of(_owner(value, world), dist_type, world, SEED)
    got, warned = _run(_model(rank, world, kind, dist_type, mode), batches, dtype)
    ref, _ = _run(_model(rank, world, "tw", dist_type, None), ref_batches)
    return {"got": got, "ref": ref, "warned": warned}


@pytest.mark.parametrize("bad", ["oor", "neg"])
@pytest.mark.parametrize("mode", ["WARNING", "IGNORE"])
@pytest.mark.parametrize("dist_type", ["roundrobin", "hash_roundrobin"])
def test_routed_fused_table_looks_bad_id_up_as_owner_row_zero_as_torchrec(dist_type: str, mode: str, bad: str) -> None:
    """A routed ROW_WISE FUSED table (WARNING / IGNORE): the bad id reaches its owner's TBE,
    which looks local row 0 up (and trains it), as torchrec's row-wise tables do: every
    step's output equals torchrec's TABLE_WISE table fed that row's global id."""
    results = run_gloo(2, _substitute_body, "fused", dist_type, mode, bad, torch.int64, timeout_s=120)
    for rank, r in enumerate(results):
        assert all(isinstance(t, np.ndarray) for t in r["got"]), (rank, r["got"])
        assert len(r["got"]) == STEPS
        for step, (a, b) in enumerate(zip(r["got"], r["ref"])):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=f"rank {rank} step {step}")


def test_routed_fused_table_int32_negative_id_default_mode() -> None:
    """int32 ids and the default mode (fbgemm's WARNING): a negative id is read as unsigned
    32-bit, as fbgemm's routing reads it."""
    results = run_gloo(2, _substitute_body, "fused", "roundrobin", None, "neg", torch.int32, timeout_s=120)
    for rank, r in enumerate(results):
        assert len(r["got"]) == STEPS and all(isinstance(t, np.ndarray) for t in r["got"]), (rank, r["got"])
        for a, b in zip(r["got"], r["ref"]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "kind,mode,bad",
    [
        ("tiered_HYBRID_native", None, "oor"),
        ("tiered_HYBRID_native", "WARNING", "neg"),
        ("tiered_HYBRID_native", "IGNORE", "oor"),
        ("tiered_CACHING_native", None, "neg"),
        ("tiered_CACHING_native", "WARNING", "oor"),
        ("tiered_CACHING_native", "IGNORE", "neg"),
        ("tiered_HYBRID_fbgemm", None, "neg"),
        ("tiered_HYBRID_fbgemm", "WARNING", "oor"),
        ("tiered_HYBRID_fbgemm", "IGNORE", "neg"),
    ],
)
def test_tiered_table_looks_bad_id_up_as_owner_row_zero_as_torchrec(kind: str, mode: Optional[str], bad: str) -> None:
    """A tiered table under the default mode (WARNING, fbgemm's), WARNING or IGNORE: as a
    FUSED table, the owner looks its local row 0 up (tiered tables raised in every mode);
    WARNING warns on the owner, naming the table."""
    results = run_gloo(2, _substitute_body, kind, "hash_roundrobin", mode, bad, torch.int64, timeout_s=120)
    owner = _owner(_bad_value(bad), 2)
    for rank, r in enumerate(results):
        assert len(r["got"]) == STEPS and all(isinstance(t, np.ndarray) for t in r["got"]), (rank, r["got"])
        for step, (a, b) in enumerate(zip(r["got"], r["ref"])):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=f"rank {rank} step {step}")
        table_warnings = [w for w in r["warned"] if "tiered table 't0'" in w]
        if mode == "IGNORE" or rank != owner:
            assert not table_warnings, (rank, table_warnings)
        else:
            assert len(table_warnings) == 1 and "bounds_check_mode=WARNING" in table_warnings[0], r["warned"]


def _fatal_body(rank: int, world: int, kind: str, dist_type: str, mode: str, bad: str) -> List[Any]:
    batches = [_ids(s, rank) for s in range(STEPS)]
    if rank == BAD_RANK:
        batches[BAD_STEP][BAD_POS] = _bad_value(bad)
    got, _ = _run(_model(rank, world, kind, dist_type, mode), batches)
    return [g if not isinstance(g, np.ndarray) else "ok" for g in got]


@pytest.mark.parametrize(
    "kind,dist_type,mode,bad",
    [
        ("tw", "continuous", "FATAL", "oor"),
        ("tw", "continuous", "NONE", "neg"),
        ("fused", "roundrobin", "FATAL", "neg"),
        ("fused", "roundrobin", "NONE", "oor"),
        ("fused", "hash_roundrobin", "FATAL", "oor"),
        ("fused", "hash_roundrobin", "NONE", "neg"),
        ("tiered_CACHING_native", "hash_roundrobin", "FATAL", "neg"),
        ("tiered_HYBRID_native", "hash_roundrobin", "NONE", "oor"),
        ("tiered_HYBRID_fbgemm", "hash_roundrobin", "FATAL", "oor"),
        ("tiered_HYBRID_fbgemm", "hash_roundrobin", "NONE", "neg"),
    ],
)
def test_fatal_bad_id_raises_on_the_owner_in_its_lookup(kind: str, dist_type: str, mode: str, bad: str) -> None:
    """FATAL / NONE: the rank owning the bad id raises in the lookup of that step, as
    torchrec's TABLE_WISE table does on its owner (rank 0 here); the feeding rank's router
    does not raise. FUSED tables raise fbgemm's error; tiered tables an IndexError naming
    the table and the bounds_check_mode fix."""
    results = run_gloo(2, _fatal_body, kind, dist_type, mode, bad, timeout_s=120)
    owner = 0 if kind == "tw" else _owner(_bad_value(bad), 2)
    got = results[owner]
    assert got[:BAD_STEP] == ["ok"] * BAD_STEP and len(got) == BAD_STEP + 1, got
    step, error, message = got[BAD_STEP]
    assert step == BAD_STEP
    if kind.startswith("tiered"):
        assert error == "IndexError" and "table 't0'" in message and "bounds_check_mode" in message, message
    else:
        assert error == "RuntimeError" and ("idx < num_rows" in message or "out of bounds" in message), message
    other = results[1 - owner]
    # the other rank fails in a collective once the owner is gone (it would wait, as with torchrec's)
    assert other[:BAD_STEP] == ["ok"] * BAD_STEP and other[BAD_STEP][1] != "IndexError", other


def test_tiered_shard_warning_mode_matches_fbgemm_tbe() -> None:
    """One shard (world size 1), WARNING / IGNORE: ids past the rows are looked up as row 0,
    per-sample weights kept, and row 0 trained, as by fbgemm's own CPU TBE."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig

    for mode in (BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE):
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(10, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=EmbOptimType.EXACT_SGD,
            learning_rate=0.1,
            bounds_check_mode=mode,
        )
        shard = TieredEmbeddingShard(
            num_embeddings=10,
            embedding_dim=8,
            mode="HYBRID",
            cache_load_factor=0.5,
            optimizer=TieredOptimizerConfig(optimizer="sgd", learning_rate=0.1),
            table_name="t0",
            bounds_check_mode=mode,
            dist_type="roundrobin",
        )  # local = global
        rows = torch.randn(10, 8)
        tbe.split_embedding_weights()[0].copy_(rows)
        shard.load_global_weights(rows)
        ids, offsets, psw = torch.tensor([1, 12, 3, 10]), torch.tensor([0, 2, 4]), torch.tensor([1.0, 2.0, 3.0, 4.0])
        grad = torch.randn(2, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = shard(ids.clone(), offsets, psw)
        ref = tbe(ids.clone(), offsets, psw)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
        out.backward(grad)
        ref.backward(grad)
        state = shard.export_state()
        torch.testing.assert_close(
            state.weights[torch.argsort(state.global_ids)], tbe.split_embedding_weights()[0], rtol=0, atol=1e-6
        )
        named = [str(w.message) for w in caught if "tiered table 't0'" in str(w.message)]
        assert len(named) == (1 if mode is BoundsCheckMode.WARNING else 0), named
        with pytest.raises(IndexError, match="ids out of range for table 't0'"):  # negative: raises, as fbgemm's
            shard(torch.tensor([1, -1]), torch.tensor([0, 2]))


def test_bad_bounds_check_mode_refused_naming_the_table() -> None:
    """A value fbgemm's TBE could not take (a string) is refused, naming the table and the fix."""
    from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, bounds_check_mode_of

    with pytest.raises(
        ValueError,
        match=r"tiered table 't0': fused param 'bounds_check_mode' must be an fbgemm "
        r"BoundsCheckMode.*BoundsCheckMode.WARNING",
    ):
        bounds_check_mode_of({"bounds_check_mode": "WARNING"}, "t0")
    with pytest.raises(ValueError, match=r"tiered table 'tx': bounds_check_mode must be an fbgemm BoundsCheckMode"):
        TieredEmbeddingShard(
            num_embeddings=10,
            embedding_dim=8,
            mode="HYBRID",
            cache_load_factor=0.5,
            table_name="tx",
            bounds_check_mode=7,
        )  # type: ignore[arg-type]
