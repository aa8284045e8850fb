"""Byte accounting for tiered embedding tables: THE single source of truth.

Every number of bytes the planner budgets, and every buffer the tiered-storage
runtime allocates, comes from the functions in this file. The runtime must
allocate exactly ``shard_storage(...)`` bytes per tier (its tests check
equality), so change a formula here and both sides move together.

Vocabulary:

* **fast tier**: device HBM on CUDA (a host buffer standing in for it on CPU).
* **slow tier**: host DDR, shared by the ``local_world_size`` ranks of a machine.
* **local rows**: rows a rank owns under ``roundrobin`` / ``hash_roundrobin``
  routing, where global (hashed) id ``h`` lives on rank ``h % W`` at local id
  ``h // W``.
* **HYBRID**: a static split. ``floor(x * rows)`` rows live in the fast tier, the
  rest in the slow tier; no metadata.
* **CACHING**: the full table lives in the slow tier (backing store) and
  ``floor(x * rows)`` fast-tier slots cache rows, with a row -> slot map and
  per-slot metadata in the fast tier.
* ``x == 1.0``: every row in the fast tier, no slow tier, no cache (both modes
  collapse to "all in HBM").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Tuple, Union

import torch

# Bytes of fast-tier metadata per LOCAL ROW of a CACHING table: one int64
# row -> slot index (-1 when the row is not cached). Source: recpipe tiered
# storage design (ARCHITECTURE.md "Placement"); int64 = 8 bytes.
CACHE_ROW_MAP_BYTES: int = 8
# Bytes of fast-tier metadata per CACHE SLOT of a CACHING table: one int64
# slot -> row index plus one int64 eviction score (LFU count / timestamp).
# Source: recpipe tiered storage design; 2 x int64 = 16 bytes.
CACHE_SLOT_BYTES: int = 16

# Optimizer state bytes per row, as a function of dim. fp32 state = 4 bytes.
# Sources: fbgemm_gpu EmbOptimType: rowwise adagrad keeps one fp32 momentum per
# row; adagrad one fp32 per element; adam fp32 exp_avg + exp_avg_sq per element.
_OPTIMIZER_CHOICES: Tuple[str, ...] = ("sgd", "rowwise_adagrad", "adagrad", "adam")


def optimizer_state_bytes_per_row(optimizer: str, dim: int) -> int:
    """Bytes of fused optimizer state stored next to each embedding row.

    Args:
        optimizer (str): one of ``"sgd"``, ``"rowwise_adagrad"``, ``"adagrad"``,
            ``"adam"`` (case-insensitive).
        dim (int): embedding dimension.

    Returns:
        int: bytes per row: sgd 0, rowwise_adagrad 4, adagrad ``4 * dim``,
        adam ``8 * dim``.

    Example::

        optimizer_state_bytes_per_row("adam", 128)  # 1024
    """
    if dim <= 0:
        raise ValueError(f"dim must be a positive int, got {dim}.")
    name = str(optimizer).lower()
    if name == "sgd":
        return 0
    if name == "rowwise_adagrad":
        return 4
    if name == "adagrad":
        return 4 * dim
    if name == "adam":
        return 8 * dim
    raise ValueError(
        f"Unknown optimizer {optimizer!r}: choose one of {list(_OPTIMIZER_CHOICES)}."
    )


@functools.lru_cache(maxsize=None)
def _decimal_ratio(x: float) -> Tuple[int, int]:
    f = Fraction(repr(float(x)))
    return f.numerator, f.denominator


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: Union[torch.dtype, str]) -> int:
    if isinstance(dtype, str):
        name = dtype.lower().replace("torch.", "")
        aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8"}
        name = aliases.get(name, name)
        resolved = getattr(torch, name, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(
                f"dtype {dtype!r} is not a torch dtype: use e.g. 'float32', 'float16', "
                "'bfloat16' or 'int8'."
            )
        dtype = resolved
    return torch.empty((), dtype=dtype).element_size()


def row_bytes(dim: int, dtype: Union[torch.dtype, str], optimizer: str) -> int:
    """Bytes of one embedding row: its values plus its fused optimizer state.

    Args:
        dim (int): embedding dimension.
        dtype (torch.dtype | str): dtype of the embedding values.
        optimizer (str): fused optimizer (see ``optimizer_state_bytes_per_row``).

    Returns:
        int: ``dim * dtype.itemsize + optimizer_state_bytes_per_row(optimizer, dim)``.

    Example::

        row_bytes(128, torch.float32, "adam")  # 512 + 1024 = 1536
    """
    return dim * _itemsize(dtype) + optimizer_state_bytes_per_row(optimizer, dim)


def local_rows(num_embeddings: int, world_size: int, rank: int) -> int:
    """Rows rank ``rank`` owns under roundrobin / hash_roundrobin routing.

    Global id ``h`` lives on rank ``h % W`` at local id ``h // W``, so rank ``r``
    owns ``ceil((N - r) / W)`` rows; the counts sum to ``N`` over all ranks.

    Args:
        num_embeddings (int): rows of the whole table ``N``.
        world_size (int): number of ranks ``W``.
        rank (int): rank in ``[0, W)``.

    Returns:
        int: ``(N - rank + W - 1) // W``.

    Example::

        [local_rows(10, 4, r) for r in range(4)]  # [3, 3, 2, 2]
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
    if num_embeddings < 0:
        raise ValueError(f"num_embeddings must be >= 0, got {num_embeddings}.")
    return max(0, (num_embeddings - rank + world_size - 1) // world_size)


def max_local_rows(num_embeddings: int, world_size: int) -> int:
    """Rows of the largest shard (rank 0): ``ceil(N / W)``; per-rank sizing uses it.

    Args:
        num_embeddings (int): rows of the whole table.
        world_size (int): number of ranks.

    Returns:
        int: ``local_rows(num_embeddings, world_size, 0)``.
    """
    return local_rows(num_embeddings, world_size, 0)


def _check_load_factor(x: float) -> None:
    if not (isinstance(x, (int, float)) and 0.0 < float(x) <= 1.0):
        raise ValueError(
            f"cache_load_factor must be in (0, 1], got {x!r}: use e.g. 0.1 ... 1.0 "
            "(1.0 = every row in HBM)."
        )


def _floor_fraction(x: float, rows: int) -> int:
    """``floor(x * rows)`` robust to binary float error.

    ``x`` is first read as the shortest decimal that round-trips (``repr``), so
    0.3 means 3/10 exactly (a plain ``int(0.3 * 10)`` gives 2, because
    ``0.3 * 10 == 2.9999999999999996``), then multiplied exactly and floored.
    The runtime must size its tiers with this same function.
    """
    num, den = _decimal_ratio(x)
    return (num * rows) // den


def _mode_name(mode: object) -> str:
    name = getattr(mode, "name", None) or getattr(mode, "value", None) or str(mode)
    name = str(name).upper()
    if name not in ("HYBRID", "CACHING"):
        raise ValueError(f"mode must be HYBRID or CACHING, got {mode!r}.")
    return name


def tier_rows(rows: int, mode: object, x: float) -> Tuple[int, int, int]:
    """Split a shard's rows between the tiers.

    Args:
        rows (int): local rows of the shard.
        mode (Mode | str): ``HYBRID`` or ``CACHING``.
        x (float): cache load factor in ``(0, 1]``.

    Returns:
        Tuple[int, int, int]: ``(fast_rows, slow_rows, cache_slots)``.
        ``x == 1``: ``(rows, 0, 0)``; HYBRID: ``(k, rows - k, 0)``; CACHING:
        ``(0, rows, k)`` with ``k = floor(x * rows)`` computed exactly (the decimal
        value of ``x`` times ``rows``, floored).

    Example::

        tier_rows(10, "CACHING", 0.3)  # (0, 10, 3)
    """
    _check_load_factor(x)
    name = _mode_name(mode)
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}.")
    if float(x) == 1.0:
        return rows, 0, 0
    k = _floor_fraction(x, rows)
    if name == "HYBRID":
        return k, rows - k, 0
    return 0, rows, k


