"""Step-cost models: the modelled time a table's lookups take under a placement.

Two implementations behind one ``CostModel`` protocol:

* ``AnalyticCostModel`` (default):
  ``lookups x (value_bytes / bw(hit) + state_bytes / bw(state_hit))`` with
  ``bw(h) = h * HBM_BW + (1 - h) * HBM_TO_DDR_BW`` (torchrec constants, 897 and
  32 GB/s) and the expected fast-tier hit rate: HYBRID ``hit = x`` (a hash split
  ignores frequency), CACHING ``hit`` = access mass of the ``x * N`` most frequent
  rows (an LFU cache) under the table's access distribution. The optimizer state
  follows its row (``state_hit = hit``) except in fbgemm's layout (``backend=
  "fbgemm"``): row-wise Adagrad's one fp32 per row stays in HBM (``state_hit = 1``)
  and other state of a CACHING (x < 1) table stays in UVM, uncached
  (``state_hit = 0``), the layout ``fbgemm_shard_storage`` budgets.
* ``EmpiricalCostModel``: the same bandwidth mix over whole rows with the
  effective hit rates fitted by TorchEasyRec PR #508 from an A10 sweep (a fit of
  fbgemm's measured step, state traffic included).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import List, Protocol, Sequence, Tuple, runtime_checkable

import numpy as np
from torchrec.distributed.planner.constants import HBM_MEM_BW, HBM_TO_DDR_MEM_BW

from recpipe.pipeline.placement import (
    FusedOptimizer,
    Mode,
    check_load_factor,
    dtype_itemsize,
    floor_fraction,
    optimizer_state_bytes_per_row,
)
from recpipe.planner.types import DEFAULT_ZIPF_ALPHA, STORAGE_BACKENDS, TableSpec

# Terms summed exactly before switching to the Euler-Maclaurin tail in
# ``generalized_harmonic``. Dimensionless; the tail error is below 1e-12 here.
_HARMONIC_EXACT_TERMS: int = 4096

# Effective fast-tier hit rates fitted by TorchEasyRec PR #508 (A10 GPU sweep,
# 4M rows, dim 128, Adam, Zipf alpha 1.05: HBM-only 0.80 ms, CACHING@x<1 2.63 ms,
# HYBRID@x<1 5.44 ms; inverting the torchrec bandwidth mix gives these x_eff).
EMPIRICAL_CACHING_X_EFF: float = 0.28
EMPIRICAL_HYBRID_X_EFF: float = 0.11
# Tie-break slope of the fit: x_eff grows by 0.01 per unit x so that, at equal
# mode, a larger cache is preferred when it fits. Dimensionless (PR #508).
EMPIRICAL_X_SLOPE: float = 0.01


@functools.lru_cache(maxsize=64)
def _harmonic_prefix(alpha: float) -> np.ndarray:
    m = _HARMONIC_EXACT_TERMS
    out = np.concatenate([[0.0], np.cumsum(np.arange(1, m + 1, dtype=np.float64) ** -alpha)])
    out.setflags(write=False)
    return out


def generalized_harmonic(n: np.ndarray, alpha: float) -> np.ndarray:
    """``H(n, alpha) = sum_{i=1..n} i^-alpha`` for an array of ``n``.

    Exact for ``n <= 4096``, Euler-Maclaurin tail (to the f''' term) above.

    Args:
        n (np.ndarray): non-negative integers.
        alpha (float): exponent ``>= 0``.

    Returns:
        np.ndarray: float64 values, ``H(0) = 0``.

    Raises:
        ValueError: ``n`` holds anything but whole numbers >= 0 (a negative, a
            fraction, nan, inf, a bool or a non-number), or ``alpha`` is not a finite
            number >= 0.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0.0 <= alpha < math.inf:
        raise ValueError(f"generalized_harmonic(alpha): alpha must be a finite number >= 0 (the Zipf exponent, e.g. "
                         f"{DEFAULT_ZIPF_ALPHA}), got {type(alpha).__name__} {alpha!r}.")
    raw = np.asarray(n)
    if raw.dtype.kind not in "iuf" or (raw.size and not (
            (raw.dtype.kind == "u" or raw.min() >= 0)
            and (raw.dtype.kind != "f" or bool(np.all(np.isfinite(raw) & (raw == np.floor(raw))))))):
        bad = raw.ravel()
        if raw.dtype.kind in "iuf":
            whole = (bad >= 0) & np.isfinite(bad) & (bad == np.floor(bad)) if raw.dtype.kind == "f" else bad >= 0
            bad = bad[~whole]
        shown = f"{bad[:1].tolist()[0]!r} in an array" if bad.size else "an empty array"
        raise ValueError(f"generalized_harmonic(n): n must hold whole numbers >= 0 (counts of terms, e.g. "
                         f"np.array([10, 1000])), got {shown} of dtype {raw.dtype}.")
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

        def f(t: np.ndarray | float) -> np.ndarray | float:
            return t ** -alpha

        def f1(t: np.ndarray | float) -> np.ndarray | float:
            return -alpha * t ** (-alpha - 1.0)

        tail = integral + (f(big) - f(float(m))) / 2.0 + (f1(big) - f1(float(m))) / 12.0
        out[~small] = prefix[m] + tail
    return out


def fast_tier_hit_rate(table: TableSpec, mode: Mode, x: float) -> float:
    """Expected fraction of lookups served by the fast tier.

    Args:
        table (TableSpec): the table (its access model: ``cache_stats``, else
            ``access_counts``, else Zipf(``zipf_alpha``)).
        mode (Mode): placement mode.
        x (float): cache load factor in (0, 1].

    Returns:
        float: 1.0 at ``x == 1``; ``x`` for HYBRID; the top-``x * N`` access mass
        for CACHING (an LFU cache).

    Example::

        fast_tier_hit_rate(TableSpec(name="t", rows=100, dim=8, zipf_alpha=0.0),
                           Mode.CACHING, 0.3)  # 0.3 (uniform access)
    """
    if not isinstance(table, TableSpec):
        raise ValueError(f"table must be a TableSpec, got {type(table).__name__} {table!r:.80}.")
    check_load_factor(x, "x")
    mode = Mode.parse(mode)
    if x >= 1.0:
        return 1.0
    if mode is Mode.HYBRID:
        return float(x)
    if table.cache_stats is not None:
        miss = table.cache_stats.expected_miss_rate(x)
        if isinstance(miss, bool) or not isinstance(miss, numbers.Real) or not 0.0 <= miss <= 1.0:  # also refuses nan
            raise ValueError(
                f"TableSpec({table.name}).cache_stats.expected_miss_rate({x}) returned {miss!r}: a miss rate must be "
                "a fraction in [0, 1]; fix the CacheStatistics, or pass cache_stats=None to model access by "
                "access_counts or zipf_alpha."
            )
        return float(1.0 - miss)
    if table.access_counts is not None:
        counts = np.sort(np.asarray(table.access_counts, dtype=np.float64))[::-1]
        total = counts.sum()
        if total <= 0:
            return float(x)
        k = floor_fraction(x, counts.size)
        return float(counts[:k].sum() / total)
    k = floor_fraction(x, table.rows)
    h = generalized_harmonic(np.array([k, table.rows]), table.zipf_alpha)
    return float(h[0] / h[1])


def _checked_options(table: TableSpec, options: Sequence[Tuple[Mode, float]]) -> List[Tuple[Mode, float]]:
    """``options`` as ``(Mode, float)`` pairs, or a ValueError naming the bad one (a mode given
    by name must not be priced as the other mode: the models compare modes by identity)."""
    if not isinstance(table, TableSpec):
        raise ValueError(f"table must be a TableSpec, got {type(table).__name__} {table!r:.80}.")
    if isinstance(options, (str, bytes)) or not isinstance(options, Sequence):
        raise ValueError(f"options must be a list of (mode, x) pairs, got {type(options).__name__} {options!r:.80}; "
                         "e.g. [(Mode.CACHING, 0.2), (Mode.HYBRID, 1.0)].")
    out = []
    for k, option in enumerate(options):
        if type(option) is tuple and len(option) == 2 and type(option[0]) is Mode and type(option[1]) is float \
                and 0.0 < option[1] <= 1.0:
            out.append(option)  # the enumerator's candidates
            continue
        if isinstance(option, (str, bytes)) or not isinstance(option, Sequence) or len(option) != 2:
            raise ValueError(f"options[{k}] must be a (mode, x) pair, got {option!r}; e.g. (Mode.CACHING, 0.2).")
        mode, x = option
        check_load_factor(x, f"options[{k}] x")
        out.append((Mode.parse(mode, f"options[{k}] mode"), float(x)))
    return out


@runtime_checkable
class CostModel(Protocol):
    """Prices placement options of one table in modelled milliseconds per step."""

    name: str

    def costs(self, table: TableSpec, options: Sequence[Tuple[Mode, float]]) -> np.ndarray:
        """Modelled step cost of each ``(mode, x)`` option of ``table``.

        Args:
            table (TableSpec): the table.
            options (Sequence[Tuple[Mode, float]]): candidate placements.

        Returns:
            np.ndarray: float64 costs in ms, one per option.
        """
        ...


class _BandwidthMixCostModel:
    """Shared ``lookups x (value_bytes / bw(hit) + state_bytes / bw(state_hit))``,
    ``bw(h) = h * hbm_bw + (1 - h) * h2d_bw``."""

    name: str = "bandwidth_mix"

    def __init__(
        self,
        hbm_mem_bw: float = HBM_MEM_BW,
        hbm_to_ddr_mem_bw: float = HBM_TO_DDR_MEM_BW,
    ) -> None:
        for name, value in (("hbm_mem_bw", hbm_mem_bw), ("hbm_to_ddr_mem_bw", hbm_to_ddr_mem_bw)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive finite number of bytes/ms (torchrec Topology units), "
                                 f"got {value!r}; e.g. torchrec's HBM_MEM_BW / HBM_TO_DDR_MEM_BW.")
        if not (hbm_mem_bw > 0 and hbm_to_ddr_mem_bw > 0):
            raise ValueError(
                f"hbm_mem_bw ({hbm_mem_bw}) and hbm_to_ddr_mem_bw ({hbm_to_ddr_mem_bw}) "
                "must be positive bytes/ms (torchrec Topology units)."
            )
        self.hbm_mem_bw = float(hbm_mem_bw)
        self.hbm_to_ddr_mem_bw = float(hbm_to_ddr_mem_bw)

    def effective_hit(self, table: TableSpec, mode: Mode, x: float) -> float:
        raise NotImplementedError

    def effective_hits(self, table: TableSpec, options: Sequence[Tuple[Mode, float]]) -> np.ndarray:
        """``effective_hit`` of every option (subclasses vectorize it).

        Args:
            table (TableSpec): the table.
            options (Sequence[Tuple[Mode, float]]): candidate placements.

        Returns:
            np.ndarray: float64 hit rates, one per option.
        """
        return np.array([self.effective_hit(table, m, x) for m, x in options], dtype=np.float64)

    def state_hits(self, table: TableSpec, options: Sequence[Tuple[Mode, float]], hit: np.ndarray) -> np.ndarray:
        """Fraction of optimizer-state reads served by the fast tier: the state follows its row.

        Args:
            table (TableSpec): the table.
            options (Sequence[Tuple[Mode, float]]): candidate placements.
            hit (np.ndarray): the rows' ``effective_hits``.

        Returns:
            np.ndarray: float64, one per option (``hit`` here).
        """
        return hit

    def costs(self, table: TableSpec, options: Sequence[Tuple[Mode, float]]) -> np.ndarray:
        """See ``CostModel.costs``.

        Raises:
            ValueError: ``table`` is not a ``TableSpec``, or an option is not a pair of a
                mode (``Mode`` or its name) and an ``x`` in (0, 1].
        """
        options = _checked_options(table, options)
        hit = self.effective_hits(table, options)
        state_hit = self.state_hits(table, options, hit)
        value = table.lookups_per_step * table.dim * dtype_itemsize(table.dtype)
        state = table.lookups_per_step * optimizer_state_bytes_per_row(table.optimizer, table.dim)
        return value / self._bandwidth(hit) + state / self._bandwidth(state_hit)

    def _bandwidth(self, hit: np.ndarray) -> np.ndarray:
        return hit * self.hbm_mem_bw + (1.0 - hit) * self.hbm_to_ddr_mem_bw


class AnalyticCostModel(_BandwidthMixCostModel):
    """Bandwidth mix priced with the modelled fast-tier hit rate.

    Args:
        hbm_mem_bw (float): HBM bandwidth in bytes/ms (torchrec ``HBM_MEM_BW``, 897 GB/s).
        hbm_to_ddr_mem_bw (float): host->device bandwidth in bytes/ms (torchrec
            ``HBM_TO_DDR_MEM_BW``, 32 GB/s).
        backend (str): the tiered tables' layout, one of ``STORAGE_BACKENDS``:
            ``native`` (state moves with its row) or ``fbgemm`` (row-wise state
            always in HBM; other state of a CACHING table in UVM, uncached). The
            planner passes its own ``backend``.

    Example::

        AnalyticCostModel().costs(table, [(Mode.CACHING, 0.2), (Mode.HYBRID, 1.0)])
    """

    name: str = "analytic"

    def __init__(
        self,
        hbm_mem_bw: float = HBM_MEM_BW,
        hbm_to_ddr_mem_bw: float = HBM_TO_DDR_MEM_BW,
        backend: str = "native",
    ) -> None:
        super().__init__(hbm_mem_bw, hbm_to_ddr_mem_bw)
        if backend not in STORAGE_BACKENDS:
            raise ValueError(f"backend must be one of {list(STORAGE_BACKENDS)}, got {backend!r}.")
        self.backend: str = backend

    def state_hits(self, table: TableSpec, options: Sequence[Tuple[Mode, float]], hit: np.ndarray) -> np.ndarray:
        """Fraction of optimizer-state reads served by the fast tier in ``backend``'s layout.

        Args:
            table (TableSpec): the table.
            options (Sequence[Tuple[Mode, float]]): candidate placements.
            hit (np.ndarray): the rows' ``effective_hits``.

        Returns:
            np.ndarray: ``hit`` (native); on fbgemm 1 for row-wise Adagrad, 0 for
            other state of CACHING (x < 1) options, else ``hit``.
        """
        if self.backend != "fbgemm":
            return hit
        if table.optimizer is FusedOptimizer.ROWWISE_ADAGRAD:
            return np.ones_like(hit)
        uncached = np.array([m is Mode.CACHING and x < 1.0 for m, x in options], dtype=bool)
        return np.where(uncached, 0.0, hit)

    def effective_hit(self, table: TableSpec, mode: Mode, x: float) -> float:
        """The hit rate of ``fast_tier_hit_rate``."""
        return fast_tier_hit_rate(table, mode, x)

    def effective_hits(self, table: TableSpec, options: Sequence[Tuple[Mode, float]]) -> np.ndarray:
        """``fast_tier_hit_rate`` of every option; one harmonic-sum call for Zipf tables.

        Args:
            table (TableSpec): the table.
            options (Sequence[Tuple[Mode, float]]): candidate placements.

        Returns:
            np.ndarray: float64 hit rates, equal to ``fast_tier_hit_rate`` per option.
        """
        if table.cache_stats is not None or table.access_counts is not None:
            return super().effective_hits(table, options)
        out = np.empty(len(options), dtype=np.float64)
        zipf: list = []
        for i, (mode, x) in enumerate(options):
            if x >= 1.0:
                out[i] = 1.0
            elif mode is Mode.HYBRID:
                out[i] = float(x)
            else:
                zipf.append(i)
        if zipf:
            ks = [floor_fraction(options[i][1], table.rows) for i in zipf]
            h = generalized_harmonic(np.array(ks + [table.rows]), table.zipf_alpha)
            out[zipf] = h[:-1] / h[-1]
        return out


class EmpiricalCostModel(_BandwidthMixCostModel):
    """Bandwidth mix priced with PR #508's fitted effective hit rates.

    ``x_eff = 1`` at ``x = 1``; else ``0.28 + 0.01 x`` (CACHING) or
    ``0.11 + 0.01 x`` (HYBRID), independent of the access distribution.

    Args:
        hbm_mem_bw (float): HBM bandwidth in bytes/ms.
        hbm_to_ddr_mem_bw (float): host->device bandwidth in bytes/ms.
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
) -> CostModel:
    """Resolve ``"analytic"`` / ``"empirical"`` or pass a ``CostModel`` through.

    Args:
        name_or_model (str | CostModel): model or its name.
        hbm_mem_bw (float): HBM bandwidth in bytes/ms.
        hbm_to_ddr_mem_bw (float): host->device bandwidth in bytes/ms.
        backend (str): the tiered tables' layout (``AnalyticCostModel``'s ``backend``).

    Returns:
        CostModel: the model.
    """
    if isinstance(name_or_model, str):
        key = name_or_model.lower()
        if key == "analytic":
            return AnalyticCostModel(hbm_mem_bw, hbm_to_ddr_mem_bw, backend)
        if key == "empirical":
            return EmpiricalCostModel(hbm_mem_bw, hbm_to_ddr_mem_bw)
        raise ValueError(f"cost_model must be 'analytic', 'empirical' or a CostModel, got {name_or_model!r}.")
    if isinstance(name_or_model, type):
        raise ValueError(f"cost_model {name_or_model.__name__} is a class: pass an instance, e.g. "
                         f"{name_or_model.__name__}(), or the name 'analytic' / 'empirical'.")
    if not isinstance(name_or_model, CostModel):
        raise ValueError(
            f"cost_model {name_or_model!r} does not implement CostModel (name, costs(table, options))."
        )
    return name_or_model


__all__ = [
    "AnalyticCostModel",
    "CostModel",
    "EMPIRICAL_CACHING_X_EFF",
    "EMPIRICAL_HYBRID_X_EFF",
    "EMPIRICAL_X_SLOPE",
    "EmpiricalCostModel",
    "fast_tier_hit_rate",
    "generalized_harmonic",
    "make_cost_model",
]

