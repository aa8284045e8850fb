"""Assembly of one run: sharding (where placements are decided), optimizers, train pipeline."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

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

from recpipe.planner.errors import PlacementPlannerError
from recpipe.recipes.config import ConfigError, TrainConfig
from recpipe.recipes.models import EBC_PATH, embedding_bag_collection

if TYPE_CHECKING:
    from recpipe.planner import PlacementConstraints, PlacementPlan

# fp32 tables: 4 bytes per value.
BYTES_PER_FLOAT32: int = 4


@dataclass(frozen=True, kw_only=True)
class ShardedModel:
    """The sharded model and a description of where its tables live."""

    model: DistributedModelParallel
    plan: ShardingPlan
    plan_text: str  # human-readable placement table
    table_ranks: dict[str, Any]
    """Each table's owner rank (table_wise) or planned placement; checked on resume."""


def greedy_table_wise(tables: list[tuple[str, int]], world_size: int) -> dict[str, int]:
    """Owner rank per ``(name, bytes)`` table: largest first, each to the least-loaded rank (ties: lower rank)."""
    load = [0] * world_size
    owner: dict[str, int] = {}
    for name, size in sorted(tables, key=lambda t: (-t[1], t[0])):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += size
    return owner


def shard_model(config: TrainConfig, model: nn.Module, env: ShardingEnv, device: torch.device) -> ShardedModel:
    """Shards ``model``'s EBC over ``env`` and wraps the dense part in DDP.

    ``planned``: the planner picks per table a sharding type (``config.sharding_types``: table-wise,
    whole on one rank; row-wise; column-wise, torchrec's FUSED table in column shards) and a storage
    (all in the fast tier, HYBRID or CACHING; torchrec's FUSED table where that kernel is the faster
    one) under the tier budgets, pricing lookups and communication; ``table_wise``: torchrec's own
    sharder places whole tables greedily;
    ``torchrec_planner``: torchrec's ``EmbeddingShardingPlanner`` plans (both for comparison).
    With ``dynamic_tables`` (``planned`` only) every table is pinned dynamic (:func:`dynamic_constraints`).

    Args:
        model: unsharded ``DLRMTrain`` with meta tables.
    """
    ebc = embedding_bag_collection(model)
    # The tables' optimizer runs inside their backward (fused); DMP moves it into the shards.
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": config.embedding_lr})
    if config.placement == "planned":
        return _shard_planned(config, model, env, device)
    if config.placement == "torchrec_planner":
        return _shard_torchrec_planner(model, env, device)
    sizes = {t.name: t.num_embeddings * t.embedding_dim * BYTES_PER_FLOAT32 for t in ebc.embedding_bag_configs()}
    owner = greedy_table_wise(list(sizes.items()), env.world_size)
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
    dmp = DistributedModelParallel(module=model, env=env, device=device, plan=plan, sharders=[sharder])
    lines = [f"{'table':<14} {'rows':>10} {'dim':>5} {'MB':>9} {'sharding':>11} {'rank':>5}"]
    for t in ebc.embedding_bag_configs():
        mb = sizes[t.name] / 2**20
        lines.append(
            f"{t.name:<14} {t.num_embeddings:>10} {t.embedding_dim:>5} {mb:>9.1f} {'table_wise':>11} {owner[t.name]:>5}"
        )
    return ShardedModel(model=dmp, plan=plan, plan_text="\n".join(lines), table_ranks=dict(owner))


