"""Typed wrappers and fake kernels of the ``torch.ops.recpipe`` routing ops.

Importing it loads ``recpipe._C`` (``csrc/bucketize*.{cpp,cu}``, math in ``csrc/bucketize_math.h``) and
registers each op's fake kernel beside its wrapper. Distribution types: ``continuous`` (0, fbgemm's block
split, bit-identical), ``roundrobin`` (1, ``owner = id % W``, ``local = id // W``), ``hash_roundrobin`` (2,
roundrobin over a seeded bijection ``H`` of ``[0, N)``: two keyed xorshift-multiply window permutations, no
cycle-walking; dense local ids, aliased patterns spread). A hash_roundrobin table size of 0 means raw keys:
every int64 id is valid (read as unsigned in the index width) and ``H`` is a seeded bijection of the whole
64-bit range (what dynamic tables route). May import ``recpipe.pipeline.placement`` and ``recpipe._C`` only.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

import recpipe._C  # registers torch.ops.recpipe.*; holds the routing constants
from recpipe.pipeline.placement import DIST_TYPES, check_int, local_rows

__all__ = [
    "DIST_TYPES",
    "ROUTING_VERSION",
    "BucketizeResult",
    "block_bucketize_sparse_features",
    "check_int",
    "dist_type_code",
    "hash_roundrobin_global_ids",
    "local_rows",
    "route_ids",
]

#: Version of the hash_roundrobin bijection the kernels compute; checkpoints record it, since
#: rows stored in local-id order are only valid under the routing that wrote them.
ROUTING_VERSION: int = recpipe._C.ROUTING_VERSION

_EXTENSION_DIST_TYPES = {
    "continuous": recpipe._C.DIST_CONTINUOUS,
    "roundrobin": recpipe._C.DIST_ROUNDROBIN,
    "hash_roundrobin": recpipe._C.DIST_HASH_ROUNDROBIN,
}
if _EXTENSION_DIST_TYPES != DIST_TYPES:  # pragma: no cover - guards the extension's table
    raise ImportError(
        f"recpipe._C's dist type codes {_EXTENSION_DIST_TYPES} differ from the placement contract's {DIST_TYPES}: "
        "rebuild recpipe so the extension matches the sources."
    )


def dist_type_code(name: str) -> int:
    """Code (0, 1, 2) of a distribution type name (:data:`DIST_TYPES`)."""
    if not isinstance(name, str) or name not in DIST_TYPES:
        raise ValueError(f"unknown dist_type {name!r}; choose one of {sorted(DIST_TYPES)}")
    return DIST_TYPES[name]


class BucketizeResult(NamedTuple):
    """Outputs of :func:`block_bucketize_sparse_features` in fbgemm's layout. ``new_lengths`` is ``[W * F * B]`` ordered
    (rank, feature, sample), ``new_indices`` and ``new_weights`` follow it; ``new_pos`` (bag positions),
    ``unbucketize_permute`` (output position of each input id) and ``bucket_mapping`` (owner rank of each input id) are
    None unless requested."""

    new_lengths: torch.Tensor
    new_indices: torch.Tensor
    new_weights: Optional[torch.Tensor]
    new_pos: Optional[torch.Tensor]
    unbucketize_permute: Optional[torch.Tensor]
    bucket_mapping: Optional[torch.Tensor] = None


_OptionalTensor = Optional[torch.Tensor]
_INT32_MAX: int = 2**31 - 1
_INT64_MIN: int = -(2**63)
_INT64_MAX: int = 2**63 - 1


def _fake_index_dtype(t: torch.Tensor, name: str) -> None:
    """The kernels' index dtype check, for the fake kernels (same message)."""
    if t.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(
            f"recpipe: `{name}` must be int32 or int64, got {t.dtype}; convert it with `.to(torch.int64)`."
        )


