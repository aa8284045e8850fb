"""Samples/s of recpipe's default path against what a torchrec user runs, over a workload matrix.

Each workload is the recipe (``python -m recpipe.recipes.train``) on ``--nproc`` gloo ranks launched
with torchrun (1 thread each); each is run under five configurations (the matrix's columns) and one
more run for the eval table, interleaved ``--repeats`` times (every run printed, then the medians):

* ``torchrec``: ``--placement table_wise --pipeline sparse``: torchrec's sharder (fbgemm FUSED tables
  placed whole, greedily) and ``TrainPipelineSparseDist``: the baseline of the ratios;
* ``torchrec planner``: ``--placement torchrec_planner --pipeline sparse``: torchrec's own
  ``EmbeddingShardingPlanner`` (CPU topology) and ``TrainPipelineSparseDist``;
* ``recpipe default``: the recipe's defaults: recpipe's planner (table-wise FUSED or row-wise tiered
  per table, the default fast-tier budget of half the tables' bytes, which binds) and
  ``TrainPipelineFusedSparseDist``;
* ``recpipe all-fast``: the same with a fast tier that holds every table;
* ``recpipe default + semi_sync``: the defaults with ``--pipeline semi_sync`` (``TrainPipelineSemiSync``,
  synchronous for the recipe's first ``--semi-sync-start-batch`` 20 steps, then each batch looked up from
  tables one step stale); its cell gives the ratio to torchrec and to the ``recpipe default`` (fused) cell.

Every run evaluates once, after its last step (``--eval-every 0``), ``EVAL_BATCHES`` batches per rank
(capped by the eval split: MovieLens' 10,000 held-out ratings are 10 global batches of 512 x 2 ranks). The recipe's samples/s counts
training time only (evaluation pauses its clock and runs after the last timed interval), so the matrix
does not see it; the metrics file's ``eval_samples_per_s`` times it. The **eval table** compares, per
workload, the eval samples/s of recpipe default with ``--eval-pipeline plain`` (``model(batch)`` per batch,
an extra run) and ``--eval-pipeline prefetch`` (``EvalPipelinePrefetch``, the default: the ``recpipe
default`` runs).

Workloads (``--workloads`` picks some): the default recipe (MovieLens-100k, micro-DLRM-DRAM), a
synthetic Criteo-like DLRM with 26 tables of 200,000 rows (batch 512 and 2048 per rank), the same
with a skewed mix of table sizes (1.6M rows down to 3,125: ids of feature f span 1.6M / 2^(f mod 10)),
and micro-DLRM-DRAM on the synthetic Zipf stream. Targets: recpipe default >= 1.00x torchrec on every
row, recpipe all-fast >= 1.05x on every row, >= 1.10x on the median row; semi_sync >= 1.08x fused (the
median of its ratio over the DLRM rows, printed) and >= 1.15x torchrec on the median row (of all rows
measured); eval prefetch >= 1.15x plain on every row.

``--plans`` measures instead whether the modelled cost ranks plans as measured: per workload, at the
default fast tier, the planner's plan and the plans it picks when restricted to one sharding type
(``--sharding-types row_wise`` / ``table_wise``: plans it considered), each with its modelled ms/step
(from the plan report) and samples/s. Target: the planner's plan within 5% of the fastest.

Usage::

    python scripts/bench_recipe.py [--steps 100] [--repeats 3] [--workloads default,equal26_b512] [--plans]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
from pathlib import Path

from benchutil import hardware_line, int_at_least, positive_int, print_table, recipe_command, run_recipe

#: Steps between the recipe's log lines; its throughput counts the intervals after the
#: first (warm-up), so a run needs at least two.
LOG_EVERY: int = 10
#: A fast tier larger than every workload's tables, MiB.
ALL_FAST_MB: str = "1000000"
#: Eval batches per rank of every run's one evaluation (after its last step).
EVAL_BATCHES: int = 50
#: Targets: semi_sync / fused (median over the DLRM rows), semi_sync / torchrec (median row), eval prefetch / plain.
SEMI_SYNC_VS_FUSED: float = 1.08
SEMI_SYNC_VS_TORCHREC: float = 1.15
EVAL_PREFETCH_VS_PLAIN: float = 1.15
#: name -> (extra CLI flags, label): the matrix's columns. The first is the baseline of the ratios.
CONFIGS: dict[str, tuple[list[str], str]] = {
    "torchrec": (["--placement", "table_wise", "--pipeline", "sparse"], "torchrec table-wise + SparseDist"),
    "torchrec_planner": (
        ["--placement", "torchrec_planner", "--pipeline", "sparse"],
        "torchrec EmbeddingShardingPlanner + SparseDist",
    ),
    "default": ([], "recpipe default (planned, default fast tier) + fused"),
    "all_fast": (["--fast-tier-mb", ALL_FAST_MB], "recpipe planned, fast tier holds all + fused"),
    "semi_sync": (["--pipeline", "semi_sync"], "recpipe default + semi_sync"),
}
#: The eval table's extra run: recpipe default evaluating without prefetch (``default`` is its prefetch run).
EVAL_PLAIN: dict[str, tuple[list[str], str]] = {
    "eval_plain": (["--eval-pipeline", "plain"], "recpipe default, --eval-pipeline plain")
}
#: ``--plans``: name -> (extra CLI flags, label); the first is the planner's own plan.
PLANS: dict[str, tuple[list[str], str]] = {
    "chosen": ([], "planner's plan (every sharding type)"),
    "row_wise": (["--sharding-types", "row_wise"], "row-wise only"),
    "table_wise": (["--sharding-types", "table_wise"], "table-wise only"),
}
#: The plan report's modelled cost line (``modelled cost:   0.5504 ms/step; ...``).
MODELLED_COST = re.compile(r"modelled cost:\s+([0-9.]+) ms/step")
_SYNTHETIC_DLRM = ["--model", "dlrm", "--dataset", "synthetic"]
#: name -> (extra CLI flags, label).
WORKLOADS: dict[str, tuple[list[str], str]] = {
    "default": (["--batch-size", "512"], "default recipe (MovieLens, micro-DLRM-DRAM), batch 512"),
    "equal26_b512": (
        [*_SYNTHETIC_DLRM, "--synthetic-id-space", "102400000", "--num-embeddings", "200000", "--batch-size", "512"],
        "DLRM, 26 tables x 200k rows, batch 512",
    ),
    "equal26_b2048": (
        [*_SYNTHETIC_DLRM, "--synthetic-id-space", "102400000", "--num-embeddings", "200000", "--batch-size", "2048"],
        "DLRM, 26 tables x 200k rows, batch 2048",
    ),
    "skewed_b512": (
        [*_SYNTHETIC_DLRM, "--synthetic-id-space", "1600000", "--num-embeddings", "1600000", "--batch-size", "512"],
        "DLRM, 26 tables of 1.6M..3k rows, batch 512",
    ),
    "micro_zipf_b512": (
        ["--model", "micro_dlrm_dram", "--dataset", "synthetic", "--batch-size", "512"],
        "micro-DLRM-DRAM, synthetic Zipf ids, batch 512",
    ),
}


def run_once(workload: str, flags: list[str], steps: int, workdir: Path, nproc: int) -> tuple[dict, str]:
    """One torchrun job of ``workload`` with ``flags``; returns its metrics JSON and its output."""
    metrics = workdir / f"{workload}-{len(list(workdir.iterdir()))}.json"
    eval_flags = ["--eval-batches", str(EVAL_BATCHES)]  # one evaluation, after the last step (--eval-every 0)
    proc = run_recipe(
        recipe_command(
            nproc, steps, LOG_EVERY, *WORKLOADS[workload][0], *eval_flags, *flags, "--metrics-file", str(metrics)
        )
    )
    return json.loads(metrics.read_text()), proc.stdout + proc.stderr


def measure(
    workload: str, runs: dict[str, tuple[list[str], str]], args: argparse.Namespace, workdir: Path
) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """The metrics of every run of ``runs`` (interleaved ``args.repeats`` times; a failed run has none)
    and each one's output."""
    metrics: dict[str, list[dict]] = {name: [] for name in runs}
    outputs: dict[str, str] = {}
    for rep in range(args.repeats):
        for name, (flags, _) in runs.items():
            try:
                m, outputs[name] = run_once(workload, flags, args.steps, workdir, args.nproc)
            except RuntimeError as e:  # the recipe failed: its own message, not a traceback
                print(f"run {rep + 1} {workload} {name}: failed: {e}", flush=True)
                continue
            metrics[name].append(m)
            print(
                f"run {rep + 1} {workload} {name}: {m['samples_per_s']:.0f} samples/s, "
                f"eval {_number(m.get('eval_samples_per_s')):.0f} samples/s",
                flush=True,
            )
    return metrics, outputs


