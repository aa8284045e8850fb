"""Unit tests of recpipe.recipes: config, hashing, data sources, placement, logging, components."""

from __future__ import annotations

import csv
import math
import random
import re
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from recpipe.recipes import components
from recpipe.recipes.build import greedy_table_wise
from recpipe.recipes.checkpoint_policy import fingerprint
from recpipe.recipes.cli import parse_config
from recpipe.recipes.config import ConfigError, TrainConfig
from recpipe.recipes.data.base import DatasetSpec, IdTransform, table_rows
from recpipe.recipes.data.criteo import CriteoFormatError, count_rows, parse_criteo_row
from recpipe.recipes.data.hashing import fmix32, fmix32_int, hash_ids, mix_seed
from recpipe.recipes.data.movielens import movielens100k_path
from recpipe.recipes.data.registry import make_data_source
from recpipe.recipes.data.synthetic import sample_zipf
from recpipe.recipes.tb_logging import RunLogger, TierStatsProvider, collect_tier_stats, merge_tier_stats
from recpipe.recipes.train import run


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"pipeline": "fast"}, "pipeline"),
        ({"model": "dlrm2"}, "model"),
        ({"dense_arch": (64, 32)}, "dense_arch"),
        ({"over_arch": (64, 2)}, "over_arch"),
        ({"dataset": "synthetic"}, "max_steps"),
        ({"dataset": "criteo_tsv"}, "data_path"),
        ({"resume": True}, "checkpoint_dir"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
    ],
)
def test_bad_config_names_field_and_fix(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field) as e:
        TrainConfig(**kwargs)
    assert "Fix:" in str(e.value)


def test_cli_overrides_yaml(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("batch_size: 64\nmodel: dlrm\ndense_arch: [32, 16]\nembedding_dim: 16\n")
    cfg = parse_config(["--config", str(cfg_file), "--batch-size", "32", "--no-progress-bar"])
    assert (cfg.batch_size, cfg.model, cfg.dense_arch, cfg.progress_bar) == (32, "dlrm", (32, 16), False)
    packaged = parse_config(["--config", "default"])
    assert (packaged.model, packaged.dataset, packaged.pipeline) == ("micro_dlrm_dram", "movielens100k", "fused")
    (tmp_path / "bad.yaml").write_text("batch_sise: 3\n")
    with pytest.raises(ConfigError, match="batch_sise"):
        parse_config(["--config", str(tmp_path / "bad.yaml")])


# ---------------------------------------------------------------- hashing
def test_fmix32_matches_python_reference() -> None:
    rng = random.Random(0)
    xs = [0, 1, 2**32 - 1] + [rng.randrange(2**32) for _ in range(2000)]
    got = fmix32(torch.tensor(xs, dtype=torch.int64)).tolist()

    # Independent reference: MurmurHash3 fmix32 written out with Python big ints.
    def ref(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) % 2**32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) % 2**32
        return h ^ (h >> 16)

    assert got == [ref(x) for x in xs] == [fmix32_int(x) for x in xs]
    big = torch.tensor([2**40 + 5, 2**62 + 7], dtype=torch.int64)
    h = hash_ids(big, mix_seed(1, 2))
    assert bool(((h >= 0) & (h < 2**32)).all())
    assert h[0] != hash_ids(torch.tensor([5]), mix_seed(1, 2))[0]  # high bits matter


def test_zipf_sampler_matches_pmf() -> None:
    n, alpha, size = 1000, 1.2, 200_000
    ranks = sample_zipf(n, alpha, size, torch.Generator().manual_seed(0))
    assert int(ranks.min()) >= 0 and int(ranks.max()) < n
    counts = torch.bincount(ranks, minlength=n).double() / size

    # The sampler inverts the continuous bounded power law on [1, n + 1]: its mass
    # on [r + 1, r + 2) in closed form is the reference.
    def cdf(x: float) -> float:
        return (x ** (1 - alpha) - 1) / ((n + 1) ** (1 - alpha) - 1)

    for r in (0, 1, 5, 50):
        expected = cdf(r + 2) - cdf(r + 1)
        assert abs(counts[r].item() - expected) < 4 * math.sqrt(expected / size) + 1e-4