def _shard_torchrec_planner(model: nn.Module, env: ShardingEnv, device: torch.device) -> ShardedModel:
    """torchrec's ``EmbeddingShardingPlanner`` (its default topology for this device) and sharder."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import Topology as TorchrecTopology

    sharder = EmbeddingBagCollectionSharder()
    planner = EmbeddingShardingPlanner(
        topology=TorchrecTopology(
            world_size=env.world_size,
            local_world_size=local_world_size_from_env(env.world_size),
            compute_device=device.type,
        )
    )
    plan = planner.collective_plan(model, [sharder], env.process_group)
    dmp = DistributedModelParallel(module=model, env=env, device=device, plan=plan, sharders=[sharder])
    module_plan = plan.plan[EBC_PATH]
    lines = [f"{'table':<14} {'sharding':>18} {'kernel':>8} {'ranks':>10}"]
    for name, ps in module_plan.items():
        lines.append(f"{name:<14} {ps.sharding_type:>18} {ps.compute_kernel:>8} {str(ps.ranks):>10}")
    ranks = {name: ps.ranks for name, ps in module_plan.items()}
    return ShardedModel(model=dmp, plan=plan, plan_text="\n".join(lines), table_ranks=ranks)


def local_world_size_from_env(world_size: int) -> int:
    """Ranks per machine: torchrun's ``LOCAL_WORLD_SIZE`` (unset: one machine of ``world_size``)."""
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
    config: TrainConfig, *, world_size: int, local_world_size: int, fast_bytes: int, slow_bytes: int | None = None
) -> Topology:
    """The planner's Topology of ``world_size / local_world_size`` machines.

    HBM is the fast tier (``fast_bytes`` per rank; on CPU a host buffer); ``slow_tier_mb``
    (or ``slow_bytes``, when given) is host DDR per machine, shared by its ranks.
    """
    from recpipe.planner import make_topology

    slow = int(config.slow_tier_mb * 2**20) if slow_bytes is None else slow_bytes
    slow_per_rank = slow // local_world_size
    return make_topology(
        world_size=world_size, local_world_size=local_world_size, hbm_cap=fast_bytes, ddr_cap=slow_per_rank
    )


# Planner failures a larger tier budget resolves (``PlacementErrorType`` values): the recipe names its flags.
_BUDGET_FAILURES: frozenset[str] = frozenset(
    {"insufficient_hbm", "insufficient_ddr", "insufficient_storage", "table_does_not_fit"}
)
# The budgets a planner message asks for, in bytes: "hbm_cap) to at least 12.88 MiB (13495560 B)",
# "DDR per machine to at least 4.47 MiB (4680000 B; ddr_cap ...)".
_QUOTED_BUDGETS: dict[str, re.Pattern[str]] = {
    "fast": re.compile(r"hbm_cap\)?(?: to)? at least [\d.]+ \w+ \((\d+) B"),
    "slow": re.compile(r"DDR per machine to at least [\d.]+ \w+ \((\d+) B"),
}
# Plans tried per tier when looking for the least budget the planner's messages name.
MAX_BUDGET_TRIES: int = 6
# Suggested tier budgets are multiples of 1/MIB_STEPS MiB (rounded up from the planner's bytes).
MIB_STEPS: int = 1000


def _step_bytes(steps: int) -> int:
    """Bytes of a budget of ``steps / MIB_STEPS`` MiB, as :func:`_shard_planned` converts the flag's value."""
    return int((steps / MIB_STEPS) * 2**20)


