"""Typed wrapper and fake kernel of ``torch.ops.recpipe.dynamic_hash_plan``, the dynamic key index's plan.

Importing it loads ``recpipe._C`` (kernel in ``csrc/dynamic_table.cpp``, hashing in ``csrc/dynamic_hash.h``)
and registers the ops' fake kernels, used by ``torch.compile`` / FakeTensor. May import
``recpipe.pipeline.placement`` and ``recpipe._C``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

import recpipe._C  # noqa: F401  (registers torch.ops.recpipe.dynamic_hash_plan)
from recpipe.pipeline.placement import check_int

__all__ = ["native_hash_plan", "native_init_uniform", "native_unique"]

_UINT64_MAX = 2**64 - 1
_INT64_MAX = 2**63 - 1


def _uint64_bits(value: int, name: str) -> int:
    """The int64 with the bit pattern of the uint64 ``value`` (the ops take salts as int64); refuses a value
    outside ``[0, 2**64)``, naming ``name``."""
    value = check_int(value, name, 0, _UINT64_MAX)
    return value - 2**64 if value > _INT64_MAX else value


def _fake_vector(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    torch._check(t.dim() == 1, lambda: f"`{name}` must be 1-D, got shape {list(t.shape)}")
    torch._check(t.dtype == dtype, lambda: f"`{name}` must be {dtype}, got {t.dtype}")


@torch.library.register_fake("recpipe::dynamic_hash_plan")
def _dynamic_hash_plan_fake(
    uniq: torch.Tensor,
    want_insert: Optional[torch.Tensor],
    keys: torch.Tensor,
    scores: torch.Tensor,
    sizes: torch.Tensor,
    bucket_slots: int,
    salt: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    _fake_vector(uniq, "uniq", torch.int64)
    if want_insert is not None:
        _fake_vector(want_insert, "want_insert", torch.bool)
        torch._check(want_insert.shape[0] == uniq.shape[0], lambda: "`want_insert` needs one flag per key of `uniq`")
    for t, name in ((keys, "keys"), (scores, "scores"), (sizes, "sizes")):
        _fake_vector(t, name, torch.int64)
    torch._check(bucket_slots >= 1, lambda: f"`bucket_slots` must be >= 1, got {bucket_slots}")
    torch._check(keys.shape[0] == sizes.shape[0] * bucket_slots, lambda: "`keys` must have B * bucket_slots entries")
    torch._check(scores.shape[0] == keys.shape[0], lambda: "`scores` needs one score per slot of `keys`")
    return uniq.new_empty(uniq.shape), uniq.new_empty(uniq.shape)


def native_hash_plan(
    uniq: torch.Tensor,
    want_insert: Optional[torch.Tensor],
    keys: torch.Tensor,
    scores: torch.Tensor,
    sizes: torch.Tensor,
    bucket_slots: int,
    salt: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plans a lookup of ``uniq`` in a dynamic key index without changing it (the spec's ``plan``).

    Bucket of a key: ``(mix64(uint64(key) ^ salt) >> 1) % B`` (``csrc/dynamic_hash.h``). Bucket ``b``'s
    used slots are ``[b * bucket_slots, b * bucket_slots + sizes[b])``.

    Args:
        uniq (torch.Tensor): ascending unique int64 keys ``[n]`` (e.g. ``torch.unique(keys_in)``), 1-D,
            contiguous, on the CPU.
        want_insert (Optional[torch.Tensor]): bool ``[n]``, the keys that take a slot when absent; None: none.
        keys (torch.Tensor): the index's int64 key of each slot ``[B * bucket_slots]``.
        scores (torch.Tensor): the index's int64 eviction score of each slot ``[B * bucket_slots]``.
        sizes (torch.Tensor): int64 used slots of each bucket ``[B]``, each in ``[0, bucket_slots]``.
        bucket_slots (int): slots per bucket (``BUCKET_SLOTS``), >= 1.
        salt (int): the bucket salt, a uint64 in ``[0, 2**64)``.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: int64 ``(found, slot)``, both ``[n]``. ``found[i]``: the slot
        holding ``uniq[i]``, -1 when absent. ``slot[i]``: -1 unless ``uniq[i]`` is absent and wants a slot;
        then, per bucket in ascending key order, the bucket's free slots in order, then its victims (used
        slots that no key of ``uniq`` holds, by ascending ``(score, slot)``), then -1. A ``slot[i]`` below
        ``b * bucket_slots + sizes[b]`` evicts the key held there.

    Raises:
        ValueError: ``bucket_slots`` or ``salt`` is not an int in range.
        RuntimeError: (from the kernel) a tensor of the wrong dtype, shape, layout or device, ``uniq`` not
            strictly ascending, or a ``sizes`` entry outside ``[0, bucket_slots]``; the message names the
            argument and the fix.
    """
    bucket_slots = check_int(bucket_slots, "bucket_slots", 1, _INT64_MAX)
    salt_bits = _uint64_bits(salt, "salt")
    # the op's int is a signed int64: pass the salt's bit pattern
    found, slot = torch.ops.recpipe.dynamic_hash_plan(uniq, want_insert, keys, scores, sizes, bucket_slots, salt_bits)
    return found, slot


@torch.library.register_fake("recpipe::dynamic_init_uniform")
def _dynamic_init_uniform_fake(
    keys: torch.Tensor, dim: int, init_salt: int, lower: float, upper: float
) -> torch.Tensor:
    _fake_vector(keys, "keys", torch.int64)
    torch._check(dim >= 1, lambda: f"recpipe: `dim` must be >= 1, got {dim}")
    return keys.new_empty((keys.numel(), dim), dtype=torch.float32)


def native_init_uniform(keys: torch.Tensor, dim: int, init_salt: int, lower: float, upper: float) -> torch.Tensor:
    """float32 initial rows ``[n, dim]`` of int64 CPU ``keys`` under the uniform initializer (the compiled kernel
    of ``key_hashing.init_rows``' uniform case, the same doubles).

    Args:
        keys (torch.Tensor): int64 keys.
        dim (int): row width.
        init_salt (int): the table's initial-value salt (a uint64).
        lower, upper (float): the uniform range.

    Raises:
        ValueError: ``init_salt`` is not an int in ``[0, 2**64)``.
    """
    return torch.ops.recpipe.dynamic_init_uniform(
        keys, dim, _uint64_bits(init_salt, "init_salt"), float(lower), float(upper)
    )


@torch.library.register_fake("recpipe::dynamic_unique")
def _dynamic_unique_fake(keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _fake_vector(keys, "keys", torch.int64)
    distinct = torch.library.get_ctx().new_dynamic_size()
    return keys.new_empty((distinct,)), keys.new_empty(keys.shape), keys.new_empty((distinct,))


def native_unique(keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(uniq, inverse, counts)`` of 1-D int64 CPU ``keys``: the compiled kernel of
    ``torch.unique(keys, sorted=True, return_inverse=True, return_counts=True)``, the same tensors (a hash
    set of the keys, then a radix sort of the distinct ones only).

    Raises:
        RuntimeError: (from the kernel) ``keys`` not a 1-D int64 CPU tensor; the message names the fix.
    """
    uniq, inverse, counts = torch.ops.recpipe.dynamic_unique(keys)
    return uniq, inverse, counts