# ---------------------------------------------------------------- data
def test_movielens_counts_and_labels_against_file() -> None:
    path = movielens100k_path()
    assert Path(path).parts[-4:-2] == ("recbole", "dataset_example")  # read from the installed wheel
    with open(path) as f:
        rows = list(csv.reader(f, delimiter="\t"))[1:]
    users = {r[0] for r in rows}
    items = {r[1] for r in rows}
    positives = sum(float(r[2]) >= 4 for r in rows)
    assert (len(rows), len(users), len(items)) == (100_000, 943, 1682)
    cfg = TrainConfig(model="dlrm", batch_size=1000, eval_fraction=0.1)
    src = make_data_source(cfg, rank=0, world_size=1)
    assert src.spec.cardinalities == (944, 1683)
    assert src.steps_per_epoch == 90
    seen_pos = 0
    seen_rows = 0
    for b in src.train_batches(0, 90):
        seen_pos += int(b.labels.sum())
        seen_rows += b.labels.numel()
    for b in src.eval_batches():
        pass
    held_out = 100_000 - seen_rows
    # all training rows seen exactly once per epoch; positives split between train and eval
    assert seen_rows == 90_000 and held_out == 10_000
    assert 0 < positives - seen_pos <= 10_000
    assert abs(seen_pos / seen_rows - positives / 100_000) < 0.02


def test_movielens_ranks_partition_the_global_batch() -> None:
    cfg = TrainConfig(model="dlrm", batch_size=64)
    single = make_data_source(TrainConfig(model="dlrm", batch_size=128), 0, 1)
    r0, r1 = (make_data_source(cfg, r, 2) for r in (0, 1))
    for step in (0, 7, 700):  # 700 is in the second epoch
        whole = next(single.train_batches(step, step + 1))
        a, b = next(r0.train_batches(step, step + 1)), next(r1.train_batches(step, step + 1))
        torch.testing.assert_close(torch.cat([a.dense_features, b.dense_features]), whole.dense_features)
        torch.testing.assert_close(torch.cat([a.labels, b.labels]), whole.labels)
        ua = a.sparse_features["user_id"].values()
        ub = b.sparse_features["user_id"].values()
        torch.testing.assert_close(torch.cat([ua, ub]), whole.sparse_features["user_id"].values())


def test_micro_dlrm_dram_projection_is_k_hashed_rows() -> None:
    cfg = TrainConfig(batch_size=32, virtual_rows=1 << 16, hash_k=3)
    src = make_data_source(cfg, 0, 1)
    kjt = next(src.train_batches(0, 1)).sparse_features
    item = kjt["item_id"]
    assert item.lengths().tolist() == [3] * 32
    assert int(item.values().max()) < (1 << 16)
    dlrm = make_data_source(TrainConfig(model="dlrm", batch_size=32), 0, 1)
    raw = next(dlrm.train_batches(0, 1)).sparse_features["item_id"].values()
    expected = torch.stack([hash_ids(raw, mix_seed(cfg.seed, 1, j)) % (1 << 16) for j in range(3)], dim=1).reshape(-1)
    assert torch.equal(item.values(), expected)


@pytest.mark.parametrize(
    "model,dataset",
    [
        ("dlrm", "synthetic"),
        ("dlrm", "movielens100k"),
        ("micro_dlrm_dram", "synthetic"),
        ("micro_dlrm_dram", "movielens100k"),
    ],
)
@pytest.mark.parametrize("field,value", [("hash_k", 7), ("virtual_rows", 1000), ("num_embeddings", 50)])
def test_resume_fingerprint_covers_exactly_the_table_fields_the_model_uses(
    model: str, dataset: str, field: str, value: int
) -> None:
    # Reference: the tables the run builds (rows per feature) and how ids are hashed into
    # them. A field changing neither must not block a resume; one changing either must.
    spec = DatasetSpec(name=dataset, dense_in_features=3, feature_names=("a", "b"), cardinalities=(100, 5000))
    base = TrainConfig(model=model, dataset=dataset, max_steps=4)
    changed = TrainConfig(**{**base.to_dict(), field: value})

    def tables(c: TrainConfig) -> tuple:
        t = IdTransform(c, spec)
        p = t.projector
        return table_rows(c, spec), None if p is None else (p.num_rows, p.k)

    assert (fingerprint(base) == fingerprint(changed)) == (tables(base) == tables(changed)), (model, dataset, field)