def _steps_holding(num_bytes: int) -> int:
    """The fewest 1/MIB_STEPS MiB steps whose budget holds ``num_bytes``."""
    steps = -(-num_bytes * MIB_STEPS // 2**20)
    while _step_bytes(steps) < num_bytes:  # float rounding of the flag's conversion
        steps += 1
    return steps


def _mb(value: float) -> str:
    """A MiB value as a flag takes it: at most 3 decimals, no trailing zeros (``12.871``, ``16384``)."""
    return f"{value:.3f}".rstrip("0").rstrip(".")


def _budget_failure(error: PlacementPlannerError) -> bool:
    """True for a planner error that more tier budget resolves."""
    return error.planner_error_type.value in _BUDGET_FAILURES


def dynamic_constraints(config: TrainConfig, model: nn.Module) -> dict[str, PlacementConstraints]:
    """The planner's pins of ``--dynamic-tables``: every table of ``model``'s EBC dynamic (none without the flag).

    Each table's capacity is its rows (``num_embeddings`` of its config: ``min(id space, --num-embeddings)``,
    MovieLens' id counts, or ``--virtual-rows`` for ``micro_dlrm_dram``); ``lru`` eviction (a full bucket drops
    its least recently looked-up key), every key admitted at once, torchrec's default uniform initial rows
    (``+-sqrt(1 / rows)``), ``on_full='warning'`` (a key that finds no slot warns and pools as nothing rather
    than stopping the run) and the run's ``--seed``. The planner chooses each table's sharding type (table- or
    row-wise), mode and cache load factor as for a static tiered table.

    Args:
        config: the run's config.
        model: the unsharded model (meta tables).

    Returns:
        Table name -> its ``PlacementConstraints``; empty unless ``config.dynamic_tables``.
    """
    from recpipe.pipeline.placement import DynamicTableOptions
    from recpipe.planner import PlacementConstraints

    if not config.dynamic_tables:
        return {}
    return {
        t.name: PlacementConstraints(
            dynamic=DynamicTableOptions(
                capacity=t.num_embeddings, eviction="lru", admit_after=1, on_full="warning", seed=config.seed
            )
        )
        for t in embedding_bag_collection(model).embedding_bag_configs()
    }


class TierPlanner:
    """Plans the model's tables with recpipe's planner under tier budgets given in bytes.

    When no plan fits, :meth:`plan_or_config_error` raises a :class:`ConfigError` naming the recipe's
    flags, each with the least budget the planner's messages name with which a plan is found.

    Args:
        config: the run's config (batch size, seed, sharding types, ``dynamic_tables``: the pins of
            :func:`dynamic_constraints`; the budgets come per call).
        model: the unsharded model (meta tables, fused optimizer applied).
        world, local_world: ranks, and ranks per machine.
        device: the device the tables train on (picks the planned backend and communication).
    """

    def __init__(
        self, config: TrainConfig, model: nn.Module, *, world: int, local_world: int, device: torch.device
    ) -> None:
        self.config, self.model, self.device = config, model, device
        self.world, self.local_world = world, local_world
        self.constraints = dynamic_constraints(config, model)

    def plan(self, fast: int, slow: int) -> PlacementPlan:
        """The ``PlacementPlan`` for ``fast`` bytes per rank and ``slow`` bytes per machine (PlacementPlannerError if none)."""
        from recpipe.planner import PlacementPlanner

        topology = planner_topology(
            self.config, world_size=self.world, local_world_size=self.local_world, fast_bytes=fast, slow_bytes=slow
        )
        planner = PlacementPlanner(
            topology,
            batch_size=self.config.batch_size,
            hbm_reservation=0.0,
            seed=self.config.seed,
            # the bytes of the tiered tables' default backend on this device (fbgemm's TBE on
            # CUDA; recpipe's own layout elsewhere, where the fast tier is a host buffer)
            backend="fbgemm" if self.device.type == "cuda" else "native",
            # gloo on CPU was measured (planner.communication.GLOO_CPU); CUDA uses the topology's bandwidths
            communication="gloo_cpu" if self.device.type == "cpu" else "topology",
            sharding_types=tuple(self.config.sharding_types.split(",")),
            constraints=self.constraints,
        )
        return planner.plan(self.model)

    def plan_or_config_error(self, fast: int, slow: int) -> PlacementPlan:
        """:meth:`plan`, with a budget failure raised as the :class:`ConfigError` of the recipe's flags."""
        try:
            return self.plan(fast, slow)
        except PlacementPlannerError as e:
            if not _budget_failure(e):
                raise
            raise self._budget_error(e, fast, slow) from e

    def least_quoted(self, error: PlacementPlannerError, tier: str, fast: int, slow: int) -> int | None:
        """The least budget of ``tier`` (``fast`` or ``slow``), in 1/:data:`MIB_STEPS` MiB, that the
        planner's messages name and with which it plans, the other tier kept; None if none does.

        Tries the budgets ``error`` names in increasing order; a failed try's message adds its own.
        """
        now = fast if tier == "fast" else slow
        tried: set[int] = set()
        quoted = {int(b) for b in _QUOTED_BUDGETS[tier].findall(str(error))}
        while len(tried) < MAX_BUDGET_TRIES:
            steps = sorted({_steps_holding(b) for b in quoted} - tried)
            steps = [k for k in steps if _step_bytes(k) > now]
            if not steps:
                return None
            tried.add(steps[0])
            budget = _step_bytes(steps[0])
            try:
                self.plan(*((budget, slow) if tier == "fast" else (fast, budget)))
            except PlacementPlannerError as e:
                if not _budget_failure(e):
                    raise
                quoted |= {int(b) for b in _QUOTED_BUDGETS[tier].findall(str(e))}
                continue
            return steps[0]
        return None

    def _budget_error(self, error: PlacementPlannerError, fast: int, slow: int) -> ConfigError:
        """The error of budgets ``fast`` / ``slow`` no plan fits: the flags, and for each the least value
        the planner names with which it plans while the other stays as it is."""
        from recpipe.planner import tables_from_module

        cfg = self.config
        kind = error.planner_error_type.value
        fast_now = f"{_mb(cfg.fast_tier_mb)} MiB per rank"
        if not cfg.fast_tier_mb:
            fast_now = f"0 (half the tables' per-rank bytes: {_mb(fast / 2**20)} MiB per rank)"
        fixes = []
        least_fast = self.least_quoted(error, "fast", fast, slow)
        if least_fast is not None:
            fixes.append(
                f"pass --fast-tier-mb {_mb(least_fast / MIB_STEPS)} or more (the least budget the planner names "
                f"that plans, --slow-tier-mb {_mb(cfg.slow_tier_mb)} kept)"
            )
        least_slow = self.least_quoted(error, "slow", fast, slow)
        if least_slow is not None:
            fixes.append(
                f"pass --slow-tier-mb {_mb(least_slow / MIB_STEPS)} or more (the least budget the planner names "
                f"that plans, --fast-tier-mb {_mb(cfg.fast_tier_mb)} kept)"
            )
        if not fixes:
            fixes.append("raise --fast-tier-mb and --slow-tier-mb")
        fixes.append(f"shard over more ranks (now {self.world}): per-rank bytes shrink as 1/ranks")
        # the budget at fault; with the fast tier left to its default, the slow tier the user set
        slow_at_fault = kind == "insufficient_ddr" or (not cfg.fast_tier_mb and kind != "insufficient_hbm")
        name = "slow_tier_mb" if slow_at_fault else "fast_tier_mb"
        return ConfigError(
            f"invalid config value {name}={getattr(cfg, name)!r}: the placement planner finds no plan of the "
            f"model's {len(tables_from_module(self.model))} tables within --fast-tier-mb {fast_now} "
            f"and --slow-tier-mb {_mb(cfg.slow_tier_mb)} MiB per machine (planner: {kind}). Fix: " + "; or ".join(fixes)
        )


def default_fast_bytes(model: nn.Module, world: int, constraints: Mapping[str, PlacementConstraints]) -> int:
    """The fast tier of ``--fast-tier-mb 0``: half the tables' per-rank row bytes, so placements are tiered, plus
    the hash indexes of the dynamic tables (pinned in ``constraints``), which live in the fast tier whole.

    A table's per-rank rows are those of its largest row-wise shard (``ceil(rows / world)``); a dynamic table's,
    its shard's slots (``dynamic_local_slots(capacity, world)``).
    """
    from recpipe.pipeline.placement import dynamic_counter_slots, dynamic_index_bytes, dynamic_local_slots
    from recpipe.planner import max_local_rows, row_bytes, tables_from_module

    rows_bytes, index_bytes = 0, 0
    for t in tables_from_module(model):
        pin = constraints.get(t.name)
        options = pin.dynamic if pin is not None else None
        per_row = row_bytes(t.dim, t.dtype, t.optimizer)
        if options is None:
            rows_bytes += max_local_rows(t.rows, world) * per_row
            continue
        slots = dynamic_local_slots(options.table_capacity(t.rows), world)
        rows_bytes += slots * per_row
        index_bytes += dynamic_index_bytes(slots, dynamic_counter_slots(options, t.rows, world))
    return max(1, rows_bytes // 2 + index_bytes)


def _shard_planned(config: TrainConfig, model: nn.Module, env: ShardingEnv, device: torch.device) -> ShardedModel:
    """Planner -> ShardingPlan -> DMP; the plan is sized for the tables' fused optimizer.

    Raises:
        ConfigError: no plan fits ``--fast-tier-mb`` / ``--slow-tier-mb`` (names the least that would).
    """
    from recpipe.pipeline.tiered.tiered_sharders import (
        TieredEmbeddingBagCollectionSharder,
        TieredEmbeddingCollectionSharder,
    )

    world = env.world_size
    tiers = TierPlanner(config, model, world=world, local_world=local_world_size_from_env(world), device=device)
    fast = int(config.fast_tier_mb * 2**20) or default_fast_bytes(model, world, tiers.constraints)
    placement = tiers.plan_or_config_error(fast, int(config.slow_tier_mb * 2**20))
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
            "sharding_type": p.sharding_type,
            "rank": p.rank,
            "ranks": p.ranks,
            "mode": p.storage,
            "cache_load_factor": p.cache_load_factor,
            "dist_type": placement.dist_type.value,
        }
        for p in placement.placements
    }
    return ShardedModel(model=dmp, plan=plan, plan_text=placement.report(), table_ranks=where)


