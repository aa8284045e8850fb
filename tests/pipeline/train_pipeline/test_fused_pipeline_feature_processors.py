"""TrainPipelineFusedSparseDist with feature processors (``allow_dense_tables=True``).

A ``FeatureProcessedEmbeddingBagCollection`` with a ``PositionWeightedModuleCollection``
applies position weights - dense parameters stepped by the dense optimizer -
inside its embedding lookup. With ``allow_dense_tables=True`` the fused pipeline
issues that module's lookup after the optimizer step (the other pipelined modules
keep their early lookup), so it must stay bit-identical to torchrec's
``TrainPipelineSparseDist``: losses and predictions step by step, and the final
parameters (tables and position weights). Two models, both sharded TABLE_WISE on
2 gloo ranks with torchrec's ``FeatureProcessedEmbeddingBagCollectionSharder``:

* recpipe's test model (``pipeline_harness.TwoModuleModel``): a
  feature-processed EBC and an EC;
* torchrec's public test model ``TestSparseNN`` with ``max_feature_lengths`` (a
  plain EBC and a feature-processed EBC) on ``ModelInput.generate`` batches
  (torchrec's own ``test_feature_processed_ebc`` builds its model with
  ``create_module_and_freeze`` from its tests package, which the wheel does not
  ship; it is CUDA-only and compares predictions only).

A control forces the feature-processed lookup before the optimizer: it is not
exact (autograd's version check fails), so the ordering is what the test checks.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import pytest
import torch
from harness.gloo import run_gloo
from harness.pipelines import FLAG_COMBOS, N_BATCHES, build_dmp, make_batches, run_pipeline, shard_with_dense_adam

TSNN_BATCHES = 8  # batches of the TestSparseNN runs
TSNN_BATCH_SIZE = 8  # samples per rank per batch
TSNN_FP_TABLES = {"feature_1": 6, "feature_3": 4}  # feature-processed table -> max length
TSNN_SEED = 7

Trace = Tuple[List[np.ndarray], List[np.ndarray]]
State = Dict[str, List[np.ndarray]]


def _numpy(tensors: Sequence[torch.Tensor]) -> List[np.ndarray]:
    return [t.detach().cpu().clone().numpy() for t in tensors]


def final_state(model: torch.nn.Module) -> State:
    """Every state-dict entry as this rank's local tensors (sharded tables: local shards)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    out: State = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            tensors = [shard.tensor for shard in value.local_shards()]
        elif isinstance(value, DTensor):
            tensors = [value.to_local()]
        else:
            tensors = [value]
        out[key] = _numpy(tensors)
    return out


def _run(pipeline: Any, batches: Sequence[Any]) -> Trace:
    losses, preds, again = run_pipeline(pipeline, batches)
    if not again:
        raise AssertionError("progress() after the end did not raise StopIteration again")
    return _numpy(losses), _numpy(preds)


def _record_recpipe(out: Dict[str, Any], key: str, pipe: Any, model: torch.nn.Module, batches: Sequence[Any]) -> None:
    """Runs ``pipe`` over ``batches`` and records under ``key`` its trace, the final
    state, the modules it looked up after the optimizer and those it pipelined."""
    out[key] = _run(pipe, batches)
    out[key + " state"] = final_state(model)
    out[key + " late"] = list(pipe.after_optimizer_modules)
    out[key + " relookups"] = pipe.stats.relookups
    out[key + " pipelined"] = sorted(m.forward.name for m in pipe._pipelined_modules)


def _stale_pipeline_type() -> type:
    """The fused pipeline with the after-optimizer ordering switched off (control only)."""
    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    class StaleFeatureProcessorPipeline(TrainPipelineFusedSparseDist):
        def _pipeline_model(self, *args: Any, **kwargs: Any) -> None:
            super()._pipeline_model(*args, **kwargs)
            self._after_opt_modules = set()

    return StaleFeatureProcessorPipeline


# ----------------------------------------------------------------- recpipe model


