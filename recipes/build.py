"""Assembly of one run: sharding, optimizers and the train pipeline, each in ONE place.

* :func:`shard_model` is where placements are decided: ``--placement planned`` (the
  default) plans HYBRID / CACHING tiered tables with :mod:`recpipe.planner` and shards
  them with recpipe's sharders; ``table_wise`` places whole tables with torchrec's own
  ``EmbeddingBagCollectionSharder`` (greedy by bytes), for comparison.
* :func:`make_pipeline` selects ``fused`` (recpipe) or ``sparse`` (torchrec).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import Topology
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from recpipe.recipes.config import TrainConfig
from recpipe.recipes.models import EBC_PATH

# fp32 tables: 4 bytes per value.
BYTES_PER_FLOAT32: int = 4


@dataclass(frozen=True, kw_only=True)
class ShardedModel:
    """The sharded model and a description of where its tables live."""

    model: DistributedModelParallel
    """The DMP-wrapped model (dense part data-parallel)."""
    plan: ShardingPlan
    """torchrec plan used to shard it."""
    plan_text: str
    """Human-readable placement table (logged to TensorBoard as text)."""
    table_ranks: dict[str, Any]
    """Where each table lives: its owner rank (table_wise) or its planned placement
    (mode, cache load factor, routing); checkpoints check it on resume."""


def greedy_table_wise(tables: list[tuple[str, int]], world_size: int) -> dict[str, int]:
    """Assigns whole tables to ranks, largest first, each to the least-loaded rank.

    Args:
        tables: ``(name, bytes)`` per table.
        world_size: number of ranks.

    Returns:
        Owner rank per table name (ties go to the lower rank; deterministic).
    """
    load = [0] * world_size
    owner: dict[str, int] = {}
    for name, size in sorted(tables, key=lambda t: (-t[1], t[0])):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += size
    return owner


def shard_model(
    config: TrainConfig, model: nn.Module, env: ShardingEnv, device: torch.device
) -> ShardedModel:
    """Shards ``model``'s EBC over ``env`` and wraps the dense part in DDP.

    ``config.placement == "planned"`` (default): :class:`recpipe.planner.PlacementPlanner`
    chooses HYBRID / CACHING and a cache load factor per table under the fast-tier
    (``fast_tier_mb`` per device) and slow-tier (``slow_tier_mb`` per machine)
    budgets; the plan shards every table ROW_WISE with hash routing into tiered
    storage (:class:`recpipe.pipeline.tiered.sharders.TieredEmbeddingBagCollectionSharder`).
    ``"table_wise"``: torchrec's own sharder places whole tables greedily.

    Args:
        config: the run's config (placement, budgets, embedding learning rate).
        model: unsharded ``DLRMTrain`` with meta tables.
        env: sharding environment (world size, rank, process group).
        device: compute device.

    Returns:
        The :class:`ShardedModel`.
    """
    ebc = model.get_submodule(EBC_PATH)
    # The tables' optimizer runs inside their backward (fused); DMP moves it into the shards.
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": config.embedding_lr})
    if config.placement == "planned":
        return _shard_planned(config, model, env, device)
    sizes = [
        (t.name, t.num_embeddings * t.embedding_dim * BYTES_PER_FLOAT32)
        for t in ebc.embedding_bag_configs()
    ]
    owner = greedy_table_wise(sizes, env.world_size)
    sharder = EmbeddingBagCollectionSharder()
    module_plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={name: table_wise(rank=rank) for name, rank in owner.items()},
        sharder=sharder,
        local_size=env.world_size,
        world_size=env.world_size,
        device_type=device.type,
    )
    plan = ShardingPlan({EBC_PATH: module_plan})
    dmp = DistributedModelParallel(
        module=model, env=env, device=device, plan=plan, sharders=[sharder]
    )
    lines = [f"{'table':<14} {'rows':>10} {'dim':>5} {'MB':>9} {'sharding':>11} {'rank':>5}"]
    for t in ebc.embedding_bag_configs():
        mb = t.num_embeddings * t.embedding_dim * BYTES_PER_FLOAT32 / 2**20
        lines.append(
            f"{t.name:<14} {t.num_embeddings:>10} {t.embedding_dim:>5} {mb:>9.1f} "
            f"{'table_wise':>11} {owner[t.name]:>5}"
        )
    return ShardedModel(model=dmp, plan=plan, plan_text="\n".join(lines), table_ranks=dict(owner))


def local_world_size_from_env(world_size: int) -> int:
    """Ranks per machine of this job: torchrun's ``LOCAL_WORLD_SIZE``.

    ``torchx run recpipe.train -j {nnodes}x{nproc_per_node}`` starts ``nproc_per_node``
    ranks per machine and torchrun exports that count to every worker. Without it
    (one process, not under torchrun) the job is one machine.

    Args:
        world_size: ranks of the job.

    Returns:
        Ranks per machine, a divisor of ``world_size``.

    Raises:
        ValueError: ``LOCAL_WORLD_SIZE`` is not a positive integer dividing
            ``world_size``.
    """
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        return world_size
    try:
        local = int(raw)
    except ValueError:
        local = 0
    if local < 1 or world_size % local != 0:
        raise ValueError(
            f"invalid LOCAL_WORLD_SIZE={raw!r} for world size {world_size}: it must be the "
            "ranks per machine, a positive divisor of the world size. Fix: launch with "
            "torchrun / torchx (which set it) or unset it for a one-machine job"
        )
    return local


def planner_topology(
    config: TrainConfig, *, world_size: int, local_world_size: int, fast_bytes: int
) -> Topology:
    """The planner's Topology: ``world_size / local_world_size`` machines.

    The planner models a GPU host: a ``"cuda"`` topology whose HBM is the fast tier
    (on CPU a separate host buffer of that size). ``config.slow_tier_mb`` is host
    DDR *per machine*, shared by that machine's ``local_world_size`` ranks, so each
    rank's ``ddr_cap`` is its share.

    Args:
        config: ``slow_tier_mb``.
        world_size: ranks of the job.
        local_world_size: ranks per machine (see :func:`local_world_size_from_env`).
        fast_bytes: fast-tier bytes per rank.

    Returns:
        The torchrec ``Topology`` given to the planner.

    Example::

        # -j 2x1: 2 machines of 1 rank, each rank gets the whole per-machine DDR
        planner_topology(cfg, world_size=2, local_world_size=1, fast_bytes=2**20)
    """
    from recpipe.planner import make_topology

    slow_per_rank = int(config.slow_tier_mb * 2**20) // local_world_size
    return make_topology(
        world_size=world_size,
        local_world_size=local_world_size,
        hbm_cap=fast_bytes,
        ddr_cap=slow_per_rank,
    )


def _shard_planned(
    config: TrainConfig, model: nn.Module, env: ShardingEnv, device: torch.device
) -> ShardedModel:
    """Planner -> ShardingPlan -> DMP with recpipe's tiered row-wise sharder.

    The planner reads the tables and the optimizer fused into each
    (``apply_optimizer_in_backward`` in :func:`shard_model`) from ``model``, so the
    plan is sized for the optimizer the tables train with; the sharders refuse a
    table whose optimizer differs from its plan.
    """
    from recpipe.pipeline.tiered.sharders import (
        TieredEmbeddingBagCollectionSharder,
        TieredEmbeddingCollectionSharder,
    )
    from recpipe.planner import PlacementPlanner, max_local_rows, row_bytes, tables_from_module

    world = env.world_size
    fast = int(config.fast_tier_mb * 2**20)
    if fast == 0:
        per_rank = sum(
            max_local_rows(t.rows, world) * row_bytes(t.dim, t.dtype, t.optimizer)
            for t in tables_from_module(model)
        )
        fast = max(1, per_rank // 2)
    topology = planner_topology(
        config, world_size=world, local_world_size=local_world_size_from_env(world), fast_bytes=fast
    )
    planner = PlacementPlanner(
        topology,
        batch_size=config.batch_size,
        hbm_reservation=0.0,
        seed=config.seed,
        # the bytes of the tiered tables' default backend on this device (fbgemm's TBE on
        # CUDA; recpipe's own layout elsewhere, where the fast tier is a host buffer)
        backend="fbgemm" if device.type == "cuda" else "native",
    )
    placement = planner.plan(model)
    plan = placement.to_sharding_plan(compute_device=device.type)
    dmp = DistributedModelParallel(
        module=model,
        env=env,
        device=device,
        plan=plan,
        sharders=[TieredEmbeddingBagCollectionSharder(), TieredEmbeddingCollectionSharder()],
    )
    where = {
        p.table: {
            "mode": p.mode.name,
            "cache_load_factor": p.cache_load_factor,
            "dist_type": placement.dist_type.value,
        }
        for p in placement.placements
    }
    return ShardedModel(model=dmp, plan=plan, plan_text=placement.report(), table_ranks=where)


def make_optimizer(config: TrainConfig, model: DistributedModelParallel) -> CombinedOptimizer:
    """Dense Adagrad combined with the tables' fused optimizer.

    Adagrad creates its state eagerly, so a checkpoint can be restored in place
    before the first step (exact resume).

    Args:
        config: ``dense_lr``.
        model: the DMP model.

    Returns:
        ``CombinedOptimizer([fused, dense])``; ``step()`` only moves the dense part.
    """
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=config.dense_lr),
    )
    return CombinedOptimizer([model.fused_optimizer, dense])


def make_pipeline(
    config: TrainConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
) -> TrainPipelineSparseDist:
    """The train pipeline named by ``config.pipeline``.

    ``fused`` on CPU issues batch i+1's lookup before the dense optimizer step
    (``embedding_lookup_after_opt=False``): its output all-to-all then overlaps the
    optimizer, which hides more of the wait than issuing it after (the pipeline's
    documented CPU choice; default recipe, 2 ranks: ~9% more samples/s, paired runs).
    CUDA keeps the pipeline's default (after the optimizer). Either is exact.

    Args:
        config: ``pipeline`` is ``"fused"`` (recpipe) or ``"sparse"`` (torchrec).
        model: the DMP model.
        optimizer: the combined optimizer.
        device: compute device.

    Returns:
        A ``TrainPipelineSparseDist`` (or recpipe's subclass); ``progress(it)`` runs one step.

    Raises:
        ImportError: ``fused`` was asked for but recpipe.pipeline does not provide it.
    """
    if config.pipeline == "sparse":
        return TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=True)
    try:
        from recpipe.pipeline.train.pipeline import TrainPipelineFusedSparseDist
    except ImportError as e:
        raise ImportError(
            "pipeline='fused' needs recpipe.pipeline.train.pipeline.TrainPipelineFusedSparseDist, "
            f"which failed to import ({e}). Fix: pass --pipeline sparse, or install a recpipe "
            "that includes the fused pipeline"
        ) from e
    return TrainPipelineFusedSparseDist(
        model, optimizer, device, embedding_lookup_after_opt=device.type != "cpu"
    )
