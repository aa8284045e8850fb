"""The byte formulas: bytes per tier of a shard and of a machine, native layout and fbgemm's TBE.

The planner budgets and the runtime allocates with these same functions. Imports only ``.values``,
``.cache_policies`` and ``.dynamic_options``."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Optional, Protocol, Tuple, Union

import torch

from recpipe.pipeline.placement.cache_policies import CachePolicy, cache_policy_spec
from recpipe.pipeline.placement.dynamic_options import (
    DynamicTableOptions,
    dynamic_counter_slots,
    dynamic_index_bytes,
    dynamic_local_slots,
)
from recpipe.pipeline.placement.values import (
    SUPPORTED_OPTIMIZERS,
    FusedOptimizerKind,
    Mode,
    check_int,
    check_load_factor,
    dtype_itemsize,
    local_rows,
    resolve_dtype,
)

#: Fast-tier bytes per local row of a native CACHING table: the int64 row -> slot map.
CACHE_ROW_MAP_BYTES: int = 8
#: Ways per set of fbgemm's UVM cache on NVIDIA GPUs (the warp size, fbgemm's
#: ``DEFAULT_ASSOC``); fbgemm cache slots are ``cache_sets * FBGEMM_CACHE_ASSOC``.
FBGEMM_CACHE_ASSOC: int = 32
#: Bytes per local row of the int32 row -> hashed position map of an fbgemm HYBRID shard (HBM).
SPLIT_MAP_BYTES: int = 4


def optimizer_state_bytes_per_row(optimizer: Union[FusedOptimizerKind, str], dim: int) -> int:
    """Bytes of fp32 fused optimizer state per row: sgd 0, rowwise_adagrad 4, adagrad ``4 * dim``, adam ``8 * dim``."""
    dim = check_int(dim, "dim", 1)
    opt = FusedOptimizerKind.parse(optimizer)
    return {FusedOptimizerKind.SGD: 0, FusedOptimizerKind.ROWWISE_ADAGRAD: 4, FusedOptimizerKind.ADAGRAD: 4 * dim}.get(
        opt, 8 * dim
    )


@functools.lru_cache(maxsize=None)
def decimal_ratio(x: float) -> Tuple[int, int]:
    """``x`` as the exact ratio ``(numerator, denominator)`` of its shortest round-trip
    decimal, e.g. ``0.3 -> (3, 10)``."""
    f = Fraction(repr(float(x)))
    return f.numerator, f.denominator


def row_bytes(dim: int, dtype: Union[torch.dtype, str], optimizer: Union[FusedOptimizerKind, str]) -> int:
    """Bytes of one embedding row with its optimizer state."""
    dim = check_int(dim, "dim", 1)
    return dim * dtype_itemsize(resolve_dtype(dtype)) + optimizer_state_bytes_per_row(optimizer, dim)


def max_local_rows(num_embeddings: int, world_size: int) -> int:
    """Rows of the largest shard (rank 0): ``ceil(N / W)``, what per-rank sizing uses."""
    return local_rows(num_embeddings, world_size, 0)


def floor_fraction(x: float, rows: int) -> int:
    """``floor(x * rows)`` with ``x`` read as its shortest round-trip decimal (``int(0.3 * 10)`` would give 2)."""
    check_load_factor(x, "x")
    rows = check_int(rows, "rows", 0)
    num, den = decimal_ratio(float(x))
    return (num * rows) // den


def tier_split(rows: Any, num: Any, den: Any, caching: Any) -> Tuple[Any, Any, Any]:
    """:func:`tier_rows` on ints or element-wise on numpy arrays, for ``x = num / den``."""
    k = (num * rows) // den
    cached = caching * (num < den)  # CACHING with x < 1
    fast_rows = k - k * cached
    return fast_rows, rows - fast_rows, k * cached


def tier_rows(rows: int, mode: Union[Mode, str], x: float) -> Tuple[int, int, int]:
    """Split a shard's rows between the tiers: ``(fast_rows, slow_rows, cache_slots)``; with
    ``k = floor_fraction(x, rows)``, ``x == 1`` gives ``(rows, 0, 0)``, HYBRID ``(k, rows - k, 0)``,
    CACHING ``(0, rows, k)``."""
    check_load_factor(x)
    caching = Mode.parse(mode) is Mode.CACHING
    rows = check_int(rows, "rows", 0)
    num, den = decimal_ratio(float(x))
    fast_rows, slow_rows, cache_slots = tier_split(rows, num, den, caching)
    return int(fast_rows), int(slow_rows), int(cache_slots)


@dataclass(frozen=True)
class ShardStorage:
    """Bytes of one shard per tier."""

    fast_bytes: int
    """HBM (fast tier) bytes: rows, cache slots and metadata."""
    slow_bytes: int
    """Host DDR (slow tier) bytes."""


def native_tier_bytes(
    rows: Any, fast_rows: Any, slow_rows: Any, slots: Any, row_bytes: Any, cached: Any, slot_bytes: int
) -> Tuple[Any, Any]:
    """``(fast, slow)`` bytes of the native layout, on ints or numpy arrays; optimizer state moves with its row."""
    fast = (fast_rows + slots) * row_bytes + cached * (rows * CACHE_ROW_MAP_BYTES + slots * slot_bytes)
    return fast, slow_rows * row_bytes


def shard_storage(
    rows: int,
    dim: int,
    dtype: Union[torch.dtype, str],
    optimizer: Union[FusedOptimizerKind, str],
    mode: Union[Mode, str],
    x: float,
    cache_policy: Union[CachePolicy, str] = CachePolicy.LFU,
) -> ShardStorage:
    """Bytes per tier of a native-layout shard of ``rows`` local rows."""
    fast_rows, slow_rows, slots = tier_rows(rows, mode, x)
    cached = Mode.parse(mode) is Mode.CACHING and float(x) < 1.0
    rb = row_bytes(dim, dtype, optimizer)
    return ShardStorage(
        *native_tier_bytes(rows, fast_rows, slow_rows, slots, rb, cached, cache_policy_spec(cache_policy).slot_bytes)
    )


def dynamic_shard_storage(
    options: DynamicTableOptions,
    num_embeddings: int,
    shards: int,
    dim: int,
    dtype: Union[torch.dtype, str],
    optimizer: Union[FusedOptimizerKind, str],
    mode: Union[Mode, str],
    x: float,
    cache_policy: Union[CachePolicy, str] = CachePolicy.LFU,
    rows_storage: Callable[..., ShardStorage] = shard_storage,
) -> ShardStorage:
    """Bytes per tier of one shard of a dynamic table over ``shards`` shards (every shard holds the same slots).

    Its rows are a tiered shard of ``slots = dynamic_local_slots(options.table_capacity(num_embeddings), shards)``
    rows sized by ``rows_storage`` (:func:`shard_storage`, recpipe's layout, or :func:`fbgemm_shard_storage`),
    and its hash index, ``dynamic_index_bytes(slots, dynamic_counter_slots(options, num_embeddings, shards))``
    (with admission, its counter table too), is in the fast tier.

    Args:
        options: the table's dynamic options (its capacity and admission).
        num_embeddings: the table's ``num_embeddings`` (the capacity when ``options.capacity`` is None).
        shards: shards of the table: the world size row-wise, 1 table-wise.
        dim, dtype, optimizer, mode, x, cache_policy: as :func:`shard_storage`.
        rows_storage: the byte formula of the slots' tiered shard.

    Raises:
        ValueError: ``options`` is not a ``DynamicTableOptions``, or a bad size or placement.
    """
    if not isinstance(options, DynamicTableOptions):
        raise ValueError(
            f"options must be a DynamicTableOptions, got {type(options).__name__}; e.g. DynamicTableOptions(capacity="
            "1_000_000)."
        )
    num_embeddings = check_int(num_embeddings, "num_embeddings", 1)
    shards = check_int(shards, "shards", 1)
    slots = dynamic_local_slots(options.table_capacity(num_embeddings), shards)
    rows = rows_storage(slots, dim, dtype, optimizer, mode, x, cache_policy)
    index = dynamic_index_bytes(slots, dynamic_counter_slots(options, num_embeddings, shards))
    return ShardStorage(fast_bytes=rows.fast_bytes + index, slow_bytes=rows.slow_bytes)


class FbgemmTierLayout(Protocol):
    """The tables of a shard on fbgemm's TBE, as :func:`fbgemm_tier_bytes` reads them
    (``recpipe.pipeline.tiered.tbe_tables.FbgemmTierPlan`` is one)."""

    num_rows: int
    embedding_dim: int
    fast_rows: int
    cache_slots: int
    split_map: bool
    cache_algorithm: Optional[str]
    optimizer: FusedOptimizerKind
    compute_device: str


def fbgemm_cache_sets(slots: Any) -> Any:
    """Sets of fbgemm's cache for ``slots`` planned slots: ``max(1, slots // 32)`` (ints or numpy arrays)."""
    return slots // FBGEMM_CACHE_ASSOC + (slots < FBGEMM_CACHE_ASSOC)


def fbgemm_bytes(
    rows: Any,
    fast_rows: Any,
    slots: Any,
    value_bytes: Any,
    state_bytes: Any,
    rowwise: Any,
    split_map: Any,
    policy_bytes: Any,
) -> Tuple[Any, Any]:
    """``(fast, slow)`` bytes of fbgemm's TBE plus recpipe's split map, on ints or numpy arrays. fbgemm keeps a DEVICE
    table's optimizer state and row-wise state (one fp32 per row) in HBM, a UVM row's per-element state in UVM (never
    cached); a cache adds ``lxu_cache_state`` (8 bytes/slot), ``cache_index_table_map`` (4 bytes/row) and the policy's
    ``fbgemm_state_bytes``."""
    s_fast = state_bytes * rowwise
    fast = fast_rows * (value_bytes + state_bytes) + (rows - fast_rows) * s_fast + split_map * rows * SPLIT_MAP_BYTES
    fast = fast + (slots > 0) * (slots * (value_bytes + 8) + rows * 4 + policy_bytes)
    return fast, (rows - fast_rows) * (value_bytes + state_bytes - s_fast)


def fbgemm_tier_bytes(plan: FbgemmTierLayout, value_bytes: int = 4) -> ShardStorage:
    """HBM (fast) and UVM (slow) bytes of a CUDA shard's TBE tables of ``value_bytes`` per row element,
    fixed per-TBE buffers excluded."""
    if plan.compute_device != "cuda":
        raise ValueError("fbgemm_tier_bytes describes the CUDA tables: plan with compute_device='cuda'.")
    R, S = plan.num_rows, plan.cache_slots if plan.cache_algorithm is not None else 0
    algorithm = plan.cache_algorithm
    policy = cache_policy_spec(algorithm).fbgemm_state_bytes(R, S) if S and algorithm is not None else 0
    fast, slow = fbgemm_bytes(
        R,
        plan.fast_rows,
        S,
        plan.embedding_dim * value_bytes,
        optimizer_state_bytes_per_row(plan.optimizer, plan.embedding_dim),
        plan.optimizer is FusedOptimizerKind.ROWWISE_ADAGRAD,
        plan.split_map,
        policy,
    )
    return ShardStorage(fast_bytes=fast, slow_bytes=slow)


def fbgemm_shard_storage(
    rows: int,
    dim: int,
    dtype: Union[torch.dtype, str],
    optimizer: Union[FusedOptimizerKind, str],
    mode: Union[Mode, str],
    x: float,
    cache_policy: Union[CachePolicy, str],
) -> ShardStorage:
    """Bytes per tier of a CUDA shard on fbgemm's TBE (the tables ``tiered.fbgemm.plan_fbgemm_tier`` builds);
    arguments as :func:`shard_storage`, an empty shard has no tables."""
    rows = check_int(rows, "rows", 0)
    fast_rows, slow_rows, slots = tier_rows(rows, mode, x)
    spec = cache_policy_spec(cache_policy)
    if rows == 0:
        return ShardStorage(fast_bytes=0, slow_bytes=0)
    dim = check_int(dim, "dim", 1)
    if dim % 4:
        raise ValueError(f"embedding_dim={dim}: fbgemm's TBE needs a positive multiple of 4.")
    opt = FusedOptimizerKind.parse(optimizer)
    if opt not in SUPPORTED_OPTIMIZERS:
        raise ValueError(
            f"optimizer {opt.value} is not supported by tiered tables: use one of "
            f"{sorted(o.value for o in SUPPORTED_OPTIMIZERS)}."
        )
    caching = slow_rows > 0 and Mode.parse(mode) is Mode.CACHING
    S = fbgemm_cache_sets(slots) * FBGEMM_CACHE_ASSOC if caching else 0
    v = dim * dtype_itemsize(dtype)
    fast, slow = fbgemm_bytes(
        rows,
        fast_rows,
        S,
        v,
        optimizer_state_bytes_per_row(opt, dim),
        opt is FusedOptimizerKind.ROWWISE_ADAGRAD,
        slow_rows > 0 and not caching,
        spec.fbgemm_state_bytes(rows, S),
    )
    return ShardStorage(fast_bytes=fast, slow_bytes=slow)


def machine_storage(
    num_embeddings: int,
    world_size: int,
    local_world_size: int,
    dim: int,
    dtype: Union[torch.dtype, str],
    optimizer: Union[FusedOptimizerKind, str],
    mode: Union[Mode, str],
    x: float,
) -> ShardStorage:
    """Bytes of one table on machine 0, the most loaded (arguments as :func:`shard_storage`)."""
    return machine_sum(
        num_embeddings, world_size, local_world_size, lambda rows: shard_storage(rows, dim, dtype, optimizer, mode, x)
    )


def machine_sum(
    num_embeddings: int, world_size: int, local_world_size: int, shard: Callable[[int], ShardStorage]
) -> ShardStorage:
    """Bytes of one table summed over machine 0's ranks, from ``shard(local_rows)``."""
    num_embeddings = check_int(num_embeddings, "num_embeddings", 0)
    world_size = check_int(world_size, "world_size", 1)
    local_world_size = check_int(local_world_size, "local_world_size")
    if not 1 <= local_world_size <= world_size:
        raise ValueError(f"local_world_size must be in [1, world_size={world_size}], got {local_world_size}.")
    big, n_big, n_small = machine_split(num_embeddings, world_size, local_world_size)
    shards = [(n_big, shard(big))] + ([(n_small, shard(big - 1))] if n_small else [])
    fast = sum(n * s.fast_bytes for n, s in shards)
    return ShardStorage(fast_bytes=fast, slow_bytes=sum(n * s.slow_bytes for n, s in shards))


def machine_split(num_embeddings: Any, world_size: int, local_world_size: int) -> Tuple[Any, Any, Any]:
    """``(big, n_big, n_small)``: machine 0 hosts ``n_big`` ranks of ``ceil(N / W)`` rows and ``n_small``
    of one fewer; on ints or element-wise on numpy arrays of ``N``."""
    big = (num_embeddings + world_size - 1) // world_size
    rem = num_embeddings % world_size
    n = rem + (rem == 0) * local_world_size
    n_big = n - (n > local_world_size) * (n - local_world_size)  # min(n, L)
    return big, n_big, local_world_size - n_big