def _check_seed(seed: int) -> None:
    """Raises ``ValueError`` unless ``seed`` is a signed int64."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not _INT64_MIN <= seed <= _INT64_MAX:
        raise ValueError(
            f"`seed` must be an int in [-2**63, 2**63) (the ops take a signed int64; the hash keys use its "
            f"64 bits), got {seed!r}; reduce it, e.g. seed % 2**63."
        )


def _fake_layout_checks(
    lengths: torch.Tensor,
    indices: torch.Tensor,
    F: int,
    weights: Optional[torch.Tensor],
    batch_size_per_feature: Optional[torch.Tensor],
    block_bucketize_pos: Optional[list[torch.Tensor]],
    keep_orig_idx_per_feature: Optional[torch.Tensor],
) -> None:
    """The kernels' static checks of the per-id and per-bag arguments of ``F`` features, same messages."""
    if keep_orig_idx_per_feature is not None and keep_orig_idx_per_feature.dtype != torch.bool:
        raise RuntimeError(
            "recpipe: `keep_orig_idx_per_feature` must be a bool tensor, got "
            f"{keep_orig_idx_per_feature.dtype}; build it with `torch.tensor([...], dtype=torch.bool)`."
        )
    if batch_size_per_feature is None:
        torch._check(
            lengths.numel() % F == 0 if F != 0 else lengths.numel() == 0,
            lambda: (
                f"recpipe: `lengths` has {lengths.numel()} entries, not a multiple of the {F} features "
                "in `dist_types`; lengths must be [F * B] (feature-major), or pass `batch_size_per_feature`."
            ),
        )
    if block_bucketize_pos:
        torch._check(
            len(block_bucketize_pos) == F,
            lambda: (
                f"recpipe: `block_bucketize_pos` has "
                f"{len(block_bucketize_pos)} tensors but `dist_types` has {F}; pass one tensor per feature."
            ),
        )
        for f, b in enumerate(block_bucketize_pos):
            if b.dim() != 1 or b.dtype not in (torch.int32, torch.int64):
                raise RuntimeError(
                    f"recpipe: `block_bucketize_pos[{f}]` must be a 1-D int32/int64 tensor, got "
                    f"{b.dtype} of shape {tuple(b.shape)}."
                )
    if weights is not None:
        torch._check(weights.dim() in (1, 2), lambda: "recpipe: `weights` must be [n] or [n, D] (one row per id)")
        if weights.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise RuntimeError(
                f"recpipe: `weights` must be float16, bfloat16, float32 or float64, got {weights.dtype}."
            )
        torch._check(
            weights.shape[0] == indices.shape[0],
            lambda: (
                f"recpipe: `weights` has {weights.shape[0]} "
                f"entries but `indices` has {indices.shape[0]}; pass one weight per id (or weights=None)."
            ),
        )


