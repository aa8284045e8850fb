"""Typed wrappers, fake kernels and KJT helpers for ``torch.ops.recpipe.*``.

The kernels live in ``recpipe._C`` (``csrc/library.cpp`` for the schemas, ``csrc/bucketize.cpp`` for the
CPU, ``csrc/bucketize_cuda.cu`` for CUDA); the routing math they share is
``csrc/bucketize_math.h``. Importing this module loads the extension and
registers the fake (meta) kernels used by ``torch.compile`` and FakeTensor.

Distribution types (per feature):

* ``continuous`` (0): fbgemm's block split. ``owner = id // block``,
  ``local = id % block`` for ``id < block * W``; other ids (raw, unhashed) go to
  ``id % W`` with local ``id // W``. Bit-identical to
  ``torch.ops.fbgemm.block_bucketize_sparse_features``.
* ``roundrobin`` (1): ``owner = id % W``, ``local = id // W``.
* ``hash_roundrobin`` (2): roundrobin over a seeded bijection ``H`` of the
  table's id space ``[0, N)``: ``owner = H(id) % W``, ``local = H(id) // W``.
  Local ids on every rank stay dense (rank ``r`` owns ``ceil((N - r) / W)``
  rows) while aliased id patterns (``k * W + r``, ``k * 2**j``) spread evenly.
  ``H`` (routing version :data:`ROUTING_VERSION`): with ``h = 2**floor(log2 N)``,
  a keyed xorshift-multiply permutation of the window ``[0, h)``, then another
  of the window ``[N - h, N)``; every id costs the same two steps (no
  cycle-walking). See ``HashPermutation`` in ``csrc/bucketize_math.h``.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

import torch

import recpipe._C  # registers torch.ops.recpipe.*; holds the routing constants
from recpipe.pipeline.placement import DIST_TYPES, check_int, local_rows

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "DIST_TYPES",
    "ROUTING_VERSION",
    "BucketizeResult",
    "block_bucketize_sparse_features",
    "bucketize_kjt",
    "bucketize_kjt_by",
    "check_dist_type",
    "check_int",
    "continuous_block_rows",
    "global_row_ids",
    "local_rows",
    "shard_num_rows",
    "dist_type_code",
    "hash_roundrobin_global_ids",
    "route_ids",
]

#: Version of the hash_roundrobin bijection the kernels compute, read from the
#: extension (csrc/bucketize_math.h ``kRoutingVersion``). 1: one permutation of
#: ``[0, 2**ceil(log2 N))`` with cycle-walking; 2: two windows, no walk.
#: Checkpoints record it: rows stored in local-id order are only valid under the
#: routing that wrote them.
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
    """Code of a distribution type name.

    Args:
        name: one of ``continuous``, ``roundrobin``, ``hash_roundrobin``.

    Returns:
        0, 1 or 2.
    """
    try:
        if not isinstance(name, str):
            raise KeyError(name)
        return DIST_TYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown dist_type {name!r}; choose one of {sorted(DIST_TYPES)}"
        ) from None


class BucketizeResult(NamedTuple):
    """Outputs of :func:`block_bucketize_sparse_features` (fbgemm's layout).

    Attributes:
        new_lengths: ``[W * F * B]`` lengths ordered (rank, feature, sample).
        new_indices: local ids in the same order; order inside a bag preserved.
        new_weights: weights following their ids, or None.
        new_pos: position of each id in its original bag, or None.
        unbucketize_permute: output position of each input id (``sequence``), or None.
        bucket_mapping: owner rank of each input id (``return_bucket_mapping``), or None.
    """

    new_lengths: torch.Tensor
    new_indices: torch.Tensor
    new_weights: Optional[torch.Tensor]
    new_pos: Optional[torch.Tensor]
    unbucketize_permute: Optional[torch.Tensor]
    bucket_mapping: Optional[torch.Tensor] = None


_INT32_MAX: int = 2**31 - 1


def _fake_index_dtype(t: torch.Tensor, name: str) -> None:
    """The kernels' index dtype check, for the fake kernels (same message)."""
    if t.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"recpipe: `{name}` must be int32 or int64, got {t.dtype}; convert it with "
                           "`.to(torch.int64)`.")


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
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor],
           Optional[torch.Tensor]]:
    torch._check(my_size > 0, lambda: f"recpipe: `my_size` (the world size W) must be >= 1, got {my_size}")
    per_feature = {"table_sizes": table_sizes, "total_num_blocks": total_num_blocks,
                   "batch_size_per_feature": batch_size_per_feature}
    for name, t in (("lengths", lengths), ("indices", indices), ("block_sizes", block_sizes),
                    ("dist_types", dist_types)) + tuple((k, v) for k, v in per_feature.items() if v is not None):
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
    for name, t in (("block_sizes", block_sizes), *per_feature.items(),
                    ("keep_orig_idx_per_feature", keep_orig_idx_per_feature)):
        if t is not None:
            torch._check(t.numel() == F, lambda: f"recpipe: `{name}` has {t.numel()} entries but `dist_types` "
                         f"has {F}; pass one entry per feature.")
    if keep_orig_idx_per_feature is not None and keep_orig_idx_per_feature.dtype != torch.bool:
        raise RuntimeError("recpipe: `keep_orig_idx_per_feature` must be a bool tensor, got "
                           f"{keep_orig_idx_per_feature.dtype}; build it with `torch.tensor([...], dtype=torch.bool)`.")
    if batch_size_per_feature is None:
        torch._check(lengths.numel() % F == 0 if F != 0 else lengths.numel() == 0,
                     lambda: f"recpipe: `lengths` has {lengths.numel()} entries, not a multiple of the {F} features "
                     "in `dist_types`; lengths must be [F * B] (feature-major), or pass `batch_size_per_feature`.")
    if block_bucketize_pos:
        torch._check(len(block_bucketize_pos) == F, lambda: f"recpipe: `block_bucketize_pos` has "
                     f"{len(block_bucketize_pos)} tensors but `dist_types` has {F}; pass one tensor per feature.")
        for f, b in enumerate(block_bucketize_pos):
            if b.dim() != 1 or b.dtype not in (torch.int32, torch.int64):
                raise RuntimeError(f"recpipe: `block_bucketize_pos[{f}]` must be a 1-D int32/int64 tensor, got "
                                   f"{b.dtype} of shape {tuple(b.shape)}.")
    if weights is not None:
        torch._check(weights.dim() in (1, 2), lambda: "recpipe: `weights` must be [n] or [n, D] (one row per id)")
        if weights.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise RuntimeError(f"recpipe: `weights` must be float16, bfloat16, float32 or float64, got "
                               f"{weights.dtype}.")
        torch._check(weights.shape[0] == indices.shape[0], lambda: f"recpipe: `weights` has {weights.shape[0]} "
                     f"entries but `indices` has {indices.shape[0]}; pass one weight per id (or weights=None).")
    new_lengths = lengths.new_empty((my_size * lengths.numel(),))
    new_indices = torch.empty_like(indices)
    # the kernels allocate every output contiguous (at::empty), whatever the inputs' strides
    new_weights = weights.new_empty(weights.shape) if weights is not None else None
    new_pos = torch.empty_like(indices) if bucketize_pos else None
    permute = torch.empty_like(indices) if sequence else None
    mapping = torch.empty_like(indices) if return_bucket_mapping else None
    return new_lengths, new_indices, new_weights, new_pos, permute, mapping