def test_synthetic_stream_is_deterministic_and_learnable() -> None:
    cfg = TrainConfig(dataset="synthetic", model="dlrm", max_steps=5, batch_size=4096, num_embeddings=1000)
    a, b = make_data_source(cfg, 0, 2), make_data_source(cfg, 0, 2)
    other_rank = make_data_source(cfg, 1, 2)
    ba, bb = next(a.train_batches(3, 4)), next(b.train_batches(3, 4))
    assert torch.equal(ba.dense_features, bb.dense_features)
    assert torch.equal(ba.sparse_features.values(), bb.sparse_features.values())
    assert not torch.equal(ba.dense_features, next(other_rank.train_batches(3, 4)).dense_features)
    dense, ids, labels = a.raw_batch(0, 3)
    assert dense.shape == (4096, 13) and ids.shape == (26, 4096)
    # labels follow the hidden logistic model: its logits separate them well
    logits = a.hidden_logits(dense, ids)
    pos, neg = logits[labels == 1], logits[labels == 0]
    auc = (pos[:, None] > neg[None, :]).double().mean().item()
    assert auc > 0.75
    # Zipf: the hottest id of feature 0 is far more frequent than uniform
    top = torch.bincount(ids[0]).max().item()
    assert top > 50 * 4096 / cfg.synthetic_id_space


def _write_criteo(path: Path, rows: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    data = []
    for _ in range(rows):
        row = [str(rng.randint(0, 1))]
        row += [str(rng.randint(-2, 1000)) if rng.random() > 0.1 else "" for _ in range(13)]
        row += [("%08x" % rng.randrange(2**32)) if rng.random() > 0.1 else "" for _ in range(26)]
        data.append(row)
    with open(path, "w", newline="") as f:
        csv.writer(f, delimiter="\t").writerows(data)
    return data


def test_criteo_tsv_source_against_independent_parse(tmp_path: Path) -> None:
    path = tmp_path / "day_0.tsv"
    rows = _write_criteo(path, 100, seed=1)
    cfg = TrainConfig(dataset="criteo_tsv", data_path=str(path), model="dlrm", batch_size=10, num_embeddings=997)
    src = make_data_source(cfg, 1, 2)  # rank 1 of 2: second half of each 20-row global batch
    assert src.steps_per_epoch == 5
    batches = list(src.train_batches(0, 7))  # wraps into the second epoch
    assert len(batches) == 7
    for step, batch in enumerate(batches):
        g = step % 5
        mine = rows[g * 20 + 10 : g * 20 + 20]
        assert batch.labels.tolist() == [float(r[0]) for r in mine]
        dense = [[math.log1p(max(int(v), 0)) if v else 0.0 for v in r[1:14]] for r in mine]
        torch.testing.assert_close(batch.dense_features, torch.tensor(dense))
        cat5 = [(int(r[14 + 5], 16) if r[14 + 5] else 0) % 997 for r in mine]
        assert batch.sparse_features["cat_5"].values().tolist() == cat5


def _same_batches(got: list, want: list) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a.labels, b.labels), step
        assert torch.equal(a.dense_features, b.dense_features), step
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values()), step


def test_criteo_max_steps_past_one_pass_wraps_like_epochs(tmp_path: Path) -> None:
    # With max_steps the rows are not counted: the end of the first pass gives the epoch's
    # length, and training wraps to step % steps_per_epoch as a counted (epochs) run does.
    path = tmp_path / "day_0.tsv"
    _write_criteo(path, 107, seed=2)  # 5 global batches of 2 x 10 rows, 7 rows left over
    base = dict(dataset="criteo_tsv", data_path=str(path), model="dlrm", batch_size=10, num_embeddings=997)
    counted = make_data_source(TrainConfig(**base, epochs=3), 1, 2)
    assert counted.steps_per_epoch == 5
    want = list(counted.train_batches(0, 13))
    src = make_data_source(TrainConfig(**base, max_steps=13), 1, 2)
    assert src.steps_per_epoch is None
    # chunks as the train loop asks for them (eval / checkpoint intervals), across two wraps
    chunks = [b for lo, hi in ((0, 3), (3, 8), (8, 13)) for b in src.train_batches(lo, hi)]
    assert src.steps_per_epoch == 5
    _same_batches(chunks, want)
    # a resumed run starting two passes in lands on the uninterrupted run's batches
    resumed = make_data_source(TrainConfig(**base, max_steps=13), 1, 2)
    _same_batches(list(resumed.train_batches(11, 13)), want[11:])


