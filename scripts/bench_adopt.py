"""Adopting a plain torchrec DCP checkpoint: recpipe's tiered load vs torchrec's own load.

A torchrec job (``--save-world`` gloo CPU ranks, default 8; torchrec's
``EmbeddingBagCollectionSharder``, ROW_WISE FUSED tables, row-wise Adagrad) saves as torchrec
users do::

    torch.distributed.checkpoint.save({**model.state_dict(), "fused_optimizer": model.fused_optimizer.state_dict()})

Then 2 ranks load it, each run in fresh processes (so no run inherits another's freed memory):

* torchrec: the same torchrec model on 2 ranks loads it (``dcp.load`` of that dict, then
  ``fused_optimizer.load_state_dict``): the baseline a torchrec user has today;
* recpipe: a model whose tables are tiered (HYBRID, hash_roundrobin) loads it with
  ``recpipe.pipeline.checkpoint.load(model, dir, verify=False)`` (torchrec writes no digests): each
  rank streams the torchrec tables one saved chunk at a time, checks them, then writes the rows
  it owns chunk by chunk (its extra memory is about one saved chunk, not a whole table);
* recpipe, check_rows=False: the same without the first (checking) read;
* leaving recpipe: the torchrec model loads a checkpoint of the same tables tiered (HYBRID,
  ``recpipe.pipeline.checkpoint.save`` of a 2-rank tiered model) with ``recpipe.pipeline.checkpoint.load``: each
  table is checked, then each rank gathers the rows its shards hold from the tiered exports, one
  table at a time (never every such table whole on every rank at once).

Per run: wall seconds of the slower rank between two barriers, and each rank's peak RSS growth
during the load (``VmHWM`` reset through ``/proc/self/clear_refs`` just before, minus ``VmRSS``
then), the larger rank's. Best of ``--repeat`` runs (their order rotates).

Usage::

    .venv/bin/python scripts/bench_adopt.py                        # 2 x 2M x 64 (1 GB of weights)
    .venv/bin/python scripts/bench_adopt.py --tables 2x1048576x64 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_checkpoint import WORLD, _parse_set, adagrad_ebc  # noqa: E402
from bench_checkpoint import _model as tiered_model
from benchutil import hardware_line, positive_int, print_table, run_workers, writable_dir  # noqa: E402

RUNS = ("torchrec", "recpipe", "recpipe_unchecked", "leave")
LABELS = {
    "torchrec": "torchrec FUSED, torch dcp.load",
    "recpipe": "recpipe tiered, dcp.load",
    "recpipe_unchecked": "recpipe tiered, check_rows=False",
    "leave": "torchrec FUSED, recpipe dcp.load of tiered",
}


def _torchrec_model(n_tables: int, rows: int, dim: int, world: int = WORLD) -> Any:
    """Plain torchrec: ROW_WISE FUSED row-wise Adagrad tables, torchrec's own sharder."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    ebc, names = adagrad_ebc(n_tables, rows, dim)
    sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        ebc,
        {n: row_wise() for n in names},
        sharder=sharder,  # type: ignore[arg-type]
        local_size=world,
        world_size=world,
        device_type="cpu",
    )
    return DistributedModelParallel(
        ebc,
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )


def _torchrec_state(model: Any) -> Dict[str, Any]:
    return {**model.state_dict(), "fused_optimizer": model.fused_optimizer.state_dict()}


