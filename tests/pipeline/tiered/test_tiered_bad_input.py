"""Bad input to tiered shards, their optimizer and fused params, and the fused optimizer.

``TieredEmbeddingShard`` (construction, forward, load / export methods),
``TieredOptimizerConfig`` (``state_cols``, ``update``), ``tiered_optimizer_from_fused_params``
and ``TieredFusedOptimizer`` refuse a wrong type, shape or value naming the argument (ids out
of range also naming the table, shard and fixes), never routing a 4.5 seed as 4 nor failing
with AttributeError / TypeError. Valid unusual input still works: a numpy seed routes as the
reference permutation says, a list of one export loads, the checked update equals
``torch.optim.Adam``.
"""

from typing import Any, Callable

import numpy as np
import pytest
import torch
from harness.routing_reference import RefPermutation
from harness.tiered_shards import roundrobin_shard

from recpipe.pipeline.tiered.fused_optimizer import TieredFusedOptimizer
from recpipe.pipeline.tiered.fused_params import tiered_optimizer_from_fused_params
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig

_SHARD = dict(
    num_embeddings=40, embedding_dim=4, mode="HYBRID", cache_load_factor=0.5, rank=1, world_size=2, table_name="t"
)


@pytest.mark.parametrize(
    "arg,value",
    [
        ("routing_seed", 4.5),
        ("routing_seed", "4"),
        ("routing_seed", True),
        ("routing_seed", None),
        ("routing_seed", 2**70),
        ("split_seed", 4.5),
        ("split_seed", "4"),
        ("split_seed", float("nan")),
        ("optimizer", "adam"),
        ("optimizer", 3),
        ("embedding_dim", True),
        ("num_embeddings", True),
        ("rank", 1.0),
        ("world_size", "2"),
    ],
)
def test_tiered_shard_constructor_names_argument(arg: str, value: object) -> None:
    """Non-integer seeds (int() would route 4.5 as 4, '4' as 4, True as 1), a string optimizer
    and bool sizes are refused naming the argument."""
    with pytest.raises(ValueError, match=arg):
        TieredEmbeddingShard(**{**_SHARD, arg: value})


def test_tiered_shard_numpy_seed_routes_like_int() -> None:
    """A numpy int seed is the same routing as the Python int (reference: the permutation of
    routing_reference, not recpipe's op)."""
    shard = TieredEmbeddingShard(**{**_SHARD, "dist_type": "hash_roundrobin", "routing_seed": np.int64(7)})
    perm = RefPermutation(40, 7)
    want = sorted(g for g in range(40) if perm.forward(g) % 2 == 1)
    assert sorted(shard.global_ids().tolist()) == want
    assert shard.routing_seed == 7 and type(shard.routing_seed) is int


@pytest.fixture(params=["native", "torch"])
def shard(request: pytest.FixtureRequest) -> TieredEmbeddingShard:
    return TieredEmbeddingShard(**_SHARD, backend=request.param)


@pytest.mark.parametrize(
    "arg,value",
    [
        ("ids", None),
        ("ids", [0, 3, 5]),
        ("ids", np.array([0, 3, 5])),
        ("offsets", None),
        ("offsets", [0, 2, 3]),
        ("per_sample_weights", [1.0, 1.0, 1.0]),
    ],
)
def test_tiered_forward_non_tensor_named(shard: TieredEmbeddingShard, arg: str, value: object) -> None:
    """A non-tensor input is refused naming the argument (as torch.nn.EmbeddingBag does)."""
    kwargs = dict(ids=torch.tensor([0, 3, 5]), offsets=torch.tensor([0, 2, 3]), per_sample_weights=None)
    kwargs[arg] = value
    with pytest.raises(ValueError, match=arg):
        shard(**kwargs)


@pytest.mark.parametrize(
    "call,arg",
    [
        (lambda s: s.load_global_weights(None), "weights"),
        (lambda s: s.load_global_weights([[0.0] * 4] * 40), "weights"),
        (lambda s: s.update_hyper_parameters(None), "params_dict"),
        (lambda s: s.update_hyper_parameters([("lr", 0.1)]), "params_dict"),
        (lambda s: s.load_states(None), "states"),
        (lambda s: s.load_states([None]), "states"),
        (lambda s: s.load_states(s.export_state()), "states"),  # one export, not a list of them
        (lambda s: s.check_export_metadata(None), "metadata"),
    ],
)
def test_tiered_methods_name_argument(
    shard: TieredEmbeddingShard, call: Callable[[TieredEmbeddingShard], Any], arg: str
) -> None:
    """Bad arguments are refused naming them, not with AttributeError / TypeError."""
    with pytest.raises(ValueError, match=arg):
        call(shard)


