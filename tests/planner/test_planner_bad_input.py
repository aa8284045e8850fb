"""Bad arguments to the planner's public API, each refused at once with a ValueError naming it.

Topologies, cost models, proposers (construction and ``solve``), ``PlacementPlanner`` and
``plan``, ``tables_from_module``, ``GridPlacementEnumerator``, ``fast_tier_hit_rate``,
``row_wise_sharding_spec``, ``TableSpec`` and ``PlacementConstraints``: never stored for
later, failed deep inside torchrec / torch, or planned silently. Valid values that look
unusual (numpy ints, whole-number float bytes, a mode string) plan as the plain values
do (references: torchrec's ``Topology``, the plain-int plan, an exhaustive search).
"""

from typing import Any, Callable

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner.types import Topology

from recpipe.planner import (
    AnalyticCostModel,
    BruteForceProposer,
    EmpiricalCostModel,
    GridPlacementEnumerator,
    KnapsackProposer,
    Mode,
    PlacementConstraints,
    PlacementPlanner,
    TableSpec,
    fast_tier_hit_rate,
    make_topology,
    tables_from_module,
)
from recpipe.planner.specs import check_topology_args
from recpipe.planner.torchrec_plan import row_wise_sharding_spec

GiB = 2**30


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
    got = make_topology(world_size=np.int64(4), local_world_size=np.int64(2), hbm_cap=2**30, ddr_cap=2**32)
    want = Topology(world_size=4, local_world_size=2, compute_device="cuda", hbm_cap=2**30, ddr_cap=2**32)
    assert (got.world_size, got.local_world_size) == (want.world_size, want.local_world_size)
    assert [d.storage for d in got.devices] == [d.storage for d in want.devices]


@pytest.mark.parametrize("cls", [AnalyticCostModel, EmpiricalCostModel])
@pytest.mark.parametrize("arg", ["hbm_mem_bw", "hbm_to_ddr_mem_bw"])
@pytest.mark.parametrize("value", [None, "1e9", True, float("inf"), [1.0]])
def test_cost_model_bandwidths_named(cls: type, arg: str, value: object) -> None:
    with pytest.raises(ValueError, match=arg):
        cls(**{arg: value})


@pytest.mark.parametrize("value", [None, "4", 4.5, True, 0, -1, [4]])
def test_brute_force_max_tables_named(value: object) -> None:
    """A bad ``max_tables`` is refused at construction, not stored for the solver."""
    with pytest.raises(ValueError, match="max_tables"):
        BruteForceProposer(max_tables=value)


def _topology() -> Topology:
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
        ("proposer", KnapsackProposer),  # the class, not an instance
    ],
)
def test_planner_constructor_names_argument(arg: str, value: object) -> None:
    with pytest.raises(ValueError, match=arg):
        PlacementPlanner(_topology(), **{arg: value})


@pytest.mark.parametrize("proposer", [BruteForceProposer(), KnapsackProposer(bins=(8, 4))])
def test_planner_refuses_bins_together_with_a_proposer(proposer: Any) -> None:
    """``bins`` only builds the default proposer: with a proposer of one's own it was ignored."""
    topo = make_topology(world_size=2, local_world_size=2, hbm_cap=GiB, ddr_cap=GiB)
    with pytest.raises(
        ValueError,
        match=rf"bins=\(100, 50\) and proposer={type(proposer).__name__}\(\.\.\.\) were "
        r"both given.*drop bins, or pass proposer=KnapsackProposer\(bins=\(100, 50\)\)",
    ):
        PlacementPlanner(topo, bins=(100, 50), proposer=proposer)
    # either alone is fine, and the given proposer's own bins are the ones used
    dp = KnapsackProposer(bins=(8, 4))
    tables = [TableSpec(name=n, rows=50_000, dim=16, optimizer="adam") for n in "abc"]
    small = make_topology(world_size=2, local_world_size=2, hbm_cap=4 * 2**20, ddr_cap=GiB)
    PlacementPlanner(small, proposer=dp, backend="native").plan(tables)
    assert dp.last_bins[0] in (0, 8) and dp.last_bins[1] in (0, 4) and dp.last_bins != (0, 0)
    PlacementPlanner(topo, bins=(100, 50))


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


@pytest.mark.parametrize("proposer", [KnapsackProposer(), BruteForceProposer()], ids=["dp", "brute"])
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
def test_proposer_solve_names_argument(proposer: Any, arg: str, value: object) -> None:
    kwargs = dict(hbm=_H, ddr=_H, cost=_C, hbm_budget=10, ddr_budget=10)
    kwargs[arg] = value
    with pytest.raises(ValueError, match=arg):
        proposer.solve(**kwargs)


@pytest.mark.parametrize("proposer", [KnapsackProposer(), BruteForceProposer()], ids=["dp", "brute"])
def test_proposer_whole_float_bytes_still_solve(proposer: Any) -> None:
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
def test_cost_model_class_instead_of_instance_named(build: Callable[[], Any]) -> None:
    """A cost model class (not an instance) is refused naming ``cost_model``."""
    with pytest.raises(ValueError, match="cost_model"):
        build()


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
    with pytest.raises(ValueError, match="load_factors"):
        PlacementConstraints(load_factors=value)
