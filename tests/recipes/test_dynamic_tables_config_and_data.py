"""``--dynamic-tables`` on the data side: the flag and the settings it contradicts, Criteo's and MovieLens'
raw keys reaching the tables unchanged (the static path keeps its modulo), the resume fingerprint, and the
dynamic tables' key-index counters in TensorBoard.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from harness.criteo_files import CRITEO, write_criteo
from harness.recipe_configs import scalars
from torch import nn

from recpipe.recipes.checkpoint_policy import fingerprint
from recpipe.recipes.cli import build_arg_parser, parse_config
from recpipe.recipes.config import ConfigError, TrainConfig
from recpipe.recipes.data.movielens import ML100K_ITEMS, ML100K_USERS, load_movielens100k
from recpipe.recipes.data.registry import make_data_source
from recpipe.recipes.tb_logging import DYNAMIC_COUNTERS, RunLogger, collect_tier_stats

DLRM = ["--model", "dlrm"]


def test_dynamic_tables_flag_defaults_off_and_is_documented() -> None:
    assert TrainConfig().dynamic_tables is False
    assert parse_config(DLRM).dynamic_tables is False
    assert parse_config(DLRM + ["--dynamic-tables"]).dynamic_tables is True
    assert parse_config(DLRM + ["--dynamic-tables", "--no-dynamic-tables"]).dynamic_tables is False
    help_text = " ".join(build_arg_parser().format_help().split())
    assert "--dynamic-tables, --no-dynamic-tables Dynamic embedding tables: every table takes" in help_text
    with pytest.raises(ConfigError, match="dynamic_tables='yes': must be true or false"):
        TrainConfig(model="dlrm", dynamic_tables="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            DLRM + ["--placement", "table_wise"],
            r"dynamic_tables=True: it contradicts placement='table_wise', where torchrec's own sharder places torch",
        ),
        (
            ["--placement", "torchrec_planner"],
            r"dynamic_tables=True: it contradicts placement='torchrec_planner', where torchrec's EmbeddingShardingPl",
        ),
        (
            DLRM + ["--sharding-types", "column_wise"],
            r"dynamic_tables=True: it contradicts sharding_types='column_wise': column-wise shards are torchrec's",
        ),
    ],
)
def test_settings_that_build_no_dynamic_table_are_refused_naming_both(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as caught:
        parse_config(argv + ["--dynamic-tables"])
    assert "Fix: " in str(caught.value) and "drop --dynamic-tables" in str(caught.value)
    parse_config(argv)  # each setting is valid without the flag


@pytest.mark.parametrize("sharding_types", ["table_wise", "row_wise", "row_wise,column_wise"])
def test_a_table_wise_or_row_wise_sharding_type_allows_dynamic_tables(sharding_types: str) -> None:
    config = parse_config(DLRM + ["--sharding-types", sharding_types, "--dynamic-tables"])
    assert config.dynamic_tables and config.sharding_types == sharding_types


@pytest.mark.parametrize("argv", [[], ["--config", "default"]], ids=["defaults", "default_recipe"])
def test_the_default_model_takes_dynamic_tables(argv: list[str]) -> None:
    config = parse_config(argv + ["--dynamic-tables"])
    assert config.model == "micro_dlrm_dram" and config.placement == "planned" and config.dynamic_tables


def test_resume_fingerprint_tells_dynamic_from_static_tables() -> None:
    static, dynamic = TrainConfig(model="dlrm"), TrainConfig(model="dlrm", dynamic_tables=True)
    assert fingerprint(static)["dynamic_tables"] is False and fingerprint(dynamic)["dynamic_tables"] is True
    assert {k: v for k, v in fingerprint(static).items() if k != "dynamic_tables"} == {
        k: v for k, v in fingerprint(dynamic).items() if k != "dynamic_tables"
    }


def _hex_columns(path: Path) -> list[list[int]]:
    """Per row, the 26 categorical columns of a Criteo TSV parsed as hex (an empty cell is 0)."""
    with open(path, newline="") as f:
        return [[int(v, 16) if v else 0 for v in row[14:]] for row in csv.reader(f, delimiter="\t")]


@pytest.mark.parametrize("dynamic", [False, True])
def test_criteo_tables_take_the_hex_values_raw_or_modulo_num_embeddings(tmp_path: Path, dynamic: bool) -> None:
    path = tmp_path / "day.tsv"
    write_criteo(path, 64)
    cats = _hex_columns(path)
    assert max(map(max, cats)) > 2**31  # ids past int32 reach the tables whole
    config = TrainConfig(**{**CRITEO, "data_path": str(path), "dynamic_tables": dynamic})
    src = make_data_source(config, 1, 2)  # rank 1 of 2: rows 16-31 of global step 0, rows 48-63 of step 1
    for step, batch in enumerate(src.train_batches(0, 2)):
        first = step * 32 + 16
        expected = torch.tensor([row for row in cats[first : first + 16]]).t()  # (26, 16)
        if not dynamic:
            expected = expected % CRITEO["num_embeddings"]
        assert torch.equal(batch.sparse_features.values().reshape(26, 16), expected)


def test_movielens_tables_take_the_raw_user_and_item_ids() -> None:
    data = load_movielens100k()
    static = make_data_source(TrainConfig(model="dlrm", batch_size=64), 0, 1)
    dynamic = make_data_source(TrainConfig(model="dlrm", batch_size=64, dynamic_tables=True), 0, 1)
    rows = static._epoch_perm(0)[64:128]  # step 1's ratings
    for src in (static, dynamic):
        kjt = next(src.train_batches(1, 2)).sparse_features
        assert torch.equal(kjt["user_id"].values(), data["user"][rows])
        assert torch.equal(kjt["item_id"].values(), data["item"][rows])
    assert int(data["user"].max()) == ML100K_USERS and int(data["item"].max()) == ML100K_ITEMS


class _FakeShards(nn.Module):
    """A sharded table module reporting fixed tier stats."""

    def __init__(self, stats: dict[str, dict[str, float]]) -> None:
        super().__init__()
        self._stats = stats

    def tier_stats(self) -> dict[str, dict[str, float]]:
        return self._stats


def test_dynamic_counters_are_logged_per_table_under_dynamic(tmp_path: Path) -> None:
    counters = {"occupancy": 40.0, "inserted": 55.0, "evicted": 15.0, "not_admitted": 7.0, "failed": 1.0}
    model = nn.Sequential(
        _FakeShards({"t_dyn": {"hit_rate": 0.5, "lookups": 10.0, **counters}, "t_static": {"hit_rate": 1.0}}),
        _FakeShards({"t_dyn": {"hit_rate": 1.0, "lookups": 30.0, **counters}}),  # another shard of t_dyn
    )
    log = RunLogger(str(tmp_path))
    log.tier_stats(3, collect_tier_stats(model))
    log.close()
    events = scalars(tmp_path)
    assert set(DYNAMIC_COUNTERS) == set(counters)
    dynamic_tags = {f"dynamic/t_dyn/{name}" for name in counters}
    assert set(events) == dynamic_tags | {"tier/t_dyn/hit_rate", "tier/t_dyn/lookups", "tier/t_static/hit_rate"}
    for name, value in counters.items():  # counts of the two shards, summed
        assert events[f"dynamic/t_dyn/{name}"] == [(3, 2 * value)]
    assert events["tier/t_dyn/hit_rate"] == [(3, pytest.approx(35 / 40))]
