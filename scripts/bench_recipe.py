"""Samples/s of the default recipe: recpipe's fused pipeline vs torchrec's TrainPipelineSparseDist.

Both runs use the same model (micro-DLRM-DRAM), data (MovieLens-100k), placements and
seed, on 2 gloo ranks launched with torchrun (1 thread each). Runs alternate
sparse/fused ``--repeats`` times; the table reports the median samples/s (steady state:
the first logging interval is excluded) and whether the per-step losses of both
pipelines are bit-identical.

Usage::

    python scripts/bench_recipe.py [--steps 200] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchutil import hardware_line, print_table


def run_once(pipeline: str, steps: int, workdir: Path, nproc: int) -> dict:
    """One torchrun job of the default recipe; returns its metrics JSON."""
    metrics = workdir / f"{pipeline}-{len(list(workdir.iterdir()))}.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "recpipe.recipes.train", "--config", "default", "--pipeline", pipeline,
        "--max-steps", str(steps), "--eval-every", "0", "--log-every", "10",
        "--no-progress-bar", "--metrics-file", str(metrics),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(metrics.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per pipeline (alternating)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (gloo, CPU)")
    args = parser.parse_args()
    print(hardware_line())
    print(
        f"default recipe (MovieLens-100k, micro-DLRM-DRAM, planned tiered placements + hash routing), "
        f"{args.nproc} ranks x 1 thread, {args.steps} steps per run, {args.repeats} runs per pipeline"
    )
    sps: dict[str, list[float]] = {"sparse": [], "fused": []}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(args.repeats):
            for pipeline in ("sparse", "fused"):
                m = run_once(pipeline, args.steps, Path(d), args.nproc)
                sps[pipeline].append(m["samples_per_s"])
                losses.setdefault(pipeline, m["losses"])
    base = statistics.median(sps["sparse"])
    identical = losses["fused"] == losses["sparse"]
    rows = []
    for name, label in (("sparse", "torchrec TrainPipelineSparseDist"), ("fused", "recpipe TrainPipelineFusedSparseDist")):
        med = statistics.median(sps[name])
        rows.append([label, med, " ".join(f"{v:.0f}" for v in sps[name]), med / base, losses[name][-1]])
    print_table(["pipeline", "samples/s (median)", "runs", "ratio vs torchrec", "last loss (rank 0)"], rows)
    print(f"per-step losses identical across pipelines: {identical} ({len(losses['sparse'])} steps)")
    if not identical:
        sys.exit(1)


if __name__ == "__main__":
    main()
