"""Plan your own EmbeddingBagCollection, shard it, train it with the fused pipeline, checkpoint it.

On 2 gloo CPU processes: recpipe's planner places table "small" and pins table "big" to a row-wise
CACHING table (half its rows in the fast tier); DistributedModelParallel shards the model with
recpipe's sharder; TrainPipelineFusedSparseDist trains 8 steps; recpipe's DCP checkpoint saves the
model and loads it into a freshly initialised one, which then predicts exactly as the trained model.

Run: python examples/planned_ebc_training.py [CHECKPOINT_DIR]   (default: a temporary directory)
"""

from __future__ import annotations

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.pipeline import TieredEmbeddingBagCollectionSharder, TrainPipelineFusedSparseDist, checkpoint
from recpipe.planner import PlacementConstraints, PlacementPlanner, make_topology

WORLD_SIZE, STEPS, BATCH, DIM, DENSE = 2, 8, 32, 8, 4
TABLES = {"small": 100, "big": 2000}  # table (and feature) name -> rows


class Model(nn.Module):
    """Dense features and the tables' pooled embeddings -> one logit."""

    def __init__(self) -> None:
        super().__init__()
        configs = [
            EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=r, feature_names=[t])
            for t, r in TABLES.items()
        ]
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        self.over = nn.Linear(DENSE + DIM * len(TABLES), 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        pooled = self.ebc(batch.sparse_features).values()
        logits = self.over(torch.cat([batch.dense_features, pooled], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach())  # (loss, output): the pipeline returns the output


def make_batch(rank: int, step: int) -> Batch:
    """Rank ``rank``'s batch at ``step``: 1-3 ids per sample and feature, seeded by (rank, step)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(1, 4, (len(TABLES) * BATCH,), generator=g)
    per_key = lengths.view(len(TABLES), BATCH).sum(1).tolist()
    values = torch.cat([torch.randint(0, r, (n,), generator=g) for r, n in zip(TABLES.values(), per_key)])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(TABLES), values=values, lengths=lengths)
    return Batch(torch.randn(BATCH, DENSE, generator=g), kjt, torch.randint(0, 2, (BATCH,), generator=g).float())


def build(seed: int) -> tuple[DistributedModelParallel, KeyedOptimizerWrapper, str]:
    """The planned, sharded model, the optimizer of its dense part, the plan's report."""
    torch.manual_seed(seed)
    model = Model()
    # the tables' optimizer runs inside their backward (fused); the planner budgets its state
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.05})
    # the planner's HBM is the fast tier (on CPU, a host buffer of hbm_cap bytes per rank); DDR the slow tier
    topology = make_topology(world_size=WORLD_SIZE, local_world_size=WORLD_SIZE, hbm_cap=2**20, ddr_cap=2**30)
    pins = {"big": PlacementConstraints(sharding_type="row_wise", mode="CACHING", cache_load_factor=0.5)}
    plan = PlacementPlanner(topology, constraints=pins, backend="native", hbm_reservation=0.0).plan(model)
    sharded = DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=plan.to_sharding_plan(compute_device="cpu"),
        sharders=[TieredEmbeddingBagCollectionSharder()],
    )
    dense = dict(in_backward_optimizer_filter(sharded.named_parameters()))
    return sharded, KeyedOptimizerWrapper(dense, lambda params: torch.optim.Adam(params, lr=0.01)), plan.report()


def run_rank(rank: int, tmp: str, checkpoint_dir: str) -> None:
    """One rank: plan and shard, train STEPS steps through the pipeline, save, reload, compare."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD_SIZE)
    model, optimizer, report = build(seed=0)
    if rank == 0:
        print(report)
    pipeline = TrainPipelineFusedSparseDist(model, optimizer, torch.device("cpu"))
    batches = iter([make_batch(rank, step) for step in range(STEPS)])
    losses = [float(pipeline.progress(batches)[0]) for _ in range(STEPS)]  # the model's output: (loss, logits)
    model = pipeline.detach()  # the plain model again (the pipeline had taken over its lookups)
    checkpoint.save(model, checkpoint_dir)
    fresh, _, _ = build(seed=1)  # other initial weights, until the load
    probe = make_batch(rank, STEPS)
    with torch.no_grad():
        trained, before = model(probe)[1][1], fresh(probe)[1][1]
        checkpoint.load(fresh, checkpoint_dir)
        after = fresh(probe)[1][1]
    # one write per rank, so the two ranks' lines do not interleave
    print(
        f"rank {rank}: losses {' '.join(f'{x:.4f}' for x in losses)}\n"
        f"rank {rank}: fresh model predicts as the trained one before the load: {torch.equal(before, trained)}, "
        f"after: {torch.equal(after, trained)}\n",
        end="",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint_dir = sys.argv[1] if len(sys.argv) > 1 else f"{tmp}/checkpoint"
        # fork: the ranks inherit this process's imports (spawn would import torchrec again in each)
        mp.start_processes(run_rank, args=(tmp, checkpoint_dir), nprocs=WORLD_SIZE, start_method="fork")
        print(f"checkpoint saved to {checkpoint_dir}" + ("" if len(sys.argv) > 1 else " (a temporary directory)"))
