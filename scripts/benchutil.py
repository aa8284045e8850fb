"""Shared helpers of the bench_*.py scripts: option checks, hardware line, timing, table printing,
recipe runs."""

from __future__ import annotations

import argparse
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import torch


# ---------------------------------------------------------------- option checks
# argparse ``type=`` functions: a bad value stops the script before any work with
# argparse's one line ``error: argument --x: ...`` (exit 2), never a traceback.
def int_at_least(lo: int) -> Callable[[str], int]:
    """argparse type: an int ``>= lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)


def unit_fraction(text: str) -> float:
    """argparse type: a float in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (0.0 < value <= 1.0):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated ints ``>= 1`` (``1024,512``)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints, e.g. 1024,512") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every width must be >= 1, got {text}")
    return values


def writable_dir(text: str) -> str:
    """argparse type: an existing directory this process may write into."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not an existing directory; create it first")
    if not _can_write_in(path):
        raise argparse.ArgumentTypeError(f"{text} is not writable; pass a directory you can create files in")
    return text


def writable_file(text: str) -> Path:
    """argparse type: a file path whose directory exists and is writable."""
    path = Path(text)
    if path.is_dir() or not path.parent.is_dir() or not _can_write_in(path.parent):
        raise argparse.ArgumentTypeError(f"{text} is not a writable file path (its directory must exist)")
    return path


def _can_write_in(directory: Path) -> bool:
    """Whether a file can be created in ``directory`` (tried: ``os.access`` says yes to root
    everywhere, e.g. on /proc)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------- workers
def iter_reports(q: Any, procs: Sequence[Any], timeout_s: float = 1800.0) -> Iterator[Any]:
    """Yields one report per spawned worker from ``q`` as each arrives (the caller
    may stop at a failed one; its ``finally`` kills the rest).

    Stops with ``SystemExit`` when a worker exits without reporting (it died
    before its ``try``, or was killed) or nothing arrives for ``timeout_s``,
    instead of waiting on the queue for the full timeout.
    """
    got = 0
    deadline = time.time() + timeout_s
    while got < len(procs):
        try:
            report = q.get(timeout=2)
        except queue.Empty:
            if got + sum(p.exitcode is None for p in procs) < len(procs) and q.empty():
                codes = [p.exitcode for p in procs]
                raise SystemExit(f"a worker exited without reporting (exit codes {codes}); see its output above")
            if time.time() > deadline:
                raise SystemExit(f"no report from the workers after {timeout_s:.0f} s")
            continue
        got += 1
        deadline = time.time() + timeout_s
        yield report


def run_workers(procs: Sequence[Any], q: Any, what: str = "") -> Dict[int, Any]:
    """Starts the spawned workers ``procs``, collects each one's ``(rank, result, error)``
    report from ``q`` (:func:`iter_reports`) and joins them; stops with ``SystemExit`` at the
    first error (``what``: the run, for the message). Workers still alive are killed.

    Returns:
        Dict[int, Any]: each rank's result.
    """
    out: Dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        for rank, result, error in iter_reports(q, procs):
            if error:
                raise SystemExit(f"{what + ': ' if what else ''}rank {rank} failed: {error}")
            out[rank] = result
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return out


# ---------------------------------------------------------------- report
def hardware_line(threads: Optional[int] = None) -> str:
    """One line naming the CPU, core count, accelerators and library versions.

    Args:
        threads (Optional[int]): intra-op threads of the measured processes (ranks)
            when they are not this process's.
    """
    model = platform.processor() or "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"hardware: {model}, {os.cpu_count()} cores, {gpu}; torch {torch.__version__}, " + (
        f"intra-op threads {torch.get_num_threads()}" if threads is None else f"{threads} intra-op thread(s) per rank"
    )


def recipe_command(nproc: int, steps: int, log_every: int, *extra: str) -> list[str]:
    """torchrun command of the default recipe on ``nproc`` CPU ranks: one evaluation (after the last step;
    the training throughput leaves it out), no progress bar.

    Args:
        nproc (int): ranks.
        steps (int): training steps.
        log_every (int): steps between log lines.
        *extra (str): further training flags.

    Returns:
        list[str]: the command.
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "recpipe.recipes.train",
        "--config",
        "default",
        "--max-steps",
        str(steps),
        "--eval-every",
        "0",
        "--log-every",
        str(log_every),
        "--no-progress-bar",
        *extra,
    ]


def run_recipe(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Runs ``cmd`` with one intra-op thread per rank (OMP_NUM_THREADS=1), capturing its output.

    Raises:
        RuntimeError: it exited non-zero; the message holds the command and its output's tail.
    """
    proc = subprocess.run(list(cmd), env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(recipe_failure(cmd, proc))
    return proc


def recipe_failure(cmd: Sequence[str], proc: subprocess.CompletedProcess[str]) -> str:
    """Why ``cmd`` failed: the recipe's own ``error:`` lines (each once) when it printed any,
    else its output's tail (torchrun's traceback would bury the recipe's message)."""
    errors = list(dict.fromkeys(ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")))
    if errors:
        return "the recipe failed: " + "\n".join(e[len("error: ") :] for e in errors)
    return f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def time_it(fn: Callable[[], object], *, repeat: int = 7, warmup: int = 2, min_time_s: float = 0.0) -> float:
    """Median wall seconds of ``fn()`` over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    samples = []
    t_end = time.perf_counter() + min_time_s
    while len(samples) < repeat or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Prints a Markdown table (readable in a terminal and in a closing note)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, r in enumerate(cells):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def _fmt(c: object) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 100 else f"{c:.1f}"
    return str(c)