def test_criteo_run_past_one_pass_reaches_its_end(tmp_path: Path) -> None:
    # the QA run died at the end of the first pass, with no final checkpoint or metrics
    path = tmp_path / "day_0.tsv"
    _write_criteo(path, 60, seed=4)  # 3 steps per pass at batch 20
    result = run(
        TrainConfig(
            dataset="criteo_tsv",
            data_path=str(path),
            model="dlrm",
            batch_size=20,
            num_embeddings=97,
            embedding_dim=8,
            dense_arch=(8,),
            over_arch=(8, 1),
            max_steps=7,
            eval_batches=1,
            log_every=7,
            progress_bar=False,
            checkpoint_dir=str(tmp_path / "ckpt"),
            metrics_file=str(tmp_path / "m.json"),
        )
    )
    assert result.steps == 7 and len(result.losses) == 7 and [s for s, _ in result.evals] == [7]
    assert (tmp_path / "ckpt" / "step_00000007").is_dir() and (tmp_path / "m.json").is_file()


@pytest.mark.parametrize("max_steps", [None, 50])
@pytest.mark.parametrize("rows", [0, 19])
def test_criteo_data_smaller_than_a_global_batch_is_refused(tmp_path: Path, rows: int, max_steps: int | None) -> None:
    path = tmp_path / "day_0.tsv"
    _write_criteo(path, rows, seed=3)
    cfg = TrainConfig(dataset="criteo_tsv", data_path=str(path), model="dlrm", batch_size=10, max_steps=max_steps)
    with pytest.raises(ConfigError) as e:
        make_data_source(cfg, 0, 2)
    message = str(e.value)
    assert message.startswith(
        f"invalid config value data_path={str(path)!r}: it holds {rows} rows, fewer than one global batch "
        "(batch_size 10 x 2 rank(s) = 20 rows)"
    ), message
    assert "Fix: lower --batch-size" in message and "--data-path" in message and "--max-steps" not in message


@pytest.mark.parametrize("max_steps", [None, 50])
@pytest.mark.parametrize("rows", [0, 10, 19])
def test_criteo_eval_data_smaller_than_a_global_batch_is_refused(
    tmp_path: Path, rows: int, max_steps: int | None
) -> None:
    # every evaluation of such a file has its rows (not empty: "auroc nan")
    train, small = tmp_path / "train.tsv", tmp_path / "eval.tsv"
    _write_criteo(train, 100, seed=5)
    _write_criteo(small, rows, seed=6)
    base = dict(dataset="criteo_tsv", data_path=str(train), model="dlrm", batch_size=10, max_steps=max_steps)
    with pytest.raises(ConfigError) as e:
        make_data_source(TrainConfig(**base, eval_data_path=str(small)), 1, 2)
    message = str(e.value)
    assert message.startswith(
        f"invalid config value eval_data_path={str(small)!r}: it holds {rows} rows, fewer than one global batch"
    ), message
    assert "Fix: lower --batch-size" in message and message.endswith("or pass more rows in --eval-data-path")
    _write_criteo(small, 20, seed=6)  # exactly one global batch: one eval batch per rank
    assert len(list(make_data_source(TrainConfig(**base, eval_data_path=str(small)), 1, 2).eval_batches())) == 1


def test_count_rows_reads_at_most_the_limit(tmp_path: Path) -> None:
    a = tmp_path / "a.tsv"
    _write_criteo(a, 30, seed=7)
    missing = str(tmp_path / "never_opened.tsv")
    assert count_rows([str(a)]) == 30 and count_rows([str(a), str(a)], limit=45) == 45
    assert count_rows([str(a), missing], limit=30) == 30  # stops before opening the next file
    assert count_rows([str(a)], limit=100) == 30


