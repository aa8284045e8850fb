"""Bad input to the planner's helpers and plan files, the quoted budgets of an infeasible
pair of budgets, the label of an all-HBM table, and one rounding per byte figure in a message."""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, compute_kernel_to_embedding_location
from torchrec.distributed.planner.types import Topology

from recpipe.pipeline.tiered.optim import TieredOptimizerConfig
from recpipe.pipeline.tiered.tbe_tables import plan_fbgemm_tier
from recpipe.planner import (
    DEFAULT_LOAD_FACTORS,
    BruteForceProposer,
    KnapsackProposer,
    Mode,
    PlacementConstraints,
    PlacementErrorType,
    PlacementPlan,
    PlacementPlanner,
    PlacementPlannerError,
    TableSpec,
    machine_storage,
    make_topology,
    max_local_rows,
    shard_storage,
)
from recpipe.planner import knapsack as P
from recpipe.planner.cost_models import generalized_harmonic
from recpipe.planner.errors import format_bytes

GiB = 2**30
MiB = 2**20


def _topo(world: int, local: int, hbm: int, ddr_per_rank: int) -> Topology:
    return make_topology(world_size=world, local_world_size=local, hbm_cap=hbm, ddr_cap=ddr_per_rank)


def _plan_dict() -> Dict[str, Any]:
    tables = [TableSpec(name="a", rows=5000, dim=16, optimizer="adam"), TableSpec(name="b", rows=300, dim=8)]
    return PlacementPlanner(_topo(2, 2, GiB, GiB), backend="native").plan(tables).to_dict()


# ------------------------------------------------------- plan dicts and files
def _set(path: Tuple[Any, ...], value: Any) -> Callable[[Dict[str, Any]], Any]:
    def edit(d: Dict[str, Any]) -> Any:
        node = d
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return d

    return edit


def _drop(path: Tuple[Any, ...]) -> Callable[[Dict[str, Any]], Any]:
    def edit(d: Dict[str, Any]) -> Any:
        node = d
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
        return d

    return edit


BAD_PLAN_DICTS = [
    # (edit of a valid to_dict(), what the message must name); before: TypeError, KeyError or silence
    (lambda d: None, r"data must be a dict .*got NoneType None"),
    (lambda d: [d], r"data must be a dict .*got list"),
    (lambda d: {}, r"data has no \['placements', 'world_size'"),
    (_drop(("world_size",)), r"data has no \['world_size'\]"),
    (_set(("bogus",), 1), r"data has unknown keys \['bogus'\]"),
    (_set(("placements",), None), r"data\['placements'\] must be a list"),
    (_set(("placements", 0), "a"), r"data\['placements'\]\[0\] must be a dict"),
    (_drop(("placements", 1, "rows")), r"data\['placements'\]\[1\] \(table 'b'\) has no \['rows'\]"),
    (_set(("placements", 0, "extra"), 0), r"data\['placements'\]\[0\] \(table 'a'\) has unknown keys \['extra'\]"),
    (_set(("world_size",), "2"), r"`data\['world_size'\]` must be an int, got str '2'"),
    (_set(("world_size",), True), r"`data\['world_size'\]` must be an int, got bool"),
    (_set(("local_world_size",), 0), r"`data\['local_world_size'\]` must be >= 1"),
    (_set(("local_world_size",), 3), r"data\['local_world_size'\] \(3\) must divide data\['world_size'\] \(2\)"),
    (_set(("hbm_budget_per_rank",), -1), r"`data\['hbm_budget_per_rank'\]` must be >= 0"),
    (_set(("ddr_budget_per_machine",), 1.5), r"`data\['ddr_budget_per_machine'\]` must be an int"),
    (_set(("compute_device",), None), r"data\['compute_device'\] must be a non-empty string"),
    (_set(("seed",), 2**64), r"`data\['seed'\]` must be <="),
    (_set(("dist_type",), "zigzag"), r"data\['dist_type'\]"),
    (_set(("backend",), "tpu"), r"data\['backend'\] must be one of"),
    (_set(("placements", 0, "table"), ""), r"data\['placements'\]\[0\] \(table ''\)\['table'\] must be a non-empty"),
    (_set(("placements", 0, "rows"), 0), r"`data\['placements'\]\[0\] \(table 'a'\)\['rows'\]` must be >= 1"),
    (_set(("placements", 0, "dim"), "16"), r"`data\['placements'\]\[0\] \(table 'a'\)\['dim'\]` must be an int"),
    (_set(("placements", 0, "mode"), "HOT"), r"data\['placements'\]\[0\] \(table 'a'\)\['mode'\] must be one of"),
    (_set(("placements", 0, "cache_load_factor"), 1.5), r"\['cache_load_factor'\] must be in \(0, 1\]"),
    (_set(("placements", 0, "hbm_bytes_per_rank"), -5), r"\['hbm_bytes_per_rank'\]` must be >= 0"),
    (_set(("placements", 0, "cost"), float("nan")), r"\['cost'\] must be a finite number >= 0"),
    (_set(("placements", 0, "optimizer"), "lion"), r"\['optimizer'\] must be one of"),
    (
        _set(("placements", 1, "table"), "a"),
        r"data\['placements'\]\[1\] places table 'a' like data\['placements'\]\[0\]",
    ),
]


