"""PlacementPlanner: topology budgets -> options -> proposer -> PlacementPlan."""

from __future__ import annotations

import math
import numbers
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from torch import nn
from torchrec.distributed.planner.constants import BATCH_SIZE, POOLING_FACTOR
from torchrec.distributed.planner.types import Topology
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
from torchrec.modules.embedding_configs import data_type_to_dtype
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from recpipe.pipeline.routing.ops import check_int
from recpipe.pipeline.placement import (
    ROUTED_DIST_TYPES,
    CachePolicy,
    DistType,
    FusedOptimizer,
    check_load_factors,
)
from recpipe.planner.cost_models import CostModel, make_cost_model
from recpipe.planner.enumerators import GridPlacementEnumerator, OptionArrays
from recpipe.planner.proposers import DynamicProgrammingProposer, Proposer
from recpipe.planner.types import (
    DEFAULT_LOAD_FACTORS,
    PlacementConstraints,
    PlacementOption,
    PlacementPlan,
    PlannerError,
    PlannerErrorType,
    TablePlacement,
    TableSpec,
    check_topology_args,
    format_bytes,
)

# Fraction of each device's HBM kept for dense parameters, activations and
# input buffers: TorchEasyRec PR #508 / tzrec default ``storage_reserve_percent``
# (used with torchrec's HeuristicalStorageReservation). Dimensionless.
DEFAULT_HBM_RESERVATION: float = 0.15
# Fraction of host DDR reserved: torchrec's percentage reservations touch HBM
# only, so the seed reserves no DDR. Dimensionless.
DEFAULT_DDR_RESERVATION: float = 0.0


def _optimizer_error(table: str, message: str) -> PlannerError:
    return PlannerError(
        f"Table {table!r}: {message}\n"
        "Possible solutions:\n"
        "  1) fuse one of SGD, RowWiseAdagrad or Adam (the optimizers tiered tables run) into the table's backward: "
        "apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, ebc.parameters(), {'lr': 0.01});\n"
        "  2) plan a list of TableSpec with the optimizer the table will train with.",
        PlannerErrorType.INPUT_VALIDATION,
    )


def table_fused_optimizer(
    param: Optional[nn.Parameter],
    table: str,
    fused_params: Optional[Mapping[str, Any]] = None,
) -> Optional[FusedOptimizer]:
    """The fused optimizer torchrec's sharders will give a table, read as they read it.

    torchrec's ``apply_optimizer_in_backward`` stores the optimizer on the weight
    (``param._optimizer_classes`` / ``param._optimizer_kwargs``); the sharder turns
    the class into an fbgemm ``EmbOptimType`` (``optimizer_type_to_emb_opt_type``,
    unless the kwargs name an ``optimizer``) and merges it over its own
    ``fused_params``, so the parameter's optimizer wins over the sharder's.

    Args:
        param (Optional[nn.Parameter]): the table's weight (meta tensors are fine).
        table (str): table name, for errors.
        fused_params (Optional[Mapping[str, Any]]): the sharders' fused params.

    Returns:
        Optional[FusedOptimizer]: the optimizer, or None when neither names one.

    Raises:
        PlannerError: the optimizer has no fused (fbgemm) equivalent the byte
            formulas know, or the weight carries more than one.
    """
    classes = list(getattr(param, "_optimizer_classes", None) or [])
    kwargs = list(getattr(param, "_optimizer_kwargs", None) or [{}])
    if len(classes) > 1:
        raise _optimizer_error(
            table, f"its weight carries {len(classes)} in-backward optimizers {[c.__name__ for c in classes]}; "
            "torchrec's sharders fuse exactly one."
        )
    emb_opt: Any = None
    if classes:
        emb_opt = kwargs[0].get("optimizer") if kwargs else None
        if emb_opt is None:
            try:
                emb_opt = optimizer_type_to_emb_opt_type(classes[0])
            except ValueError:
                raise _optimizer_error(
                    table, f"its in-backward optimizer {classes[0].__module__}.{classes[0].__qualname__} has no "
                    "fused (fbgemm EmbOptimType) equivalent."
                ) from None
    elif fused_params is not None and fused_params.get("optimizer") is not None:
        emb_opt = fused_params["optimizer"]
    if emb_opt is None:
        return None
    try:
        return FusedOptimizer.parse(emb_opt)
    except ValueError as e:
        raise _optimizer_error(table, f"its fused optimizer {emb_opt} cannot be sized: {e}") from None