def test_criteo_malformed_rows_raise() -> None:
    with pytest.raises(CriteoFormatError, match="39 columns"):
        parse_criteo_row(["1"] * 39)
    with pytest.raises(CriteoFormatError, match="malformed"):
        parse_criteo_row(["1"] + ["3"] * 13 + ["zz"] * 26)
    with pytest.raises(CriteoFormatError, match="label"):
        parse_criteo_row(["7"] + ["3"] * 13 + ["a"] * 26)


# ---------------------------------------------------------------- placement
def test_greedy_table_wise_balances_bytes() -> None:
    tables = [("a", 100), ("b", 60), ("c", 50), ("d", 10)]
    owner = greedy_table_wise(tables, 2)
    load = [sum(s for n, s in tables if owner[n] == r) for r in range(2)]
    assert owner["a"] != owner["b"] and sorted(load) == [110, 110]
    assert greedy_table_wise(tables, 2) == owner  # deterministic


# ---------------------------------------------------------------- TensorBoard
class _FakeTieredTable(nn.Module):
    def __init__(self, stats: dict[str, dict[str, float]]) -> None:
        super().__init__()
        self._stats = stats

    def tier_stats(self) -> dict[str, dict[str, float]]:
        return self._stats


def test_merged_tier_ratios_are_fractions_of_all_ranks_lookups() -> None:
    # Two ranks' stats of one table: each ratio is its rank's count / lookups, so the
    # merged ratio is the summed counts over the summed lookups (not a sum, not a plain mean).
    ranks = [
        {"lookups": 10.0, "fast": 10.0, "hits": 4.0, "cumulative_lookups": 100.0, "cumulative_hits": 90.0},
        {"lookups": 30.0, "fast": 15.0, "hits": 30.0, "cumulative_lookups": 50.0, "cumulative_hits": 5.0},
    ]
    parts = [
        {
            "t": {
                "lookups": r["lookups"],
                "fast_fraction": r["fast"] / r["lookups"],
                "hit_rate": r["hits"] / r["lookups"],
                "cumulative_lookups": r["cumulative_lookups"],
                "cumulative_hit_rate": r["cumulative_hits"] / r["cumulative_lookups"],
                "rows_loaded": 3.0,
            }
        }
        for r in ranks
    ]
    merged = merge_tier_stats(parts)["t"]
    assert merged["fast_fraction"] == pytest.approx(25 / 40)
    assert merged["hit_rate"] == pytest.approx(34 / 40)
    assert merged["cumulative_hit_rate"] == pytest.approx(95 / 150)
    assert merged["lookups"] == 40.0 and merged["cumulative_lookups"] == 150.0 and merged["rows_loaded"] == 6.0
    # a ratio without its count is a plain mean; one with 0 lookups everywhere too
    assert merge_tier_stats([{"t": {"x_fraction": 1.0}}, {"t": {"x_fraction": 0.5}}])["t"]["x_fraction"] == 0.75
    idle = [{"t": {"lookups": 0.0, "hit_rate": 0.0}}, {"t": {"lookups": 0.0, "hit_rate": 1.0}}]
    assert merge_tier_stats(idle)["t"]["hit_rate"] == 0.5


def test_tier_stats_hook_logs_fake_provider(tmp_path: Path) -> None:
    model = nn.Sequential(
        nn.Linear(2, 2),
        _FakeTieredTable({"t_a": {"hit_rate": 0.8, "slow_bytes": 100.0}}),
        _FakeTieredTable({"t_a": {"hit_rate": 0.6, "slow_bytes": 50.0}, "t_b": {"hit_rate": 1.0}}),
    )
    assert isinstance(model[1], TierStatsProvider) and not isinstance(model[0], TierStatsProvider)
    stats = collect_tier_stats(model)
    assert stats == {"t_a": {"hit_rate": pytest.approx(0.7), "slow_bytes": 150.0}, "t_b": {"hit_rate": 1.0}}
    assert merge_tier_stats([]) == {}
    log = RunLogger(str(tmp_path))
    log.tier_stats(5, stats)
    log.text("placement/plan", "t_a  rank 0")
    log.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {"tier/t_a/hit_rate", "tier/t_a/slow_bytes", "tier/t_b/hit_rate"}
    ev = acc.Scalars("tier/t_a/slow_bytes")
    assert [(e.step, e.value) for e in ev] == [(5, 150.0)]
    with pytest.raises(FloatingPointError, match="train/loss"):
        RunLogger(str(tmp_path / "x")).scalars(1, {"train/loss": float("nan")})


