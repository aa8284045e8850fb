"""PlacementPlanner: topology budgets -> options (enumerator, cost model) -> one per table (proposer) -> owner
ranks (partitioner) -> PlacementPlan."""

from __future__ import annotations

import numbers
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from torch import nn
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.types import Topology

from recpipe.pipeline.placement import (
    ROUTED_DIST_TYPES,
    CachePolicy,
    DistType,
    DynamicTableOptions,
    FusedOptimizerKind,
    check_int,
    check_load_factors,
    resolve_dtype,
)
from recpipe.planner.communication import (
    GLOO_CPU,
    PLANNED_SHARDING_TYPES,
    CommConstants,
    CommCostModel,
    topology_constants,
)
from recpipe.planner.constraints import constraint_for
from recpipe.planner.cost_models import make_cost_model
from recpipe.planner.diagnosis import InfeasibilityDiagnosis
from recpipe.planner.enumerators import GridPlacementEnumerator
from recpipe.planner.errors import PlacementErrorType, PlacementPlannerError, sized
from recpipe.planner.option_arrays import MODE_OF_CODE, SHARDING_OF_CODE, OptionArrays
from recpipe.planner.partitioners import GreedyTableWisePartitioner, Partition, place_shards
from recpipe.planner.placement_plan import PlacementPlan, TablePlacement, option_text
from recpipe.planner.proposers import KnapsackProposer
from recpipe.planner.specs import (
    DEFAULT_LOAD_FACTORS,
    PlacementConstraints,
    PlacementOption,
    TableSpec,
    check_topology_args,
)
from recpipe.planner.stage_checks import (
    check_enumerator_settings,
    check_stages,
    checked_choice,
    checked_options,
    checked_partition,
    cost_model_name,
)
from recpipe.planner.tables import tables_from_module
from recpipe.planner.types import CostModel, PlacementEnumerator, PlacementPartitioner, PlacementProposer

#: Fraction of each device's HBM kept for dense parameters, activations and input buffers (tzrec's
#: default ``storage_reserve_percent``). Dimensionless.
DEFAULT_HBM_RESERVATION: float = 0.15
#: Fraction of host DDR reserved: torchrec's percentage reservations touch HBM only. Dimensionless.
DEFAULT_DDR_RESERVATION: float = 0.0
#: Knapsack runs that drop the table- and column-wise options of tables no ranks could hold, before one without
#: any. Count.
MAX_PARTITION_REPAIRS: int = 8
#: ``communication=`` names -> constants (``topology``: the topology's own bandwidths).
COMMUNICATION_CONSTANTS = {"gloo_cpu": GLOO_CPU}