def test_load_states_list_of_one_export_still_loads(shard: TieredEmbeddingShard) -> None:
    w = torch.randn(40, 4)
    shard.load_global_weights(w)
    other = TieredEmbeddingShard(**_SHARD, backend=shard.backend)
    other.load_states([shard.export_state()])
    bags = torch.arange(other.num_rows + 1)
    torch.testing.assert_close(other(torch.arange(other.num_rows), bags), w.index_select(0, other.global_ids()))


@pytest.mark.parametrize("dim", ["4", 4.0, True, None, [4]])
def test_optimizer_state_cols_dim_named(dim: object) -> None:
    """A non-integer ``dim`` ('4', [4], 4.0) is refused, not multiplied by the state width."""
    with pytest.raises(ValueError, match="dim"):
        TieredOptimizerConfig(optimizer="adam").state_cols(dim)


@pytest.mark.parametrize(
    "arg,value",
    [
        ("grad", torch.zeros(2, 4)),
        ("grad", torch.zeros(3, 5)),
        ("state", torch.zeros(3, 4)),
        ("weights", None),
        ("grad", torch.zeros(3, 4, dtype=torch.int64)),
        ("step", 4.5),
        ("step", 0),
        ("step", None),
    ],
)
def test_optimizer_update_names_argument(arg: str, value: object) -> None:
    """Bad shapes and a non-integer step (a non-integer bias correction) are refused naming the argument."""
    kwargs = dict(weights=torch.zeros(3, 4), state=torch.zeros(3, 8), grad=torch.zeros(3, 4), step=1)
    kwargs[arg] = value
    with pytest.raises(ValueError, match=arg):
        TieredOptimizerConfig(optimizer="adam", learning_rate=0.1).update(**kwargs)


def test_optimizer_update_matches_torch_adam() -> None:
    """The checked update still equals torch.optim.Adam (one step, per row)."""
    torch.manual_seed(0)
    w0, g = torch.randn(3, 4), torch.randn(3, 4)
    w, s = w0.clone(), torch.zeros(3, 8)
    TieredOptimizerConfig(optimizer="adam", learning_rate=0.1).update(w, s, g, 1)
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Adam([p], lr=0.1, betas=(0.9, 0.999), eps=1e-8)
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(w, p.detach())


@pytest.mark.parametrize(
    "fused_params,arg",
    [
        ("x", "fused_params"),
        ({"learning_rate": "x"}, "learning_rate"),
        ({"eps": None}, "eps"),
        ({"optimizer": "adam", "beta1": [0.9]}, "beta1"),
    ],
)
def test_tiered_optimizer_fused_params_named(fused_params: object, arg: str) -> None:
    """Bad fused params are refused naming them, not with float()'s bare errors."""
    with pytest.raises(ValueError, match=arg):
        tiered_optimizer_from_fused_params(fused_params)


@pytest.mark.parametrize("shards", [None, "x", {"t": 3}, [1]])
def test_tiered_fused_optimizer_shards_named(shards: object) -> None:
    with pytest.raises(ValueError, match="shards"):
        TieredFusedOptimizer(shards)


def test_bad_input_errors() -> None:
    shard = roundrobin_shard("CACHING", 0.5, "sgd")
    # the kernel's range check, re-raised naming the table and shard, with the fixes
    for ids, lo, hi in (([0, 240], 0, 240), ([-1, 3], -1, 3)):
        with pytest.raises(
            IndexError,
            match=rf"ids out of range for table {shard.table_name!r} shard 0: got ids in "
            rf"\[{lo}, {hi}\] but the shard has 240 local rows\. Possible solutions",
        ):
            shard(torch.tensor(ids), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="offsets must start at 0"):
        shard(torch.tensor([1, 3]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="ids must be a 1-D int32/int64"):
        shard(torch.tensor([1.0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="mode must be one of"):
        roundrobin_shard("SPILL", 0.5, "sgd")
    for x in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"cache_load_factor must be in \(0, 1\]"):
            roundrobin_shard("HYBRID", x, "sgd")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        TieredOptimizerConfig(optimizer="lamb")
    with pytest.raises(ValueError, match="cache_policy"):
        roundrobin_shard("CACHING", 0.5, "sgd", cache_policy="fifo")
    with pytest.raises(ValueError, match="dist_type"):
        roundrobin_shard("CACHING", 0.5, "sgd", dist_type="random")
    with pytest.raises(ValueError, match="weight_decay"):
        TieredOptimizerConfig(optimizer="sgd", weight_decay=0.1)
