"""The benchmark and tool scripts refuse bad option values before any work: argparse's
one line ``error: argument --x: ...`` and exit code 2, never a traceback, a hang or a
table of NaN; and a worker that dies without reporting stops the script at once."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

CASES = [
    ("bench_bucketize.py", ["--keys", "0"], "--keys: must be an int >= 512, got 0"),
    ("bench_bucketize.py", ["--repeat", "0"], "--repeat: must be an int >= 1, got 0"),
    ("bench_bucketize.py", ["--worlds", "2", "0"], "--worlds: must be an int >= 1, got 0"),
    ("bench_storage.py", ["--bags", "4"], "--bags: must be an int >= 8, got 4"),
    ("bench_storage.py", ["--dim", "0"], "--dim: must be an int >= 1, got 0"),
    ("bench_storage.py", ["--repeat", "x"], "--repeat: 'x' is not an int"),
    ("bench_storage.py", ["--bags", "8000", "--pooling", "101"], "--pooling: a MovieLens step takes"),
    ("bench_pipeline.py", ["--threads", "0"], "--threads: must be an int >= 1, got 0"),
    ("bench_pipeline.py", ["--over-arch", "a,b"], "--over-arch: 'a,b' is not a comma-separated list of ints"),
    ("bench_pipeline.py", ["--warmup", "-1"], "--warmup: must be an int >= 0, got -1"),
    ("bench_checkpoint.py", ["--load-factor", "1.5"], "--load-factor: must be in (0, 1], got 1.5"),
    ("bench_checkpoint.py", ["--load-factor", "nan"], "--load-factor: must be in (0, 1], got nan"),
    ("bench_checkpoint.py", ["--dir", "/nonexistent/x"], "--dir: /nonexistent/x is not an existing directory"),
    ("bench_checkpoint.py", ["--sets", "2x0x64"], "--sets: table set '2x0x64': every number must be positive"),
    ("bench_planner.py", ["--backend", "gpu"], "--backend: invalid choice: 'gpu'"),
    ("bench_planner.py", ["--quick=1"], "--quick: ignored explicit argument '1'"),
    ("bench_recipe.py", ["--steps", "5"], "--steps: must be an int >= 20, got 5"),
    ("bench_recipe.py", ["--nproc", "0"], "--nproc: must be an int >= 1, got 0"),
    ("bench_dynamic_quality.py", ["--capacity", "8"], "--capacity: must be an int >= 16, got 8"),
    ("bench_dynamic_quality.py", ["--steps", "x"], "--steps: 'x' is not an int"),
    ("bench_dynamic_vs_mch.py", ["--capacity", "2050"], "--capacity: must be a multiple of 16 (a dynamic table's"),
    ("bench_dynamic_vs_mch.py", ["--eviction-interval", "0"], "--eviction-interval: must be an int >= 1, got 0"),
    ("bench_eval_pipeline.py", ["--batches", "0"], "--batches: must be an int >= 1, got 0"),
    ("bench_eval_pipeline.py", ["--dense-arch", "64,32"], "--dense-arch: its last width 32 must equal --dim 64"),
    ("bench_semi_sync.py", ["--steps", "10"], "--steps: must be an int >= 30, got 10"),
    ("bench_semi_sync.py", ["--start-batch", "400"], "--start-batch: 400 must be below --steps 300"),
    ("profile_recipe.py", ["--rate", "0"], "--rate: must be an int >= 1, got 0"),
    ("profile_recipe.py", ["--raw", "/nonexistent/dir/raw.txt"], "--raw: /nonexistent/dir/raw.txt is not a writable"),
    ("profile_recipe.py", ["--steps", "20", "--", "--bogus-flag"], "extra (recipe flags after --): bad command line"),
]
if Path("/proc").is_dir():  # a directory even root cannot create files in
    CASES.append(("bench_checkpoint.py", ["--dir", "/proc"], "--dir: /proc is not writable"))


@pytest.mark.parametrize("script, args, message", CASES, ids=[f"{c[0]}{' '.join(c[1])}" for c in CASES])
def test_bad_option_is_one_line_and_exit_2(script: str, args: list[str], message: str) -> None:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith(f"{script}: error: argument {message}"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert time.perf_counter() - t0 < 60  # refused before any work (importing torch takes the time)


def _exit_silently() -> None:
    sys.exit(3)


def test_a_worker_that_dies_without_reporting_stops_the_script() -> None:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from benchutil import iter_reports
    finally:
        sys.path.remove(str(SCRIPTS))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_exit_silently) for _ in range(2)]
    for p in procs:
        p.start()
    t0 = time.perf_counter()
    with pytest.raises(SystemExit, match=r"a worker exited without reporting \(exit codes \[3, 3\]\)"):
        list(iter_reports(q, procs, timeout_s=600))
    assert time.perf_counter() - t0 < 60
    for p in procs:
        p.join()


HELP_SCRIPTS = sorted(p.name for p in SCRIPTS.glob("*.py") if p.name != "benchutil.py")


@pytest.mark.parametrize("script", HELP_SCRIPTS)
def test_help_shows_the_whole_docstring(script: str) -> None:
    """scripts/README.md sends the reader to each script's docstring (what it measures,
    its targets): ``--help`` prints all of it, line breaks kept, and exits 0."""
    import ast

    doc = ast.get_docstring(ast.parse((SCRIPTS / script).read_text()))
    assert doc
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    help_lines = [ln.strip() for ln in proc.stdout.splitlines()]
    missing = [ln.strip() for ln in doc.splitlines() if ln.strip() and ln.strip() not in help_lines]
    assert not missing, f"{script} --help lacks these docstring lines: {missing[:3]}"