# ---------------------------------------------------------------- torchx components
def test_components_validate_before_returning_appdef() -> None:
    app = components.train("--dataset", "synthetic", "--max-steps", "5", j="1x2")
    role = app.roles[0]
    assert role.entrypoint == "bash" or "torchrun" in " ".join([role.entrypoint, *role.args])
    joined = " ".join(role.args)
    assert "-m recpipe.recipes.train" in joined and "--nproc_per_node 2" in joined.replace("=", " ")
    assert role.env["OMP_NUM_THREADS"] == "1"
    with pytest.raises(ConfigError, match="batch_size"):
        components.train("--batch-size", "-4")
    default = components.default_recipe(tb_dir="/tmp/tbx")
    assert "--config default" in " ".join(default.roles[0].args)
    assert "--tb-dir /tmp/tbx" in " ".join(default.roles[0].args)
    # without tb_dir, each job logs into its own run directory (as `make run` does)
    args = " ".join(components.default_recipe().roles[0].args)
    assert re.search(r"--tb-dir runs/recpipe/\d{8}-\d{6}\b", args), args


@pytest.mark.parametrize("j", ["1x0", "0x2", "0", "x2", "2x", "1:0x2", "3:2x2", "1x-1", "one", ""])
def test_component_refuses_a_bad_j_naming_it(j: str) -> None:
    with pytest.raises(ConfigError, match=r"invalid component argument -j .* every number >= 1. Fix: e\.g\. -j 1x2"):
        components.train("--dataset", "synthetic", "--max-steps", "5", j=j)


@pytest.mark.parametrize(
    "arg, value, flag, bound",
    [
        ("cpu", 0, "--cpu", ">= 1"),
        ("cpu", True, "--cpu", ">= 1"),
        ("memMB", -1, "--memMB", ">= 1"),
        ("memMB", 0, "--memMB", ">= 1"),
        ("rdzv_port", 0, "--rdzv_port", "in [1, 65535]"),
        ("rdzv_port", 70000, "--rdzv_port", "in [1, 65535]"),
        ("tee", 7, "--tee", "in [0, 3]"),
        ("tee", -1, "--tee", "in [0, 3]"),
        ("max_retries", -1, "--max_retries", ">= 0"),
    ],
)
def test_component_refuses_bad_resource_arguments_naming_them(arg: str, value: object, flag: str, bound: str) -> None:
    # torchx passed these on unchecked (cpu=0 even became 2)
    with pytest.raises(ConfigError) as e:
        components.train("--dataset", "synthetic", "--max-steps", "5", j="2x1", **{arg: value})
    assert str(e.value).startswith(
        f"invalid component argument {flag} {value!r}: it must be an integer {bound}. Fix: e.g. {flag} "
    ), str(e.value)


def test_component_accepts_the_resource_bounds_and_a_j_with_spaces() -> None:
    app = components.train(
        "--dataset", "synthetic", "--max-steps", "5", j=" 2x1\n", cpu=1, memMB=1, max_retries=0, rdzv_port=65535, tee=0
    )
    role = app.roles[0]
    joined = " ".join(role.args)
    assert (role.resource.cpu, role.resource.memMB, role.max_retries) == (1, 1, 0)
    assert "--nnodes 2" in joined and "--nproc_per_node 1" in joined and ":65535" in joined and "--tee 0" in joined
    assert "--nproc_per_node 3" in " ".join(components.default_recipe(j="\t1x3 ").roles[0].args)
    with pytest.raises(ConfigError, match="invalid component argument -j '1 x2'"):
        components.train("--dataset", "synthetic", "--max-steps", "5", j="1 x2")