@torch.library.register_fake("recpipe::block_bucketize_sparse_features")
def _block_bucketize_fake(
    lengths: torch.Tensor,
    indices: torch.Tensor,
    block_sizes: torch.Tensor,
    dist_types: torch.Tensor,
    my_size: int,
    sequence: bool = False,
    bucketize_pos: bool = False,
    weights: Optional[torch.Tensor] = None,
    table_sizes: Optional[torch.Tensor] = None,
    seed: int = 0,
    keep_orig_idx: bool = False,
    batch_size_per_feature: Optional[torch.Tensor] = None,
    max_B: int = -1,
    block_bucketize_pos: Optional[list[torch.Tensor]] = None,
    total_num_blocks: Optional[torch.Tensor] = None,
    keep_orig_idx_per_feature: Optional[torch.Tensor] = None,
    return_bucket_mapping: bool = False,
    route_bad_ids: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, _OptionalTensor, _OptionalTensor, _OptionalTensor, _OptionalTensor]:
    torch._check(my_size > 0, lambda: f"recpipe: `my_size` (the world size W) must be >= 1, got {my_size}")
    per_feature = dict(
        table_sizes=table_sizes, total_num_blocks=total_num_blocks, batch_size_per_feature=batch_size_per_feature
    )
    required = dict(lengths=lengths, indices=indices, block_sizes=block_sizes, dist_types=dist_types)
    for name, t in {**required, **per_feature}.items():
        if t is not None:
            _fake_index_dtype(t, name)
            torch._check(t.dim() == 1, lambda: f"`{name}` must be 1-D")
    for name, t in (("indices", indices), ("weights", weights)):
        if t is not None and t.device != lengths.device:
            raise RuntimeError(
                f"recpipe: `{name}` is on {t.device} but `lengths` is on {lengths.device}; "
                "move all tensor arguments to one device."
            )
    # the kernels' static (shape / dtype) checks, same messages: a traced call fails at trace time
    F = dist_types.numel()
    for name, t in dict(
        block_sizes=block_sizes, **per_feature, keep_orig_idx_per_feature=keep_orig_idx_per_feature
    ).items():
        if t is not None:
            torch._check(
                t.numel() == F,
                lambda: (
                    f"recpipe: `{name}` has {t.numel()} entries but `dist_types` has {F}; pass one entry per feature."
                ),
            )
    _fake_layout_checks(
        lengths, indices, F, weights, batch_size_per_feature, block_bucketize_pos, keep_orig_idx_per_feature
    )
    # the kernels allocate every output contiguous (at::empty), whatever the inputs' strides
    new_weights = weights.new_empty(weights.shape) if weights is not None else None
    # new_pos, unbucketize_permute and bucket_mapping: one entry per input id, when requested
    new_pos, unbucketize_permute, bucket_mapping = (
        torch.empty_like(indices) if on else None for on in (bucketize_pos, sequence, return_bucket_mapping)
    )
    new_lengths = lengths.new_empty((my_size * lengths.numel(),))
    return new_lengths, torch.empty_like(indices), new_weights, new_pos, unbucketize_permute, bucket_mapping


def _check_my_size(my_size: object) -> None:
    """Refuses a world size that is not an int in ``[1, 2**63)``, naming ``my_size`` and ``world_size``."""
    try:
        check_int(my_size, "my_size", minimum=1, maximum=_INT64_MAX)
    except ValueError as e:
        raise ValueError(
            f"{e} `my_size` is fbgemm's name of the world size (`world_size` in route_ids and "
            "hash_roundrobin_global_ids): the number of ranks W the ids are bucketized over; pass e.g. "
            "my_size=torch.distributed.get_world_size()."
        ) from None