def _number(value: float | None) -> float:
    """A metrics value as a float: NaN for ``None`` (not measured)."""
    return float("nan") if value is None else float(value)


def median_of(runs: list[dict], key: str) -> float:
    """The median of ``key`` over the runs that measured it (NaN: none did)."""
    values = [v for v in (_number(m.get(key)) for m in runs) if math.isfinite(v)]
    return statistics.median(values) if values else float("nan")


def plan_choice(args: argparse.Namespace, workdir: Path) -> bool:
    """The ``--plans`` table; True when the planner's plan is within 5% of the fastest on every workload."""
    rows, ok = [], True
    for workload in args.workloads:
        runs, outputs = measure(workload, PLANS, args, workdir)
        med = {name: median_of(v, "samples_per_s") for name, v in runs.items() if v}
        fastest = max(med.values())
        for name, (_, label) in PLANS.items():
            found = MODELLED_COST.search(outputs.get(name, ""))
            modelled = float(found.group(1)) if found else float("nan")
            rows.append(
                [WORKLOADS[workload][1], label, modelled, med.get(name, float("nan")), med.get(name, 0) / fastest]
            )
        ok &= med.get("chosen", 0) >= 0.95 * fastest
    print_table(["workload", "plan", "modelled ms/step", "samples/s (median)", "vs fastest measured"], rows)
    return ok