def make_optimizer(config: TrainConfig, model: DistributedModelParallel) -> CombinedOptimizer:
    """``CombinedOptimizer([fused, dense Adagrad])``; Adagrad's eager state lets a checkpoint load before step 1."""
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=config.dense_lr),
    )
    return CombinedOptimizer([model.fused_optimizer, dense])


def make_pipeline(
    config: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> TrainPipelineSparseDist:
    """The train pipeline named by ``config.pipeline``.

    ``sparse``: torchrec's ``TrainPipelineSparseDist``; ``fused``: recpipe's
    ``TrainPipelineFusedSparseDist``; ``semi_sync``: recpipe's ``TrainPipelineSemiSync``, synchronous
    until step ``config.semi_sync_start_batch``. ``fused`` (and ``semi_sync``'s synchronous phase) on CPU
    issue the next lookup before the dense optimizer step so its all-to-all overlaps the optimizer; CUDA
    keeps the default order. ``sparse`` and ``fused`` are exact (same losses).

    Args:
        config: the run's config.
        model: the sharded model.
        optimizer: the combined (fused + dense) optimizer.
        device: the device the model trains on (``semi_sync``: the recipe's loop numbers its batches by
            global step, ``recipes.loop.number_batches_from``, so its phase starts at the same step in a
            resumed run).

    Returns:
        The pipeline (every one is a ``TrainPipelineSparseDist``).
    """
    if config.pipeline == "sparse":
        return TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=True)
    after_opt = device.type != "cpu"
    if config.pipeline == "semi_sync":
        from recpipe.pipeline import TrainPipelineSemiSync

        return TrainPipelineSemiSync(
            model,
            optimizer,
            device,
            execute_all_batches=True,
            start_batch=config.semi_sync_start_batch,
            embedding_lookup_after_opt=after_opt,
        )
    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    return TrainPipelineFusedSparseDist(model, optimizer, device, embedding_lookup_after_opt=after_opt)


def describe_pipeline(config: TrainConfig) -> str:
    """One line naming the train pipeline of ``config`` (logged to TensorBoard and the console)."""
    if config.pipeline == "sparse":
        return "sparse: torchrec TrainPipelineSparseDist (exact)"
    if config.pipeline == "fused":
        return "fused: recpipe TrainPipelineFusedSparseDist (exact)"
    return (
        f"semi_sync: recpipe TrainPipelineSemiSync, synchronous for {config.semi_sync_start_batch} steps, "
        "then each batch looked up from tables one step stale"
    )
