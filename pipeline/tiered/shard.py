"""Tiered embedding storage: one row-wise shard split between a fast and a slow tier.

A :class:`TieredEmbeddingShard` owns the ``R`` local rows a rank holds of one
table under row-wise sharding (roundrobin / hash_roundrobin / continuous routing,
see :mod:`recpipe.pipeline.routing.ops`). Its rows live in two tiers:

* **fast tier**: HBM on CUDA (``device``); on CPU a separate host buffer.
* **slow tier**: host DDR (pinned when ``device`` is CUDA).

Placement (``recpipe.pipeline.placement.Mode``) with cache load factor ``x``:

* ``HYBRID(x)``: a seeded bijective hash ``H`` of ``[0, R)`` (the recpipe
  hash_roundrobin bijection with ``W = 1``) puts local row ``r`` in the fast tier
  at ``H(r)`` when ``H(r) < floor(x * R)``, else in the slow tier at
  ``H(r) - floor(x * R)``. No per-row metadata.
* ``CACHING(x)``: every row lives in the slow tier; ``floor(x * R)`` fast slots
  cache rows, with a row -> slot map and slot -> row / score maps in the fast
  tier. Misses are loaded into the cache before the lookup (LFU: when their access
  count beats the least frequently used slot; LRU: always, evicting the least
  recently used slot); rows a batch needs that do not get a slot are read from and
  updated in the slow tier directly (fbgemm's UVM-cache behaviour). Evicted dirty
  rows are written back; :meth:`~TieredEmbeddingShard.flush` and ``state_dict()``
  write back every dirty slot.
* ``x == 1.0``: every row in the fast tier.

Every tier buffer is sized with ``recpipe.pipeline.placement.tier_rows`` so the
bytes allocated per tier equal ``recpipe.pipeline.placement.shard_storage`` (see
:meth:`~TieredEmbeddingShard.tier_bytes`).

The optimizer is fused into the backward like fbgemm's TBE: the lookup is a custom
``autograd.Function`` whose backward sums the gradient per unique row, applies
SGD / row-wise Adagrad / Adam in place in whichever tier each row lives and
returns no weight gradient. The optimizer state of a row lives and moves with it.

Backends (``backend=``; the default follows the device):

* ``native`` (CPU): each step runs in the compiled ops ``torch.ops.recpipe.tiered_lookup``
  and ``tiered_backward`` (``csrc/tiered.cpp``).
* ``fbgemm`` (CUDA): fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen``
  (:mod:`recpipe.pipeline.tiered.fbgemm`): CACHING as a ``MANAGED_CACHING`` table
  (fbgemm's set-associative UVM cache, LRU / LFU), HYBRID as a ``DEVICE`` +
  ``MANAGED`` table pair split by the same hash, the fused optimizer fbgemm's. No
  host sync in a training step. fbgemm's cache admission and byte layout differ
  from the rules above (see that module); values and updates agree to float rounding.
  On CPU this backend builds the same tables as fbgemm HOST tables (tests).
* ``torch`` (other devices): the same rules as ``native`` in device-generic torch ops
  (``_lookup_torch``, ``_backward_torch``), the reference the kernel is tested
  against bit for bit on the cache maps. Its ``unique`` / mask indexing / admission
  count read the device, so it is not sync-free.

Every backend's hit / traffic counters live in the int64 ``_stats`` tensor, updated
on the device, and are read on the host only by :meth:`tier_stats`.

Metadata encodings (they keep the metadata inside the planner's byte budget of
``CACHE_ROW_MAP_BYTES`` per row and ``CACHE_SLOT_BYTES`` per slot):

* ``row_map[r] >= 0``: slot of cached row ``r``; ``row_map[r] = -(c + 1)``: row
  not cached, accessed ``c`` times so far (LFU keeps full access history, so a hot
  row that was evicted or never admitted is re-admitted as soon as it is hotter
  than the coldest slot). LRU uses ``-1`` for every uncached row.
* ``slot_score[s] = (key << 1) | dirty`` with ``key`` the access count (LFU) or
  the last step the slot was used (LRU); ``slot_row[s] = -1`` for a free slot.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn

from recpipe.pipeline.tiered.fbgemm import FbgemmTier, plan_fbgemm_tier, split_tier
from recpipe.pipeline.tiered.optim import FusedOptimizer, TieredOptimizerConfig
from recpipe.pipeline.routing.ops import (
    ROUTING_VERSION,
    TIERED_MODES,
    TIERED_OPTIMIZERS,
    TIERED_POLICIES,
    TIERED_POOLINGS,
    TIERED_STATS,
    check_dist_type as _check_dist_type,
    check_int,
    global_row_ids,
    route_ids,
    shard_num_rows,
)
from recpipe.pipeline.placement import (
    TIERED_DTYPES,
    CachePolicy,
    Mode,
    ShardStorage,
    dtype_itemsize,
    row_bytes,
    tier_rows,
)

__all__ = [
    "BACKENDS",
    "CachePolicy",
    "FusedOptimizer",
    "TieredEmbeddingShard",
    "TieredOptimizerConfig",
    "TieredShardState",
    "TieredCheckpointError",
    "bounds_check_mode_of",
    "global_row_ids",
    "non_finite_rows",
    "resolve_backend",
    "shard_num_rows",
]

#: Rows of an export routed and copied at a time by :meth:`TieredEmbeddingShard.load_states`
#: (bounds the load's extra memory to the shard's own rows plus one chunk).
LOAD_CHUNK_ROWS: int = 1 << 20

#: Rows written to the tiers at a time when a shard's rows are set whole (loads): 64 Ki rows,
#: 16 MiB of copies at dim 64 fp32, however large the shard.
WRITE_CHUNK_ROWS: int = 1 << 16

#: Version of the export format written in ``TieredShardState.metadata``.
#: 2 adds ``routing_version`` (``recpipe.pipeline.routing.ops.ROUTING_VERSION``); version 1
#: exports lack it and were routed by hash_roundrobin version 1.
CHECKPOINT_VERSION: int = 2


#: fused param naming how a lookup treats ids outside the table (fbgemm's, torchrec's).
FUSED_PARAM_BOUNDS_CHECK_MODE: str = "bounds_check_mode"

#: fbgemm's ``V2_*`` modes and the mode each checks as (its TBE maps them so too).
_V2_BOUNDS_CHECK_MODES: Dict[str, str] = {"V2_IGNORE": "IGNORE", "V2_WARNING": "WARNING", "V2_FATAL": "FATAL"}


def bounds_check_mode_of(fused_params: Optional[Mapping[str, Any]], table_name: str) -> BoundsCheckMode:
    """The ``bounds_check_mode`` a table's lookups apply, as fbgemm's TBE resolves it.

    fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` (torchrec's FUSED tables) takes the
    fused param ``bounds_check_mode`` (default ``BoundsCheckMode.WARNING``), overridden by
    the environment variable ``FBGEMM_TBE_BOUNDS_CHECK_MODE`` (an int), with the ``V2_*``
    modes checking as the mode they name.

    Args:
        fused_params (Mapping[str, Any] | None): the table's fused params.
        table_name (str): the table, for errors.

    Returns:
        BoundsCheckMode: ``FATAL``, ``WARNING``, ``IGNORE`` or ``NONE``.

    Raises:
        ValueError: naming the table and the fix, for a value that is not a ``BoundsCheckMode``.
    """
    value: Any = (fused_params or {}).get(FUSED_PARAM_BOUNDS_CHECK_MODE, BoundsCheckMode.WARNING)
    where = f"fused param {FUSED_PARAM_BOUNDS_CHECK_MODE!r}"
    env = os.environ.get("FBGEMM_TBE_BOUNDS_CHECK_MODE")
    if env is not None:
        value, where = env, "environment variable FBGEMM_TBE_BOUNDS_CHECK_MODE"
    return _parse_bounds_check_mode(value, where, table_name)


def _parse_bounds_check_mode(value: Any, where: str, table_name: str) -> BoundsCheckMode:
    """``value`` (a ``BoundsCheckMode`` or its int value) as the mode it checks as (``V2_*``
    as the mode they name); ``where`` names the argument in the error."""
    try:
        if isinstance(value, BoundsCheckMode):
            mode = value
        elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
            mode = BoundsCheckMode(int(value))
        elif isinstance(value, int) and not isinstance(value, bool):
            mode = BoundsCheckMode(value)
        else:
            raise ValueError(value)
    except ValueError:
        raise ValueError(
            f"tiered table {table_name!r}: {where} must be an fbgemm BoundsCheckMode (or its int value), got "
            f"{type(value).__name__} {value!r}; pass e.g. fused_params={{'bounds_check_mode': "
            "BoundsCheckMode.WARNING}} (from fbgemm_gpu.split_table_batched_embeddings_ops_common), as for "
            "torchrec's FUSED tables."
        ) from None
    return BoundsCheckMode[_V2_BOUNDS_CHECK_MODES.get(mode.name, mode.name)]


class TieredCheckpointError(ValueError):
    """A tiered-table export cannot be loaded into this shard (metadata mismatch,
    missing or duplicated rows). The message lists numbered possible solutions."""


#: The tiered kernels a shard can run (``TieredEmbeddingShard(backend=...)``).
BACKENDS: Tuple[str, ...] = ("native", "fbgemm", "torch")


def resolve_backend(backend: Optional[str], device: torch.device) -> str:
    """A shard's backend: the given one (validated against the device) or the device's default.

    Args:
        backend (Optional[str]): one of :data:`BACKENDS`, or None.
        device (torch.device): the shard's (fast-tier) device.

    Returns:
        str: ``backend``, or ``native`` on CPU, ``fbgemm`` on CUDA, ``torch`` elsewhere.

    Raises:
        ValueError: naming ``backend``, for an unknown one or one that cannot run on ``device``.
    """
    if backend is None:
        return {"cpu": "native", "cuda": "fbgemm"}.get(device.type, "torch")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)} or None (the device's default), got {backend!r}.")
    if backend == "native" and device.type != "cpu":
        raise ValueError(f"backend 'native' (the compiled CPU kernel) cannot run on {device}: use backend=None "
                         "('fbgemm' on CUDA) or 'torch'.")
    if backend == "fbgemm" and device.type not in ("cpu", "cuda"):
        raise ValueError(f"backend 'fbgemm' runs on cpu or cuda, not {device}: use backend='torch'.")
    return backend


@dataclass
class TieredShardState:
    """Export of one shard: global row ids, values and optimizer state.

    Args:
        global_ids (torch.Tensor): ``[n]`` int64 global row ids (local id order).
        weights (torch.Tensor): ``[n, dim]`` row values.
        optimizer_state (torch.Tensor): ``[n, state_cols]`` fp32 optimizer state.
        step (int): optimizer step counter (Adam bias correction).
        metadata (Dict[str, Any]): table, routing (``dist_type``, ``routing_seed``,
            ``world_size``, ``rank``) and ``placement`` of the exporting shard.
    """

    global_ids: torch.Tensor
    weights: torch.Tensor
    optimizer_state: torch.Tensor
    step: int
    metadata: Dict[str, Any] = field(default_factory=dict)


def non_finite_rows(weights: torch.Tensor, optimizer_state: torch.Tensor) -> Optional[torch.Tensor]:
    """Which rows hold a NaN / inf value or optimizer state (a bool per row), or None when
    none does (two reductions per tensor: the usual case allocates nothing row-sized)."""
    parts = [t for t in (weights, optimizer_state) if t.numel()]
    if all(bool(torch.isfinite(torch.stack([t.amax(), t.amin()])).all()) for t in parts):
        return None
    bad = torch.zeros(weights.shape[0], dtype=torch.bool, device=weights.device)
    for t in parts:
        bad |= (~torch.isfinite(t.reshape(t.shape[0], -1))).any(dim=1)
    return bad


def _bag_lengths_and_ids(offsets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(lengths [B], bag of each id [n])`` of ``B + 1`` bag offsets (int64, offsets' device)."""
    offsets = offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    return lengths, torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)


class _TieredLookup(torch.autograd.Function):
    """Pooled lookup whose backward applies the fused optimizer to the tiers."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        anchor: torch.Tensor,
        shard: "TieredEmbeddingShard",
        ids: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor],
    ) -> torch.Tensor:
        lookup = shard._lookup if shard._native else shard._lookup_torch
        out, uniq, inverse = lookup(ids, offsets, per_sample_weights)
        ctx.shard = shard
        # the optimizer hyper-parameters of the lookup, as fbgemm's TBE hands its backward (a
        # change between forward and backward, e.g. zero_grad() after the forward, applies next time)
        ctx.optimizer = copy.copy(shard.optimizer)
        ctx.save_for_backward(uniq, inverse, offsets, per_sample_weights)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        uniq, inverse, offsets, psw = ctx.saved_tensors
        shard: TieredEmbeddingShard = ctx.shard
        # per-sample weights that need a gradient (e.g. a feature processor's position
        # weights): read the rows before this backward updates them, as fbgemm's TBE does
        grad_psw = shard._psw_grad(grad_out, uniq, inverse, offsets) if ctx.needs_input_grad[4] else None
        update = shard._backward_update if shard._native else shard._backward_torch
        update(grad_out, uniq, inverse, offsets, psw, ctx.optimizer)
        return None, None, None, None, grad_psw


class TieredEmbeddingShard(nn.Module):
    """One row-wise shard of an embedding-bag table stored in a fast and a slow tier.

    Args:
        num_embeddings (int): rows ``N`` of the whole (global) table.
        embedding_dim (int): embedding dimension.
        mode (Mode | str): ``HYBRID`` or ``CACHING``.
        cache_load_factor (float): ``x`` in ``(0, 1]``: fast rows (HYBRID) or cache
            slots (CACHING) are ``floor(x * R)``; ``1.0`` puts every row in the fast tier.
        optimizer (TieredOptimizerConfig | None): fused optimizer (default SGD lr 0.01).
        pooling (str): ``sum`` or ``mean``.
        cache_policy (CachePolicy | str): ``lfu`` (default) or ``lru``; CACHING only.
        rank (int): rank owning this shard.
        world_size (int): ranks the table is sharded over.
        dist_type (str): routing of the table: ``hash_roundrobin`` (recpipe default),
            ``roundrobin`` or ``continuous``.
        routing_seed (int): seed of the hash_roundrobin routing.
        split_seed (int): seed of the HYBRID fast/slow split hash.
        dtype (torch.dtype): row dtype (only ``torch.float32`` is supported).
        device (torch.device | str | None): fast-tier device (default CPU).
        table_name (str): name recorded in exports and errors.
        backend (str | None): ``native`` (the compiled CPU kernel), ``fbgemm``
            (fbgemm's TBE, :mod:`recpipe.pipeline.tiered.fbgemm`; on CPU its tables
            are HOST tables without a cache, for tests) or ``torch`` (device-generic
            torch ops, the kernel's test reference). Default: ``native`` on CPU,
            ``fbgemm`` on CUDA, ``torch`` elsewhere.
        weight_init_min (float | None): low end of the uniform initial rows (default
            ``-sqrt(1 / num_embeddings)``, torchrec's ``get_weight_init_min``).
        weight_init_max (float | None): high end (default ``sqrt(1 / num_embeddings)``).
        bounds_check_mode (BoundsCheckMode | None): what a lookup does with a local id
            ``>= num_rows``, as fbgemm's TBE on CPU: ``FATAL`` (default; the tiered
            sharders pass the table's fused param, default ``WARNING`` as fbgemm's) and
            ``NONE`` raise an ``IndexError`` naming the table (fbgemm's CPU kernel raises
            under ``NONE`` too); ``WARNING`` (with a warning) and ``IGNORE`` look local
            row 0 up in its place (its gradient updates row 0), the id's per-sample weight
            kept. A negative local id raises under every mode, as in fbgemm's CPU TBE.

    Example::

        shard = TieredEmbeddingShard(num_embeddings=1000, embedding_dim=16,
                                     mode=Mode.CACHING, cache_load_factor=0.2)
        out = shard(ids, offsets)            # [B, 16]; ids are LOCAL row ids
        out.sum().backward()                 # updates the rows in place
        shard.tier_stats()["hit_rate"]
    """

    def __init__(
        self,
        *,
        num_embeddings: int,
        embedding_dim: int,
        mode: Union[Mode, str],
        cache_load_factor: float,
        optimizer: Optional[TieredOptimizerConfig] = None,
        pooling: str = "sum",
        cache_policy: Union[CachePolicy, str] = CachePolicy.LFU,
        rank: int = 0,
        world_size: int = 1,
        dist_type: str = "hash_roundrobin",
        routing_seed: int = 0,
        split_seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: Optional[Union[torch.device, str]] = None,
        table_name: str = "table",
        backend: Optional[str] = None,
        weight_init_min: Optional[float] = None,
        weight_init_max: Optional[float] = None,
        bounds_check_mode: Optional[BoundsCheckMode] = None,
    ) -> None:
        super().__init__()
        self.mode: Mode = Mode.parse(mode)
        self.bounds_check_mode: BoundsCheckMode = (
            BoundsCheckMode.FATAL if bounds_check_mode is None
            else _parse_bounds_check_mode(bounds_check_mode, "bounds_check_mode", table_name))
        x = cache_load_factor
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 < float(x) <= 1.0:
            raise ValueError(
                f"cache_load_factor must be in (0, 1], got {x!r}: use e.g. 0.1 ... 1.0 "
                "(1.0 = every row in the fast tier)."
            )
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be a positive int, got {embedding_dim!r}.")
        if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int) or num_embeddings <= 0:
            raise ValueError(f"num_embeddings must be a positive int, got {num_embeddings!r}.")
        if pooling not in ("sum", "mean"):
            raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}.")
        if optimizer is not None and not isinstance(optimizer, TieredOptimizerConfig):
            raise ValueError(
                f"tiered table {table_name!r}: optimizer must be a TieredOptimizerConfig or None, got "
                f"{type(optimizer).__name__} {optimizer!r}; pass e.g. TieredOptimizerConfig(optimizer='adam', "
                "learning_rate=0.01)."
            )
        if dtype not in TIERED_DTYPES:
            raise ValueError(
                f"tiered table {table_name!r}: dtype {dtype} is not supported by the tiered kernel yet: "
                "use torch.float32 (the table's data_type DataType.FP32)."
            )
        self.cache_load_factor: float = float(x)
        self.optimizer: TieredOptimizerConfig = optimizer or TieredOptimizerConfig()
        self.pooling: str = pooling
        self.cache_policy: CachePolicy = CachePolicy.parse(cache_policy)
        self.dist_type: str = _check_dist_type(dist_type)
        self.num_embeddings: int = num_embeddings
        self.embedding_dim: int = embedding_dim
        self.rank: int = rank
        self.world_size: int = world_size
        self.routing_seed: int = check_int(routing_seed, "routing_seed", -(2**63), 2**63 - 1)
        self.split_seed: int = check_int(split_seed, "split_seed", -(2**63), 2**63 - 1)
        self.dtype: torch.dtype = dtype
        self.table_name: str = table_name
        bound = math.sqrt(1.0 / num_embeddings)
        init = [-bound if weight_init_min is None else weight_init_min,
                bound if weight_init_max is None else weight_init_max]
        for name, v in zip(("weight_init_min", "weight_init_max"), init):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ValueError(f"tiered table {table_name!r}: {name} must be a finite number or None, got {v!r}; "
                                 "set it in the table's EmbeddingBagConfig (or leave it None for +-sqrt(1 / rows)).")
        if init[0] > init[1]:
            raise ValueError(f"tiered table {table_name!r}: weight_init_min={init[0]} exceeds weight_init_max="
                             f"{init[1]}; swap them in the table's EmbeddingBagConfig.")
        self.weight_init_range: Tuple[float, float] = (float(init[0]), float(init[1]))
        self.device: torch.device = torch.device(device) if device is not None else torch.device("cpu")
        self.num_rows: int = shard_num_rows(num_embeddings, world_size, rank, dist_type)
        self.backend: str = resolve_backend(backend, self.device)

        R = self.num_rows
        self.fast_rows, self.slow_rows, self.cache_slots = tier_rows(R, self.mode, self.cache_load_factor)
        self.all_fast: bool = self.slow_rows == 0 and self.cache_slots == 0
        self.caching: bool = self.mode is Mode.CACHING and self.cache_load_factor < 1.0
        self.row_bytes: int = row_bytes(embedding_dim, dtype, self.optimizer.name)
        # Bytes a cache load / write-back moves per row: values and optimizer state, except
        # in fbgemm's cache, which holds values only (the state stays in UVM).
        self.moved_row_bytes: int = (embedding_dim * dtype_itemsize(dtype) if self.backend == "fbgemm"
                                     else self.row_bytes)
        cols = self.optimizer.state_cols(embedding_dim)
        self.state_cols: int = cols
        slow_device = torch.device("cpu")
        pin = self.device.type == "cuda" and torch.cuda.is_available()

        def slow(shape: Tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=slow_device, pin_memory=pin)

        self.__dict__["_fbgemm"] = None  # Optional[FbgemmTier], set below for backend "fbgemm"
        self._fbgemm: Optional[FbgemmTier]
        fbgemm = self.backend == "fbgemm"  # fbgemm's TBE holds the rows: the buffers below stay empty
        n_fast = 0 if fbgemm else self.fast_rows + self.cache_slots
        n_slow = 0 if fbgemm else self.slow_rows
        self.fast_weights: torch.Tensor = torch.zeros((n_fast, embedding_dim), dtype=dtype, device=self.device)
        self.fast_state: torch.Tensor = torch.zeros((n_fast, cols), dtype=torch.float32, device=self.device)
        self.slow_weights: torch.Tensor = slow((n_slow, embedding_dim), dtype)
        self.slow_state: torch.Tensor = slow((n_slow, cols), torch.float32)
        if self.caching and not fbgemm:
            self.row_map: Optional[torch.Tensor] = torch.full((R,), -1, dtype=torch.int64, device=self.device)
            self.slot_row: Optional[torch.Tensor] = torch.full(
                (self.cache_slots,), -1, dtype=torch.int64, device=self.device
            )
            self.slot_score: Optional[torch.Tensor] = torch.zeros(
                (self.cache_slots,), dtype=torch.int64, device=self.device
            )
        else:
            self.row_map = self.slot_row = self.slot_score = None
        self.step: int = 0
        # The step Adam's bias correction counts on (native and torch backends): fbgemm's host
        # counter iter_cpu, which follows step but re-reads it only while 0 (set_optimizer_step).
        self._opt_iter: int = 0
        self._step_sets: int = 0  # loads that set the step (_set_step), for undo_lookup
        # Bulk writes of the rows (init, load_global_weights, load_states): lets the
        # fused pipeline see a table written between steps (train_pipeline.tables_version).
        self.rows_writes: int = 0
        self._clock: int = 0  # lookups so far; the LRU recency key (native and torch backends)
        # Counters of the last lookup, then their running totals (layout: ops.TIERED_STATS);
        # updated in place by the kernel, read on the host only by tier_stats().
        self._stats: torch.Tensor = torch.zeros(2 * len(TIERED_STATS), dtype=torch.int64, device=self.device)
        self._flushed_rows: int = 0
        # The torch path's counters of the current lookup: host ints, or 0-d device tensors
        # for the sums (not read back; stacked on the device into _stats).
        self._last: Dict[str, Union[int, torch.Tensor]] = {}
        # The compiled kernel (csrc/tiered.cpp) runs the CPU shards. Other devices use the
        # device-generic torch-op path below (_lookup_torch / _backward_torch), which is also
        # the reference the kernel is tested against.
        self._native: bool = self.backend == "native"
        if self.backend == "fbgemm" and embedding_dim % 4:
            # checked on every rank, also one holding no rows (it builds no fbgemm table),
            # so no rank of a sharded model goes on while another refuses the table
            raise ValueError(
                f"tiered table {table_name!r}: embedding_dim={embedding_dim} is not a multiple of 4, which "
                "fbgemm's TBE (backend 'fbgemm') needs, as torchrec's FUSED tables do. Possible solutions:\n"
                "  1. use a dim that is a multiple of 4 in the table's config;\n"
                "  2. run the table on another backend: backend='native' on CPU (the tiered sharders' backend= "
                "argument), or 'torch' on other devices."
            )
        if self.backend == "fbgemm" and R > 0:
            plan = plan_fbgemm_tier(num_rows=R, embedding_dim=embedding_dim, mode=self.mode,
                                    cache_load_factor=self.cache_load_factor, cache_policy=self.cache_policy,
                                    optimizer=self.optimizer, compute_device=self.device.type)
            # Not a registered submodule: the TBE's tensors must not appear in state_dict() (the
            # shard exports its rows itself) nor in parameters() (fbgemm updates them in backward).
            split_pos = self._split_hash(torch.arange(R, dtype=torch.int64)) if plan.split_map else None
            self.__dict__["_fbgemm"] = FbgemmTier(plan, split_pos=split_pos, pooling=pooling,
                                                  device=self.device, stats=self._stats)
        no_cache = torch.empty(0, dtype=torch.int64, device=self.device)
        self._op_row_map: torch.Tensor = self.row_map if self.row_map is not None else no_cache
        self._op_slot_row: torch.Tensor = self.slot_row if self.slot_row is not None else no_cache
        self._op_slot_score: torch.Tensor = self.slot_score if self.slot_score is not None else no_cache
        self._op_mode: int = TIERED_MODES[
            "ALL_FAST" if self.all_fast else ("CACHING" if self.caching else "HYBRID")]
        self._op_policy: int = TIERED_POLICIES[self.cache_policy.value]
        self._op_pooling: int = TIERED_POOLINGS[self.pooling]
        self.reset_parameters()

    # ------------------------------------------------------------------ sizing
    def tier_tensors(self) -> Dict[str, List[Tuple[str, torch.Tensor]]]:
        """Every tensor the shard allocated: the two tiers' buffers, and the kernel's counters.

        Returns:
            Dict[str, List[Tuple[str, torch.Tensor]]]: ``{"fast": [...], "slow": [...],
            "counters": [...]}``. ``counters`` is not table storage: the statistics
            (``2 * len(ops.TIERED_STATS)`` int64 = 112 bytes per shard, on the fast
            tier's device) and, when the shard has no cache, the empty (0-byte) tensor
            the kernel gets for its cache maps.
        """
        counters = [("stats", self._stats)]
        if self.backend == "fbgemm":
            tiers = self._fbgemm.tier_tensors() if self._fbgemm is not None else {"fast": [], "slow": []}
            return {"fast": tiers["fast"], "slow": tiers["slow"], "counters": counters}
        fast = [("fast_weights", self.fast_weights), ("fast_state", self.fast_state)]
        if self.caching:
            assert self.row_map is not None and self.slot_row is not None and self.slot_score is not None
            fast += [("row_map", self.row_map), ("slot_row", self.slot_row), ("slot_score", self.slot_score)]
        else:
            counters.append(("no_cache", self._op_row_map))
        return {"fast": fast, "slow": [("slow_weights", self.slow_weights), ("slow_state", self.slow_state)],
                "counters": counters}

    def tier_bytes(self) -> ShardStorage:
        """Bytes allocated per tier, read from the tensors' storages.

        Returns:
            ShardStorage: equals ``recpipe.pipeline.placement.shard_storage(num_rows,
            embedding_dim, dtype, optimizer, mode, cache_load_factor)`` for the
            ``native`` and ``torch`` backends; for ``fbgemm`` on CUDA,
            ``recpipe.pipeline.tiered.fbgemm.fbgemm_tier_bytes`` of the shard's plan.
        """
        tiers = self.tier_tensors()
        return ShardStorage(
            fast_bytes=sum(t.untyped_storage().nbytes() for _, t in tiers["fast"]),
            slow_bytes=sum(t.untyped_storage().nbytes() for _, t in tiers["slow"]),
        )

    # ------------------------------------------------------------- placement
    def _split_hash(self, rows: torch.Tensor) -> torch.Tensor:
        """Seeded bijection of ``[0, R)`` (recpipe hash_roundrobin with ``W = 1``)."""
        return route_ids(rows, max(self.num_rows, 1), 1, "hash_roundrobin", self.split_seed)[1]

    def _locate(self, rows: torch.Tensor) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """Tier and index of local rows: ``(in_fast mask or None if all fast, index)``."""
        if self.all_fast:
            return None, rows
        if self.caching:
            assert self.row_map is not None
            slot = self.row_map.index_select(0, rows)
            in_fast = slot >= 0
            return in_fast, torch.where(in_fast, slot, rows)
        return split_tier(self._split_hash(rows), self.fast_rows)

    def _read(self, in_fast: Optional[torch.Tensor], idx: torch.Tensor, state: bool) -> torch.Tensor:
        fast = self.fast_state if state else self.fast_weights
        slow = self.slow_state if state else self.slow_weights
        if in_fast is None:
            return fast.index_select(0, idx)
        out = torch.empty((idx.numel(), fast.shape[1]), dtype=fast.dtype, device=self.device)
        f_pos = in_fast.nonzero().squeeze(1)
        s_pos = (~in_fast).nonzero().squeeze(1)
        out.index_copy_(0, f_pos, fast.index_select(0, idx.index_select(0, f_pos)))
        if s_pos.numel():
            s_idx = idx.index_select(0, s_pos).to(slow.device)
            out.index_copy_(0, s_pos, slow.index_select(0, s_idx).to(self.device, non_blocking=True))
        return out

    def _write(self, in_fast: Optional[torch.Tensor], idx: torch.Tensor, values: torch.Tensor, state: bool) -> None:
        fast = self.fast_state if state else self.fast_weights
        slow = self.slow_state if state else self.slow_weights
        if in_fast is None:
            fast.index_copy_(0, idx, values)
            return
        f_pos = in_fast.nonzero().squeeze(1)
        s_pos = (~in_fast).nonzero().squeeze(1)
        fast.index_copy_(0, idx.index_select(0, f_pos), values.index_select(0, f_pos))
        if s_pos.numel():
            s_idx = idx.index_select(0, s_pos).to(slow.device)
            slow.index_copy_(0, s_idx, values.index_select(0, s_pos).to(slow.device))

    def set_learning_rate(self, lr: Union[float, torch.Tensor]) -> None:
        """Sets the fused optimizer's learning rate for the following lookups (a lookup's
        backward updates with the learning rate of that lookup, as fbgemm's TBE does).

        torchrec's fused optimizers do the same from ``step()`` / ``zero_grad()``
        (``set_learning_rate`` of fbgemm's TBE), which is how an LR schedule on
        ``model.fused_optimizer`` reaches a table (see
        ``recpipe.pipeline.tiered.sharders.TieredFusedOptimizer``). As fbgemm's TBE (which fills
        its learning-rate tensor with it, ``fill_``), a 0-dim tensor is accepted, e.g. a
        param group's tensor ``lr``; its value is read once here (on CUDA a device sync).

        Args:
            lr (float | torch.Tensor): the learning rate, a finite real number >= 0 or a
                0-dim real (floating or integer) tensor holding one.

        Raises:
            ValueError: naming the table when ``lr`` is not such a number or tensor.
        """
        self.optimizer.learning_rate = self._check_lr(lr)
        if self._fbgemm is not None:
            self._fbgemm.tbe.set_learning_rate(self.optimizer.learning_rate)

    def _check_lr(self, lr: Any) -> float:
        """``lr`` as a float (see :meth:`set_learning_rate`), or a ValueError naming the table."""
        value: Optional[float] = None
        if isinstance(lr, torch.Tensor):
            if lr.dim() == 0 and not lr.is_complex() and lr.dtype is not torch.bool:
                value = float(lr.detach().item())
        elif isinstance(lr, numbers.Real) and not isinstance(lr, (bool, np.bool_)):
            value = float(lr)
        if value is None or not math.isfinite(value) or value < 0:
            what = (f"a tensor of shape {list(lr.shape)} and dtype {lr.dtype}" if isinstance(lr, torch.Tensor)
                    else repr(lr))
            raise ValueError(
                f"tiered table {self.table_name!r}: learning rate must be a finite real number >= 0 or a 0-dim "
                f"real tensor holding one (as fbgemm's TBE takes), got {what}: pass e.g. 0.01 or "
                "torch.tensor(0.01) (a 1-element tensor: lr.reshape(()))."
            )
        return value

    def set_optimizer_step(self, step: int) -> None:
        """Sets the optimizer step counter, as ``set_optimizer_step`` of fbgemm's TBE (which
        torchrec's fused optimizers call from ``model.fused_optimizer.set_optimizer_step``,
        e.g. to restore the step of a checkpoint).

        Exactly as fbgemm's TBE: the step is the table's recorded (and exported) ``step``;
        Adam's bias correction counts on a host counter that takes it at the next update only
        when it is still 0, i.e. when the table has not updated since it was built or loaded (fbgemm's
        ``iter_cpu``, which re-reads ``iter`` only while 0). So after
        ``set_optimizer_step(s)`` on a fresh or just loaded model (``load_states``,
        ``load_global_weights``, ``load_state_dict``: they set the step and restart that
        counter) the next update is step ``s + 1``; a running table keeps its bias correction
        and records ``s`` (the next export or checkpoint, and the job restored from it,
        continue from there).

        Args:
            step (int): the step, an int >= 0.

        Raises:
            ValueError: naming the table when ``step`` is not an int >= 0.
        """
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"tiered table {self.table_name!r}: optimizer step must be an int >= 0, got {step!r}: "
                             "pass the number of optimizer steps taken (e.g. the checkpoint's step).")
        self.step = int(step)
        if self._fbgemm is not None:
            self._fbgemm.set_optimizer_step(self.step)

    def _next_optimizer_step(self) -> int:
        """Counts one update (native and torch backends): the step Adam's bias correction
        uses, by fbgemm's rule (its host counter re-reads the recorded step while 0)."""
        if self._opt_iter == 0:
            self._opt_iter = self.step
        self._opt_iter += 1
        self.step += 1
        return self._opt_iter

    def update_hyper_parameters(self, params_dict: Dict[str, float]) -> None:
        """Sets fused optimizer hyper-parameters for the following lookups, as
        ``update_hyper_parameters`` of fbgemm's TBE (which torchrec's fused optimizers'
        ``update_hyper_parameters`` call): ``lr``, ``eps``, ``beta1``, ``beta2``,
        ``weight_decay`` (Adam's; SGD and row-wise Adagrad run without weight decay,
        as their tables' ``weight_decay`` fused param, so it is ignored for them).

        Args:
            params_dict (Dict[str, float]): hyper-parameter name -> value.

        Raises:
            NotImplementedError: naming the table and the parameter, for another name
                (fbgemm raises it too, e.g. for a typo).
            ValueError: naming the table, for a value out of range (nothing is set).
        """
        names = ("lr", "eps", "beta1", "beta2", "weight_decay")
        if not isinstance(params_dict, Mapping):
            raise ValueError(f"tiered table {self.table_name!r}: params_dict must be a dict of hyper-parameter "
                             f"name -> value, got {type(params_dict).__name__}; pass e.g. {{'lr': 0.01}}.")
        for name in params_dict:
            if name not in names:
                raise NotImplementedError(f"tiered table {self.table_name!r}: setting hyper-parameter {name!r} is "
                                          f"not supported (supported: {list(names)}).")
        adam = self.optimizer.optimizer is FusedOptimizer.ADAM
        fields = ("eps", "beta1", "beta2") + (("weight_decay",) if adam else ())
        updates = {k: float(v) for k, v in params_dict.items() if k in fields}
        try:  # validated on a copy: nothing is set when a value is refused
            dataclasses.replace(self.optimizer, **updates)
        except ValueError as e:
            raise ValueError(f"tiered table {self.table_name!r}: {e}") from None
        if "lr" in params_dict:
            self.set_learning_rate(params_dict["lr"])
        for key, value in updates.items():
            setattr(self.optimizer, key, value)
        if self._fbgemm is not None:
            self._fbgemm.tbe.update_hyper_parameters({k: float(v) for k, v in params_dict.items()
                                                      if k != "weight_decay" or "weight_decay" in fields})

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initializes rows like torchrec's fused kernels (uniform over ``weight_init_range``,
        by default ``+-sqrt(1 / N)``) and zeroes state.

        Each row is drawn in local-id order with the global RNG, then placed.
        """
        w = torch.empty((self.num_rows, self.embedding_dim), dtype=self.dtype).uniform_(*self.weight_init_range)
        self._load_local_rows(w.to(self.device), None, reset_cache=True)

    @torch.no_grad()
    def load_global_weights(self, weights: torch.Tensor) -> None:
        """Sets this shard's rows from a full ``[num_embeddings, dim]`` table; zeroes state.

        Args:
            weights (torch.Tensor): the global table.
        """
        self._load_local_rows(self._own_rows(weights), None, reset_cache=True)
        self._set_step(0)

    def _own_rows(self, weights: Any) -> torch.Tensor:
        """This shard's rows (local-id order, its device and dtype) of a full ``[num_embeddings,
        dim]`` table, refused naming the table unless it is one."""
        if not isinstance(weights, torch.Tensor):
            raise ValueError(f"tiered table {self.table_name!r}: weights must be a torch.Tensor of shape "
                             f"[{self.num_embeddings}, {self.embedding_dim}], got {type(weights).__name__}; "
                             "pass e.g. torch.as_tensor(weights, dtype=torch.float32).")
        if tuple(weights.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"weights must have shape [num_embeddings={self.num_embeddings}, "
                f"embedding_dim={self.embedding_dim}], got {list(weights.shape)}."
            )
        return weights.index_select(0, self.global_ids().to(weights.device)).to(self.device, self.dtype)

    @torch.no_grad()
    def load_global_optimizer_state(self, state: torch.Tensor, step: int,
                                    weights: Optional[torch.Tensor] = None) -> None:
        """Sets the optimizer state of this shard's rows from a full table's, keeping their values.

        The counterpart of :meth:`load_global_weights` for the fused optimizer state (e.g.
        a torchrec FUSED table's, gathered by ``recpipe.pipeline.tiered.sharders.gather_full_optimizer_state``):
        the rows this shard owns are picked by global id. Call it after the weights were
        loaded (:meth:`load_global_weights` zeroes the state). The step is set as after
        :meth:`load_states`: the next update is step ``step + 1`` (Adam's bias correction).

        Args:
            state (torch.Tensor): ``[num_embeddings, state_cols]`` float optimizer state in
                this shard's layout (row-wise Adagrad: the momentum; Adam: ``exp_avg`` then
                ``exp_avg_sq``; SGD: no columns), in global row order.
            step (int): the optimizer step the state was saved at, an int >= 0.
            weights (torch.Tensor | None): the full ``[num_embeddings, dim]`` table whose rows
                to load with the state, in one write (as :meth:`load_global_weights`, then
                this); None keeps the shard's values.

        Raises:
            ValueError: naming the table, for another shape, a non-finite value or a bad
                step (nothing is changed).
        """
        shape = [self.num_embeddings, self.state_cols]
        if not isinstance(state, torch.Tensor) or not state.is_floating_point() or list(state.shape) != shape:
            got = (f"a {state.dtype} tensor of shape {list(state.shape)}" if isinstance(state, torch.Tensor)
                   else type(state).__name__)
            raise ValueError(
                f"tiered table {self.table_name!r}: optimizer state must be a float tensor of shape {shape} "
                f"([num_embeddings, state columns of {self.optimizer.name}]), got {got}; pass the state of a "
                f"table with the same shape and optimizer.")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"tiered table {self.table_name!r}: optimizer step must be an int >= 0, got {step!r}: "
                             "pass the step the state was saved at.")
        gids = self.global_ids()
        local = state.detach().index_select(0, gids.to(state.device)).to(torch.float32)
        if not bool(torch.isfinite(local).all()):
            raise ValueError(f"tiered table {self.table_name!r}: the optimizer state holds NaN or inf values; "
                             "load the state of a healthy run.")
        # the shard's values: export_state flushes the cache, every value in local-id order
        values = self._own_rows(weights) if weights is not None else self.export_state().weights
        self._load_local_rows(values.to(self.device, self.dtype), local.to(self.device), reset_cache=True)
        self._set_step(int(step))

    def _set_step(self, step: int) -> None:
        """Sets the optimizer step counter (Adam bias correction), in fbgemm's TBE too."""
        self.step = int(step)
        self._step_sets += 1  # undo_lookup of a fbgemm shard without rows keeps a step set since the lookup
        self._opt_iter = 0  # the next update re-reads step, as a restored fbgemm TBE (set_optimizer_step)
        if self._fbgemm is not None:
            self._fbgemm.set_step(self.step)

    def lookup_counters(self) -> Optional[Any]:
        """The counters a lookup advances, for :meth:`undo_lookup` (host values only).

        The fbgemm backend counts optimizer steps in the lookup, as fbgemm's TBE does
        (the TBE's ``step`` / ``iter``, ``FbgemmTier.step`` and this shard's ``step``; a
        shard without rows, which has no TBE, counts its ``step`` alike); the ``native`` and ``torch`` backends count them in the backward, so a lookup
        whose backward never runs advanced nothing: None. ``TrainPipelineFusedSparseDist``
        reads them around every lookup it issues early, to take back a discarded one's.

        Returns:
            Optional[Any]: an opaque snapshot, or None when a lookup counts nothing.
        """
        if self._fbgemm is not None:
            return self._fbgemm.lookup_counters()
        # a fbgemm shard without rows counts its lookups itself (_forward_fbgemm)
        return (self.step, self._step_sets) if self.backend == "fbgemm" else None

    def undo_lookup(self, before: Optional[Any], after: Optional[Any]) -> None:
        """Takes back the counter increments of one discarded lookup (:meth:`lookup_counters`
        ``before`` / ``after`` it), keeping those of lookups since, so the step counts
        equal a run in which the lookup never ran. A step set since (``load_states``,
        ``load_global_weights``) already erased them. No-op for the ``native`` and
        ``torch`` backends.

        Args:
            before (Optional[Any]): :meth:`lookup_counters` before the lookup.
            after (Optional[Any]): :meth:`lookup_counters` right after it.
        """
        if before is None or after is None or self.backend != "fbgemm":
            return
        if self._fbgemm is None:  # a shard without rows: its own count, unless a load set the step since
            if self._step_sets == after[1]:
                self.step -= after[0] - before[0]
            return
        self._fbgemm.undo_lookup(before, after)
        self.step = self._fbgemm.step  # as _forward_fbgemm sets it

    def global_ids(self) -> torch.Tensor:
        """Global id of every local row, in local-id order.

        Returns:
            torch.Tensor: ``[num_rows]`` int64.
        """
        return global_row_ids(
            torch.arange(self.num_rows, dtype=torch.int64), self.num_embeddings, self.world_size,
            self.rank, self.dist_type, self.routing_seed,
        )

    def _reset_cache(self) -> None:
        if self.caching:
            assert self.row_map is not None and self.slot_row is not None and self.slot_score is not None
            self.row_map.fill_(-1)
            self.slot_row.fill_(-1)
            self.slot_score.zero_()

    def _load_local_rows(self, weights: torch.Tensor, state: Optional[torch.Tensor], reset_cache: bool,
                         rows: Optional[torch.Tensor] = None) -> None:
        """Writes ``weights`` / ``state`` (None: zeros) of local ``rows`` (None: every row, in
        local-id order) to their tiers. Only with the cache empty (``reset_cache``, or emptied by
        the caller): a cached row would be written to its slot unmarked."""
        self.rows_writes += 1
        if self.backend == "fbgemm":
            if self._fbgemm is not None:
                self._fbgemm.write_rows(weights, state, rows)  # empties the cache
            return
        if reset_cache:
            self._reset_cache()
        n = self.num_rows if rows is None else int(rows.numel())
        for lo in range(0, n, WRITE_CHUNK_ROWS):  # bounded temporaries (the tiers' row copies)
            hi = min(lo + WRITE_CHUNK_ROWS, n)
            part_rows = (torch.arange(lo, hi, dtype=torch.int64, device=self.device) if rows is None
                         else rows[lo:hi].to(self.device))
            in_fast, idx = self._locate(part_rows)
            self._write(in_fast, idx, weights[lo:hi], state=False)
            part = (state[lo:hi] if state is not None else
                    torch.zeros((hi - lo, self.fast_state.shape[1]), dtype=torch.float32, device=self.device))
            self._write(in_fast, idx, part, state=True)

    # ----------------------------------------------------------------- cache
    def _prefetch(self, uniq: torch.Tensor, counts: torch.Tensor) -> None:
        """Loads the batch's missing rows into the cache (CACHING only), evicting
        slots the batch does not use; updates access counts / recency."""
        assert self.row_map is not None and self.slot_row is not None and self.slot_score is not None
        lfu = self.cache_policy is CachePolicy.LFU
        rm = self.row_map.index_select(0, uniq)
        cached = rm >= 0
        hit_slots = rm[cached]
        if lfu:
            self.slot_score.index_add_(0, hit_slots, counts[cached] << 1)
        else:
            dirty = self.slot_score.index_select(0, hit_slots) & 1
            self.slot_score.index_copy_(0, hit_slots, (self._clock << 1) | dirty)
        miss_mask = ~cached
        misses = uniq[miss_mask]
        self._last["hits"] = (counts * cached).sum()  # no mask indexing: no host sync
        if misses.numel() == 0:
            return
        miss_key = (-rm[miss_mask] - 1) + counts[miss_mask] if lfu else torch.full_like(misses, self._clock)
        if self.cache_slots == 0:
            if lfu:
                self.row_map.index_copy_(0, misses, -(miss_key + 1))
            return
        # victims: free slots first, then slots unused by this batch, coldest first
        usable = torch.ones(self.cache_slots, dtype=torch.bool, device=self.device)
        usable[hit_slots] = False
        v_slots = usable.nonzero().squeeze(1)
        v_rows = self.slot_row.index_select(0, v_slots)
        v_key = torch.where(v_rows >= 0, self.slot_score.index_select(0, v_slots) >> 1, -1)
        v_order = torch.argsort(v_key, stable=True)
        m_order = torch.argsort(miss_key, descending=True, stable=True)
        n = min(v_slots.numel(), misses.numel())
        v_sel = v_order[:n]
        m_sel = m_order[:n]
        if lfu:
            admit = miss_key.index_select(0, m_sel) > v_key.index_select(0, v_sel)
            n = int(admit.sum().item())  # a prefix: miss keys descend, victim keys ascend
            v_sel, m_sel = v_sel[:n], m_sel[:n]
            # misses that stay in the slow tier keep their access count
            self.row_map.index_copy_(0, misses, -(miss_key + 1))
        if n == 0:
            return
        slots = v_slots.index_select(0, v_sel)
        old_rows = v_rows.index_select(0, v_sel)
        old_score = self.slot_score.index_select(0, slots)
        occupied = old_rows >= 0
        # write back dirty victims (rows and their optimizer state move together)
        wb = occupied & ((old_score & 1) == 1)
        wb_slots, wb_rows = slots[wb], old_rows[wb].to(self.slow_weights.device)
        if wb_rows.numel():
            self.slow_weights.index_copy_(0, wb_rows, self.fast_weights.index_select(0, wb_slots).to(
                self.slow_weights.device))
            self.slow_state.index_copy_(0, wb_rows, self.fast_state.index_select(0, wb_slots).to(
                self.slow_state.device))
        ev_rows = old_rows[occupied]
        if ev_rows.numel():
            self.row_map.index_copy_(0, ev_rows, -((old_score[occupied] >> 1) + 1) if lfu
                                     else torch.full_like(ev_rows, -1))
        new_rows = misses.index_select(0, m_sel)
        src = new_rows.to(self.slow_weights.device)
        self.fast_weights.index_copy_(0, slots, self.slow_weights.index_select(0, src).to(self.device))
        self.fast_state.index_copy_(0, slots, self.slow_state.index_select(0, src).to(self.device))
        self.row_map.index_copy_(0, new_rows, slots)
        self.slot_row.index_copy_(0, slots, new_rows)
        self.slot_score.index_copy_(0, slots, miss_key.index_select(0, m_sel) << 1)
        self._last["rows_loaded"] = n
        self._last["rows_evicted"] = ev_rows.numel()
        self._last["rows_written_back"] = wb_rows.numel()

    @torch.no_grad()
    def flush(self) -> int:
        """Writes every dirty cached row (and its optimizer state) back to the slow tier.

        Returns:
            int: rows written back.
        """
        if self.backend == "fbgemm":
            if self._fbgemm is None:
                return 0
            n = self._fbgemm.flush()
            self._flushed_rows += n
            return n
        if not self.caching:
            return 0
        assert self.slot_row is not None and self.slot_score is not None
        dirty = (self.slot_row >= 0) & ((self.slot_score & 1) == 1)
        slots = dirty.nonzero().squeeze(1)
        if slots.numel():
            rows = self.slot_row.index_select(0, slots).to(self.slow_weights.device)
            self.slow_weights.index_copy_(0, rows, self.fast_weights.index_select(0, slots).to(rows.device))
            self.slow_state.index_copy_(0, rows, self.fast_state.index_select(0, slots).to(rows.device))
            self.slot_score.index_copy_(0, slots, self.slot_score.index_select(0, slots) & ~1)
        self._flushed_rows += int(slots.numel())
        return int(slots.numel())

    # ---------------------------------------------------------------- lookup
    def _check_psw_pooling(self, psw: Optional[torch.Tensor]) -> None:
        """Per-sample weights only with sum pooling (a host check: no tensor is read)."""
        if psw is not None and self.pooling != "sum":
            raise ValueError("per_sample_weights need pooling='sum' (as in torch.nn.EmbeddingBag).")

    def _check_inputs(self, ids: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor]) -> None:
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"ids must be a 1-D int32/int64 tensor of local row ids, got {ids.dtype} "
                             f"with shape {list(ids.shape)}.")
        if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64) or offsets.numel() < 1:
            raise ValueError("offsets must be a 1-D int32/int64 tensor of B + 1 bag offsets "
                             f"(include_last_offset), got shape {list(offsets.shape)}.")
        if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel() or bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError(f"offsets must start at 0, be non-decreasing and end at len(ids)={ids.numel()}; "
                             f"got first {int(offsets[0])}, last {int(offsets[-1])}.")
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_rows:
                raise IndexError(
                    f"ids out of range for table {self.table_name!r} shard {self.rank}: got ids in "
                    f"[{lo}, {hi}] but the shard has {self.num_rows} local rows. Possible solutions:\n"
                    f"  1. route global ids with recpipe.pipeline.routing.ops.route_ids / bucketize_kjt "
                    f"(dist_type={self.dist_type!r}, world_size={self.world_size}) before the lookup.\n"
                    f"  2. check num_embeddings={self.num_embeddings} matches the feature's id space (global ids "
                    f"in [0, {self.num_embeddings}); recpipe's row-wise sharding sends a global id v >= "
                    f"{self.num_embeddings} (or negative, read as unsigned) to rank v % world_size as local id "
                    "v // world_size, as torchrec's does).\n"
                    f"  3. to look ids past the shard's rows up as local row 0 instead of raising, as fbgemm's TBE "
                    f"does, give the table the fused param bounds_check_mode=BoundsCheckMode.WARNING or IGNORE "
                    f"(now {self.bounds_check_mode.name})."
                )
        self._check_psw_pooling(psw)
        if psw is not None and psw.shape != ids.shape:
            raise ValueError(f"per_sample_weights must have the shape of ids {list(ids.shape)}, "
                             f"got {list(psw.shape)}.")

    def _lookup(
        self, ids: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One lookup by the compiled kernel (checks, cache loads, pooling, stats)."""
        self._flushed_rows = 0
        self._clock += 1
        try:
            return torch.ops.recpipe.tiered_lookup(
                ids, offsets, psw, self.fast_weights, self.fast_state, self.slow_weights, self.slow_state,
                self._op_row_map, self._op_slot_row, self._op_slot_score, self._stats, self.num_rows,
                self.fast_rows, self.split_seed, self._op_mode, self._op_policy, self._clock, self._op_pooling,
            )
        except (IndexError, ValueError):
            # the kernel's checks cannot name the table: the host checks say the same, naming it
            self._check_inputs(ids, offsets, psw)
            raise

    @torch.no_grad()
    def _backward_update(
        self,
        grad_out: torch.Tensor,
        uniq: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        psw: Optional[torch.Tensor],
        opt: TieredOptimizerConfig,
    ) -> None:
        """The fused optimizer step of one lookup's rows by the compiled kernel, with
        the optimizer hyper-parameters ``opt`` of that lookup."""
        step = self._next_optimizer_step()
        torch.ops.recpipe.tiered_backward(
            grad_out, uniq, inverse, offsets, psw, self.fast_weights, self.fast_state, self.slow_weights,
            self.slow_state, self._op_row_map, self._op_slot_score, self.num_rows, self.fast_rows,
            self.split_seed, self._op_mode, self._op_pooling, TIERED_OPTIMIZERS[opt.name],
            float(opt.learning_rate), float(opt.eps), float(opt.beta1), float(opt.beta2),
            float(opt.weight_decay), step,
        )

    def _lookup_torch(
        self, ids: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same lookup in device-generic torch ops (non-CPU devices; the kernel's test reference)."""
        self._check_inputs(ids, offsets, psw)
        self._flushed_rows = 0
        self._last = dict.fromkeys(TIERED_STATS, 0)
        self._clock += 1
        ids = ids.to(torch.int64)
        offsets = offsets.to(torch.int64)
        n = ids.numel()
        self._last["lookups"] = n
        mode = self.pooling
        if self.all_fast:
            out = F.embedding_bag(ids, self.fast_weights, offsets, mode=mode,
                                  per_sample_weights=psw, include_last_offset=True)
            uniq, inverse = torch.unique(ids, return_inverse=True)
            self._last.update(unique_rows=uniq.numel(), hits=n, fast_lookups=n)
        else:
            uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
            self._last["unique_rows"] = uniq.numel()
            if self.caching:
                self._prefetch(uniq, counts)
            in_fast, idx = self._locate(uniq)
            assert in_fast is not None
            fast_lookups = (counts * in_fast).sum()
            self._last["fast_lookups"] = fast_lookups
            if not self.caching:
                self._last["hits"] = fast_lookups
            rows = self._read(in_fast, idx, state=False)
            out = F.embedding_bag(inverse, rows, offsets, mode=mode,
                                  per_sample_weights=psw, include_last_offset=True)
        last = torch.stack([v.to(torch.int64) if isinstance(v, torch.Tensor)
                            else torch.full((), v, dtype=torch.int64, device=self.device)
                            for v in (self._last[k] for k in TIERED_STATS)])
        k = len(TIERED_STATS)
        self._stats[:k] = last
        self._stats[k:] += last
        return out, uniq, inverse

    @torch.no_grad()
    def _psw_grad(
        self, grad_out: torch.Tensor, uniq: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Gradient of the per-sample weights of a lookup (sum pooling): for id ``i`` of
        bag ``b``, ``<grad_out[b], row(ids[i])>``, with the rows as stored now (before the
        lookup's fused update).

        Args:
            grad_out (torch.Tensor): ``[B, D]`` gradient of the pooled output.
            uniq (torch.Tensor): the lookup's unique local rows.
            inverse (torch.Tensor): index into ``uniq`` of each id.
            offsets (torch.Tensor): ``B + 1`` bag offsets.

        Returns:
            torch.Tensor: ``[n]`` float32, one entry per id.
        """
        _, bags = _bag_lengths_and_ids(offsets)
        rows = self._read(*self._locate(uniq.to(torch.int64)), state=False)
        return (grad_out.index_select(0, bags) * rows.index_select(0, inverse.to(torch.int64))).sum(1)

    @torch.no_grad()
    def _backward_torch(
        self,
        grad_out: torch.Tensor,
        uniq: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        psw: Optional[torch.Tensor],
        opt: TieredOptimizerConfig,
    ) -> None:
        """:meth:`_backward_update` in device-generic torch ops."""
        lengths, bags = _bag_lengths_and_ids(offsets)
        g = grad_out.index_select(0, bags)
        if psw is not None:
            g = g * psw.unsqueeze(1)
        elif self.pooling == "mean":
            g = g / lengths.clamp(min=1).to(g.dtype).index_select(0, bags).unsqueeze(1)
        grad_u = torch.zeros((uniq.numel(), self.embedding_dim), dtype=g.dtype, device=g.device)
        grad_u.index_add_(0, inverse, g)
        step = self._next_optimizer_step()
        # re-resolve: a later forward may have moved rows since this batch's lookup
        in_fast, idx = self._locate(uniq)
        w = self._read(in_fast, idx, state=False)
        s = self._read(in_fast, idx, state=True)
        opt.update(w, s, grad_u, step)
        self._write(in_fast, idx, w, state=False)
        self._write(in_fast, idx, s, state=True)
        if self.caching and in_fast is not None:
            assert self.slot_score is not None
            slots = idx[in_fast]
            self.slot_score.index_copy_(0, slots, self.slot_score.index_select(0, slots) | 1)

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Pooled lookup of local ids.

        Args:
            ids (torch.Tensor): 1-D local row ids in ``[0, num_rows)``.
            offsets (torch.Tensor): ``B + 1`` bag offsets (``include_last_offset``).
            per_sample_weights (torch.Tensor | None): weights of the ids (sum pooling),
                cast to float32 as fbgemm's TBE does. When they require a gradient (e.g.
                a feature processor's position weights) the backward returns fbgemm's:
                for each id, the dot product of its bag's output gradient with its row
                before the update.

        Returns:
            torch.Tensor: ``[B, embedding_dim]`` pooled embeddings. Its backward
            applies the fused optimizer to the rows in place.
        """
        for name, t in (("ids", ids), ("offsets", offsets), ("per_sample_weights", per_sample_weights)):
            if not isinstance(t, torch.Tensor) and (t is not None or name != "per_sample_weights"):
                raise ValueError(
                    f"tiered table {self.table_name!r}: {name} must be a torch.Tensor, got {type(t).__name__}; "
                    f"pass e.g. torch.as_tensor({name}, dtype=torch.{'float32' if name[0] == 'p' else 'int64'})."
                )
        if per_sample_weights is not None:  # fbgemm's TBE casts them to float32 too (autograd sees the cast)
            per_sample_weights = per_sample_weights.float()
        ids = self._bounds_check(ids)
        if self.backend == "fbgemm":
            return self._forward_fbgemm(ids, offsets, per_sample_weights)
        anchor = torch.empty(0, device=self.device, requires_grad=torch.is_grad_enabled())
        return _TieredLookup.apply(anchor, self, ids, offsets, per_sample_weights)

    def _bounds_check(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` with local ids ``>= num_rows`` replaced by 0 under ``WARNING`` / ``IGNORE``
        (fbgemm's ``bounds_check_indices`` on CPU; ``WARNING`` also warns, on the CPU).

        Under ``FATAL`` / ``NONE``, and for negative ids, ``ids`` is returned as given: the
        lookup's checks raise for them.
        """
        if (self.bounds_check_mode not in (BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE)
                or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or ids.numel() == 0):
            return ids
        if ids.device.type == "cpu":  # a host check: a CUDA batch is replaced without a sync
            if int(ids.max()) < self.num_rows:  # the usual batch: one reduction, nothing allocated
                return ids
        past = ids >= self.num_rows
        if ids.device.type == "cpu":
            if self.bounds_check_mode is BoundsCheckMode.WARNING:
                first = int(past.nonzero()[0, 0])
                warnings.warn(
                    f"tiered table {self.table_name!r} shard {self.rank}: {int(past.sum())} id(s) past the shard's "
                    f"{self.num_rows} local rows (first: local id {int(ids[first])} at position {first}) are looked "
                    "up as local row 0 (bounds_check_mode=WARNING, as fbgemm's TBE); the global ids of the feature "
                    f"must lie in [0, {self.num_embeddings}). Set bounds_check_mode=BoundsCheckMode.FATAL to raise "
                    "instead, or IGNORE to silence this.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return torch.where(past, torch.zeros_like(ids), ids)

    def _forward_fbgemm(
        self, ids: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """The lookup by fbgemm's TBE, whose backward applies the fused optimizer.

        No host sync on CUDA: ids are checked on the device (``torch._assert_async``)
        and the statistics are counted on the device. On CPU the inputs are also
        checked on the host (as by the other backends), for the error messages.
        """
        if self.device.type == "cpu":
            self._check_inputs(ids, offsets, psw)
        self._check_psw_pooling(psw)  # also on CUDA, where _check_inputs is skipped
        self._flushed_rows = 0
        if self._fbgemm is None:  # a shard without rows (fewer rows than ranks): only empty bags
            # counted as fbgemm's TBE counts the lookups of the table's other shards (FbgemmTier: SGD
            # steps in lookups with grad enabled, the TBE's iter in every lookup), so that every rank
            # exports the same step (loads and DCP refuse exports that disagree)
            if torch.is_grad_enabled() or self.optimizer.optimizer is not FusedOptimizer.SGD:
                self.step += 1
            k = len(TIERED_STATS)
            self._stats[:k].zero_()
            # requires grad as the other backends' outputs do (their anchor): a sharded model's
            # loss.backward() on this rank then runs the output dist's backward collective with
            # the other ranks (a rank whose lookups all came out without grad skipped it)
            return torch.zeros((offsets.numel() - 1, self.embedding_dim), dtype=self.dtype, device=self.device,
                               requires_grad=torch.is_grad_enabled())
        out = self._fbgemm(ids, offsets, psw)
        self.step = self._fbgemm.step  # training lookups; export_state reads fbgemm's own counter
        return out

    # ----------------------------------------------------------------- stats
    def tier_stats(self) -> Dict[str, float]:
        """Statistics of the last lookup (and cumulative hit rate).

        Returns:
            Dict[str, float]: ``hit_rate`` (ids whose row was in the fast tier
            before the step's cache loads), ``fast_fraction`` (ids served from the
            fast tier), ``cumulative_hit_rate`` (over ``cumulative_lookups``),
            ``lookups``, ``unique_rows``,
            ``rows_loaded`` / ``rows_written_back`` / ``rows_evicted`` between the
            tiers, ``bytes_moved`` (``(loaded + written back) * moved_row_bytes``:
            values plus optimizer state, values only in fbgemm's cache) and
            ``flushed_rows``. On CUDA this synchronizes the device (the counters are
            device tensors): call it when logging, not every step.
        """
        if self.device.type == "cuda":
            # the counters may have been written on the pipeline's lookup stream
            torch.cuda.synchronize(self.device)
        counts = [float(v) for v in self._stats.tolist()]  # the one host read of the counters
        k = len(TIERED_STATS)
        last = dict(zip(TIERED_STATS, counts[:k]))
        total = dict(zip(TIERED_STATS, counts[k:]))
        lookups = max(last["lookups"], 1.0)
        moved = last["rows_loaded"] + last["rows_written_back"]
        return {
            "hit_rate": last["hits"] / lookups,
            "fast_fraction": last["fast_lookups"] / lookups,
            "cumulative_hit_rate": total["hits"] / max(total["lookups"], 1.0),
            "cumulative_lookups": total["lookups"],
            "lookups": last["lookups"],
            "unique_rows": last["unique_rows"],
            "rows_loaded": last["rows_loaded"],
            "rows_evicted": last["rows_evicted"],
            "rows_written_back": last["rows_written_back"],
            "bytes_loaded": last["rows_loaded"] * self.moved_row_bytes,
            "bytes_written_back": last["rows_written_back"] * self.moved_row_bytes,
            "bytes_moved": moved * self.moved_row_bytes,
            "flushed_rows": float(self._flushed_rows),
        }

    # ------------------------------------------------------------ checkpoint
    def metadata(self) -> Dict[str, Any]:
        """Routing and placement of this shard, as recorded in exports.

        Returns:
            Dict[str, Any]: plain Python values (JSON-serializable).
        """
        return {
            "version": CHECKPOINT_VERSION,
            "table": self.table_name,
            "num_embeddings": self.num_embeddings,
            "embedding_dim": self.embedding_dim,
            "dtype": str(self.dtype).replace("torch.", ""),
            "optimizer": self.optimizer.name,
            "dist_type": self.dist_type,
            "routing_seed": self.routing_seed,
            "routing_version": ROUTING_VERSION,
            "world_size": self.world_size,
            "rank": self.rank,
            "num_rows": self.num_rows,
            "placement": {
                "mode": self.mode.name,
                "cache_load_factor": self.cache_load_factor,
                "cache_policy": self.cache_policy.value,
                "split_seed": self.split_seed,
            },
        }

    @torch.no_grad()
    def export_state(self) -> TieredShardState:
        """Flushes the cache and exports (global id, value, optimizer state) of every row.

        Returns:
            TieredShardState: rows in local-id order, on CPU.
        """
        self.flush()
        if self.backend == "fbgemm":
            if self._fbgemm is not None:
                weights, state = self._fbgemm.read_rows(self.state_cols)
                self.step = self._fbgemm.get_step()
            else:
                weights = torch.empty((0, self.embedding_dim), dtype=self.dtype)
                state = torch.empty((0, self.state_cols), dtype=torch.float32)
        else:
            rows = torch.arange(self.num_rows, dtype=torch.int64, device=self.device)
            in_fast, idx = self._locate(rows)
            weights, state = self._read(in_fast, idx, state=False), self._read(in_fast, idx, state=True)
        return TieredShardState(
            global_ids=self.global_ids(),
            weights=weights.cpu(),
            optimizer_state=state.cpu(),
            step=self.step,
            metadata=self.metadata(),
        )

    def _ckpt_error(self, what: str, solutions: Sequence[str]) -> TieredCheckpointError:
        lines = [f"cannot load table {self.table_name!r} into shard rank {self.rank}/{self.world_size} "
                 f"({self.mode.name} {self.cache_load_factor}, {self.dist_type}): {what}. Possible solutions:"]
        lines += [f"  {i}. {s}" for i, s in enumerate(solutions, 1)]
        return TieredCheckpointError("\n".join(lines))

    def check_export_metadata(self, md: Dict[str, Any]) -> None:
        """Checks an export's metadata (no rows needed) against this shard: every
        field present; the same num_embeddings, embedding_dim, dtype and optimizer; a
        routing version this recpipe knows. Loaders call it for every export before
        they change any state.

        Args:
            md (Dict[str, Any]): ``TieredShardState.metadata`` of the export.

        Raises:
            TieredCheckpointError: naming the table, the field and both values.
        """
        required = ("version", "num_embeddings", "embedding_dim", "dtype", "optimizer", "dist_type",
                    "routing_seed", "world_size", "rank", "num_rows", "placement")
        if not isinstance(md, Mapping):
            raise self._ckpt_error(f"export metadata is a {type(md).__name__}, not a dict",
                                   ["pass TieredShardState.metadata of an export_state() / state_dict() export"])
        missing = [k for k in required if k not in md]
        if missing:
            raise self._ckpt_error(f"export metadata lacks {missing}",
                                   ["export with TieredEmbeddingShard.export_state() / state_dict()"])
        mine = self.metadata()
        for key in ("num_embeddings", "embedding_dim", "dtype", "optimizer"):
            if md[key] != mine[key]:
                raise self._ckpt_error(
                    f"export has {key}={md[key]!r} but this shard has {key}={mine[key]!r}",
                    [f"build the shard with {key}={md[key]!r}", "load the export of the matching table"])
        routing_version = int(md.get("routing_version", 1))  # version 1 exports lack the key
        if routing_version > ROUTING_VERSION:
            raise self._ckpt_error(
                f"export was routed by hash_roundrobin version {routing_version}, newer than this "
                f"recpipe's version {ROUTING_VERSION}",
                ["load it with the recpipe release that wrote it (or a newer one)"])

    def _validate_state(self, st: TieredShardState) -> None:
        md = st.metadata
        self.check_export_metadata(md)
        n = int(st.global_ids.numel())
        rows = shard_num_rows(md["num_embeddings"], md["world_size"], md["rank"], md["dist_type"])
        if n != rows or md["num_rows"] != rows or st.weights.shape[0] != n or st.optimizer_state.shape[0] != n:
            raise self._ckpt_error(
                f"export of rank {md['rank']}/{md['world_size']} ({md['dist_type']}) holds {n} rows, "
                f"its metadata implies {rows}",
                ["the export is truncated or its metadata was edited: re-export the shard"])
        routing_version = int(md.get("routing_version", 1))
        gids = st.global_ids.to(torch.int64).cpu()
        if md["dist_type"] == "hash_roundrobin" and routing_version != ROUTING_VERSION:
            # An older hash placed these rows; this build no longer computes it, so the
            # global ids are checked as such (distinct, in range) and load_states places
            # every row by its global id under today's routing: nothing is lost.
            out_of_range = int(((gids < 0) | (gids >= md["num_embeddings"])).sum())
            repeated = n - int(gids.unique().numel())
            if out_of_range or repeated:
                raise self._ckpt_error(
                    f"export (hash_roundrobin version {routing_version}) has {out_of_range} global ids "
                    f"outside [0, {md['num_embeddings']}) and {repeated} repeated",
                    ["the export is damaged or its metadata was edited: re-export the shard"])
        else:
            agree = all(
                torch.equal(global_row_ids(torch.arange(lo, min(lo + LOAD_CHUNK_ROWS, n), dtype=torch.int64),
                                           md["num_embeddings"], md["world_size"], md["rank"], md["dist_type"],
                                           md["routing_seed"]), gids[lo:lo + LOAD_CHUNK_ROWS])
                for lo in range(0, n, LOAD_CHUNK_ROWS))
            if not agree:
                raise self._ckpt_error(
                    f"export global ids disagree with its metadata (dist_type={md['dist_type']!r}, "
                    f"routing_seed={md['routing_seed']}, world_size={md['world_size']}, rank={md['rank']})",
                    ["the metadata does not describe how these rows were routed: re-export the shard",
                     "do not mix exports written with different routing seeds or world sizes"])
        cols = self.fast_state.shape[1]
        if tuple(st.weights.shape[1:]) != (self.embedding_dim,) or tuple(st.optimizer_state.shape[1:]) != (cols,):
            raise self._ckpt_error(
                f"export has value/state widths {list(st.weights.shape[1:])}/{list(st.optimizer_state.shape[1:])}, "
                f"expected [{self.embedding_dim}]/[{cols}]", ["load the export of the matching table"])

    @torch.no_grad()
    def load_states(self, states: Sequence[TieredShardState]) -> None:
        """Loads this shard's rows from exports of any routing, world size and placement.

        Every export is validated against its metadata; the rows this shard owns
        under its own routing are picked by global id. Rows this shard owns that are
        absent (or present twice) raise :class:`TieredCheckpointError`, never a
        silent drop. The cache is emptied and every row written to its tier.

        Args:
            states (Sequence[TieredShardState]): exports, e.g. of every rank of the
                saving job.
        """
        if isinstance(states, TieredShardState) or not isinstance(states, Sequence) \
                or not all(isinstance(st, TieredShardState) for st in states):
            got = type(states).__name__ if not isinstance(states, Sequence) or isinstance(states, (str, bytes)) \
                else f"a {type(states).__name__} of {sorted({type(st).__name__ for st in states})}"
            raise self._ckpt_error(f"states must be a list of TieredShardState, got {got}",
                                   ["pass a list of exports, e.g. [shard.export_state()] (one per saving rank)"])
        if len(states) == 0:
            raise self._ckpt_error("no export given", ["pass the exports of every saving rank"])
        for st in states:
            self._validate_state(st)
        steps = {int(st.step) for st in states}
        if len(steps) != 1:
            raise self._ckpt_error(f"exports disagree on the optimizer step {sorted(steps)}",
                                   ["load exports written at the same training step"])
        R = self.num_rows
        if len(states) == 1 and states[0].metadata["rank"] == self.rank and self.routes_as(states[0].metadata):
            # this shard's own rows in local-id order (validated above): written as they are
            st = states[0]
            bad = non_finite_rows(st.weights, st.optimizer_state)
            if bad is not None:
                raise self._non_finite_error(int(bad.sum()))
            self._load_local_rows(st.weights.to(self.device, self.dtype),
                                  st.optimizer_state.to(self.device, torch.float32), reset_cache=True)
            self._set_step(steps.pop())
            return
        # Stream the exports in chunks: extra memory is this shard's R rows plus one chunk
        # (O(N / W) per rank), whatever the saving job's world size.
        weights = torch.empty((R, self.embedding_dim), dtype=self.dtype)
        opt = torch.empty((R, self.fast_state.shape[1]), dtype=torch.float32)
        count = torch.zeros(R, dtype=torch.int64)
        non_finite = 0
        for st in states:
            for lo in range(0, int(st.global_ids.numel()), LOAD_CHUNK_ROWS):
                hi = lo + LOAD_CHUNK_ROWS
                owner, local = route_ids(st.global_ids[lo:hi].to(torch.int64).cpu(), self.num_embeddings,
                                         self.world_size, self.dist_type, self.routing_seed)
                sel = (owner == self.rank).nonzero().squeeze(1)
                if sel.numel() == 0:
                    continue
                mine = local.index_select(0, sel)
                w = st.weights[lo:hi].cpu().index_select(0, sel)
                o = st.optimizer_state[lo:hi].cpu().index_select(0, sel)
                non_finite += int(((~torch.isfinite(w)).any(dim=1) | (~torch.isfinite(o)).any(dim=1)).sum())
                count.index_add_(0, mine, torch.ones_like(mine))
                weights.index_copy_(0, mine, w.to(self.dtype))
                opt.index_copy_(0, mine, o.to(torch.float32))
        if bool((count > 1).any()):
            dup = self.global_ids().index_select(0, (count > 1).nonzero().squeeze(1)[:5])
            raise self._ckpt_error(f"{int((count > 1).sum())} rows appear more than once (global ids {dup.tolist()})",
                                   ["pass each saving rank's export exactly once"])
        if bool((count == 0).any()):
            gone = self.global_ids().index_select(0, (count == 0).nonzero().squeeze(1)[:5])
            src = sorted({(st.metadata["rank"], st.metadata["world_size"]) for st in states})
            raise self._ckpt_error(
                f"{int((count == 0).sum())} of its {R} rows are missing from the exports "
                f"(e.g. global ids {gone.tolist()}; got exports of (rank, world_size) {src})",
                ["pass the exports of ALL ranks of the saving job (rows are resharded by global id)",
                 "check that the saving job used the same num_embeddings"])
        if non_finite:
            raise self._non_finite_error(non_finite)
        self._load_local_rows(weights.to(self.device), opt.to(self.device), reset_cache=True)
        self._set_step(steps.pop())

    @torch.no_grad()
    def load_row_blocks(self, blocks: Iterable[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]],
                        step: int) -> None:
        """Sets every row of this shard from blocks of a table's rows by global id, streamed:
        each block's rows this shard owns (under its routing) are written to their tiers as the
        block comes, so extra memory is one block, not the shard (:meth:`load_states` gathers
        the shard's rows first and refuses before it writes). Empties the cache first (written
        back, then every row is overwritten); records ``step`` as :meth:`load_states` does.

        Args:
            blocks (Iterable[Tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]): ``(global
                ids [n] int64, values [n, dim], fp32 optimizer state [n, state_cols] or None:
                zeros)`` of any rows of the table (e.g. a torchrec checkpoint's saved chunks);
                every row of this shard in exactly one block.
            step (int): the optimizer step to record, an int >= 0.

        Raises:
            TieredCheckpointError: naming the table: a block of another shape, a row of this
                shard holding NaN / inf (its block is not written), or rows of this shard missing
                or repeated (after the last block). The blocks before are written: the shard is
                then partly loaded.
        """
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"tiered table {self.table_name!r}: optimizer step must be an int >= 0, got {step!r}: "
                             "pass the step the rows were saved at.")
        self.flush()
        if self.backend != "fbgemm":  # fbgemm's write_rows empties its cache at every write
            self._reset_cache()
        cols = self.fast_state.shape[1]
        count = torch.zeros(self.num_rows, dtype=torch.int64)
        for gids, weights, state in blocks:
            n = int(gids.numel())
            if (gids.dim() != 1 or tuple(weights.shape) != (n, self.embedding_dim)
                    or (state is not None and tuple(state.shape) != (n, cols))):
                got = [list(gids.shape), list(weights.shape), None if state is None else list(state.shape)]
                raise self._ckpt_error(
                    f"a block of rows has shapes (global ids, values, state) {got}, expected [{n}], "
                    f"[{n}, {self.embedding_dim}] and [{n}, {cols}] or None", ["pass blocks of this table's rows"])
            owner, local = route_ids(gids.to(torch.int64).cpu(), self.num_embeddings, self.world_size,
                                     self.dist_type, self.routing_seed)
            sel = (owner == self.rank).nonzero().squeeze(1)
            mine = local.index_select(0, sel)
            values = weights.index_select(0, sel.to(weights.device))
            opt = state.index_select(0, sel.to(state.device)) if state is not None else None
            bad = non_finite_rows(values, opt if opt is not None else values.new_empty((sel.numel(), 0)))
            if bad is not None:
                raise self._non_finite_error(int(bad.sum()))
            count.index_add_(0, mine, torch.ones_like(mine))
            if mine.numel():
                self._load_local_rows(values.to(self.device, self.dtype),
                                      opt.to(self.device, torch.float32) if opt is not None else None,
                                      reset_cache=False, rows=mine)
            del owner, local, sel, mine, values, opt
        if bool((count != 1).any()):
            raise self._ckpt_error(
                f"{int((count == 0).sum())} of its {self.num_rows} rows are missing from the blocks and "
                f"{int((count > 1).sum())} appear more than once", ["pass every row of the table exactly once"])
        self._set_step(int(step))

    def _non_finite_error(self, rows: int) -> TieredCheckpointError:
        return self._ckpt_error(f"{rows} of the rows it would load hold NaN or inf values or optimizer state",
                                ["the saving run diverged or the export is damaged: load an earlier checkpoint",
                                 "re-export the table from a healthy run"])

    def routes_as(self, metadata: Dict[str, Any]) -> bool:
        """Whether an export with ``metadata`` (:meth:`metadata`) holds rows routed as this
        shard's job routes them (the same table size, world size, dist_type, seed and routing
        version): its rank ``r``'s export then holds exactly rank ``r``'s rows, in local-id order.

        Args:
            metadata (Dict[str, Any]): an export's metadata.
        """
        return (metadata.get("num_embeddings") == self.num_embeddings and metadata.get("world_size") == self.world_size
                and metadata.get("dist_type") == self.dist_type and metadata.get("routing_seed") == self.routing_seed
                and int(metadata.get("routing_version", 1)) == ROUTING_VERSION)

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        st = self.export_state()
        destination[prefix + "global_ids"] = st.global_ids
        destination[prefix + "weights"] = st.weights
        destination[prefix + "optimizer_state"] = st.optimizer_state
        destination[prefix + "step"] = torch.tensor(st.step, dtype=torch.int64)
        destination[prefix + "_extra_state"] = st.metadata

    def _load_from_state_dict(
        self,
        state_dict: Dict[str, Any],
        prefix: str,
        local_metadata: Dict[str, Any],
        strict: bool,
        missing_keys: List[str],
        unexpected_keys: List[str],
        error_msgs: List[str],
    ) -> None:
        keys = ("global_ids", "weights", "optimizer_state", "step", "_extra_state")
        absent = [prefix + k for k in keys if prefix + k not in state_dict]
        if absent:
            missing_keys.extend(absent)
            return
        st = TieredShardState(
            global_ids=state_dict[prefix + "global_ids"],
            weights=state_dict[prefix + "weights"],
            optimizer_state=state_dict[prefix + "optimizer_state"],
            step=int(state_dict[prefix + "step"]),
            metadata=dict(state_dict[prefix + "_extra_state"]),
        )
        self.load_states([st])

    def extra_repr(self) -> str:
        return (f"table={self.table_name!r}, rows={self.num_rows}/{self.num_embeddings}, dim={self.embedding_dim}, "
                f"mode={self.mode.name}, x={self.cache_load_factor}, optimizer={self.optimizer.name}, "
                f"rank={self.rank}/{self.world_size}, dist_type={self.dist_type}")