@dataclass(frozen=True)
class ShardStorage:
    """Bytes of one shard per tier.

    Args:
        fast_bytes (int): HBM (fast tier) bytes: rows, cache slots and metadata.
        slow_bytes (int): host DDR (slow tier) bytes.
    """

    fast_bytes: int
    slow_bytes: int


def shard_storage(
    rows: int,
    dim: int,
    dtype: Union[torch.dtype, str],
    optimizer: str,
    mode: object,
    x: float,
) -> ShardStorage:
    """Bytes one shard of ``rows`` local rows needs in each tier.

    ``fast = (fast_rows + cache_slots) * row_bytes`` plus, for CACHING with
    ``x < 1``, ``rows * CACHE_ROW_MAP_BYTES + cache_slots * CACHE_SLOT_BYTES``;
    ``slow = slow_rows * row_bytes``. The per-rank bytes of a table sharded over
    ``W`` ranks are ``shard_storage(max_local_rows(N, W), ...)``.

    Args:
        rows (int): local rows of the shard.
        dim (int): embedding dimension.
        dtype (torch.dtype | str): embedding dtype.
        optimizer (str): fused optimizer name.
        mode (Mode | str): ``HYBRID`` or ``CACHING``.
        x (float): cache load factor in ``(0, 1]``.

    Returns:
        ShardStorage: fast and slow tier bytes.

    Example::

        shard_storage(10, 4, torch.float32, "sgd", "CACHING", 0.3)
        # fast = 3 * 16 + 10 * 8 + 3 * 16 = 176, slow = 10 * 16 = 160
    """
    fast_rows, slow_rows, slots = tier_rows(rows, mode, x)
    rb = row_bytes(dim, dtype, optimizer)
    fast = (fast_rows + slots) * rb
    if _mode_name(mode) == "CACHING" and float(x) < 1.0:
        fast += rows * CACHE_ROW_MAP_BYTES + slots * CACHE_SLOT_BYTES
    return ShardStorage(fast_bytes=fast, slow_bytes=slow_rows * rb)


