"""Deterministic 32-bit hashing in int64 tensor arithmetic (no overflow).

``fmix32`` is MurmurHash3's 32-bit finaliser; each 32x32-bit multiply is split into
two 32x16-bit products so intermediates stay below 2**49. On CPU, :func:`hash_ids_grid`
runs the same function in numpy ``uint32`` arithmetic (multiplies wrap by definition).
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

_MASK32: int = 0xFFFFFFFF
# MurmurHash3 fmix32 multipliers (Austin Appleby, public domain reference smhasher).
_C1: int = 0x85EBCA6B
_C2: int = 0xC2B2AE35
# Knuth's 32-bit golden-ratio multiplier, used to mix seeds.
_GOLDEN: int = 0x9E3779B1
# What the hash arithmetic runs on: int64 tensors, or Python ints (exact, unbounded).
_Ints = TypeVar("_Ints", torch.Tensor, int)


def _mul32(x: _Ints, c: int) -> _Ints:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` without leaving int64 range."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def fmix32(x: _Ints) -> _Ints:
    """MurmurHash3 finaliser on int64 tensors (or ints) holding values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def fmix32_int(x: int) -> int:
    """:func:`fmix32` of one int's low 32 bits."""
    return fmix32(x & _MASK32)


def mix_seed(*parts: int) -> int:
    """Combines integers into one 32-bit seed (order matters)."""
    h = 0
    for p in parts:
        h = fmix32_int(h * _GOLDEN + (p & _MASK32) + ((p >> 32) & _MASK32))
    return h