def _memory_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _worker(
    rank: int, world: int, port: int, run: str, table_set: Tuple[int, int, int], checkpoint: str, queue: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")  # torchrec's deprecation warnings, once per rank
    try:  # everything inside: a failure always reaches the parent
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        import torch.distributed.checkpoint as tdcp

        from recpipe.pipeline import checkpoint as recpipe_dcp

        if run == "save":  # the torchrec user's checkpoint (random init is enough: rows are copied, not trained)
            tdcp.save(_torchrec_state(_torchrec_model(*table_set, world=world)), checkpoint_id=checkpoint)
            queue.put((rank, None, None))
            return
        if run == "save_tiered":  # the same tables tiered, saved by recpipe
            recpipe_dcp.save(tiered_model(*table_set, "HYBRID", 0.5), checkpoint + "_tiered")
            queue.put((rank, None, None))
            return
        if run == "leave":
            model = _torchrec_model(*table_set)

            def load() -> None:
                recpipe_dcp.load(model, checkpoint + "_tiered")
        elif run == "torchrec":
            model = _torchrec_model(*table_set)

            def load() -> None:
                state = _torchrec_state(model)
                tdcp.load(state, checkpoint_id=checkpoint)
                model.fused_optimizer.load_state_dict(state["fused_optimizer"])
        else:
            model = tiered_model(*table_set, "HYBRID", 0.5)

            def load() -> None:
                recpipe_dcp.load(
                    model, checkpoint, verify=False, check_rows=False if run == "recpipe_unchecked" else None
                )

        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        rss0 = _memory_kb("VmRSS")
        t0 = time.perf_counter()
        load()
        dist.barrier()
        seconds = time.perf_counter() - t0
        queue.put((rank, {"s": seconds, "peak_mb": (_memory_kb("VmHWM") - rss0) / 1024}, None))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        import traceback

        queue.put((rank, None, f"{exc!r}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(run: str, table_set: Tuple[int, int, int], checkpoint: str, world: int = WORLD) -> Dict[int, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, run, table_set, checkpoint, queue)) for r in range(world)
    ]
    return run_workers(procs, queue, run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tables",
        type=_parse_set,
        default=_parse_set("2x2097152x64"),
        help="table set TABLESxROWSxDIM (default 2x2097152x64: 1 GB of fp32 weights)",
    )
    parser.add_argument(
        "--save-world",
        type=positive_int,
        default=8,
        help="ranks of the saving torchrec job (its ROW_WISE chunks: a table / this; default 8)",
    )
    parser.add_argument("--repeat", type=positive_int, default=2, help="runs of each load (best of; default 2)")
    parser.add_argument(
        "--dir",
        type=writable_dir,
        default=None,
        help="existing directory to checkpoint into (default: a temporary one on /tmp's disk)",
    )
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench_adopt_", dir=args.dir)
    checkpoint = os.path.join(root, "torchrec")
    results: Dict[str, List[Dict[int, Any]]] = {run: [] for run in RUNS}
    try:
        _spawn("save", args.tables, checkpoint, world=args.save_world)
        _spawn("save_tiered", args.tables, checkpoint)
        for i in range(args.repeat):
            for run in RUNS[i % len(RUNS) :] + RUNS[: i % len(RUNS)]:  # rotate which goes first
                results[run].append(_spawn(run, args.tables, checkpoint))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    n_tables, rows, dim = args.tables
    weights_mb = n_tables * rows * dim * 4 / 2**20
    table_mb = rows * dim * 4 / 2**20
    print(hardware_line(threads=1) + f"; {WORLD} gloo ranks; checkpoint in {os.path.dirname(root)}")
    print(
        f"checkpoint of {args.save_world} ranks: {n_tables} x {rows:,} x {dim} ROW_WISE FUSED row-wise Adagrad fp32 "
        f"tables ({weights_mb:,.0f} MB of weights; one table {table_mb:,.0f} MB, one saved chunk "
        f"{table_mb / args.save_world:,.0f} MB, one loading rank's rows {table_mb / WORLD:,.0f} MB); best of "
        f"{args.repeat}; s = slower rank between barriers; peak = the larger rank's RSS growth"
    )
    base = {k: min(max(r[k] for r in res.values()) for res in results["torchrec"]) for k in ("s", "peak_mb")}
    table = []
    for run in RUNS:
        s = min(max(r["s"] for r in res.values()) for res in results[run])
        peak = min(max(r["peak_mb"] for r in res.values()) for res in results[run])
        table.append([LABELS[run], s, s / base["s"], peak, peak / base["peak_mb"]])
    print_table(["load", "s", "x torchrec s", "peak RSS MB", "x torchrec peak"], table)


if __name__ == "__main__":
    main()
