"""torchrec optimizer idioms on tiered tables, against torchrec's own FUSED tables (fbgemm's TBE) or plain math.

* ``model.fused_optimizer.set_optimizer_step(step)`` (torchrec's ``KeyedOptimizer`` /
  ``CombinedOptimizer`` API, which sets fbgemm's ``iter``) reaches tiered tables with
  fbgemm's semantics, on the native and the fbgemm backends.
* A tensor learning rate (fbgemm's TBE fills its lr tensor with it, ``fill_``) is accepted.
* A table's own ``recpipe_backend`` fused param with a bad value is refused naming the table.

Reference models: torchrec's own TABLE_WISE FUSED EBC (row-wise Adagrad: fbgemm-gpu-cpu has
no CPU Adam, so Adam's bias correction is checked against plain torch math).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import torch
from harness.gloo import run_gloo
from harness.tiered_ebc_models import kjt_and_grad, warmup_batches, warmup_model

_model = warmup_model  # torchrec FUSED (placements None) or tiered on a backend, same initial tables


def _fused_tbes(model: Any) -> Dict[str, Any]:
    """table name -> the fbgemm TBE of torchrec's FUSED table on this rank."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
    from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag

    out = {}
    for lookup in model.module.ebc._lookups:  # torchrec keeps them in a plain list
        for m in lookup.modules():
            if isinstance(m, BaseBatchedEmbeddingBag) and isinstance(
                m.emb_module, SplitTableBatchedEmbeddingBagsCodegen
            ):
                for table in m.config.embedding_tables:
                    out[table.name] = m.emb_module
    return out


# --- set_optimizer_step ----------------------------------------------------------------------
STEP_RESTORE, STEP_MIDRUN = 10, 100
"""``model.fused_optimizer.set_optimizer_step``: on the fresh model (a restore), then after 2 steps."""


def _set_step_body(rank: int, world: int) -> Dict[str, Any]:
    """Per run: the recorded step of every table after the restore + 2 steps and after the
    mid-run set + 2 steps (torchrec: its TBE's ``iter``; tiered: the exported step)."""
    both = {
        "t0": dict(mode="CACHING", cache_load_factor=0.2, seed=3),
        "t1": dict(mode="HYBRID", cache_load_factor=0.5, seed=3),
    }
    out: Dict[str, Any] = {}
    for kind, placements, backend in (("ref", None, None), ("native", both, "native"), ("fbgemm", both, "fbgemm")):
        model = _model(world, placements, backend)
        batches = warmup_batches(rank)
        recorded: List[Dict[str, int]] = []
        for when, step in ((0, STEP_RESTORE), (2, STEP_MIDRUN)):
            model.fused_optimizer.set_optimizer_step(step)
            for batch in batches[when : when + 2]:
                loss, _ = model(batch)
                loss.backward()
            if kind == "ref":
                recorded.append({n: int(tbe.iter) for n, tbe in _fused_tbes(model).items()})
            else:
                recorded.append({n: st.step for n, st in model.module.ebc.tiered_state().items()})
        out[kind] = recorded
    return out


def test_set_optimizer_step_on_fused_optimizer_reaches_tiered_tables() -> None:
    """``model.fused_optimizer.set_optimizer_step(step)`` (torchrec's CombinedOptimizer API; it
    calls ``set_optimizer_step`` of fbgemm's TBE) sets the step of tiered tables as of torchrec's
    own TABLE_WISE FUSED tables: on a fresh model (restoring a checkpoint's step) and mid-run,
    the native and the fbgemm backend record the FUSED TBE's ``iter`` after the following
    steps. ``TieredFusedOptimizer`` had no ``set_optimizer_step``, which CombinedOptimizer
    silently skipped: tiered tables kept counting from 0."""
    results = run_gloo(2, _set_step_body)
    ref = {**results[0]["ref"][0], **results[1]["ref"][0]}, {**results[0]["ref"][1], **results[1]["ref"][1]}
    assert ref == ({"t0": STEP_RESTORE + 2, "t1": STEP_RESTORE + 2}, {"t0": STEP_MIDRUN + 2, "t1": STEP_MIDRUN + 2})
    for rank, res in enumerate(results):
        for kind in ("native", "fbgemm"):
            assert tuple(res[kind]) == ref, (rank, kind, res[kind], ref)