def machine_storage(
    num_embeddings: int,
    world_size: int,
    local_world_size: int,
    dim: int,
    dtype: Union[torch.dtype, str],
    optimizer: str,
    mode: object,
    x: float,
) -> ShardStorage:
    """Bytes of one table summed over the ranks of the most loaded machine.

    Machine 0 hosts ranks ``0 .. L-1``, which own the largest shards (local rows
    are non-increasing in rank), so it is the most loaded machine for every table.

    Args:
        num_embeddings (int): rows of the whole table.
        world_size (int): number of ranks.
        local_world_size (int): ranks per machine.
        dim (int): embedding dimension.
        dtype (torch.dtype | str): embedding dtype.
        optimizer (str): fused optimizer name.
        mode (Mode | str): ``HYBRID`` or ``CACHING``.
        x (float): cache load factor in ``(0, 1]``.

    Returns:
        ShardStorage: fast and slow bytes summed over ranks ``0 .. L-1``.
    """
    if not 1 <= local_world_size <= world_size:
        raise ValueError(
            f"local_world_size must be in [1, world_size={world_size}], got {local_world_size}."
        )
    big = max_local_rows(num_embeddings, world_size)
    # ranks r < N % W (or all ranks when W divides N) own `big` rows, the rest big - 1.
    rem = num_embeddings % world_size
    n_big = local_world_size if rem == 0 else min(rem, local_world_size)
    n_small = local_world_size - n_big
    s_big = shard_storage(big, dim, dtype, optimizer, mode, x)
    fast, slow = n_big * s_big.fast_bytes, n_big * s_big.slow_bytes
    if n_small:
        s_small = shard_storage(big - 1, dim, dtype, optimizer, mode, x)
        fast += n_small * s_small.fast_bytes
        slow += n_small * s_small.slow_bytes
    return ShardStorage(fast_bytes=fast, slow_bytes=slow)


__all__ = [
    "CACHE_ROW_MAP_BYTES",
    "CACHE_SLOT_BYTES",
    "ShardStorage",
    "local_rows",
    "machine_storage",
    "max_local_rows",
    "optimizer_state_bytes_per_row",
    "row_bytes",
    "shard_storage",
    "tier_rows",
]
