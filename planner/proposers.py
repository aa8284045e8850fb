"""Proposers: pick one option per table minimising total cost under two budgets.

Both proposers solve the same problem, given as arrays of shape ``(M, K)``
(tables x options; missing options have ``cost = inf``):

    minimise   sum_i cost[i, j_i]
    such that  sum_i hbm[i, j_i] <= hbm_budget   (bytes per device)
               sum_i ddr[i, j_i] <= ddr_budget   (bytes per machine)

``DynamicProgrammingProposer`` is the 2-D knapsack DP over (HBM bins, DDR bins)
over the reachable cells only, followed by an exact-bytes local search; its
relaxation loop, budget prices and option pruning run as C++ kernels
(``torch.ops.recpipe.placement_*``, csrc/placement_dp.cpp) or as their NumPy
twins (array operations, the same plan). ``BruteForceProposer`` enumerates
every combination (<= 8 tables) and is exact.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, List, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

from recpipe.pipeline.routing.ops import check_int
from recpipe.planner.types import PlannerInputError

# Per-axis bin cap of the 2-D DP grid, as in TorchEasyRec PR #508
# (``_DP_AXIS_BIN_CAP``). Bins.
DP_AXIS_BIN_CAP: int = 1024
# Default DP work when ``bins`` is not given: the grid is sized so that the
# bound sum_i options_i x min(cells, reachable combinations before table i) on
# (cell, option) updates stays near this count (6 tables get ~1024 x 700 bins,
# 1000 tables ~46 x 23). Updates.
DP_WORK_TARGET: float = 2.0e7
# Smallest default grid per binding axis (HBM, DDR). Bins.
DP_MIN_BINS: Tuple[int, int] = (16, 8)
# Largest tables x options for which the exact repair also tries every pair of
# single-table changes ((M K)^2 candidates per step, ~65k here). Count.
REPAIR_PAIR_LIMIT: int = 256
# Largest C(tables, 3) x options^3 for which the repair also tries every change
# of three tables at once (6 tables x 19 options: 137k). Count.
REPAIR_TRIPLE_LIMIT: int = 400_000
# Most improving moves the repair applies (each step costs ~0.1 ms at 1000
# tables x 19 options, so the step stays bounded on big instances). Moves.
REPAIR_MAX_STEPS: int = 200
# Most (tables x options x options) booleans ``prune_dominated`` builds at once. Count.
_PRUNE_CHUNK: int = 4_000_000
# Subgradient steps of the budget prices the DP uses: the prices only rank plans
# sharing a cell and tighten the incumbent bound (any prices >= 0 keep it valid);
# on the bench's 100-table instance 50 steps already agree with 200 to 1e-4. Steps.
PRICE_ITERS: int = 60
# Relative slack of the incumbent bound in the DP (kBoundSlack in
# csrc/placement_dp.cpp): float error in a bound never drops a tying plan. Fraction.
BOUND_SLACK: float = 1e-9
# Coarsest grid of the DP's warm-start ladder: grids are halved while they keep
# at least this many cells, at most LADDER_LEVELS - 1 times. Cells / count.
LADDER_MIN_CELLS: int = 128
LADDER_LEVELS: int = 3
# Bytes below which the DP kernel carries byte counts exactly, as doubles (kExactBytes in
# csrc/placement_dp.cpp, which refuses budgets and options at or above it). Bytes.
EXACT_BYTES: int = 2**53
# Tables above which the brute-force proposer refuses (19^8 ~ 1.7e10 combos).
BRUTE_FORCE_MAX_TABLES: int = 8
# Largest value of an ``int`` argument of the compiled planner kernels: their schemas'
# ``int`` is int64, and torch refuses a larger Python int with a message naming no fix.
_KERNEL_INT_MAX: int = 2**63 - 1
# Most (HBM bins + 1) x (DDR bins + 1) cells the compiled DP kernel takes (kMaxCells in
# csrc/placement_dp.cpp); the NumPy twin has no such limit. Cells.
KERNEL_MAX_CELLS: int = 2**23


def _kernel_budget_error(op: str, name: str, value: int, largest: int, largest_text: str) -> PlannerInputError:
    """The error for a budget ``value`` past ``largest``, the largest ``torch.ops.recpipe.<op>`` takes."""
    return PlannerInputError(
        f"{name} is {value} bytes, past {largest} B ({largest_text}), the largest budget the compiled planner "
        f"kernel torch.ops.recpipe.{op} takes (refused before calling it).\n"
        "Possible solutions:\n"
        f"  1) pass {name} below 2^53 bytes ({EXACT_BYTES} B = 8 PiB, the planner's exact byte range): no device "
        "or machine holds more; for a budget that binds no plan, pass the sum of each table's largest option "
        "(DynamicProgrammingProposer.solve passes that sum in place of a larger budget);\n"
        "  2) use the NumPy twin (budget_prices, or DynamicProgrammingProposer(backend='numpy')), which takes "
        "any budget."
    )


_CPP_OPS: Optional[Tuple[Any, Any]] = None
_CPP_TRIED = False


def _cpp_ops() -> Optional[Tuple[Any, Any]]:
    """``(torch, torch.ops.recpipe)`` when the compiled planner kernels load, else None (NumPy is used)."""
    global _CPP_OPS, _CPP_TRIED
    if not _CPP_TRIED:
        _CPP_TRIED = True
        try:
            import torch

            import recpipe._C  # noqa: F401  (registers torch.ops.recpipe.*)

            if hasattr(torch.ops.recpipe, "placement_dp"):
                _register_fakes(torch)
                _CPP_OPS = (torch, torch.ops.recpipe)
        except ImportError:
            _CPP_OPS = None
    return _CPP_OPS


def _register_fakes(torch: Any) -> None:
    """Fake (meta) kernels of the planner ops, for FakeTensor / ``torch.library.opcheck``."""

    @torch.library.register_fake("recpipe::placement_dp")
    def _placement_dp_fake(
        hbm: Any, ddr: Any, cost: Any, priced: Any, keep: Any, hbm_budget: int, ddr_budget: int,
        hbm_bins: int, ddr_bins: int, incumbent: float, price_hbm: float, price_ddr: float,
    ) -> Tuple[Any, Any]:
        # The plan has one entry per table, or none when no plan fits: data-dependent.
        n = torch.library.get_ctx().new_dynamic_size()
        return hbm.new_empty((n,)), cost.new_empty(())

    @torch.library.register_fake("recpipe::placement_prune_dominated")
    def _placement_prune_dominated_fake(hbm: Any, ddr: Any, cost: Any, usable: Any) -> Any:
        return usable.new_empty(usable.shape)

    @torch.library.register_fake("recpipe::placement_budget_prices")
    def _placement_budget_prices_fake(
        hbm: Any, ddr: Any, cost: Any, hbm_budget: int, ddr_budget: int, iters: int = 200
    ) -> Any:
        return cost.new_empty((2,))


@runtime_checkable
class Proposer(Protocol):
    """Chooses one option index per table."""

    def solve(
        self,
        hbm: np.ndarray,
        ddr: np.ndarray,
        cost: np.ndarray,
        hbm_budget: int,
        ddr_budget: int,
    ) -> Optional[np.ndarray]:
        """Solve the placement knapsack.

        Args:
            hbm (np.ndarray): ``(M, K)`` int64 HBM bytes per device of each option.
            ddr (np.ndarray): ``(M, K)`` int64 DDR bytes per machine of each option.
            cost (np.ndarray): ``(M, K)`` float64 cost, ``inf`` for no option.
            hbm_budget (int): HBM bytes per device.
            ddr_budget (int): DDR bytes per machine.

        Returns:
            Optional[np.ndarray]: ``(M,)`` chosen option per table, or None if no
            combination fits.
        """
        ...


def _checked_arrays(hbm: Any, ddr: Any, cost: Any) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The option arrays as int64 / int64 / float64 arrays of one ``(tables, options)`` shape, or a
    ValueError naming the argument."""
    arrays = []
    for name, a in (("hbm", hbm), ("ddr", ddr)):
        raw = np.asarray(a)
        whole = raw.dtype.kind in "iu" or (raw.dtype.kind == "f" and bool(np.isfinite(raw).all())
                                            and bool((raw == np.floor(raw)).all()))
        if not whole or (raw.size and raw.min() < 0):
            got = (f"{raw.dtype} values with minimum {raw.min()}" if raw.size and raw.dtype.kind in "iuf"
                   else f"{raw.dtype} values" if a is not None else "None")
            raise ValueError(f"`{name}` must hold whole byte counts >= 0 in a (tables, options) array (no fraction, "
                             f"nan or negative), got {got}; pass the enumerator's int64 arrays (OptionArrays).")
        if raw.dtype.kind in "uf" and raw.size and int(raw.max()) > np.iinfo(np.int64).max:
            # a float array's whole numbers past int64 were cast to -2^63 bytes: a plan "fitting" any budget
            raise ValueError(f"`{name}` holds {int(raw.max())} bytes, past int64 (2^63 - 1): no table option "
                             "is that large; pass the enumerator's int64 arrays (OptionArrays).")
        arrays.append(raw.astype(np.int64))
    hbm, ddr = arrays
    raw_cost = np.asarray(cost)
    cost = raw_cost.astype(np.float64) if raw_cost.dtype.kind in "iuf" else raw_cost
    if cost.dtype.kind != "f" or np.isnan(cost).any():
        got = "None" if raw_cost.ndim == 0 and raw_cost.dtype == object and raw_cost.item() is None \
            else f"dtype {cost.dtype}" + (" holding nan" if cost.dtype.kind == "f" else "")
        raise ValueError(f"`cost` must be a float array without nan (inf marks no option), got {got}.")
    if np.isneginf(cost).any():  # was taken for "no option", as inf is, silently
        i, j = (int(v) for v in np.argwhere(np.isneginf(cost))[0])
        raise ValueError(f"`cost` holds -inf at (table {i}, option {j}): a cost is a finite number, or inf to mark "
                         "no option; pass the enumerator's costs (OptionArrays).")
    if not (hbm.shape == ddr.shape == cost.shape and cost.ndim == 2):
        raise ValueError(
            f"hbm {hbm.shape}, ddr {ddr.shape} and cost {cost.shape} must share one (tables, options) shape."
        )
    return hbm, ddr, cost


