"""TrainPipelineFusedSparseDist against torchrec's TrainPipelineSparseDist on torchrec breadth.

Four pipelined modules (two EBCs sharing a feature, a weighted EBC, an EC), a
feature no table reads, tables of different dims and poolings (SUM / MEAN), FP16
table weights, fused optimizers set through the sharders' fused params
(row-wise Adagrad with weight decay, SGD, Adagrad), TABLE_WISE + COLUMN_WISE +
ROW_WISE + TABLE_ROW_WISE in one model (explicit plans from torchrec's
``construct_module_sharding_plan``), torchrec's ``CombinedOptimizer`` of the
fused and dense optimizers, a custom ``Pipelineable`` batch with an
extra tensor, a variable batch size per step and per rank with a short last
batch, nested outputs, ``custom_model_fwd``, ``pipeline_postproc`` with a
postproc module, ``enqueue_batch_after_forward``, ``apply_jit``,
``free_features_storage_early`` and
``execute_all_batches=False`` over several dataloaders (epochs), with and
without ``reset()``. The reference is torchrec's own pipeline on an identically
initialised copy: losses, every output, the final parameters, the fused
optimizer state and the fbgemm TBEs' ``step`` / ``iter`` counters (read from
fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen``) must be equal (torch.equal),
for every ``use_emb_lookup_stream`` x ``embedding_lookup_after_opt``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
from harness.breadth_model import BreadthBatch, build_breadth, final_state, flatten_outputs, make_breadth_batches
from harness.gloo import run_gloo
from harness.pipelines import FLAG_COMBOS
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


def run_epochs(
    pipeline: Any, epochs: Sequence[Sequence[BreadthBatch]], extra_calls: int = 1, reset: bool = False
) -> List[List[Any]]:
    """Drives ``pipeline.progress`` over one dataloader per epoch; after each
    StopIteration calls it ``extra_calls`` more times (each must raise
    StopIteration again), then ``reset()`` when asked.

    Returns:
        List[List[Any]]: per step, its flattened outputs (numpy); then one entry
        per epoch: how many extra calls raised StopIteration.
    """
    trace: List[List[Any]] = []
    for batches in epochs:
        it: Iterator[BreadthBatch] = iter(batches)
        while True:
            try:
                out = pipeline.progress(it)
            except StopIteration:
                break
            trace.append([t.numpy() for t in flatten_outputs(out)])
        stops = 0
        for _ in range(extra_calls):
            try:
                pipeline.progress(it)
            except StopIteration:
                stops += 1
        trace.append([stops])
        if reset:
            pipeline.reset()
    return trace


SCENARIOS: Dict[str, Dict[str, Any]] = {
    "mixed_shardings_rowwise_adagrad_wd": {
        "shardings": {
            "ta": "column_wise",
            "tb": "table_row_wise",
            "tc": "table_wise",
            "wa": "row_wise",
            "ww": "column_wise",
            "ts": "row_wise",
            "tsa": "column_wise",
        },
        "fused_params": {"optimizer": "EXACT_ROWWISE_ADAGRAD", "learning_rate": 0.05, "weight_decay": 0.01},
        # a variable batch size per step and a short last batch (the same on both ranks:
        # torchrec 1.9.2's TABLE_ROW_WISE backward all_gather fails on gloo with
        # another batch size per rank, "invalid tensor size", its own pipeline too)
        "sizes": ([8, 5, 11, 3, 8, 2], [8, 5, 11, 3, 8, 2]),
        "options": {},
    },
    "fp16_sgd_postproc_custom_fwd": {
        "shardings": {"ta": "row_wise", "tb": "column_wise", "tc": "row_wise", "ts": "row_wise"},
        "fused_params": {"optimizer": "EXACT_SGD", "learning_rate": 0.1},
        "data_type": "FP16",
        "postproc": True,
        # a variable batch size per step, different per rank, and a short last batch
        "sizes": ([8, 5, 11, 3, 8, 2], [6, 9, 2, 12, 8, 1]),
        "options": {"pipeline_postproc": True, "enqueue_batch_after_forward": True, "custom_model_fwd": True},
    },
    "adagrad_jit_free_early_combined_optimizer": {
        "shardings": {"tb": "row_wise", "ww": "row_wise", "tsa": "row_wise"},
        "fused_params": {"optimizer": "EXACT_ADAGRAD", "learning_rate": 0.1},
        "sizes": ([8, 8, 8], [8, 8, 8]),
        # the pipeline's optimizer: CombinedOptimizer([model.fused_optimizer, dense Adam])
        "combined_optimizer": True,
        "options": {"apply_jit": True, "free_features_storage_early": True},
    },
}
"""One gloo run each: torchrec's pipeline, then ours with every flag combination."""