@pytest.mark.parametrize("edit, match", BAD_PLAN_DICTS)
def test_from_dict_refuses_what_is_not_a_plan(edit: Callable[[Dict[str, Any]], Any], match: str) -> None:
    good = _plan_dict()
    assert PlacementPlan.from_dict(copy.deepcopy(good)).to_dict() == good  # the round trip stays exact
    with pytest.raises(ValueError, match=r"^PlacementPlan\.from_dict\(data\): .*" + match):
        PlacementPlan.from_dict(edit(copy.deepcopy(good)))


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", r"the file is empty"),
        (b"placements: []\n", r"the file is not JSON \(Expecting value at line 1 column 1\)"),
        (b"\xff\xfe{}", r"the file is not UTF-8 text"),
        (b"[1, 2]", r"the file holds a JSON list, not a plan"),
        (b"null", r"the file holds a JSON NoneType, not a plan"),
        (b'{"placements": []}', r"the file is not a valid plan: data has no \['world_size'"),
    ],
)
def test_load_refuses_files_that_are_not_plans(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(f"PlacementPlan.load({str(path)!r}): ") + match):
        PlacementPlan.load(path)
    path.write_text(json.dumps(_plan_dict()))
    assert PlacementPlan.load(str(path)).to_dict() == _plan_dict()


@pytest.mark.parametrize("path", [None, 3, b"", ""])
def test_load_and_save_name_a_bad_path_argument(path: Any) -> None:
    with pytest.raises(ValueError, match=r"PlacementPlan\.load\(path\): path must be a plan file's path"):
        PlacementPlan.load(path)
    with pytest.raises(ValueError, match=r"PlacementPlan\.save\(path\): path must be a plan file's path"):
        PlacementPlan.from_dict(_plan_dict()).save(path)


# ------------------------------------------------------------- helpers' input
def _prices_instance() -> Tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    rng = np.random.default_rng(0)
    hbm = rng.integers(1, 1000, (5, 4)).astype(np.int64)
    ddr = rng.integers(1, 1000, (5, 4)).astype(np.int64)
    cost = rng.random((5, 4))
    return hbm, ddr, cost, int(hbm.min(axis=1).sum() * 1.5), int(ddr.min(axis=1).sum() * 1.5)


@pytest.mark.parametrize("twin", [P.budget_prices, P._budget_prices_cpp], ids=["numpy", "cpp"])
@pytest.mark.parametrize(
    "iters, match",
    [
        (0, r"`iters` must be >= 1, got 0"),
        (-1, r"`iters` must be >= 1, got -1"),
        (1.5, r"`iters` must be an int, got float 1\.5"),
        (True, r"`iters` must be an int, got bool True"),
        (None, r"`iters` must be an int, got NoneType None"),
    ],
)
def test_budget_prices_refuses_bad_iters(twin: Callable[..., Any], iters: Any, match: str) -> None:
    hbm, ddr, cost, H, D = _prices_instance()
    # the compiled kernel refuses iters < 1 (independent reference); both twins say so
    with pytest.raises(RuntimeError, match="`iters` must be >= 1"):
        torch.ops.recpipe.placement_budget_prices(
            torch.from_numpy(hbm), torch.from_numpy(ddr), torch.from_numpy(cost), H, D, 0
        )
    with pytest.raises(ValueError, match=match):
        twin(hbm, ddr, cost, H, D, iters=iters)
    assert twin(hbm, ddr, cost, H, D, iters=np.int64(3)) == pytest.approx(P.budget_prices(hbm, ddr, cost, H, D, 3))