class PlacementPlanner:
    """Chooses for every table a sharding type and a storage: TABLE_WISE (the whole table on one rank) or
    ROW_WISE (over all ranks), as recpipe's tiered table (HYBRID / CACHING and a cache load factor, or all in
    the fast tier) or, all in the fast tier, as torchrec's FUSED table, TABLE_WISE or COLUMN_WISE (column
    shards of at least 128 columns, each whole on one rank, where the table's width splits).

    Budgets: HBM per device = ``min(device hbm) x (1 - hbm_reservation)``; DDR per machine = ``min over
    machines of its ranks' ddr sum`` (torchrec's ``ddr_cap`` is per rank) ``x (1 - ddr_reservation)``.
    Row-wise tables' largest shards (rank 0 / machine 0) are checked on every rank; the knapsack budgets
    a table- or column-wise table by its share of every rank, then the partitioner picks the owners of its
    shards under the ranks' budgets (a table no ranks hold takes its cheapest option that fits, see
    :meth:`_solve`). Costs: lookup
    bytes (``cost_model``) plus the sharding type's communication (``communication``).

    The four stages are extension points (``recpipe.planner.types``): ``enumerator`` lists the options,
    ``cost_model`` prices their lookups (in the default enumerator), ``proposer`` picks one per table and
    ``partitioner`` picks the owner ranks of the table- and column-wise ones. Each takes an instance of its
    protocol; the planner checks what each returns and refuses, naming it, picks outside the budgets.

    Args:
        topology: torchrec topology (dry runs on a CPU machine are fine).
        enumerator: a ``PlacementEnumerator``; None builds a ``GridPlacementEnumerator`` from ``cost_model``,
            ``load_factors``, ``constraints``, ``sharding_types`` and ``communication``, which are refused
            beside a given one (it lists and prices the options itself).
        partitioner: a ``PlacementPartitioner``; None: ``GreedyTableWisePartitioner()``.
        cost_model: ``"analytic"`` (None, the default), ``"empirical"`` or a ``CostModel``.
        proposer: a ``PlacementProposer``; None: ``KnapsackProposer(bins)``.
        load_factors: the cache load factors ``x`` each tiered table may take.
        bins: DP grid of the default proposer (None sizes it); refused together with ``proposer``.
        constraints: pins per table name or FQN; a pinned sharding type must be one of ``sharding_types``.
        optimizer: fused optimizer of module tables the model names none for (a module's own always win);
            the default SGD is what the tiered sharders train such a table with.
        fused_params: the sharders' fused params (their ``optimizer`` applies to tables without an
            in-backward optimizer, as in torchrec).
        batch_size: per-rank batch size for tables read from a module.
        hbm_reservation: fraction of HBM kept for everything else.
        ddr_reservation: fraction of host DDR kept for everything else.
        dist_type: routing of row-wise tables, carried to the sharders.
        seed: seed of the HYBRID hash split, carried to the sharders.
        cache_policy: eviction policy of CACHING tables, carried to the sharders.
        backend: layout whose bytes are budgeted and priced: ``fbgemm`` (fbgemm's TBE) or ``native``
            (recpipe's own: the CPU kernel and the torch backend). None: a given enumerator's, else ``fbgemm``
            on a ``cuda`` topology, else ``native``; plan ``native`` when a ``cuda`` topology models a CPU run.
        sharding_types: the sharding types to choose from (``table_wise``, ``row_wise``, ``column_wise``, in
            any order, or one comma-separated string).
        communication: constants of the communication model: ``"gloo_cpu"`` (measured for gloo on CPU),
            ``"topology"`` (the topology's bandwidths) or a ``CommConstants``; None: ``gloo_cpu`` on a
            ``cpu`` topology, else ``topology``.

    Raises:
        ValueError: an argument the planner cannot plan with, named (``PlannerInputError`` for pins).
    """

    def __init__(
        self,
        topology: Topology,
        *,
        enumerator: Optional[PlacementEnumerator] = None,
        partitioner: Optional[PlacementPartitioner] = None,
        cost_model: Union[str, CostModel, None] = None,
        proposer: Optional[PlacementProposer] = None,
        load_factors: Sequence[float] = DEFAULT_LOAD_FACTORS,
        bins: Optional[Tuple[int, int]] = None,
        constraints: Optional[Mapping[str, PlacementConstraints]] = None,
        optimizer: Union[FusedOptimizerKind, str] = FusedOptimizerKind.SGD,
        fused_params: Optional[Mapping[str, Any]] = None,
        batch_size: int = BATCH_SIZE,
        hbm_reservation: float = DEFAULT_HBM_RESERVATION,
        ddr_reservation: float = DEFAULT_DDR_RESERVATION,
        dist_type: Union[DistType, str] = DistType.HASH_ROUNDROBIN,
        seed: int = 0,
        cache_policy: Union[CachePolicy, str] = CachePolicy.LFU,
        backend: Optional[str] = None,
        sharding_types: Sequence[str] = PLANNED_SHARDING_TYPES,
        communication: Union[str, CommConstants, None] = None,
    ) -> None:
        _check_topology(topology, hbm_reservation, ddr_reservation, batch_size)
        seed = check_int(seed, "seed", -(2**63), 2**63 - 1)
        load_factors = check_load_factors(load_factors)
        stages = {"enumerator": enumerator, "partitioner": partitioner, "proposer": proposer}
        dist = _check_collaborators(bins, constraints, stages, fused_params, dist_type)
        self.topology = topology
        if backend is None:
            backend = getattr(enumerator, "backend", "fbgemm" if topology.compute_device == "cuda" else "native")
        self.backend: str = backend  # checked by the enumerator
        self.cache_policy: CachePolicy = CachePolicy.parse(cache_policy)
        self.proposer: PlacementProposer = proposer if proposer is not None else KnapsackProposer(bins)
        self.partitioner: PlacementPartitioner = (
            partitioner if partitioner is not None else GreedyTableWisePartitioner()
        )
        self.optimizer: FusedOptimizerKind = FusedOptimizerKind.parse(optimizer)
        self.fused_params: Optional[Mapping[str, Any]] = dict(fused_params) if fused_params is not None else None
        self.batch_size = batch_size
        self.hbm_reservation, self.ddr_reservation = hbm_reservation, ddr_reservation
        self.dist_type: DistType = dist
        self.seed = seed
        self._set_enumerator(
            enumerator,
            cost_model=cost_model,
            load_factors=load_factors,
            constraints=constraints,
            sharding_types=sharding_types,
            communication=communication,
        )

    def _set_enumerator(self, enumerator: Optional[PlacementEnumerator], **settings: Any) -> None:
        """Takes ``enumerator`` (refusing the default one's ``settings`` beside it) or builds the default
        ``GridPlacementEnumerator`` from ``settings``; records the cost model, pins, load factors and sharding
        types the plan and its diagnosis quote."""
        self.cost_model: Optional[CostModel]
        self.comm_model: Optional[CommCostModel]
        self.enumerator: PlacementEnumerator
        self.sharding_types: Tuple[str, ...]
        self.constraints: Mapping[str, PlacementConstraints]
        if enumerator is not None:
            check_enumerator_settings(enumerator, self.backend, self.cache_policy, **settings)
            self.enumerator = enumerator
            self.cost_model = getattr(enumerator, "cost_model", None)
            self.comm_model = getattr(enumerator, "comm_model", None)
            self.load_factors = tuple(getattr(enumerator, "load_factors", DEFAULT_LOAD_FACTORS))
            self.constraints = dict(getattr(enumerator, "constraints", None) or {})
            self.sharding_types = tuple(getattr(enumerator, "sharding_types", PLANNED_SHARDING_TYPES))
            return
        topology, cost_model = self.topology, settings["cost_model"]
        self.cost_model = make_cost_model(
            "analytic" if cost_model is None else cost_model,
            topology.hbm_mem_bw,
            topology.hbm_to_ddr_mem_bw,
            self.backend,
            self.cache_policy,
        )
        self.load_factors = tuple(settings["load_factors"])
        self.constraints = dict(settings["constraints"] or {})
        self.comm_model = CommCostModel(_comm_constants(settings["communication"], topology), topology.world_size)
        grid = GridPlacementEnumerator(
            topology.world_size,
            topology.local_world_size,
            self.cost_model,
            self.load_factors,
            self.constraints,
            backend=self.backend,
            cache_policy=self.cache_policy,
            sharding_types=settings["sharding_types"],
            comm_model=self.comm_model,
        )
        self.enumerator, self.sharding_types = grid, grid.sharding_types

    @property
    def hbm_budget(self) -> int:
        """Usable HBM bytes per device."""
        cap = min(d.storage.hbm for d in self.topology.devices)
        return int(cap * (1.0 - self.hbm_reservation))

    @property
    def ddr_budget(self) -> int:
        """Usable host DDR bytes per machine."""
        devs, L = self.topology.devices, self.topology.local_world_size
        per_machine = [sum(d.storage.ddr for d in devs[s : s + L]) for s in range(0, len(devs), L)]
        return int(min(per_machine) * (1.0 - self.ddr_reservation))

    def _tables(self, tables: Union[nn.Module, Sequence[TableSpec]]) -> List[TableSpec]:
        if isinstance(tables, nn.Module):
            specs = tables_from_module(
                tables, optimizer=self.optimizer, fused_params=self.fused_params, batch_size=self.batch_size
            )
            if not specs:
                raise PlacementPlannerError(
                    f"The module to plan ({type(tables).__module__}.{type(tables).__qualname__}) holds no "
                    "EmbeddingBagCollection or EmbeddingCollection: there is no table to place.\n"
                    "Possible solutions:\n"
                    "  1) pass the model that holds the embedding collections (or an EBC / EC itself), "
                    "e.g. PlacementPlanner(topology).plan(model) rather than one of its dense submodules;\n"
                    "  2) plan a list of TableSpec.",
                    PlacementErrorType.INPUT_VALIDATION,
                )
            return specs
        want = "tables must be an EmbeddingBagCollection / EmbeddingCollection (or a model holding them) or a list"
        if isinstance(tables, (TableSpec, str, bytes)) or not hasattr(tables, "__iter__"):
            hint = ": wrap one TableSpec in a list" if isinstance(tables, TableSpec) else "."
            raise ValueError(f"{want} of TableSpec, got {type(tables).__name__}{hint}")
        specs = list(tables)
        for t in specs:
            if not isinstance(t, TableSpec):
                raise ValueError(f"{want} of TableSpec, got an element of type {type(t).__name__}.")
        seen = set()
        for t in specs:
            if t.fqn in seen:
                raise ValueError(f"table {t.fqn!r} appears twice: table names must be unique per module.")
            seen.add(t.fqn)
        return specs

    def plan(self, tables: Union[nn.Module, Sequence[TableSpec]]) -> PlacementPlan:
        """The cheapest plan within both budgets for ``tables``: an EBC / EC (meta device fine), a model
        holding them, or table specs. A module's tables are sized for the optimizer the model fuses into each
        (call ``apply_optimizer_in_backward`` first) and their dtype.

        Raises:
            PlacementPlannerError: no plan fits (with numbered solutions), or the input is unusable (INPUT_VALIDATION).
        """
        specs = self._tables(tables)
        H, D = self.hbm_budget, self.ddr_budget
        if specs and H <= 0:
            raise PlacementPlannerError(
                f"The topology has no HBM budget (compute_device={self.topology.compute_device!r}, "
                f"HBM per device {sized(H)}): every placement keeps at least part of a table in HBM.\n"
                "Possible solutions:\n"
                "  1) build the Topology with compute_device='cuda' and hbm_cap = the fast-tier size per rank "
                "(on CPU the fast tier is a host buffer of that size: plan with backend='native').\n"
                f"  2) lower hbm_reservation (now {self.hbm_reservation}).",
                PlacementErrorType.INPUT_VALIDATION,
            )
        options = checked_options(self.enumerator, self.enumerator.enumerate_arrays(specs), specs)
        dynamic = [(constraint_for(t, self.constraints) or PlacementConstraints()).dynamic for t in specs]
        _check_dynamic_options(self.enumerator, options, specs, dynamic)
        choice, owners = self._solve(specs, options, H, D)
        placements = _placements(specs, options, choice, owners, dynamic)
        plan = PlacementPlan(
            placements=placements,
            world_size=self.topology.world_size,
            local_world_size=self.topology.local_world_size,
            compute_device=self.topology.compute_device,
            hbm_budget_per_rank=H,
            ddr_budget_per_machine=D,
            cost_model=cost_model_name(self.cost_model, self.enumerator),
            dist_type=self.dist_type,
            seed=self.seed,
            cache_policy=self.cache_policy,
            backend=self.backend,
        )
        # A proposer bug must never hand out a plan that breaks a budget.
        if plan.hbm_bytes_per_rank > H or plan.ddr_bytes_per_machine > D:
            raise AssertionError(
                f"proposer returned a plan over budget: HBM {plan.hbm_bytes_per_rank} > {H} or "
                f"DDR {plan.ddr_bytes_per_machine} > {D}"
            )
        return plan

    def _solve(
        self, specs: List[TableSpec], options: OptionArrays, H: int, D: int
    ) -> Tuple[np.ndarray, List[Tuple[int, ...]]]:
        """The knapsack's choice per table and the owner ranks of each table- or column-wise one's shards (empty
        for row-wise).

        An option with a shard larger than a rank's budget is dropped first. Tables the partitioner cannot
        place (the knapsack sees only their share of every rank) take their cheapest option that still fits
        (:meth:`_repair`); if one has none, the knapsack runs again without the owned (table- and column-wise)
        options of those tables, and after ``MAX_PARTITION_REPAIRS`` such runs without any owned option (every
        rank then holds the same shards, so a plan the knapsack finds always fits).
        """
        W, L = self.topology.world_size, self.topology.local_world_size
        cost = options.cost.copy()
        owned = options.sharding >= 1
        cost[owned & (options.owner_bytes > H)] = np.inf
        rows = np.arange(len(specs))
        for attempt in range(MAX_PARTITION_REPAIRS + 1):
            if attempt == MAX_PARTITION_REPAIRS:
                cost[owned] = np.inf
            got = self.proposer.solve(options.hbm_bytes_per_rank, options.ddr_bytes_per_machine, cost, H, D)
            if got is None:
                raise InfeasibilityDiagnosis(self, specs, options, H, D).error()
            choice = checked_choice(self.proposer, got, options, cost, H, D)
            sharding = options.sharding[rows, choice]
            tw = np.flatnonzero(sharding >= 1)
            rw = np.flatnonzero(sharding == 0)
            base = (
                int(options.hbm_bytes_per_rank[rw, choice[rw]].sum()),
                int(options.ddr_bytes_per_machine[rw, choice[rw]].sum()),
            )
            shard_bytes = (options.owner_bytes[tw, choice[tw]], options.owner_slow_bytes[tw, choice[tw]])
            shards = options.shards[tw, choice[tw]]
            got_part = self.partitioner.partition(
                *shard_bytes, options.cost[tw, choice[tw]], base, (H, D), W, L, shards
            )
            part = checked_partition(
                self.partitioner, got_part, [specs[i] for i in tw], shards, shard_bytes, base, (H, D), W, L
            )
            owners: List[Tuple[int, ...]] = [()] * len(specs)
            for i, o in zip(tw.tolist(), part.shard_owners):
                owners[i] = tuple(o)
            unplaced = tw[part.unplaced]
            if not unplaced.size or self._repair(options, cost, choice, owners, unplaced, part, H, D, L):
                return choice, owners
            cost[unplaced] = np.where(owned[unplaced], np.inf, cost[unplaced])
        raise AssertionError("a plan without owned tables needs no partition")  # the last attempt's

    @staticmethod
    def _repair(
        options: OptionArrays,
        cost: np.ndarray,
        choice: np.ndarray,
        owners: List[Tuple[int, ...]],
        unplaced: np.ndarray,
        part: Partition,
        H: int,
        D: int,
        L: int,
    ) -> bool:
        """Gives each unplaced table (largest first) its cheapest option that still fits: a table- or
        column-wise one whose shards ranks whose fast tier (and machine's slow tier) hold them, or a row-wise
        one whose shard every rank and machine holds. Updates ``choice`` and ``owners``; True if every table
        found one."""
        rank_bytes, machine_slow = part.rank_bytes.copy(), part.machine_slow_bytes.copy()
        for i in sorted(unplaced.tolist(), key=lambda k: -int(options.owner_bytes[k, choice[k]])):
            best: Tuple[float, int, Tuple[int, ...]] = (np.inf, -1, ())  # (cost, option, owners)
            for j in np.flatnonzero(np.isfinite(cost[i])).tolist():
                if options.sharding[i, j] == 0:
                    fits = (
                        rank_bytes.max() + options.hbm_bytes_per_rank[i, j] <= H
                        and machine_slow.max() + options.ddr_bytes_per_machine[i, j] <= D
                    )
                    ranks: Tuple[int, ...] = ()
                else:  # the lowest ranks that hold its shards (a load rising with the rank), on copies
                    got = place_shards(
                        rank_bytes.copy(),
                        machine_slow.copy(),
                        np.arange(rank_bytes.size, dtype=np.float64),
                        int(options.owner_bytes[i, j]),
                        int(options.owner_slow_bytes[i, j]),
                        int(options.shards[i, j]),
                        0.0,
                        (H, D),
                        L,
                    )
                    fits, ranks = got is not None, got or ()
                if fits and cost[i, j] < best[0]:
                    best = (float(cost[i, j]), int(j), ranks)
            _, j, ranks = best
            if j < 0:
                return False
            choice[i], owners[i] = j, ranks
            if not ranks:
                rank_bytes += options.hbm_bytes_per_rank[i, j]
                machine_slow += options.ddr_bytes_per_machine[i, j]
            for r in ranks:
                rank_bytes[r] += options.owner_bytes[i, j]
                machine_slow[r // L] += options.owner_slow_bytes[i, j]
        return True


def _check_dynamic_options(
    enumerator: PlacementEnumerator,
    options: OptionArrays,
    specs: Sequence[TableSpec],
    dynamic: Sequence[Optional[DynamicTableOptions]],
) -> None:
    """Refuses an enumerator that offers a dynamic table torchrec's FUSED table (a dynamic table is a recpipe
    tiered table, row- or table-wise)."""
    for i, (t, d) in enumerate(zip(specs, dynamic)):
        if d is not None and bool((options.fused[i] & (options.modes[i] >= 0)).any()):
            raise ValueError(
                f"enumerator {type(enumerator).__name__}.enumerate_arrays offers dynamic table {t.fqn!r} torchrec's "
                "FUSED table: a dynamic table is a recpipe tiered table, row- or table-wise; offer it tiered options "
                "only (GridPlacementEnumerator does)."
            )


def _placements(
    specs: List[TableSpec],
    options: OptionArrays,
    choice: np.ndarray,
    owners: List[Tuple[int, ...]],
    dynamic: Sequence[Optional[DynamicTableOptions]],
) -> List[TablePlacement]:
    """Each table's placement from its chosen option, with the owner rank of a table-wise one (the ranks of a
    column-wise one's shards), its dynamic options (``dynamic[i]``, None for a static table) and why it won: the
    next cheapest option when it is the cheapest, else the cheaper one the budgets ruled out."""
    if not specs:
        return []
    rows = np.arange(len(specs))
    cost = np.where(options.modes >= 0, options.cost, np.inf)
    best = np.argmin(cost, axis=1)
    others = cost.copy()
    others[rows, choice] = np.inf
    runner_up = np.argmin(others, axis=1)
    sharding = options.sharding[rows, choice]
    tw = sharding >= 1
    # a table-wise table's bytes are all on its owner and its machine; a column-wise one's shard on each owner
    hbm = np.where(tw, options.owner_bytes[rows, choice], options.hbm_bytes_per_rank[rows, choice])
    hbm_machine = np.where(sharding == 1, hbm, options.hbm_bytes_per_machine[rows, choice])
    ddr = np.where(tw, options.owner_slow_bytes[rows, choice], options.ddr_bytes_per_rank[rows, choice])
    ddr_machine = np.where(tw, ddr, options.ddr_bytes_per_machine[rows, choice])
    out = []
    for i, t in enumerate(specs):
        j = int(choice[i])
        if best[i] != j:
            reason = (
                f"budget: {_option_text(options, i, int(best[i]))} models {cost[i, j] - cost[i, best[i]]:.3g} ms less"
            )
        elif np.isfinite(others[i, runner_up[i]]):
            k = int(runner_up[i])
            reason = f"cheapest: next {_option_text(options, i, k)} +{cost[i, k] - cost[i, j]:.3g} ms"
        else:
            reason = "only option"
        out.append(
            TablePlacement(
                table=t.name,
                module_path=t.module_path,
                rows=t.rows,
                dim=t.dim,
                mode=MODE_OF_CODE[int(options.modes[i, j])],
                cache_load_factor=float(options.load_factors[i, j]),
                hbm_bytes_per_rank=int(hbm[i]),
                ddr_bytes_per_rank=int(ddr[i]),
                hbm_bytes_per_machine=int(hbm_machine[i]),
                ddr_bytes_per_machine=int(ddr_machine[i]),
                cost=float(options.cost[i, j]),
                optimizer=FusedOptimizerKind.parse(t.optimizer),
                dtype=resolve_dtype(t.dtype),  # the torch.dtype TableSpec resolved it to
                sharding_type=SHARDING_OF_CODE[int(options.sharding[i, j])],
                fused=bool(options.fused[i, j]),
                rank=owners[i][0] if sharding[i] == 1 else None,
                ranks=owners[i] if sharding[i] == 2 else None,
                lookup_cost=float(options.lookup_cost[i, j]),
                comm_cost=float(options.comm_cost[i, j]),
                reason=reason,
                dynamic=dynamic[i],
            )
        )
    return out


def _option_text(options: OptionArrays, i: int, j: int) -> str:
    """Option ``j`` of table ``i`` in words (:func:`option_text`)."""
    return option_text(
        PlacementOption(
            MODE_OF_CODE[int(options.modes[i, j])],
            float(options.load_factors[i, j]),
            0,
            0,
            0,
            0,
            sharding_type=SHARDING_OF_CODE[int(options.sharding[i, j])],
            fused=bool(options.fused[i, j]),
        )
    )


def _comm_constants(communication: Union[str, CommConstants, None], topology: Topology) -> CommConstants:
    """The communication constants ``communication`` names (see ``PlacementPlanner``)."""
    if communication is None:
        communication = "gloo_cpu" if topology.compute_device == "cpu" else "topology"
    if isinstance(communication, CommConstants):
        return communication
    if communication == "topology":
        return topology_constants(topology)
    if isinstance(communication, str) and communication in COMMUNICATION_CONSTANTS:
        return COMMUNICATION_CONSTANTS[communication]
    raise ValueError(
        f"communication must be one of {['topology', *COMMUNICATION_CONSTANTS]}, a CommConstants or None, "
        f"got {communication!r}."
    )


# How :func:`_check_topology` names a torchrec Topology's fields in messages.
_TOPOLOGY_NAMES: Tuple[str, str, str, str] = (
    "Topology world_size",
    "Topology local_world_size",
    "Topology hbm_cap (HBM per device)",
    "Topology ddr_cap (DDR per rank)",
)


def _check_topology(topology: Topology, hbm_reservation: float, ddr_reservation: float, batch_size: int) -> None:
    """Refuses a topology, reservations or batch size :class:`PlacementPlanner` cannot plan with."""
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a torchrec Topology, got {type(topology).__name__}.")
    hbm_cap = min((d.storage.hbm for d in topology.devices), default=0)
    ddr_cap = min((d.storage.ddr for d in topology.devices), default=0)
    check_topology_args(topology.world_size, topology.local_world_size, hbm_cap, ddr_cap, names=_TOPOLOGY_NAMES)
    for name, frac in (("hbm_reservation", hbm_reservation), ("ddr_reservation", ddr_reservation)):
        if isinstance(frac, bool) or not isinstance(frac, numbers.Real) or not 0.0 <= frac < 1.0:
            raise ValueError(f"{name} must be a number in [0, 1), got {frac!r}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int (samples per rank), got {batch_size!r}.")


def _check_collaborators(
    bins: Optional[Tuple[int, int]],
    constraints: Optional[Mapping[str, PlacementConstraints]],
    stages: Mapping[str, Any],
    fused_params: Optional[Mapping[str, Any]],
    dist_type: Union[DistType, str],
) -> DistType:
    """Refuses pins, stages (:func:`check_stages`) and routing :class:`PlacementPlanner` cannot plan with;
    returns ``dist_type``."""
    for name, value in (("constraints", constraints), ("fused_params", fused_params)):
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(f"{name} must be a dict (or None), got {type(value).__name__} {value!r}.")
    check_stages(stages, bins)
    dist = DistType.parse(dist_type)
    if dist not in ROUTED_DIST_TYPES:
        raise ValueError(
            f"dist_type must be 'hash_roundrobin' or 'roundrobin' (the routings whose shard sizes "
            f"placement.local_rows describes), got {dist_type!r}."
        )
    return dist


__all__ = [
    "COMMUNICATION_CONSTANTS",
    "DEFAULT_DDR_RESERVATION",
    "DEFAULT_HBM_RESERVATION",
    "MAX_PARTITION_REPAIRS",
    "PlacementPlanner",
]
