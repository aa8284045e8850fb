"""Benchmark: the recipe's ``--pipeline semi_sync`` vs ``fused`` vs torchrec, 2 gloo ranks, CPU.

The workload is the recipe (``recpipe.recipes.train.run``) on the synthetic Criteo-like DLRM stream:
26 tables of ``--rows`` rows x 64, batch ``--batch-size`` per rank, 1 intra-op thread per rank. Each
configuration runs in two fresh spawned processes (one per rank), interleaved ``--repeats`` times:

* ``torchrec``: ``--placement table_wise --pipeline sparse``: torchrec's sharder (FUSED tables placed
  whole) and ``TrainPipelineSparseDist``: the baseline of the speed ratios;
* ``fused``: the recipe's default: recpipe's planner and ``TrainPipelineFusedSparseDist`` (exact);
* ``semi_sync``: the same placement and ``TrainPipelineSemiSync``, synchronous for
  ``--start-batch`` steps, then each batch looked up from tables one step stale.

Columns: median ms per step (the recipe's throughput, without its first logging interval), the
ratio of the torchrec and fused step times to it, the eval AUROC after ``--steps`` steps (every
configuration trains on the same data from the same seed; ``--eval-batches`` batches per rank),
its difference from ``fused`` (target: semi_sync within 0.003), and the largest peak RSS of a
rank (``ru_maxrss``; semi-sync keeps one more batch's embeddings alive).

Usage::

    python scripts/bench_semi_sync.py                       # ~5 min on 2 busy cores
    python scripts/bench_semi_sync.py --steps 60 --repeats 1 --rows 20000   # quick
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import traceback
from typing import Any, Dict, List

import torch.multiprocessing as mp
from benchutil import hardware_line, int_at_least, positive_int, print_table, run_workers

#: name -> (recipe config fields, label); the first is the baseline of the speed ratios.
CONFIGS: Dict[str, tuple[Dict[str, Any], str]] = {
    "torchrec": ({"placement": "table_wise", "pipeline": "sparse"}, "torchrec table-wise FUSED + SparseDist"),
    "fused": ({"pipeline": "fused"}, "recpipe planned + fused (exact)"),
    "semi_sync": ({"pipeline": "semi_sync"}, "recpipe planned + semi_sync"),
}
AUROC_TARGET = 0.003  # |semi_sync - fused| eval AUROC
LOG_EVERY = 10  # the recipe's throughput leaves out the first logging interval


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, fields: Dict[str, Any], q: Any) -> None:
    """Runs the recipe on ``rank`` and reports ``(rank, {ms_per_step, auroc, rss_mib}, error)``."""
    try:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"
        )
        from recpipe.recipes.config import TrainConfig
        from recpipe.recipes.train import run

        result = run(TrainConfig(**fields))
        global_batch = fields["batch_size"] * world
        report = {
            "ms_per_step": 1000.0 * global_batch / result.samples_per_s,
            "auroc": result.final_auroc,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        }
        q.put((rank, report, None))
    except Exception:  # noqa: BLE001 - reported to the parent, which stops the script
        q.put((rank, None, traceback.format_exc()))


def _run_config(args: argparse.Namespace, name: str) -> Dict[int, Any]:
    fields = dict(
        model="dlrm",
        dataset="synthetic",
        synthetic_id_space=args.rows * 26 * 2,
        num_embeddings=args.rows,
        batch_size=args.batch_size,
        max_steps=args.steps,
        eval_batches=args.eval_batches,
        log_every=LOG_EVERY,
        progress_bar=False,
        num_threads=1,
        **CONFIGS[name][0],
    )
    if name == "semi_sync":
        fields["semi_sync_start_batch"] = args.start_batch
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, fields, q)) for r in range(2)]
    return run_workers(procs, q, what=name)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int_at_least(3 * LOG_EVERY), default=300, help="training steps per run")
    p.add_argument("--repeats", type=positive_int, default=2, help="interleaved runs of every configuration")
    p.add_argument("--rows", type=int_at_least(1000), default=100_000, help="rows of each of the 26 tables")
    p.add_argument("--batch-size", type=positive_int, default=512, help="samples per rank per step")
    p.add_argument("--eval-batches", type=positive_int, default=40, help="eval batches per rank")
    p.add_argument("--start-batch", type=int_at_least(0), default=20, help="semi_sync's synchronous steps")
    args = p.parse_args()
    if args.start_batch >= args.steps:
        p.error(
            f"argument --start-batch: {args.start_batch} must be below --steps {args.steps}, or semi_sync never starts"
        )
    return args


def main() -> None:
    args = _parse()
    print(hardware_line(threads=1), flush=True)
    runs: Dict[str, List[Dict[int, Any]]] = {name: [] for name in CONFIGS}
    for r in range(args.repeats):
        for name in CONFIGS:
            out = _run_config(args, name)
            runs[name].append(out)
            print(f"round {r + 1} {name}: {out[0]['ms_per_step']:.1f} ms/step, auroc {out[0]['auroc']:.4f}", flush=True)
    ms = {n: statistics.median(o[0]["ms_per_step"] for o in runs[n]) for n in CONFIGS}
    auroc = {n: runs[n][0][0]["auroc"] for n in CONFIGS}  # same data and seed every repeat: the first run's
    rss = {n: max(o[rank]["rss_mib"] for o in runs[n] for rank in o) for n in CONFIGS}
    rows = [
        [
            CONFIGS[n][1],
            ms[n],
            f"{ms['torchrec'] / ms[n]:.3f}x",
            f"{ms['fused'] / ms[n]:.3f}x",
            f"{auroc[n]:.4f}",
            f"{auroc[n] - auroc['fused']:+.4f}",
            f"{rss[n]:.0f}",
        ]
        for n in CONFIGS
    ]
    print(
        f"\nsynthetic DLRM, 26 tables x {args.rows} rows x 64, batch {args.batch_size} per rank, 2 gloo ranks, "
        f"{args.steps} steps, semi_sync start {args.start_batch}, median of {args.repeats}"
    )
    print_table(
        ["pipeline", "ms/step", "vs torchrec", "vs fused", "eval AUROC", "AUROC - fused", "peak RSS/rank MiB"], rows
    )
    gap = abs(auroc["semi_sync"] - auroc["fused"])
    print(f"semi_sync AUROC within {AUROC_TARGET} of fused: {'yes' if gap <= AUROC_TARGET else 'NO'} ({gap:.4f})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
