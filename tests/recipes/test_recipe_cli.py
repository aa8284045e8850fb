"""The training CLI: --help, bad command lines, float ranges, YAML files, output paths, launcher and start checks."""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
from harness.recipe_configs import SMALL_SYNTHETIC
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchx.specs.builders import materialize_appdef

from recpipe.planner import PlacementPlanner
from recpipe.recipes import components, launch
from recpipe.recipes import train as train_module
from recpipe.recipes.build import planner_topology
from recpipe.recipes.cli import field_docs, parse_config
from recpipe.recipes.config import (
    CHOICES,
    FLOAT_RULES,
    INT_LISTS,
    MAX_TIER_MB,
    OUTPUT_PATHS,
    UNITS,
    ConfigError,
    ConfigPathError,
    TrainConfig,
)
from recpipe.recipes.data.registry import make_data_source
from recpipe.recipes.faults import nothing_to_train
from recpipe.recipes.models import EBC_PATH, build_model
from recpipe.recipes.train import run

FIELDS = dataclasses.fields(TrainConfig)
HINTS = typing.get_type_hints(TrainConfig)
FLOAT_FIELDS = [f.name for f in FIELDS if HINTS[f.name] is float]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _train(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "recpipe.recipes.train", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


# ---------------------------------------------------------------- --help
def test_every_field_has_a_docstring_read_from_the_source() -> None:
    docs = field_docs()
    assert set(docs) == {f.name for f in FIELDS}
    assert all(docs.values())
    assert docs["batch_size"] == "Samples per rank per step (the global batch is batch_size * world_size)."
    assert docs["timeout_s"].startswith("Seconds a collective (all-to-all, all-reduce, barrier) may wait")


def test_help_exits_zero_and_describes_every_flag() -> None:
    proc = _train("--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    docs = field_docs()
    for f in FIELDS:
        flag = _flag(f.name)
        if HINTS[f.name] is bool:
            assert f"{flag}, --no-{flag[2:]}" in text
        else:
            assert f" {flag} " in text
        assert " ".join(docs[f.name].split()[:6]) in text, f.name
    for name, choices in CHOICES.items():
        assert f"choices: {', '.join(choices)}" in text, name
    assert "--sharding-types TYPE[,TYPE...]" in text
    assert "a comma-separated subset, any order, of: table_wise, row_wise, column_wise" in text
    for name, unit in UNITS.items():
        assert f"{_flag(name)} {unit.upper()}" in text and f"unit: {unit}" in text
    assert "unit: seconds; range: in [1, 604800]; default: 600]" in text
    assert "range: in [0, 8589934592); default: 16384]" in text  # slow_tier_mb
    assert "default: micro_dlrm_dram]" in text and "default: 64,64]" in text and "default: unset]" in text


# ---------------------------------------------------------------- bad command lines
@pytest.mark.parametrize(
    "argv, why",
    [
        (["--batch-sise", "3"], "unrecognized arguments: --batch-sise 3"),
        (["--batch-size", "x"], "argument --batch-size: invalid int value: 'x'"),
        (["--epoch", "3"], "unrecognized arguments: --epoch 3"),  # no abbreviations
        (["--dense-arch", "3,a"], "argument --dense-arch: expected comma-separated integers, got '3,a'"),
        (["--max-steps"], "argument --max-steps: expected one argument"),
        (["stray", "--seed", "1"], "unrecognized arguments: stray"),
    ],
)
def test_bad_command_line_raises_config_error_quoting_it(argv: list[str], why: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(argv)
    assert f"bad command line {shlex.join(argv)!r}: {why}" in str(e.value)
    assert "--help" in str(e.value)


def test_entry_point_reports_the_real_command_line() -> None:
    proc = _train("--dataset", "synthetic", "--batch-size", "x y")
    assert proc.returncode != 0
    assert "bad command line \"--dataset synthetic --batch-size 'x y'\"" in proc.stderr


# ---------------------------------------------------------------- choice fields
@pytest.mark.parametrize("name", sorted(CHOICES))
def test_a_choice_field_refuses_an_unknown_value_naming_the_flag_and_its_choices(name: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config([_flag(name), "bogus"], check_paths=False)
    choices = CHOICES[name]
    assert str(e.value) == (
        f"invalid config value {name}='bogus': unknown choice. "
        f"Fix: use one of {', '.join(choices)}, e.g. {_flag(name)} {choices[0]}"
    )


def test_eval_pipeline_flag_parses_and_defaults_to_prefetch() -> None:
    assert parse_config([], check_paths=False).eval_pipeline == "prefetch"
    assert parse_config(["--eval-pipeline", "plain"], check_paths=False).eval_pipeline == "plain"
    with pytest.raises(
        ConfigError, match=r"eval_pipeline='Plain'.*Fix: use one of prefetch, plain, e\.g\. --eval-pipeline"
    ):
        parse_config(["--eval-pipeline", "Plain"], check_paths=False)


# ---------------------------------------------------------------- float fields
def test_every_float_field_has_a_range() -> None:
    assert set(FLOAT_RULES) == set(FLOAT_FIELDS)
    for name, rule in FLOAT_RULES.items():
        assert parse_config([_flag(name), rule.example]).to_dict()[name] == float(rule.example)


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1"])
def test_float_fields_reject_nan_inf_and_negative(name: str, value: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config([f"{_flag(name)}={value}"])  # "--x -inf" would read -inf as a flag
    message = str(e.value)
    assert message.startswith(f"invalid config value {name}=")
    assert "must be a finite number" in message and f"Fix: pass e.g. {_flag(name)} " in message


@pytest.mark.parametrize(
    "name, value",
    [
        ("dense_lr", 0.0),
        ("embedding_lr", 0.0),
        ("timeout_s", 0.0),
        ("timeout_s", 0.5),
        ("timeout_s", 1e9),
        ("eval_fraction", 1.0),
        ("zipf_alpha", 3.5),
        ("slow_tier_mb", True),
    ],
)
def test_float_fields_reject_out_of_range(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"invalid config value {name}="):
        TrainConfig(**{name: value})


def test_yaml_floats(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("dense_lr: 1e-3\ntimeout_s: 30\n")  # YAML 1.1 reads 1e-3 as a string
    parsed = parse_config(["--config", str(cfg)])
    assert (parsed.dense_lr, parsed.timeout_s) == (0.001, 30.0)
    assert parsed.to_dict()["timeout_s"] == 30.0 and TrainConfig().timeout_s == 600.0
    cfg.write_text("slow_tier_mb: .nan\n")
    with pytest.raises(ConfigError, match="slow_tier_mb=nan"):
        parse_config(["--config", str(cfg)])
    cfg.write_text("dense_lr: fast\n")
    with pytest.raises(ConfigError, match="dense_lr='fast'"):
        parse_config(["--config", str(cfg)])


@pytest.mark.parametrize("name", ["fast_tier_mb", "slow_tier_mb"])
@pytest.mark.parametrize("value", ["1e15", "1e18", "1e20", "8589934592"])
def test_tier_budgets_past_the_planners_byte_limit_are_refused(name: str, value: str) -> None:
    # refused at validation: the planner's C++ kernel would overflow int64
    with pytest.raises(ConfigError) as e:
        parse_config([_flag(name), value])
    message = str(e.value)
    assert message.startswith(
        f"invalid config value {name}={float(value)!r}: must be a finite number "
        "in [0, 8589934592) MiB (not nan or inf); the placement planner takes budgets "
        f"below 2^53 bytes (8 PiB). Fix: pass e.g. {_flag(name)} "
    ), message


def test_the_largest_tier_budgets_accepted_are_what_the_planner_takes() -> None:
    # the bound is the DP kernel's exact range (csrc/placement_dp.cpp: budgets < 2^53 bytes),
    # as the recipe turns MiB into bytes (recipes/build.py); the planner itself plans a larger
    # budget as unbounded (it cannot limit any plan)
    assert MAX_TIER_MB * 2**20 == 2**53
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100, feature_names=["f"])],
        device=torch.device("meta"),
    )

    def plan(cfg: TrainConfig) -> None:
        topology = planner_topology(cfg, world_size=1, local_world_size=1, fast_bytes=int(cfg.fast_tier_mb * 2**20))
        PlacementPlanner(topology, batch_size=8, hbm_reservation=0.0, backend="native").plan(ebc)

    top = math.nextafter(MAX_TIER_MB, 0.0)
    cfg = TrainConfig(fast_tier_mb=top, slow_tier_mb=top)  # accepted, and planned
    plan(cfg)
    for name in ("fast_tier_mb", "slow_tier_mb"):
        with pytest.raises(ConfigError, match=f"invalid config value {name}="):
            TrainConfig(**{name: MAX_TIER_MB})
        over = TrainConfig(fast_tier_mb=top, slow_tier_mb=top)
        setattr(over, name, MAX_TIER_MB)  # past validation: the planner takes it too
        plan(over)


# ---------------------------------------------------------------- YAML config files
def test_every_int_list_field_is_checked() -> None:
    assert set(INT_LISTS) == {f.name for f in FIELDS if HINTS[f.name] == tuple[int, ...]}
    for name, example in INT_LISTS.items():
        assert parse_config([_flag(name), example]).to_dict()[name] == [int(w) for w in example.split(",")]


@pytest.mark.parametrize("name", sorted(INT_LISTS))
@pytest.mark.parametrize(
    "text", ['"64,64"', "64", "[64, a]", "[64.5, 64]", "[true, 64]", "[0, 64]", "[]", "null", "{a: 1}"]
)
def test_yaml_int_list_of_the_wrong_type_is_a_config_error(tmp_path: Path, name: str, text: str) -> None:
    # a ConfigError, not a traceback (int(','), 'int' object is not iterable, or inside
    # torch when the model is built)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"{name}: {text}\n")
    with pytest.raises(ConfigError) as e:
        parse_config(["--config", str(cfg)])
    message = str(e.value)
    assert message.startswith(f"invalid config value {name}="), message
    assert (
        f"must be a non-empty list of positive integers. Fix: pass e.g. {_flag(name)} {INT_LISTS[name]} "
        f"(in YAML: {name}: [" in message
    )


@pytest.mark.parametrize(
    "name, text", [("data_path", "[a.tsv, b.tsv]"), ("eval_data_path", "5"), ("resume", "5"), ("progress_bar", "maybe")]
)
def test_yaml_path_and_flag_fields_of_the_wrong_type_are_config_errors(tmp_path: Path, name: str, text: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"dataset: criteo_tsv\n{name}: {text}\n" if name == "data_path" else f"{name}: {text}\n")
    with pytest.raises(ConfigError, match=f"invalid config value {name}=.*: must be (a path|true or false)"):
        parse_config(["--config", str(cfg)])


@pytest.mark.parametrize(
    "text, why",
    [
        (
            "batch_size: [1\n",
            "while parsing a flow sequence, expected ',' or ']', but got '<stream end>' at line 2, column 1",
        ),
        ("seed: 1\nmodel: dlrm: x\n", "mapping values are not allowed here at line 2, column 12"),
        (
            "seed: 1\n\tbatch_size: 2\n",
            "while scanning for the next token, found character '\\t' that cannot start any token at line 2, column 1",
        ),
    ],
)
def test_invalid_yaml_is_a_config_error_naming_file_and_place(tmp_path: Path, text: str, why: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as e:
        parse_config(["--config", str(cfg)])
    assert str(e.value) == f"config file {str(cfg)!r} is not valid YAML: {why}. Fix: correct the YAML syntax there"


def test_entry_point_yaml_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    for text, message in (
        ("dense_arch: 64\n", "error: invalid config value dense_arch=64: must be a non-empty list"),
        ("batch_size: [1\n", "error: config file "),
    ):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(text)
        proc = _train("--config", str(cfg), "--dataset", "synthetic", "--max-steps", "2")
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(message)


# ---------------------------------------------------------------- output paths
def _unwritable_cases(tmp_path: Path) -> list[tuple[str, str, str]]:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    a_dir = tmp_path / "a_dir"
    a_dir.mkdir()
    return [
        ("metrics_file", str(a_file / "m.json"), "is not a directory"),
        ("metrics_file", str(a_dir), "is a directory, expected a file path"),
        ("tb_dir", str(a_file), "exists and is not a directory"),
        ("checkpoint_dir", str(a_file / "sub" / "ckpt"), "is not a directory"),
        ("tb_dir", "/proc/recpipe-tb", "cannot write into directory '/proc'"),  # even as root
    ]


def test_unwritable_output_paths_fail_at_validation(tmp_path: Path) -> None:
    assert set(OUTPUT_PATHS) == {"metrics_file", "tb_dir", "checkpoint_dir"}
    for name, path, why in _unwritable_cases(tmp_path):
        with pytest.raises(ConfigError) as e:
            parse_config([_flag(name), path])
        message = str(e.value)
        assert message.startswith(f"invalid config value {name}={path!r}"), message
        assert why in message and f"Fix: pass {_flag(name)} " in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only-mode directories")
def test_read_only_directory_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="is not writable"):
            TrainConfig(metrics_file=str(ro / "m.json"))
    finally:
        ro.chmod(0o700)


def test_writable_output_paths_are_accepted_and_nothing_is_created(tmp_path: Path) -> None:
    TrainConfig(
        metrics_file=str(tmp_path / "x" / "y" / "m.json"), tb_dir=str(tmp_path / "tb"), checkpoint_dir=str(tmp_path)
    )
    assert list(tmp_path.iterdir()) == []
    existing = tmp_path / "m.json"
    existing.write_text("old")
    TrainConfig(metrics_file=str(existing))
    assert existing.read_text() == "old"


def test_entry_point_refuses_an_unwritable_metrics_file_before_training(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("x")
    bad = tmp_path / "a_file" / "metrics.json"
    proc = _train(
        "--dataset", "synthetic", "--model", "dlrm", "--max-steps", "2", "--metrics-file", str(bad), cwd=tmp_path
    )
    assert proc.returncode != 0
    assert f"invalid config value metrics_file={str(bad)!r}" in proc.stderr
    assert "[recpipe] step" not in proc.stdout and "placement plan" not in proc.stdout


# ---------------------------------------------------------------- launcher and torchx component
def test_launcher_and_component_validate_before_launching(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ConfigError, match="dense_lr=inf"):
        components.train("--dataset", "synthetic", "--max-steps", "5", "--dense-lr", "inf")
    with pytest.raises(ConfigError, match="timeout_s=nan"):
        components.default_recipe("--timeout-s", "nan")
    with pytest.raises(
        ConfigError, match=r"bad command line '--config default --tb-dir runs/recpipe/\d{8}-\d{6} --epoch 3'"
    ):
        components.default_recipe("--epoch", "3")
    (tmp_path / "a_file").write_text("x")
    assert launch.main(["--tb-dir", str(tmp_path / "a_file" / "tb"), "--timeout-s", "30"]) == 2
    err = capsys.readouterr().err
    assert "invalid config value tb_dir=" in err
    # the launcher's workers run on this machine: no hint about the component's --check_paths
    assert "check_paths" not in err and "launching machine" not in err, err
    assert launch.main(["--tb-dir", str(tmp_path / "tb"), "--slow-tier-mb", "inf"]) == 2
    assert "slow_tier_mb=inf" in capsys.readouterr().err
    assert not (tmp_path / "tb").exists()


@pytest.mark.parametrize("flag, name", [("--data-path", "data_path"), ("--eval-data-path", "eval_data_path")])
def test_a_data_path_that_is_a_directory_is_named_as_one(tmp_path: Path, flag: str, name: str) -> None:
    """A directory given as a Criteo input is refused as a directory (it exists), with the fix."""
    (tmp_path / "day_0.tsv").write_text("")
    args = ["--dataset", "criteo_tsv", "--data-path", str(tmp_path / "day_0.tsv"), "--max-steps", "5"]
    args += [flag, str(tmp_path)]
    with pytest.raises(
        ConfigPathError,
        match=rf"{name}: '{tmp_path}' is a directory, not a file\. Fix: pass the "
        r"Criteo TSV files in it",
    ):
        parse_config(args)


def test_component_path_checks_can_be_left_to_the_workers(tmp_path: Path) -> None:
    """Paths that exist only on the cluster: the component checks the file system on the
    launching machine unless ``check_paths`` is False; values are checked either way and
    the workers' own parse still checks the paths."""
    (tmp_path / "a_file").write_text("x")
    cluster_only = [
        "--dataset",
        "criteo_tsv",
        "--data-path",
        str(tmp_path / "absent" / "day_0.tsv"),
        "--tb-dir",
        str(tmp_path / "a_file" / "tb"),
        "--max-steps",
        "5",
    ]
    with pytest.raises(ConfigPathError, match=r"data_path: file .*day_0.tsv' does not exist.*--check_paths False"):
        components.train(*cluster_only)
    with pytest.raises(ConfigPathError, match=r"tb_dir=.*--check_paths False"):
        components.train(*cluster_only[4:])
    # as `torchx run -s kubernetes recpipe.train --check_paths False -- ...` builds it
    app = materialize_appdef(components.train, ["--check_paths", "False", "--", *cluster_only])
    assert f"--data-path {tmp_path / 'absent' / 'day_0.tsv'}" in " ".join(app.roles[0].args)
    assert components.default_recipe(tb_dir=str(tmp_path / "a_file" / "tb"), check_paths=False).roles
    with pytest.raises(ConfigError, match="dense_lr=inf") as e:
        components.train(*cluster_only, "--dense-lr", "inf", check_paths=False)
    assert not isinstance(e.value, ConfigPathError)
    with pytest.raises(ConfigPathError, match="does not exist"):  # the workers' parse
        parse_config(cluster_only)
    assert parse_config(cluster_only, check_paths=False).data_path == str(tmp_path / "absent" / "day_0.tsv")


def test_timeout_flag_reaches_the_workers() -> None:
    # as `torchx run recpipe.train -j 1x2 -- ...` builds it: torchx decodes the CLI by the
    # component's annotations (string annotations would fail with "ValueError: Unknown")
    app = materialize_appdef(
        components.train, ["-j", "1x2", "--", "--dataset", "synthetic", "--max-steps", "5", "--timeout-s", "30"]
    )
    assert "--timeout-s 30" in " ".join(app.roles[0].args)
    with pytest.raises(ConfigError, match="timeout_s=0.0"):
        materialize_appdef(components.train, ["--", "--timeout-s", "0"])
    default = components.default_recipe("--timeout-s", "45")
    assert "--timeout-s 45" in " ".join(default.roles[0].args)


def test_entry_point_user_errors_are_one_line_exit_2() -> None:
    """A bad value or flag at the entry point prints one ``error:`` line (no traceback)
    and exits 2 before anything else starts."""
    for args, message in (
        (["--dense-lr", "inf"], "error: invalid config value dense_lr=inf"),
        (["--batch-sise", "3"], "error: bad command line '--batch-sise 3'"),
        (
            ["--placement", "table_wise", "--sharding-types", "row_wise"],
            "error: invalid config value sharding_types='row_wise': --sharding-types restricts the planner of "
            "--placement planned, but --placement is table_wise",
        ),
    ):
        proc = _train(*args)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(message)


def test_num_threads_above_the_machines_cpus_is_refused_naming_the_flag(tmp_path: Path) -> None:
    """``--num-threads`` above the machine's CPUs is refused at validation, before torch / gloo
    would fail creating threads ("RuntimeError: Resource temporarily unavailable")."""
    cpus = os.cpu_count() or 1
    TrainConfig(dataset="synthetic", max_steps=1, num_threads=cpus)  # the machine's CPUs: accepted
    for value in (cpus + 1, 100_000):
        with pytest.raises(
            ConfigError, match=rf"num_threads={value}: .*{cpus} logical CPU.*--num-threads between 1 and {cpus}"
        ):
            TrainConfig(dataset="synthetic", max_steps=1, num_threads=value)
    # a job for other machines: left to the workers, which check at start
    TrainConfig(dataset="synthetic", max_steps=1, num_threads=100_000, check_paths=False)
    with pytest.raises(ConfigError, match=r"num_threads=100000.*--check_paths False"):
        components.train("--dataset", "synthetic", "--max-steps", "1", "--num-threads", "100000")
    proc = _train("--dataset", "synthetic", "--max-steps", "1", "--num-threads", "100000", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: invalid config value num_threads=100000") and "--num-threads" in proc.stderr


# ---------------------------------------------------------------- failures after start
def test_tier_budgets_no_plan_fits_are_one_error_line_naming_the_flags_and_exit_2() -> None:
    # A configuration error like the others: the recipe's flags and the least budget that plans,
    # not the planner's hbm_cap / hbm_reservation (arguments the recipe sets itself).
    proc = _train(
        "--dataset",
        "synthetic",
        "--model",
        "dlrm",
        "--num-embeddings",
        "20000",
        "--max-steps",
        "4",
        "--fast-tier-mb",
        "0.001",
        "--slow-tier-mb",
        "0.001",
        "--no-progress-bar",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-3000:]
    assert proc.stderr.startswith(
        "error: ConfigError: invalid config value fast_tier_mb=0.001: the placement planner finds no plan of the "
        "model's 26 tables within --fast-tier-mb 0.001 MiB per rank and --slow-tier-mb 0.001 MiB per machine"
    ), proc.stderr
    # with no slow tier to speak of, the least plan holds every table in the fast tier: its rows of
    # 64 floats and one row-wise Adagrad float, 4 B each
    config = TrainConfig(dataset="synthetic", model="dlrm", num_embeddings=20000, max_steps=4)
    model = build_model(config, make_data_source(config, 0, 1).spec, torch.device("cpu"))
    all_fast = sum(
        t.num_embeddings * (t.embedding_dim + 1) * 4 for t in model.get_submodule(EBC_PATH).embedding_bag_configs()
    )
    least = math.ceil(all_fast / 2**20 * 1000) / 1000
    assert f"Fix: pass --fast-tier-mb {least:g} or more" in proc.stderr, proc.stderr
    assert "hbm_cap" not in proc.stderr and "hbm_reservation" not in proc.stderr
    assert "[recpipe] step " not in proc.stdout


@pytest.fixture(scope="module")
def saved_at_2_and_4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints of the small synthetic run at steps 2 and 4 (``latest`` = 4)."""
    root = tmp_path_factory.mktemp("resume_end") / "ckpt"
    run(TrainConfig(**SMALL_SYNTHETIC, max_steps=4, checkpoint_dir=str(root), checkpoint_every=2))
    return root


def test_resume_at_or_past_the_last_step_is_refused_before_the_model_is_built(
    saved_at_2_and_4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # refused: such a run would train nothing, print "final auroc nan" and exit 0
    root = tmp_path / "ckpt"
    shutil.copytree(saved_at_2_and_4, root)

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built")

    with monkeypatch.context() as m:
        m.setattr(train_module, "build_model", no_model)
        for max_steps in (4, 3):
            with pytest.raises(ConfigError) as e:
                run(TrainConfig(**SMALL_SYNTHETIC, max_steps=max_steps, checkpoint_dir=str(root), resume=True))
            assert str(e.value) == (
                f"invalid config value max_steps={max_steps}: --resume would continue from step 4 "
                f"({root / 'step_00000004'}), at or past the run's last step {max_steps}, so it would train "
                "nothing. Fix: pass --max-steps greater than 4 to train further, or drop --resume"
            )
    # the loader's choice exactly: with step 4 damaged, resume falls back to step 2 and trains
    data_file = root / "step_00000004" / "__0_0.distcp"
    data_file.write_bytes(data_file.read_bytes()[:-100])
    result = run(TrainConfig(**SMALL_SYNTHETIC, max_steps=4, checkpoint_dir=str(root), resume=True))
    assert result.start_step == 2 and len(result.losses) == 2
    # a run of whole epochs names them
    message = str(nothing_to_train(TrainConfig(checkpoint_dir=str(root)), 800, 703))
    assert "max_steps=None" in message and "last step 703 (--epochs 1)" in message
    assert "Fix: pass --max-steps greater than 800 (or more --epochs)" in message


def _criteo_file(path: Path, rows: int) -> str:
    path.write_text(
        "".join(
            "\t".join([str(i % 2)] + ["3"] * 13 + ["%08x" % (i * 7 + k) for k in range(26)]) + "\n" for i in range(rows)
        )
    )
    return str(path)


def test_entry_point_errors_found_at_start_are_one_line_exit_2(saved_at_2_and_4: Path, tmp_path: Path) -> None:
    """A data file smaller than one global batch and a resume with nothing left to train are
    found once the run reads its data or checkpoint: one ``error:`` line, exit 2, no training."""
    train_rows, eval_rows = _criteo_file(tmp_path / "tr.tsv", 64), _criteo_file(tmp_path / "ev.tsv", 10)
    criteo = [
        "--dataset",
        "criteo_tsv",
        "--model",
        "dlrm",
        "--num-embeddings",
        "97",
        "--embedding-dim",
        "8",
        "--dense-arch",
        "8",
        "--over-arch",
        "8,1",
        "--batch-size",
        "16",
        "--max-steps",
        "2",
    ]
    smalls = [
        f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
        for k, v in SMALL_SYNTHETIC.items()
        if k != "progress_bar"
    ]
    cases = [
        (
            [*criteo, "--data-path", train_rows, "--eval-data-path", eval_rows],
            f"error: ConfigError: invalid config value eval_data_path={eval_rows!r}: it holds 10 rows, fewer than one "
            "global batch (batch_size 16 x 1 rank(s) = 16 rows)",
        ),
        (
            [*smalls, "--max-steps=3", f"--checkpoint-dir={saved_at_2_and_4}", "--resume"],
            "error: ConfigError: invalid config value max_steps=3: --resume would continue from step 4",
        ),
    ]
    for args, message in cases:
        proc = _train(*args, "--no-progress-bar")
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and proc.stderr.startswith(message), proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
        assert "placement plan" not in proc.stdout and "[recpipe] step" not in proc.stdout
