"""Bad input to recpipe's routing helpers, sharders and routing overrides.

``global_row_ids``, ``bucketize_kjt`` / ``bucketize_kjt_by``, the routed sharders,
``RoutingOverrides`` and ``table_routing`` refuse a wrong type or value with a ValueError
naming the argument, never a silent wrong result (float ids truncated to rows) nor a bare
TypeError / AttributeError. Valid unusual input (2-D ids, numpy seeds) routes as the
reference permutation of ``harness.routing_reference`` says.
"""

from typing import Any, Callable

import numpy as np
import pytest
import torch
from harness.routing_reference import RefPermutation
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.pipeline.routing.features import RoutingOverrides, table_routing
from recpipe.pipeline.routing.kjt import bucketize_kjt, bucketize_kjt_by
from recpipe.pipeline.routing.routed_sharders import (
    RoutedEmbeddingBagCollectionSharder,
    RoutedEmbeddingCollectionSharder,
    routed_sharders,
)
from recpipe.pipeline.routing.rows import global_row_ids


@pytest.mark.parametrize(
    "local_ids",
    [
        None,
        [0, 1],
        np.array([0, 1]),
        torch.tensor([0.5, 1.7]),
        torch.tensor([0.0, 1.0], dtype=torch.float64),
        torch.tensor([True, False]),
    ],
)
@pytest.mark.parametrize("dist_type", ["roundrobin", "continuous", "hash_roundrobin"])
def test_global_row_ids_refuses_non_integer_local_ids(local_ids: object, dist_type: str) -> None:
    """A list / array or float ids (0.5 would truncate to row 0) are refused naming ``local_ids``."""
    with pytest.raises(ValueError, match="local_ids"):
        global_row_ids(local_ids, 10, 4, 1, dist_type, 0)


@pytest.mark.parametrize("world_size", [4.5, 4.0])
def test_global_row_ids_float_world_size_refused(world_size: float) -> None:
    """A non-integer world_size (4.5 would give float 'global ids' [1.0, 5.5]) is refused."""
    with pytest.raises(ValueError, match="world_size"):
        global_row_ids(torch.tensor([0, 1]), 10, world_size, 1, "roundrobin", 0)


def test_global_row_ids_hash_keeps_shape_of_local_ids() -> None:
    """Any shape, as the other routings and the docstring say (2-D ids too). Checked against the
    reference permutation's inverse."""
    n, w, rank, seed = 10, 4, 1, 3
    local = torch.tensor([[0, 1], [2, 1]])
    got = global_row_ids(local, n, w, rank, "hash_roundrobin", seed)
    perm = RefPermutation(n, seed)
    inverse = {perm.forward(g): g for g in range(n)}
    want = torch.tensor([[inverse[int(loc) * w + rank] for loc in row] for row in local])
    assert got.shape == local.shape
    torch.testing.assert_close(got, want)


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.tensor([1, 5, 7, 3]), lengths=torch.tensor([2, 1, 0, 1])
    )


_KJT_ARGS = dict(world_size=2, dist_types={"a": "hash_roundrobin", "b": "roundrobin"}, table_sizes={"a": 10, "b": 10})


@pytest.mark.parametrize(
    "override,arg",
    [
        (dict(kjt=None), "kjt"),
        (dict(kjt={"a": torch.tensor([1])}), "kjt"),
        (dict(dist_types=None), "dist_types"),
        (dict(dist_types=["hash_roundrobin", "roundrobin"]), "dist_types"),
        (dict(table_sizes=None), "table_sizes"),
        (dict(table_sizes={"a": 2**70, "b": 10}), "table_sizes"),
        (dict(world_size=2**40), "world_size"),
    ],
)
def test_bucketize_kjt_bad_arguments_named(override: dict, arg: str) -> None:
    kwargs = {"kjt": _kjt(), **_KJT_ARGS, **override}
    with pytest.raises(ValueError, match=f"`{arg}`"):
        bucketize_kjt(**kwargs)


def test_bucketize_kjt_by_refuses_non_kjt() -> None:
    with pytest.raises(ValueError, match="`kjt`"):
        bucketize_kjt_by(None, 2, torch.tensor([5]), torch.tensor([1]), torch.tensor([10]))


@pytest.mark.parametrize(
    "build",
    [RoutedEmbeddingBagCollectionSharder, RoutedEmbeddingCollectionSharder, lambda **kw: routed_sharders(**kw)],
    ids=["ebc", "ec", "routed_sharders"],
)
@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(table_dist_types={"t0": "roundrobin"}, seed=4.5), "seed"),
        (dict(table_dist_types={"t0": "roundrobin"}, seed="4"), "seed"),
        (dict(table_dist_types={"t0": "roundrobin"}, seed=2**70), "seed"),
        (dict(seed=None), "seed"),
        (dict(table_dist_types="hash_roundrobin"), "table_dist_types"),
        (dict(table_dist_types=["t0"]), "table_dist_types"),
        (dict(table_dist_types={3: "roundrobin"}), "table_dist_types"),
    ],
)
def test_sharder_routing_arguments_named(build: Callable[..., Any], kwargs: dict, arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        build(**kwargs)


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(table_dist_types=None), "table_dist_types"),
        (dict(table_dist_types={"t": "bogus"}), "table_dist_types"),
        (dict(seed=4.5), "seed"),
        (dict(seed=None), "seed"),
    ],
)
def test_routing_overrides_validated(kwargs: dict, arg: str) -> None:
    """Bad overrides are refused at construction, not handed to the routing."""
    with pytest.raises(ValueError, match=arg):
        RoutingOverrides(**kwargs)


def test_routing_overrides_parse_and_route_like_fused_params() -> None:
    """A string dist type and a numpy seed in the overrides give the same routing as the fused params."""
    over = RoutingOverrides(table_dist_types={"t": "hash_roundrobin"}, seed=np.int64(3))
    assert table_routing(None, "t", over) == table_routing(
        {"recpipe_dist_type": "hash_roundrobin", "recpipe_seed": 3}, "t"
    )


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(fused_params="x"), "fused_params"),
        (dict(fused_params=[1]), "fused_params"),
        (dict(overrides="x"), "overrides"),
        (dict(overrides={"t": "roundrobin"}), "overrides"),
    ],
)
def test_table_routing_arguments_named(kwargs: dict, arg: str) -> None:
    """Bad arguments are refused naming them, not with a bare dict / attribute error."""
    with pytest.raises(ValueError, match=arg):
        table_routing(**{"fused_params": None, "table_name": "t", **kwargs})