@torch.library.register_fake("recpipe::route_ids")
def _route_ids_fake(
    ids: torch.Tensor, table_size: int, world_size: int, dist_type: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    _fake_index_dtype(ids, "ids")
    torch._check(table_size > 0, lambda: f"`table_size` must be >= 1, got {table_size}")
    torch._check(world_size > 0, lambda: f"`world_size` must be >= 1, got {world_size}")
    torch._check(dist_type in DIST_TYPES.values(), lambda: f"`dist_type` must be one of {DIST_TYPES}, got {dist_type}")
    torch._check(ids.dtype == torch.int64 or dist_type != DIST_TYPES["hash_roundrobin"]
                 or (table_size - 1) // world_size <= _INT32_MAX,
                 lambda: f"recpipe: `ids` are int32 but hash_roundrobin over `table_size` = {table_size} rows and "
                 f"{world_size} ranks gives local ids up to {(table_size - 1) // world_size}, beyond int32; pass "
                 "int64 ids (`.to(torch.int64)`).")
    # contiguous, as the kernels allocate them (ids may be any shape and strides)
    return ids.new_empty(ids.shape, dtype=torch.int64), ids.new_empty(ids.shape)


@torch.library.register_fake("recpipe::hash_roundrobin_global_ids")
def _global_ids_fake(
    ranks: torch.Tensor,
    local_ids: torch.Tensor,
    table_size: int,
    world_size: int,
    seed: int = 0,
) -> torch.Tensor:
    _fake_index_dtype(ranks, "ranks")
    _fake_index_dtype(local_ids, "local_ids")
    torch._check(
        ranks.numel() == local_ids.numel(),
        lambda: "`ranks` and `local_ids` need the same number of entries",
    )
    torch._check(local_ids.dtype == torch.int64 or table_size - 1 <= _INT32_MAX,
                 lambda: f"recpipe: `local_ids` are int32 but a table of `table_size` = {table_size} rows has global "
                 "ids above the int32 range; pass int64 local_ids (`.to(torch.int64)`).")
    return torch.empty_like(local_ids)


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
    """Splits every bag of a flat KJT by owner rank.

    Takes every argument of ``torch.ops.fbgemm.block_bucketize_sparse_features`` (and
    of its ``_inference`` and ``_2d_weights`` variants) plus recpipe's per-feature
    routing; on continuous features the results are bit-identical to fbgemm's.

    The ``[F]`` metadata (``block_sizes``, ``dist_types``, ``table_sizes``,
    ``batch_size_per_feature``, ``total_num_blocks``, ``keep_orig_idx_per_feature``,
    ``block_bucketize_pos``) may stay on the CPU for CUDA inputs: the call then never
    synchronizes the host. Metadata on the GPU costs one device-to-host copy each.
    On CUDA, bad values (negative lengths, ids outside a checked table without
    ``route_bad_ids``) fail by a device-side assert instead of a Python exception.

    Args:
        lengths: bag lengths (int32/int64), feature-major: ``[F * B]``, or
            ``[sum(batch_size_per_feature)]`` for a variable batch per feature.
        indices: ids (int32/int64), ``lengths.sum()`` of them.
        block_sizes: ``[F]`` rows per block, used by continuous features.
        dist_types: ``[F]`` codes, see :data:`DIST_TYPES`.
        my_size: world size ``W``.
        sequence: also return ``unbucketize_permute``.
        bucketize_pos: also return each id's position in its bag.
        weights: per-id weights (fp16/bf16/fp32/fp64) that follow their ids:
            ``[n]``, or ``[n, D]`` (fbgemm's 2-D weights variant).
        table_sizes: ``[F]`` row counts; required by hash_roundrobin features.
        seed: seed of the hash_roundrobin bijection.
        keep_orig_idx: return raw ids instead of local ids (key-value backends).
        batch_size_per_feature: ``[F]`` batch size of each feature (VBE KJTs).
        max_B: largest batch size; accepted for fbgemm's signature, unused (each bag
            finds its feature from ``batch_size_per_feature``).
        block_bucketize_pos: per feature, the first row of each rank (``W + 1``
            bounds from 0): uneven row-wise shards; continuous features only.
        total_num_blocks: ``[F]`` blocks per table over all ranks (a multiple
            of ``W``; each rank holds ``total / W`` consecutive blocks);
            continuous features only.
        keep_orig_idx_per_feature: ``[F]`` bool, overrides ``keep_orig_idx``.
        return_bucket_mapping: also return each id's owner rank.
        route_bad_ids: an id of a roundrobin / hash_roundrobin feature outside
            ``[0, table_sizes[f])`` (read as unsigned ``u``, so negative ids too) is
            routed as fbgemm routes an id past a continuous table: to rank ``u % W``
            as local id ``u // W``, past that rank's rows (a rank without rows,
            ``table_sizes[f] < W``, hands it to rank ``u % W % table_sizes[f]`` as a
            local id >= 1), so the owner's embedding kernel applies its
            ``bounds_check_mode``, as torchrec's row-wise input dist does. Default:
            refused with ``IndexError`` naming the id and feature.

    Returns:
        :class:`BucketizeResult`.

    Example::

        out = block_bucketize_sparse_features(
            lengths, indices, torch.tensor([250]), torch.tensor([2]), 4,
            table_sizes=torch.tensor([1000]),
        )
    """
    _check_seed(seed)
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


_INT64_MIN: int = -(2**63)
_INT64_MAX: int = 2**63 - 1


def _check_seed(seed: int) -> None:
    """Raises ``ValueError`` unless ``seed`` is an int the ops take (a signed int64)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not _INT64_MIN <= seed <= _INT64_MAX:
        raise ValueError(
            f"`seed` must be an int in [-2**63, 2**63) (the ops take a signed int64; the hash keys use its "
            f"64 bits), got {seed!r}; reduce it, e.g. seed % 2**63."
        )


def hash_roundrobin_global_ids(
    ranks: torch.Tensor,
    local_ids: torch.Tensor,
    table_size: int,
    world_size: int,
    seed: int = 0,
) -> torch.Tensor:
    """Inverse of hash_roundrobin routing: (owner rank, local id) -> global id.

    ``global = H^-1(local * W + rank)``; checkpoints use it to export global row
    ids whatever the routing.

    Args:
        ranks: owner rank of each row.
        local_ids: local row id on that rank.
        table_size: rows ``N`` of the table.
        world_size: ``W`` the rows were routed with.
        seed: the routing seed.

    Returns:
        Global ids, dtype of ``local_ids``.
    """
    _check_seed(seed)
    # types here; ranges in the kernel (same messages on every entry point)
    table_size = check_int(table_size, "table_size")
    world_size = check_int(world_size, "world_size")
    return torch.ops.recpipe.hash_roundrobin_global_ids(
        ranks, local_ids, table_size, world_size, seed
    )


def route_ids(
    ids: torch.Tensor,
    table_size: int,
    world_size: int,
    dist_type: str = "hash_roundrobin",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Owner rank and local id of each id of one table (``torch.ops.recpipe.route_ids``).

    The per-id routing primitive (the same ``TableRoute`` math as the KJT op), O(n)
    memory: checkpoint resharding and the tiered HYBRID split call it.

    Args:
        ids: ids of the table (any shape, int32/int64), in ``[0, table_size)``.
        table_size: rows ``N`` of the table.
        world_size: ``W``.
        dist_type: ``continuous`` (block ``ceil(N / W)``), ``roundrobin`` or
            ``hash_roundrobin``.
        seed: the routing seed.

    Returns:
        ``(owner, local)``, both shaped like ``ids`` (owner int64).
    """
    _check_seed(seed)
    # types here; ranges in the kernel (same messages on every entry point)
    table_size = check_int(table_size, "table_size")
    world_size = check_int(world_size, "world_size")
    return torch.ops.recpipe.route_ids(ids, table_size, world_size, dist_type_code(dist_type), seed)


def continuous_block_rows(num_embeddings: int, world_size: int) -> int:
    """Rows per rank of a continuous table cut into torchrec's blocks: ``ceil(N / W)``, at least 1.

    Rank ``r`` holds global rows ``[r * block, (r + 1) * block)`` (the last ranks may hold
    fewer, or none).

    Args:
        num_embeddings (int): rows ``N`` of the whole table.
        world_size (int): ranks ``W``.

    Returns:
        int: the block size.
    """
    num_embeddings = check_int(num_embeddings, "num_embeddings", 0)
    world_size = check_int(world_size, "world_size", 1)
    return max(1, -(-num_embeddings // world_size))


def check_dist_type(dist_type: str) -> str:
    """``dist_type`` if it names a distribution type (:data:`DIST_TYPES`), else a ValueError."""
    if not isinstance(dist_type, str) or dist_type not in DIST_TYPES:
        raise ValueError(f"dist_type must be one of {sorted(DIST_TYPES)}, got {dist_type!r}.")
    return dist_type


def shard_num_rows(num_embeddings: int, world_size: int, rank: int, dist_type: str) -> int:
    """Local rows rank ``rank`` owns of a table of ``num_embeddings`` rows.

    Args:
        num_embeddings (int): rows ``N`` of the whole table.
        world_size (int): ranks ``W`` the table is sharded over.
        rank (int): the rank.
        dist_type (str): ``continuous`` (blocks of ``ceil(N / W)``), ``roundrobin``
            or ``hash_roundrobin`` (:func:`local_rows`).

    Returns:
        int: the shard's row count.

    Example::

        shard_num_rows(10, 4, 3, "continuous")  # 1
    """
    check_dist_type(dist_type)
    num_embeddings = check_int(num_embeddings, "num_embeddings", 0)
    world_size = check_int(world_size, "world_size", 1)
    rank = check_int(rank, "rank")
    if dist_type == "continuous":
        local_rows(num_embeddings, world_size, rank)  # validates the arguments
        block = continuous_block_rows(num_embeddings, world_size)
        return max(0, min(block, num_embeddings - rank * block))
    return local_rows(num_embeddings, world_size, rank)


def global_row_ids(
    local_ids: torch.Tensor,
    num_embeddings: int,
    world_size: int,
    rank: int,
    dist_type: str,
    seed: int,
) -> torch.Tensor:
    """Global ids of local rows of shard ``rank`` (inverse of the routing).

    Args:
        local_ids (torch.Tensor): int64 local row ids.
        num_embeddings (int): rows of the whole table.
        world_size (int): ranks the table is sharded over.
        rank (int): owner rank.
        dist_type (str): routing of the table.
        seed (int): hash_roundrobin seed.

    Returns:
        torch.Tensor: int64 global ids, shaped like ``local_ids``.

    Raises:
        ValueError: ``rank`` is not in ``[0, world_size)``, or (continuous, roundrobin)
            a local id is not a row of shard ``rank`` (the hash_roundrobin kernel
            refuses such ids itself).
    """
    check_dist_type(dist_type)
    if not isinstance(local_ids, torch.Tensor) or local_ids.is_floating_point() or local_ids.is_complex() \
            or local_ids.dtype == torch.bool:
        got = f"a {local_ids.dtype} tensor" if isinstance(local_ids, torch.Tensor) else type(local_ids).__name__
        raise ValueError(
            f"global_row_ids: `local_ids` must be an integer tensor of local row ids, got {got}; pass e.g. "
            "torch.as_tensor(ids, dtype=torch.int64) (a float tensor would be truncated)."
        )
    local_ids = local_ids.to(torch.int64)
    num_embeddings = check_int(num_embeddings, "num_embeddings", 0)
    world_size = check_int(world_size, "world_size", 1)
    rank = check_int(rank, "rank")
    rows = shard_num_rows(num_embeddings, world_size, rank, dist_type)  # validates rank and world_size
    if dist_type != "hash_roundrobin" and local_ids.numel() > 0:  # an export path, not a step: may sync
        lo, hi = int(local_ids.min()), int(local_ids.max())
        if lo < 0 or hi >= rows:
            raise ValueError(
                f"global_row_ids: `local_ids` in [{lo}, {hi}] are not all rows of shard {rank} ({rows} rows of a "
                f"{dist_type} table of {num_embeddings} rows over {world_size} ranks): pass local ids in "
                f"[0, {rows}), or check the checkpoint's world size and routing."
            )
    if dist_type == "roundrobin":
        return local_ids * world_size + rank
    if dist_type == "continuous":
        return local_ids + rank * continuous_block_rows(num_embeddings, world_size)
    if local_ids.numel() == 0:
        return local_ids.clone()
    flat = local_ids.reshape(-1)  # any shape, as the other routings (the op takes 1-D ids)
    ranks = torch.full_like(flat, rank)
    return hash_roundrobin_global_ids(ranks, flat, num_embeddings, world_size, seed).view(local_ids.shape)


def _check_row_bounds(
    row_bounds: dict[str, list[int]], keys: list[str], table_sizes: dict[str, int], world_size: int,
    dist_types: dict[str, str],
) -> None:
    """Raises ``ValueError`` unless every entry of ``row_bounds`` is ``W + 1`` shard bounds
    of its feature's continuous table: 0, non-decreasing, ending at the table's rows."""
    unknown = sorted(set(row_bounds) - set(keys))
    if unknown:
        raise ValueError(f"bucketize_kjt: `row_bounds` names features {unknown} the KJT does not have ({keys})")
    routed = sorted(k for k in row_bounds if dist_types[k] != "continuous")
    if routed:
        raise ValueError(
            f"bucketize_kjt: `row_bounds` names features {routed} that are not continuous "
            f"({ {k: dist_types[k] for k in routed} }); shard bounds apply to continuous tables only: "
            "drop their entries"
        )
    for k, b in row_bounds.items():
        n = table_sizes[k]
        ok = (isinstance(b, (list, tuple)) and len(b) == world_size + 1
              and all(isinstance(v, int) and not isinstance(v, bool) for v in b)
              and b[0] == 0 and b[-1] == n and all(x <= y for x, y in zip(b, b[1:])))
        if not ok:
            raise ValueError(
                f"bucketize_kjt: `row_bounds[{k!r}]` is {b!r}; it must be {world_size + 1} non-decreasing ints: "
                f"0, the first row of each next rank, then the table's {n} rows "
                f"(e.g. {[0] + [min(n, r * -(-n // world_size)) for r in range(1, world_size)] + [n]})"
            )


def _check_kjt(kjt: Any, where: str) -> None:
    """Raises ``ValueError`` unless ``kjt`` is a torchrec ``KeyedJaggedTensor``."""
    if not isinstance(kjt, KeyedJaggedTensor):
        raise ValueError(
            f"{where}: `kjt` must be a torchrec KeyedJaggedTensor, got {type(kjt).__name__}; build one with "
            "KeyedJaggedTensor.from_lengths_sync(keys=..., values=..., lengths=...)"
        )


def bucketize_kjt(
    kjt: KeyedJaggedTensor,
    world_size: int,
    dist_types: dict[str, str],
    table_sizes: dict[str, int],
    *,
    seed: int = 0,
    sequence: bool = False,
    bucketize_pos: bool = False,
    keep_orig_idx: bool = False,
    row_bounds: Optional[dict[str, list[int]]] = None,
    route_bad_ids: bool = False,
) -> tuple[KeyedJaggedTensor, Optional[torch.Tensor]]:
    """Bucketizes a KJT by owner rank, feature by feature.

    The result mirrors torchrec's ``bucketize_kjt_before_all2all``: a KJT whose
    keys are ``kjt.keys()`` repeated ``world_size`` times (rank-major) and whose
    lengths are ``[W * F * B]``, ready for the KJT all-to-all. KJTs with a variable
    batch per feature (VBE) keep their strides per key, per rank.

    Args:
        kjt: the input features.
        world_size: ``W``.
        dist_types: feature name -> ``continuous`` / ``roundrobin`` /
            ``hash_roundrobin``; every key of ``kjt`` needs an entry.
        table_sizes: feature name -> rows of the table the feature looks up;
            every key needs one (continuous uses ``ceil(rows / W)`` per rank).
        seed: seed of the hash_roundrobin bijection.
        sequence: also return the unbucketize permutation.
        bucketize_pos: put each id's bag position in the result's weights
            (torchrec's convention for position-weighted features).
        keep_orig_idx: keep raw ids instead of local ids.
        row_bounds: feature name -> uneven shard bounds of its (continuous) table:
            0, the first row of ranks 1..W-1, and the table's end. Continuous
            features without an entry keep the blocks of ``ceil(rows / W)``.
        route_bad_ids: route ids outside their roundrobin / hash_roundrobin table
            past their owner's rows (as torchrec's row-wise routing sends ids past a
            table) instead of refusing them (see :func:`block_bucketize_sparse_features`).

    Returns:
        ``(bucketized_kjt, unbucketize_permute or None)``.
    """
    _check_kjt(kjt, "bucketize_kjt")
    for name, value in (("dist_types", dist_types), ("table_sizes", table_sizes)):
        if not isinstance(value, Mapping):
            raise ValueError(
                f"bucketize_kjt: `{name}` must be a dict keyed by feature name, got {type(value).__name__}; "
                f"pass e.g. {{{kjt.keys()[0] if kjt.keys() else 'feature'!r}: ...}} for every key of the KJT"
            )
    keys = kjt.keys()
    missing = [k for k in keys if k not in dist_types]
    if missing:
        raise ValueError(
            f"bucketize_kjt: `dist_types` has no entry for features {missing}; "
            f"map each to one of {sorted(DIST_TYPES)}"
        )
    missing = [k for k in keys if k not in table_sizes]
    if missing:
        raise ValueError(
            f"bucketize_kjt: `table_sizes` has no entry for features {missing}; "
            "pass the row count of the table each feature looks up"
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 0 < world_size <= _INT32_MAX:
        raise ValueError(f"bucketize_kjt: `world_size` must be an int >= 1 (the number of ranks) and at most "
                         f"2**31 - 1, got {type(world_size).__name__} {world_size!r}")
    bad = {k: table_sizes[k] for k in keys
           if isinstance(table_sizes[k], bool) or not isinstance(table_sizes[k], int)
           or not 0 < table_sizes[k] <= _INT64_MAX}
    if bad:
        raise ValueError(
            f"bucketize_kjt: `table_sizes` must be positive ints below 2**63 (each table's row count), got {bad}"
        )
    codes = torch.tensor([dist_type_code(dist_types[k]) for k in keys], dtype=torch.int64)
    sizes = torch.tensor([int(table_sizes[k]) for k in keys], dtype=torch.int64)
    blocks = torch.tensor([continuous_block_rows(int(table_sizes[k]), world_size) for k in keys], dtype=torch.int64)
    bounds = None
    if row_bounds is not None:
        _check_row_bounds(row_bounds, keys, table_sizes, world_size, dist_types)
        # a continuous feature without an entry keeps torchrec's blocks: the bounds
        # [0, b, 2b, ..., W * b] route exactly as the block rule (ids >= W * b too)
        bounds = [
            torch.tensor(
                row_bounds[k] if k in row_bounds
                else [r * int(b) for r in range(world_size + 1)] if dist_types[k] == "continuous" else [],
                dtype=torch.int64,
            )
            for k, b in zip(keys, blocks.tolist())
        ]
    return bucketize_kjt_by(
        kjt, world_size, blocks, codes, sizes, seed=seed, sequence=sequence, bucketize_pos=bucketize_pos,
        keep_orig_idx=keep_orig_idx, row_bounds=bounds, route_bad_ids=route_bad_ids,
    )


def bucketize_kjt_by(
    kjt: KeyedJaggedTensor,
    world_size: int,
    block_sizes: torch.Tensor,
    dist_types: torch.Tensor,
    table_sizes: torch.Tensor,
    *,
    seed: int = 0,
    sequence: bool = False,
    bucketize_pos: bool = False,
    keep_orig_idx: bool = False,
    row_bounds: Optional[list[torch.Tensor]] = None,
    route_bad_ids: bool = False,
) -> tuple[KeyedJaggedTensor, Optional[torch.Tensor]]:
    """:func:`bucketize_kjt` with the per-feature metadata as ``[F]`` tensors (kept on
    the CPU by callers such as the row-wise input dist, so no call syncs a device).

    Args:
        kjt: the input features (VBE or not).
        world_size: ``W``.
        block_sizes: ``[F]`` rows per rank of continuous features.
        dist_types: ``[F]`` codes of :data:`DIST_TYPES`.
        table_sizes: ``[F]`` table rows.
        seed: seed of the hash_roundrobin bijection.
        sequence: also return the unbucketize permutation.
        bucketize_pos: put bag positions in the result's weights.
        keep_orig_idx: keep raw ids instead of local ids.
        row_bounds: per feature, uneven shard bounds (empty for routed features), or None.
        route_bad_ids: route ids outside their roundrobin / hash_roundrobin table
            past their owner's rows instead of refusing them (see
            :func:`block_bucketize_sparse_features`).

    Returns:
        ``(bucketized_kjt, unbucketize_permute or None)``.
    """
    _check_kjt(kjt, "bucketize_kjt_by")
    vbe = kjt.variable_stride_per_key()
    strides = kjt.stride_per_key() if vbe else None
    try:
        out = block_bucketize_sparse_features(
            kjt.lengths().view(-1),
            kjt.values(),
            block_sizes,
            dist_types,
            world_size,
            sequence=sequence,
            bucketize_pos=bucketize_pos,
            weights=kjt.weights_or_none(),
            table_sizes=table_sizes,
            seed=seed,
            keep_orig_idx=keep_orig_idx,
            batch_size_per_feature=torch.tensor(strides, dtype=torch.int64) if strides is not None else None,
            max_B=max(strides) if strides else -1,
            block_bucketize_pos=row_bounds,
            route_bad_ids=route_bad_ids,
        )
    except IndexError as e:  # an id outside its table: the op numbers the feature, the KJT names it
        raise _with_feature_name(e, list(kjt.keys())) from None
    # torchrec's convention (bucketize_kjt_before_all2all): positions ride in the weights.
    result = KeyedJaggedTensor(
        keys=list(kjt.keys()) * world_size,
        values=out.new_indices,
        weights=out.new_pos if bucketize_pos else out.new_weights,
        lengths=out.new_lengths.view(-1),
        stride=None if vbe else kjt.stride(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank() * world_size if vbe else None,
    )
    return result, out.unbucketize_permute


def _with_feature_name(error: IndexError, keys: list[str]) -> IndexError:
    """The op's out-of-range id error with the KJT key of the feature it numbers.

    Args:
        error: the op's error (``... (feature f, <dist type>) is outside ...``).
        keys: the KJT's keys, in feature order.

    Returns:
        IndexError: the same message naming the key, or ``error`` if it numbers no feature.
    """
    found = re.search(r"\(feature (\d+), ", str(error))
    if found is None or int(found.group(1)) >= len(keys):
        return error
    return IndexError(f"{error} (feature {found.group(1)} is the KJT key {keys[int(found.group(1))]!r})")


# ---------------------------------------------------------------------------
# Tiered storage ops (csrc/tiered.cpp): codes of their integer arguments, the
# layout of the stats counters, and their fake kernels.

#: ``mode`` argument of the tiered ops.
TIERED_MODES: dict[str, int] = {"ALL_FAST": 0, "HYBRID": 1, "CACHING": 2}
#: ``policy`` argument (CACHING eviction).
TIERED_POLICIES: dict[str, int] = {"lfu": 0, "lru": 1}
#: ``pooling`` argument.
TIERED_POOLINGS: dict[str, int] = {"sum": 0, "mean": 1}
#: ``optimizer`` argument (fused optimizer applied by ``tiered_backward``).
TIERED_OPTIMIZERS: dict[str, int] = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2}
#: Counters of the ``stats`` tensor, in order: the last lookup's values at
#: ``[0, 7)``, running totals of the same at ``[7, 14)``.
TIERED_STATS: tuple[str, ...] = (
    "lookups", "unique_rows", "hits", "fast_lookups", "rows_loaded", "rows_evicted", "rows_written_back",
)


@torch.library.register_fake("recpipe::tiered_lookup")
def _tiered_lookup_fake(
    ids: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    fast_weights: torch.Tensor,
    fast_state: torch.Tensor,
    slow_weights: torch.Tensor,
    slow_state: torch.Tensor,
    row_map: torch.Tensor,
    slot_row: torch.Tensor,
    slot_score: torch.Tensor,
    stats: torch.Tensor,
    num_rows: int,
    fast_rows: int,
    split_seed: int,
    mode: int,
    policy: int,
    clock: int,
    pooling: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._check(ids.dim() == 1, lambda: f"`ids` must be 1-D, got shape {list(ids.shape)}")
    torch._check(ids.dtype in (torch.int32, torch.int64), lambda: f"`ids` must be int32/int64, got {ids.dtype}")
    torch._check(offsets.dim() == 1 and offsets.numel() >= 1, lambda: "`offsets` must be 1-D with B + 1 entries")
    torch._check(
        fast_weights.dtype == torch.float32 and fast_weights.dim() == 2,
        lambda: "`fast_weights` must be a float32 [rows, dim] tensor",
    )
    unique = torch.library.get_ctx().new_dynamic_size()
    out = fast_weights.new_empty((offsets.numel() - 1, fast_weights.shape[1]))
    return out, ids.new_empty((unique,), dtype=torch.int64), ids.new_empty(ids.shape, dtype=torch.int64)


@torch.library.register_fake("recpipe::tiered_backward")
def _tiered_backward_fake(
    grad_out: torch.Tensor,
    uniq: torch.Tensor,
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    fast_weights: torch.Tensor,
    fast_state: torch.Tensor,
    slow_weights: torch.Tensor,
    slow_state: torch.Tensor,
    row_map: torch.Tensor,
    slot_score: torch.Tensor,
    num_rows: int,
    fast_rows: int,
    split_seed: int,
    mode: int,
    pooling: int,
    optimizer: int,
    lr: float,
    eps: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    step: int,
) -> None:
    torch._check(
        grad_out.dim() == 2 and grad_out.shape[0] == offsets.numel() - 1,
        lambda: "`grad_out` must be [B, dim] with B = len(offsets) - 1",
    )
    torch._check(step >= 1, lambda: f"`step` must be >= 1, got {step}")
