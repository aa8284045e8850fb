"""Step-cost models: the modelled time a table's lookups take under a placement.

Both models price ``lookups x (value_bytes / bw(hit) + state_bytes / bw(state_hit))`` with ``bw(h) =
h * HBM_BW + (1 - h) * HBM_TO_DDR_BW`` (torchrec's 897 and 32 GB/s). ``AnalyticCostModel`` (default)
models the fast-tier hit rate: HYBRID ``x`` (a hash split ignores frequency), CACHING the access mass of
the ``x * N`` hottest rows; the state follows its row except in fbgemm's layout (row-wise state always
in HBM, other state of a CACHING table in UVM, uncached). ``EmpiricalCostModel`` uses the effective hit
rates fitted by TorchEasyRec PR #508 (A10 sweep of fbgemm's step, state traffic included).
:func:`dynamic_lookup_costs` prices a dynamic table from the static costs of its slots (hash probes,
and inserts of the keys its capacity cannot hold).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import List, Sequence, Tuple, Union, cast

import numpy as np
from torchrec.distributed.planner.constants import HBM_MEM_BW, HBM_TO_DDR_MEM_BW

from recpipe.pipeline.placement import (
    BUCKET_SLOTS,
    INDEX_BYTES_PER_SLOT,
    CachePolicy,
    FusedOptimizerKind,
    Mode,
    cache_policy_spec,
    check_load_factor,
    decimal_ratio,
    dtype_itemsize,
    floor_fraction,
    optimizer_state_bytes_per_row,
    row_bytes,
)
from recpipe.planner.specs import DEFAULT_ZIPF_ALPHA, STORAGE_BACKENDS, TableSpec, per_row_format
from recpipe.planner.types import CostModel

# Bound on ``rows x load-factor numerator`` in the vectorized floor_fraction, to stay exact in int64.
_INT64_SAFE: int = 2**62
# Terms summed exactly before the Euler-Maclaurin tail of ``generalized_harmonic``. Count; with the tail's
# corrections through the B4 term, the truncation error is below 1e-14 relative for alpha in [0, 3].
_HARMONIC_EXACT_TERMS: int = 256

# Effective hit rates fitted by TorchEasyRec PR #508 (A10, 4M rows, dim 128, Adam, Zipf 1.05), inverting
# torchrec's bandwidth mix; the slope makes a larger cache win ties at equal mode. Dimensionless.
EMPIRICAL_CACHING_X_EFF: float = 0.28
EMPIRICAL_HYBRID_X_EFF: float = 0.11
EMPIRICAL_X_SLOPE: float = 0.01


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
    return generalized_harmonic_rows(n.reshape(1, -1), np.array([float(alpha)])).reshape(n.shape)


# Distinct Zipf exponents whose exact prefix sums are built at once (x 257 float64 each). Count.
_PREFIX_CHUNK: int = 4096


def generalized_harmonic_rows(n: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """:func:`generalized_harmonic` of every row ``i`` of ``n`` (``(T, C)``, whole numbers >= 0 as float64)
    with exponent ``alpha[i]``, for many tables at once (unchecked: callers check). The exact terms are
    ``exp(-alpha log i)``, within 3e-15 relative of ``i ** -alpha`` and a few times faster."""
    m = _HARMONIC_EXACT_TERMS
    out = np.empty_like(n)
    top = np.empty(n.shape[0])  # H(m, alpha) per row
    exps, inv = np.unique(alpha, return_inverse=True)
    log_terms = np.log(np.arange(1, m + 1, dtype=np.float64))
    small = n <= m
    for start in range(0, exps.size, _PREFIX_CHUNK):
        a = exps[start : start + _PREFIX_CHUNK]
        terms = np.exp(-a[:, None] * log_terms[None, :])
        prefix = np.concatenate([np.zeros((a.size, 1)), np.cumsum(terms, axis=1)], axis=1)
        rows = np.flatnonzero((inv >= start) & (inv < start + a.size))
        p = prefix[inv[rows] - start]
        cols = np.where(small[rows], n[rows], 0).astype(np.int64)
        out[rows] = np.where(small[rows], np.take_along_axis(p, cols, axis=1), 0.0)
        top[rows] = p[:, m]
    big = ~small
    if big.any():
        a = np.broadcast_to(alpha[:, None], n.shape)[big]
        b, mf = n[big], float(m)
        with np.errstate(divide="ignore", invalid="ignore"):
            integral = np.where(np.abs(a - 1.0) < 1e-12, np.log(b / m), (b ** (1.0 - a) - m ** (1.0 - a)) / (1.0 - a))
        # Euler-Maclaurin: f = x^-a, (f(b) - f(m)) / 2 + B2/2! (f'(b) - f'(m)) + B4/4! (f'''(b) - f'''(m))
        df1 = -a * (b ** (-a - 1.0) - mf ** (-a - 1.0))
        df3 = -a * (a + 1.0) * (a + 2.0) * (b ** (-a - 3.0) - mf ** (-a - 3.0))
        tail = integral + (b**-a - mf**-a) / 2.0 + df1 / 12.0 - df3 / 720.0
        out[big] = np.broadcast_to(top[:, None], n.shape)[big] + tail
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
            if isinstance(miss, bool) or not isinstance(miss, numbers.Real) or miss < 0.0 or not miss <= 1.0:  # or nan
                raise ValueError(
                    f"TableSpec({table.name}).cache_stats.expected_miss_rate({x}) returned {miss!r}: a miss rate "
                    "must be a fraction in [0, 1]; fix the CacheStatistics, or pass cache_stats=None to model "
                    "access by access_counts or zipf_alpha."
                )
            out[i] = float(1.0 - cast(float, miss))  # a Real: typeshed's numbers.Real types 1.0 - miss as complex
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


class _ZipfCostMatrix:
    """The bandwidth-mix costs of many tables x one option list at once (:meth:`cost_matrix`): equal to each
    table's ``costs``, with the Zipf hit rates of all tables from one vectorized harmonic sum."""

    backend: str
    cache_policy: CachePolicy
    hbm_mem_bw: float
    hbm_to_ddr_mem_bw: float

    def cost_matrix(self, tables: Sequence[TableSpec], options: Sequence[Tuple[Mode, float]]) -> np.ndarray:
        """``(tables, options)`` modelled ms; tables with measured access (``cache_stats``,
        ``access_counts``) or huge row counts are priced one by one."""
        if not tables:
            return np.zeros((0, len(options)))
        options = _checked_options(tables[0], options)
        xs = np.array([x for _, x in options], dtype=np.float64)
        caching = np.array([m is Mode.CACHING for m, _ in options], dtype=bool)
        cached = caching & (xs < 1.0)
        hit = np.where(xs >= 1.0, 1.0, xs)[None, :].repeat(len(tables), axis=0)
        ratios = [decimal_ratio(x) for x in xs[cached]]
        num = np.array([r[0] for r in ratios], dtype=np.int64)
        den = np.array([r[1] for r in ratios], dtype=np.int64)
        rows = np.array([t.rows for t in tables], dtype=np.int64)
        measured = np.array([t.cache_stats is not None or t.access_counts is not None for t in tables])
        zipf = ~measured & (rows < _INT64_SAFE // max(int(num.max(initial=1)), 1))
        if cached.any() and zipf.any():
            z = np.flatnonzero(zipf)
            ks = (num[None, :] * rows[z, None]) // den[None, :]  # floor_fraction of every cached option
            n = np.concatenate([ks, rows[z, None]], axis=1).astype(np.float64)
            h = generalized_harmonic_rows(n, np.array([tables[int(i)].zipf_alpha for i in z], dtype=np.float64))
            mass = h[:, :-1] / h[:, -1:]
            hit_rate = cache_policy_spec(self.cache_policy).hit_rate
            hit[np.ix_(z, np.flatnonzero(cached))] = hit_rate(xs[cached][None, :], mass)
        for i in np.flatnonzero(~zipf).tolist():
            hit[i] = _hit_rates(tables[i], options, self.cache_policy)
        state_hit = hit
        if self.backend == "fbgemm":
            rowwise = np.array([t.optimizer is FusedOptimizerKind.ROWWISE_ADAGRAD for t in tables])[:, None]
            state_hit = np.where(rowwise, 1.0, np.where(cached[None, :], 0.0, hit))
        lookups = np.array([t.lookups_per_step for t in tables], dtype=np.float64)
        value = lookups * per_row_format(tables, lambda dim, dtype, _: dim * dtype_itemsize(dtype))
        state = lookups * per_row_format(tables, lambda dim, _, opt: optimizer_state_bytes_per_row(opt, dim))
        bw = lambda h: h * self.hbm_mem_bw + (1.0 - h) * self.hbm_to_ddr_mem_bw  # noqa: E731
        return value[:, None] / bw(hit) + state[:, None] / bw(state_hit)


class AnalyticCostModel(_ZipfCostMatrix, _BandwidthMixCostModel):
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
        if table.optimizer is FusedOptimizerKind.ROWWISE_ADAGRAD:
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


#: Fast-tier bytes one lookup's hash probe moves in a dynamic table's index: its bucket's ``BUCKET_SLOTS`` int64
#: keys and int64 size header read, its int64 score written. Bytes per lookup.
DYNAMIC_PROBE_BYTES: int = BUCKET_SLOTS * 8 + 8 + 8
#: Fast-tier bytes an insert writes into the index beyond its probe: the key and its score. Bytes per insert.
DYNAMIC_INSERT_INDEX_BYTES: int = INDEX_BYTES_PER_SLOT
#: Passes of a new row's bytes (values and optimizer state) over its slot's tier: the initializer writes it, the
#: lookup that inserted it reads it. Count per insert.
DYNAMIC_INSERT_ROW_PASSES: int = 2


def dynamic_miss_rate(capacity: int, distinct_keys: int, zipf_alpha: float) -> float:
    """Fraction of a dynamic table's lookups whose key has no row: 0 when ``capacity >= distinct_keys``, else
    the access mass of the ``distinct_keys - capacity`` coldest keys under Zipf(``zipf_alpha``), ``1 -
    H(capacity) / H(distinct_keys)`` (eviction keeps the hottest keys resident; ``zipf_alpha = 0`` gives ``1 -
    capacity / distinct_keys``)."""
    if distinct_keys <= capacity:
        return 0.0
    h = generalized_harmonic(np.array([capacity, distinct_keys]), zipf_alpha)
    return float(min(1.0, max(0.0, 1.0 - h[0] / h[1])))


def dynamic_priced_table(table: TableSpec, capacity: int) -> TableSpec:
    """The static table a dynamic table's resident keys are priced as: ``capacity`` rows (its slots over all ranks)
    with the table's access skew (per-row ``access_counts`` describe no slot and are dropped)."""
    return dataclasses.replace(table, rows=capacity, access_counts=None)


def dynamic_lookup_costs(
    table: TableSpec,
    options: Sequence[Tuple[Mode, float]],
    static_costs: np.ndarray,
    *,
    capacity: int,
    distinct_keys: int,
    admission: bool,
    hbm_mem_bw: float = HBM_MEM_BW,
    hbm_to_ddr_mem_bw: float = HBM_TO_DDR_MEM_BW,
) -> np.ndarray:
    """Modelled ms per step of a dynamic table's options, from ``static_costs``, the costs of its
    :func:`dynamic_priced_table`.

    With ``m = dynamic_miss_rate(capacity, distinct_keys, zipf_alpha)`` and ``L = lookups_per_step``: ``(1 - m) x
    static + L x probe + m x L x insert``. Every lookup probes the index (``DYNAMIC_PROBE_BYTES`` at HBM
    bandwidth); a lookup of a key without a row inserts it: the index entry (``DYNAMIC_INSERT_INDEX_BYTES``, plus
    a probe of the admission counters when ``admission``) and ``DYNAMIC_INSERT_ROW_PASSES`` passes of the row's
    bytes at the bandwidth mix of the new row's hit rate (1 at ``x = 1``; ``x`` HYBRID, whose hash split ignores
    access; 0 CACHING, whose cache does not hold a new row), which lowers the effective hit rate of such lookups.
    ``capacity >= distinct_keys``: the static cost plus the probe.

    Args:
        table: the table (dim, dtype, optimizer, lookups, skew).
        options: ``(mode, x)`` pairs, as ``static_costs``.
        static_costs: ``(len(options),)`` ms of the resident lookups' static formula.
        capacity: rows over all ranks.
        distinct_keys: distinct keys the table is expected to see.
        admission: whether a miss also probes the admission counters (``admit_after > 1``).
        hbm_mem_bw: HBM bandwidth in bytes/ms.
        hbm_to_ddr_mem_bw: host->device bandwidth in bytes/ms.
    """
    options = _checked_options(table, options)
    miss = dynamic_miss_rate(capacity, distinct_keys, table.zipf_alpha)
    xs = np.array([x for _, x in options], dtype=np.float64)
    caching = np.array([m is Mode.CACHING for m, _ in options], dtype=bool)
    new_hit = np.where(xs >= 1.0, 1.0, np.where(caching, 0.0, xs))
    new_bw = new_hit * hbm_mem_bw + (1.0 - new_hit) * hbm_to_ddr_mem_bw
    index_bytes = DYNAMIC_INSERT_INDEX_BYTES + (DYNAMIC_PROBE_BYTES if admission else 0)
    insert = DYNAMIC_INSERT_ROW_PASSES * row_bytes(table.dim, table.dtype, table.optimizer) / new_bw
    insert = insert + index_bytes / hbm_mem_bw
    probe = DYNAMIC_PROBE_BYTES / hbm_mem_bw
    static = np.asarray(static_costs, dtype=np.float64)
    return (1.0 - miss) * static + table.lookups_per_step * (probe + miss * insert)


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
    "DYNAMIC_INSERT_INDEX_BYTES",
    "DYNAMIC_INSERT_ROW_PASSES",
    "DYNAMIC_PROBE_BYTES",
    "EMPIRICAL_CACHING_X_EFF",
    "EMPIRICAL_HYBRID_X_EFF",
    "EMPIRICAL_X_SLOPE",
    "EmpiricalCostModel",
    "dynamic_lookup_costs",
    "dynamic_miss_rate",
    "dynamic_priced_table",
    "fast_tier_hit_rate",
    "generalized_harmonic",
    "make_cost_model",
]
