"""The CUDA realization of a tiered shard: fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen``.

On CUDA a :class:`~recpipe.pipeline.tiered.shard.TieredEmbeddingShard` hands its rows to
fbgemm's TBE, which already offers the tiers, the UVM cache and the fused
optimizers, all without host syncs in a training step:

* ``x == 1`` (either mode): one ``DEVICE`` table of ``R`` rows.
* ``CACHING(x)``: one ``MANAGED_CACHING`` table of ``R`` rows (the backing store
  in UVM, i.e. host DDR) with an HBM cache of ``cache_sets`` sets of
  :data:`FBGEMM_CACHE_ASSOC` ways, ``CacheAlgorithm`` LRU or LFU from the
  placement's cache policy. fbgemm's cache holds the row values only: optimizer
  state stays in UVM. Evicted rows are always written back (no dirty bit).
* ``HYBRID(x)``: a ``DEVICE`` table of ``k = floor(x * R)`` rows and a ``MANAGED``
  (UVM) table of ``R - k`` rows, split by the shard's seeded hash exactly as the
  CPU kernel splits them (``route_ids(r, R, 1, "hash_roundrobin", split_seed)``):
  row ``r`` is fast row ``H(r)`` when ``H(r) < k``, else slow row ``H(r) - k``
  (:func:`split_tier`, which the shard's own ``_locate`` uses too).
  ``H`` is computed once, by the shard at construction (its ``_split_hash``), into
  an int32 HBM map (``route_ids`` reads a flag back on CUDA, so it is not called
  per step). A lookup partitions
  each bag's ids between the two tables on the device (a stable sort by tier,
  per-bag counts, a cumulative sum: no data-dependent shapes) and sums the two
  pooled halves.

Pooling is SUM in fbgemm; ``mean`` divides by the bag lengths afterwards, so a
HYBRID bag split over both tables is averaged over all of its ids.

:func:`plan_fbgemm_tier` (pure, no fbgemm import) decides the tables, cache and
optimizer arguments from the shard's placement; :func:`fbgemm_tbe_kwargs` turns a
plan into the TBE's constructor arguments; :func:`fbgemm_tier_bytes` is the byte
formula of what fbgemm allocates per tier, which differs from
``recpipe.pipeline.placement.shard_storage`` as documented there.

``compute_device="cpu"`` builds the same tables as fbgemm ``HOST`` tables (the
CPU build of fbgemm has no UVM and no cache): it checks the split, the bag
partition, the optimizer mapping and the export / load code on a machine without
a GPU. fbgemm's CPU TBE runs SGD and row-wise Adagrad but not Adam.

A lookup advances counters, which a pipeline that discards a lookup takes back
(``TrainPipelineFusedSparseDist``): :func:`tbe_counters` / :func:`undo_tbe_lookup` for
any fbgemm TBE (torchrec's FUSED tables' too), :meth:`FbgemmTier.lookup_counters` /
:meth:`FbgemmTier.undo_lookup` for a tier's TBE and its own SGD step count.

Statistics (``recpipe.pipeline.routing.ops.TIERED_STATS`` layout) are counted with device
ops into an int64 tensor and read on the host only by ``tier_stats()``: ids and
unique rows of each lookup; for CACHING the ids already cached before the step's
loads (``fbgemm.lxu_cache_lookup``), the ids served from the cache
(``lxu_cache_locations`` after the prefetch), and the slots whose row changed
during the prefetch (a snapshot of ``lxu_cache_state``: loads; those that held a
row: evictions = write-backs).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from recpipe.pipeline.tiered.optim import TieredOptimizerConfig
from recpipe.pipeline.routing.ops import TIERED_STATS
from recpipe.pipeline.placement import (
    CachePolicy,
    FusedOptimizer,
    Mode,
    ShardStorage,
    check_load_factor,
    dtype_itemsize,
    optimizer_state_bytes_per_row,
    tier_rows,
)

__all__ = [
    "FBGEMM_CACHE_ASSOC",
    "FbgemmTable",
    "FbgemmTier",
    "FbgemmTierPlan",
    "Layout",
    "fbgemm_shard_storage",
    "fbgemm_tbe_kwargs",
    "fbgemm_tier_bytes",
    "plan_fbgemm_tier",
    "split_tier",
    "tbe_counters",
    "undo_tbe_lookup",
]

#: Ways per cache set of fbgemm's UVM cache on NVIDIA GPUs (the warp size,
#: fbgemm's ``DEFAULT_ASSOC``); cache slots are ``cache_sets * FBGEMM_CACHE_ASSOC``.
FBGEMM_CACHE_ASSOC: int = 32

#: Bytes of the int32 local-row -> hashed position map of a HYBRID shard (HBM).
SPLIT_MAP_BYTES: int = 4

# recpipe fused optimizer -> fbgemm ``EmbOptimType`` member name.
_OPTIM_TYPES: Dict[FusedOptimizer, str] = {
    FusedOptimizer.SGD: "EXACT_SGD",
    FusedOptimizer.ROWWISE_ADAGRAD: "EXACT_ROWWISE_ADAGRAD",
    FusedOptimizer.ADAM: "ADAM",
}
# recpipe cache policy -> fbgemm ``CacheAlgorithm`` member name.
_CACHE_ALGORITHMS: Dict[CachePolicy, str] = {CachePolicy.LRU: "LRU", CachePolicy.LFU: "LFU"}
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
    """One table of the shard's TBE.

    Args:
        rows (int): rows of the table.
        location (str): fbgemm ``EmbeddingLocation`` member name.
        fast (bool): the table holds fast-tier (HBM) rows.
    """

    rows: int
    location: str
    fast: bool


@dataclass(frozen=True)
class FbgemmTierPlan:
    """What the fbgemm path builds for one shard (plain data; see :func:`plan_fbgemm_tier`).

    Args:
        layout (Layout): ALL_FAST, HYBRID or CACHING.
        num_rows (int): local rows ``R`` of the shard.
        embedding_dim (int): row width.
        fast_rows (int): rows of the fast tier (HYBRID: ``k``; ALL_FAST: ``R``; CACHING: 0).
        tables (Tuple[FbgemmTable, ...]): the TBE's tables, one feature each, fast first.
        cache_sets (int): cache sets of a CACHING table (0 otherwise).
        cache_algorithm (Optional[str]): fbgemm ``CacheAlgorithm`` member name (CACHING only).
        optimizer (FusedOptimizer): the recpipe optimizer.
        optim_type (str): fbgemm ``EmbOptimType`` member name.
        learning_rate (float): learning rate.
        eps (float): Adagrad / Adam epsilon.
        beta1 (float): Adam first-moment decay.
        beta2 (float): Adam second-moment decay.
        weight_decay (float): Adam weight decay (fbgemm ADAM's in-update ``weight_decay``).
        compute_device (str): ``cuda``, or ``cpu`` (every table a fbgemm HOST table).
    """

    layout: Layout
    num_rows: int
    embedding_dim: int
    fast_rows: int
    tables: Tuple[FbgemmTable, ...]
    cache_sets: int
    cache_algorithm: Optional[str]
    optimizer: FusedOptimizer
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
    """Maps a shard's placement to fbgemm TBE tables, cache and optimizer.

    Rows per tier come from ``recpipe.pipeline.placement.tier_rows`` (the byte
    formulas' split). A CACHING cache gets ``max(1, floor(x * R) // 32)`` sets of 32
    ways: never more slots than the plan's ``floor(x * R)``, except the one set a
    table whose plan gives fewer than 32 slots still needs.

    Args:
        num_rows (int): local rows ``R`` of the shard (> 0).
        embedding_dim (int): row width.
        mode (Mode | str): ``HYBRID`` or ``CACHING``.
        cache_load_factor (float): ``x`` in ``(0, 1]``.
        cache_policy (CachePolicy | str): ``lfu`` or ``lru`` (CACHING).
        optimizer (TieredOptimizerConfig): the fused optimizer and its hyper-parameters.
        compute_device (str): ``cuda`` (DEVICE / MANAGED / MANAGED_CACHING tables) or
            ``cpu`` (the same tables as fbgemm HOST tables, no cache: for tests).

    Returns:
        FbgemmTierPlan: the tables (fast first) and the TBE's arguments.

    Raises:
        ValueError: ``embedding_dim`` not a positive multiple of 4 (fbgemm's TBE
            requirement), ``num_rows`` < 1, or an unknown ``compute_device``.

    Example::

        plan_fbgemm_tier(num_rows=1000, embedding_dim=16, mode="CACHING", cache_load_factor=0.2,
                         cache_policy="lru", optimizer=TieredOptimizerConfig())
        # tables (1000 rows, MANAGED_CACHING), cache_sets 6 (192 slots), cache_algorithm "LRU"
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
    mode = Mode.parse(mode)
    policy = CachePolicy.parse(cache_policy)
    fast_rows, slow_rows, slots = tier_rows(num_rows, mode, cache_load_factor)
    cpu = compute_device == "cpu"

    def loc(name: str) -> str:
        return "HOST" if cpu else name

    cache_sets = 0
    algorithm: Optional[str] = None
    if slow_rows == 0:
        layout = Layout.ALL_FAST
        tables: Tuple[FbgemmTable, ...] = (FbgemmTable(num_rows, loc("DEVICE"), True),)
    elif mode is Mode.CACHING:
        layout = Layout.CACHING
        tables = (FbgemmTable(num_rows, loc("MANAGED_CACHING"), False),)
        cache_sets = 0 if cpu else max(1, slots // FBGEMM_CACHE_ASSOC)
        algorithm = _CACHE_ALGORITHMS[policy]
    elif fast_rows == 0:
        layout = Layout.HYBRID
        tables = (FbgemmTable(slow_rows, loc("MANAGED"), False),)
    else:
        layout = Layout.HYBRID
        tables = (FbgemmTable(fast_rows, loc("DEVICE"), True), FbgemmTable(slow_rows, loc("MANAGED"), False))
    opt = FusedOptimizer.parse(optimizer.optimizer)
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
        learning_rate=float(optimizer.learning_rate),
        eps=float(optimizer.eps),
        beta1=float(optimizer.beta1),
        beta2=float(optimizer.beta2),
        weight_decay=float(optimizer.weight_decay),
        compute_device=compute_device,
    )


def fbgemm_tbe_kwargs(plan: FbgemmTierPlan, device: Optional[torch.device] = None) -> Dict[str, Any]:
    """Constructor arguments of ``SplitTableBatchedEmbeddingBagsCodegen`` for a plan.

    Args:
        plan (FbgemmTierPlan): from :func:`plan_fbgemm_tier`.
        device (torch.device | None): the TBE's device (default: ``plan.compute_device``).

    Returns:
        Dict[str, Any]: keyword arguments with fbgemm's enums (``embedding_specs``,
        ``feature_table_map``, ``optimizer``, hyper-parameters, ``pooling_mode`` SUM,
        cache arguments, ``bounds_check_mode``, ``device``).
    """
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
        "embedding_specs": [(t.rows, plan.embedding_dim, EmbeddingLocation[t.location], compute)
                            for t in plan.tables],
        "feature_table_map": list(range(len(plan.tables))),
        "optimizer": EmbOptimType[plan.optim_type],
        "learning_rate": plan.learning_rate,
        "eps": plan.eps,
        "beta1": plan.beta1,
        "beta2": plan.beta2,
        "weight_decay": plan.weight_decay,
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


def fbgemm_tier_bytes(plan: FbgemmTierPlan, value_bytes: int = 4) -> ShardStorage:
    """Bytes fbgemm (plus recpipe's split map) allocates per tier for a CUDA plan.

    Counted: every buffer that grows with rows or cache slots. Fixed per-TBE
    buffers (offsets, placements, counters: tens of bytes) are not.

    fbgemm's placement rule for optimizer state (``construct_split_state``): the state
    of a DEVICE table is in HBM; per-element state (Adam) of a MANAGED /
    MANAGED_CACHING table is in UVM (never cached); row-wise state (row-wise Adagrad,
    one fp32 per row) is in HBM for every table. With ``v = dim * value_bytes``,
    ``s`` the state bytes per row (``optimizer_state_bytes_per_row``) and ``s_f`` /
    ``s_u`` its HBM / UVM part for a UVM row (``s, 0`` row-wise, ``0, s`` otherwise):

    * ALL_FAST: ``fast = R * (v + s)``, equal to ``shard_storage``.
    * HYBRID: ``fast = k * (v + s) + (R - k) * s_f + R * SPLIT_MAP_BYTES``,
      ``slow = (R - k) * (v + s_u)``.
    * CACHING with ``S = cache_sets * 32`` slots: ``slow = R * (v + s_u)``,
      ``fast = R * s_f + S * v`` (the cache holds values only) ``+ S * 8``
      (``lxu_cache_state``) ``+ R * 4`` (``cache_index_table_map``) ``+`` LRU:
      ``S * 8`` (``lxu_state`` timestamps) | LFU: ``(R + 1) * 8`` (access counts).

    ``shard_storage`` (recpipe's own layout, the planner's budget for ``backend="native"``)
    instead assumes state moves with its row
    (``fast = k * (v + s)`` for both modes) and a CACHING metadata of
    ``R * 8 + floor(x * R) * 16`` bytes.

    Args:
        plan (FbgemmTierPlan): a plan for ``compute_device="cuda"``.
        value_bytes (int): bytes per row element (4 for float32).

    Returns:
        ShardStorage: HBM (fast) and UVM (slow) bytes.
    """
    if plan.compute_device != "cuda":
        raise ValueError("fbgemm_tier_bytes describes the CUDA tables: plan with compute_device='cuda'.")
    R, D = plan.num_rows, plan.embedding_dim
    v = D * value_bytes
    s = optimizer_state_bytes_per_row(plan.optimizer, D)
    rowwise = plan.optimizer is FusedOptimizer.ROWWISE_ADAGRAD
    fast = slow = 0
    for t in plan.tables:
        if t.fast:
            fast += t.rows * (v + s)
        else:
            slow += t.rows * (v + (0 if rowwise else s))
            fast += t.rows * (s if rowwise else 0)
    if plan.split_map:
        fast += R * SPLIT_MAP_BYTES
    if plan.layout is Layout.CACHING:
        S = plan.cache_slots
        fast += S * D * value_bytes + S * 8 + R * 4
        fast += S * 8 if plan.cache_algorithm == "LRU" else (R + 1) * 8
    return ShardStorage(fast_bytes=fast, slow_bytes=slow)


def fbgemm_shard_storage(
    rows: int,
    dim: int,
    dtype: Union[torch.dtype, str],
    optimizer: Union[FusedOptimizer, str],
    mode: Union[Mode, str],
    x: float,
    cache_policy: Union[CachePolicy, str],
) -> ShardStorage:
    """Bytes per tier of a CUDA tiered shard of ``rows`` local rows on the fbgemm backend.

    The planner's budget for ``backend="fbgemm"``: :func:`fbgemm_tier_bytes` of the
    tables :func:`plan_fbgemm_tier` builds. A shard without rows builds no table and
    takes no bytes. Same arguments as ``recpipe.pipeline.placement.shard_storage``
    plus the cache policy.

    Args:
        rows (int): local rows of the shard (>= 0).
        dim (int): embedding dimension (a multiple of 4).
        dtype (torch.dtype | str): embedding dtype (tiered tables hold float32).
        optimizer (FusedOptimizer | str): fused optimizer (sgd, rowwise_adagrad or adam).
        mode (Mode | str): ``HYBRID`` or ``CACHING``.
        x (float): cache load factor in ``(0, 1]``.
        cache_policy (CachePolicy | str): ``lfu`` or ``lru`` (sizes a CACHING table's metadata).

    Returns:
        ShardStorage: HBM (fast) and UVM (slow) bytes.

    Raises:
        ValueError: ``dim`` not a multiple of 4, or an optimizer fbgemm's tiered tables
            do not run (the messages of ``plan_fbgemm_tier`` / ``TieredOptimizerConfig``).

    Example::

        fbgemm_shard_storage(1000, 16, torch.float32, "sgd", "CACHING", 0.2, "lru")
        # fast = 192 * 64 + 192 * 8 + 1000 * 4 + 192 * 8 = 19360, slow = 1000 * 64 = 64000
    """
    if rows == 0:
        check_load_factor(x)
        return ShardStorage(fast_bytes=0, slow_bytes=0)
    plan = plan_fbgemm_tier(
        num_rows=rows,
        embedding_dim=dim,
        mode=mode,
        cache_load_factor=x,
        cache_policy=cache_policy,
        optimizer=TieredOptimizerConfig(optimizer=optimizer),
    )
    return fbgemm_tier_bytes(plan, value_bytes=dtype_itemsize(dtype))


# TBE buffers per tier (the names fbgemm registers; absent or empty ones count 0 bytes).
_FAST_BUFFERS: Tuple[str, ...] = ("weights_dev", "momentum1_dev", "momentum2_dev")
_CACHE_BUFFERS: Tuple[str, ...] = ("lxu_cache_weights", "lxu_cache_state", "lxu_state", "cache_index_table_map")
_SLOW_BUFFERS: Tuple[str, ...] = ("weights_uvm", "momentum1_uvm", "momentum2_uvm",
                                  "weights_host", "momentum1_host", "momentum2_host")


TbeCounters = Tuple[Optional[int], Optional[int]]
"""An fbgemm TBE's lookup counters (``step``, ``iter_cpu``), by :func:`tbe_counters`."""


def tbe_counters(tbe: nn.Module) -> TbeCounters:
    """An fbgemm TBE's lookup counters: ``step`` (every lookup) and the host copy
    ``iter_cpu`` of ``iter`` (Adam, LAMB, row-wise Adagrad and the other optimizers
    but SGD: bias correction or decay by iteration), both advanced by the forward.
    Host values only (``iter_cpu`` is a CPU tensor): no device sync.

    Args:
        tbe (nn.Module): an fbgemm ``SplitTableBatchedEmbeddingBagsCodegen`` (or a
            module without these counters: None for each missing one).

    Returns:
        TbeCounters: ``(step, iter_cpu)``.
    """
    step = getattr(tbe, "step", None)
    it = getattr(tbe, "iter_cpu", None)
    return (step if isinstance(step, int) else None, int(it) if isinstance(it, torch.Tensor) else None)


def undo_tbe_lookup(tbe: nn.Module, before: TbeCounters, after: TbeCounters) -> None:
    """Takes back the counter increments of one discarded lookup (``before`` /
    ``after`` it, by :func:`tbe_counters`), keeping those of lookups since (e.g.
    the detached model's eval forwards), so the optimizer steps as if the
    discarded lookup never ran. fbgemm adds 1 to ``iter`` per lookup (its host
    copy may first re-sync from a loaded ``iter``, so only whether it moved counts).

    Args:
        tbe (nn.Module): the TBE the lookup ran on.
        before (TbeCounters): its counters before the lookup.
        after (TbeCounters): its counters right after the lookup.
    """
    if before[0] is not None and after[0] is not None:
        tbe.step -= after[0] - before[0]  # pyre-ignore[16]
    if before[1] is not None and after[1] is not None and after[1] != before[1]:
        tbe.iter_cpu.sub_(1)  # pyre-ignore[29]
        tbe.iter.sub_(1)  # pyre-ignore[29]


def split_tier(pos: torch.Tensor, fast_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Tier and index of HYBRID rows from their hashed positions ``H(r)``.

    Args:
        pos (torch.Tensor): int64 hashed positions.
        fast_rows (int): rows ``k`` of the fast tier.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: ``(in_fast, index)``: ``H(r) < k``, and
        ``H(r)`` in the fast tier or ``H(r) - k`` in the slow tier.
    """
    in_fast = pos < fast_rows
    return in_fast, torch.where(in_fast, pos, pos - fast_rows)


class FbgemmTier(nn.Module):
    """The rows of one shard in an fbgemm TBE, with device-side statistics.

    Args:
        plan (FbgemmTierPlan): from :func:`plan_fbgemm_tier`.
        split_pos (torch.Tensor | None): HYBRID (``plan.split_map``): the hashed position
            ``H(r)`` of every local row ``r``, in local-id order (the shard's split hash of
            ``arange(R)``); None for the other layouts.
        pooling (str): ``sum`` or ``mean``.
        device (torch.device): the TBE's device (``cuda``, or ``cpu`` for a ``cpu`` plan).
        stats (torch.Tensor): the shard's int64 counters (``2 * len(TIERED_STATS)``, on
            ``device``), updated in place by every lookup.
    """

    def __init__(
        self,
        plan: FbgemmTierPlan,
        *,
        split_pos: Optional[torch.Tensor],
        pooling: str,
        device: torch.device,
        stats: torch.Tensor,
    ) -> None:
        super().__init__()
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

        if (device.type == "cuda") != (plan.compute_device == "cuda"):
            raise ValueError(f"an fbgemm plan for compute_device={plan.compute_device!r} cannot run on {device}: "
                             "plan with the shard's device type.")
        self.plan = plan
        self.pooling = pooling
        self.device = device
        self._stats = stats
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(**fbgemm_tbe_kwargs(plan, device))
        self._has_cache: bool = self.tbe.lxu_cache_weights.numel() > 0
        R = plan.num_rows
        self._two_tables = len(plan.tables) == 2
        # HYBRID: the hashed position of every local row, on the device (route_ids syncs on CUDA).
        self.split_pos: Optional[torch.Tensor] = None
        if plan.split_map:
            if split_pos is None or tuple(split_pos.shape) != (R,):
                raise ValueError(f"a HYBRID fbgemm tier needs split_pos, the hashed position of each of its {R} "
                                 "rows (the shard's split hash).")
            dt = torch.int32 if R < 2**31 else torch.int64
            self.split_pos = split_pos.to(dt).to(device)
        self.step = 0  # SGD steps (fbgemm counts only the other optimizers' steps)
        self._step_sets = 0  # set_step() calls: a lookup's counters set since are not taken back

    # ------------------------------------------------------------- layout
    def locate(self, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Table and row within it of local rows.

        Args:
            rows (torch.Tensor): int64 local row ids on the TBE's device.

        Returns:
            Tuple[torch.Tensor, torch.Tensor]: ``(table, index)`` int64.
        """
        if self.split_pos is None:
            return torch.zeros_like(rows), rows
        pos = self.split_pos.index_select(0, rows).to(torch.int64)
        in_fast, idx = split_tier(pos, self.plan.fast_rows)
        if not self._two_tables:
            return torch.zeros_like(rows), idx
        return (~in_fast).to(torch.int64), idx

    def _states(self) -> List[List[torch.Tensor]]:
        """Per table: ``[weights [rows, D], state [rows] or [rows, D] ...]`` (views)."""
        weights = self.tbe.split_embedding_weights()
        states = self.tbe.split_optimizer_states() if self.plan.optimizer is not FusedOptimizer.SGD else []
        return [[weights[t]] + (list(states[t]) if states else []) for t in range(len(self.plan.tables))]

    def _table_rows(self, rows: Optional[torch.Tensor] = None
                    ) -> Iterator[Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]]:
        """Per table: the positions in ``rows`` (local rows; None: every row, in local-id order) of
        the rows it holds, their rows within it, and its :meth:`_states` views."""
        if rows is None:
            rows = torch.arange(self.plan.num_rows, dtype=torch.int64, device=self.device)
        table, idx = self.locate(rows)
        for t, parts in enumerate(self._states()):
            sel = (table == t).nonzero().squeeze(1)
            yield sel, idx.index_select(0, sel), parts

    @torch.no_grad()
    def read_rows(self, state_cols: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every local row's value and optimizer state, in local-id order.

        Reads the UVM store: the caller flushes the cache first (``export_state`` does).

        Args:
            state_cols (int): columns of the recpipe state layout
                (``TieredOptimizerConfig.state_cols``).

        Returns:
            Tuple[torch.Tensor, torch.Tensor]: ``[R, D]`` values and ``[R, state_cols]``
            fp32 state (row-wise Adagrad: the momentum; Adam: ``exp_avg`` then ``exp_avg_sq``).
        """
        R, D = self.plan.num_rows, self.plan.embedding_dim
        w = torch.empty((R, D), dtype=torch.float32, device=self.device)
        s = torch.empty((R, state_cols), dtype=torch.float32, device=self.device)
        for sel, src, parts in self._table_rows():
            w.index_copy_(0, sel, parts[0].index_select(0, src).to(torch.float32))
            if state_cols:
                cols = [p.index_select(0, src).reshape(src.numel(), -1).to(torch.float32) for p in parts[1:]]
                s.index_copy_(0, sel, torch.cat(cols, dim=1))
        return w, s

    @torch.no_grad()
    def write_rows(self, weights: torch.Tensor, state: Optional[torch.Tensor],
                   rows: Optional[torch.Tensor] = None) -> None:
        """Sets local rows' values and optimizer state; empties the cache without writing it
        back (a caller setting only some rows flushes first).

        Args:
            weights (torch.Tensor): ``[n, D]`` values of ``rows``.
            state (torch.Tensor | None): ``[n, state_cols]`` fp32 state (None: zeros).
            rows (torch.Tensor | None): int64 local rows (None: every row, ``n = R``, in
                local-id order).
        """
        weights = weights.to(self.device)
        if state is not None:
            state = state.to(self.device)
        if rows is not None:
            rows = rows.to(self.device)
        for sel, dst, parts in self._table_rows(rows):
            parts[0].index_copy_(0, dst, weights.index_select(0, sel).to(parts[0].dtype))
            table_state = state.index_select(0, sel) if state is not None else None  # this table's rows
            col = 0
            for p in parts[1:]:
                width = 1 if p.dim() == 1 else p.shape[1]
                if table_state is None:
                    p.index_fill_(0, dst, 0)
                else:
                    v = table_state[:, col:col + width]
                    p.index_copy_(0, dst, v.reshape((-1,) + tuple(p.shape[1:])).to(p.dtype))
                col += width
        self.tbe.reset_cache_states()

    @torch.no_grad()
    def flush(self) -> int:
        """Writes the HBM cache back to the UVM store (no-op without a cache).

        Returns:
            int: rows written back (every occupied slot: fbgemm keeps no dirty bit).
        """
        if not self._has_cache:
            return 0
        n = int((self.tbe.lxu_cache_state >= 0).sum())
        self.tbe.flush()
        return n

    def get_step(self) -> int:
        """The recorded optimizer step: fbgemm's ``iter`` (what its checkpoints hold; a device
        read on CUDA), or recpipe's for SGD. It equals the host counter ``iter_cpu`` unless
        :meth:`set_optimizer_step` set it after the TBE's first update."""
        if self.plan.optimizer is FusedOptimizer.SGD:
            return self.step
        return int(self.tbe.iter.item())

    @torch.no_grad()
    def set_optimizer_step(self, step: int) -> None:
        """fbgemm's ``set_optimizer_step`` (``iter``; its host counter ``iter_cpu`` takes it
        at the next update only while 0), and this tier's SGD step count.

        Args:
            step (int): the step, an int >= 0.
        """
        self.tbe.set_optimizer_step(step)
        self.step = step

    @torch.no_grad()
    def set_step(self, step: int) -> None:
        """Sets the optimizer step of loaded rows (Adam bias correction continues from it):
        fbgemm's ``iter``, its host counter ``iter_cpu`` reset to 0 so that the next update
        re-reads ``iter`` as after fbgemm's own checkpoint load (a later
        :meth:`set_optimizer_step` still applies, as on a restored FUSED table)."""
        self.step = step
        self._step_sets += 1
        self.tbe.iter.fill_(step)
        self.tbe.iter_cpu.fill_(0)

    def lookup_counters(self) -> Tuple[int, int, TbeCounters]:
        """The counters a training lookup advances, host values only (no device sync).

        Returns:
            Tuple[int, int, TbeCounters]: this tier's SGD ``step``, its :meth:`set_step`
            count, and the TBE's :func:`tbe_counters`.
        """
        return self.step, self._step_sets, tbe_counters(self.tbe)

    def undo_lookup(self, before: Tuple[int, int, TbeCounters], after: Tuple[int, int, TbeCounters]) -> None:
        """Takes back what one discarded lookup advanced (its :meth:`lookup_counters`
        ``before`` / ``after`` it): the TBE's ``step``, and, unless :meth:`set_step`
        ran since the lookup (a load set the step, which erased the increment), this
        tier's ``step`` and the TBE's ``iter`` / ``iter_cpu``.

        Args:
            before (Tuple[int, int, TbeCounters]): the counters before the lookup.
            after (Tuple[int, int, TbeCounters]): the counters right after it.
        """
        step_before, _, tbe_before = before
        step_after, sets_after, tbe_after = after
        if self._step_sets == sets_after:
            self.step -= step_after - step_before
            undo_tbe_lookup(self.tbe, tbe_before, tbe_after)
        else:  # only fbgemm's own lookup count survived the set
            undo_tbe_lookup(self.tbe, tbe_before, (tbe_after[0], None))

    def tier_tensors(self) -> Dict[str, List[Tuple[str, torch.Tensor]]]:
        """The TBE's row and cache buffers per tier (see :func:`fbgemm_tier_bytes`).

        Returns:
            Dict[str, List[Tuple[str, torch.Tensor]]]: ``{"fast": [...], "slow": [...]}``;
            with a ``cpu`` plan every row buffer is a HOST buffer, listed as slow.
        """
        def held(names: Tuple[str, ...], rows: bool) -> List[Tuple[str, torch.Tensor]]:
            out = []
            for name in names:
                t = getattr(self.tbe, name, None)
                # fbgemm registers unused optimizer-state buffers as 1-element int64 placeholders
                if isinstance(t, torch.Tensor) and t.numel() and (t.is_floating_point() or not rows):
                    out.append((name, t))
            return out

        fast = held(_FAST_BUFFERS, True) + (held(_CACHE_BUFFERS, False) if self._has_cache else [])
        if self.split_pos is not None:
            fast.append(("split_pos", self.split_pos))
        return {"fast": fast, "slow": held(_SLOW_BUFFERS, True)}

    # ------------------------------------------------------------- lookup
    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor]) -> torch.Tensor:
        """Pooled lookup of local ids; fbgemm's backward applies the fused optimizer.

        Args:
            ids (torch.Tensor): 1-D local row ids.
            offsets (torch.Tensor): ``B + 1`` bag offsets.
            psw (torch.Tensor | None): per-sample weights (sum pooling).

        Returns:
            torch.Tensor: ``[B, embedding_dim]``.
        """
        R, D, k = self.plan.num_rows, self.plan.embedding_dim, self.plan.fast_rows
        ids = ids.to(torch.int64)
        offsets = offsets.to(torch.int64)
        n = ids.numel()
        B = offsets.numel() - 1
        if n:
            torch._assert_async(((ids >= 0) & (ids < R)).all(),
                                f"tiered table: local ids outside [0, {R}) (route global ids first)")
        if torch.is_grad_enabled():
            self.step += 1
        lengths = offsets[1:] - offsets[:-1]
        with torch.no_grad():
            uniq = ids.sort().values
            unique_rows = (uniq[1:] != uniq[:-1]).sum() + (1 if n else 0)
        zero = ids.new_zeros(())
        hits = fast = loaded = evicted = zero
        if self.split_pos is not None:
            pos = self.split_pos.index_select(0, ids).to(torch.int64)
            in_fast, idx = split_tier(pos, k)
            with torch.no_grad():
                hits = fast = in_fast.sum()
            if self._two_tables:
                perm = torch.argsort((~in_fast).to(torch.int32), stable=True)
                idx = idx.index_select(0, perm)
                bag = torch.searchsorted(offsets, torch.arange(n, device=ids.device), right=True) - 1
                fast_per_bag = torch.zeros(B, dtype=torch.int64, device=ids.device).index_add_(
                    0, bag, in_fast.to(torch.int64))
                counts = torch.cat([fast_per_bag, lengths - fast_per_bag])
                tbe_offsets = torch.cat([offsets.new_zeros(1), counts.cumsum(0)])
                w = psw.index_select(0, perm) if psw is not None else None
                both = self.tbe(idx, tbe_offsets, w)  # [B, 2D]: fast-tier bags, then slow-tier bags
                out = both[:, :D] + both[:, D:]
            else:
                out = self.tbe(idx, offsets, psw)  # the slow table alone: k == 0, idx == pos
        elif self._has_cache:
            with torch.no_grad():
                lin = torch.ops.fbgemm.linearize_cache_indices(self.tbe.cache_hash_size_cumsum, ids, offsets)
                before = torch.ops.fbgemm.lxu_cache_lookup(lin, self.tbe.lxu_cache_state,
                                                           self.tbe.total_cache_hash_size)
                hits = (before >= 0).sum()
                state_before = self.tbe.lxu_cache_state.clone()
            out = self.tbe(ids, offsets, psw)
            with torch.no_grad():
                fast = (self.tbe.lxu_cache_locations >= 0).sum()
                changed = self.tbe.lxu_cache_state != state_before
                loaded = changed.sum()
                evicted = (changed & (state_before >= 0)).sum()
        else:
            out = self.tbe(ids, offsets, psw)
            if self.plan.layout is Layout.ALL_FAST:
                hits = fast = ids.new_full((), n)
        if self.pooling == "mean":
            out = out / lengths.clamp(min=1).to(out.dtype).unsqueeze(1)
        with torch.no_grad():
            last = torch.stack([ids.new_full((), n), unique_rows, hits, fast, loaded, evicted, evicted])
            K = len(TIERED_STATS)
            self._stats[:K].copy_(last)
            self._stats[K:].add_(last)
        return out