def _scenario_body(rank: int, world_size: int, name: str) -> Dict[str, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    sc = SCENARIOS[name]
    fused_params = dict(sc["fused_params"], optimizer=EmbOptimType[sc["fused_params"]["optimizer"]])
    data_type = DataType[sc.get("data_type", "FP32")]
    device = torch.device("cpu")

    def make(cls: type, **flags: Any) -> Tuple[Any, DistributedModelParallel]:
        dmp, opt = build_breadth(sc["shardings"], fused_params, data_type, sc.get("postproc", False))
        if sc.get("combined_optimizer", False):
            opt = CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", opt)])
        options = dict(sc["options"])
        if options.pop("custom_model_fwd", False):

            def model_fwd(batch: BreadthBatch, model: nn.Module = dmp) -> Tuple[torch.Tensor, Any]:
                loss, out = model(batch)
                return loss, (out[0], out[1][0] + 1.0)

            options["custom_model_fwd"] = model_fwd
        return cls(dmp, opt, device, **options, **flags), dmp

    out: Dict[str, Any] = {}
    pipe, dmp = make(TrainPipelineSparseDist)
    # Fresh batches per run: on CPU the batch is not copied, and
    # free_features_storage_early frees the storage of the caller's KJTs.
    out["torchrec"] = (run_epochs(pipe, [make_breadth_batches(rank, sc["sizes"][rank])]), final_state(dmp))
    for stream, after_opt in FLAG_COMBOS:
        pipe, dmp = make(
            TrainPipelineFusedSparseDist, use_emb_lookup_stream=stream, embedding_lookup_after_opt=after_opt
        )
        out[(stream, after_opt)] = (run_epochs(pipe, [make_breadth_batches(rank, sc["sizes"][rank])]), final_state(dmp))
        out[(stream, after_opt, "pipelined")] = sorted(m.forward.name for m in pipe._pipelined_modules)
        out[(stream, after_opt, "relookups")] = pipe.stats.relookups
    return out


def _assert_equal_runs(label: str, got: Tuple[Any, Any], want: Tuple[Any, Any]) -> None:
    g_trace, g_state = got
    w_trace, w_state = want
    assert len(g_trace) == len(w_trace), f"{label}: {len(g_trace)} trace entries, torchrec {len(w_trace)}"
    for step, (a, b) in enumerate(zip(g_trace, w_trace)):
        assert len(a) == len(b), f"{label}: entry {step} has {len(a)} outputs, torchrec {len(b)}"
        for k, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(torch.as_tensor(x), torch.as_tensor(y)), f"{label}: entry {step} output {k} differs"
    assert sorted(g_state) == sorted(w_state), f"{label}: state keys differ"
    for key in w_state:
        if isinstance(w_state[key], list):
            assert g_state[key] == w_state[key], f"{label}: {key} {g_state[key]} vs torchrec {w_state[key]}"
        else:
            assert torch.equal(torch.as_tensor(g_state[key]), torch.as_tensor(w_state[key])), (
                f"{label}: {key} differs from torchrec's"
            )


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_breadth_model_matches_torchrec_pipeline(name: str) -> None:
    """Losses, nested outputs, parameters, fused optimizer state and TBE counters
    equal torchrec's TrainPipelineSparseDist, every flag combination."""
    for rank, res in enumerate(run_gloo(2, _scenario_body, name, timeout_s=300)):
        trace, _ = res["torchrec"]
        steps = [entry for entry in trace if len(entry) > 1]
        assert len(steps) == len(SCENARIOS[name]["sizes"][rank]), "torchrec ran every batch"
        assert len({float(s[0]) for s in steps}) > 1, "the losses must move (the comparison has teeth)"
        assert res["torchrec"][1]["tbe (step, iter)"], "the model has fbgemm TBEs"
        for stream, after_opt in FLAG_COMBOS:
            label = f"rank {rank} {name} use_emb_lookup_stream={stream} embedding_lookup_after_opt={after_opt}"
            _assert_equal_runs(label, res[(stream, after_opt)], res["torchrec"])
            assert res[(stream, after_opt, "relookups")] == 0, label
            expected = ["ebc1", "ebc2", "ec", "wbc"]
            assert res[(stream, after_opt, "pipelined")] == expected, label


# ---------------------------------------------------------------- epochs


def _epochs_body(rank: int, world_size: int, enqueue_after: bool, reset: bool, sizes: List[int]) -> Dict[str, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    fused_params = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    shardings = {"ta": "column_wise", "tb": "row_wise", "ts": "row_wise"}

    def epochs() -> List[List[BreadthBatch]]:
        return [make_breadth_batches(rank, [8] * n, seed=e + 1) for e, n in enumerate(sizes)]

    options = {"execute_all_batches": False, "enqueue_batch_after_forward": enqueue_after}
    # torchrec 1.9.2 re-runs the forward of the batch it stopped in when progress()
    # is called again after a StopIteration raised after the forward: no extra calls then.
    extra = 0 if enqueue_after else 2
    device = torch.device("cpu")
    out: Dict[str, Any] = {}
    dmp, opt = build_breadth(shardings, fused_params)
    out["torchrec"] = (
        run_epochs(TrainPipelineSparseDist(dmp, opt, device, **options), epochs(), extra, reset),
        final_state(dmp),
    )
    for stream, after_opt in FLAG_COMBOS:
        dmp, opt = build_breadth(shardings, fused_params)
        pipe = TrainPipelineFusedSparseDist(
            dmp, opt, device, use_emb_lookup_stream=stream, embedding_lookup_after_opt=after_opt, **options
        )
        out[(stream, after_opt)] = (run_epochs(pipe, epochs(), extra, reset), final_state(dmp))
    return out


@pytest.mark.parametrize("sizes", ([5, 4, 3], [2]), ids=("three_epochs", "two_batches"))
def test_execute_all_batches_false_over_epochs_matches_torchrec(sizes: List[int]) -> None:
    """execute_all_batches=False stops inside the step of a batch before its forward
    (torchrec never looks it up): the lookup issued for it early is taken back, so
    the TBEs' step / iter (row-wise Adagrad's iteration count) end equal to torchrec's,
    after extra progress() calls and across dataloaders that resume that batch."""
    for rank, res in enumerate(run_gloo(2, _epochs_body, False, False, sizes, timeout_s=300)):
        assert any(len(e) > 1 for e in res["torchrec"][0]) or sizes == [2]
        for stream, after_opt in FLAG_COMBOS:
            label = f"rank {rank} epochs {sizes} use_emb_lookup_stream={stream} embedding_lookup_after_opt={after_opt}"
            _assert_equal_runs(label, res[(stream, after_opt)], res["torchrec"])


def test_reset_after_stop_after_forward_keeps_counters() -> None:
    """execute_all_batches=False with enqueue_batch_after_forward=True stops after
    the forward, which consumed the batch's lookup; reset() then must not take
    that lookup back: the TBE counters stay equal to torchrec's, epoch after epoch."""
    for rank, res in enumerate(run_gloo(2, _epochs_body, True, True, [5, 4, 3], timeout_s=300)):
        for stream, after_opt in FLAG_COMBOS:
            label = f"rank {rank} reset use_emb_lookup_stream={stream} embedding_lookup_after_opt={after_opt}"
            _assert_equal_runs(label, res[(stream, after_opt)], res["torchrec"])


# ---------------------------------------------------------------- managed collision


@dataclass
class McBatch(Pipelineable):
    """Raw ids (a managed-collision module remaps them) and regression targets."""

    features: KeyedJaggedTensor
    targets: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "McBatch":
        return McBatch(
            self.features.to(device, non_blocking=non_blocking), self.targets.to(device, non_blocking=non_blocking)
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.features.record_stream(stream)
        self.targets.record_stream(stream)

    def pin_memory(self) -> "McBatch":
        return self


def make_mc_batches(rank: int, n: int) -> List[McBatch]:
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 4, (2 * 8,), generator=g)
        values = torch.randint(0, 1000, (int(lengths.sum()),), generator=g)
        out.append(
            McBatch(KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], values, lengths), torch.rand(8, generator=g))
        )
    return out


