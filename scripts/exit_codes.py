"""Exit codes of recipe processes on their exit paths, run many times.

A scheduler reads a worker's exit code: an error the recipe reports must end the
process with that error's code (1, or 2 for a bad config), a finished run with 0,
and never with a signal (-6, SIGABRT, from a thread or resource torn down at
interpreter exit). This script starts the ranks of each scenario as plain
processes (``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` set here, no launcher that
would stop the other ranks when one exits) and prints every rank's exit code:

* ``resume-mismatch``: resume a saved checkpoint with another ``--embedding-dim``
  (every rank refuses it with ``CheckpointMismatchError``: expected 1);
* ``short-run``: a short successful run (expected 0).

Usage::

    python scripts/exit_codes.py [--repeat 20] [--nproc 2]
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

ABORT_MARKERS: Tuple[str, ...] = ("terminate called", "Fatal Python error")
RUN_TIMEOUT_S: float = 300.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(args: Sequence[str], nproc: int, log_dir: Path, tag: str) -> Tuple[List[int], bool]:
    """Runs ``python -m recpipe.recipes.train ARGS`` as ``nproc`` ranks; returns their
    exit codes (``-N`` for signal N) and whether any rank's output shows an abort."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc))
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = []
    logs = []
    for rank in range(nproc):
        log = open(log_dir / f"{tag}.rank{rank}.log", "w")
        logs.append(log)
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc))
        cmd = [sys.executable, "-m", "recpipe.recipes.train", *args]
        procs.append(subprocess.Popen(cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=RUN_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    for log in logs:
        log.close()
    aborted = any(
        marker in (log_dir / f"{tag}.rank{rank}.log").read_text(errors="replace")
        for rank in range(nproc)
        for marker in ABORT_MARKERS
    )
    return codes, aborted


def main(argv: Sequence[str] | None = None) -> int:
    """Runs both scenarios ``--repeat`` times and prints one table row per scenario."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=20, help="runs per scenario (default 20)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run (default 2)")
    parser.add_argument("--keep-logs", type=Path, default=None, help="directory to keep every rank's output in")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.nproc < 1:
        parser.error("--repeat and --nproc must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        logs = args.keep_logs or root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        base = ["--max-steps", "4", "--eval-every", "0", "--log-every", "2", "--tb-dir", str(root / "tb")]
        ckpt = ["--checkpoint-dir", str(root / "ckpt")]
        codes, aborted = run_ranks([*base, *ckpt], args.nproc, logs, "save")
        if any(codes) or aborted:
            print(f"the checkpoint-writing run failed: exit codes {codes}; see {logs}", file=sys.stderr)
            return 1
        scenarios: Dict[str, Tuple[List[str], int]] = {
            "resume-mismatch": (
                [*base, *ckpt, "--max-steps", "8", "--resume", "--embedding-dim", "32", "--dense-arch", "64,32"],
                1,
            ),
            "short-run": (base, 0),
        }
        print(
            f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
            f"{args.nproc} ranks per run, {args.repeat} runs per scenario"
        )
        print("| scenario | expected | exit codes (count) | aborts | seconds per run |")
        print("|---|---|---|---|---|")
        failed = False
        for name, (scenario_args, expected) in scenarios.items():
            counts: collections.Counter[int] = collections.Counter()
            aborts = 0
            t0 = time.perf_counter()
            for i in range(args.repeat):
                codes, aborted = run_ranks(scenario_args, args.nproc, logs, f"{name}.{i}")
                counts.update(codes)
                aborts += aborted
            per_run = (time.perf_counter() - t0) / args.repeat
            shown = ", ".join(f"{code}: {n}" for code, n in sorted(counts.items()))
            print(f"| {name} | {expected} | {shown} | {aborts} | {per_run:.1f} |")
            failed |= set(counts) != {expected} or aborts > 0
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
