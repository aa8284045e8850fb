"""Shared helpers of the bench_*.py scripts: hardware line, timing, table printing, recipe runs."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Sequence

import torch


def hardware_line() -> str:
    """One line naming the CPU, core count, accelerators and library versions."""
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
    return (
        f"hardware: {model}, {os.cpu_count()} cores, {gpu}; torch {torch.__version__}, "
        f"intra-op threads {torch.get_num_threads()}"
    )


def recipe_command(nproc: int, steps: int, log_every: int, *extra: str) -> list[str]:
    """torchrun command of the default recipe on ``nproc`` CPU ranks, no eval, no progress bar.

    Args:
        nproc (int): ranks.
        steps (int): training steps.
        log_every (int): steps between log lines.
        *extra (str): further training flags.

    Returns:
        list[str]: the command.
    """
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "recpipe.recipes.train", "--config", "default", "--max-steps", str(steps),
        "--eval-every", "0", "--log-every", str(log_every), "--no-progress-bar", *extra,
    ]


def run_recipe(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Runs ``cmd`` with one intra-op thread per rank (OMP_NUM_THREADS=1), capturing its output.

    Raises:
        RuntimeError: it exited non-zero; the message holds the command and its output's tail.
    """
    proc = subprocess.run(list(cmd), env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


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
