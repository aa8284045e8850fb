"""Shared helpers of the pipeline tests (no tests here): small sharded models, batches, runners.

Provides the two-module test model (``TwoModuleModel``: an EBC and an EC) with
its batches (``TwoSparseBatch``, ``make_batches``), ``build_dmp`` /
``shard_with_dense_adam`` to shard it, the non-pipelined ``run_reference`` and
``run_pipeline`` loops, the pipeline flag combinations (recpipe's ``FLAG_COMBOS``,
torchrec's ``TORCHREC_FLAG_COMBOS``) and the trace helpers ``on_cpu`` (tensors to
numpy for the result queue) and ``assert_same`` (bit-for-bit comparison of losses
and predictions). Imported by the pipeline, tiered and README tests, and run inside
gloo ranks (run_gloo pickles module-level functions, so everything here is module
level). Sizes are kept small: the whole pipeline test area must finish in a few
minutes on 2 cores.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

# Sharding types exercised by the parity tests: the one place to extend.
# torchrec 1.9.2's sharders offer row_wise only for compute device cuda; row_wise
# runs through recpipe's sharders (recpipe.pipeline.routing.routed_sharders), on CPU too.
SHARDING_TYPES: Tuple[str, ...] = ("table_wise", "column_wise", "row_wise")

EMB_DIM = 8  # default embedding dim of every table (divisible by 2 ranks for column_wise); TwoModuleModel(emb_dim=)
DENSE_IN = 6  # dense features per sample
BATCH = 16  # samples per rank per batch
N_BATCHES = 10  # batches per run (>= 10 for step-by-step parity)
MAX_IDS = 3  # max ids per sample per feature
EBC_TABLES = (("t0", 300), ("t1", 200))  # (name, rows) of the pooled tables
EC_TABLES = (("s0", 100),)  # (name, rows) of the sequence tables
EC_LEN = 3  # padded sequence length used to pool the EC output

FLAG_COMBOS: Tuple[Tuple[bool, bool], ...] = tuple(itertools.product((False, True), (False, True)))
"""(use_emb_lookup_stream, embedding_lookup_after_opt): all four combinations. On CPU
the stream flag selects no stream (there is none) and must change nothing; both are run."""

TORCHREC_FLAG_COMBOS: Tuple[Tuple[str, bool], ...] = tuple(
    itertools.product(("new", "current", "data_dist"), (False, True))
)
"""(emb_lookup_stream, embedding_lookup_after_data_dist): torchrec's TrainPipelineFusedSparseDist
arguments, all six combinations. On CPU the stream selects nothing; the issue point applies."""


@dataclass
class TwoSparseBatch(Pipelineable):
    """Dense features, one KJT per sharded module, labels."""

    dense: torch.Tensor
    ebc_features: KeyedJaggedTensor
    ec_features: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "TwoSparseBatch":
        return TwoSparseBatch(
            self.dense.to(device, non_blocking=non_blocking),
            self.ebc_features.to(device, non_blocking=non_blocking),
            self.ec_features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense.record_stream(stream)
        self.ebc_features.record_stream(stream)
        self.ec_features.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> "TwoSparseBatch":
        return TwoSparseBatch(
            self.dense.pin_memory(),
            self.ebc_features.pin_memory(),
            self.ec_features.pin_memory(),
            self.labels.pin_memory(),
        )


def _kjt(names: Sequence[str], rows: Sequence[int], g: torch.Generator) -> KeyedJaggedTensor:
    lengths = torch.randint(0, MAX_IDS + 1, (len(names) * BATCH,), generator=g)
    values = []
    for i, r in enumerate(rows):
        n = int(lengths[i * BATCH : (i + 1) * BATCH].sum())
        values.append(torch.randint(0, r, (n,), generator=g))
    return KeyedJaggedTensor.from_lengths_sync(keys=list(names), values=torch.cat(values), lengths=lengths)


def make_batches(rank: int, n: int = N_BATCHES, seed: int = 0) -> List[TwoSparseBatch]:
    """``n`` deterministic batches for ``rank`` (different data per rank)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    out = []
    for _ in range(n):
        out.append(
            TwoSparseBatch(
                dense=torch.randn(BATCH, DENSE_IN, generator=g),
                ebc_features=_kjt([f"f_{t}" for t, _ in EBC_TABLES], [r for _, r in EBC_TABLES], g),
                ec_features=_kjt([f"f_{t}" for t, _ in EC_TABLES], [r for _, r in EC_TABLES], g),
                labels=torch.randint(0, 2, (BATCH,), generator=g).float(),
            )
        )
    return out