class McModel(nn.Module):
    """torchrec's ManagedCollisionEmbeddingBagCollection (MCH remapping of raw ids
    in [0, 1000) to 100 rows per table) under a linear regression head."""

    def __init__(self) -> None:
        super().__init__()
        from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
        from torchrec.modules.mc_modules import (
            DistanceLFU_EvictionPolicy,
            ManagedCollisionCollection,
            MCHManagedCollisionModule,
        )

        cpu = torch.device("cpu")
        tables = [
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f"f{i}"])
            for i in range(2)
        ]
        # No eviction within the test (fbgemm-gpu-cpu has no reset_weight_momentum).
        mch = {
            t.name: MCHManagedCollisionModule(
                zch_size=100,
                input_hash_size=1000,
                device=cpu,
                eviction_interval=1000,
                eviction_policy=DistanceLFU_EvictionPolicy(),
            )
            for t in tables
        }
        self.mc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=tables, device=cpu),
            ManagedCollisionCollection(managed_collision_modules=mch, embedding_configs=tables),
            return_remapped_features=False,
        )
        self.head = nn.Linear(16, 1)

    def forward(self, batch: McBatch) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        pooled, _ = self.mc(batch.features)
        pred = self.head(pooled.values()).squeeze(1)
        loss = ((pred - batch.targets) ** 2).mean()
        return loss, (loss.detach(), pred.detach())


