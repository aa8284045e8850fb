"""Where the default recipe's training step spends its time, sampled with py-spy.

Runs the default recipe the way ``scripts/bench_recipe.py`` does (``torchrun`` on
``--nproc`` gloo ranks, 1 thread each, MovieLens-100k, micro-DLRM-DRAM) under
``py-spy record --subprocesses --idle`` and reads the samples of every rank's main
thread taken inside a training step (a ``progress()`` call of the train loop, not of
the evaluation). Each sample goes to the first category that matches its stack:

* ``tiered kernel``: ``torch.ops.recpipe.tiered_lookup`` / ``tiered_backward`` and their
  Python wrappers (any frame of ``pipeline/tiered/shard.py``,
  ``pipeline/tiered/backends/`` or ``csrc/tiered.cpp``).
* ``data path``: batch building (any frame of ``recipes/data/``: the source, the
  ``IdTransform`` / ``VirtualTableProjector`` hashing, the KJT construction).
* ``collectives``: all-to-all / all-reduce issue and wait (torchrec ``comm_ops`` /
  ``dist_data`` awaitables, ``torch.distributed``; with ``--native`` also ``c10d::`` frames,
  e.g. DDP's gradient all-reduce awaited at the end of backward, which non-blocking
  sampling sees only as the autograd engine); mostly waiting for the other rank, whose
  work and gloo's threads share the cores.
* ``other``: the rest, broken down by pipeline stage (the function ``progress()`` called)
  and by innermost Python function.

Idle samples (a rank blocked in a wait) count: the shares are of wall time. py-spy runs
non-blocking by default so sampling does not stall one rank while the other waits;
``--native`` (blocking, C++ frames) attributes native time more finely but inflates waits.

Usage::

    PYTHONPATH=build/dev python scripts/profile_recipe.py [--steps 600] [--rate 100]
    python scripts/profile_recipe.py -- --placement table_wise --pipeline sparse   # the baseline
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from benchutil import (
    hardware_line,
    positive_int,
    print_table,
    recipe_command,
    recipe_failure,
    run_recipe,
    writable_file,
)

#: (category, predicate on one frame string "name (file:line)"), first match wins.
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    (
        "tiered kernel",
        re.compile(r"pipeline/tiered/(shard\.py|backends/)|csrc/tiered\.cpp|tiered_(lookup|backward)_cpu"),
    ),
    ("data path", re.compile(r"recipes/data/")),
    (
        "collectives",
        re.compile(
            r"torchrec/distributed/comm_ops\.py|_wait_impl \(.*torchrec/distributed/dist_data\.py"
            r"|torch/distributed/distributed_c10d\.py|torch/distributed/c10d_logger\.py"
            r"|^c10d::"
        ),
    ),  # with --native: DDP's gradient all-reduce waits inside the autograd engine
]
_LINENO = re.compile(r":\d+\)$")


@dataclass
class Profile:
    """Samples of the training steps, by category, stage and innermost Python function."""

    step: int = 0
    categories: collections.Counter = field(default_factory=collections.Counter)
    stages: collections.Counter = field(default_factory=collections.Counter)
    other_leaves: collections.Counter = field(default_factory=collections.Counter)


def _name(frame: str) -> str:
    """A frame without its line number (``func (file)``), so lines of one function merge."""
    return _LINENO.sub(")", frame)


def parse_raw(path: Path) -> Profile:
    """Reads py-spy's raw (collapsed-stack) output into a :class:`Profile`.

    Args:
        path: file written by ``py-spy record --format raw --threads --full-filenames``.

    Returns:
        The counts of the main threads' samples inside a training step's ``progress()``.
    """
    prof = Profile()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        if not any("MainThread" in f for f in frames[:4]):
            continue
        in_run = [i for i, f in enumerate(frames) if f.startswith("run (") and "recipes/train.py" in f]
        if not in_run or any(f.startswith("evaluate (") for f in frames):
            continue
        prog = [i for i, f in enumerate(frames) if i > in_run[0] and f.split(" (")[0].endswith(".progress")]
        if not prog:
            continue
        prof.step += n
        below = frames[prog[0] + 1 :]
        cat = next((c for c, rx in CATEGORIES if any(rx.search(f) for f in below)), "other")
        prof.categories[cat] += n
        if cat == "other":
            prof.stages[_name(below[0]) if below else "progress (self)"] += n
            py = [f for f in below if ".py:" in f]
            prof.other_leaves[_name(py[-1]) if py else "progress (self)"] += n
    return prof


def _short(frame: str) -> str:
    """``func (…/pkg/file.py)`` shortened to the last two path parts."""
    name, _, where = frame.partition(" (")
    parts = where.rstrip(")").split("/")
    return f"{name} ({'/'.join(parts[-2:])})"


def run_profile(args: argparse.Namespace, extra: list[str], out: Path) -> None:
    """Runs the recipe under py-spy, writing raw samples to ``out``."""
    spy = shutil.which("py-spy", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if spy is None:
        sys.exit("py-spy not found: pip install py-spy (a dev tool, not a dependency of recpipe)")
    cmd = [
        spy,
        "record",
        "--subprocesses",
        "--idle",
        "--threads",
        "--full-filenames",
        "--format",
        "raw",
        "--rate",
        str(args.rate),
        "-o",
        str(out),
        *([] if args.native else ["--nonblocking"]),
        *(["--native"] if args.native else []),
        "--",
        *recipe_command(args.nproc, args.steps, 50, *extra),
    ]
    try:
        proc = run_recipe(cmd)
    except RuntimeError as e:
        sys.exit(str(e))
    if not out.exists():
        sys.exit(f"{' '.join(cmd)} wrote no profile {out}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    done = [ln for ln in proc.stdout.splitlines() if ln.startswith("[recpipe] done")]
    if not done:  # py-spy exits 0 whatever its child did: the recipe's own last line tells
        sys.exit(recipe_failure(cmd, proc))
    print(done[-1].replace("[recpipe] done", "run (under the profiler)"))


def _raw_path(text: str) -> Path:
    """argparse type of ``--raw``: an existing file to read, or a writable path."""
    path = Path(text)
    return path if path.is_file() else writable_file(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=600, help="training steps (default 600)")
    parser.add_argument("--rate", type=positive_int, default=100, help="py-spy samples per second (default 100)")
    parser.add_argument("--nproc", type=positive_int, default=2, help="ranks (gloo, CPU; default 2)")
    parser.add_argument("--native", action="store_true", help="sample C/C++ frames too (blocking: inflates waits)")
    parser.add_argument("--raw", type=_raw_path, default=None, help="keep (or, if it exists, only read) this raw file")
    parser.add_argument("extra", nargs="*", help="more recipe flags, after --")
    args = parser.parse_args()
    if not (args.raw and args.raw.exists()):  # the recipe's flags, checked before py-spy starts
        from recpipe.recipes.cli import parse_config
        from recpipe.recipes.config import ConfigError

        cmd = recipe_command(args.nproc, args.steps, 50, *args.extra)
        try:
            parse_config(cmd[cmd.index("recpipe.recipes.train") + 1 :])
        except ConfigError as e:
            parser.error(f"argument extra (recipe flags after --): {e}")
    print(hardware_line(threads=1))
    print(
        f"default recipe{''.join(' ' + a for a in args.extra)} (MovieLens-100k, micro-DLRM-DRAM), {args.nproc} ranks x 1 "
        f"thread, {args.steps} steps, py-spy {args.rate} Hz{' --native' if args.native else ' non-blocking'}"
    )
    with tempfile.TemporaryDirectory() as d:
        raw = args.raw or Path(d) / "raw.txt"
        if not raw.exists():
            run_profile(args, args.extra, raw)
        prof = parse_raw(raw)
    if prof.step == 0:
        sys.exit("no samples inside a training step")
    total = prof.step
    print(f"main-thread samples inside training steps (all ranks): {total}")
    busy = total - prof.categories["collectives"]  # the step without its collectives (mostly waits)
    print_table(
        ["category", "samples", "share of step", "share of step without collectives"],
        [
            [
                c,
                prof.categories[c],
                f"{100 * prof.categories[c] / total:.1f}%",
                "" if c == "collectives" else f"{100 * prof.categories[c] / max(busy, 1):.1f}%",
            ]
            for c in [*(c for c, _ in CATEGORIES), "other"]
        ],
    )
    print("\n'other' by pipeline stage (the function progress() called):")
    print_table(
        ["stage", "samples", "share of step"],
        [[_short(s), n, f"{100 * n / total:.1f}%"] for s, n in prof.stages.most_common(8)],
    )
    print("\n'other' by innermost Python function:")
    print_table(
        ["function", "samples", "share of step"],
        [[_short(s), n, f"{100 * n / total:.1f}%"] for s, n in prof.other_leaves.most_common(12)],
    )


if __name__ == "__main__":
    main()