def block_bucketize_sparse_features(
    lengths: torch.Tensor,
    indices: torch.Tensor,
    block_sizes: torch.Tensor,
    dist_types: torch.Tensor,
    my_size: int,
    *,
    sequence: bool = False,
    bucketize_pos: bool = False,
    weights: Optional[torch.Tensor] = None,
    table_sizes: Optional[torch.Tensor] = None,
    seed: int = 0,
    keep_orig_idx: bool = False,
    batch_size_per_feature: Optional[torch.Tensor] = None,
    max_B: int = -1,
    block_bucketize_pos: Optional[list[torch.Tensor]] = None,
    total_num_blocks: Optional[torch.Tensor] = None,
    keep_orig_idx_per_feature: Optional[torch.Tensor] = None,
    return_bucket_mapping: bool = False,
    route_bad_ids: bool = False,
) -> BucketizeResult:
    """Splits every bag of a flat KJT by owner rank. Takes every argument of ``fbgemm.block_bucketize_sparse_features``
    (and its ``_inference`` / ``_2d_weights`` variants) plus per-feature routing; continuous features match fbgemm bit
    for bit. ``[F]`` metadata kept on the CPU lets a CUDA call run without a host sync. On CUDA, bad values fail by a
    device-side assert instead of a Python exception.

    Args:
        lengths: bag lengths, ``[F * B]`` feature-major, or ``[sum(batch_size_per_feature)]`` (VBE).
        block_sizes: ``[F]`` rows per block of continuous features.
        dist_types: ``[F]`` codes of :data:`DIST_TYPES`.
        my_size: world size ``W`` (fbgemm's name; ``world_size`` in :func:`route_ids` and
            :func:`hash_roundrobin_global_ids`).
        weights: per-id weights following their ids, ``[n]`` or ``[n, D]``.
        table_sizes: ``[F]`` row counts; required by hash_roundrobin features. 0 for a hash_roundrobin feature
            means raw keys: any int64 id, ``owner = H(u) % W``, ``local = H(u) // W`` with ``H`` a seeded bijection
            of the whole 64-bit range (int64 indices, or keep the keys as local ids); 0 for a roundrobin feature
            leaves its raw ids unchecked.
        keep_orig_idx_per_feature: ``[F]`` bool, per feature whether the local id is the id itself (a dynamic
            table's raw keys); overrides ``keep_orig_idx``.
        max_B: accepted for fbgemm's signature, unused.
        block_bucketize_pos: per continuous feature, ``W + 1`` uneven shard bounds from 0.
        total_num_blocks: ``[F]`` blocks per continuous table over all ranks (a multiple of ``W``).
        route_bad_ids: route an id outside its roundrobin / hash_roundrobin table (read as unsigned
            ``u``) past rank ``u % W``'s rows, as fbgemm routes ids past a continuous table, so the
            owner's kernel applies its ``bounds_check_mode``; default: ``IndexError``.

    Returns:
        :class:`BucketizeResult`.
    """
    _check_seed(seed)
    if not isinstance(my_size, torch.SymInt):  # a SymInt under tracing is the kernel's to check
        _check_my_size(my_size)
    return BucketizeResult(
        *torch.ops.recpipe.block_bucketize_sparse_features(
            lengths,
            indices,
            block_sizes,
            dist_types,
            my_size,
            sequence,
            bucketize_pos,
            weights,
            table_sizes,
            seed,
            keep_orig_idx,
            batch_size_per_feature,
            max_B,
            block_bucketize_pos,
            total_num_blocks,
            keep_orig_idx_per_feature,
            return_bucket_mapping,
            route_bad_ids,
        )
    )