def _adam_rows(backend: str, sets: List[Optional[int]]) -> List[np.ndarray]:
    """An all-fast Adam shard (lr 0.1) updated once per entry of ``sets`` (each first
    ``set_optimizer_step(entry)`` unless None), with gradients ``g_k``; its rows after each."""
    from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig

    torch.manual_seed(0)
    shard = TieredEmbeddingShard(
        num_embeddings=6,
        embedding_dim=4,
        mode="HYBRID",
        cache_load_factor=1.0,
        optimizer=TieredOptimizerConfig(optimizer="adam", learning_rate=0.1),
        backend=backend,
    )
    rows = [shard.export_state().weights.numpy().copy()]
    for k, step in enumerate(sets):
        if step is not None:
            shard.set_optimizer_step(step)
        ids = torch.arange(6)
        out = shard(ids, torch.arange(7))
        out.backward(_adam_grad(k))
        rows.append(shard.export_state().weights.numpy().copy())
    return rows


def _adam_grad(k: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(k + 1))


def _fbgemm_iters(sets: List[Optional[int]]) -> List[int]:
    """The step fbgemm's TBE updates with at each entry of ``sets`` (its host counter
    ``iter_cpu`` after the lookup), same ``set_optimizer_step`` calls: the reference counter."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(6, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD
    )
    iters = []
    for step in sets:
        if step is not None:
            tbe.set_optimizer_step(step)
        tbe(torch.arange(6), torch.arange(7)).sum().backward()
        iters.append(int(tbe.iter_cpu))
    return iters


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_set_optimizer_step_sets_adam_bias_correction_as_fbgemm(backend: str) -> None:
    """After ``set_optimizer_step(s)`` a tiered Adam table updates with the bias correction of
    the step fbgemm's TBE would use (the reference: an fbgemm TBE given the same calls, its
    host counter ``iter_cpu``): ``s + 1`` on a fresh table, and a running table keeps counting
    (fbgemm's TBE re-reads its step only while its host counter is 0). Each update equals
    fbgemm ADAM's formula in plain torch math with that step."""
    sets = [7, None, 50, None]
    iters = _fbgemm_iters(sets)
    assert iters == [8, 9, 10, 11], iters
    rows = _adam_rows(backend, sets)
    w = torch.from_numpy(rows[0]).double()
    m1 = torch.zeros_like(w)
    m2 = torch.zeros_like(w)
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 0.1
    for k, t in enumerate(iters):
        g = _adam_grad(k).double()
        m1 = b1 * m1 + (1 - b1) * g
        m2 = b2 * m2 + (1 - b2) * g * g
        w = w - lr * (m1 / (1 - b1**t)) / ((m2 / (1 - b2**t)).sqrt() + eps)
        torch.testing.assert_close(
            torch.from_numpy(rows[k + 1]).double(), w, atol=1e-5, rtol=1e-5, msg=f"update {k} (step {t})"
        )


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_set_optimizer_step_after_load_restores_bias_correction(backend: str) -> None:
    """torchrec's restore idiom: load the checkpoint, then ``set_optimizer_step(s)``. A tiered Adam
    table trained 3 updates (step 3), loaded into a fresh table (``load_states``, which sets
    step 3) then given ``set_optimizer_step(20)``, updates with step 21, as a restored fbgemm TBE
    (``iter_cpu`` 0 re-reads ``iter``; the reference TBE shows it) and fbgemm ADAM's formula in plain
    math from the loaded moments."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig

    def shard() -> TieredEmbeddingShard:
        return TieredEmbeddingShard(
            num_embeddings=6,
            embedding_dim=4,
            mode="CACHING",
            cache_load_factor=0.5,
            optimizer=TieredOptimizerConfig(optimizer="adam", learning_rate=0.1),
            backend=backend,
        )

    trained = shard()
    for k in range(3):
        trained(torch.arange(6), torch.arange(7)).backward(_adam_grad(k))
    saved = trained.export_state()
    assert saved.step == 3
    ref = SplitTableBatchedEmbeddingBagsCodegen(
        [(6, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD
    )
    ref.set_optimizer_step(20)  # torchrec restores a FUSED table's step so (its rows load elsewhere)
    ref(torch.arange(6), torch.arange(7)).sum().backward()
    t = int(ref.iter_cpu)
    assert t == 21
    restored = shard()
    restored.load_states([saved])
    restored.set_optimizer_step(20)
    restored(torch.arange(6), torch.arange(7)).backward(_adam_grad(3))
    got = restored.export_state()
    w, st, g = saved.weights.double(), saved.optimizer_state.double(), _adam_grad(3).double()
    m1 = 0.9 * st[:, :4] + 0.1 * g
    m2 = 0.999 * st[:, 4:] + 0.001 * g * g
    want = w - 0.1 * (m1 / (1 - 0.9**t)) / ((m2 / (1 - 0.999**t)).sqrt() + 1e-8)
    torch.testing.assert_close(got.weights.double(), want, atol=1e-5, rtol=1e-5)
    assert got.step == 21


def test_fbgemm_backend_set_optimizer_step_after_load_as_fused_tbe() -> None:
    """The fbgemm backend's TBE after ``load_states`` then ``set_optimizer_step(20)`` counts its
    next update as step 21 (``iter_cpu``, the counter fbgemm's optimizers read) and records 21
    (``iter``), as a FUSED TBE given ``set_optimizer_step(20)`` after a restore."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig

    def shard() -> TieredEmbeddingShard:
        return TieredEmbeddingShard(
            num_embeddings=6,
            embedding_dim=4,
            mode="HYBRID",
            cache_load_factor=0.5,
            optimizer=TieredOptimizerConfig(optimizer="rowwise_adagrad"),
            backend="fbgemm",
        )

    trained = shard()
    for k in range(3):
        trained(torch.arange(6), torch.arange(7)).backward(_adam_grad(k))
    ref = SplitTableBatchedEmbeddingBagsCodegen(
        [(6, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD
    )
    restored = shard()
    restored.load_states([trained.export_state()])
    ref.set_optimizer_step(20)  # torchrec restores a FUSED table's step so
    restored.set_optimizer_step(20)
    ref(torch.arange(6), torch.arange(7)).sum().backward()
    restored(torch.arange(6), torch.arange(7)).backward(_adam_grad(3))
    tbe = restored.tiers.fbgemm.tbe  # type: ignore[union-attr]
    assert (int(tbe.iter_cpu), int(tbe.iter)) == (int(ref.iter_cpu), int(ref.iter)) == (21, 21)
    assert restored.export_state().step == 21


def test_set_optimizer_step_refuses_bad_step_naming_table() -> None:
    from recpipe.pipeline.tiered.shard import TieredEmbeddingShard

    shard = TieredEmbeddingShard(
        num_embeddings=6, embedding_dim=4, mode="HYBRID", cache_load_factor=0.5, table_name="clicks"
    )
    for bad in (-1, 2.5, True, "3"):
        with pytest.raises(ValueError, match=r"^tiered table 'clicks': optimizer step must be an int >= 0, got "):
            shard.set_optimizer_step(bad)  # type: ignore[arg-type]
    shard.set_optimizer_step(np.int64(4))  # type: ignore[arg-type]
    assert shard.export_state().step == 4


# --- tensor learning rate ----------------------------------------------------------------------
def _tensor_lr_body(rank: int, world: int) -> Dict[str, Any]:
    """Outputs of 4 steps whose fused param groups' ``lr`` is a 0-dim tensor (set, then
    ``step()``), torchrec's TABLE_WISE FUSED EBC vs t0 tiered (native and fbgemm)."""
    out: Dict[str, Any] = {}
    cached = {"t0": dict(mode="CACHING", cache_load_factor=0.2, seed=3)}
    for kind, placements, backend in (("ref", None, None), ("native", cached, "native"), ("fbgemm", cached, "fbgemm")):
        model = _model(world, placements, backend)
        outputs = []
        for step, lr in enumerate((0.05, 0.2, 0.01, 0.3)):
            for group in model.fused_optimizer.param_groups:
                group["lr"] = torch.tensor(lr)
            model.fused_optimizer.step()
            kjt, grad = kjt_and_grad(step, rank)
            result = model.module.ebc(kjt).values()
            outputs.append(result.detach().numpy().copy())
            result.backward(grad)
        out[kind] = outputs
    return out


def test_tensor_learning_rate_reaches_tiered_tables_as_fbgemm() -> None:
    """A 0-dim tensor ``lr`` in ``model.fused_optimizer``'s param groups (fbgemm's TBE takes it:
    ``set_learning_rate`` fills its lr tensor with it) trains tiered tables as torchrec's own
    TABLE_WISE FUSED tables, step by step."""
    for rank, res in enumerate(run_gloo(2, _tensor_lr_body)):
        for kind in ("native", "fbgemm"):
            for step, want in enumerate(res["ref"]):
                torch.testing.assert_close(
                    torch.from_numpy(res[kind][step]),
                    torch.from_numpy(want),
                    atol=2e-6,
                    rtol=1e-5,
                    msg=f"rank {rank} {kind} step {step}",
                )


def test_set_learning_rate_refuses_what_fbgemm_cannot_take_naming_table() -> None:
    """Accepted as fbgemm's TBE accepts: numbers and 0-dim real tensors; refused with the table
    named: a 1-element 1-d tensor (fbgemm's ``fill_`` refuses it too), complex and bool values,
    and values that are not finite or are negative."""
    from recpipe.pipeline.tiered.shard import TieredEmbeddingShard

    shard = TieredEmbeddingShard(
        num_embeddings=6, embedding_dim=4, mode="HYBRID", cache_load_factor=0.5, table_name="clicks"
    )
    for good, value in (
        (torch.tensor(0.25), 0.25),
        (torch.tensor(2), 2.0),
        (torch.tensor(0.5, dtype=torch.float64), 0.5),
        (np.float32(0.125), 0.125),
        (3, 3.0),
    ):
        shard.set_learning_rate(good)  # type: ignore[arg-type]
        assert shard.optimizer.learning_rate == value and isinstance(shard.optimizer.learning_rate, float)
    for bad in (torch.tensor([0.1]), torch.tensor(1 + 1j), torch.tensor(True), True, math.nan, -0.1, "0.1"):
        with pytest.raises(ValueError, match=r"^tiered table 'clicks': learning rate must be a finite real number "):
            shard.set_learning_rate(bad)  # type: ignore[arg-type]
    assert shard.optimizer.learning_rate == 3.0


# --- a table's own recpipe_backend fused param ----------------------------------------------
def _backend_param_body(rank: int, world: int, value: Any) -> Any:
    """Builds t0 tiered (CACHING) next to t1 recpipe ROW_WISE FUSED with the sharder's fused params
    ``{"recpipe_backend": value}``; the error's message, else t0's backend and 4 steps' outputs."""
    cached = {"t0": dict(mode="CACHING", cache_load_factor=0.2, seed=3)}
    try:
        model = _model(world, cached, None, {"recpipe_backend": value})
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return model.module.ebc.tiered_tables()["t0"].backend, _four_steps(model, rank)


def _four_steps(model: Any, rank: int) -> List[np.ndarray]:
    """The EBC's outputs of 4 training steps (each backward applies the fused optimizer)."""
    outputs = []
    for step in range(4):
        kjt, grad = kjt_and_grad(step, rank)
        result = model.module.ebc(kjt).values()
        outputs.append(result.detach().numpy().copy())
        result.backward(grad)
    return outputs


def test_bad_recpipe_backend_fused_param_refused_naming_table() -> None:
    """A table's ``recpipe_backend`` fused param (here from the sharder's ``fused_params``) that
    is not a backend is refused on every rank naming the table, the param and the fix."""
    for msg in run_gloo(2, _backend_param_body, "uvm"):
        assert msg == (
            "ValueError: tiered table 't0': fused param 'recpipe_backend'='uvm' is refused: backend must "
            "be one of ['native', 'fbgemm', 'torch'] or None (the device's default), got 'uvm'. Set the "
            "backend with the tiered sharders' backend= argument (e.g. TieredEmbeddingBagCollectionSharder("
            "backend='fbgemm')), or fix or remove 'recpipe_backend' in the fused params of the sharder / "
            "the table's ParameterSharding."
        ), msg


def _ref_outputs_body(rank: int, world: int) -> List[np.ndarray]:
    return _four_steps(_model(world, None), rank)


def test_recpipe_backend_in_sharder_fused_params_reaches_only_tiered_tables() -> None:
    """``TieredEmbeddingBagCollectionSharder(fused_params={"recpipe_backend": "fbgemm"})`` runs the
    tiered table t0 on fbgemm while the FUSED table t1 beside it trains as usual: every step's
    outputs equal torchrec's own TABLE_WISE FUSED EBC's: the key never reaches t1's fbgemm TBE
    (whose constructor takes no such argument)."""
    refs = run_gloo(2, _ref_outputs_body)
    for rank, (res, ref) in enumerate(zip(run_gloo(2, _backend_param_body, "fbgemm"), refs)):
        assert not isinstance(res, str), res
        backend, outputs = res
        assert backend == "fbgemm"
        for step, want in enumerate(ref):
            torch.testing.assert_close(
                torch.from_numpy(outputs[step]),
                torch.from_numpy(want),
                atol=2e-6,
                rtol=1e-5,
                msg=f"rank {rank} step {step}",
            )
