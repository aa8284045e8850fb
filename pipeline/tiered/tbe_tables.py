"""fbgemm's TBE (``SplitTableBatchedEmbeddingBagsCodegen``) tables for a tiered shard.

:func:`plan_fbgemm_tier` (pure, no fbgemm import) maps a placement to tables: ``x == 1`` one
``DEVICE`` table; ``CACHING(x)`` one ``MANAGED_CACHING`` table (the HBM cache holds values only);
``HYBRID(x)`` a ``DEVICE`` plus a ``MANAGED`` table, split by the shard's hash; ``compute_device=
"cpu"`` builds ``HOST`` tables (no cache), for tests. :func:`tbe_counters` / :func:`undo_tbe_lookup`
take back a discarded lookup's counters. May import ``recpipe.pipeline.placement`` and ``.tiered.optim``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import nn

from recpipe.pipeline.placement import (
    FBGEMM_CACHE_ASSOC,
    CachePolicy,
    FusedOptimizerKind,
    Mode,
    cache_policy_spec,
    fbgemm_cache_sets,
    tier_rows,
)
from recpipe.pipeline.tiered.optim import HYPER_PARAMETERS, TieredOptimizerConfig

__all__ = [
    "FbgemmTable",
    "FbgemmTierPlan",
    "Layout",
    "fbgemm_tbe_kwargs",
    "plan_fbgemm_tier",
    "tbe_counters",
    "undo_tbe_lookup",
]

# recpipe fused optimizer -> fbgemm ``EmbOptimType`` member name.
_OPTIM_TYPES: Dict[FusedOptimizerKind, str] = {
    FusedOptimizerKind.SGD: "EXACT_SGD",
    FusedOptimizerKind.ROWWISE_ADAGRAD: "EXACT_ROWWISE_ADAGRAD",
    FusedOptimizerKind.ADAM: "ADAM",
}
_COMPUTE_DEVICES: Tuple[str, ...] = ("cuda", "cpu")


class Layout(enum.StrEnum):
    """How a shard's rows map onto fbgemm tables."""

    ALL_FAST = "ALL_FAST"
    """One DEVICE table (``x == 1``)."""
    HYBRID = "HYBRID"
    """A DEVICE table then a MANAGED table, split by the shard's hash."""
    CACHING = "CACHING"
    """One MANAGED_CACHING table (UVM backing store, HBM cache)."""


@dataclass(frozen=True)
class FbgemmTable:
    """One table of the shard's TBE: rows, fbgemm ``EmbeddingLocation`` name, holds fast-tier rows."""

    rows: int
    location: str
    fast: bool


@dataclass(frozen=True)
class FbgemmTierPlan:
    """What the fbgemm path builds for one shard: tables (one feature each, fast first), cache,
    fbgemm enum names and the optimizer's hyper-parameters (plain data)."""

    layout: Layout
    num_rows: int
    embedding_dim: int
    fast_rows: int
    tables: Tuple[FbgemmTable, ...]
    cache_sets: int
    cache_algorithm: Optional[str]
    optimizer: FusedOptimizerKind
    optim_type: str
    learning_rate: float
    eps: float
    beta1: float
    beta2: float
    weight_decay: float
    compute_device: str

    @property
    def cache_slots(self) -> int:
        """Slots of the HBM cache: ``cache_sets * FBGEMM_CACHE_ASSOC`` (0 without a cache)."""
        return self.cache_sets * FBGEMM_CACHE_ASSOC

    @property
    def split_map(self) -> bool:
        """Whether the shard keeps the int32 hashed-position map (HYBRID with both tables)."""
        return self.layout is Layout.HYBRID


def plan_fbgemm_tier(
    *,
    num_rows: int,
    embedding_dim: int,
    mode: Union[Mode, str],
    cache_load_factor: float,
    cache_policy: Union[CachePolicy, str],
    optimizer: TieredOptimizerConfig,
    compute_device: str = "cuda",
) -> FbgemmTierPlan:
    """Maps a shard's placement (rows per tier as ``placement.tier_rows``) to fbgemm TBE tables.

    A CACHING cache gets ``max(1, floor(x * R) // 32)`` sets of 32 ways. ``embedding_dim``
    must be a positive multiple of 4 (fbgemm's requirement).
    """
    if not isinstance(embedding_dim, int) or embedding_dim <= 0 or embedding_dim % 4:
        raise ValueError(
            f"embedding_dim={embedding_dim!r}: fbgemm's TBE needs a positive multiple of 4 (as torchrec's FUSED "
            "tables do); use such a dim for tiered tables on CUDA, or backend='torch' (device-generic torch ops, "
            "slower)."
        )
    if not isinstance(num_rows, int) or num_rows < 1:
        raise ValueError(
            f"num_rows must be an int >= 1 for an fbgemm table, got {num_rows!r} "
            "(an empty shard has no table to build)."
        )
    if compute_device not in _COMPUTE_DEVICES:
        raise ValueError(f"compute_device must be one of {list(_COMPUTE_DEVICES)}, got {compute_device!r}.")
    layout, tables, cache_sets, algorithm = _fbgemm_tables(
        num_rows, Mode.parse(mode), cache_load_factor, CachePolicy.parse(cache_policy), compute_device == "cpu"
    )
    fast_rows = tier_rows(num_rows, mode, cache_load_factor)[0]
    opt = FusedOptimizerKind.parse(optimizer.optimizer)
    return FbgemmTierPlan(
        layout=layout,
        num_rows=num_rows,
        embedding_dim=embedding_dim,
        fast_rows=fast_rows,
        tables=tables,
        cache_sets=cache_sets,
        cache_algorithm=algorithm,
        optimizer=opt,
        optim_type=_OPTIM_TYPES[opt],
        **{k: float(getattr(optimizer, k)) for k in HYPER_PARAMETERS},
        compute_device=compute_device,
    )


