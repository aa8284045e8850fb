"""Bad input to recpipe's public helpers: a ValueError naming the argument, never a silent
wrong result, a ZeroDivisionError / AttributeError / bare TypeError, or a result of the wrong type.

Valid values that look unusual (numpy ints) keep working and give plain-math results.
"""

import math

import numpy as np
import pytest
import torch
from harness.routing_reference import RefPermutation
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.pipeline import placement as pl
from recpipe.pipeline.routing import ops
from recpipe.pipeline.routing.kjt import bucketize_kjt, bucketize_kjt_by
from recpipe.pipeline.routing.rows import check_dist_type, continuous_block_rows, global_row_ids, shard_num_rows
from recpipe.planner import AnalyticCostModel, BruteForceProposer, EmpiricalCostModel, make_topology
from recpipe.planner.specs import check_topology_args

# (function, valid kwargs) of the int-argument helpers; every int argument goes through ops.check_int
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
def test_out_of_range_and_wrong_type_named(fn, kwargs, arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        fn(**kwargs)


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
    "arg,value",
    [
        ("world_size", 4.0),
        ("world_size", "4"),
        ("world_size", None),
        ("world_size", np.float64(4.0)),
        ("local_world_size", 2.0),
        ("local_world_size", True),
        ("local_world_size", "2"),
        ("hbm_cap", None),
        ("hbm_cap", "1GiB"),
        ("hbm_cap", True),
        ("ddr_cap", [1]),
    ],
)
def test_topology_args_named(arg: str, value: object) -> None:
    """make_topology / check_topology_args refuse a float, bool, None or str argument naming it
    (not failing deep inside torchrec with "can't multiply sequence by non-int")."""
    kwargs = dict(world_size=4, local_world_size=2, hbm_cap=2**30, ddr_cap=2**32)
    kwargs[arg] = value
    with pytest.raises(ValueError, match=arg):
        make_topology(**kwargs)
    with pytest.raises(ValueError, match=arg):
        check_topology_args(**kwargs)


def test_topology_numpy_ints_match_torchrec() -> None:
    from torchrec.distributed.planner.types import Topology

    got = make_topology(world_size=np.int64(4), local_world_size=np.int64(2), hbm_cap=2**30, ddr_cap=2**32)
    want = Topology(world_size=4, local_world_size=2, compute_device="cuda", hbm_cap=2**30, ddr_cap=2**32)
    assert (got.world_size, got.local_world_size) == (want.world_size, want.local_world_size)
    assert [d.storage for d in got.devices] == [d.storage for d in want.devices]


@pytest.mark.parametrize("cls", [AnalyticCostModel, EmpiricalCostModel])
@pytest.mark.parametrize("arg", ["hbm_mem_bw", "hbm_to_ddr_mem_bw"])
@pytest.mark.parametrize("value", [None, "1e9", True, float("inf"), [1.0]])
def test_cost_model_bandwidths_named(cls, arg: str, value: object) -> None:
    with pytest.raises(ValueError, match=arg):
        cls(**{arg: value})


@pytest.mark.parametrize("value", [None, "4", 4.5, True, 0, -1, [4]])
def test_brute_force_max_tables_named(value: object) -> None:
    """A bad ``max_tables`` is refused at construction, not stored for the solver."""
    with pytest.raises(ValueError, match="max_tables"):
        BruteForceProposer(max_tables=value)


# ------------------------------------------------------------------ tiered shard
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig  # noqa: E402

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
def shard(request) -> TieredEmbeddingShard:
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
def test_tiered_methods_name_argument(shard: TieredEmbeddingShard, call, arg: str) -> None:
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


# ------------------------------------------------------------------ planner
from recpipe.planner import (  # noqa: E402
    DynamicProgrammingProposer,
    GridPlacementEnumerator,
    Mode,
    PlacementPlanner,
    TableSpec,
    fast_tier_hit_rate,
    tables_from_module,
)
from recpipe.planner.torchrec_plan import row_wise_sharding_spec  # noqa: E402


