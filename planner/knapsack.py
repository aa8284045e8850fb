"""The knapsack the proposers solve, and its shared pieces.

Given ``(M, K)`` arrays (tables x options; ``cost = inf`` marks no option): minimise ``sum_i cost[i, j_i]``
with ``sum_i hbm[i, j_i] <= hbm_budget`` (bytes per device) and ``sum_i ddr[i, j_i] <= ddr_budget``
(bytes per machine). Checks the inputs, prices the budgets, drops dominated options, and loads the
compiled kernels (csrc/placement_dp.cpp) lazily; each has a NumPy twin here or in ``proposers``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, List, Optional, Tuple

import numpy as np

from recpipe.pipeline.placement import check_int
from recpipe.planner.errors import PlannerInputError

# Per-axis bin cap of the 2-D DP grid, as in TorchEasyRec PR #508. Bins.
DP_AXIS_BIN_CAP: int = 1024
# Most (tables x options x options) booleans ``prune_dominated`` builds at once. Count.
_PRUNE_CHUNK: int = 4_000_000
# Subgradient steps of the DP's budget prices: they only rank plans sharing a cell and tighten the
# incumbent bound (any prices >= 0 keep it valid), so few steps suffice. Steps.
PRICE_ITERS: int = 60
# Bytes below which the DP kernel carries byte counts exactly, as doubles (kExactBytes). Bytes.
EXACT_BYTES: int = 2**53
# Largest ``int`` argument of the compiled kernels (int64; torch's own refusal names no fix).
_KERNEL_INT_MAX: int = 2**63 - 1
# Most (HBM bins + 1) x (DDR bins + 1) cells the compiled DP kernel takes (kMaxCells). Cells.
KERNEL_MAX_CELLS: int = 2**23


def _check_kernel_budgets(op: str, hbm_budget: int, ddr_budget: int, largest: int, largest_text: str) -> None:
    """Refuses a budget past ``largest``, the largest ``torch.ops.recpipe.<op>`` takes."""
    for name, value in (("hbm_budget", int(hbm_budget)), ("ddr_budget", int(ddr_budget))):
        if value <= largest:
            continue
        raise PlannerInputError(
            f"{name} is {value} bytes, past {largest} B ({largest_text}), the largest budget the compiled planner "
            f"kernel torch.ops.recpipe.{op} takes (refused before calling it).\n"
            "Possible solutions:\n"
            f"  1) pass {name} below 2^53 bytes ({EXACT_BYTES} B = 8 PiB, the planner's exact byte range): no "
            "device or machine holds more; for a budget that binds no plan, pass the sum of each table's largest "
            "option (KnapsackProposer.solve passes that sum in place of a larger budget);\n"
            "  2) use the NumPy twin (budget_prices, or KnapsackProposer(backend='numpy')), which takes "
            "any budget."
        )


@functools.lru_cache(maxsize=None)
def _cpp_ops() -> Optional[Tuple[Any, Any]]:
    """``(torch, torch.ops.recpipe)`` when the compiled planner kernels load, else None (NumPy is used)."""
    try:
        import torch

        import recpipe._C  # noqa: F401  (registers torch.ops.recpipe.*)

        if not hasattr(torch.ops.recpipe, "placement_dp"):
            return None
        _register_fakes(torch)
    except ImportError:
        return None
    return torch, torch.ops.recpipe


def _loaded_ops() -> Tuple[Any, Any]:
    """``_cpp_ops()`` for a caller whose backend is ``cpp``, chosen because the kernels loaded."""
    ops = _cpp_ops()
    if ops is None:
        raise RuntimeError(
            "the compiled planner kernels torch.ops.recpipe (recpipe._C) did not load; build/install recpipe "
            "(`make venv`) or use backend='numpy'."
        )
    return ops


def _tensors(*arrays: np.ndarray) -> List[Any]:
    """The arrays as CPU tensors sharing their (contiguous) memory, for the compiled kernels."""
    torch = _loaded_ops()[0]
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


def _register_fakes(torch: Any) -> None:
    """Fake (meta) kernels of the planner ops, for FakeTensor / ``torch.library.opcheck``."""

    @torch.library.register_fake("recpipe::placement_dp")
    def _placement_dp_fake(hbm: Any, ddr: Any, cost: Any, *rest: Any) -> Tuple[Any, Any]:
        # rest: priced, keep, the budgets, the bins, the incumbent and the prices. The plan has one entry
        # per table, or none when no plan fits: data-dependent.
        n = torch.library.get_ctx().new_dynamic_size()
        return hbm.new_empty((n,)), cost.new_empty(())

    @torch.library.register_fake("recpipe::placement_prune_dominated")
    def _placement_prune_dominated_fake(hbm: Any, ddr: Any, cost: Any, usable: Any) -> Any:
        return usable.new_empty(usable.shape)

    @torch.library.register_fake("recpipe::placement_budget_prices")
    def _placement_budget_prices_fake(hbm: Any, ddr: Any, cost: Any, *budgets_and_iters: Any) -> Any:
        return cost.new_empty((2,))


def _checked_arrays(hbm: Any, ddr: Any, cost: Any) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The option arrays as int64 / int64 / float64 arrays of one ``(tables, options)`` shape."""
    arrays = []
    for name, a in (("hbm", hbm), ("ddr", ddr)):
        raw = np.asarray(a)
        whole = raw.dtype.kind in "iu" or (
            raw.dtype.kind == "f" and bool(np.isfinite(raw).all()) and bool((raw == np.floor(raw)).all())
        )
        if not whole or (raw.size and raw.min() < 0):
            got = "None" if a is None else f"{raw.dtype} values"
            if raw.size and raw.dtype.kind in "iuf":
                got += f" with minimum {raw.min()}"
            raise ValueError(
                f"`{name}` must hold whole byte counts >= 0 in a (tables, options) array (no fraction, "
                f"nan or negative), got {got}; pass the enumerator's int64 arrays (OptionArrays)."
            )
        if raw.dtype.kind in "uf" and raw.size and int(raw.max()) > np.iinfo(np.int64).max:
            # a float array's whole numbers past int64 were cast to -2^63 bytes: a plan "fitting" any budget
            raise ValueError(
                f"`{name}` holds {int(raw.max())} bytes, past int64 (2^63 - 1): no table option "
                "is that large; pass the enumerator's int64 arrays (OptionArrays)."
            )
        arrays.append(raw.astype(np.int64))
    hbm, ddr = arrays
    raw_cost = np.asarray(cost)
    cost = raw_cost.astype(np.float64) if raw_cost.dtype.kind in "iuf" else raw_cost
    if cost.dtype.kind != "f" or np.isnan(cost).any():
        got = (
            "None"
            if raw_cost.ndim == 0 and raw_cost.dtype == object and raw_cost.item() is None
            else f"dtype {cost.dtype}" + (" holding nan" if cost.dtype.kind == "f" else "")
        )
        raise ValueError(f"`cost` must be a float array without nan (inf marks no option), got {got}.")
    if np.isneginf(cost).any():  # -inf would read as "no option", as inf does, silently
        i, j = (int(v) for v in np.argwhere(np.isneginf(cost))[0])
        raise ValueError(
            f"`cost` holds -inf at (table {i}, option {j}): a cost is a finite number, or inf to mark "
            "no option; pass the enumerator's costs (OptionArrays)."
        )
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
    """Each axis's sum of every table's largest usable option, in bytes; sums at or past 2^53 are refused
    (no machine holds that much, int64 sums could wrap there: a typo in a table's size)."""
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
    """Lagrange prices ``(l_h, l_d)`` (cost per whole budget) of the HBM and DDR constraints.

    Projected subgradient ascent on the dual ``g(l) = sum_i min_j (c_ij + l_h h_ij / H + l_d d_ij / D) -
    l_h - l_d``. The DP ranks partial plans sharing a cell with them, so a cheaper plan that eats more of a
    binding budget does not evict a leaner one.
    """
    iters = check_int(iters, "iters", 1)
    hbm, ddr, cost = _validated(hbm, ddr, cost, hbm_budget, ddr_budget)
    ok = np.isfinite(cost)
    if not ok.any():
        return 0.0, 0.0
    a = np.where(ok, hbm / max(hbm_budget, 1), 0.0)
    b = np.where(ok, ddr / max(ddr_budget, 1), 0.0)
    c = np.where(ok, cost, np.inf)
    scale = max(float(np.sum(np.where(ok, cost, -np.inf).max(axis=1) - c.min(axis=1))), 1e-12)  # cost spread
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
    """:func:`budget_prices` through ``torch.ops.recpipe.placement_budget_prices``."""
    iters = check_int(iters, "iters", 1)
    hbm, ddr, cost = _validated(hbm, ddr, cost, hbm_budget, ddr_budget)
    _check_kernel_budgets(
        "placement_budget_prices", hbm_budget, ddr_budget, _KERNEL_INT_MAX, "2^63 - 1, the largest int64"
    )
    if iters > _KERNEL_INT_MAX:
        raise PlannerInputError(
            f"iters is {iters} subgradient steps, past int64 (2^63 - 1), the largest int the compiled planner "
            "kernel torch.ops.recpipe.placement_budget_prices takes (refused before calling it).\n"
            f"Possible solutions:\n  1) pass a few hundred steps at most (the DP prices with {PRICE_ITERS}; "
            "more barely move the prices)."
        )
    out = _loaded_ops()[1].placement_budget_prices(
        *_tensors(hbm, ddr, cost), int(hbm_budget), int(ddr_budget), int(iters)
    )
    return float(out[0]), float(out[1])


