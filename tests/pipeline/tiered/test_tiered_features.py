"""torchrec features through tiered tables, each against torchrec's own FUSED tables.

Every test runs the same model twice on 2 gloo CPU ranks, from the same initial
weights and on the same batches: with recpipe's tiered tables (ROW_WISE,
CUSTOMIZED_KERNEL) and with torchrec's own sharders (TABLE_WISE, FUSED kernel,
fbgemm's TBE), and compares what a user sees step by step.

* ``output_dtype`` in the sharder's fused params (e.g. FP16 outputs): fbgemm's TBE outputs
  FUSED tables' lookups in it; tiered tables output it too (pooled EBC and sequence EC).
* an empty batch (0 bags per feature) between ordinary steps.
* fused params the tiered kernel does not implement are refused naming the table: row-wise
  Adagrad's ``weight_decay_mode`` / ``max_norm`` (fbgemm's CUDA update applies them), and torch
  optimizer kwargs fbgemm's TBE does not take (torchrec's FUSED tables fail on them); a
  ``weight_decay`` fbgemm ignores is accepted and trains as torchrec's.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import harness.tiered_ebc_models as pooled
import harness.tiered_ec_models as seq
import numpy as np
import pytest
import torch
from harness.gloo import run_gloo

STEPS = 3


def _batch(step: int, rank: int, batch_size: int) -> Any:
    """A KJT of ``test_tiered_sharders``' features with ``batch_size`` bags per feature
    (0: an empty batch) and the upstream gradient of its pooled output."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(100 * step + rank)
    rows = {f: r for _, r, _, fs in pooled.TABLES for f in fs}
    lengths = torch.randint(0, 5, (len(pooled.FEATURES) * batch_size,), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, rows[f], (int(lengths[i * batch_size : (i + 1) * batch_size].sum()),), generator=gen)
            for i, f in enumerate(pooled.FEATURES)
        ]
    )
    return KeyedJaggedTensor(keys=pooled.FEATURES, values=values, lengths=lengths), torch.randn(
        batch_size, 20, generator=gen
    )


def _ebc_body(rank: int, world: int, fused_params: Dict[str, Any], batch_sizes: List[int]) -> Dict[str, List[Any]]:
    """EBC of ``test_tiered_sharders`` (t0 tiered HYBRID, t1 FUSED row-wise) vs torchrec's
    TABLE_WISE FUSED EBC, both sharders given ``fused_params``, row-wise Adagrad; one step
    (forward, backward) per batch size. Returns per step (t0's output dtype, the output's
    dtype, the output as float32)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    global_weights = {
        f"embedding_bags.{n}.weight": pooled.make_ebc().embedding_bags[n].weight.detach().clone()
        for n, *_ in pooled.TABLES
    }
    results: Dict[str, List[Any]] = {}
    for kind in ("tiered", "ref"):
        ebc = pooled.make_ebc()
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": pooled.LR})
        if kind == "tiered":
            sharder: Any = TieredEmbeddingBagCollectionSharder(fused_params=dict(fused_params))
            plan = pooled.tiered_plan(ebc, sharder, world, {"t0": dict(mode="HYBRID", cache_load_factor=0.3, seed=3)})
        else:
            sharder = EmbeddingBagCollectionSharder(fused_params=dict(fused_params))
            plan = pooled.table_wise_plan(ebc, sharder, world)
        model = DistributedModelParallel(
            ebc, plan=ShardingPlan({"": plan}), sharders=[sharder], device=torch.device("cpu")
        )
        pooled.copy_global_weights(model.module.state_dict(), global_weights)
        if kind == "tiered":
            assert set(model.module.tiered_tables()) == {"t0"}
            model.module.load_state_dict(
                {"embedding_bags.t0.weight": global_weights["embedding_bags.t0.weight"]}, strict=False
            )
        outs = []
        for step, batch_size in enumerate(batch_sizes):
            kjt, grad = _batch(step, rank, batch_size)
            kt = model(kjt)
            t0 = kt["f0"]  # a tiered table's own output (t1's is FUSED in both models)
            outs.append((str(t0.dtype), str(kt.values().dtype), kt.values().detach().float().numpy().copy()))
            kt.values().backward(grad.to(kt.values().dtype))
        results[kind] = outs
    return results


def test_output_dtype_fused_param_reaches_tiered_ebc_tables() -> None:
    """A tiered EBC table outputs the fused param ``output_dtype`` (it output float32, so
    the KeyedTensor beside FUSED tables was promoted to float32), and its outputs, which
    depend on every earlier update (the gradient comes back in that dtype), equal
    torchrec's FUSED tables within its rounding (each rank rounds its partial sums of a
    row-wise bag; TABLE_WISE rounds the whole bag once). FP16 only: fbgemm's CPU TBE has
    no BF16 output to compare with (tiered tables accept BF16, as fbgemm's CUDA TBE)."""
    want_dtype, tol = "torch.float16", 2e-3
    from fbgemm_gpu.split_embedding_configs import SparseType

    for rank, res in enumerate(run_gloo(2, _ebc_body, {"output_dtype": SparseType.FP16}, [4] * STEPS)):
        for step in range(STEPS):
            (t0_dtype, dtype, got), (ref_t0_dtype, ref_dtype, want) = res["tiered"][step], res["ref"][step]
            assert ref_t0_dtype == ref_dtype == want_dtype  # torchrec's FUSED tables
            assert (t0_dtype, dtype) == (want_dtype, want_dtype), f"rank {rank} step {step}"
            np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=f"rank {rank} step {step}")