def _topology():
    return make_topology(world_size=2, local_world_size=2, hbm_cap=2**24, ddr_cap=2**28)


@pytest.mark.parametrize(
    "arg,value",
    [
        ("load_factors", None),
        ("load_factors", 0.5),
        ("load_factors", "0.5"),
        ("batch_size", 4.5),
        ("batch_size", True),
        ("batch_size", None),
        ("batch_size", "512"),
        ("hbm_reservation", None),
        ("hbm_reservation", "0.1"),
        ("ddr_reservation", True),
        ("seed", 4.5),
        ("seed", "1"),
        ("seed", None),
        ("seed", 2**70),
        ("constraints", "t0"),
        ("constraints", [1]),
        ("fused_params", "x"),
        ("proposer", 3),
        ("proposer", DynamicProgrammingProposer),  # the class, not an instance
    ],
)
def test_planner_constructor_names_argument(arg: str, value: object) -> None:
    with pytest.raises(ValueError, match=arg):
        PlacementPlanner(_topology(), **{arg: value})


def test_planner_seed_numpy_int_is_planned_as_int() -> None:
    ref = PlacementPlanner(_topology(), seed=5).plan([TableSpec(name="t", rows=1000, dim=8)])
    got = PlacementPlanner(_topology(), seed=np.int64(5)).plan([TableSpec(name="t", rows=1000, dim=8)])
    assert got.placement_params("t") == ref.placement_params("t")
    assert got.placement_params("t").seed == 5


@pytest.mark.parametrize("tables", [None, TableSpec(name="t", rows=10, dim=4), "t0"])
def test_plan_tables_named(tables: object) -> None:
    """``plan`` refuses None or a lone TableSpec naming ``tables``."""
    with pytest.raises(ValueError, match="tables must be"):
        PlacementPlanner(_topology()).plan(tables)


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(module=None), "module"),
        (dict(module="ebc"), "module"),
        (dict(batch_size=4.5), "batch_size"),
        (dict(batch_size=True), "batch_size"),
        (dict(batch_size="4"), "batch_size"),
        (dict(pooling_factor="0.5"), "pooling_factor"),
        (dict(pooling_factor=True), "pooling_factor"),
        (dict(pooling_factor=None), "pooling_factor"),
        (dict(fused_params="x"), "fused_params"),
    ],
)
def test_tables_from_module_names_argument(kwargs: dict, arg: str) -> None:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=100, feature_names=["f0"])],
        device=torch.device("meta"),
    )
    with pytest.raises(ValueError, match=arg):
        tables_from_module(**{"module": ebc, **kwargs})


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(world_size=None), "world_size"),
        (dict(world_size=2.0), "world_size"),
        (dict(world_size=0), "world_size"),
        (dict(local_world_size=4), "local_world_size"),
        (dict(local_world_size="2"), "local_world_size"),
        (dict(cost_model=None), "cost_model"),
        (dict(cost_model="analytic"), "cost_model"),
        (dict(load_factors=0.5), "load_factors"),
        (dict(load_factors=None), "load_factors"),
    ],
)
def test_enumerator_constructor_names_argument(kwargs: dict, arg: str) -> None:
    """Every bad argument is refused at construction naming it, not stored for later."""
    base = dict(world_size=2, local_world_size=2, cost_model=AnalyticCostModel())
    with pytest.raises(ValueError, match=arg):
        GridPlacementEnumerator(**{**base, **kwargs})


@pytest.mark.parametrize(
    "mode,x,arg",
    [
        ("bogus", 0.5, "mode"),
        (None, 0.5, "mode"),
        (3, 0.5, "mode"),
        (Mode.CACHING, True, "x"),
        (Mode.CACHING, float("inf"), "x"),
        (Mode.CACHING, None, "x"),
        (Mode.CACHING, 0.0, "x"),
        (Mode.CACHING, -0.5, "x"),
    ],
)
def test_fast_tier_hit_rate_names_argument(mode: object, x: object, arg: str) -> None:
    table = TableSpec(name="t", rows=100, dim=8)
    with pytest.raises(ValueError, match=arg):
        fast_tier_hit_rate(table, mode, x)
    with pytest.raises(ValueError, match=arg):
        AnalyticCostModel().effective_hit(table, mode, x)


