"""Recipe settings that were ignored or refused unclearly: ``--sharding-types`` (any order and subset,
refused where the placement ignores it), a ``--fast-tier-mb`` / ``--slow-tier-mb`` no plan fits (a
config error naming the flag and the least budget that plans), and a resume that changes either
(the resume line names the change)."""

from __future__ import annotations

import contextlib
import io
import itertools
import re
from pathlib import Path

import pytest
import torch
from harness.recipe_configs import SMALL_SYNTHETIC
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from recpipe.planner import PlacementPlannerError
from recpipe.planner.communication import PLANNED_SHARDING_TYPES
from recpipe.recipes.build import TierPlanner
from recpipe.recipes.cli import parse_config
from recpipe.recipes.config import SHARDING_TYPES, ConfigError, TrainConfig
from recpipe.recipes.data.registry import make_data_source
from recpipe.recipes.models import EBC_PATH, build_model
from recpipe.recipes.train import run

ALL_TYPES = "table_wise,row_wise,column_wise"
SUBSETS = [s for n in range(1, 4) for s in itertools.combinations(("table_wise", "row_wise", "column_wise"), n)]


# ---------------------------------------------------------------- --sharding-types
def test_the_recipes_sharding_types_are_the_planners() -> None:
    assert SHARDING_TYPES == tuple(PLANNED_SHARDING_TYPES)


@pytest.mark.parametrize("subset", SUBSETS, ids=",".join)
def test_any_order_of_any_subset_is_accepted_and_stored_in_the_planners_order(subset: tuple[str, ...]) -> None:
    expected = ",".join(t for t in ("table_wise", "row_wise", "column_wise") if t in subset)
    for order in itertools.permutations(subset):
        value = ",".join(order)
        assert TrainConfig(sharding_types=value).sharding_types == expected, value
        assert parse_config(["--sharding-types", value]).sharding_types == expected, value


def test_repeats_spaces_and_a_yaml_list_are_accepted(tmp_path: Path) -> None:
    assert TrainConfig(sharding_types="row_wise, table_wise,row_wise").sharding_types == "table_wise,row_wise"
    assert TrainConfig(sharding_types="row_wise,").sharding_types == "row_wise"
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("sharding_types: [column_wise, row_wise]\n")
    assert parse_config(["--config", str(yaml_file)]).sharding_types == "row_wise,column_wise"