def test_empty_batch_on_tiered_ebc_tables_as_torchrec() -> None:
    """A step with an empty batch (0 bags per feature, e.g. the end of a dataset split
    unevenly) gives a [0, dims] output and updates nothing, as torchrec's FUSED tables
    do; the tiered kernel failed to reshape its 0 pooled rows. The steps around it (whose
    outputs depend on every earlier update) equal torchrec's."""
    for rank, res in enumerate(run_gloo(2, _ebc_body, {}, [4, 0, 4, 1])):
        assert [out.shape for _, _, out in res["ref"]] == [(4, 20), (0, 20), (4, 20), (1, 20)]
        for step, ((_, _, got), (_, _, want)) in enumerate(zip(res["tiered"], res["ref"])):
            np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5, err_msg=f"rank {rank} step {step}")


def _output_dtype_ec_body(rank: int, world: int) -> Dict[str, List[Any]]:
    """EC of ``test_tiered_sequence`` (both tables tiered, planned by recpipe's planner) vs
    torchrec's TABLE_WISE FUSED EC, both sharders given ``output_dtype`` FP16, SGD."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingCollectionSharder

    fused_params = {"output_dtype": SparseType.FP16}
    results: Dict[str, List[Any]] = {}
    for kind in ("tiered", "ref"):
        ec = seq.make_ec()
        apply_optimizer_in_backward(torch.optim.SGD, ec.parameters(), {"lr": seq.LR})
        if kind == "tiered":
            sharder: Any = TieredEmbeddingCollectionSharder(fused_params=fused_params)
            plan = seq.planner_plan(ec, world)
        else:
            sharder = EmbeddingCollectionSharder(fused_params=fused_params)
            per = {t: table_wise(rank=i % world) for i, (t, _, _) in enumerate(seq.TABLES)}
            plan = ShardingPlan(
                {
                    "": construct_module_sharding_plan(
                        ec, per, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
                    )
                }
            )
        model = DistributedModelParallel(ec, plan=plan, sharders=[sharder], device=torch.device("cpu"))
        outs = []
        for step in range(STEPS):
            kjt, grads = seq.kjt_and_grads(step, rank)
            emb = model(kjt)
            loss = torch.zeros(())
            for f in seq.FEATURES:
                values = emb[f].values()
                outs.append((str(values.dtype), values.detach().float().numpy().copy()))
                loss = loss + (values.float() * grads[f]).sum()
            loss.backward()
        results[kind] = outs
    return results


def test_output_dtype_fused_param_reaches_tiered_ec_tables() -> None:
    """Tiered sequence tables output rows in ``output_dtype`` FP16 as torchrec's FUSED EC
    does: each row rounded once, so equal to torchrec's bit for bit, step after step."""
    for rank, res in enumerate(run_gloo(2, _output_dtype_ec_body)):
        assert len(res["tiered"]) == len(res["ref"]) == STEPS * len(seq.FEATURES)
        for i, ((dtype, got), (ref_dtype, want)) in enumerate(zip(res["tiered"], res["ref"])):
            assert ref_dtype == "torch.float16"
            assert dtype == "torch.float16", f"rank {rank} lookup {i}: {dtype}"
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} lookup {i}")