def hash_ids(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Hashes non-negative int64 ids (high 32 bits folded in) with a 32-bit seed to ``[0, 2**32)``."""
    if ids.dtype != torch.int64:
        raise TypeError(f"hash_ids: ids must be int64, got {ids.dtype}; convert with ids.long()")
    return fmix32(_fold(ids) ^ (seed & _MASK32))


def _fold(ids: torch.Tensor) -> torch.Tensor:
    """Folds int64 ids to 32 bits: ``low32 ^ fmix32(high32)`` (the first step of :func:`hash_ids`)."""
    return (ids & _MASK32) ^ fmix32((ids >> 32) & _MASK32)


def _fmix32_np_(x: np.ndarray) -> np.ndarray:
    """In-place ``fmix32`` on a ``uint32`` array (multiplies wrap modulo ``2**32``)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(_C1)
    x ^= x >> np.uint32(13)
    x *= np.uint32(_C2)
    x ^= x >> np.uint32(16)
    return x


def hash_ids_grid(ids: torch.Tensor, seeds: torch.Tensor, modulus: int | None = None) -> torch.Tensor:
    """int64 ``(F, N, k)``: ``out[f, n, j] == hash_ids(ids[f, n], seeds[f, j]) % modulus``, in one broadcast.

    Args:
        ids: int64 ``(F, N)`` ids ``>= 0``.
        seeds: int64 ``(F, k)`` 32-bit seeds.
        modulus: if given (``> 0``), the hashes are reduced modulo it.
    """
    if ids.dtype != torch.int64 or seeds.dtype != torch.int64:
        raise TypeError(
            f"hash_ids_grid: ids and seeds must be int64, got {ids.dtype} and {seeds.dtype}; convert with .long()"
        )
    if ids.dim() != 2 or seeds.dim() != 2 or ids.shape[0] != seeds.shape[0]:
        raise ValueError(
            f"hash_ids_grid: ids (F, N) and seeds (F, k) must share F, got {tuple(ids.shape)} and {tuple(seeds.shape)}"
        )
    if modulus is not None and modulus <= 0:
        raise ValueError(f"hash_ids_grid: modulus={modulus} must be > 0")
    # Hashes lie below 2**32: a larger modulus leaves them unchanged.
    reduce_by = modulus if modulus is not None and modulus < 2**32 else None
    return (_hash_grid_numpy if ids.device.type == "cpu" else _hash_grid_torch)(ids, seeds, reduce_by)


def _hash_grid_torch(ids: torch.Tensor, seeds: torch.Tensor, modulus: int | None) -> torch.Tensor:
    """:func:`hash_ids_grid` in int64 tensor ops (any device)."""
    x = fmix32(_fold(ids).unsqueeze(2) ^ (seeds.to(ids.device) & _MASK32).unsqueeze(1))
    return x if modulus is None else x % modulus


def _hash_grid_numpy(ids: torch.Tensor, seeds: torch.Tensor, modulus: int | None) -> torch.Tensor:
    """:func:`hash_ids_grid` in numpy ``uint32`` ops (CPU tensors; ``modulus < 2**32``)."""
    a = ids.numpy()
    folded = _fmix32_np_(((a >> 32) & _MASK32).astype(np.uint32))
    folded ^= (a & _MASK32).astype(np.uint32)
    x = folded[:, :, None] ^ (seeds.cpu().numpy() & _MASK32).astype(np.uint32)[:, None, :]
    _fmix32_np_(x)
    if modulus is not None:
        x %= np.uint32(modulus)
    # Copy into torch-owned (resizable) storage rather than wrapping numpy's buffer.
    out = torch.empty(x.shape, dtype=torch.int64)
    out.numpy()[...] = x
    return out


class VirtualTableProjector:
    """Projects each sparse feature's ids into a large virtual table (micro-DLRM-DRAM).

    Every id of feature ``f`` becomes ``k`` rows ``hash(id, mix_seed(seed, f, j)) mod num_rows``,
    so embedding lookups dominate the step (the mlperf-edu micro-DLRM idea).
    """

    def __init__(self, num_rows: int, k: int, seed: int) -> None:
        if num_rows <= 0 or k <= 0:
            raise ValueError(f"VirtualTableProjector: num_rows={num_rows} and k={k} must be > 0")
        self.num_rows, self.k, self.seed = num_rows, k, seed
        self._seeds = torch.empty(0, k, dtype=torch.int64)

    def slot_seeds(self, num_features: int) -> torch.Tensor:
        """int64 ``(num_features, k)`` seeds: ``[f, j] = mix_seed(seed, f, j)`` (computed once)."""
        if self._seeds.shape[0] < num_features:
            self._seeds = torch.tensor(
                [[mix_seed(self.seed, f, j) for j in range(self.k)] for f in range(num_features)], dtype=torch.int64
            ).reshape(num_features, self.k)
        return self._seeds[:num_features]

    def project(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ``(F, N, k)`` rows of int64 ``(F, N)`` ids, row ``f`` those of feature ``f``."""
        if ids.dim() != 2:
            raise ValueError(f"VirtualTableProjector.project: ids must be (F, N), got {tuple(ids.shape)}")
        return hash_ids_grid(ids, self.slot_seeds(ids.shape[0]), self.num_rows)

    def __call__(self, ids: torch.Tensor, feature: int) -> torch.Tensor:
        """Rows of ``ids`` (shape ``(N,)``) for one feature: int64 ``(N, k)``."""
        if feature < 0:
            raise ValueError(f"VirtualTableProjector: feature={feature} must be >= 0")
        seeds = self.slot_seeds(feature + 1)[feature : feature + 1]
        return hash_ids_grid(ids.reshape(1, -1), seeds, self.num_rows)[0]


#: Tag of the salts of VirtualKeyProjector (unrelated to the dynamic tables' own bucket and init salts).
VIRTUAL_KEY_TAG: int = 0x6D6963726F2D6B79


class VirtualKeyProjector:
    """``micro_dlrm_dram``'s ids as dynamic-table keys (``--dynamic-tables``): every id of feature ``f`` becomes
    ``k`` raw int64 keys ``mix64(id ^ salt(seed, f, j))`` (``j < k``; splitmix64's finalizer, the dynamic tables'
    own ``recpipe.pipeline.tiered.dynamic.key_hashing.mix64``).

    ``mix64`` is a bijection of the 64-bit values and XOR with a salt is one too, so for each ``(f, j)`` distinct
    ids never share a key; keys of different slots ``j`` meet only by chance (one in 2^64 per pair). The model
    keeps its pooling factor ``k``, as :class:`VirtualTableProjector` does, but a key's row is its own instead of
    one of ``num_rows`` shared ones.
    """

    def __init__(self, k: int, seed: int) -> None:
        if k <= 0:
            raise ValueError(f"VirtualKeyProjector: k={k} must be > 0")
        self.k, self.seed = k, seed
        self._salts = torch.empty(0, k, dtype=torch.int64)

    def slot_salts(self, num_features: int) -> torch.Tensor:
        """int64 ``(num_features, k)`` salts: ``[f, j] = salt_of(mix_seed(seed, f, j), tag)`` as int64 bits."""
        from recpipe.pipeline.tiered.dynamic.key_hashing import salt_of, to_int64_bits

        if self._salts.shape[0] < num_features:
            salts = [
                [salt_of(mix_seed(self.seed, f, j), VIRTUAL_KEY_TAG) for j in range(self.k)]
                for f in range(num_features)
            ]
            self._salts = torch.tensor([[to_int64_bits(s) for s in row] for row in salts], dtype=torch.int64).reshape(
                num_features, self.k
            )
        return self._salts[:num_features]

    def project(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ``(F, N, k)`` keys of int64 ``(F, N)`` ids, row ``f`` those of feature ``f``."""
        from recpipe.pipeline.tiered.dynamic.key_hashing import mix64

        if ids.dtype != torch.int64 or ids.dim() != 2:
            raise ValueError(
                f"VirtualKeyProjector.project: ids must be an int64 (F, N) tensor, got {ids.dtype} {tuple(ids.shape)}"
            )
        salts = self.slot_salts(ids.shape[0]).to(ids.device)
        return mix64(ids.unsqueeze(2) ^ salts.unsqueeze(1))
