"""Why no plan fits: the planner's infeasibility message, naming the table or budget at fault and the
least budgets that would plan (found by bisection on the proposer)."""

from __future__ import annotations

import math
from typing import List, Mapping, Optional, Protocol, Sequence, Tuple

import numpy as np
from torchrec.distributed.planner.types import Topology

from recpipe.planner.constraints import ROW_WISE, TABLE_WISE, constraint_for, sharding_types_flags
from recpipe.planner.errors import PlacementErrorType, PlacementPlannerError, rounded, sized, solutions
from recpipe.planner.option_arrays import OptionArrays
from recpipe.planner.specs import PlacementConstraints, PlacementOption, TableSpec
from recpipe.planner.types import PlacementProposer


class PlannerSettings(Protocol):
    """What a diagnosis reads of the planner (``PlacementPlanner`` is one)."""

    topology: Topology
    proposer: PlacementProposer
    constraints: Mapping[str, PlacementConstraints]
    load_factors: Tuple[float, ...]
    sharding_types: Tuple[str, ...]
    hbm_reservation: float
    ddr_reservation: float


class InfeasibilityDiagnosis:
    """The :class:`PlacementPlannerError` of a solve that found no plan, from the options the proposer was given
    and the budgets ``H`` (HBM per device) and ``D`` (DDR per machine)."""

    def __init__(
        self, planner: PlannerSettings, specs: Sequence[TableSpec], options: OptionArrays, H: int, D: int
    ) -> None:
        self.planner, self.specs, self.options, self.H, self.D = planner, specs, options, H, D
        hbm, ddr, cost = options.hbm_bytes_per_rank, options.ddr_bytes_per_machine, options.cost
        self.hbm, self.ddr, self.cost = hbm, ddr, cost
        self.W, self.L = planner.topology.world_size, planner.topology.local_world_size
        self.valid = valid = np.isfinite(cost)
        big = np.iinfo(np.int64).max
        self.hb, self.db = np.where(valid, hbm, big), np.where(valid, ddr, big)
        min_h_table, min_d_table = self.hb.min(axis=1), self.db.min(axis=1)
        self.min_h, self.min_d = int(min_h_table.sum()), int(min_d_table.sum())
        self.budgets = (
            f"Budgets: HBM {sized(H)} per device = hbm_cap x (1 - {planner.hbm_reservation}); "
            f"DDR {sized(D)} per machine = ddr_cap x local_world_size {self.L} x "
            f"(1 - {planner.ddr_reservation}); world_size {self.W}."
        )
        # The least DDR that goes with the least HBM: at HBM budget min_h only each table's lowest-HBM
        # options fit, so the one of those with the least DDR is the only plan left; and vice versa.
        self.lh_h, self.ld_d = self.min_h, self.min_d
        self.lh_d = int(np.where(valid & (hbm == min_h_table[:, None]), ddr, big).min(axis=1).sum())
        self.ld_h = int(np.where(valid & (ddr == min_d_table[:, None]), hbm, big).min(axis=1).sum())
        self.fits_alone = valid & (hbm <= H) & (ddr <= D)
        # tables left only torchrec's FUSED table (all rows in HBM) by sharding_types, not by a pin: load
        # factors cannot shrink them, a tiered sharding type can
        fused_only = ~(valid & ~options.fused).any(axis=1)
        pinned = np.array([constraint_for(t, planner.constraints) is not None for t in specs], dtype=bool)
        self.fused_only, self.widenable = fused_only, fused_only & ~pinned

    def error(self) -> PlacementPlannerError:
        """A table that fits no budget alone, a budget no plan fits, or budgets that fit only apart."""
        lonely = [i for i in range(len(self.specs)) if not self.fits_alone[i].any()]
        if lonely:
            return self._table_does_not_fit(lonely)
        if self.min_h > self.H or self.min_d > self.D:
            return self._insufficient()
        return self._no_combination()

    def _table_does_not_fit(self, lonely: List[int]) -> PlacementPlannerError:
        specs, H, D, lh_h, lh_d = self.specs, self.H, self.D, self.lh_h, self.lh_d
        i = lonely[0]
        t = specs[i]
        pin = constraint_for(t, self.planner.constraints)
        kind = PlacementErrorType.TABLE_DOES_NOT_FIT if pin is None else PlacementErrorType.STRICT_CONSTRAINTS
        # The table's smallest-HBM and smallest-DDR options, each with the budgets it exceeds.
        sols = [
            self._raise_for(self.options.option(i, j))
            for j in dict.fromkeys((int(np.argmin(self.hb[i])), int(np.argmin(self.db[i]))))
        ]
        if len(specs) > 1 and bool(self.valid.any(axis=1).all()):
            # the other tables may need more: name the budgets of one plan of every table
            sols.append(
                f"for all {len(specs)} tables together, raise {self._raises(lh_h, lh_d)}: with each table at its "
                f"lowest-HBM option the model needs {sized(lh_h)} of HBM per rank and {sized(lh_d)} of DDR per "
                "machine (the raises above are for this table alone)"
            )
        sols.append(f"shard over more ranks (world_size now {self.W}): per-rank bytes shrink as 1/world_size")
        if pin is not None:
            sols.insert(0, f"relax the constraints pinned on table {t.fqn!r} ({pin})")
            if pin.dynamic is not None:
                sols.insert(0, _dynamic_fix(t, pin))
        elif self.widenable[i]:
            sols.append(self._widen())
        else:
            sols.append(f"add smaller load factors than {min(self.planner.load_factors)} to load_factors")
        return PlacementPlannerError(
            f"Table {t.fqn!r} ({t.rows} rows x {t.dim}, {t.optimizer}) does not fit anywhere: no "
            f"option fits HBM {rounded(H)} per device and DDR {rounded(D)} per machine even alone "
            f"({len(lonely)} table(s) like this: {[specs[k].fqn for k in lonely][:10]}).\n{self.budgets}\n"
            + solutions(sols),
            kind,
        )

    def _insufficient(self) -> PlacementPlannerError:
        H, D, W, L, min_h, min_d = self.H, self.D, self.W, self.L, self.min_h, self.min_d
        lh_d, ld_h = self.lh_d, self.ld_h
        need_h, need_d = min_h > H, min_d > D
        kind = PlacementErrorType.INSUFFICIENT_HBM if need_h else PlacementErrorType.INSUFFICIENT_DDR
        # The other budget may fall short too once this one is raised: name it.
        short_d = need_h and lh_d > D
        short_h = need_d and not need_h and ld_h > H
        sols = []
        if need_h:
            sols.append(
                f"raise HBM per device (hbm_cap) to at least {self._hbm_cap_for(min_h)}: the model needs at "
                f"least {sized(min_h)} of HBM per rank at the smallest load factors, the "
                f"budget is {sized(H)}"
            )
        if short_d:
            other = (
                f" (with more HBM it needs less DDR: at least {sized(min_d)} per machine, with hbm_cap "
                f"at least {self._hbm_cap_for(ld_h)})"
                if lh_d > min_d
                else ""
            )
            sols.append(
                f"together with 1), raise host DDR per machine to at least {self._ddr_cap_for(lh_d)}: with "
                f"HBM raised to that least, the model needs {sized(lh_d)} of DDR per machine (each table at its "
                f"lowest-HBM option), the budget is {sized(D)}{other}"
            )
        if need_h and self.widenable.any():
            sols.append(self._widen())
        if need_h:
            smaller = "" if self.fused_only.all() else " or add smaller load_factors"
            sols.append(f"lower hbm_reservation (now {self.planner.hbm_reservation}){smaller}")
        if need_d and not need_h:
            sols.append(
                f"raise host DDR per machine to at least {self._ddr_cap_for(min_d)}: the model needs at least "
                f"{sized(min_d)} of DDR per machine, the budget is {sized(D)}"
            )
        if short_h:
            sols.append(
                f"together with 1), raise HBM per device (hbm_cap) to at least {self._hbm_cap_for(ld_h)}: with "
                f"DDR raised to that least, the model needs {sized(ld_h)} of HBM per rank (each table at its lowest-DDR "
                f"option), the budget is {sized(H)}"
            )
        sols.append(f"use more ranks (world_size now {W}) or fewer ranks per machine (local_world_size now {L})")
        both = (need_h and need_d) or short_d or short_h
        return PlacementPlannerError(
            f"Insufficient {'HBM' if need_h else 'DDR'}{(' and DDR' if need_h else ' and HBM') if both else ''} "
            f"for {len(self.specs)} tables.\n{self.budgets}\n{solutions(sols)}",
            kind,
        )

    def _no_combination(self) -> PlacementPlannerError:
        H, D, lh_h, lh_d, ld_h, ld_d = self.H, self.D, self.lh_h, self.lh_d, self.ld_h, self.ld_d
        proposer = self.planner.proposer
        # Each budget alone can be met, not both: quote, per budget, the least value with which this
        # planner plans while the other stays as it is (bisection on the proposer).
        nh, nd = getattr(proposer, "last_bins", (0, 0))
        # restore the proposer's diagnostics (last_bins, ...) to the failed solve's
        kept = {k: v for k, v in getattr(proposer, "__dict__", {}).items() if k.startswith("last_")}
        least_d = self._least_budget(lh_d, ddr_axis=True)
        least_h = self._least_budget(ld_h, ddr_axis=False)
        for k, v in kept.items():
            setattr(proposer, k, v)
        sols = []
        if least_d is not None:
            sols.append(
                f"raise DDR per machine to at least {self._ddr_cap_for(least_d)}: with HBM kept at its budget, "
                f"{sized(H)} per device, the planner finds a plan from {sized(least_d)} of DDR per machine on, "
                "not below"
            )
        elif lh_d > D:  # the proposer missed the plans bisection needs: quote the lowest-HBM plan, which fits
            sols.append(
                f"raise DDR per machine to at least {self._ddr_cap_for(lh_d)}: the lowest-HBM plan needs HBM "
                f"{sized(lh_h)} per rank and DDR {sized(lh_d)} per machine"
            )
        if least_h is not None:
            sols.append(
                f"raise HBM per device (hbm_cap) to at least {self._hbm_cap_for(least_h)}: with DDR kept at its "
                f"budget, {sized(D)} per machine, the planner finds a plan from {sized(least_h)} of HBM "
                "per rank on, not below"
            )
        elif ld_h > H:
            sols.append(
                f"raise HBM per device (hbm_cap) to at least {self._hbm_cap_for(ld_h)}: the lowest-DDR plan needs "
                f"HBM {sized(ld_h)} per rank and DDR {sized(ld_d)} per machine"
            )
        # Only options that fit both budgets alone can be in a plan: when their smallest bytes overflow a
        # budget, no plan exists and a finer grid cannot help.
        fit_h = np.where(self.fits_alone, self.hbm, np.iinfo(np.int64).max).min(axis=1)
        fit_d = np.where(self.fits_alone, self.ddr, np.iinfo(np.int64).max).min(axis=1)
        proven = int(fit_h.sum()) > H or int(fit_d.sum()) > D
        binned = [f"{n} {axis} bins" for n, axis in ((nh, "HBM"), (nd, "DDR")) if n > 0]
        if binned and not proven:  # an axis that does not bind is not binned (exact): only a binned one rounds
            sols.append(
                f"use a finer DP grid (bins=(HBM bins, DDR bins); this plan used {' and '.join(binned)}) in case "
                "the combination is within one bin of the budgets"
            )
        if not sols:  # the lowest-HBM plan fits both budgets, and the proposer did not find it
            sols.append(
                "solve with an exact proposer (BruteForceProposer, up to 8 tables) or a DP with finer bins: "
                f"the lowest-HBM plan needs HBM {sized(lh_h)} per rank and DDR {sized(lh_d)} per machine, "
                "within both budgets"
            )
        return PlacementPlannerError(
            f"No combination of placements meets both budgets at once (HBM alone needs >= {sized(self.min_h)}, "
            f"DDR alone needs >= {sized(self.min_d)}).\n{self.budgets}\n{solutions(sols)}",
            PlacementErrorType.INSUFFICIENT_STORAGE,
        )

    def _least_budget(self, upper: int, *, ddr_axis: bool) -> Optional[int]:
        """The least DDR (``ddr_axis``) or HBM budget with which the proposer plans, the other budget kept,
        by bisection between the present budget and ``upper`` (one a plan fits); None if none at ``upper``."""

        def plans(budget: int) -> bool:
            h, d = (self.H, budget) if ddr_axis else (budget, self.D)
            return self.planner.proposer.solve(self.hbm, self.ddr, self.cost, h, d) is not None

        lo, hi = (self.D if ddr_axis else self.H), upper
        if hi <= lo or not plans(hi):
            return None
        while hi - lo > 1:  # plans(hi) and not plans(lo)
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if plans(mid) else (mid, hi)
        return hi

    def _widen(self) -> str:
        """The fix of tables ``sharding_types`` leaves only torchrec's FUSED table: allow the tiered types."""
        names = [t.fqn for t, w in zip(self.specs, self.widenable) if w]
        wider = [s for s in self.planner.sharding_types if s not in (TABLE_WISE, ROW_WISE)]
        wider = [TABLE_WISE, ROW_WISE, *wider]
        return (
            f"widen sharding_types (now {list(self.planner.sharding_types)}) with 'table_wise' and/or 'row_wise' "
            f"({sharding_types_flags(wider)}): {len(names)} table(s) ({names[:5]}) have only torchrec's FUSED table, "
            "which keeps every row in HBM, where a recpipe tiered table keeps a load factor of them there"
        )

    def _hbm_cap_for(self, need: int) -> str:
        """The smallest ``hbm_cap`` whose budget holds ``need`` bytes per device, rounded and in bytes."""
        cap = _capacity_for(need, self.planner.hbm_reservation, 1)
        return f"{rounded(cap)} ({cap} B)"

    def _ddr_cap_for(self, need: int) -> str:
        """The smallest DDR per machine (a multiple of ``local_world_size``) whose budget holds ``need``."""
        cap = _capacity_for(need, self.planner.ddr_reservation, self.L)
        return f"{rounded(cap)} ({cap} B; ddr_cap {cap // self.L} B per rank)"

    def _raises(self, hbm: int, ddr: int) -> str:
        """The budgets to raise, and to what, for ``hbm`` bytes per rank and ``ddr`` per machine to fit."""
        raises = [f"the HBM per device (hbm_cap) to at least {self._hbm_cap_for(hbm)}"] if hbm > self.H else []
        raises += [f"the DDR per machine to at least {self._ddr_cap_for(ddr)}"] if ddr > self.D else []
        return " and ".join(raises)

    def _raise_for(self, option: PlacementOption) -> str:
        """What to raise for ``option`` to fit: only the budgets it exceeds."""
        h, d = option.hbm_bytes_per_rank, option.ddr_bytes_per_machine
        return (
            f"raise {self._raises(h, d)}: the table's {option.mode.name} x={option.cache_load_factor} option "
            f"needs {sized(h)} of HBM per rank and {sized(d)} of DDR per machine"
        )


def _dynamic_fix(table: TableSpec, pin: PlacementConstraints) -> str:
    """The fix of a dynamic table that fits nowhere: a smaller capacity (its slots and hash index shrink with it)."""
    capacity = pin.dynamic.table_capacity(table.rows) if pin.dynamic is not None else table.rows
    return (
        f"lower the capacity of dynamic table {table.fqn!r} (DynamicTableOptions.capacity, now {capacity} rows): "
        "each shard holds dynamic_local_slots(capacity, shards) rows and their hash index"
    )


def _capacity_for(need: int, reservation: float, ranks: int) -> int:
    """Smallest capacity ``ranks x c`` (whole bytes ``c`` per rank) whose budget
    ``int(ranks x c x (1 - reservation))`` holds ``need`` bytes."""
    c = max(0, math.ceil(need / ranks / (1.0 - reservation)) - 1)
    while int(ranks * c * (1.0 - reservation)) < need:  # float rounding: step to the first that holds
        c += 1
    return ranks * c


__all__ = ["InfeasibilityDiagnosis", "PlannerSettings"]