@torch.library.register_fake("recpipe::route_ids")
def _route_ids_fake(
    ids: torch.Tensor, table_size: int, world_size: int, dist_type: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    _fake_index_dtype(ids, "ids")
    hashed = dist_type == DIST_TYPES["hash_roundrobin"]
    torch._check(dist_type in DIST_TYPES.values(), lambda: f"`dist_type` must be one of {DIST_TYPES}, got {dist_type}")
    torch._check(
        table_size > 0 or (table_size == 0 and hashed),
        lambda: (
            f"recpipe: `table_size` must be >= 1 (the table's row count), got {table_size}; 0 (raw int64 keys, any "
            "value) is accepted by hash_roundrobin (dist_type 2) only."
        ),
    )
    torch._check(world_size > 0, lambda: f"`world_size` must be >= 1, got {world_size}")
    torch._check(
        ids.dtype == torch.int64 or not hashed or table_size > 0,
        lambda: (
            f"recpipe: `ids` are int32 but hash_roundrobin over raw keys (`table_size` = 0) and {world_size} ranks "
            f"gives local ids up to {(2**64 - 1) // world_size}, beyond int32; pass int64 ids (`.to(torch.int64)`)."
        ),
    )
    torch._check(
        ids.dtype == torch.int64 or not hashed or (table_size - 1) // world_size <= _INT32_MAX,
        lambda: (
            f"recpipe: `ids` are int32 but hash_roundrobin over `table_size` = {table_size} rows and "
            f"{world_size} ranks gives local ids up to {(table_size - 1) // world_size}, beyond int32; pass "
            "int64 ids (`.to(torch.int64)`)."
        ),
    )
    # contiguous, as the kernels allocate them (ids may be any shape and strides)
    return ids.new_empty(ids.shape, dtype=torch.int64), ids.new_empty(ids.shape)


def route_ids(
    ids: torch.Tensor, table_size: int, world_size: int, dist_type: str = "hash_roundrobin", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Owner rank (int64) and local id of each id of one table, both shaped like ``ids`` (the KJT op's
    math; continuous uses blocks of ``ceil(N / W)``).

    Args:
        ids: ids of the table, int32 or int64, any shape.
        table_size: the table's row count ``N`` (ids must lie in ``[0, N)``). For hash_roundrobin only, 0 means
            raw keys: every int64 id is valid, read as uint64, and routed by a seeded bijection ``H`` of the
            whole 64-bit range (``owner = H(u) % W``, ``local = H(u) // W``; int64 ids only, and a local id past
            ``2**63 - 1`` (``W == 1``) comes back as its int64 bit pattern).
        world_size: number of ranks ``W``.
        dist_type: a name of :data:`DIST_TYPES`.
        seed: hash seed (signed int64).

    Returns:
        ``(owner, local)``: owner int64, local in the dtype of ``ids``.

    Raises:
        IndexError: an id outside ``[0, N)`` of a table with ``N >= 1``.
        RuntimeError: a bad table size (0 for continuous / roundrobin), world size, dtype or dist type.
    """
    _check_seed(seed)
    # types here; ranges in the kernel (same messages on every entry point)
    table_size = check_int(table_size, "table_size", maximum=_INT64_MAX)
    world_size = check_int(world_size, "world_size", maximum=_INT64_MAX)
    return torch.ops.recpipe.route_ids(ids, table_size, world_size, dist_type_code(dist_type), seed)


@torch.library.register_fake("recpipe::hash_roundrobin_global_ids")
def _global_ids_fake(
    ranks: torch.Tensor, local_ids: torch.Tensor, table_size: int, world_size: int, seed: int = 0
) -> torch.Tensor:
    _fake_index_dtype(ranks, "ranks")
    _fake_index_dtype(local_ids, "local_ids")
    torch._check(ranks.numel() == local_ids.numel(), lambda: "`ranks` and `local_ids` need the same number of entries")
    torch._check(
        local_ids.dtype == torch.int64 or table_size > 0,
        lambda: (
            "recpipe: `local_ids` are int32 but raw keys (`table_size` = 0) are int64 global ids (returned in the "
            "dtype of local_ids); pass int64 local_ids (`.to(torch.int64)`)."
        ),
    )
    torch._check(
        local_ids.dtype == torch.int64 or table_size - 1 <= _INT32_MAX,
        lambda: (
            f"recpipe: `local_ids` are int32 but a table of `table_size` = {table_size} rows has global "
            "ids above the int32 range; pass int64 local_ids (`.to(torch.int64)`)."
        ),
    )
    return torch.empty_like(local_ids)


def hash_roundrobin_global_ids(
    ranks: torch.Tensor, local_ids: torch.Tensor, table_size: int, world_size: int, seed: int = 0
) -> torch.Tensor:
    """Inverse of hash_roundrobin routing: ``H^-1(local * W + rank)``, dtype of ``local_ids``.

    Args:
        ranks: owner rank of each entry.
        local_ids: local id of each entry on its owner.
        table_size: the table's row count, or 0 for raw keys (inverts :func:`route_ids` with ``table_size`` 0:
            the slot is formed in uint64, a local id is read as uint64, and the result is the int64 key; int64
            ``local_ids`` only).
        world_size: number of ranks ``W`` the ids were routed over.
        seed: hash seed the ids were routed with.

    Returns:
        The global ids (keys), shaped and typed like ``local_ids``.

    Raises:
        RuntimeError: a pair that is not a slot of the table (``local * W + rank`` outside it, or a bad rank).
    """
    _check_seed(seed)
    # types here; ranges in the kernel (same messages on every entry point)
    table_size = check_int(table_size, "table_size", maximum=_INT64_MAX)
    world_size = check_int(world_size, "world_size", maximum=_INT64_MAX)
    return torch.ops.recpipe.hash_roundrobin_global_ids(ranks, local_ids, table_size, world_size, seed)