@pytest.mark.parametrize(
    "n, alpha, match",
    [
        (-1, 1.0, r"n must hold whole numbers >= 0 .*got -1 in"),  # before: 8.895..., the sum of 4096 terms
        (np.array([3, -2]), 1.0, r"got -2 in"),
        (np.array([1.5]), 1.0, r"got 1\.5 in"),
        (np.array([np.nan]), 1.0, r"got nan in"),
        (np.array([np.inf]), 1.0, r"got inf in"),
        (np.array([True]), 1.0, r"got True in an array of dtype bool"),
        (None, 1.0, r"n must hold whole numbers >= 0 .*got None in an array of dtype object"),
        (np.array(["3"]), 1.0, r"n must hold whole numbers >= 0 .*got '3' in"),
        (np.array([3]), -1.0, r"alpha must be a finite number >= 0 .*got float -1\.0"),
        (np.array([3]), float("nan"), r"alpha must be a finite number >= 0 .*got float nan"),
        (np.array([3]), float("inf"), r"alpha must be a finite number >= 0 .*got float inf"),
        (np.array([3]), None, r"alpha must be a finite number >= 0 .*got NoneType None"),
        (np.array([3]), True, r"alpha must be a finite number >= 0 .*got bool True"),
    ],
)
def test_generalized_harmonic_refuses_bad_n_and_alpha(n: Any, alpha: Any, match: str) -> None:
    with pytest.raises(ValueError, match=r"generalized_harmonic\((n|alpha)\): .*" + match):
        generalized_harmonic(n, alpha)


def test_generalized_harmonic_equals_the_plain_sum_on_good_input() -> None:
    for alpha in (0.0, 0.6, 1.0, 1.05):
        ns = np.array([0, 1, 7, 4096, 4097, 20000])
        ref = [math.fsum(i**-alpha for i in range(1, int(k) + 1)) for k in ns]
        np.testing.assert_allclose(generalized_harmonic(ns, alpha), ref, rtol=1e-10)
        np.testing.assert_allclose(generalized_harmonic(ns.astype(np.float64), alpha), ref, rtol=1e-10)


@pytest.mark.parametrize("num", [float("nan"), float("inf"), -float("inf"), None, "3", True, np.float64("nan")])
def test_format_bytes_refuses_what_is_not_a_byte_count(num: Any) -> None:
    with pytest.raises(ValueError, match=r"format_bytes\(num\): num must be a finite number of bytes"):
        format_bytes(num)


def test_format_bytes_on_byte_counts() -> None:
    for n in (0, 5, 1023, 1536, 153_601_234_567, np.int64(3 * GiB)):
        k = min(int(math.log(max(int(n), 1), 1024)), 5)
        plain = f"{int(n) / 1024**k:.{0 if k == 0 else 2}f} {['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'][k]}"
        assert format_bytes(n) == plain
    assert format_bytes(1.5 * GiB + 1, round_up=True) == "1.51 GiB"
    with pytest.raises(ValueError, match=r"format_bytes\(round_up\)"):
        format_bytes(10, round_up=None)  # type: ignore[arg-type]


# ------------------------------------------- no plan at both budgets at once
def _least_by_brute_force(tables: List[TableSpec], W: int, L: int, H: int, D: int) -> Tuple[int, int]:
    """(least DDR per machine of a plan within HBM H per rank, least HBM per rank of a plan within
    DDR D per machine) over every combination of (mode, x) options, from the storage formulas."""
    opts = []
    for t in tables:
        rows = max_local_rows(t.rows, W)
        cand = [(m, x) for x in DEFAULT_LOAD_FACTORS for m in (Mode.HYBRID, Mode.CACHING)]
        opts.append(
            [
                (
                    shard_storage(rows, t.dim, t.dtype, t.optimizer, m, x).fast_bytes,
                    machine_storage(t.rows, W, L, t.dim, t.dtype, t.optimizer, m, x).slow_bytes,
                )
                for m, x in cand
            ]
        )
    least_d = least_h = math.inf
    for combo in itertools.product(*opts):
        h, d = sum(c[0] for c in combo), sum(c[1] for c in combo)
        if h <= H:
            least_d = min(least_d, d)
        if d <= D:
            least_h = min(least_h, h)
    return int(least_d), int(least_h)