def _two_module_body(rank: int, world_size: int) -> Dict[str, Any]:
    from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist
    from recpipe.pipeline.train_pipeline.validation import FusedLookupExactnessChecker, FusedLookupExactnessError

    device = torch.device("cpu")
    batches = make_batches(rank, seed=3)
    out: Dict[str, Any] = {}

    model, opt = build_dmp("table_wise", device, position_weighted=True)
    out["initial"] = final_state(model)
    pipe = TrainPipelineSparseDist(model, opt, device)
    out["torchrec"] = _run(pipe, batches)
    out["torchrec state"] = final_state(model)
    out["torchrec fp module"] = [
        m.forward.name for m in pipe._pipelined_modules if isinstance(m, ShardedFeatureProcessedEmbeddingBagCollection)
    ]

    for stream, after_opt in FLAG_COMBOS:
        model, opt = build_dmp("table_wise", device, position_weighted=True)
        pipe = TrainPipelineFusedSparseDist(
            model,
            opt,
            device,
            use_emb_lookup_stream=stream,
            embedding_lookup_after_opt=after_opt,
            allow_dense_tables=True,
        )
        key = f"recpipe stream={stream} after_opt={after_opt}"
        _record_recpipe(out, key, pipe, model, batches)
        out[key + " steps"] = pipe.stats.steps

    model, opt = build_dmp("table_wise", device, position_weighted=True)
    stale = _stale_pipeline_type()(model, opt, device, embedding_lookup_after_opt=False, allow_dense_tables=True)
    out["stale"] = _run(stale, batches)
    out["stale late"] = list(stale.after_optimizer_modules)
    out["stale relookups"] = stale.stats.relookups
    out["stale steps"] = stale.stats.steps

    # Without the flag: refused at attach, naming module, tables and parameters.
    model, opt = build_dmp("table_wise", device, position_weighted=True)
    try:
        TrainPipelineFusedSparseDist(model, opt, device).progress(iter(batches))
        out["refused"] = None
    except FusedLookupExactnessError as e:
        out["refused"] = str(e)

    # A feature-processed EBC that also holds a dense-kernel table: the table is
    # found through the inner EBC's plan, the module is ordered late once.
    overrides = {"t1": ("table_wise", "dense")}
    model, opt = build_dmp("table_wise", device, position_weighted=True, overrides=overrides)
    out["mixed torchrec"] = _run(TrainPipelineSparseDist(model, opt, device), batches)
    out["mixed torchrec state"] = final_state(model)
    model, opt = build_dmp("table_wise", device, position_weighted=True, overrides=overrides)
    pipe = TrainPipelineFusedSparseDist(model, opt, device, embedding_lookup_after_opt=False, allow_dense_tables=True)
    out["mixed recpipe"] = _run(pipe, batches)
    out["mixed recpipe state"] = final_state(model)
    out["mixed late"] = list(pipe.after_optimizer_modules)
    modules = {m.forward.name: m for m in pipe._pipelined_modules}
    checker = FusedLookupExactnessChecker(allow_dense_tables=True)
    out["mixed dense tables"] = [(d.module, d.table, d.reason) for d in checker.dense_updated_tables(modules)]
    out["mixed fp modules"] = [(f.module, f.tables, f.parameters) for f in checker.feature_processed_modules(modules)]
    out["cuda_initialized"] = torch.cuda.is_initialized()
    return out


@pytest.fixture(scope="module")
def two_module_results() -> List[Dict[str, Any]]:
    return run_gloo(2, _two_module_body, timeout_s=300)


def _assert_trace_equal(label: str, got: Trace, want: Trace, n_steps: int) -> None:
    for part, g, w in (("loss", got[0], want[0]), ("predictions", got[1], want[1])):
        assert len(g) == len(w) == n_steps, f"{label}: {len(g)} {part} steps, torchrec {len(w)}"
        for step, (a, b) in enumerate(zip(g, w)):
            assert np.array_equal(a, b), f"{label}: {part} differ at step {step}, max |diff| {np.abs(a - b).max()}"


def _assert_state_equal(label: str, got: State, want: State) -> None:
    assert sorted(got) == sorted(want), f"{label}: state keys differ"
    for key in want:
        assert len(got[key]) == len(want[key]), f"{label}: {key}: shard count differs"
        for a, b in zip(got[key], want[key]):
            assert np.array_equal(a, b), f"{label}: final {key} differs, max |diff| {np.abs(a - b).max()}"


def _position_weight_keys(state: State) -> List[str]:
    return sorted(k for k in state if "position_weights" in k)