def test_unsupported_output_dtype_refused_naming_the_table() -> None:
    """An ``output_dtype`` fbgemm's CPU TBE cannot output (e.g. INT8) is refused naming the table."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from torchrec.modules.embedding_configs import DataType

    from recpipe.pipeline.tiered.fused_params import tiered_output_dtype

    assert tiered_output_dtype(None, "t") == torch.float32
    assert tiered_output_dtype({"output_dtype": DataType.FP16}, "t") == torch.float16  # torchrec's DataType too
    with pytest.raises(ValueError, match=r"tiered table 't0': fused param 'output_dtype'=.*INT8.* not supported"):
        tiered_output_dtype({"output_dtype": SparseType.INT8}, "t0")


def _refused_body(
    rank: int,
    world: int,
    fused_params: Dict[str, Any],
    optimizer: str = "RowWiseAdagrad",
    optimizer_kwargs: Optional[Dict[str, Any]] = None,
) -> str:
    """The error sharding t0 tiered with ``fused_params`` and in-backward ``optimizer``
    (``torch.optim.<name>`` or torchrec's ``RowWiseAdagrad``) raises on this rank."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    ebc = pooled.make_ebc()
    optimizer_class = RowWiseAdagrad if optimizer == "RowWiseAdagrad" else getattr(torch.optim, optimizer)
    apply_optimizer_in_backward(optimizer_class, ebc.parameters(), {"lr": pooled.LR, **(optimizer_kwargs or {})})
    sharder = TieredEmbeddingBagCollectionSharder(fused_params=dict(fused_params))
    plan = pooled.tiered_plan(ebc, sharder, world, {"t0": dict(mode="CACHING", cache_load_factor=0.2, seed=3)})
    try:
        DistributedModelParallel(ebc, plan=ShardingPlan({"": plan}), sharders=[sharder], device=torch.device("cpu"))
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize(
    "params, named",
    [
        (
            {"weight_decay": 0.1, "weight_decay_mode": "L2"},
            "{'weight_decay_mode': <WeightDecayMode.L2: 1>, 'weight_decay': 0.1}",
        ),
        (
            {"weight_decay": 0.1, "weight_decay_mode": "DECOUPLE"},
            "{'weight_decay_mode': <WeightDecayMode.DECOUPLE: 2>, 'weight_decay': 0.1}",
        ),
        ({"max_norm": 0.5}, "{'max_norm': 0.5}"),
    ],
    ids=["l2", "decouple", "max_norm"],
)
def test_rowwise_adagrad_weight_decay_mode_and_max_norm_refused_for_tiered_tables(
    params: Dict[str, Any], named: str
) -> None:
    """fbgemm's row-wise Adagrad decays rows by ``weight_decay_mode`` (L2 / DECOUPLE) and
    renormalizes them to ``max_norm`` (fbgemm's CUDA update, the one torchrec's FUSED tables
    train with on GPUs; its ``optimizers.py`` template); the tiered kernel does neither, and
    took them silently. A tiered table given them is refused on every rank when sharded,
    naming the table, the params and the fixes."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    fused_params = {k: WeightDecayMode[v] if k == "weight_decay_mode" else v for k, v in params.items()}
    for rank, msg in enumerate(run_gloo(2, _refused_body, fused_params)):
        assert msg.startswith(f"tiered table 't0': fused params {named} change fbgemm's rowwise_adagrad update"), (
            f"rank {rank}: {msg}"
        )
        assert "Possible solutions:\n  1. remove them" in msg and "\n  2. plan this table as a torchrec FUSED" in msg


def test_weight_decay_fbgemm_ignores_is_accepted_and_equals_torchrec() -> None:
    """A ``weight_decay`` without ``weight_decay_mode`` (fbgemm's NONE: row-wise Adagrad ignores
    it) is accepted, and the tiered table trains as torchrec's FUSED tables given it."""
    for rank, res in enumerate(run_gloo(2, _ebc_body, {"weight_decay": 0.1}, [4] * STEPS)):
        for step, ((_, _, got), (_, _, want)) in enumerate(zip(res["tiered"], res["ref"])):
            np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5, err_msg=f"rank {rank} step {step}")


@pytest.mark.parametrize(
    "optimizer, kwargs",
    [
        ("Adam", {"betas": (0.5, 0.75)}),
        ("RowWiseAdagrad", {"initial_accumulator_value": 0.1}),
        ("SGD", {"momentum": 0.9, "nesterov": True}),
    ],
    ids=["adam_betas", "rowwise_adagrad_initial_accumulator", "sgd_nesterov"],
)
def test_torch_optimizer_kwargs_fbgemm_does_not_take_refused_for_tiered_tables(
    optimizer: str, kwargs: Dict[str, Any]
) -> None:
    """``apply_optimizer_in_backward`` hands a torch optimizer's kwargs to the fused params;
    those fbgemm's TBE does not take (Adam's ``betas``, Adagrad's ``initial_accumulator_value``,
    SGD's ``nesterov``) make torchrec's FUSED tables fail (fbgemm's TypeError), while tiered
    tables trained silently without them (e.g. Adam with its default betas). Both are refused
    (the tiered one naming the table, the kwargs and fbgemm's names)."""
    only = {k: v for k, v in kwargs.items() if k != "momentum"}  # fbgemm takes momentum (LARS)
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(only))}'"):
        _fbgemm_tbe(optimizer, kwargs)
    for rank, msg in enumerate(run_gloo(2, _refused_body, {}, optimizer, kwargs)):
        assert msg.startswith(
            f"tiered table 't0': fused params {only} are torch optimizer arguments that fbgemm's TBE does not take"
        ), f"rank {rank}: {msg}"
        assert "Possible solutions:\n  1. remove them" in msg and "beta1 / beta2 for Adam's betas" in msg


def _fbgemm_tbe(optimizer: str, kwargs: Dict[str, Any]) -> Any:
    """fbgemm's CPU TBE (torchrec's FUSED kernel) built with ``kwargs``, as torchrec builds
    it from the fused params ``apply_optimizer_in_backward`` gives."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    opt = {
        "Adam": EmbOptimType.ADAM,
        "RowWiseAdagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "SGD": EmbOptimType.EXACT_SGD,
    }[optimizer]
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=opt, learning_rate=0.1, **kwargs
    )
