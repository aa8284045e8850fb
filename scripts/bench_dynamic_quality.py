"""Quality of dynamic tables (issue 50): eval AUROC of ``--dynamic-tables`` against hashed static tables of the
same memory, on the raw-key stream ``synthetic_raw_keys``.

The recipe (``recpipe.recipes.train.run``, in this process, one rank, ``--model dlrm``, 26 tables) runs twice on
the same data, steps and seed:

* ``dynamic``: every table dynamic (``--dynamic-tables``): capacity ``--capacity`` rows, so its shard holds
  ``slots = dynamic_local_slots(capacity, 1)`` rows (whole buckets of 16) plus its hash index
  (``dynamic_index_bytes(slots)``: a key and a score per slot, a header per bucket); lru eviction.
* ``static``: every table a static table looked up by ``key mod rows`` (the hashing trick), with ``rows`` the
  dynamic table's bytes over the bytes of one row (values and row-wise Adagrad state): ``(slots * row_bytes +
  index_bytes) // row_bytes``, so the static table spends the dynamic one's index on more rows.

Both keep every row in the fast tier (the quality of a tiered table does not depend on its tiers) and evaluate on
the stream's held-out split after the last step. The table prints both AUROCs, their ratio, each table's rows and
bytes, and the dynamic tables' keys held and evicted (summed over the 26 tables, from the run's TensorBoard
``dynamic/<table>/<counter>`` scalars). Target: dynamic AUROC >= static AUROC.

Usage::

    PYTHONPATH=build/dev .venv/bin/python scripts/bench_dynamic_quality.py [--steps 1000] [--capacity 16384]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import hardware_line, int_at_least, print_table  # noqa: E402

#: The dynamic tables' key-index counters summed into the table (``dynamic/<table>/<counter>`` scalars).
SUMMED_COUNTERS: tuple[str, ...] = ("occupancy", "evicted")
#: A fast tier that holds every table of the runs, MiB.
ALL_FAST_MB: float = 1_000_000.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int_at_least(10), default=1000, help="training steps of each run")
    p.add_argument("--batch-size", type=int_at_least(16), default=512, help="samples per step")
    p.add_argument("--keys", type=int_at_least(2), default=100_000, help="distinct keys of every feature")
    p.add_argument("--capacity", type=int_at_least(16), default=16384, help="rows of each dynamic table")
    p.add_argument("--dim", type=int_at_least(1), default=16, help="embedding dimension")
    p.add_argument("--eval-batches", type=int_at_least(1), default=40, help="evaluation batches of --batch-size")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the stream, the teacher and the models")
    p.add_argument("--threads", type=int_at_least(1), default=1, help="intra-op threads")
    return p.parse_args(argv)


def same_memory_rows(capacity: int, dim: int) -> tuple[int, int, int, int]:
    """``(slots, dynamic bytes, static rows, bytes per row)`` of a dynamic table of ``capacity`` rows on one rank.

    The dynamic table's bytes are its slots' rows (fp32 values and row-wise Adagrad state) plus its hash index;
    the static table of the same bytes has ``bytes // row_bytes`` rows.
    """
    import torch

    from recpipe.pipeline.placement import dynamic_index_bytes, dynamic_local_slots, row_bytes

    per_row = row_bytes(dim, torch.float32, "rowwise_adagrad")
    slots = dynamic_local_slots(capacity, 1)
    total = slots * per_row + dynamic_index_bytes(slots)
    return slots, total, total // per_row, per_row


def train_config(args: argparse.Namespace, *, dynamic: bool, rows: int, tb_dir: str) -> Any:
    """The recipe's config of one run: ``rows`` per table (a dynamic table's capacity)."""
    from recpipe.recipes.config import TrainConfig

    return TrainConfig(
        model="dlrm",
        dataset="synthetic_raw_keys",
        dynamic_tables=dynamic,
        num_embeddings=rows,
        synthetic_id_space=args.keys,
        embedding_dim=args.dim,
        dense_arch=(32, args.dim),
        over_arch=(32, 1),
        batch_size=args.batch_size,
        max_steps=args.steps,
        eval_batches=args.eval_batches,
        fast_tier_mb=ALL_FAST_MB,
        seed=args.seed,
        num_threads=args.threads,
        log_every=max(1, args.steps // 4),
        progress_bar=False,
        tb_dir=tb_dir,
    )


def last_counters(tb_dir: str) -> dict[str, float]:
    """Every :data:`SUMMED_COUNTERS` counter at the run's last logged step, summed over the tables (NaN if none)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    out: dict[str, float] = {}
    for counter in SUMMED_COUNTERS:
        mine = [t for t in tags if t.startswith("dynamic/") and t.endswith(f"/{counter}")]
        out[counter] = sum(acc.Scalars(t)[-1].value for t in mine) if mine else float("nan")
    return out


def run_one(args: argparse.Namespace, *, dynamic: bool, rows: int, workdir: Path) -> tuple[float, float, dict]:
    """``(eval AUROC, seconds, dynamic counters)`` of one recipe run."""
    from recpipe.recipes.train import run

    tb_dir = str(workdir / ("dynamic" if dynamic else "static"))
    t0 = time.perf_counter()
    result = run(train_config(args, dynamic=dynamic, rows=rows, tb_dir=tb_dir))
    seconds = time.perf_counter() - t0
    counters = last_counters(tb_dir) if dynamic else {c: float("nan") for c in SUMMED_COUNTERS}
    print(f"{'dynamic' if dynamic else 'static'}: auroc {result.final_auroc:.4f} in {seconds:.0f} s", flush=True)
    return result.final_auroc, seconds, counters


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # every table is dynamic: torchrec's first-batch notice that raw keys leave [0, num_embeddings) is expected
    logging.getLogger("torchrec.sparse.jagged_tensor_validator").setLevel(logging.ERROR)
    slots, table_bytes, static_rows, per_row = same_memory_rows(args.capacity, args.dim)
    print(
        f"synthetic_raw_keys: 26 features x {args.keys} keys, {args.steps} steps of {args.batch_size}, eval "
        f"{args.eval_batches} batches, dim {args.dim}, seed {args.seed}; dynamic capacity {args.capacity} "
        f"({slots} slots), static rows {static_rows}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        dyn_auc, dyn_s, counters = run_one(args, dynamic=True, rows=args.capacity, workdir=Path(tmp))
        static_auc, static_s, _ = run_one(args, dynamic=False, rows=static_rows, workdir=Path(tmp))
    mib, static_mib = table_bytes / 2**20, static_rows * per_row / 2**20
    held, evicted = (f"{counters[c]:.0f}" for c in SUMMED_COUNTERS)
    rows = [
        ["dynamic (lru)", slots, f"{mib:.3f}", held, evicted, f"{dyn_auc:.4f}", f"{dyn_auc / static_auc:.4f}"],
        ["static (key mod rows)", static_rows, f"{static_mib:.3f}", "-", "-", f"{static_auc:.4f}", "1.0000"],
    ]
    print(hardware_line(args.threads))
    headers = ["tables", "rows per table", "MiB per table", "keys held", "keys evicted", "eval AUROC", "vs static"]
    print_table(headers, rows)
    print(f"run time: dynamic {dyn_s:.0f} s, static {static_s:.0f} s")
    met = dyn_auc >= static_auc
    print(f"target dynamic AUROC >= static AUROC of the same memory: {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
