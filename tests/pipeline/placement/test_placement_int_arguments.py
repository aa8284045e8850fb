"""Int arguments of the placement sizing helpers and the routing row helpers.

Every int argument of these helpers goes through ``recpipe.pipeline.placement.check_int``:
a wrong type (None, a str, a float, a bool, a list) or an out-of-range value is refused
with a ValueError naming the argument, never a silent wrong result, a ZeroDivisionError or
a bare TypeError. numpy ints keep working and give the plain-math results (the reference).
"""

import math
from typing import Any, Callable

import numpy as np
import pytest
import torch

from recpipe.pipeline import placement as pl
from recpipe.pipeline.routing import ops
from recpipe.pipeline.routing.rows import check_dist_type, continuous_block_rows, global_row_ids, shard_num_rows

# (function, valid kwargs) of the int-argument helpers; every int argument goes through check_int
_INT_HELPERS = {
    "local_rows": (ops.local_rows, dict(num_embeddings=10, world_size=4, rank=1)),
    "continuous_block_rows": (continuous_block_rows, dict(num_embeddings=10, world_size=4)),
    "shard_num_rows": (shard_num_rows, dict(num_embeddings=10, world_size=4, rank=1, dist_type="continuous")),
    "max_local_rows": (pl.max_local_rows, dict(num_embeddings=10, world_size=4)),
    "optimizer_state_bytes_per_row": (pl.optimizer_state_bytes_per_row, dict(optimizer="adam", dim=8)),
    "row_bytes": (pl.row_bytes, dict(dim=8, dtype="float32", optimizer="adam")),
    "floor_fraction": (pl.floor_fraction, dict(x=0.3, rows=10)),
    "tier_rows": (pl.tier_rows, dict(rows=10, mode="CACHING", x=0.3)),
    "shard_storage": (pl.shard_storage, dict(rows=10, dim=8, dtype="float32", optimizer="adam", mode="CACHING", x=0.3)),
    "machine_storage": (
        pl.machine_storage,
        dict(
            num_embeddings=10,
            world_size=4,
            local_world_size=2,
            dim=8,
            dtype="float32",
            optimizer="adam",
            mode="CACHING",
            x=0.3,
        ),
    ),
    "global_row_ids": (
        global_row_ids,
        dict(local_ids=torch.tensor([0, 1]), num_embeddings=10, world_size=4, rank=1, dist_type="roundrobin", seed=0),
    ),
    "route_ids": (ops.route_ids, dict(ids=torch.tensor([1, 5]), table_size=10, world_size=2)),
    "hash_roundrobin_global_ids": (
        ops.hash_roundrobin_global_ids,
        dict(ranks=torch.tensor([0, 1]), local_ids=torch.tensor([1, 2]), table_size=10, world_size=2),
    ),
}


_INT_ARGS = ("num_embeddings", "world_size", "rank", "dim", "rows", "local_world_size", "table_size")


# wrong types for an int argument: refused naming the argument, never taken as floats /
# bools-as-ints nor failing with "'<' not supported between instances of ..."
_BAD_INTS = [None, "4", 4.0, 4.5, True, np.float64(4.0), float("nan"), [4]]


@pytest.mark.parametrize(
    "fn_name,arg,value",
    [(f, a, v) for f, (_, kw) in _INT_HELPERS.items() for a in kw if a in _INT_ARGS for v in _BAD_INTS],
)
def test_int_argument_refused_naming_it(fn_name: str, arg: str, value: object) -> None:
    fn, kwargs = _INT_HELPERS[fn_name]
    with pytest.raises(ValueError, match=rf"`?{arg}`? must be"):
        fn(**{**kwargs, arg: value})


@pytest.mark.parametrize("fn_name", sorted(_INT_HELPERS))
def test_numpy_ints_accepted_as_plain_ints(fn_name: str) -> None:
    """numpy ints are ints: the result equals the call with Python ints, and is not a numpy scalar."""
    fn, kwargs = _INT_HELPERS[fn_name]
    np_kwargs = {k: (np.int64(v) if k in _INT_ARGS else v) for k, v in kwargs.items()}
    got, want = fn(**np_kwargs), fn(**kwargs)
    if isinstance(want, torch.Tensor) or isinstance(want, tuple) and isinstance(want[0], torch.Tensor):
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w)
    else:
        assert got == want
        assert not isinstance(got, np.generic), type(got)


def test_plain_math_of_int_helpers() -> None:
    """The helpers against plain integer math, on the values the checks let through."""
    n, w = 10, 4
    assert [ops.local_rows(np.int64(n), w, r) for r in range(w)] == [math.ceil((n - r) / w) for r in range(w)]
    assert continuous_block_rows(np.int64(n), w) == math.ceil(n / w)
    assert pl.tier_rows(np.int64(10), "HYBRID", 0.3) == (3, 7, 0)


@pytest.mark.parametrize(
    "fn,kwargs,arg",
    [
        (continuous_block_rows, dict(num_embeddings=10, world_size=0), "world_size"),
        (continuous_block_rows, dict(num_embeddings=-1, world_size=2), "num_embeddings"),
        (continuous_block_rows, dict(num_embeddings=10, world_size=-2), "world_size"),
        (pl.floor_fraction, dict(x=0.3, rows=-1), "rows"),
        (pl.floor_fraction, dict(x=-0.5, rows=10), "x"),
        (pl.floor_fraction, dict(x="0.5", rows=10), "x"),
        (pl.floor_fraction, dict(x=float("nan"), rows=10), "x"),
        (pl.row_bytes, dict(dim=8, dtype=["float32"], optimizer="adam"), "dtype"),
        (check_dist_type, dict(dist_type=["roundrobin"]), "dist_type"),
        (ops.dist_type_code, dict(name=["roundrobin"]), "dist_type"),
        (ops.route_ids, dict(ids=torch.tensor([0]), table_size=10, world_size=True), "world_size"),
        (ops.route_ids, dict(ids=torch.tensor([0]), table_size=True, world_size=2), "table_size"),
    ],
)
def test_out_of_range_and_wrong_type_named(fn: Callable[..., Any], kwargs: dict, arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        fn(**kwargs)