def test_no_plan_at_both_budgets_quotes_the_least_raise_of_each() -> None:
    # Each budget alone can be met, not both. Each line quotes the least budget that plans
    # with the other kept (not the DDR of the lowest-HBM plan, 131.84 MiB here, which the
    # HBM budget does not force): 1 byte less per rank does not plan.
    tables = [TableSpec(name=n, rows=100_000, dim=64, optimizer="adam") for n in ("a", "b")]
    W = L = 2

    def plan(hbm: int, ddr_per_rank: int) -> None:
        PlacementPlanner(_topo(W, L, hbm, ddr_per_rank), backend="native").plan(tables)

    for hbm0, ddr0 in ((40 * MiB, 40 * MiB), (60 * MiB, MiB // 2)):
        with pytest.raises(PlacementPlannerError) as e:
            plan(hbm0, ddr0)
        msg = str(e.value)
        assert e.value.planner_error_type is PlacementErrorType.INSUFFICIENT_STORAGE, msg
        ddr_line = re.search(r"^  1\) raise DDR per machine to at least .*$", msg, re.M).group(0)
        hbm_line = re.search(r"^  2\) raise HBM per device \(hbm_cap\) to at least .*$", msg, re.M).group(0)
        ddr_cap = int(re.search(r"\(\d+ B; ddr_cap (\d+) B per rank\)", ddr_line).group(1))
        hbm_cap = int(re.search(r"hbm_cap\) to at least \d+\.\d\d [KMG]iB \((\d+) B\)", hbm_line).group(1))
        # follow each line alone: it plans, and one byte less per rank does not
        plan(hbm0, ddr_cap)
        with pytest.raises(PlacementPlannerError):
            plan(hbm0, ddr_cap - 1)
        plan(hbm_cap, ddr0)
        with pytest.raises(PlacementPlannerError):
            plan(hbm_cap - 1, ddr0)
        # the needs quoted are the least over every combination of options (storage formulas)
        H, D = int(hbm0 * (1 - 0.15)), ddr0 * L
        least_d, least_h = _least_by_brute_force(tables, W, L, H, D)
        assert f"the planner finds a plan from {format_bytes(least_d, round_up=True)} ({least_d} B) of DDR" in ddr_line
        assert f"the planner finds a plan from {format_bytes(least_h, round_up=True)} ({least_h} B) of HBM" in hbm_line


# ------------------------------------------------- the label of an all-HBM table
def test_a_table_pinned_to_caching_at_x_one_is_not_labelled_caching() -> None:
    # torchrec's CACHING is FUSED_UVM_CACHING, an fbgemm MANAGED_CACHING table: a cache over a
    # full UVM (DDR) copy, at cache_load_factor 1.0 too. At x = 1 a tiered table builds one
    # DEVICE table and no DDR copy (fbgemm's layout of the runtime), so the plan must not call
    # it CACHING; an x < 1 CACHING placement does build the MANAGED_CACHING table.
    managed_caching = compute_kernel_to_embedding_location(EmbeddingComputeKernel.FUSED_UVM_CACHING)
    assert managed_caching is EmbeddingLocation.MANAGED_CACHING
    t = TableSpec(name="t", rows=100_000, dim=64, optimizer="sgd")
    for pin, roomy in (
        (PlacementConstraints(mode="CACHING"), True),
        (PlacementConstraints(mode="CACHING", cache_load_factor=1.0), True),
        (PlacementConstraints(mode="CACHING", cache_load_factor=0.5), True),
        (PlacementConstraints(mode="CACHING"), False),
    ):
        hbm = 80 * GiB if roomy else 8 * MiB
        row_wise = PlacementConstraints(
            sharding_type="row_wise", mode=pin.mode, cache_load_factor=pin.cache_load_factor
        )
        plan = PlacementPlanner(_topo(2, 2, hbm, GiB), constraints={"t": row_wise}).plan([t])
        p = plan.placement("t")
        built = plan_fbgemm_tier(
            num_rows=max_local_rows(t.rows, 2),
            embedding_dim=t.dim,
            mode=p.mode,
            cache_load_factor=p.cache_load_factor,
            cache_policy=plan.cache_policy,
            optimizer=TieredOptimizerConfig(),
        )
        locations = {EmbeddingLocation[table.location] for table in built.tables}
        assert (p.mode is Mode.CACHING) == (managed_caching in locations), (pin, p, locations)
        assert (p.cache_load_factor == 1.0) == (locations == {EmbeddingLocation.DEVICE}) == (p.ddr_bytes_per_rank == 0)
        assert plan.placement_params("t").mode is p.mode and plan.to_dict()["placements"][0]["mode"] == p.mode.value
        if p.cache_load_factor == 1.0:
            assert "| HBM " in plan.report()


# --------------------------------------------------- one rounding per message
_FIGURE = re.compile(r"(\d+\.\d\d) ([KMGTP]iB) \((\d+) B[;)]")


def _figures(msg: str) -> List[Tuple[str, int]]:
    return [(f"{v} {u}", int(n)) for v, u, n in _FIGURE.findall(msg)]


def _rounded_up(n: int) -> str:
    k = min(int(math.log(n, 1024)), 5)
    return f"{math.ceil(n / 1024**k * 100) / 100:.2f} {['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'][k]}"


def _errors() -> List[str]:
    """One planner error of each kind where a capacity equals a need (no reservation, one rank
    per machine), so the same byte count is quoted twice in one message."""
    out = []
    many = [TableSpec(name=f"x{i}", rows=10**6, dim=64, optimizer="sgd") for i in range(8)]
    one = [TableSpec(name="t", rows=4 * 10**6, dim=64, optimizer="adam")]
    pair = [TableSpec(name=n, rows=100_000, dim=64, optimizer="adam") for n in ("a", "b")]
    for tables, hbm, ddr in (
        (many, 150 * MiB + 12345, 64 * GiB),  # INSUFFICIENT_HBM
        (many, 150 * MiB + 12345, 1000 * MiB + 7),  # INSUFFICIENT_HBM and DDR
        (one, MiB, MiB),  # TABLE_DOES_NOT_FIT
        (pair, 20 * MiB + 5, 20 * MiB + 3),  # TABLE_DOES_NOT_FIT, with "for all 2 tables"
        (pair, 40 * MiB, 40 * MiB),
    ):  # INSUFFICIENT_STORAGE
        with pytest.raises(PlacementPlannerError) as e:
            PlacementPlanner(_topo(1, 1, hbm, ddr), backend="native", hbm_reservation=0.0).plan(tables)
        out.append(str(e.value))
    return out


def test_one_byte_count_reads_the_same_everywhere_in_a_message() -> None:
    # A byte count is rounded one way wherever it is quoted (never "raise hbm_cap to at least
    # 28.62 MiB (30000000 B): ... needs at least 28.61 MiB (30000000 B)").
    repeated = 0
    for msg in _errors():
        figures = _figures(msg)
        assert figures, msg
        for shown, n in figures:
            assert {s for s, m in figures if m == n} == {shown}, (n, msg)  # one count, one reading
        for shown, n in figures:
            assert shown == _rounded_up(n), (shown, n, msg)  # and it never reads smaller than it is
        counts = [n for _, n in figures]
        repeated += len(counts) - len(set(counts))
    assert repeated >= 3  # the messages do quote one count several times (capacity = need)


# ------------------------------------------------------------------------ CLI
def test_cli_can_follow_the_advice_to_add_smaller_load_factors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The planner advises smaller load factors than 0.1: the CLI has a flag to give them,
    # and its errors name the flags.
    from recpipe.pipeline.placement import fbgemm_shard_storage
    from recpipe.planner.__main__ import main as cli_main

    y = tmp_path / "big.yaml"
    y.write_text("- {name: big, rows: 100000000, dim: 8, optimizer: adam}\n")
    base = ["--tables", str(y), "--world-size", "2", "--hbm", "500MiB", "--ddr", "100GiB"]
    assert cli_main(base) == 2
    err = capsys.readouterr().err
    assert "add smaller load factors than 0.1 to load_factors" in err, err
    assert "load_factors = --load-factors" in err and "hbm_cap = --hbm" in err, err
    assert cli_main([*base, "--load-factors", "0.05", "0.1", "1", "--json", str(tmp_path / "p.json")]) == 0
    p = PlacementPlan.load(tmp_path / "p.json").placement("big")
    assert (p.mode, p.cache_load_factor) == (Mode.HYBRID, 0.05)
    # the bytes of fbgemm's tables for that placement, within --hbm x (1 - 0.15)
    ref = fbgemm_shard_storage(max_local_rows(10**8, 2), 8, torch.float32, "adam", Mode.HYBRID, 0.05, "lfu")
    assert p.hbm_bytes_per_rank == ref.fast_bytes <= int(500 * MiB * 0.85)
    for bad in (["0"], ["1.5"], ["nan"]):
        with pytest.raises(SystemExit) as exc:
            cli_main([*base, "--load-factors", *bad])
        assert exc.value.code == 2 and "--load-factors must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("x, shown", [(0.045, "0.045"), (0.125, "0.125"), (0.3, "0.30"), (0.5, "0.50")])
def test_report_shows_the_load_factor_planned(x: float, shown: str) -> None:
    # x is printed with every decimal it has past 2: a pinned 0.045 reads 0.045, not 0.04.
    t = TableSpec(name="t", rows=100_000, dim=8, optimizer="sgd")
    pin = PlacementConstraints(sharding_type="row_wise", mode="HYBRID", cache_load_factor=x)
    plan = PlacementPlanner(_topo(2, 2, GiB, GiB), constraints={"t": pin}).plan([t])
    assert plan.placement("t").cache_load_factor == x
    row = next(line for line in plan.report().splitlines() if line.startswith("t "))
    assert [c.strip() for c in row.split("|")][1:5] == ["row_wise", "all", "HYBRID", shown], row


# ------------------------------------------------------------------ cost models
def _plain_cost(t: TableSpec, mode: str, x: float, empirical: bool) -> float:
    """The bandwidth mix of torchrec's constants, in plain math: values at the fast-tier hit rate
    (HYBRID x; CACHING the Zipf mass of the floor(x N) hottest rows; the empirical fit's x_eff),
    Adam's state with its row (recpipe's own layout)."""
    from torchrec.distributed.planner.constants import HBM_MEM_BW, HBM_TO_DDR_MEM_BW

    if empirical:
        hit = (0.28 if mode == "CACHING" else 0.11) + 0.01 * x
    elif mode == "HYBRID":
        hit = x
    else:
        k = math.floor(x * t.rows + 1e-9)
        hit = math.fsum(i**-t.zipf_alpha for i in range(1, k + 1)) / math.fsum(
            i**-t.zipf_alpha for i in range(1, t.rows + 1)
        )
    bw = hit * HBM_MEM_BW + (1 - hit) * HBM_TO_DDR_MEM_BW
    return t.lookups_per_step * (t.dim * 4 + 2 * t.dim * 4) / bw


@pytest.mark.parametrize("name", ["HYBRID", "hybrid", "CACHING", "caching"])
@pytest.mark.parametrize("model", ["analytic", "empirical"])
def test_cost_models_price_a_mode_given_by_name_as_that_mode(name: str, model: str) -> None:
    # A mode given by name is priced as that mode (not compared by identity, which would
    # price "HYBRID" as CACHING in the analytic model and "CACHING" as HYBRID in the empirical one).
    from recpipe.planner import AnalyticCostModel, EmpiricalCostModel

    t = TableSpec(name="t", rows=1000, dim=4, optimizer="adam", lookups_per_step=512)
    cm = AnalyticCostModel() if model == "analytic" else EmpiricalCostModel()
    got = cm.costs(t, [(name, 0.3)])
    assert got[0] == pytest.approx(_plain_cost(t, name.upper(), 0.3, model == "empirical"), rel=1e-9)
    assert cm.costs(t, [(Mode.parse(name), 0.3)])[0] == got[0]


@pytest.mark.parametrize(
    "options, match",
    [
        ([(Mode.CACHING, 1.5)], r"options\[0\] x must be in \(0, 1\], got 1\.5"),  # before: priced as x = 1
        ([(Mode.HYBRID, 0.5), (Mode.CACHING, True)], r"options\[1\] x must be in \(0, 1\], got True"),
        ([("LRU", 0.5)], r"options\[0\] mode must be one of \['HYBRID', 'CACHING'\], got 'LRU'"),
        ([(Mode.HYBRID,)], r"options\[0\] must be a \(mode, x\) pair"),
        ("CACHING", r"options must be a list of \(mode, x\) pairs"),
    ],
)
def test_cost_models_refuse_bad_options(options: Any, match: str) -> None:
    from recpipe.planner import AnalyticCostModel, EmpiricalCostModel

    t = TableSpec(name="t", rows=1000, dim=4)
    for cm in (AnalyticCostModel(), AnalyticCostModel(backend="fbgemm"), EmpiricalCostModel()):
        with pytest.raises(ValueError, match=match):
            cm.costs(t, options)
        with pytest.raises(ValueError, match=r"table must be a TableSpec, got NoneType"):
            cm.costs(None, [(Mode.HYBRID, 0.5)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bins=5), r"bins must be a pair of positive ints .*got int 5"),  # before: TypeError (no len())
        (dict(bins=(True, 4)), r"bins must be a pair of positive ints"),  # before: one HBM bin
        (dict(bins="ab"), r"bins must be a pair of positive ints .*got str"),
        (dict(repair="no"), r"repair must be True or False, got str 'no'"),  # before: truthy, repaired
    ],
)
def test_dp_proposer_names_bad_arguments(kwargs: Dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KnapsackProposer(**kwargs)
    if "bins" in kwargs:  # the planner's own bins= builds that proposer
        with pytest.raises(ValueError, match=match):
            PlacementPlanner(_topo(2, 2, GiB, GiB), **kwargs)


@pytest.mark.parametrize(
    "tables, match",
    [
        (None, r"tables must be a list of TableSpec, got NoneType"),  # before: TypeError
        (
            [TableSpec(name="t", rows=10, dim=4), None],
            r"tables\[1\] must be a TableSpec, got NoneType",
        ),  # AttributeError
        ([{"name": "t", "rows": 10, "dim": 4}], r"tables\[0\] must be a TableSpec, got dict"),
    ],
)
def test_enumerator_names_bad_tables(tables: Any, match: str) -> None:
    from recpipe.planner import AnalyticCostModel, GridPlacementEnumerator

    enum = GridPlacementEnumerator(2, 2, AnalyticCostModel())
    for call in (enum.enumerate, enum.enumerate_arrays):
        with pytest.raises(ValueError, match=match):
            call(tables)


# ------------------------------------------------------- budgets past 2^53 bytes
@pytest.mark.parametrize("hbm, ddr", [(2**70, 2**70), (2**54, 2**40), (40 * MiB, 2**64), (40 * MiB, 2**53 + 1)])
def test_budgets_past_the_kernels_exact_range_plan_as_unbounded(hbm: int, ddr: int) -> None:
    # A budget of 2^53 bytes or more (past the DP kernel's range, or past int64, e.g. the CLI's
    # --hbm 99999999TiB) binds no plan: the plan is the exact optimum (brute force over every
    # combination).
    tables = [TableSpec(name=n, rows=100_000, dim=64, optimizer="adam") for n in ("a", "b", "c")]
    planner = PlacementPlanner(
        make_topology(world_size=2, local_world_size=2, hbm_cap=hbm, ddr_cap=ddr),
        backend="native",
        sharding_types=("row_wise",),
    )
    plan = planner.plan(tables)
    opts = planner.enumerator.enumerate_arrays(tables)
    best = BruteForceProposer().solve(
        opts.hbm_bytes_per_rank, opts.ddr_bytes_per_machine, opts.cost, planner.hbm_budget, planner.ddr_budget
    )
    assert plan.total_cost == pytest.approx(float(opts.cost[np.arange(3), best].sum()), rel=1e-12)
    assert plan.hbm_bytes_per_rank <= planner.hbm_budget and plan.ddr_bytes_per_machine <= planner.ddr_budget
    if hbm >= 2**53:  # HBM for everything: every table all in HBM (the cheapest option of each)
        rows = max_local_rows(100_000, 2)
        assert all(p.cache_load_factor == 1.0 for p in plan.placements)
        assert (
            plan.hbm_bytes_per_rank == 3 * shard_storage(rows, 64, torch.float32, "adam", Mode.HYBRID, 1.0).fast_bytes
        )


def test_cli_takes_a_huge_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from recpipe.planner.__main__ import main as cli_main

    y = tmp_path / "t.yaml"
    y.write_text("- {name: t, rows: 1000, dim: 8}\n")
    assert cli_main(["--tables", str(y), "--world-size", "2", "--hbm", "99999999TiB", "--ddr", "8PiB"]) == 0
    # unbounded: the whole table on one rank (table-wise FUSED) moves the fewest bytes
    assert "modes: 0 HYBRID, 0 CACHING, 0 all-HBM, 1 table-wise FUSED" in capsys.readouterr().out
