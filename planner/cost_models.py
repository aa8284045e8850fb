"""Step-cost models: the modelled time a table's lookups take under a placement.

Both models price ``lookups x (value_bytes / bw(hit) + state_bytes / bw(state_hit))`` with ``bw(h) =
h * HBM_BW + (1 - h) * HBM_TO_DDR_BW`` (torchrec's 897 and 32 GB/s). ``AnalyticCostModel`` (default)
models the fast-tier hit rate: HYBRID ``x`` (a hash split ignores frequency), CACHING the access mass of
the ``x * N`` hottest rows; the state follows its row except in fbgemm's layout (row-wise state always
in HBM, other state of a CACHING table in UVM, uncached). ``EmpiricalCostModel`` uses the effective hit
rates fitted by TorchEasyRec PR #508 (A10 sweep of fbgemm's step, state traffic included).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import List, Sequence, Tuple, Union

import numpy as np
from torchrec.distributed.planner.constants import HBM_MEM_BW, HBM_TO_DDR_MEM_BW

from recpipe.pipeline.placement import (
    CachePolicy,
    FusedOptimizer,
    Mode,
    cache_policy_spec,
    check_load_factor,
    dtype_itemsize,
    floor_fraction,
    optimizer_state_bytes_per_row,
)
from recpipe.planner.specs import DEFAULT_ZIPF_ALPHA, STORAGE_BACKENDS, TableSpec
from recpipe.planner.types import CostModel

# Terms summed exactly before the Euler-Maclaurin tail of ``generalized_harmonic`` (tail error < 1e-12).
_HARMONIC_EXACT_TERMS: int = 4096

# Effective hit rates fitted by TorchEasyRec PR #508 (A10, 4M rows, dim 128, Adam, Zipf 1.05), inverting
# torchrec's bandwidth mix; the slope makes a larger cache win ties at equal mode. Dimensionless.
EMPIRICAL_CACHING_X_EFF: float = 0.28
EMPIRICAL_HYBRID_X_EFF: float = 0.11
EMPIRICAL_X_SLOPE: float = 0.01


@functools.lru_cache(maxsize=64)
def _harmonic_prefix(alpha: float) -> np.ndarray:
    m = _HARMONIC_EXACT_TERMS
    out = np.concatenate([[0.0], np.cumsum(np.arange(1, m + 1, dtype=np.float64) ** -alpha)])
    out.setflags(write=False)
    return out


def generalized_harmonic(n: np.ndarray, alpha: float) -> np.ndarray:
    """``H(n, alpha) = sum_{i=1..n} i^-alpha`` (float64) for an array of whole ``n >= 0``.

    Exact for ``n <= 4096``, Euler-Maclaurin tail (to the f''' term) above.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0.0 <= alpha < math.inf:
        raise ValueError(
            f"generalized_harmonic(alpha): alpha must be a finite number >= 0 (the Zipf exponent, e.g. "
            f"{DEFAULT_ZIPF_ALPHA}), got {type(alpha).__name__} {alpha!r}."
        )
    raw = np.asarray(n)
    bad = raw.ravel()
    if raw.dtype.kind in "iuf":  # keep the entries that are not whole numbers >= 0
        whole = (bad >= 0) & np.isfinite(bad) & (bad == np.floor(bad)) if raw.dtype.kind == "f" else bad >= 0
        bad = bad[~whole]
    if raw.dtype.kind not in "iuf" or bad.size:
        shown = f"{bad[:1].tolist()[0]!r} in an array" if bad.size else "an empty array"
        raise ValueError(
            f"generalized_harmonic(n): n must hold whole numbers >= 0 (counts of terms, e.g. "
            f"np.array([10, 1000])), got {shown} of dtype {raw.dtype}."
        )
    n = raw.astype(np.float64)
    m = _HARMONIC_EXACT_TERMS
    prefix = _harmonic_prefix(float(alpha))
    out = np.empty_like(n)
    small = n <= m
    out[small] = prefix[n[small].astype(np.int64)]
    big = n[~small]
    if big.size:
        if abs(alpha - 1.0) < 1e-12:
            integral = np.log(big / m)
        else:
            integral = (big ** (1.0 - alpha) - m ** (1.0 - alpha)) / (1.0 - alpha)
        mf = float(m)  # the f / 2 and f' / 12 terms of f(t) = t^-alpha
        df1 = -alpha * big ** (-alpha - 1.0) - -alpha * mf ** (-alpha - 1.0)
        tail = integral + (big**-alpha - mf**-alpha) / 2.0 + df1 / 12.0
        out[~small] = prefix[m] + tail
    return out


def fast_tier_hit_rate(
    table: TableSpec, mode: Mode, x: float, cache_policy: Union[CachePolicy, str] = CachePolicy.LFU
) -> float:
    """Expected fraction of lookups served by the fast tier.

    1.0 at ``x == 1``; ``x`` for HYBRID; for CACHING the policy's ``hit_rate`` of the top-``x * N`` access
    mass, from the table's ``cache_stats``, else ``access_counts``, else Zipf(``zipf_alpha``).
    """
    if not isinstance(table, TableSpec):
        raise ValueError(f"table must be a TableSpec, got {type(table).__name__} {table!r:.80}.")
    check_load_factor(x, "x")
    return float(_hit_rates(table, [(Mode.parse(mode), x)], cache_policy)[0])


def _hit_rates(
    table: TableSpec, options: Sequence[Tuple[Mode, float]], cache_policy: Union[CachePolicy, str]
) -> np.ndarray:
    """:func:`fast_tier_hit_rate` of every checked option, float64; one harmonic-sum call for a Zipf table."""
    out = np.empty(len(options), dtype=np.float64)
    cached: List[int] = []  # the CACHING options with x < 1, which the access model prices
    for i, (mode, x) in enumerate(options):
        if x >= 1.0:
            out[i] = 1.0
        elif mode is Mode.HYBRID:
            out[i] = float(x)
        else:
            cached.append(i)
    if table.cache_stats is not None:
        for i in cached:
            x = options[i][1]
            miss = table.cache_stats.expected_miss_rate(x)
            if isinstance(miss, bool) or not isinstance(miss, numbers.Real) or not 0.0 <= miss <= 1.0:  # also nan
                raise ValueError(
                    f"TableSpec({table.name}).cache_stats.expected_miss_rate({x}) returned {miss!r}: a miss rate "
                    "must be a fraction in [0, 1]; fix the CacheStatistics, or pass cache_stats=None to model "
                    "access by access_counts or zipf_alpha."
                )
            out[i] = float(1.0 - miss)
    elif table.access_counts is not None and cached:
        counts = np.sort(np.asarray(table.access_counts, dtype=np.float64))[::-1]
        total = counts.sum()
        for i in cached:
            x = options[i][1]
            top = counts[: floor_fraction(x, counts.size)].sum() / total if total > 0 else None
            out[i] = float(x) if top is None else cache_policy_spec(cache_policy).hit_rate(float(x), float(top))
    elif cached:
        ks = [floor_fraction(options[i][1], table.rows) for i in cached]
        h = generalized_harmonic(np.array(ks + [table.rows]), table.zipf_alpha)
        hit_rate = cache_policy_spec(cache_policy).hit_rate
        out[cached] = [hit_rate(float(options[i][1]), float(m)) for i, m in zip(cached, h[:-1] / h[-1])]
    return out


def _checked_options(table: TableSpec, options: Sequence[Tuple[Mode, float]]) -> List[Tuple[Mode, float]]:
    """``options`` as ``(Mode, float)`` pairs (the models compare modes by identity)."""
    if not isinstance(table, TableSpec):
        raise ValueError(f"table must be a TableSpec, got {type(table).__name__} {table!r:.80}.")
    if isinstance(options, (str, bytes)) or not isinstance(options, Sequence):
        raise ValueError(
            f"options must be a list of (mode, x) pairs, got {type(options).__name__} {options!r:.80}; "
            "e.g. [(Mode.CACHING, 0.2), (Mode.HYBRID, 1.0)]."
        )
    out = []
    for k, option in enumerate(options):
        if type(option) is tuple and [type(v) for v in option] == [Mode, float] and 0.0 < option[1] <= 1.0:
            out.append(option)  # the enumerator's candidates
            continue
        if isinstance(option, (str, bytes)) or not isinstance(option, Sequence) or len(option) != 2:
            raise ValueError(f"options[{k}] must be a (mode, x) pair, got {option!r}; e.g. (Mode.CACHING, 0.2).")
        mode, x = option
        check_load_factor(x, f"options[{k}] x")
        out.append((Mode.parse(mode, f"options[{k}] mode"), float(x)))
    return out


class _BandwidthMixCostModel:
    """``lookups x (value_bytes / bw(hit) + state_bytes / bw(state_hit))``, ``bw(h) = h * hbm + (1 - h) * h2d``."""

    name: str = "bandwidth_mix"

    def __init__(self, hbm_mem_bw: float = HBM_MEM_BW, hbm_to_ddr_mem_bw: float = HBM_TO_DDR_MEM_BW) -> None:
        for name, value in (("hbm_mem_bw", hbm_mem_bw), ("hbm_to_ddr_mem_bw", hbm_to_ddr_mem_bw)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
                raise ValueError(
                    f"{name} must be a positive finite number of bytes/ms (torchrec Topology units), "
                    f"got {value!r}; e.g. torchrec's HBM_MEM_BW / HBM_TO_DDR_MEM_BW."
                )
        self.hbm_mem_bw = float(hbm_mem_bw)
        self.hbm_to_ddr_mem_bw = float(hbm_to_ddr_mem_bw)

    def effective_hit(self, table: TableSpec, mode: Mode, x: float) -> float:
        """Fast-tier hit rate that prices option ``(mode, x)``."""
        raise NotImplementedError

    def effective_hits(self, table: TableSpec, options: Sequence[Tuple[Mode, float]]) -> np.ndarray:
        """``effective_hit`` of every option, float64."""
        return np.array([self.effective_hit(table, m, x) for m, x in options], dtype=np.float64)

    def state_hits(self, table: TableSpec, options: Sequence[Tuple[Mode, float]], hit: np.ndarray) -> np.ndarray:
        """Fraction of optimizer-state reads served by the fast tier (the state follows its row)."""
        return hit

    def costs(self, table: TableSpec, options: Sequence[Tuple[Mode, float]]) -> np.ndarray:
        """See ``CostModel.costs``; a ValueError for a bad table or option."""
        options = _checked_options(table, options)
        hit = self.effective_hits(table, options)
        state_hit = self.state_hits(table, options, hit)
        value = table.lookups_per_step * table.dim * dtype_itemsize(table.dtype)
        state = table.lookups_per_step * optimizer_state_bytes_per_row(table.optimizer, table.dim)
        return value / self._bandwidth(hit) + state / self._bandwidth(state_hit)

    def _bandwidth(self, hit: np.ndarray) -> np.ndarray:
        return hit * self.hbm_mem_bw + (1.0 - hit) * self.hbm_to_ddr_mem_bw


class AnalyticCostModel(_BandwidthMixCostModel):
    """Bandwidth mix priced with the modelled fast-tier hit rate (:func:`fast_tier_hit_rate`).

    Args:
        hbm_mem_bw: HBM bandwidth in bytes/ms.
        hbm_to_ddr_mem_bw: host->device bandwidth in bytes/ms.
        backend: the tiered tables' layout (``STORAGE_BACKENDS``), which sets where optimizer state lives.
        cache_policy: eviction policy of CACHING tables.
    """

    name: str = "analytic"

    def __init__(
        self,
        hbm_mem_bw: float = HBM_MEM_BW,
        hbm_to_ddr_mem_bw: float = HBM_TO_DDR_MEM_BW,
        backend: str = "native",
        cache_policy: Union[CachePolicy, str] = CachePolicy.LFU,
    ) -> None:
        super().__init__(hbm_mem_bw, hbm_to_ddr_mem_bw)
        if backend not in STORAGE_BACKENDS:
            raise ValueError(f"backend must be one of {list(STORAGE_BACKENDS)}, got {backend!r}.")
        self.backend: str = backend
        self.cache_policy: CachePolicy = CachePolicy.parse(cache_policy)

    def state_hits(self, table: TableSpec, options: Sequence[Tuple[Mode, float]], hit: np.ndarray) -> np.ndarray:
        """Fast-tier fraction of state reads: on fbgemm 1 for row-wise Adagrad, 0 for other CACHING state."""
        if self.backend != "fbgemm":
            return hit
        if table.optimizer is FusedOptimizer.ROWWISE_ADAGRAD:
            return np.ones_like(hit)
        uncached = np.array([m is Mode.CACHING and x < 1.0 for m, x in options], dtype=bool)
        return np.where(uncached, 0.0, hit)

    def effective_hit(self, table: TableSpec, mode: Mode, x: float) -> float:
        """:func:`fast_tier_hit_rate`."""
        return fast_tier_hit_rate(table, mode, x, self.cache_policy)

    def effective_hits(self, table: TableSpec, options: Sequence[Tuple[Mode, float]]) -> np.ndarray:
        """:func:`fast_tier_hit_rate` of every option; one harmonic-sum call for Zipf tables."""
        return _hit_rates(table, options, self.cache_policy)


class EmpiricalCostModel(_BandwidthMixCostModel):
    """Bandwidth mix priced with PR #508's fitted hit rates, independent of the access distribution.

    ``x_eff = 1`` at ``x = 1``, else ``0.28 + 0.01 x`` (CACHING) or ``0.11 + 0.01 x`` (HYBRID).
    """

    name: str = "empirical"

    def effective_hit(self, table: TableSpec, mode: Mode, x: float) -> float:
        """The fitted ``x_eff``."""
        mode = Mode.parse(mode)
        check_load_factor(x, "x")
        if x >= 1.0:
            return 1.0
        base = EMPIRICAL_CACHING_X_EFF if mode is Mode.CACHING else EMPIRICAL_HYBRID_X_EFF
        return base + EMPIRICAL_X_SLOPE * float(x)


def make_cost_model(
    name_or_model: "str | CostModel",
    hbm_mem_bw: float,
    hbm_to_ddr_mem_bw: float,
    backend: str = "native",
    cache_policy: Union[CachePolicy, str] = CachePolicy.LFU,
) -> CostModel:
    """Resolve ``"analytic"`` / ``"empirical"`` (bandwidths in bytes/ms) or pass a ``CostModel`` through."""
    if isinstance(name_or_model, str):
        key = name_or_model.lower()
        if key == "analytic":
            return AnalyticCostModel(hbm_mem_bw, hbm_to_ddr_mem_bw, backend, cache_policy)
        if key == "empirical":
            return EmpiricalCostModel(hbm_mem_bw, hbm_to_ddr_mem_bw)
        raise ValueError(f"cost_model must be 'analytic', 'empirical' or a CostModel, got {name_or_model!r}.")
    if isinstance(name_or_model, type):
        raise ValueError(
            f"cost_model {name_or_model.__name__} is a class: pass an instance, e.g. "
            f"{name_or_model.__name__}(), or the name 'analytic' / 'empirical'."
        )
    if not isinstance(name_or_model, CostModel):
        raise ValueError(f"cost_model {name_or_model!r} does not implement CostModel (name, costs(table, options)).")
    return name_or_model


__all__ = [
    "AnalyticCostModel",
    "EMPIRICAL_CACHING_X_EFF",
    "EMPIRICAL_HYBRID_X_EFF",
    "EMPIRICAL_X_SLOPE",
    "EmpiricalCostModel",
    "fast_tier_hit_rate",
    "generalized_harmonic",
    "make_cost_model",
]