def build_mc() -> Tuple[DistributedModelParallel, Any]:
    """McModel, ROW_WISE FUSED (row-wise Adagrad) with torchrec's MC sharder; the
    pipeline's optimizer is CombinedOptimizer([model.fused_optimizer, dense Adam])."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder

    torch.manual_seed(0)
    model = McModel()
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    )
    plan = construct_module_sharding_plan(
        model.mc,
        {"t0": row_wise(compute_kernel="fused"), "t1": row_wise(compute_kernel="fused")},
        sharder=sharder,
        local_size=2,
        world_size=2,
        device_type="cpu",
    )
    dmp = DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({"mc": plan}),
        sharders=[sharder],
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.Adam(ps, lr=0.01)
    )
    return dmp, CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])


def _mc_run(pipeline: Any, dmp: DistributedModelParallel, rank: int, event: str) -> Tuple[List[Any], Dict[str, Any]]:
    """6 steps; after step 2 ``event``: "lr" sets the fused learning rate, "attach"
    detaches and re-attaches the pipeline. Returns (trace, state without the MC
    modules' own buffers)."""
    it = iter(make_mc_batches(rank, 6))
    trace: List[Any] = []
    while True:
        try:
            out = pipeline.progress(it)
        except StopIteration:
            break
        trace.append([t.numpy() for t in flatten_outputs(out)])
        if len(trace) == 2 and event == "lr":
            for group in dmp.fused_optimizer.param_groups:
                group["lr"] = 0.5
        if len(trace) == 2 and event == "attach":
            pipeline.detach()
            pipeline.attach()
    state = final_state(dmp)  # includes the MCH modules' _current_iter_tensor buffers
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    mchs = [m for m in dmp.module.modules() if isinstance(m, MCHManagedCollisionModule)]
    assert mchs, "the sharded model holds torchrec's MCH modules"
    for i, m in enumerate(mchs):
        offset = m._current_history_buffer_offset
        state[f"mch {i} (iter, history offset)"] = [m._current_iter, offset]
        state[f"mch {i} history"] = m._history_accumulator[:offset].numpy().copy()
    return trace, state


def _mc_body(rank: int, world_size: int, event: str) -> Dict[str, Any]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    device = torch.device("cpu")
    dmp, opt = build_mc()
    out: Dict[str, Any] = {"torchrec": _mc_run(TrainPipelineSparseDist(dmp, opt, device), dmp, rank, event)}
    for stream, after_opt in FLAG_COMBOS:
        dmp, opt = build_mc()
        pipe = TrainPipelineFusedSparseDist(
            dmp, opt, device, use_emb_lookup_stream=stream, embedding_lookup_after_opt=after_opt
        )
        out[(stream, after_opt)] = _mc_run(pipe, dmp, rank, event)
        out[(stream, after_opt, "relookups")] = pipe.stats.relookups
    return out


@pytest.mark.parametrize("event", ("none", "lr", "attach"))
def test_managed_collision_ebc_matches_torchrec(event: str) -> None:
    """A ManagedCollisionEmbeddingBagCollection keeps its TBEs in its sharded EBC's
    ``_lookups``: a fused learning rate changed between two progress() calls
    redoes its early lookup, attach() waits its tuple of awaitables, and the
    discarded lookup's MCH profiling (iteration, input history) is taken back:
    losses and state equal torchrec's."""
    for rank, res in enumerate(run_gloo(2, _mc_body, event, timeout_s=300)):
        trace, state = res["torchrec"]
        assert len(trace) == 6 and state["tbe (step, iter)"], "torchrec ran 6 steps on fbgemm TBEs"
        for stream, after_opt in FLAG_COMBOS:
            label = f"rank {rank} MC {event} use_emb_lookup_stream={stream} embedding_lookup_after_opt={after_opt}"
            _assert_equal_runs(label, res[(stream, after_opt)], res["torchrec"])
            assert res[(stream, after_opt, "relookups")] == (0 if event == "none" else 1), label
