"""KJT bucketization: a torchrec ``KeyedJaggedTensor`` split by owner rank.

May import ``recpipe.pipeline.placement`` and the routing modules ``ops`` and ``rows`` only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.pipeline.placement import DIST_TYPES
from recpipe.pipeline.routing.ops import block_bucketize_sparse_features, dist_type_code
from recpipe.pipeline.routing.rows import continuous_block_rows

__all__ = ["bucketize_kjt", "bucketize_kjt_by"]

_INT32_MAX: int = 2**31 - 1
_INT64_MAX: int = 2**63 - 1


def _check_row_bounds(
    row_bounds: dict[str, list[int]],
    keys: list[str],
    table_sizes: dict[str, int],
    world_size: int,
    dist_types: dict[str, str],
) -> None:
    """Raises ``ValueError`` unless each entry is ``W + 1`` non-decreasing bounds of a continuous table."""
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
        ok = (
            isinstance(b, (list, tuple))
            and len(b) == world_size + 1
            and all(isinstance(v, int) and not isinstance(v, bool) for v in b)
            and b[0] == 0
            and b[-1] == n
            and all(x <= y for x, y in zip(b, b[1:]))
        )
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
    keep_orig_idx_per_feature: Optional[Mapping[str, bool]] = None,
) -> tuple[KeyedJaggedTensor, Optional[torch.Tensor]]:
    """Bucketizes a KJT by owner rank, as torchrec's ``bucketize_kjt_before_all2all`` does.

    The result's keys are ``kjt.keys()`` repeated ``W`` times (rank-major), lengths ``[W * F * B]``;
    VBE KJTs keep their strides per key, per rank.

    Args:
        dist_types: feature name -> dist type, for every key.
        table_sizes: feature name -> rows of its table, for every key; 0 for a hash_roundrobin feature of raw
            int64 keys (any value, routed by a seeded bijection of the whole 64-bit range: a dynamic table).
        bucketize_pos: put each id's bag position in the result's weights.
        keep_orig_idx: every feature's local id is the id itself.
        row_bounds: feature name -> uneven shard bounds of its continuous table (0, ..., rows).
        route_bad_ids: see :func:`block_bucketize_sparse_features`.
        keep_orig_idx_per_feature: feature name -> whether its local id is the id itself (a dynamic table's
            features keep their raw keys); features it does not name follow ``keep_orig_idx``.

    Returns:
        ``(bucketized_kjt, unbucketize_permute or None)``.

    Raises:
        ValueError: a missing or invalid routing argument, naming it and the features.
        IndexError: an id outside its roundrobin / hash_roundrobin table, naming the KJT key.
    """
    _check_kjt(kjt, "bucketize_kjt")
    keys = kjt.keys()
    _check_routing_args(keys, world_size, dist_types, table_sizes)
    keep = _keep_per_feature(keep_orig_idx_per_feature, keys, keep_orig_idx)
    codes = torch.tensor([dist_type_code(dist_types[k]) for k in keys], dtype=torch.int64)
    sizes = torch.tensor([int(table_sizes[k]) for k in keys], dtype=torch.int64)
    blocks = [continuous_block_rows(int(table_sizes[k]), world_size) for k in keys]
    bounds = None
    if row_bounds is not None:
        _check_row_bounds(row_bounds, keys, table_sizes, world_size, dist_types)
        # per feature, the op's block_bucketize_pos: given bounds, [0, b, ..., W * b] for another
        # continuous feature (routes as the block rule), or empty for a routed one
        bounds = [
            torch.tensor(
                row_bounds.get(k, [r * b for r in range(world_size + 1)] if dist_types[k] == "continuous" else []),
                dtype=torch.int64,
            )
            for k, b in zip(keys, blocks)
        ]
    return bucketize_kjt_by(
        kjt,
        world_size,
        torch.tensor(blocks, dtype=torch.int64),
        codes,
        sizes,
        seed=seed,
        sequence=sequence,
        bucketize_pos=bucketize_pos,
        keep_orig_idx=keep_orig_idx,
        row_bounds=bounds,
        route_bad_ids=route_bad_ids,
        keep_orig_idx_per_feature=keep,
    )


def _keep_per_feature(
    keep_orig_idx_per_feature: Optional[Mapping[str, bool]], keys: list[str], keep_orig_idx: bool
) -> Optional[torch.Tensor]:
    """The op's ``[F]`` bool ``keep_orig_idx_per_feature`` of a name -> bool mapping (None stays None)."""
    if keep_orig_idx_per_feature is None:
        return None
    if not isinstance(keep_orig_idx_per_feature, Mapping):
        raise ValueError(
            "bucketize_kjt: `keep_orig_idx_per_feature` must be a dict of feature name -> bool, got "
            f"{type(keep_orig_idx_per_feature).__name__}; pass e.g. {{'raw_feature': True}}"
        )
    unknown = sorted(set(keep_orig_idx_per_feature) - set(keys))
    if unknown:
        raise ValueError(
            f"bucketize_kjt: `keep_orig_idx_per_feature` names features {unknown} the KJT does not have ({keys})"
        )
    bad = {k: v for k, v in keep_orig_idx_per_feature.items() if not isinstance(v, bool)}
    if bad:
        raise ValueError(f"bucketize_kjt: `keep_orig_idx_per_feature` values must be bools, got {bad}")
    return torch.tensor([keep_orig_idx_per_feature.get(k, keep_orig_idx) for k in keys], dtype=torch.bool)