def test_fast_tier_hit_rate_mode_string_is_the_mode() -> None:
    """'HYBRID' (a string, as everywhere else) is HYBRID: hit rate x (not CACHING's)."""
    table = TableSpec(name="t", rows=100, dim=8, zipf_alpha=1.2)
    assert fast_tier_hit_rate(table, "HYBRID", 0.3) == 0.3


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(world_size=2.0), "world_size"),
        (dict(world_size=None), "world_size"),
        (dict(world_size=0), "world_size"),
        (dict(dim=4.5), "dim"),
        (dict(dim=True), "dim"),
        (dict(dim=None), "dim"),
        (dict(dim=-1), "dim"),
        (dict(num_embeddings=-1), "num_embeddings"),
        (dict(local_world_size=3), "local_world_size"),
        (dict(compute_device="bogus"), "compute_device"),
        (dict(compute_device=None), "compute_device"),
    ],
)
def test_row_wise_sharding_spec_names_argument(kwargs: dict, arg: str) -> None:
    """Bad arguments are refused naming them, not deep inside torch (ShardMetadata,
    _remote_device) nor turned into a spec of 4.5-wide shards."""
    base = dict(num_embeddings=10, dim=4, world_size=2, local_world_size=2, compute_device="cuda")
    with pytest.raises(ValueError, match=arg):
        row_wise_sharding_spec(**{**base, **kwargs})


_H = np.array([[1, 2], [1, 2]], dtype=np.int64)
_C = np.array([[1.0, 0.5], [1.0, 0.5]])


@pytest.mark.parametrize("proposer", [DynamicProgrammingProposer(), BruteForceProposer()], ids=["dp", "brute"])
@pytest.mark.parametrize(
    "arg,value",
    [
        ("hbm", np.array([[1.5, 2.0], [1.0, 2.0]])),
        ("hbm", -_H),
        ("ddr", np.full((2, 2), np.nan)),
        ("ddr", None),
        ("cost", np.full((2, 2), np.nan)),
        ("hbm_budget", 4.5),
        ("hbm_budget", None),
        ("ddr_budget", "10"),
        ("ddr_budget", float("nan")),
    ],
)
def test_proposer_solve_names_argument(proposer, arg: str, value: object) -> None:
    kwargs = dict(hbm=_H, ddr=_H, cost=_C, hbm_budget=10, ddr_budget=10)
    kwargs[arg] = value
    with pytest.raises(ValueError, match=arg):
        proposer.solve(**kwargs)


@pytest.mark.parametrize("proposer", [DynamicProgrammingProposer(), BruteForceProposer()], ids=["dp", "brute"])
def test_proposer_whole_float_bytes_still_solve(proposer) -> None:
    """Whole-number float byte arrays are taken; the answer is the exhaustive optimum."""
    got = proposer.solve(_H.astype(np.float64), _H.astype(np.float64), _C, 3, 3)
    # reference: every combination by hand; budgets 3 fit option 1 (2 bytes) for one table only
    best = min(
        ((i, j) for i in range(2) for j in range(2) if _H[0, i] + _H[1, j] <= 3),
        key=lambda ij: _C[0, ij[0]] + _C[1, ij[1]],
    )
    assert _C[0, got[0]] + _C[1, got[1]] == _C[0, best[0]] + _C[1, best[1]]


@pytest.mark.parametrize(
    "build",
    [
        lambda: PlacementPlanner(_topology(), cost_model=AnalyticCostModel),
        lambda: GridPlacementEnumerator(2, 2, AnalyticCostModel),
    ],
    ids=["planner", "enumerator"],
)
def test_cost_model_class_instead_of_instance_named(build) -> None:
    """A cost model class (not an instance) is refused naming ``cost_model``."""
    with pytest.raises(ValueError, match="cost_model"):
        build()


