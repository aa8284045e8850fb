"""uint64 hashing of raw keys in int64 torch ops (any device): buckets, salts and initial row values.

torch has no uint64 arithmetic; int64 products wrap as uint64 products do, and a logical right shift is an
arithmetic one masked. ``csrc/dynamic_hash.h`` computes the same functions for the native kernels (the plan,
and float32 uniform rows on the CPU); the formulas are in ``docs/dynamic.md``. Imports
``recpipe.pipeline.placement`` and ``native_plan``.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from recpipe.pipeline.placement import DynamicInitializer
from recpipe.pipeline.tiered.dynamic.native_plan import native_init_uniform

__all__ = [
    "ADMIT_TAG",
    "BUCKET_TAG",
    "INIT_TAG",
    "bucket_of",
    "init_rows",
    "init_salt",
    "mix64",
    "mix64_int",
    "salt_of",
    "to_int64_bits",
]

_MASK64 = (1 << 64) - 1
#: Salt tags: the bucket hash, the admission counters' bucket hash and the initial values use unrelated hashes.
BUCKET_TAG: int = 0x64796E2D62756B74
ADMIT_TAG: int = 0x64796E2D61646D74
INIT_TAG: int = 0x64796E2D696E6974
_GOLDEN: int = 0x9E3779B97F4A7C15
_M1: int = 0xBF58476D1CE4E5B9
_M2: int = 0x94D049BB133111EB


def to_int64_bits(x: int) -> int:
    """The int64 with the bit pattern of the uint64 ``x mod 2^64``."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def mix64_int(x: int) -> int:
    """splitmix64's finalizer of a Python int (as uint64)."""
    x &= _MASK64
    x ^= x >> 30
    x = (x * _M1) & _MASK64
    x ^= x >> 27
    x = (x * _M2) & _MASK64
    return x ^ (x >> 31)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer of int64 tensors read as uint64 (bit patterns in, bit patterns out)."""
    x = x ^ _shr(x, 30)
    x = x * to_int64_bits(_M1)
    x = x ^ _shr(x, 27)
    x = x * to_int64_bits(_M2)
    return x ^ _shr(x, 31)


def salt_of(seed: int, tag: int) -> int:
    """``mix64(seed ^ tag)`` as a uint64 Python int."""
    return mix64_int((seed & _MASK64) ^ tag)


def bucket_of(keys: torch.Tensor, salt: int, num_buckets: int) -> torch.Tensor:
    """``(mix64(key ^ salt) >> 1) % num_buckets`` of int64 keys (int64, the keys' device)."""
    return _shr(mix64(keys ^ to_int64_bits(salt)), 1) % num_buckets


def _fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & _MASK64
    return h


def init_salt(seed: int, table_name: str) -> int:
    """The initial values' salt of one table: ``mix64(seed ^ INIT_TAG ^ fnv1a64(name))``."""
    return mix64_int((seed & _MASK64) ^ INIT_TAG ^ _fnv1a64(table_name.encode()))


def _uniforms(keys: torch.Tensor, salt: int, cols: int) -> torch.Tensor:
    """``u(j)`` in [0, 1) (float64) for ``j < cols`` of every key: ``[n, cols]``."""
    base = mix64(keys.to(torch.int64) ^ to_int64_bits(salt))
    steps = torch.arange(1, cols + 1, dtype=torch.int64, device=keys.device) * to_int64_bits(_GOLDEN)
    bits = _shr(mix64(base.unsqueeze(1) + steps.unsqueeze(0)), 11)
    return bits.to(torch.float64) * 2.0**-53


def init_rows(
    keys: torch.Tensor, dim: int, init: DynamicInitializer, bounds: Tuple[float, float], salt: int, dtype: torch.dtype
) -> torch.Tensor:
    """The initial rows ``[n, dim]`` of ``keys``: a pure function of ``(salt, key)``.

    Args:
        keys (torch.Tensor): int64 keys.
        dim (int): row width.
        init (DynamicInitializer): the distribution.
        bounds (Tuple[float, float]): ``init.bounds(num_embeddings)``.
        salt (int): :func:`init_salt` of the table.
        dtype (torch.dtype): the rows' dtype.
    """
    n = keys.numel()
    if init.mode == "constant":
        return torch.full((n, dim), init.value, dtype=dtype, device=keys.device)
    lo, hi = bounds
    if init.mode == "uniform":
        if keys.device.type == "cpu" and dtype == torch.float32:  # the compiled kernel: the same doubles, faster
            return native_init_uniform(keys.to(torch.int64), dim, salt, lo, hi)
        return (lo + (hi - lo) * _uniforms(keys, salt, dim)).to(dtype)
    u = _uniforms(keys, salt, 2 * dim)
    z = torch.sqrt(-2.0 * torch.log1p(-u[:, 0::2])) * torch.cos((2.0 * math.pi) * u[:, 1::2])
    return (init.mean + init.std * z).clamp(lo, hi).to(dtype)
