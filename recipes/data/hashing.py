"""Deterministic 32-bit hashing in int64 tensor arithmetic (no overflow).

``fmix32`` is MurmurHash3's 32-bit finaliser. Each 32x32-bit multiply is split
into two 32x16-bit products so every intermediate stays below 2**49 and int64
never overflows: results are identical on every platform and in pure Python.
"""

from __future__ import annotations

import torch

_MASK32: int = 0xFFFFFFFF
# MurmurHash3 fmix32 multipliers (Austin Appleby, public domain reference smhasher).
_C1: int = 0x85EBCA6B
_C2: int = 0xC2B2AE35
# Knuth's 32-bit golden-ratio multiplier, used to mix seeds.
_GOLDEN: int = 0x9E3779B1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` without leaving int64 range."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 finaliser on int64 tensors holding values in ``[0, 2**32)``.

    Args:
        x: int64 tensor, values in ``[0, 2**32)``.

    Returns:
        int64 tensor of hashes in ``[0, 2**32)``.
    """
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def fmix32_int(x: int) -> int:
    """Pure-Python ``fmix32`` (the same function on one int)."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * _C1) & _MASK32
    x ^= x >> 13
    x = (x * _C2) & _MASK32
    return x ^ (x >> 16)


def mix_seed(*parts: int) -> int:
    """Combines integers into one 32-bit seed (order matters)."""
    h = 0
    for p in parts:
        h = fmix32_int(h * _GOLDEN + (p & _MASK32) + ((p >> 32) & _MASK32))
    return h


def hash_ids(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Hashes non-negative int64 ids with a seed to 32-bit values.

    Args:
        ids: int64 tensor of ids ``>= 0`` (any size; high 32 bits are folded in).
        seed: 32-bit seed, e.g. from :func:`mix_seed`.

    Returns:
        int64 tensor of the same shape, values in ``[0, 2**32)``.
    """
    if ids.dtype != torch.int64:
        raise TypeError(f"hash_ids: ids must be int64, got {ids.dtype}; convert with ids.long()")
    folded = (ids & _MASK32) ^ fmix32((ids >> 32) & _MASK32)
    return fmix32(folded ^ (seed & _MASK32))


class VirtualTableProjector:
    """Projects each sparse feature's ids into a large virtual table (micro-DLRM-DRAM).

    Every id of feature ``f`` becomes ``k`` rows ``hash(id, seed_f_j) mod num_rows``,
    ``j < k``: the same data drives ``k`` wide-row lookups per feature, so embedding
    lookups dominate the step (the mlperf-edu micro-DLRM idea).

    Args:
        num_rows: rows of every virtual table.
        k: rows per id (pooling factor of the projected feature).
        seed: base seed; feature ``f`` slot ``j`` uses ``mix_seed(seed, f, j)``.

    Example::

        proj = VirtualTableProjector(num_rows=1 << 18, k=4, seed=0)
        rows = proj(torch.tensor([3, 5]), feature=0)  # shape (2, 4)
    """

    def __init__(self, num_rows: int, k: int, seed: int) -> None:
        if num_rows <= 0 or k <= 0:
            raise ValueError(f"VirtualTableProjector: num_rows={num_rows} and k={k} must be > 0")
        self.num_rows = num_rows
        self.k = k
        self.seed = seed

    def __call__(self, ids: torch.Tensor, feature: int) -> torch.Tensor:
        """Rows of ``ids`` (shape ``(N,)``) for one feature: int64 ``(N, k)``."""
        cols = [
            hash_ids(ids, mix_seed(self.seed, feature, j)) % self.num_rows for j in range(self.k)
        ]
        return torch.stack(cols, dim=1)