# ------------------------------------------------------------------ sharders, routing, DCP
from recpipe.pipeline import checkpoint as recpipe_dcp  # noqa: E402
from recpipe.pipeline.routing.features import RoutingOverrides, table_routing  # noqa: E402
from recpipe.pipeline.routing.routed_sharders import (  # noqa: E402
    RoutedEmbeddingBagCollectionSharder,
    RoutedEmbeddingCollectionSharder,
    routed_sharders,
)
from recpipe.pipeline.tiered.fused_optimizer import TieredFusedOptimizer  # noqa: E402
from recpipe.pipeline.tiered.fused_params import tiered_optimizer_from_fused_params  # noqa: E402


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
def test_sharder_routing_arguments_named(build, kwargs: dict, arg: str) -> None:
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


@pytest.mark.parametrize(
    "call,arg",
    [
        (lambda d: recpipe_dcp.save(torch.nn.Linear(2, 2), d, thread_count=0), "thread_count"),
        (lambda d: recpipe_dcp.save(torch.nn.Linear(2, 2), d, thread_count=2.0), "thread_count"),
        (lambda d: recpipe_dcp.save(torch.nn.Linear(2, 2), d, thread_count=None), "thread_count"),
        (lambda d: recpipe_dcp.save(None, d), "model"),
        (lambda d: recpipe_dcp.save(torch.nn.Linear(2, 2), None), "checkpoint_id"),
        (lambda d: recpipe_dcp.load(torch.nn.Linear(2, 2), None), "checkpoint_id"),
        (lambda d: recpipe_dcp.load(None, d), "model"),
        (lambda d: recpipe_dcp.load_dcp_state_dict(torch.nn.Linear(2, 2), 3), "checkpoint"),
        (lambda d: recpipe_dcp.dcp_state_dict("model"), "model"),
        (lambda d: recpipe_dcp.verify_checkpoint(None), "checkpoint_id"),
        (lambda d: recpipe_dcp.write_digests(3), "checkpoint_id"),
        (lambda d: recpipe_dcp.remove_rank_files(d, None), "rank"),
        (lambda d: recpipe_dcp.remove_rank_files(d, "0"), "rank"),
    ],
)
def test_dcp_arguments_named(tmp_path, call, arg: str) -> None:
    """Bad arguments are refused naming them, not by pathlib nor as a CheckpointSaveError
    blaming the disk."""
    with pytest.raises(ValueError, match=arg):
        call(tmp_path)


def test_dcp_save_bad_thread_count_keeps_previous_checkpoint(tmp_path) -> None:
    """A save refused for ``thread_count=0`` leaves the previous checkpoint whole: it loads
    into a fresh module (reference: the saved weights)."""
    src = torch.nn.Linear(2, 2)
    recpipe_dcp.save(src, tmp_path)
    with pytest.raises(ValueError, match="thread_count"):
        recpipe_dcp.save(torch.nn.Linear(2, 2), tmp_path, thread_count=0)
    dst = torch.nn.Linear(2, 2)
    recpipe_dcp.load(dst, tmp_path)
    torch.testing.assert_close(dst.weight, src.weight)
    torch.testing.assert_close(dst.bias, src.bias)


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(name=3), "name"),
        (dict(name=["t"]), "name"),
        (dict(module_path=None), "module_path"),
        (dict(module_path=3), "module_path"),
        (dict(feature_names=None), "feature_names"),
        (dict(feature_names="f0"), "feature_names"),
        (dict(feature_names=[3]), "feature_names"),
    ],
)
def test_table_spec_names_argument(kwargs: dict, arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        TableSpec(**{"name": "t", "rows": 100, "dim": 8, **kwargs})


@pytest.mark.parametrize("value", [0.5, 1, "0.5"])
def test_placement_constraints_load_factors_named(value: object) -> None:
    """A float or string ``load_factors`` (not a sequence of factors) is refused naming it."""
    from recpipe.planner import PlacementConstraints

    with pytest.raises(ValueError, match="load_factors"):
        PlacementConstraints(load_factors=value)