@pytest.mark.parametrize(
    "value, why",
    [
        ("data_parallel", "unknown sharding type(s) 'data_parallel'"),
        ("row_wise,tablewise,grid", "unknown sharding type(s) 'tablewise', 'grid'"),
        ("", "must name at least one sharding type"),
        (" , ", "must name at least one sharding type"),
        (["row_wise", 3], "must name at least one sharding type"),
    ],
)
def test_unknown_or_no_sharding_types_are_refused_naming_the_valid_ones(value: object, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        TrainConfig(sharding_types=value)  # type: ignore[arg-type]
    message = str(e.value)
    assert message.startswith(f"invalid config value sharding_types={value!r}: {why}"), message
    assert "Fix: pass " in message and "subset of table_wise, row_wise, column_wise in any order" in message


@pytest.mark.parametrize("placement", ["table_wise", "torchrec_planner"])
@pytest.mark.parametrize("value", ["row_wise", "table_wise", "row_wise,table_wise"])
def test_sharding_types_under_a_placement_that_ignores_them_are_refused_naming_both_flags(
    placement: str, value: str
) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(["--placement", placement, "--sharding-types", value])
    message = str(e.value)
    assert message.startswith(f"invalid config value sharding_types={value!r}: "), message
    assert f"--sharding-types restricts the planner of --placement planned, but --placement is {placement}" in message
    assert message.endswith("Fix: pass --placement planned to plan with these sharding types, or drop --sharding-types")


@pytest.mark.parametrize("placement", ["table_wise", "torchrec_planner"])
def test_all_sharding_types_in_any_order_go_with_every_placement(placement: str) -> None:
    # the default value (or all three types, as a config file may spell them) restricts nothing
    for value in (ALL_TYPES, "column_wise,row_wise,table_wise"):
        assert TrainConfig(placement=placement, sharding_types=value).sharding_types == ALL_TYPES


# ---------------------------------------------------------------- tier budgets no plan fits
def _tier_planner(config: TrainConfig) -> TierPlanner:
    """The planner of ``config``'s model on one rank, sized for its fused optimizer as the recipe's is."""
    torch.manual_seed(config.seed)
    model = build_model(config, make_data_source(config, 0, 1).spec, torch.device("cpu"))
    apply_optimizer_in_backward(RowWiseAdagrad, model.get_submodule(EBC_PATH).parameters(), {"lr": 0.1})
    return TierPlanner(config, model, world=1, local_world=1, device=torch.device("cpu"))


def _plans(planner: TierPlanner, fast_mb: float, slow_mb: float) -> bool:
    """Whether the planner plans with the flags' values (converted as the recipe converts them)."""

    try:
        planner.plan(int(fast_mb * 2**20), int(slow_mb * 2**20))
    except PlacementPlannerError:
        return False
    return True


def _suggested(message: str, flag: str) -> float:
    (value,) = re.findall(rf"pass {flag} ([\d.]+) or more", message)
    return float(value)


def test_a_fast_tier_too_small_is_a_config_error_naming_the_least_that_plans() -> None:
    config = TrainConfig(**SMALL_SYNTHETIC, max_steps=2, fast_tier_mb=0.001)
    with pytest.raises(ConfigError) as e:
        run(config)
    message = str(e.value)
    assert message.startswith(
        "invalid config value fast_tier_mb=0.001: the placement planner finds no plan of the model's 26 tables "
        "within --fast-tier-mb 0.001 MiB per rank and --slow-tier-mb 16384 MiB per machine"
    ), message
    assert "hbm_cap" not in message and "hbm_reservation" not in message and "\n" not in message
    least = _suggested(message, "--fast-tier-mb")
    planner = _tier_planner(config)
    # the slow tier is ample: the least fast tier is where the tables' smallest fast-tier parts
    # fit, and 0.001 MiB less does not plan
    assert _plans(planner, least, 16384.0) and not _plans(planner, least - 0.001, 16384.0), least
    # the value suggested trains
    assert run(TrainConfig(**SMALL_SYNTHETIC, max_steps=1, fast_tier_mb=least)).steps == 1


def test_both_tiers_too_small_name_each_flag_with_the_least_budget_that_plans() -> None:
    config = TrainConfig(**SMALL_SYNTHETIC, max_steps=2, fast_tier_mb=0.2, slow_tier_mb=0.05)
    with pytest.raises(ConfigError) as e:
        run(config)
    message = str(e.value)
    assert message.startswith("invalid config value fast_tier_mb=0.2: the placement planner finds no plan"), message
    fast, slow = _suggested(message, "--fast-tier-mb"), _suggested(message, "--slow-tier-mb")
    assert (
        f"pass --fast-tier-mb {fast:g} or more (the least budget the planner names that plans, --slow-tier-mb 0.05 kept)"
        in message
    )
    assert (
        f"pass --slow-tier-mb {slow:g} or more (the least budget the planner names that plans, --fast-tier-mb 0.2 kept)"
        in message
    )
    # each is the least that plans with the other tier kept, to the 0.001 MiB the message shows
    planner = _tier_planner(config)
    assert _plans(planner, fast, 0.05) and not _plans(planner, fast - 0.001, 0.05), fast
    assert _plans(planner, 0.2, slow) and not _plans(planner, 0.2, slow - 0.001), slow


def test_a_slow_tier_too_small_under_the_default_fast_tier_names_the_slow_tier() -> None:
    with pytest.raises(ConfigError) as e:
        run(TrainConfig(**SMALL_SYNTHETIC, max_steps=2, slow_tier_mb=0.001))
    message = str(e.value)
    assert message.startswith("invalid config value slow_tier_mb=0.001: "), message
    assert "within --fast-tier-mb 0 (half the tables' per-rank bytes: " in message
    slow = _suggested(message, "--slow-tier-mb")
    # the recipe, its fast tier left to the default, trains with the value named, not 0.001 MiB below it
    assert run(TrainConfig(**SMALL_SYNTHETIC, max_steps=1, slow_tier_mb=slow)).steps == 1
    with pytest.raises(ConfigError, match=f"invalid config value slow_tier_mb={slow - 0.001!r}: "):
        run(TrainConfig(**SMALL_SYNTHETIC, max_steps=1, slow_tier_mb=slow - 0.001))


# ---------------------------------------------------------------- resume line
def test_the_resume_line_names_changed_sharding_types_and_fast_tier(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run(TrainConfig(**SMALL_SYNTHETIC, max_steps=2, checkpoint_dir=str(root), checkpoint_every=2))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run(
            TrainConfig(
                **SMALL_SYNTHETIC,
                max_steps=4,
                checkpoint_dir=str(root),
                resume=True,
                sharding_types="row_wise,table_wise",
                fast_tier_mb=1.5,
            )
        )
    expected = (
        f"[recpipe] resumed from {root / 'step_00000002'}; changed since it was saved: sharding_types "
        f"{ALL_TYPES!r} -> 'table_wise,row_wise', fast_tier_mb 0.0 -> 1.5 (training continues with the new "
        "values, so losses differ from an uninterrupted run's)"
    )
    assert expected in out.getvalue().splitlines(), out.getvalue()
    assert result.start_step == 2 and len(result.losses) == 2