@pytest.mark.parametrize(
    "j,nnodes,nproc", [("2", "1", "2"), ("1x3", "1", "3"), ("2x1", "2", "1"), ("1:2x4", "1:2", "4")]
)
def test_component_accepts_every_torchx_j_form(j: str, nnodes: str, nproc: str) -> None:
    joined = " ".join(components.train("--dataset", "synthetic", "--max-steps", "5", j=j).roles[0].args)
    assert f"--nnodes {nnodes}" in joined and f"--nproc_per_node {nproc}" in joined, joined


def test_recipe_output_has_no_upstream_notices() -> None:
    """The recipe's entry point drops the two upstream notices every run printed per rank
    (torchrec's DDP ``broadcast_buffers`` FutureWarning, torch's ``is_fx_tracing``)."""
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "recpipe.recipes.train",
        "--dataset",
        "synthetic",
        "--model",
        "dlrm",
        "--num-embeddings",
        "2000",
        "--synthetic-id-space",
        "50000",
        "--embedding-dim",
        "8",
        "--dense-arch",
        "16,8",
        "--over-arch",
        "16,1",
        "--batch-size",
        "64",
        "--max-steps",
        "2",
        "--eval-batches",
        "1",
        "--log-every",
        "2",
        "--no-progress-bar",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "[recpipe] done: 2 steps" in proc.stdout
    assert "broadcast_buffers" not in proc.stderr and "is_fx_tracing" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("field", ["data_path", "eval_data_path"])
def test_data_paths_of_another_dataset_are_refused(field: str) -> None:
    """``--data-path`` / ``--eval-data-path`` are read by criteo_tsv only: on another
    dataset they are refused, not ignored."""
    flag = "--" + field.replace("_", "-")
    with pytest.raises(
        ConfigError,
        match=rf"{field}='x.tsv'.*read only by --dataset criteo_tsv, not synthetic.*"
        rf"drop {flag}, or pass --dataset criteo_tsv",
    ):
        parse_config(["--dataset", "synthetic", "--max-steps", "4", flag, "x.tsv"], check_paths=False)


def test_the_loop_reads_losses_once_per_logging_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The training loop reads the step losses on the host once per logging interval (one
    ``torch.stack(...).tolist()``), never one loss at a time: on CUDA each read of a loss waits
    for its step's kernels and keeps the host from running ahead. The recorded per-step losses
    still equal the losses the pipeline returned, step by step."""
    from torch.overrides import TorchFunctionMode

    from recpipe.recipes import train as train_module

    returned: list[torch.Tensor] = []
    make = train_module.make_pipeline

    def counting_pipeline(*args, **kwargs):  # the recipe's own pipeline; its losses are remembered
        pipeline = make(*args, **kwargs)
        progress = pipeline.progress

        def tracked(it):
            out = progress(it)
            if torch.is_grad_enabled() and pipeline._model.training:
                returned.append(out[0])
            return out

        pipeline.progress = tracked
        return pipeline

    single_reads, batched_reads = [], []

    def is_loss(x: object) -> bool:  # a returned loss or a view / detached alias of it
        return isinstance(x, torch.Tensor) and any(x.data_ptr() == t.data_ptr() for t in returned)

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            with torch._C.DisableTorchFunction():
                if func in (torch.Tensor.__float__, torch.Tensor.item, torch.Tensor.tolist) and args:
                    if is_loss(args[0]):
                        single_reads.append(func.__name__)
                if func is torch.stack and args and all(is_loss(x) for x in args[0]):
                    batched_reads.append(len(args[0]))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(train_module, "make_pipeline", counting_pipeline)
    path = tmp_path / "day_0.tsv"
    _write_criteo(path, 200, seed=5)
    with Reads():
        result = run(
            TrainConfig(
                dataset="criteo_tsv",
                data_path=str(path),
                model="dlrm",
                batch_size=20,
                num_embeddings=97,
                embedding_dim=8,
                dense_arch=(8,),
                over_arch=(8, 1),
                max_steps=12,
                eval_every=6,
                eval_batches=1,
                log_every=4,
                progress_bar=False,
            )
        )
    assert len(returned) == 12 and result.steps == 12
    assert single_reads == [], single_reads
    assert batched_reads == [4, 2, 2, 4], batched_reads  # log at 4, eval at 6, log at 8, log at 12
    assert result.losses == [float(t) for t in returned]