def test_feature_processed_ebc_is_exact_for_every_flag_combination(two_module_results: List[Dict[str, Any]]) -> None:
    for rank, res in enumerate(two_module_results):
        assert not res["cuda_initialized"], f"rank {rank}: a CPU run initialised CUDA"
        ref, ref_state = res["torchrec"], res["torchrec state"]
        assert res["torchrec fp module"] == ["ebc"], res["torchrec fp module"]
        # The comparison has teeth: losses vary and the position weights trained.
        assert len({float(x) for x in ref[0]}) > 1
        pw = _position_weight_keys(ref_state)
        assert pw == [
            "ebc._feature_processors.position_weights.f_t0",
            "ebc._feature_processors.position_weights.f_t1",
        ], pw
        for key in pw:
            assert not np.array_equal(ref_state[key][0], res["initial"][key][0]), f"{key} did not train"
        for stream, after_opt in FLAG_COMBOS:
            key = f"recpipe stream={stream} after_opt={after_opt}"
            label = f"rank {rank} {key}"
            assert res[key + " pipelined"] == ["ebc", "ec"], res[key + " pipelined"]
            assert res[key + " late"] == ["ebc"], f"{label}: after-optimizer modules {res[key + ' late']}"
            assert res[key + " steps"] == N_BATCHES
            assert res[key + " relookups"] == 0, "the after-optimizer ordering left a lookup to redo"
            _assert_trace_equal(label, res[key], ref, N_BATCHES)
            _assert_state_equal(label, res[key + " state"], ref_state)


def test_without_the_flag_feature_processor_is_refused_naming_tables_and_parameters(
    two_module_results: List[Dict[str, Any]],
) -> None:
    for res in two_module_results:
        msg = res["refused"]
        assert msg is not None, "a feature-processed module was accepted without allow_dense_tables"
        assert (
            "module 'ebc' tables ['t0', 't1'] feature-processor parameters "
            "['position_weights.f_t0', 'position_weights.f_t1']" in msg
        ), msg
        assert "3) Pass allow_dense_tables=True: the lookup of ['ebc']" in msg


def test_feature_processed_ebc_with_a_dense_table_is_exact(two_module_results: List[Dict[str, Any]]) -> None:
    for rank, res in enumerate(two_module_results):
        assert res["mixed dense tables"] == [("ebc", "t1", "compute_kernel='dense'")]
        assert res["mixed fp modules"] == [("ebc", ("t0", "t1"), ("position_weights.f_t0", "position_weights.f_t1"))]
        assert res["mixed late"] == ["ebc"]
        label = f"rank {rank} FP-EBC with a dense table"
        _assert_trace_equal(label, res["mixed recpipe"], res["mixed torchrec"], N_BATCHES)
        _assert_state_equal(label, res["mixed recpipe state"], res["mixed torchrec state"])


def test_feature_processed_lookup_before_optimizer_is_redone(two_module_results: List[Dict[str, Any]]) -> None:
    """Control: the same pipeline with the FP module's lookup issued before the
    optimizer. The optimizer step then writes the position weights that lookup
    read; the pipeline sees the write (tensor versions) and redoes the batch's
    lookup at every step: exact, but every lookup is done twice and nothing
    overlaps. Ordering the FP module after the optimizer is what keeps it exact
    and the other modules overlapped."""
    for rank, res in enumerate(two_module_results):
        assert res["stale late"] == []
        assert res["stale steps"] == N_BATCHES
        # every batch but the first (looked up in its own step) is looked up again
        assert res["stale relookups"] == N_BATCHES - 1, res["stale relookups"]
        for step, (a, b) in enumerate(zip(res["stale"][0], res["torchrec"][0])):
            assert np.array_equal(a, b), f"rank {rank}: step {step} differs from torchrec"


# ---------------------------------------------------------- torchrec TestSparseNN


def _tsnn_tables() -> List[Any]:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    # Table names equal feature names: TestEBCSparseArch selects the
    # feature-processed tables by the keys of max_feature_lengths, which the
    # PositionWeightedModuleCollection reads as feature names.
    return [
        EmbeddingBagConfig(
            num_embeddings=(i + 1) * 50,
            embedding_dim=4 * (1 + i % 2),
            name=f"feature_{i}",
            feature_names=[f"feature_{i}"],
        )
        for i in range(4)
    ]


def _tsnn_batches(rank: int, world_size: int) -> List[Any]:
    from torchrec.distributed.test_utils.test_model import ModelInput

    tables = _tsnn_tables()
    lengths = [TSNN_FP_TABLES.get(t.name, 8) for t in tables]
    return [
        ModelInput.generate(
            batch_size=TSNN_BATCH_SIZE,
            world_size=world_size,
            num_float_features=10,
            tables=tables,
            weighted_tables=[],
            pooling_avg=3,
            max_feature_lengths=lengths,
            random_seed=TSNN_SEED + i,
        )[1][rank]
        for i in range(TSNN_BATCHES)
    ]


