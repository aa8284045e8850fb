"""``make run``: the default recipe through torchx on 2 local CPU processes.

``python -m recpipe.recipes.launch [--tb-dir DIR] [--nproc N] [training flags ...]``

Validates the flags, submits the :func:`~recpipe.recipes.components.default_recipe` AppDef to
the ``local_cwd`` scheduler *in this process* (``torchx status`` elsewhere cannot follow it),
streams the workers' ``[recpipe]`` lines, waits, and prints the final metrics and the
TensorBoard log directory with its ``tensorboard --logdir`` command.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from torchx.runner import config as torchx_config
from torchx.runner import get_runner
from torchx.specs import AppDef, AppState, AppStatus

from recpipe.recipes.cli import parse_config
from recpipe.recipes.components import default_recipe
from recpipe.recipes.config import ConfigError

SCHEDULER: str = "local_cwd"
# Used when no .torchxconfig sets [local_cwd] log_dir.
DEFAULT_TORCHX_LOG_DIR: str = "runs/torchx_log"
# Lines of worker output shown when a job fails.
FAILURE_TAIL_LINES: int = 40


@dataclass(kw_only=True)
class LaunchResult:
    """Outcome of one torchx job."""

    state: AppState
    status: AppStatus | None  # its structured_error_msg names a worker's error
    log_lines: list[str]  # combined worker output (replica 0)
    app_handle: str
    log_dir: str  # torchx log directory of the job


def run_app(
    app: AppDef,
    *,
    cfg_dirs: Sequence[str] | None = None,
    log_dir: str | None = None,
    on_line: Callable[[str], None] | None = None,
) -> LaunchResult:
    """Runs ``app`` with the local_cwd scheduler in-process and waits for it.

    Args:
        cfg_dirs: directories searched for ``.torchxconfig`` (default: the cwd).
        log_dir: torchx log directory (overrides ``.torchxconfig``).
        on_line: called with every worker output line as it appears.
    """
    bindir = str(Path(sys.executable).parent)  # holds torchrun: first on PATH
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = os.pathsep.join([bindir, os.environ.get("PATH", "")])
    cfg: dict[str, object] = {}
    torchx_config.apply(scheduler=SCHEDULER, cfg=cfg, dirs=list(cfg_dirs) if cfg_dirs else None)
    log_dir = log_dir if log_dir is not None else str(cfg.get("log_dir", DEFAULT_TORCHX_LOG_DIR))
    cfg["log_dir"] = str(Path(log_dir).resolve())
    role = app.roles[0].name
    lines: list[str] = []
    with get_runner() as runner:
        handle = runner.run(app, scheduler=SCHEDULER, cfg=cfg)

        def pump() -> None:
            for _ in range(600):  # the log file appears right after submission
                try:
                    it = runner.log_lines(handle, role, k=0, should_tail=True)
                    break
                except RuntimeError:
                    time.sleep(0.1)
            else:
                return
            for line in it:
                line = line.rstrip("\n")
                lines.append(line)
                if on_line is not None:
                    on_line(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        status = runner.wait(handle, wait_interval=1)
        reader.join(timeout=10)
    state = status.state if status is not None else AppState.UNKNOWN
    return LaunchResult(state=state, status=status, log_lines=lines, app_handle=handle, log_dir=str(cfg["log_dir"]))


def _print_progress(line: str) -> None:
    if "[recpipe]" in line:
        print(line[line.index("[recpipe]") :], flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Launches the default recipe and reports its results; returns 0, 1 (job failed) or 2 (bad argument)."""
    parser = argparse.ArgumentParser(
        prog="python -m recpipe.recipes.launch",
        description=__doc__,
        allow_abbrev=False,  # an abbreviation of a training flag must not match --nproc / --tb-dir
        epilog=(
            "Every other flag is a training flag, applied after the packaged 'default' config and validated "
            "before any process starts (e.g. --epochs 3, --timeout-s 300: a rank that waits longer than that "
            "in a collective fails the job). 'python -m recpipe.recipes.train --help' describes them all."
        ),
    )
    parser.add_argument("--tb-dir", default=None, help="TensorBoard dir (default runs/recpipe/<time>)")
    parser.add_argument("--nproc", type=int, default=2, help="local worker processes (default 2)")
    args, train_args = parser.parse_known_args(argv)
    tb_dir = Path(args.tb_dir or f"runs/recpipe/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    metrics_file = tb_dir / "metrics.json"
    try:
        if args.nproc <= 0:
            raise ConfigError(f"invalid --nproc {args.nproc}: must be >= 1. Fix: pass --nproc 2")
        worker_args = ["--metrics-file", str(metrics_file), *train_args]
        command = ["--config", "default", "--tb-dir", str(tb_dir), *worker_args]
        # the workers run on this machine: check the paths here, with the plain message
        # (the component's adds a hint for cluster jobs, --check_paths False, not ours)
        parse_config(command, check_paths=True)
        app = default_recipe(*worker_args, j=f"1x{args.nproc}", tb_dir=str(tb_dir), check_paths=False)
    except ConfigError as e:
        print(f"[recpipe] {e}", file=sys.stderr)
        return 2
    print(
        f"[recpipe] launching the default recipe on {args.nproc} local processes "
        f"(torchx {SCHEDULER}): python -m recpipe.recipes.train {shlex.join(command)}",
        flush=True,
    )
    t0 = time.perf_counter()
    result = run_app(app, on_line=_print_progress)
    elapsed = time.perf_counter() - t0
    if result.state != AppState.SUCCEEDED:
        print(f"[recpipe] job {result.app_handle} {result.state.name} after {elapsed:.0f} s", file=sys.stderr)
        if result.status is not None and result.status.structured_error_msg:
            print(result.status.structured_error_msg, file=sys.stderr)
        print("\n".join(result.log_lines[-FAILURE_TAIL_LINES:]), file=sys.stderr)
        print(f"[recpipe] full worker logs: {result.log_dir}", file=sys.stderr)
        return 1
    metrics = json.loads(metrics_file.read_text())

    def number(key: str, spec: str) -> str:  # None: not measured (e.g. no eval, too few steps)
        return "n/a" if metrics.get(key) is None else format(metrics[key], spec)

    ran = metrics["steps"] - metrics.get("start_step", 0)
    steps = f"{ran} steps" if ran == metrics["steps"] else f"{ran} steps resumed at {metrics['start_step']}"
    print(
        f"\n[recpipe] finished in {elapsed:.0f} s ({steps} on {metrics['world_size']} ranks, "
        f"pipeline {metrics['pipeline']})\n"
        f"  final eval AUROC   {number('final_auroc', '.4f')}\n"
        f"  final train loss   {number('final_loss', '.4f')} (mean of the last logging interval)\n"
        f"  throughput         {number('samples_per_s', '.0f')} samples/s\n"
        f"  TensorBoard logs   {tb_dir}\n"
        f"  view them with     tensorboard --logdir {tb_dir}\n"
        f"  torchx logs        {result.log_dir}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