class TwoModuleModel(nn.Module):
    """An EBC (pooled) and an EC (sequence) feeding a small over-arch; returns (loss, logits). Every table is
    ``emb_dim`` wide."""

    def __init__(
        self,
        ebc_tables: Sequence[Tuple[str, int]] = EBC_TABLES,
        position_weighted: bool = False,
        emb_dim: int = EMB_DIM,
    ) -> None:
        super().__init__()
        ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=t, embedding_dim=emb_dim, num_embeddings=r, feature_names=[f"f_{t}"])
                for t, r in ebc_tables
            ],
            device=torch.device("cpu"),
            is_weighted=position_weighted,
        )
        # position_weighted: a feature processor (position weights stepped by the
        # dense optimizer) inside the pipelined module.
        self.ebc: nn.Module = (
            FeatureProcessedEmbeddingBagCollection(
                ebc, PositionWeightedModuleCollection({f"f_{t}": MAX_IDS for t, _ in ebc_tables})
            )
            if position_weighted
            else ebc
        )
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name=t, embedding_dim=emb_dim, num_embeddings=r, feature_names=[f"f_{t}"])
                for t, r in EC_TABLES
            ],
            device=torch.device("cpu"),
        )
        self._ec_features = [f"f_{t}" for t, _ in EC_TABLES]
        self.bottom = nn.Linear(DENSE_IN, emb_dim)
        width = emb_dim * (1 + len(ebc_tables) + len(EC_TABLES))
        self.over = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch: TwoSparseBatch) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        dense = self.bottom(batch.dense)
        pooled = self.ebc(batch.ebc_features).values()
        seq = self.ec(batch.ec_features)
        seq_pooled = [seq[f].to_padded_dense(desired_length=EC_LEN).sum(1) for f in self._ec_features]
        logits = self.over(torch.cat([dense, pooled] + seq_pooled, dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach())


def _generator(kind: str, idx: int, world_size: int, kernel: Optional[str]) -> Any:
    if kind == "table_wise":
        return table_wise(rank=idx % world_size, compute_kernel=kernel)
    if kind == "column_wise":
        return column_wise(ranks=list(range(world_size)), compute_kernel=kernel)
    if kind == "row_wise":
        return row_wise(compute_kernel=kernel)
    if kind == "data_parallel":
        return data_parallel()
    raise ValueError(f"unknown sharding type {kind!r}")


def build_dmp(
    sharding: str,
    device: torch.device,
    *,
    overrides: Optional[Dict[str, Tuple[str, Optional[str]]]] = None,
    seed: int = 0,
    position_weighted: bool = False,
    pg: Optional[dist.ProcessGroup] = None,
) -> Tuple[DistributedModelParallel, KeyedOptimizerWrapper]:
    """A sharded ``TwoModuleModel`` and its dense Adam optimizer.

    Tables get a fused in-backward Adagrad unless ``overrides`` maps their name to
    (sharding type, compute kernel) with kernel ``'dense'`` or sharding
    ``'data_parallel'`` (then the dense optimizer steps them).
    """
    overrides = overrides or {}
    world_size = dist.get_world_size()
    torch.manual_seed(seed)
    model = TwoModuleModel(position_weighted=position_weighted)
    fused_params: List[nn.Parameter] = []
    plan: Dict[str, Any] = {}
    ebc_sharder: ModuleSharder[nn.Module] = (
        FeatureProcessedEmbeddingBagCollectionSharder() if position_weighted else EmbeddingBagCollectionSharder()
    )
    ec_sharder: ModuleSharder[nn.Module] = EmbeddingCollectionSharder()
    if sharding == "row_wise" and not position_weighted:
        from recpipe.pipeline.routing.routed_sharders import (
            RoutedEmbeddingBagCollectionSharder,
            RoutedEmbeddingCollectionSharder,
        )

        ebc_sharder = RoutedEmbeddingBagCollectionSharder()
        ec_sharder = RoutedEmbeddingCollectionSharder()
    modules = (("ebc", ebc_sharder), ("ec", ec_sharder))

    def tables(mod_name: str) -> Dict[str, nn.Module]:
        if mod_name == "ec":
            return dict(model.ec.embeddings.items())
        ebc = model.ebc._embedding_bag_collection if position_weighted else model.ebc
        return dict(ebc.embedding_bags.items())

    choice: Dict[str, Tuple[str, str]] = {}
    for mod_name, _ in modules:
        for table, sub in tables(mod_name).items():
            kind, kernel = overrides.get(table, (sharding, "fused"))
            kernel = kernel or "fused"
            if kind == "data_parallel":
                kernel = "dense"
            choice[table] = (kind, kernel)
            if kernel != "dense":
                fused_params.append(sub.weight)
    # The fused in-backward optimizer must be attached before planning: torchrec
    # picks the FUSED kernel only for parameters that carry it.
    apply_optimizer_in_backward(torch.optim.Adagrad, fused_params, {"lr": 0.05})
    for mod_name, sharder in modules:
        module = getattr(model, mod_name)
        per_param = {
            table: _generator(choice[table][0], i, world_size, choice[table][1])
            for i, table in enumerate(tables(mod_name))
        }
        plan[mod_name] = construct_module_sharding_plan(
            module, per_param, sharder=sharder, local_size=world_size, world_size=world_size, device_type=device.type
        )
    return shard_with_dense_adam(model, plan, [ebc_sharder, ec_sharder], device, pg=pg)


def shard_with_dense_adam(
    model: nn.Module,
    plan: Dict[str, Any],
    sharders: List[ModuleSharder[nn.Module]],
    device: torch.device,
    *,
    pg: Optional[dist.ProcessGroup] = None,
) -> Tuple[DistributedModelParallel, KeyedOptimizerWrapper]:
    """``model`` sharded by ``plan`` and an Adam (lr 0.01) over the parameters no
    in-backward optimizer steps.

    Args:
        model (nn.Module): the unsharded model (fused optimizers already applied).
        plan (Dict[str, Any]): module FQN -> its module sharding plan.
        sharders (List[ModuleSharder[nn.Module]]): the sharders of ``plan``.
        device (torch.device): compute device.
        pg (Optional[dist.ProcessGroup]): process group (default: the world).
    """
    dmp = DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(pg or dist.GroupMember.WORLD),
        device=device,
        plan=ShardingPlan(plan),
        sharders=sharders,
    )
    opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: torch.optim.Adam(params, lr=0.01)
    )
    return dmp, opt