def _tsnn_dmp(world_size: int) -> Tuple[Any, Any]:
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.test_utils.test_model import TestSparseNN

    torch.manual_seed(TSNN_SEED)
    cpu = torch.device("cpu")
    model = TestSparseNN(
        tables=_tsnn_tables(),
        weighted_tables=[],
        dense_device=cpu,
        sparse_device=cpu,
        max_feature_lengths=dict(TSNN_FP_TABLES),
    )
    sparse = model.sparse
    ebc_sharder = EmbeddingBagCollectionSharder()
    fp_sharder = FeatureProcessedEmbeddingBagCollectionSharder()
    fp_bags = sparse.fp_ebc._embedding_bag_collection.embedding_bags
    apply_optimizer_in_backward(
        torch.optim.Adagrad,
        [b.weight for b in sparse.ebc.embedding_bags.values()] + [b.weight for b in fp_bags.values()],
        {"lr": 0.05},
    )
    plan = {}
    for fqn, module, bags, sharder in (
        ("sparse.ebc", sparse.ebc, sparse.ebc.embedding_bags, ebc_sharder),
        ("sparse.fp_ebc", sparse.fp_ebc, fp_bags, fp_sharder),
    ):
        plan[fqn] = construct_module_sharding_plan(
            module,
            {t: table_wise(rank=i % world_size, compute_kernel="fused") for i, t in enumerate(bags)},
            sharder=sharder,
            local_size=world_size,
            world_size=world_size,
            device_type="cpu",
        )
    return shard_with_dense_adam(model, plan, [ebc_sharder, fp_sharder], cpu)


class LossAndPrediction:
    """``custom_model_fwd`` for TestSparseNN (whose forward returns ``(loss, pred)``
    and whose pipelines would return only ``pred``): the pipelines return
    ``(loss, pred)`` so losses are compared too. Given to both pipelines."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    def __call__(self, batch: Any) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        loss, pred = self._model(batch)
        return loss, (loss.detach(), pred.detach())


def _tsnn_body(rank: int, world_size: int) -> Dict[str, Any]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    device = torch.device("cpu")
    batches = _tsnn_batches(rank, world_size)
    out: Dict[str, Any] = {}
    model, opt = _tsnn_dmp(world_size)
    out["initial"] = final_state(model)
    out["torchrec"] = _run(
        TrainPipelineSparseDist(model, opt, device, custom_model_fwd=LossAndPrediction(model)), batches
    )
    out["torchrec state"] = final_state(model)
    for stream, after_opt in FLAG_COMBOS:
        model, opt = _tsnn_dmp(world_size)
        pipe = TrainPipelineFusedSparseDist(
            model,
            opt,
            device,
            custom_model_fwd=LossAndPrediction(model),
            use_emb_lookup_stream=stream,
            embedding_lookup_after_opt=after_opt,
            allow_dense_tables=True,
        )
        _record_recpipe(out, f"recpipe stream={stream} after_opt={after_opt}", pipe, model, batches)
    return out


def test_torchrec_test_sparse_nn_with_feature_processor_is_exact() -> None:
    """torchrec's TestSparseNN (plain EBC + feature-processed EBC): only the FP
    module is ordered after the optimizer; every flag combination matches
    TrainPipelineSparseDist bit for bit, final parameters included."""
    for rank, res in enumerate(run_gloo(2, _tsnn_body, timeout_s=300)):
        ref, ref_state = res["torchrec"], res["torchrec state"]
        assert len({float(x) for x in ref[0]}) > 1
        pw = _position_weight_keys(ref_state)
        assert len(pw) == len(TSNN_FP_TABLES), pw
        for key in pw:
            assert not np.array_equal(ref_state[key][0], res["initial"][key][0]), f"{key} did not train"
        for stream, after_opt in FLAG_COMBOS:
            key = f"recpipe stream={stream} after_opt={after_opt}"
            label = f"rank {rank} TestSparseNN {key}"
            assert res[key + " pipelined"] == ["sparse.ebc", "sparse.fp_ebc"], res[key + " pipelined"]
            assert res[key + " late"] == ["sparse.fp_ebc"], f"{label}: {res[key + ' late']}"
            _assert_trace_equal(label, res[key], ref, TSNN_BATCHES)
            _assert_state_equal(label, res[key + " state"], ref_state)