def tables_from_module(
    module: nn.Module,
    *,
    optimizer: Union[FusedOptimizer, str] = FusedOptimizer.SGD,
    fused_params: Optional[Mapping[str, Any]] = None,
    batch_size: int = BATCH_SIZE,
    pooling_factor: float = POOLING_FACTOR,
) -> List[TableSpec]:
    """Table specs of every EmbeddingBagCollection / EmbeddingCollection in ``module``.

    Works on meta-device modules (only configs and parameter attributes are read).
    Each table's optimizer is the one the model fuses into it
    (:func:`table_fused_optimizer`: ``apply_optimizer_in_backward``, else the
    sharders' ``fused_params``), else ``optimizer``.

    Args:
        module (nn.Module): a model, or an EBC / EC itself.
        optimizer (FusedOptimizer | str): fused optimizer of tables the model gives none
            (default SGD: what the tiered sharders train such a table with, fbgemm's
            ``EXACT_SGD`` default).
        fused_params (Optional[Mapping[str, Any]]): the sharders' fused params
            (torchrec style: ``optimizer`` an ``EmbOptimType``).
        batch_size (int): per-rank batch size (torchrec ``BATCH_SIZE`` = 512 default).
        pooling_factor (float): ids per feature per sample (torchrec ``POOLING_FACTOR`` = 1).

    Returns:
        List[TableSpec]: one per table, ``lookups_per_step = batch_size x
        pooling_factor x features of the table``.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"module must be a torch.nn.Module (a model, or an EBC / EC), got {type(module).__name__}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int (samples per rank), got {batch_size!r}.")
    if isinstance(pooling_factor, bool) or not isinstance(pooling_factor, numbers.Real) \
            or not 0 <= pooling_factor < math.inf:
        raise ValueError(f"pooling_factor must be a finite number >= 0 (ids per feature per sample), got "
                         f"{pooling_factor!r}.")
    if fused_params is not None and not isinstance(fused_params, Mapping):
        raise ValueError(f"fused_params must be a dict (or None), got {type(fused_params).__name__}.")
    fallback = FusedOptimizer.parse(optimizer)
    specs: List[TableSpec] = []
    for path, sub in module.named_modules():
        if isinstance(sub, EmbeddingBagCollection):
            configs = sub.embedding_bag_configs()
            holders = sub.embedding_bags
        elif isinstance(sub, EmbeddingCollection):
            configs = sub.embedding_configs()
            holders = sub.embeddings
        else:
            continue
        for cfg in configs:
            holder = holders[cfg.name] if cfg.name in holders else None
            weight = getattr(holder, "weight", None)
            fqn = f"{path}.{cfg.name}" if path else cfg.name
            fused = table_fused_optimizer(weight, fqn, fused_params)
            specs.append(
                TableSpec(
                    name=cfg.name,
                    rows=int(cfg.num_embeddings),
                    dim=int(cfg.embedding_dim),
                    dtype=data_type_to_dtype(cfg.data_type),
                    optimizer=fused if fused is not None else fallback,
                    lookups_per_step=float(batch_size * pooling_factor * max(len(cfg.feature_names), 1)),
                    module_path=path,
                    feature_names=tuple(cfg.feature_names),
                )
            )
    return specs


class PlacementPlanner:
    """Chooses HYBRID / CACHING and a cache load factor for every table.

    Budgets: per device HBM = ``min(device hbm) x (1 - hbm_reservation)``; per
    machine DDR = ``min over machines of the sum of its ranks' ddr`` (torchrec
    ``Topology.ddr_cap`` is per rank) ``x (1 - ddr_reservation)``. Tables are
    sharded row-wise over all ranks; rank 0 / machine 0 carry the largest shards
    and are the ones checked.

    Args:
        topology (Topology): torchrec topology (``compute_device="cuda"``; dry runs
            on a CPU machine are fine).
        cost_model (str | CostModel): ``"analytic"`` (default), ``"empirical"`` or
            an object implementing ``CostModel``.
        load_factors (Sequence[float]): x grid (default 0.1 ... 1.0).
        bins (Optional[Tuple[int, int]]): DP grid (HBM bins, DDR bins) of the default
            proposer; None sizes it. Refused together with ``proposer`` (give that
            proposer its own bins).
        constraints (Optional[Mapping[str, PlacementConstraints]]): pins per table
            name or FQN.
        proposer (Optional[Proposer]): defaults to ``DynamicProgrammingProposer(bins)``;
            not together with ``bins``.
        optimizer (FusedOptimizer | str): fused optimizer of module tables whose
            model names none (neither ``apply_optimizer_in_backward`` nor
            ``fused_params``); a module's own optimizers always win. Default SGD:
            the tiered sharders train such a table with fbgemm's ``EXACT_SGD``
            default, so another value only fits sharders given that optimizer.
        fused_params (Optional[Mapping[str, Any]]): the sharders' fused params
            (torchrec style; their ``optimizer`` applies to tables without an
            in-backward optimizer, as in torchrec's sharders).
        batch_size (int): per-rank batch size for tables read from a module.
        hbm_reservation (float): fraction of HBM kept for everything else (0.15).
        ddr_reservation (float): fraction of host DDR kept (0.0).
        dist_type (DistType | str): id routing carried to the sharders (``hash_roundrobin``).
        seed (int): hash seed carried to the sharders.
        cache_policy (CachePolicy | str): eviction policy of CACHING tables carried to the sharders.
        backend (Optional[str]): the tiered tables' backend whose bytes are budgeted and priced:
            ``fbgemm`` (fbgemm's TBE, the default on CUDA: its UVM cache, and row-wise
            optimizer state in HBM for every row) or ``native`` (recpipe's own layout:
            the CPU kernel and the torch backend). None: ``fbgemm`` for a ``cuda``
            topology, else ``native``. Plan with ``native`` when a ``cuda`` topology
            models a CPU run (the fast tier as a host buffer).

    Example::

        topo = make_topology(world_size=16, local_world_size=8,
                             hbm_cap=80 * 1024**3, ddr_cap=128 * 1024**3)  # ddr_cap per rank
        plan = PlacementPlanner(topo).plan(ebc)
        print(plan.report()); sharding_plan = plan.to_sharding_plan()
    """

    def __init__(
        self,
        topology: Topology,
        *,
        cost_model: Union[str, CostModel] = "analytic",
        load_factors: Sequence[float] = DEFAULT_LOAD_FACTORS,
        bins: Optional[Tuple[int, int]] = None,
        constraints: Optional[Mapping[str, PlacementConstraints]] = None,
        proposer: Optional[Proposer] = None,
        optimizer: Union[FusedOptimizer, str] = FusedOptimizer.SGD,
        fused_params: Optional[Mapping[str, Any]] = None,
        batch_size: int = BATCH_SIZE,
        hbm_reservation: float = DEFAULT_HBM_RESERVATION,
        ddr_reservation: float = DEFAULT_DDR_RESERVATION,
        dist_type: Union[DistType, str] = DistType.HASH_ROUNDROBIN,
        seed: int = 0,
        cache_policy: Union[CachePolicy, str] = CachePolicy.LFU,
        backend: Optional[str] = None,
    ) -> None:
        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be a torchrec Topology, got {type(topology).__name__}.")
        devices = topology.devices
        check_topology_args(
            topology.world_size,
            topology.local_world_size,
            min((d.storage.hbm for d in devices), default=0),
            min((d.storage.ddr for d in devices), default=0),
            names=("Topology world_size", "Topology local_world_size", "Topology hbm_cap (HBM per device)",
                   "Topology ddr_cap (DDR per rank)"),
        )
        for name, frac in (("hbm_reservation", hbm_reservation), ("ddr_reservation", ddr_reservation)):
            if isinstance(frac, bool) or not isinstance(frac, numbers.Real) or not 0.0 <= frac < 1.0:
                raise ValueError(f"{name} must be a number in [0, 1), got {frac!r}.")
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int (samples per rank), got {batch_size!r}.")
        seed = check_int(seed, "seed", -(2**63), 2**63 - 1)
        load_factors = check_load_factors(load_factors)
        for name, value in (("constraints", constraints), ("fused_params", fused_params)):
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"{name} must be a dict (or None), got {type(value).__name__} {value!r}.")
        if proposer is not None and (isinstance(proposer, type) or not callable(getattr(proposer, "solve", None))):
            raise ValueError(
                f"proposer must be a Proposer instance (with solve(...)), got {type(proposer).__name__} "
                f"{proposer!r}: e.g. DynamicProgrammingProposer() or BruteForceProposer()."
            )
        if proposer is not None and bins is not None:
            # bins sizes the default proposer only: with a proposer of one's own it did nothing
            raise ValueError(
                f"bins={bins!r} and proposer={type(proposer).__name__}(...) were both given, but bins only sizes the "
                "default DynamicProgrammingProposer's grid and a given proposer ignores it: drop bins, or pass "
                f"proposer=DynamicProgrammingProposer(bins={bins!r}) instead of both."
            )
        dist = DistType.parse(dist_type)
        if dist not in ROUTED_DIST_TYPES:
            raise ValueError(
                f"dist_type must be 'hash_roundrobin' or 'roundrobin' (the routings whose shard sizes "
                f"placement.local_rows describes), got {dist_type!r}."
            )
        self.topology = topology
        if backend is None:
            backend = "fbgemm" if topology.compute_device == "cuda" else "native"
        self.backend: str = backend  # checked by the enumerator
        self.cost_model: CostModel = make_cost_model(
            cost_model, topology.hbm_mem_bw, topology.hbm_to_ddr_mem_bw, backend
        )
        self.load_factors = tuple(load_factors)
        self.constraints = dict(constraints or {})
        self.proposer: Proposer = proposer if proposer is not None else DynamicProgrammingProposer(bins)
        self.optimizer: FusedOptimizer = FusedOptimizer.parse(optimizer)
        self.fused_params: Optional[Mapping[str, Any]] = dict(fused_params) if fused_params is not None else None
        self.batch_size = batch_size
        self.hbm_reservation = hbm_reservation
        self.ddr_reservation = ddr_reservation
        self.dist_type: DistType = dist
        self.seed = seed
        self.cache_policy: CachePolicy = CachePolicy.parse(cache_policy)
        self.enumerator = GridPlacementEnumerator(
            topology.world_size,
            topology.local_world_size,
            self.cost_model,
            self.load_factors,
            self.constraints,
            backend=self.backend,
            cache_policy=self.cache_policy,
        )

    # ---- budgets --------------------------------------------------------------
    @property
    def hbm_budget(self) -> int:
        """Usable HBM bytes per device."""
        cap = min(d.storage.hbm for d in self.topology.devices)
        return int(cap * (1.0 - self.hbm_reservation))

    @property
    def ddr_budget(self) -> int:
        """Usable host DDR bytes per machine."""
        devs = self.topology.devices
        L = self.topology.local_world_size
        per_machine = [sum(d.storage.ddr for d in devs[s : s + L]) for s in range(0, len(devs), L)]
        return int(min(per_machine) * (1.0 - self.ddr_reservation))

    # ---- planning -------------------------------------------------------------
    def _tables(self, tables: Union[nn.Module, Sequence[TableSpec]]) -> List[TableSpec]:
        if isinstance(tables, nn.Module):
            specs = tables_from_module(
                tables, optimizer=self.optimizer, fused_params=self.fused_params, batch_size=self.batch_size
            )
            if not specs:
                raise PlannerError(
                    f"The module to plan ({type(tables).__module__}.{type(tables).__qualname__}) holds no "
                    "EmbeddingBagCollection or EmbeddingCollection: there is no table to place.\n"
                    "Possible solutions:\n"
                    "  1) pass the model that holds the embedding collections (or an EBC / EC itself), "
                    "e.g. PlacementPlanner(topology).plan(model) rather than one of its dense submodules;\n"
                    "  2) plan a list of TableSpec.",
                    PlannerErrorType.INPUT_VALIDATION,
                )
            return specs
        if isinstance(tables, (TableSpec, str, bytes)) or not hasattr(tables, "__iter__"):
            raise ValueError(
                f"tables must be an EmbeddingBagCollection / EmbeddingCollection (or a model holding them) or a "
                f"list of TableSpec, got {type(tables).__name__}" + (": wrap one TableSpec in a list"
                                                                    if isinstance(tables, TableSpec) else ".")
            )
        specs = list(tables)
        for t in specs:
            if not isinstance(t, TableSpec):
                raise ValueError(
                    f"tables must be an EmbeddingBagCollection / EmbeddingCollection (or a model holding "
                    f"them) or a list of TableSpec, got an element of type {type(t).__name__}."
                )
        seen = set()
        for t in specs:
            if t.fqn in seen:
                raise ValueError(f"table {t.fqn!r} appears twice: table names must be unique per module.")
            seen.add(t.fqn)
        return specs

    def plan(self, tables: Union[nn.Module, Sequence[TableSpec]]) -> PlacementPlan:
        """Plan every table.

        Args:
            tables (nn.Module | Sequence[TableSpec]): an EBC / EC (meta device is
                fine), a model holding them, or table specs. A module's tables are
                sized for the optimizer the model fuses into each (call
                ``apply_optimizer_in_backward`` before planning) and their dtype.

        Returns:
            PlacementPlan: the cheapest plan found within both budgets.

        Raises:
            PlannerError: no plan fits (the message lists numbered solutions), or the
                input holds no table (a module without an EBC / EC), or constraints are
                malformed or ambiguous (INPUT_VALIDATION).
        """
        specs = self._tables(tables)
        H, D = self.hbm_budget, self.ddr_budget
        if specs and H <= 0:
            raise PlannerError(
                f"The topology has no HBM budget (compute_device={self.topology.compute_device!r}, "
                f"HBM per device {_sized(H)}): every placement keeps at least part of a table in HBM.\n"
                "Possible solutions:\n"
                "  1) build the Topology with compute_device='cuda' and hbm_cap = the fast-tier size per rank "
                "(on CPU the fast tier is a host buffer of that size: plan with backend='native').\n"
                f"  2) lower hbm_reservation (now {self.hbm_reservation}).",
                PlannerErrorType.INPUT_VALIDATION,
            )
        options = self.enumerator.enumerate_arrays(specs)
        hbm, ddr, cost = options.hbm_bytes_per_rank, options.ddr_bytes_per_machine, options.cost
        choice = self.proposer.solve(hbm, ddr, cost, H, D)
        if choice is None:
            raise self._infeasible(specs, options, hbm, ddr, cost, H, D)
        placements = []
        for i, (t, j) in enumerate(zip(specs, choice)):
            o: PlacementOption = options.option(i, int(j))
            placements.append(
                TablePlacement(
                    table=t.name,
                    module_path=t.module_path,
                    rows=t.rows,
                    dim=t.dim,
                    mode=o.mode,
                    cache_load_factor=o.cache_load_factor,
                    hbm_bytes_per_rank=o.hbm_bytes_per_rank,
                    ddr_bytes_per_rank=o.ddr_bytes_per_rank,
                    hbm_bytes_per_machine=o.hbm_bytes_per_machine,
                    ddr_bytes_per_machine=o.ddr_bytes_per_machine,
                    cost=o.cost,
                    optimizer=FusedOptimizer.parse(t.optimizer),
                    dtype=t.dtype,  # type: ignore[arg-type]  # TableSpec normalizes it to a torch.dtype
                )
            )
        plan = PlacementPlan(
            placements=placements,
            world_size=self.topology.world_size,
            local_world_size=self.topology.local_world_size,
            compute_device=self.topology.compute_device,
            hbm_budget_per_rank=H,
            ddr_budget_per_machine=D,
            cost_model=getattr(self.cost_model, "name", type(self.cost_model).__name__),
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

    def _infeasible(
        self,
        specs: Sequence[TableSpec],
        options: OptionArrays,
        hbm: np.ndarray,
        ddr: np.ndarray,
        cost: np.ndarray,
        H: int,
        D: int,
    ) -> PlannerError:
        valid = np.isfinite(cost)
        hb = np.where(valid, hbm, np.iinfo(np.int64).max)
        db = np.where(valid, ddr, np.iinfo(np.int64).max)
        min_h_table = hb.min(axis=1)
        min_d_table = db.min(axis=1)
        min_h, min_d = int(min_h_table.sum()), int(min_d_table.sum())
        W, L = self.topology.world_size, self.topology.local_world_size
        budgets = (
            f"Budgets: HBM {_sized(H)} per device = hbm_cap x (1 - {self.hbm_reservation}); "
            f"DDR {_sized(D)} per machine = ddr_cap x local_world_size {L} x "
            f"(1 - {self.ddr_reservation}); world_size {W}."
        )
        # The least DDR that goes with the least HBM: at HBM budget min_h only each table's
        # lowest-HBM options fit (any other raises the sum), so the plan of those with the
        # least DDR is the only one left; and the same with HBM and DDR swapped.
        big = np.iinfo(np.int64).max
        lh_h, ld_d = min_h, min_d
        lh_d = int(np.where(valid & (hbm == min_h_table[:, None]), ddr, big).min(axis=1).sum())
        ld_h = int(np.where(valid & (ddr == min_d_table[:, None]), hbm, big).min(axis=1).sum())
        fits_alone = valid & (hbm <= H) & (ddr <= D)
        lonely = [i for i in range(len(specs)) if not fits_alone[i].any()]
        if lonely:
            i = lonely[0]
            t = specs[i]
            pinned = t.fqn in self.constraints or t.name in self.constraints
            kind = PlannerErrorType.STRICT_CONSTRAINTS if pinned else PlannerErrorType.TABLE_DOES_NOT_FIT
            # The table's smallest-HBM and smallest-DDR options, each with the budgets it exceeds.
            sols = [self._raise_for(options.option(i, j), H, D) for j in dict.fromkeys(
                (int(np.argmin(hb[i])), int(np.argmin(db[i]))))]
            if len(specs) > 1 and bool(valid.any(axis=1).all()):
                # the raises above make this table fit alone; the other tables may need more:
                # name the budgets of one plan of every table, so following one line is enough
                raises = ([f"the HBM per device (hbm_cap) to at least {self._hbm_cap_for(lh_h)}"] if lh_h > H else [])
                raises += ([f"the DDR per machine to at least {self._ddr_cap_for(lh_d)}"] if lh_d > D else [])
                sols.append(
                    f"for all {len(specs)} tables together, raise {' and '.join(raises)}: with each table at its "
                    f"lowest-HBM option the model needs {_sized(lh_h)} of HBM per rank and {_sized(lh_d)} of DDR per "
                    "machine (the raises above are for this table alone)"
                )
            sols.append(f"shard over more ranks (world_size now {W}): per-rank bytes shrink as 1/world_size")
            if pinned:
                sols.insert(0, f"relax the constraints pinned on table {t.fqn!r} ({self.constraints.get(t.fqn) or self.constraints.get(t.name)})")
            else:
                sols.append(f"add smaller load factors than {min(self.load_factors)} to load_factors")
            return PlannerError(
                f"Table {t.fqn!r} ({t.rows} rows x {t.dim}, {t.optimizer}) does not fit anywhere: no "
                f"option fits HBM {_rounded(H)} per device and DDR {_rounded(D)} per machine even alone "
                f"({len(lonely)} table(s) like this: {[specs[k].fqn for k in lonely][:10]}).\n{budgets}\n"
                "Possible solutions:\n" + "\n".join(f"  {k + 1}) {s}" for k, s in enumerate(sols)),
                kind,
            )
        need_h, need_d = min_h > H, min_d > D
        if need_h or need_d:
            kind = PlannerErrorType.INSUFFICIENT_HBM if need_h else PlannerErrorType.INSUFFICIENT_DDR
            # The other budget may fall short too once this one is raised: name it, so the
            # listed raises together make the plan fit.
            short_d = need_h and lh_d > D
            short_h = need_d and not need_h and ld_h > H
            sols = []
            if need_h:
                sols.append(
                    f"raise HBM per device (hbm_cap) to at least {self._hbm_cap_for(min_h)}: the model needs at "
                    f"least {_sized(min_h)} of HBM per rank at the smallest load factors, the "
                    f"budget is {_sized(H)}"
                )
            if short_d:
                other = (
                    f" (with more HBM it needs less DDR: at least {_sized(min_d)} per machine, with hbm_cap "
                    f"at least {self._hbm_cap_for(ld_h)})" if lh_d > min_d else ""
                )
                sols.append(
                    f"together with 1), raise host DDR per machine to at least {self._ddr_cap_for(lh_d)}: with "
                    f"HBM raised to that least, the model needs {_sized(lh_d)} of DDR per machine (each table at its "
                    f"lowest-HBM option), the budget is {_sized(D)}{other}"
                )
            if need_h:
                sols.append(f"lower hbm_reservation (now {self.hbm_reservation}) or add smaller load_factors")
            if need_d and not need_h:
                sols.append(
                    f"raise host DDR per machine to at least {self._ddr_cap_for(min_d)}: the model needs at least "
                    f"{_sized(min_d)} of DDR per machine, the budget is {_sized(D)}"
                )
            if short_h:
                sols.append(
                    f"together with 1), raise HBM per device (hbm_cap) to at least {self._hbm_cap_for(ld_h)}: with "
                    f"DDR raised to that least, the model needs {_sized(ld_h)} of HBM per rank (each table at its lowest-DDR "
                    f"option), the budget is {_sized(H)}"
                )
            sols.append(f"use more ranks (world_size now {W}) or fewer ranks per machine (local_world_size now {L})")
            both = (need_h and need_d) or short_d or short_h
            return PlannerError(
                f"Insufficient {'HBM' if need_h else 'DDR'}{(' and DDR' if need_h else ' and HBM') if both else ''} "
                f"for {len(specs)} tables.\n{budgets}\nPossible solutions:\n"
                + "\n".join(f"  {k + 1}) {s}" for k, s in enumerate(sols)),
                kind,
            )
        # Each budget alone can be met, but not both at once. For each budget, quote the least
        # value with which this planner plans while the other budget stays as it is (a larger
        # HBM budget than the lowest-HBM plan's leaves room for plans with less DDR, and the
        # other way round), found by bisection on the proposer: it plans at the value quoted
        # and not one byte below. The grid hint below reads the bins of the failed solve.
        nh, nd = getattr(self.proposer, "last_bins", (0, 0))
        # the proposer's diagnostics (last_bins, ...) keep describing the failed solve
        kept = {k: v for k, v in vars(self.proposer).items() if k.startswith("last_")} \
            if hasattr(self.proposer, "__dict__") else {}
        least_d = self._least_budget(hbm, ddr, cost, H, D, lh_d, ddr_axis=True)
        least_h = self._least_budget(hbm, ddr, cost, H, D, ld_h, ddr_axis=False)
        for k, v in kept.items():
            setattr(self.proposer, k, v)
        if least_d is not None:
            sol_d = (f"raise DDR per machine to at least {self._ddr_cap_for(least_d)}: with HBM kept at its budget, "
                     f"{_sized(H)} per device, the planner finds a plan from {_sized(least_d)} of DDR per machine on, "
                     "not below")
        else:  # the proposer missed the plans bisection needs: quote the lowest-HBM plan, which fits
            sol_d = (f"raise DDR per machine to at least {self._ddr_cap_for(lh_d)}: the lowest-HBM plan needs HBM "
                     f"{_sized(lh_h)} per rank and DDR {_sized(lh_d)} per machine") if lh_d > D else ""
        if least_h is not None:
            sol_h = (f"raise HBM per device (hbm_cap) to at least {self._hbm_cap_for(least_h)}: with DDR kept at its "
                     f"budget, {_sized(D)} per machine, the planner finds a plan from {_sized(least_h)} of HBM "
                     "per rank on, not below")
        else:
            sol_h = (f"raise HBM per device (hbm_cap) to at least {self._hbm_cap_for(ld_h)}: the lowest-DDR plan needs "
                     f"HBM {_sized(ld_h)} per rank and DDR {_sized(ld_d)} per machine") if ld_h > H else ""
        sols = [sol for sol in (sol_d, sol_h) if sol]  # a plan within both budgets that the grid missed: none
        # Only options that fit both budgets alone can be in a plan: when even their
        # smallest bytes overflow a budget, no plan exists and a finer grid cannot help.
        fit_h = np.where(fits_alone, hbm, np.iinfo(np.int64).max).min(axis=1)
        fit_d = np.where(fits_alone, ddr, np.iinfo(np.int64).max).min(axis=1)
        proven = int(fit_h.sum()) > H or int(fit_d.sum()) > D
        binned = [f"{n} {axis} bins" for n, axis in ((nh, "HBM"), (nd, "DDR")) if n > 0]
        if binned and not proven:  # an axis that does not bind is not binned (exact): only a binned one rounds
            sols.append(
                f"use a finer DP grid (bins=(HBM bins, DDR bins); this plan used {' and '.join(binned)}) in case "
                "the combination is within one bin of the budgets"
            )
        if not sols:  # the lowest-HBM plan fits both budgets, and the proposer did not find it
            sols.append("solve with an exact proposer (BruteForceProposer, up to 8 tables) or a DP with finer bins: "
                        f"the lowest-HBM plan needs HBM {_sized(lh_h)} per rank and DDR {_sized(lh_d)} per machine, "
                        "within both budgets")
        return PlannerError(
            f"No combination of placements meets both budgets at once (HBM alone needs >= {_sized(min_h)}, "
            f"DDR alone needs >= {_sized(min_d)}).\n{budgets}\nPossible solutions:\n"
            + "\n".join(f"  {k + 1}) {s}" for k, s in enumerate(sols)),
            PlannerErrorType.INSUFFICIENT_STORAGE,
        )

    def _least_budget(
        self, hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, H: int, D: int, upper: int, *, ddr_axis: bool
    ) -> Optional[int]:
        """The least DDR budget (``ddr_axis``; HBM budget ``H``) or HBM budget (DDR budget ``D``)
        with which the proposer plans, by bisection between the present budget, where it
        failed, and ``upper``, a budget a plan is known to fit.

        Args:
            hbm (np.ndarray): ``(M, K)`` HBM bytes per device of each option.
            ddr (np.ndarray): ``(M, K)`` DDR bytes per machine of each option.
            cost (np.ndarray): ``(M, K)`` costs.
            H (int): the HBM budget.
            D (int): the DDR budget.
            upper (int): the budget of a plan that fits on this axis with the other budget as it is.
            ddr_axis (bool): search the DDR budget (else the HBM budget).

        Returns:
            Optional[int]: ``b`` such that the proposer plans with budget ``b`` and not with
            ``b - 1``; None when it finds no plan even at ``upper``.
        """

        def plans(budget: int) -> bool:
            h, d = (H, budget) if ddr_axis else (budget, D)
            return self.proposer.solve(hbm, ddr, cost, h, d) is not None

        lo, hi = (D if ddr_axis else H), upper
        if hi <= lo or not plans(hi):
            return None
        while hi - lo > 1:  # plans(hi) and not plans(lo)
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if plans(mid) else (mid, hi)
        return hi

    def _hbm_cap_for(self, need: int) -> str:
        """The smallest ``hbm_cap`` whose budget holds ``need`` bytes per device, rounded up, and in bytes."""
        cap = _capacity_for(need, self.hbm_reservation, 1)
        return f"{_rounded(cap)} ({cap} B)"

    def _ddr_cap_for(self, need: int) -> str:
        """The smallest DDR per machine whose budget holds ``need`` bytes, rounded up, and in bytes.

        A machine's DDR is ``local_world_size`` x ``ddr_cap`` (torchrec's is per rank), so
        the size is a multiple of ``local_world_size``.
        """
        L = self.topology.local_world_size
        cap = _capacity_for(need, self.ddr_reservation, L)
        return f"{_rounded(cap)} ({cap} B; ddr_cap {cap // L} B per rank)"

    def _raise_for(self, option: PlacementOption, H: int, D: int) -> str:
        """What to raise for ``option`` to fit: only the budgets it exceeds."""
        raises = []
        if option.hbm_bytes_per_rank > H:
            raises.append(f"the HBM per device (hbm_cap) to at least {self._hbm_cap_for(option.hbm_bytes_per_rank)}")
        if option.ddr_bytes_per_machine > D:
            raises.append(f"the DDR per machine to at least {self._ddr_cap_for(option.ddr_bytes_per_machine)}")
        return (
            f"raise {' and '.join(raises)}: the table's {option.mode.name} x={option.cache_load_factor} option "
            f"needs {_sized(option.hbm_bytes_per_rank)} of HBM per rank and "
            f"{_sized(option.ddr_bytes_per_machine)} of DDR per machine"
        )


def _sized(num: int) -> str:
    """Bytes for a message: ``18.31 MiB (19195784 B)``, or ``512 B`` below 1 KiB.

    Every byte figure of a planner message goes through here (or :func:`_rounded`), rounded
    up to the 2 decimals shown: a size the user must reach never reads smaller than it is,
    and one byte count reads the same wherever a message quotes it (as a need, a capacity
    or a budget).
    """
    n = int(num)
    return f"{n} B" if n < 1024 else f"{_rounded(n)} ({n} B)"


def _rounded(num: int) -> str:
    """``format_bytes(num, round_up=True)``: the one rounding of byte figures in planner messages."""
    return format_bytes(num, round_up=True)


def _capacity_for(need: int, reservation: float, ranks: int) -> int:
    """Smallest capacity ``ranks x c`` (``c`` a whole number of bytes per rank) whose budget
    ``int(ranks x c x (1 - reservation))`` (``hbm_budget`` / ``ddr_budget``) is >= ``need``.

    Args:
        need (int): bytes the budget must hold.
        reservation (float): the reserved fraction in [0, 1).
        ranks (int): ranks sharing the capacity (1 for HBM per device, local_world_size for DDR per machine).

    Returns:
        int: the capacity in bytes.
    """
    c = max(0, math.ceil(need / ranks / (1.0 - reservation)) - 1)
    while int(ranks * c * (1.0 - reservation)) < need:  # float rounding: step to the first that holds
        c += 1
    return ranks * c


__all__ = [
    "DEFAULT_DDR_RESERVATION",
    "DEFAULT_HBM_RESERVATION",
    "PlacementPlanner",
    "table_fused_optimizer",
    "tables_from_module",
]