def copy_state(dst: DistributedModelParallel, src: DistributedModelParallel) -> None:
    """Makes ``dst``'s weights equal to ``src``'s (same plan on both)."""
    dst.load_state_dict(src.state_dict())


def run_reference(
    dmp: DistributedModelParallel,
    opt: torch.optim.Optimizer,
    batches: Sequence[TwoSparseBatch],
    before_step: Optional[Callable[[int], None]] = None,
) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Non-pipelined training: forward, backward, optimizer per batch.

    ``before_step(i)``, when given, runs before step i (e.g. a weight load).
    """
    losses, preds = [], []
    for step, b in enumerate(batches):
        if before_step is not None:
            before_step(step)
        opt.zero_grad()
        loss, (_, logits) = dmp(b)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
        preds.append(logits.clone())
    return losses, preds


def run_pipeline(
    pipeline: Any, batches: Sequence[TwoSparseBatch]
) -> Tuple[List[torch.Tensor], List[torch.Tensor], bool]:
    """Drives ``pipeline.progress`` until StopIteration.

    Returns:
        (losses, predictions, stops_again): the last flag is True when one more
        ``progress`` after the end raises StopIteration again.
    """
    it: Iterator[TwoSparseBatch] = iter(batches)
    losses: List[torch.Tensor] = []
    preds: List[torch.Tensor] = []
    while True:
        try:
            loss, logits = pipeline.progress(it)
        except StopIteration:
            break
        losses.append(loss.clone())
        preds.append(logits.clone())
    try:
        pipeline.progress(it)
        again = False
    except StopIteration:
        again = True
    return losses, preds, again


def on_cpu(trace: Tuple[List[torch.Tensor], ...]) -> Tuple[List[torch.Tensor], ...]:
    # Tensors cross the result queue by value (numpy): torch's shared-memory
    # tensor passing fails once the rank process has exited.
    return tuple([t.detach().cpu().numpy() for t in part] for part in trace)


def _tensors(trace: Tuple[List[Any], ...]) -> Tuple[List[torch.Tensor], ...]:
    return tuple([torch.from_numpy(a) for a in part] for part in trace)


def assert_same(name: str, got: Tuple[List[Any], ...], want: Tuple[List[Any], ...]) -> None:
    g_losses, g_preds = _tensors(got)
    w_losses, w_preds = _tensors(want)
    assert len(g_losses) == len(w_losses), f"{name}: {len(g_losses)} steps, reference {len(w_losses)}"
    for step, (a, b) in enumerate(zip(g_losses, w_losses)):
        assert torch.equal(a, b), f"{name}: loss differs at step {step}: {a.item()!r} vs {b.item()!r}"
    for step, (a, b) in enumerate(zip(g_preds, w_preds)):
        assert torch.equal(a, b), f"{name}: predictions differ at step {step}, max |diff| {(a - b).abs().max().item()}"