def _validated(
    hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, hbm_budget: int, ddr_budget: int
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The proposer inputs as int64 / int64 / float64 arrays, after checking shapes and budgets."""
    for name, budget in (("hbm_budget", hbm_budget), ("ddr_budget", ddr_budget)):
        check_int(budget, name)
    hbm, ddr, cost = _checked_arrays(hbm, ddr, cost)
    if hbm_budget < 0 or ddr_budget < 0:
        raise ValueError(f"budgets must be >= 0 bytes, got hbm_budget={hbm_budget}, ddr_budget={ddr_budget}.")
    return hbm, ddr, cost


def _byte_totals(hbm: np.ndarray, ddr: np.ndarray, usable: np.ndarray) -> Tuple[int, int]:
    """Each axis's sum of every table's largest usable option, in bytes, below 2^53.

    Every plan fits these sums, so a budget at or above one binds no plan. Sums at or
    past 2^53 bytes (8 PiB; ``EXACT_BYTES``, the DP kernel's exact range) are refused:
    no device or machine holds that much, int64 sums of options could wrap there, and
    such a size is a typo in a table's rows or dim.

    Raises:
        ValueError: naming the axis, its sum and the fix.
    """
    totals = []
    for name, arr in (("HBM per device", hbm), ("DDR per machine", ddr)):
        total = sum(int(v) for v in np.where(usable, arr, 0).max(axis=1).tolist())  # Python ints: no wrap
        if total >= EXACT_BYTES:
            raise ValueError(
                f"the tables' largest options need {total} bytes of {name} in all, at or past 2^53 bytes "
                "(8 PiB), the planner's exact byte range: no device or machine holds that much; check the "
                "tables' sizes (rows x dim) for a typo."
            )
        totals.append(total)
    return totals[0], totals[1]


def budget_prices(
    hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, hbm_budget: int, ddr_budget: int, iters: int = 200
) -> Tuple[float, float]:
    """Lagrange prices (cost per whole budget) of the HBM and DDR constraints.

    Projected subgradient ascent on the dual
    ``g(l) = sum_i min_j (c_ij + l_h h_ij / H + l_d d_ij / D) - l_h - l_d``.
    The DP prices partial plans with them when two share a grid cell, so a
    cheaper plan that eats more of a binding budget does not evict a leaner one.

    Args:
        hbm (np.ndarray): ``(M, K)`` HBM bytes.
        ddr (np.ndarray): ``(M, K)`` DDR bytes.
        cost (np.ndarray): ``(M, K)`` costs (``inf`` = no option).
        hbm_budget (int): HBM budget.
        ddr_budget (int): DDR budget.
        iters (int): subgradient steps.

    Returns:
        Tuple[float, float]: ``(l_h, l_d)``, in cost units per full budget.

    Raises:
        ValueError: ``iters`` is not an int >= 1 (as the C++ kernel refuses it), or
            the arrays or budgets are malformed (as ``Proposer.solve`` refuses them).
    """
    iters = check_int(iters, "iters", 1)
    hbm, ddr, cost = _validated(hbm, ddr, cost, hbm_budget, ddr_budget)
    ok = np.isfinite(cost)
    if not ok.any():
        return 0.0, 0.0
    a = np.where(ok, hbm / max(hbm_budget, 1), 0.0)
    b = np.where(ok, ddr / max(ddr_budget, 1), 0.0)
    c = np.where(ok, cost, np.inf)
    spread = float(np.sum(np.where(ok, cost, -np.inf).max(axis=1) - c.min(axis=1)))
    scale = max(spread, 1e-12)
    lh = ld = 0.0
    best = (-np.inf, 0.0, 0.0)
    base = np.arange(cost.shape[0]) * cost.shape[1]
    af, bf = a.ravel(), b.ravel()
    z = np.empty_like(c)
    for k in range(iters):
        np.multiply(a, lh, out=z)
        z += c
        z += ld * b
        flat = base + np.argmin(z, axis=1)
        ga = float(af.take(flat).sum()) - 1.0
        gb = float(bf.take(flat).sum()) - 1.0
        g = float(z.ravel().take(flat).sum()) - lh - ld
        if g > best[0]:
            best = (g, lh, ld)
        if k == 0 and ga <= 0.0 and gb <= 0.0:
            break  # the cheapest option of every table fits: no budget is priced
        step = scale / (k + 1)
        lh, ld = max(0.0, lh + step * ga), max(0.0, ld + step * gb)
    return best[1], best[2]


def _budget_prices_cpp(
    hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, hbm_budget: int, ddr_budget: int, iters: int = 200
) -> Tuple[float, float]:
    """``budget_prices`` through ``torch.ops.recpipe.placement_budget_prices`` (same steps, C++ loop)."""
    iters = check_int(iters, "iters", 1)
    hbm, ddr, cost = _validated(hbm, ddr, cost, hbm_budget, ddr_budget)
    for name, budget in (("hbm_budget", hbm_budget), ("ddr_budget", ddr_budget)):
        if budget > _KERNEL_INT_MAX:
            raise _kernel_budget_error("placement_budget_prices", name, int(budget), _KERNEL_INT_MAX,
                                       "2^63 - 1, the largest int64")
    if iters > _KERNEL_INT_MAX:
        raise PlannerInputError(
            f"iters is {iters} subgradient steps, past int64 (2^63 - 1), the largest int the compiled planner "
            "kernel torch.ops.recpipe.placement_budget_prices takes (refused before calling it).\n"
            f"Possible solutions:\n  1) pass a few hundred steps at most (the DP prices with {PRICE_ITERS}; "
            "more barely move the prices)."
        )
    ops = _cpp_ops()
    assert ops is not None
    torch = ops[0]
    out = ops[1].placement_budget_prices(
        torch.from_numpy(np.ascontiguousarray(hbm)),
        torch.from_numpy(np.ascontiguousarray(ddr)),
        torch.from_numpy(np.ascontiguousarray(cost)),
        int(hbm_budget),
        int(ddr_budget),
        int(iters),
    )
    return float(out[0]), float(out[1])


def _prune_dominated_cpp(hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """``prune_dominated`` through ``torch.ops.recpipe.placement_prune_dominated`` (same mask)."""
    ops = _cpp_ops()
    assert ops is not None
    torch = ops[0]
    return ops[1].placement_prune_dominated(
        torch.from_numpy(np.ascontiguousarray(hbm)),
        torch.from_numpy(np.ascontiguousarray(ddr)),
        torch.from_numpy(np.ascontiguousarray(cost)),
        torch.from_numpy(np.ascontiguousarray(usable)),
    ).numpy()


def prune_dominated(hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """Drop options another option of the same table beats on HBM, DDR and cost.

    An option is dropped when another usable option of its table needs no more
    HBM, no more DDR and costs no more, and is strictly better on one of the
    three or equal on all three with a lower index (so one of a set of identical
    options survives). Swapping a dropped option for its dominator never breaks
    a budget and never raises the cost, so the optimum is unchanged.

    Args:
        hbm (np.ndarray): ``(M, K)`` HBM bytes.
        ddr (np.ndarray): ``(M, K)`` DDR bytes.
        cost (np.ndarray): ``(M, K)`` costs.
        usable (np.ndarray): ``(M, K)`` bool, options allowed at all.

    Returns:
        np.ndarray: ``(M, K)`` bool, the usable options no other option dominates.

    Raises:
        ValueError: an array is not a ``(tables, options)`` array of its kind (``usable``
            a bool one shaped like ``cost``), naming the argument.
    """
    hbm, ddr, cost = _checked_arrays(hbm, ddr, cost)
    mask = np.asarray(usable)
    if usable is None or mask.dtype != np.bool_ or mask.shape != cost.shape:
        got = "None" if usable is None else f"{type(usable).__name__} of dtype {mask.dtype} and shape {mask.shape}"
        raise ValueError(
            f"`usable` must be a bool array shaped like `cost` {cost.shape} (True for the options allowed at all), "
            f"got {got}; e.g. usable = np.isfinite(cost)."
        )
    return _prune_dominated(hbm, ddr, cost, mask)


def _prune_dominated(hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """:func:`prune_dominated` on checked arrays."""
    M, K = cost.shape
    step = max(1, _PRUNE_CHUNK // max(K * K, 1))
    if M > step:
        return np.concatenate(
            [_prune_dominated(hbm[s : s + step], ddr[s : s + step], cost[s : s + step], usable[s : s + step])
             for s in range(0, M, step)]
        )
    h1, h2 = hbm[:, :, None], hbm[:, None, :]
    d1, d2 = ddr[:, :, None], ddr[:, None, :]
    c1 = np.where(usable, cost, np.inf)[:, :, None]
    c2 = np.where(usable, cost, np.inf)[:, None, :]
    # dom[i, j, l]: option l of table i dominates option j.
    le = (h2 <= h1) & (d2 <= d1) & (c2 <= c1) & usable[:, None, :]
    strict = (h2 < h1) | (d2 < d1) | (c2 < c1)
    lower_index = np.arange(K)[None, None, :] < np.arange(K)[None, :, None]
    dom = le & (strict | lower_index)
    return usable & ~dom.any(axis=2)


def _check_kernel_grid(bins: Optional[Tuple[int, int]], nh: int, nd: int) -> None:
    """Refuses a DP grid of ``(nh + 1) x (nd + 1)`` cells past the compiled kernel's
    ``KERNEL_MAX_CELLS`` (which it refuses with a RuntimeError, and torch past int64), naming
    the proposer's ``bins`` when they set it.

    Raises:
        PlannerInputError: the grid, its cell count, the limit and the fixes.
    """
    cells = (nh + 1) * (nd + 1)
    if cells <= KERNEL_MAX_CELLS:
        return
    # the same HBM:DDR ratio, scaled into the limit
    scale = math.sqrt(KERNEL_MAX_CELLS / cells)
    b = max(1, int((nd + 1) * scale) - 1)
    a = max(1, min(int((nh + 1) * scale) - 1, KERNEL_MAX_CELLS // (b + 1) - 1))
    b = min(b, KERNEL_MAX_CELLS // (a + 1) - 1)
    who = f"DynamicProgrammingProposer(bins={bins!r})" if bins is not None else "the DP grid"
    raise PlannerInputError(
        f"{who}: a grid of ({nh} + 1) x ({nd} + 1) = {cells} cells is past the {KERNEL_MAX_CELLS} cells (2^23) the "
        "compiled DP kernel torch.ops.recpipe.placement_dp takes (refused before calling it).\n"
        "Possible solutions:\n"
        f"  1) pass fewer bins, e.g. bins=({a}, {b}) (the same HBM:DDR ratio within {KERNEL_MAX_CELLS} cells);\n"
        f"  2) pass bins=None: the planner sizes the grid (at most {DP_AXIS_BIN_CAP} bins per axis);\n"
        "  3) solve with the NumPy twin, DynamicProgrammingProposer(bins=..., backend='numpy'), which takes any "
        "grid (slower)."
    )


def _repair(
    hbm: np.ndarray,
    ddr: np.ndarray,
    cost: np.ndarray,
    usable: np.ndarray,
    choice: np.ndarray,
    H: int,
    D: int,
    pair_limit: int,
    triple_limit: int,
) -> np.ndarray:
    """Exact-bytes local search on a feasible plan: best improving 1-, 2- and 3-table changes.

    Every accepted move keeps both budgets on exact bytes and strictly lowers the
    total cost, so the loop ends and never breaks a budget. Two-table moves are
    tried when ``tables x options <= pair_limit``, three-table moves when
    ``C(tables, 3) x options^3 <= triple_limit``.
    """
    M, K = cost.shape
    rows = np.arange(M)
    c = np.where(usable, cost, np.inf)
    for _ in range(REPAIR_MAX_STEPS):
        cur_h, cur_d, cur_c = hbm[rows, choice], ddr[rows, choice], c[rows, choice]
        slack_h = H - int(cur_h.sum())
        slack_d = D - int(cur_d.sum())
        dh = hbm - cur_h[:, None]  # (M, K) change of usage / cost when table i takes option j
        dd = ddr - cur_d[:, None]
        dc = c - cur_c[:, None]
        single = np.where((dh <= slack_h) & (dd <= slack_d), dc, np.inf)
        k = int(np.argmin(single))
        best_gain, move = float(single.flat[k]), ((k // K, k % K),)
        if M * K <= pair_limit and M > 1:
            fh, fd, fc = dh.ravel(), dd.ravel(), dc.ravel()
            tot = fc[:, None] + fc[None, :]
            ok = (fh[:, None] + fh[None, :] <= slack_h) & (fd[:, None] + fd[None, :] <= slack_d)
            owner = np.repeat(rows, K)
            ok &= owner[:, None] < owner[None, :]  # two different tables, each pair once
            tot = np.where(ok, tot, np.inf)
            q = int(np.argmin(tot))
            if tot.flat[q] < best_gain:
                a, b = divmod(q, M * K)
                best_gain, move = float(tot.flat[q]), ((a // K, a % K), (b // K, b % K))
        if M >= 3 and math.comb(M, 3) * K**3 <= triple_limit:
            for t in itertools.combinations(range(M), 3):
                x, y, z = t
                th = dh[x][:, None, None] + dh[y][None, :, None] + dh[z][None, None, :]
                td = dd[x][:, None, None] + dd[y][None, :, None] + dd[z][None, None, :]
                tc = dc[x][:, None, None] + dc[y][None, :, None] + dc[z][None, None, :]
                tc = np.where((th <= slack_h) & (td <= slack_d), tc, np.inf)
                q = int(np.argmin(tc))
                if tc.flat[q] < best_gain:
                    jx, rem = divmod(q, K * K)
                    jy, jz = divmod(rem, K)
                    best_gain, move = float(tc.flat[q]), ((x, jx), (y, jy), (z, jz))
        # Relative threshold: float noise must not loop forever.
        if not best_gain < -1e-12 * max(1.0, float(cur_c.sum())):
            return choice
        for i, j in move:
            choice[i] = j
    return choice


class DynamicProgrammingProposer:
    """2-D knapsack DP over (HBM bins, DDR bins) with back-pointers, then exact repair.

    State: for every grid cell ``(a, b)`` the cheapest partial plan whose exact
    cumulative usage ``(U, V)`` rounds *up* to that cell, i.e.
    ``a = ceil(U * nh / hbm_budget)`` and ``b = ceil(V * nd / ddr_budget)``. Each
    cell carries its plan's exact bytes, so budgets are checked on exact bytes
    (a plan never breaks a budget) and rounding never accumulates over tables.
    Only reachable cells are stored (a sparse list of occupied cells rather than
    the full ``(nh + 1) x (nd + 1)`` array), so the work per table is
    ``occupied cells x options``, the same cells a pure-Python loop that skips
    unreachable cells visits. Adding table ``i`` pushes every occupied cell
    through every option of the table, computes each candidate's exact
    rounded-up target cell and keeps the cheapest per target (a scatter-min);
    back-pointers (option, source cell) per table give the plan. Recurrence::

        dp_i(cell(U + hbm[i, j], V + ddr[i, j])) = min_{(U, V) in dp_{i-1}, j} dp_{i-1}(U, V) + cost[i, j]

    A candidate is dropped when the later tables' leanest options no longer
    fit, when its Lagrangian lower bound cannot beat the best plan found so far
    (the incumbent), or when a plan in a cell strictly below it on both axes
    costs no more; all three are exact with one bin per byte.
    With one bin per byte the DP is exact; with coarser bins two partial plans
    in one cell keep only the cheaper (compared on cost plus Lagrange budget
    prices, see ``budget_prices``).

    Options dominated within their table are dropped first (exact), an axis whose
    budget cannot bind is collapsed to one bin, and tables are added largest
    first so the last, small tables fill the slack the bins cannot resolve. If
    the priced pass finds no plan (a cheaper plan evicted the only lean one from
    a shared cell), a second pass ranks plans in a cell by bytes first. The DP's
    plan is finally improved by an exact-bytes local search (best 1-table
    changes; 2- and 3-table changes on small instances), which never breaks a
    budget and never raises the cost. The grid is solved as a ladder: up to
    ``LADDER_LEVELS`` grids, each half the bins of the next, the repaired plan of
    each pass being the incumbent of the next, so the finest pass only explores
    partial plans that can still win.

    Args:
        bins (Optional[Tuple[int, int]]): (HBM bins, DDR bins) per device /
            machine budget. None picks them from the problem size (about
            ``DP_WORK_TARGET`` cell updates, at most ``DP_AXIS_BIN_CAP`` per axis,
            HBM:DDR = 2:1 like the seed's 100:50), so few tables get near-exact bins.
        repair (bool): run the exact local search on the DP's plan (default True).
        backend (str): ``"cpp"`` runs the relaxation loop, the budget prices and
            the option pruning in ``recpipe._C`` (``torch.ops.recpipe.placement_dp``,
            ``placement_budget_prices``, ``placement_prune_dominated``), ``"numpy"``
            runs their NumPy twins (same plan), ``"auto"`` (default) uses the
            compiled kernels when they load. Tables whose largest options sum to 2^53
            bytes (8 PiB, the kernels' exact range) or more on either axis are refused
            (``ValueError``): a typo in their sizes.

    Example::

        choice = DynamicProgrammingProposer(bins=(100, 50)).solve(hbm, ddr, cost, H, D)
    """

    def __init__(self, bins: Optional[Tuple[int, int]] = None, repair: bool = True, backend: str = "auto") -> None:
        if backend not in ("auto", "cpp", "numpy"):
            raise ValueError(f"backend must be 'auto', 'cpp' or 'numpy', got {backend!r}.")
        if backend == "cpp" and _cpp_ops() is None:
            raise RuntimeError(
                "backend='cpp' needs the compiled kernels torch.ops.recpipe.placement_dp (recpipe._C), which did not "
                "load; build/install recpipe (`make venv`) or pass backend='numpy'."
            )
        self.backend = "cpp" if backend == "cpp" or (backend == "auto" and _cpp_ops() is not None) else "numpy"
        if bins is not None:
            if isinstance(bins, (str, bytes)) or not isinstance(bins, (tuple, list)) or len(bins) != 2 or any(
                    isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in bins):
                raise ValueError(f"bins must be a pair of positive ints (hbm_bins, ddr_bins), got "
                                 f"{type(bins).__name__} {bins!r}; e.g. bins=(100, 50), or None to size the grid.")
            bins = (int(bins[0]), int(bins[1]))
        if not isinstance(repair, (bool, np.bool_)):
            raise ValueError(f"repair must be True or False, got {type(repair).__name__} {repair!r}.")
        self._bins = bins
        self.repair = bool(repair)
        self.last_bins: Tuple[int, int] = (0, 0)
        self.last_prices: Tuple[float, float] = (0.0, 0.0)
        self.last_dp_cost: float = float("nan")

    def _grid(self, options_per_table: np.ndarray, hbm_binds: bool, ddr_binds: bool) -> Tuple[int, int]:
        if self._bins is not None:
            nh, nd = self._bins
        else:
            # Occupied cells after table i are at most min(cells, prod of the
            # earlier tables' option counts), so the work for a grid of C cells is
            # sum_i k_i * min(C, prod_{l<i} k_l): few tables afford fine bins.
            k = options_per_table.astype(np.float64)
            reach = np.exp(np.minimum(np.cumsum(np.log(np.concatenate([[1.0], k[:-1]]))), math.log(1e18)))

            def work(cells: float) -> float:
                return float(np.sum(k * np.minimum(cells, reach)))

            lo, hi = 1.0, float(DP_AXIS_BIN_CAP + 1) ** 2
            for _ in range(60):  # bisection on the cell count C
                mid = math.sqrt(lo * hi)
                lo, hi = (mid, hi) if work(mid) <= DP_WORK_TARGET else (lo, mid)
            cells = lo
            if hbm_binds and ddr_binds:
                nh = int(math.sqrt(2.0 * cells))
                nh, nd = max(nh, DP_MIN_BINS[0]), max(nh // 2, DP_MIN_BINS[1])
            else:
                nh = nd = max(int(cells), DP_MIN_BINS[0])
            nh, nd = min(nh, DP_AXIS_BIN_CAP), min(nd, DP_AXIS_BIN_CAP)
        return (nh if hbm_binds else 0), (nd if ddr_binds else 0)

    @staticmethod
    def _dp_numpy(
        hbm: np.ndarray,
        ddr: np.ndarray,
        cost: np.ndarray,
        priced: np.ndarray,
        keep: np.ndarray,
        H: int,
        D: int,
        nh: int,
        nd: int,
        incumbent: float = math.inf,
        ph: float = 0.0,
        pd: float = 0.0,
    ) -> Optional[Tuple[np.ndarray, float]]:
        """One DP pass in NumPy (the reference twin of ``torch.ops.recpipe.placement_dp``).

        Plans sharing a cell are ranked by ``priced``. A partial plan whose
        Lagrangian lower bound (prices ``ph``, ``pd`` per byte) exceeds
        ``incumbent`` is dropped: it cannot lead to a plan cheaper than the
        incumbent (with one bin per byte the pass stays exact). Returns
        (choice, cost), or None when no plan fits or beats the incumbent.
        """
        M = cost.shape[0]
        stride = nd + 1
        ncell = (nh + 1) * stride
        # Bins per byte. Float cell indices are exact when a bin is one byte (the
        # factor is 1.0); otherwise a plan within float error of a bin edge may be
        # filed one cell off, which is harmless: feasibility is checked on exact bytes.
        fh = nh / H if (nh and H) else 0.0  # a zero budget holds only zero-byte plans: one bin
        fd = nd / D if (nd and D) else 0.0
        # Room every later table needs at least (its leanest kept option).
        big = np.iinfo(np.int64).max
        min_h = np.where(keep, hbm, big).min(axis=1)
        min_d = np.where(keep, ddr, big).min(axis=1)
        rest_h = np.concatenate([np.cumsum(min_h[::-1])[::-1][1:], [0]])
        rest_d = np.concatenate([np.cumsum(min_d[::-1])[::-1][1:], [0]])
        # Lagrangian bound of the later tables, sum_{l > i} min_j (c + ph h + pd d).
        lag = np.where(keep, (cost + ph * hbm) + pd * ddr, np.inf).min(axis=1)
        rest_l = np.concatenate([np.cumsum(lag[::-1])[::-1][1:], [0.0]])
        bound = incumbent + BOUND_SLACK * max(1.0, abs(incumbent))
        # Sparse DP state: one entry per occupied cell.
        P = np.zeros(1)  # priced cost
        T = np.zeros(1)  # true cost
        U = np.zeros(1, dtype=np.int64)  # exact HBM bytes
        V = np.zeros(1, dtype=np.int64)  # exact DDR bytes
        back_opt: List[np.ndarray] = []
        back_src: List[np.ndarray] = []
        best = np.empty(ncell)
        winner = np.empty(ncell, dtype=np.int64)
        grid = np.empty((nh + 1, nd + 1))
        for i in range(M):
            opts = np.flatnonzero(keep[i])
            k = opts.size
            U2 = U[:, None] + hbm[i, opts]
            V2 = V[:, None] + ddr[i, opts]
            T2 = T[:, None] + cost[i, opts]
            lb = ((T2 + rest_l[i]) - ph * (H - U2)) - pd * (D - V2)
            fits = (U2 <= H - rest_h[i]) & (V2 <= D - rest_d[i]) & (lb <= bound)
            a = np.minimum(np.ceil(U2 * fh), nh)
            b = np.minimum(np.ceil(V2 * fd), nd)
            cell = (a * stride + b).astype(np.int64).ravel()
            P2 = (P[:, None] + priced[i, opts]).ravel()
            if fits.all():
                sel = None
                cs, ps = cell, P2
            else:
                sel = np.flatnonzero(fits.ravel())
                if sel.size == 0:
                    return None
                cs, ps = cell[sel], P2[sel]
            # Scatter-min: cheapest priced candidate per target cell (the last of equals).
            best.fill(np.inf)
            np.minimum.at(best, cs, ps)
            won = ps == best[cs]
            win_cells = cs[won]
            winner[win_cells] = np.flatnonzero(won) if sel is None else sel[won]
            if ncell <= 4 * win_cells.size:
                occupied = np.flatnonzero(best < np.inf)
            else:
                occupied = np.unique(win_cells)
            w = winner[occupied]  # flat (state, option) index of each cell's winner
            src, jj = np.divmod(w, k)
            P = best[occupied]
            T = T2.ravel()[w]
            U = U2.ravel()[w]
            V = V2.ravel()[w]
            bo, bs = opts[jj], src
            if nh > 0 and nd > 0 and occupied.size > 1:
                # Dominance: a state in a cell strictly lower on both axes uses
                # strictly fewer bytes of both budgets; if it costs no more, drop.
                grid.fill(np.inf)
                grid.ravel()[occupied] = T
                low = np.minimum.accumulate(np.minimum.accumulate(grid, axis=0), axis=1)
                ra, rb = np.divmod(occupied, stride)
                lower = np.full(occupied.size, np.inf)
                inner = (ra > 0) & (rb > 0)
                lower[inner] = low[ra[inner] - 1, rb[inner] - 1]
                alive = lower > T
                if not alive.all():
                    P, T, U, V, bo, bs = P[alive], T[alive], U[alive], V[alive], bo[alive], bs[alive]
            back_opt.append(bo)
            back_src.append(bs)

        pos = int(np.argmin(T))
        total = float(T[pos])
        if total > bound:
            return None  # the bound is a lower bound: the cheapest final plan can still lose to the incumbent
        choice = np.empty(M, dtype=np.int64)
        for i in range(M - 1, -1, -1):
            choice[i] = back_opt[i][pos]
            pos = int(back_src[i][pos])
        return choice, total

    @staticmethod
    def _dp_cpp(
        hbm: np.ndarray,
        ddr: np.ndarray,
        cost: np.ndarray,
        priced: np.ndarray,
        keep: np.ndarray,
        H: int,
        D: int,
        nh: int,
        nd: int,
        incumbent: float = math.inf,
        ph: float = 0.0,
        pd: float = 0.0,
    ) -> Optional[Tuple[np.ndarray, float]]:
        """One DP pass through ``torch.ops.recpipe.placement_dp`` (same result as ``_dp_numpy``).

        Raises:
            PlannerInputError: a budget at or past 2^53 bytes or a grid past ``KERNEL_MAX_CELLS``
                cells, which the kernel refuses (or, past int64, torch), named before the call.
        """
        for name, budget in (("hbm_budget", H), ("ddr_budget", D)):
            if budget >= EXACT_BYTES:
                raise _kernel_budget_error("placement_dp", name, int(budget), EXACT_BYTES - 1,
                                           "2^53 - 1, its exact byte range")
        _check_kernel_grid(None, nh, nd)
        ops = _cpp_ops()
        assert ops is not None
        torch = ops[0]
        choice, total = ops[1].placement_dp(
            torch.from_numpy(np.ascontiguousarray(hbm)),
            torch.from_numpy(np.ascontiguousarray(ddr)),
            torch.from_numpy(np.ascontiguousarray(cost)),
            torch.from_numpy(np.ascontiguousarray(priced)),
            torch.from_numpy(np.ascontiguousarray(keep)),
            H, D, nh, nd, float(incumbent), float(ph), float(pd),
        )
        if choice.numel() != cost.shape[0]:
            return None
        return choice.numpy(), float(total)

    def solve(
        self,
        hbm: np.ndarray,
        ddr: np.ndarray,
        cost: np.ndarray,
        hbm_budget: int,
        ddr_budget: int,
    ) -> Optional[np.ndarray]:
        """See ``Proposer.solve``."""
        hbm, ddr, cost = _validated(hbm, ddr, cost, hbm_budget, ddr_budget)
        H, D = int(hbm_budget), int(ddr_budget)
        M, K = cost.shape
        self.last_dp_cost = float("nan")
        if M == 0:
            return np.zeros(0, dtype=np.int64)
        usable = np.isfinite(cost) & (hbm <= H) & (ddr <= D)
        if not usable.any(axis=1).all():
            return None
        # A budget past the kernel's exact byte range (2^53, kExactBytes in csrc/placement_dp.cpp;
        # beyond int64 too) binds no plan: every plan fits the sum of each table's largest option
        # (below 2^53, _byte_totals), so the solve at that sum is the same. Budgets below keep
        # their value (and the DP its plans).
        max_h, max_d = _byte_totals(hbm, ddr, usable)
        H = max_h if H >= EXACT_BYTES else H
        D = max_d if D >= EXACT_BYTES else D
        keep = (_prune_dominated if self.backend == "numpy" else _prune_dominated_cpp)(hbm, ddr, cost, usable)
        nh, nd = self._grid(keep.sum(axis=1), max_h > H, max_d > D)
        self.last_bins = (nh, nd)
        if self.backend == "cpp":  # the finest grid of the ladder below; bins=None never comes near
            _check_kernel_grid(self._bins, nh, nd)

        # Plans sharing a cell are compared on cost + budget prices x bytes (the
        # true cost is carried alongside): with one bin per byte this changes
        # nothing, with coarse bins it stops cheap-but-greedy plans from
        # evicting lean ones cell after cell.
        lh, ld = (0.0, 0.0)
        if nh or nd:
            prices = budget_prices if self.backend == "numpy" else _budget_prices_cpp
            lh, ld = prices(hbm, ddr, cost, H, D, PRICE_ITERS)
        ph = lh / H if nh else 0.0
        pd = ld / D if nd else 0.0
        self.last_prices = (lh, ld)
        priced = cost + ph * hbm + pd * ddr
        # Big tables first, small ones last: the last tables then fill the slack
        # the bins cannot see with fine-grained bytes.
        size = np.where(usable, hbm / max(H, 1) + ddr / max(D, 1), 0.0).max(axis=1)
        order = np.argsort(-size, kind="stable")
        hbm, ddr, cost, priced, keep = hbm[order], ddr[order], cost[order], priced[order], keep[order]
        dp = self._dp_cpp if self.backend == "cpp" else self._dp_numpy
        rows = np.arange(M)
        # Warm-start ladder: solve coarser grids first; the best plan so far is
        # the incumbent of the next pass, whose partial plans are pruned when
        # their Lagrangian bound cannot beat it. The answer is the cheapest plan
        # of all passes, so it is never worse than the coarser passes' plans.
        levels = [(nh, nd)]
        while len(levels) < LADDER_LEVELS:
            a, b = levels[0]
            coarser = (a // 2, b // 2)
            if (coarser[0] + 1) * (coarser[1] + 1) < LADDER_MIN_CELLS:
                break
            levels.insert(0, coarser)
        inc_choice: Optional[np.ndarray] = None
        inc_cost = math.inf
        for a, b in levels:
            found = dp(hbm, ddr, cost, priced, keep, H, D, a, b, inc_cost, ph, pd)
            if found is None and inc_choice is None and (a or b):
                # Feasible plans can be lost when a cheaper plan evicts a leaner one
                # from a shared cell on a sliver-thin budget: retry ranking plans in a
                # cell by bytes (share of each binding budget), cost only breaking ties.
                lean = (hbm / max(H, 1) if a else 0.0) + (ddr / max(D, 1) if b else 0.0)
                scale = float(np.abs(np.where(np.isfinite(cost), cost, 0.0)).sum()) + 1.0
                found = dp(hbm, ddr, cost, cost + 1e6 * scale * lean, keep, H, D, a, b)
            if found is None:
                continue  # nothing beats the incumbent at this grid
            choice, dp_cost = found
            # the cheapest plan a DP pass returned, before repair (diagnostics)
            self.last_dp_cost = dp_cost if math.isnan(self.last_dp_cost) else min(dp_cost, self.last_dp_cost)
            if self.repair:
                choice = _repair(hbm, ddr, cost, keep, choice, H, D, REPAIR_PAIR_LIMIT, REPAIR_TRIPLE_LIMIT)
            total = float(cost[rows, choice].sum())
            if total < inc_cost:
                inc_choice, inc_cost = choice, total
        if inc_choice is None:
            return None
        choice = inc_choice
        out = np.empty(M, dtype=np.int64)
        out[order] = choice
        return out


class BruteForceProposer:
    """Exact solver: every combination, meet-in-the-middle, for <= 8 tables.

    Options dominated within their table (no less HBM, DDR and cost than another
    option) are dropped first, which keeps the answer exact. The tables are split
    in two halves whose combinations are enumerated with NumPy; each block of
    left-half combinations is paired with all right-half combinations.

    Args:
        max_tables (int): refuse larger instances (default 8).
    """

    def __init__(self, max_tables: int = BRUTE_FORCE_MAX_TABLES) -> None:
        self.max_tables = check_int(max_tables, "BruteForceProposer(max_tables)", 1)

    @staticmethod
    def _combos(
        hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, opts: List[np.ndarray], first: int
    ) -> Tuple[np.ndarray, ...]:
        h = np.zeros(1, dtype=np.int64)
        d = np.zeros(1, dtype=np.int64)
        c = np.zeros(1, dtype=np.float64)
        idx = np.zeros((1, 0), dtype=np.int64)
        for t, o in enumerate(opts, start=first):
            h = (h[:, None] + hbm[t, o][None, :]).ravel()
            d = (d[:, None] + ddr[t, o][None, :]).ravel()
            c = (c[:, None] + cost[t, o][None, :]).ravel()
            idx = np.concatenate(
                [np.repeat(idx, len(o), axis=0), np.tile(o, idx.shape[0])[:, None]], axis=1
            )
        return h, d, c, idx

    def solve(
        self,
        hbm: np.ndarray,
        ddr: np.ndarray,
        cost: np.ndarray,
        hbm_budget: int,
        ddr_budget: int,
    ) -> Optional[np.ndarray]:
        """See ``Proposer.solve``."""
        hbm, ddr, cost = _validated(hbm, ddr, cost, hbm_budget, ddr_budget)
        M = cost.shape[0]
        if M > self.max_tables:
            raise ValueError(
                f"BruteForceProposer handles at most max_tables={self.max_tables} tables, got {M}: "
                "use DynamicProgrammingProposer."
            )
        if M == 0:
            return np.zeros(0, dtype=np.int64)
        usable = np.isfinite(cost) & (hbm <= hbm_budget) & (ddr <= ddr_budget)
        if not usable.any(axis=1).all():
            return None
        _byte_totals(hbm, ddr, usable)  # int64 sums of the combinations below cannot wrap
        opts: List[np.ndarray] = []
        for t in range(M):
            ok = np.flatnonzero(np.isfinite(cost[t]) & (hbm[t] <= hbm_budget) & (ddr[t] <= ddr_budget))
            keep = []
            for j in ok:
                dominated = np.any(
                    (hbm[t, ok] <= hbm[t, j]) & (ddr[t, ok] <= ddr[t, j]) & (cost[t, ok] <= cost[t, j])
                    & ((hbm[t, ok] < hbm[t, j]) | (ddr[t, ok] < ddr[t, j]) | (cost[t, ok] < cost[t, j]))
                )
                if not dominated:
                    keep.append(j)
            if not keep:
                return None
            opts.append(np.asarray(keep, dtype=np.int64))
        half = M // 2
        hl, dl, cl, il = self._combos(hbm, ddr, cost, opts[:half], 0)
        hr, dr, cr, ir = self._combos(hbm, ddr, cost, opts[half:], half)
        best_cost, best = np.inf, None
        block = max(1, 2_000_000 // max(len(hr), 1))
        for s in range(0, len(hl), block):
            e = min(s + block, len(hl))
            tot = cl[s:e, None] + cr[None, :]
            fits = (hl[s:e, None] + hr[None, :] <= hbm_budget) & (dl[s:e, None] + dr[None, :] <= ddr_budget)
            tot = np.where(fits, tot, np.inf)
            k = int(np.argmin(tot))
            if tot.flat[k] < best_cost:
                best_cost = float(tot.flat[k])
                a, b = divmod(k, len(hr))
                best = np.concatenate([il[s + a], ir[b]])
        return best


__all__ = [
    "BRUTE_FORCE_MAX_TABLES",
    "BruteForceProposer",
    "DP_AXIS_BIN_CAP",
    "DP_MIN_BINS",
    "DP_WORK_TARGET",
    "DynamicProgrammingProposer",
    "KERNEL_MAX_CELLS",
    "Proposer",
    "REPAIR_MAX_STEPS",
    "REPAIR_PAIR_LIMIT",
    "REPAIR_TRIPLE_LIMIT",
    "budget_prices",
    "prune_dominated",
]