def _workloads(text: str) -> list[str]:
    names = [w for w in text.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"must name workloads of {list(WORKLOADS)}, got {text!r}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps",
        type=int_at_least(2 * LOG_EVERY),
        default=100,
        help=f"training steps per run (>= {2 * LOG_EVERY}: throughput is measured over the logging "
        f"intervals after the first {LOG_EVERY} steps; default 100)",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=3, help="runs per configuration (interleaved; default 3)"
    )
    parser.add_argument("--nproc", type=positive_int, default=2, help="ranks (gloo, CPU; default 2)")
    parser.add_argument(
        "--workloads", type=_workloads, default=list(WORKLOADS), help=f"comma-separated of {list(WORKLOADS)}"
    )
    parser.add_argument(
        "--plans", action="store_true", help="rank the planner's plan against restricted plans (see above)"
    )
    args = parser.parse_args()
    print(hardware_line(threads=1))
    print(f"{args.nproc} ranks x 1 thread, {args.steps} steps per run, {args.repeats} interleaved runs per cell")
    with tempfile.TemporaryDirectory() as d:
        if args.plans:
            if not plan_choice(args, Path(d)):
                sys.exit("the planner's plan is more than 5% slower than the fastest plan measured on some workload")
            return
        rows, eval_rows, ratios = [], [], []
        for workload in args.workloads:
            runs, _ = measure(workload, {**CONFIGS, **EVAL_PLAIN}, args, Path(d))
            rows.append(matrix_row(workload, runs, ratios))
            eval_rows.append(eval_row(workload, runs))
    print_table(["workload", *(label for _, label in CONFIGS.values())], rows)
    print_semi_sync_targets(ratios)
    print()
    print(f"eval throughput (samples/s, median; {EVAL_BATCHES} eval batches per rank, capped by the eval split):")
    print_table(
        ["workload", "recpipe default, eval plain", "recpipe default, eval prefetch", "prefetch / plain", "target"],
        eval_rows,
    )
    if any("failed" in str(c) for r in rows + eval_rows for c in r):
        sys.exit(1)


def matrix_row(workload: str, runs: dict[str, list[dict]], ratios: list[tuple[str, float, float]]) -> list[object]:
    """The matrix's row of ``workload``; appends ``(workload, semi_sync / fused, semi_sync / torchrec)`` to
    ``ratios`` when both were measured."""
    med = {config: median_of(runs[config], "samples_per_s") for config in CONFIGS}
    base, fused = med["torchrec"], med["default"]
    row: list[object] = [WORKLOADS[workload][1]]
    for config in CONFIGS:
        if not runs[config]:
            row.append("failed")
        elif config == "semi_sync":
            row.append(f"{med[config]:.0f} ({med[config] / base:.3f}x; {med[config] / fused:.3f}x fused)")
        else:
            row.append(f"{med[config]:.0f} ({med[config] / base:.3f}x)")
    if runs["semi_sync"] and runs["default"] and runs["torchrec"]:
        ratios.append((workload, med["semi_sync"] / fused, med["semi_sync"] / base))
    return row


def print_semi_sync_targets(ratios: list[tuple[str, float, float]]) -> None:
    """semi_sync / fused: the median over the DLRM rows; semi_sync / torchrec: the median row; each against its target."""
    dlrm = [vs_fused for workload, vs_fused, _ in ratios if "dlrm" in WORKLOADS[workload][0]]  # --model dlrm
    if dlrm:
        median = statistics.median(dlrm)
        print(
            f"semi_sync / fused, median over {len(dlrm)} DLRM row(s): {median:.3f}x "
            f"(target >= {SEMI_SYNC_VS_FUSED:.2f}x: {'met' if median >= SEMI_SYNC_VS_FUSED else 'NOT met'})"
        )
    else:
        print("semi_sync / fused over the DLRM rows: no DLRM row measured")
    if ratios:
        median = statistics.median(vs_torchrec for _, _, vs_torchrec in ratios)
        print(
            f"semi_sync / torchrec, median row of {len(ratios)}: {median:.3f}x "
            f"(target >= {SEMI_SYNC_VS_TORCHREC:.2f}x: {'met' if median >= SEMI_SYNC_VS_TORCHREC else 'NOT met'})"
        )


def eval_row(workload: str, runs: dict[str, list[dict]]) -> list[object]:
    """The eval table's row of ``workload``: plain and prefetch eval samples/s, their ratio against the target."""
    plain, prefetch = (
        median_of(runs["eval_plain"], "eval_samples_per_s"),
        median_of(runs["default"], "eval_samples_per_s"),
    )
    if not (math.isfinite(plain) and math.isfinite(prefetch)):
        return [WORKLOADS[workload][1], "failed", "failed", "-", "-"]
    ratio = prefetch / plain
    met = "met" if ratio >= EVAL_PREFETCH_VS_PLAIN else "NOT met"
    return [
        WORKLOADS[workload][1],
        f"{plain:.0f}",
        f"{prefetch:.0f}",
        f"{ratio:.3f}x",
        f">= {EVAL_PREFETCH_VS_PLAIN:.2f}x: {met}",
    ]


if __name__ == "__main__":
    main()