def _check_routing_args(
    keys: list[str], world_size: int, dist_types: Mapping[str, str], table_sizes: Mapping[str, int]
) -> None:
    """Raises ``ValueError`` unless both dicts cover every key with valid values and ``world_size`` is valid."""
    for name, value in (("dist_types", dist_types), ("table_sizes", table_sizes)):
        if not isinstance(value, Mapping):
            raise ValueError(
                f"bucketize_kjt: `{name}` must be a dict keyed by feature name, got {type(value).__name__}; "
                f"pass e.g. {{{keys[0] if keys else 'feature'!r}: ...}} for every key of the KJT"
            )
    for name, value, hint in (
        ("dist_types", dist_types, f"map each to one of {sorted(DIST_TYPES)}"),
        ("table_sizes", table_sizes, "pass the row count of the table each feature looks up"),
    ):
        missing = [k for k in keys if k not in value]
        if missing:
            raise ValueError(f"bucketize_kjt: `{name}` has no entry for features {missing}; {hint}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 0 < world_size <= _INT32_MAX:
        raise ValueError(
            f"bucketize_kjt: `world_size` must be an int >= 1 (the number of ranks) and at most "
            f"2**31 - 1, got {type(world_size).__name__} {world_size!r}"
        )
    bad = {
        k: table_sizes[k]
        for k in keys
        if isinstance(table_sizes[k], bool)
        or not isinstance(table_sizes[k], int)
        or not (0 < table_sizes[k] <= _INT64_MAX or (table_sizes[k] == 0 and dist_types[k] == "hash_roundrobin"))
    }
    if bad:
        raise ValueError(
            f"bucketize_kjt: `table_sizes` must be positive ints below 2**63 (each table's row count), or 0 for a "
            f"hash_roundrobin feature of raw int64 keys, got {bad} (dist types "
            f"{ {k: dist_types[k] for k in bad} })"
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
    keep_orig_idx_per_feature: Optional[torch.Tensor] = None,
) -> tuple[KeyedJaggedTensor, Optional[torch.Tensor]]:
    """:func:`bucketize_kjt` with ``[F]`` metadata tensors (kept on the CPU so no call syncs a device).

    Args:
        table_sizes: ``[F]`` row counts; 0 for a hash_roundrobin feature means raw int64 keys.
        row_bounds: per feature, uneven shard bounds (empty for routed features), or None.
        keep_orig_idx_per_feature: ``[F]`` bool, per feature whether the local id is the id itself (the op's
            argument; overrides ``keep_orig_idx``), or None.

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
            keep_orig_idx_per_feature=keep_orig_idx_per_feature,
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
    """The op's out-of-range id error, naming the KJT key of the feature it numbers."""
    found = re.search(r"\(feature (\d+), ", str(error))
    if found is None or int(found.group(1)) >= len(keys):
        return error
    return IndexError(f"{error} (feature {found.group(1)} is the KJT key {keys[int(found.group(1))]!r})")
