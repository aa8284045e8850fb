"""Samples/s of the default recipe against what a torchrec user runs instead.

Three runs of the same model (micro-DLRM-DRAM), data (MovieLens-100k) and seed on 2 gloo
ranks launched with torchrun (1 thread each), interleaved ``--repeats`` times:

* ``torchrec``: ``--placement table_wise --pipeline sparse`` - torchrec's own sharder
  (fbgemm FUSED tables placed whole) and ``TrainPipelineSparseDist``: the baseline.
* ``recpipe planned + SparseDist``: recpipe's planned tiered tables under torchrec's
  pipeline (isolates the pipeline; its losses must equal the default's bit for bit).
* ``recpipe default``: planned tiered tables + ``TrainPipelineFusedSparseDist``
  (``make run``).

Every run's samples/s is printed (steady state: the first logging interval is excluded by
the recipe), then the medians and their ratio to the torchrec baseline (target for the
default: >= 1.10x), and each round's ratio to that round's torchrec run (paired: steadier
when the machine's speed drifts). Exits 1 if the two recpipe runs' per-step losses differ.

Usage::

    python scripts/bench_recipe.py [--steps 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchutil import hardware_line, int_at_least, positive_int, print_table, recipe_command, run_recipe

#: Steps between the recipe's log lines; its throughput counts the intervals after the
#: first (warm-up), so a run needs at least two.
LOG_EVERY: int = 10
#: name -> (extra CLI flags, label). The first is the baseline of the ratios.
RUNS: dict[str, tuple[list[str], str]] = {
    "torchrec": (
        ["--placement", "table_wise", "--pipeline", "sparse"],
        "torchrec table-wise FUSED + TrainPipelineSparseDist",
    ),
    "planned_sparse": (["--pipeline", "sparse"], "recpipe planned tiered + TrainPipelineSparseDist"),
    "default": ([], "recpipe default (planned tiered + TrainPipelineFusedSparseDist)"),
}


def run_once(name: str, steps: int, workdir: Path, nproc: int) -> dict:
    """One torchrun job of the default recipe with ``RUNS[name]``'s flags; returns its metrics JSON."""
    metrics = workdir / f"{name}-{len(list(workdir.iterdir()))}.json"
    run_recipe(recipe_command(nproc, steps, LOG_EVERY, *RUNS[name][0], "--metrics-file", str(metrics)))
    return json.loads(metrics.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps",
        type=int_at_least(2 * LOG_EVERY),
        default=200,
        help=f"training steps per run (>= {2 * LOG_EVERY}: throughput is measured over the logging "
        f"intervals after the first {LOG_EVERY} steps; default 200)",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=3, help="runs per configuration (interleaved; default 3)"
    )
    parser.add_argument("--nproc", type=positive_int, default=2, help="ranks (gloo, CPU; default 2)")
    args = parser.parse_args()
    print(hardware_line(threads=1))
    print(
        f"default recipe (MovieLens-100k, micro-DLRM-DRAM), {args.nproc} ranks x 1 thread, "
        f"{args.steps} steps per run, {args.repeats} interleaved runs per configuration"
    )
    sps: dict[str, list[float]] = {name: [] for name in RUNS}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.repeats):
            for name in RUNS:
                try:
                    m = run_once(name, args.steps, Path(d), args.nproc)
                except RuntimeError as e:  # the recipe failed: its own message, not a traceback
                    sys.exit(str(e))
                sps[name].append(m["samples_per_s"])
                losses.setdefault(name, m["losses"])
                print(f"run {rep + 1} {name}: {m['samples_per_s']:.0f} samples/s", flush=True)
    base = statistics.median(sps["torchrec"])
    rows = []
    for name, (_, label) in RUNS.items():
        med = statistics.median(sps[name])
        rows.append([label, med, " ".join(f"{v:.0f}" for v in sps[name]), med / base, losses[name][-1]])
    print_table(["run", "samples/s (median)", "runs", "ratio vs torchrec", "last loss (rank 0)"], rows)
    # On a shared machine the speed drifts between rounds: each round's runs ran back to back,
    # so the ratio within a round is the steadier figure.
    for name, (_, label) in list(RUNS.items())[1:]:
        paired = [a / b for a, b in zip(sps[name], sps["torchrec"])]
        print(
            f"paired ratio vs torchrec, {name} (per round): "
            + " ".join(f"{r:.3f}" for r in paired)
            + f"; median {statistics.median(paired):.3f}"
        )
    identical = losses["default"] == losses["planned_sparse"]
    print(
        f"per-step losses of recpipe's fused pipeline identical to TrainPipelineSparseDist: {identical} "
        f"({len(losses['default'])} steps)"
    )
    if not identical:
        sys.exit(1)


if __name__ == "__main__":
    main()