def _prune_dominated_cpp(hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """:func:`prune_dominated` through ``torch.ops.recpipe.placement_prune_dominated``."""
    return _loaded_ops()[1].placement_prune_dominated(*_tensors(hbm, ddr, cost, usable)).numpy()


def prune_dominated(hbm: np.ndarray, ddr: np.ndarray, cost: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """Mask of the usable options no other option of the same table dominates.

    An option is dominated when another usable one needs no more HBM, no more DDR and costs no more, and is
    strictly better on one or ties with a lower index. Swapping for the dominator never breaks a budget nor
    raises the cost, so the optimum is unchanged.
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
        chunks = [_prune_dominated(*(a[s : s + step] for a in (hbm, ddr, cost, usable))) for s in range(0, M, step)]
        return np.concatenate(chunks)
    h1, h2 = hbm[:, :, None], hbm[:, None, :]
    d1, d2 = ddr[:, :, None], ddr[:, None, :]
    c = np.where(usable, cost, np.inf)
    c1, c2 = c[:, :, None], c[:, None, :]
    # dom[i, j, l]: option l of table i dominates option j.
    le = (h2 <= h1) & (d2 <= d1) & (c2 <= c1) & usable[:, None, :]
    strict = (h2 < h1) | (d2 < d1) | (c2 < c1)
    lower_index = np.arange(K)[None, None, :] < np.arange(K)[None, :, None]
    dom = le & (strict | lower_index)
    return usable & ~dom.any(axis=2)


def _check_kernel_grid(bins: Optional[Tuple[int, int]], nh: int, nd: int) -> None:
    """Refuses a grid past the compiled kernel's ``KERNEL_MAX_CELLS``, naming the proposer's ``bins``."""
    cells = (nh + 1) * (nd + 1)
    if cells <= KERNEL_MAX_CELLS:
        return
    # the same HBM:DDR ratio, scaled into the limit
    scale = math.sqrt(KERNEL_MAX_CELLS / cells)
    b = max(1, int((nd + 1) * scale) - 1)
    a = max(1, min(int((nh + 1) * scale) - 1, KERNEL_MAX_CELLS // (b + 1) - 1))
    b = min(b, KERNEL_MAX_CELLS // (a + 1) - 1)
    who = f"KnapsackProposer(bins={bins!r})" if bins is not None else "the DP grid"
    raise PlannerInputError(
        f"{who}: a grid of ({nh} + 1) x ({nd} + 1) = {cells} cells is past the {KERNEL_MAX_CELLS} cells (2^23) the "
        "compiled DP kernel torch.ops.recpipe.placement_dp takes (refused before calling it).\n"
        "Possible solutions:\n"
        f"  1) pass fewer bins, e.g. bins=({a}, {b}) (the same HBM:DDR ratio within {KERNEL_MAX_CELLS} cells);\n"
        f"  2) pass bins=None: the planner sizes the grid (at most {DP_AXIS_BIN_CAP} bins per axis);\n"
        "  3) solve with the NumPy twin, KnapsackProposer(bins=..., backend='numpy'), which takes any "
        "grid (slower)."
    )


__all__ = ["DP_AXIS_BIN_CAP", "EXACT_BYTES", "KERNEL_MAX_CELLS", "PRICE_ITERS", "budget_prices", "prune_dominated"]
