"""The typed routing wrapper's world-size errors name both spellings of the argument.

``block_bucketize_sparse_features`` takes the world size as ``my_size`` (fbgemm's name); the
other routing wrappers (``route_ids``, ``hash_roundrobin_global_ids``) call it ``world_size``.
A bad value is refused by the wrapper naming both, so a user of either spelling recognises it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from recpipe.pipeline.routing import ops

# one feature, two bags of ids routed roundrobin
LENGTHS, INDICES = torch.tensor([2, 1]), torch.tensor([5, 2, 7])
BLOCK_SIZES, DIST_TYPES = torch.tensor([4]), torch.tensor([ops.DIST_TYPES["roundrobin"]])


@pytest.mark.parametrize(
    "my_size, why",
    [
        (0, "`my_size` must be >= 1, got 0"),
        (-3, "`my_size` must be >= 1, got -3"),
        (2.0, "`my_size` must be an int, got float 2.0"),
        ("2", "`my_size` must be an int, got str '2'"),
        (True, "`my_size` must be an int, got bool True"),
        (2**64, "`my_size` must be <= 9223372036854775807, got 18446744073709551616"),
    ],
)
def test_bad_my_size_names_my_size_and_world_size(my_size: Any, why: str) -> None:
    with pytest.raises(ValueError) as info:
        ops.block_bucketize_sparse_features(LENGTHS, INDICES, BLOCK_SIZES, DIST_TYPES, my_size)
    msg = str(info.value)
    assert why in msg, msg
    assert "`world_size` in route_ids and hash_roundrobin_global_ids" in msg, msg
    assert "my_size=torch.distributed.get_world_size()" in msg, msg


def test_good_my_size_routes_as_route_ids_with_the_same_world_size() -> None:
    """The control: my_size=2 is accepted and splits the ids as route_ids(world_size=2) routes them."""
    out = ops.block_bucketize_sparse_features(LENGTHS, INDICES, BLOCK_SIZES, DIST_TYPES, 2)
    owner, local = ops.route_ids(INDICES, 8, 2, "roundrobin")
    per_rank = out.new_lengths.view(2, -1).sum(1)
    assert per_rank.tolist() == [int((owner == r).sum()) for r in range(2)]
    assert sorted(out.new_indices.tolist()) == sorted(local.tolist())