def _fbgemm_tables(
    num_rows: int, mode: Mode, x: float, policy: CachePolicy, cpu: bool
) -> Tuple[Layout, Tuple[FbgemmTable, ...], int, Optional[str]]:
    """``(layout, tables fast first, cache sets, cache algorithm)`` of a shard's placement."""
    fast_rows, slow_rows, slots = tier_rows(num_rows, mode, x)

    def loc(name: str) -> str:
        return "HOST" if cpu else name

    if slow_rows == 0:
        return Layout.ALL_FAST, (FbgemmTable(num_rows, loc("DEVICE"), True),), 0, None
    if mode is Mode.CACHING:
        return (
            Layout.CACHING,
            (FbgemmTable(num_rows, loc("MANAGED_CACHING"), False),),
            0 if cpu else fbgemm_cache_sets(slots),
            cache_policy_spec(policy).fbgemm_algorithm,
        )
    if fast_rows == 0:
        return Layout.HYBRID, (FbgemmTable(slow_rows, loc("MANAGED"), False),), 0, None
    tables = (FbgemmTable(fast_rows, loc("DEVICE"), True), FbgemmTable(slow_rows, loc("MANAGED"), False))
    return Layout.HYBRID, tables, 0, None


def fbgemm_tbe_kwargs(plan: FbgemmTierPlan, device: Optional[torch.device] = None) -> Dict[str, Any]:
    """Keyword arguments of ``SplitTableBatchedEmbeddingBagsCodegen`` for a plan (on ``device``,
    default ``plan.compute_device``)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        CacheAlgorithm,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice

    cpu = plan.compute_device == "cpu"
    compute = ComputeDevice.CPU if cpu else ComputeDevice.CUDA
    kwargs: Dict[str, Any] = {
        "embedding_specs": [(t.rows, plan.embedding_dim, EmbeddingLocation[t.location], compute) for t in plan.tables],
        "feature_table_map": list(range(len(plan.tables))),
        "optimizer": EmbOptimType[plan.optim_type],
        **{k: getattr(plan, k) for k in HYPER_PARAMETERS},
        "pooling_mode": PoolingMode.SUM,
        "stochastic_rounding": False,
        # ids are checked on the device before the lookup (torch._assert_async);
        # fbgemm's WARNING mode would clamp silently.
        "bounds_check_mode": BoundsCheckMode.NONE,
        "device": device if device is not None else torch.device(plan.compute_device),
    }
    if plan.cache_algorithm is not None:
        kwargs["cache_algorithm"] = CacheAlgorithm[plan.cache_algorithm]
    if plan.cache_sets:
        kwargs["cache_sets"] = plan.cache_sets
        kwargs["cache_load_factor"] = plan.cache_slots / plan.num_rows
    return kwargs


TbeCounters = Tuple[Optional[int], Optional[int]]
"""An fbgemm TBE's lookup counters (``step``, ``iter_cpu``), by :func:`tbe_counters`."""


def tbe_counters(tbe: nn.Module) -> TbeCounters:
    """An fbgemm TBE's ``(step, iter_cpu)`` lookup counters (host values, no device sync;
    None for each the module lacks)."""
    step = getattr(tbe, "step", None)
    it = getattr(tbe, "iter_cpu", None)
    return (step if isinstance(step, int) else None, int(it) if isinstance(it, torch.Tensor) else None)


def undo_tbe_lookup(tbe: nn.Module, before: TbeCounters, after: TbeCounters) -> None:
    """Takes back one discarded lookup's counter increments (:func:`tbe_counters` ``before`` /
    ``after`` it), keeping those of later lookups. fbgemm adds 1 to ``iter`` per lookup (its
    host copy may first re-sync from a loaded ``iter``, so only whether it moved counts)."""
    counters: Any = tbe  # fbgemm's TBE keeps ``step`` / ``iter`` as attributes nn.Module does not declare
    if before[0] is not None and after[0] is not None:
        counters.step -= after[0] - before[0]
    if before[1] is not None and after[1] is not None and after[1] != before[1]:
        counters.iter_cpu.sub_(1)
        counters.iter.sub_(1)
