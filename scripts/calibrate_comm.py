"""Measures the constants of the planner's communication model on this machine.

Prints the three numbers of ``recpipe.planner.communication.CommConstants`` (to store, with this
machine's line, in ``GLOO_CPU`` or a constants object of your own):

* ``network_bw`` (bytes/ms): payload bandwidth of ``all_to_all_single`` between ``--nproc`` gloo
  ranks (1 thread each), the slope of a least-squares line through the times of 256 KiB .. 16 MiB
  messages (the intercept, the fixed latency of a collective, is printed too);
* ``bucketize_ns`` (ns/id): ``torch.ops.recpipe.block_bucketize_sparse_features`` with
  hash_roundrobin routing of 1M ids over ``--nproc`` ranks, one thread;
* ``bag_ns`` (ns/bag): ``embedding_bag`` (sum) time per bag beyond its rows: 64K bags of 1 id
  against 1 bag of 64K ids, dim 64, one thread.

Usage: python scripts/calibrate_comm.py [--nproc 2] [--repeat 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchutil import hardware_line, positive_int, run_workers, time_it

#: Message sizes of the bandwidth fit, bytes per rank (all of it leaves for the other ranks).
SIZES: tuple[int, ...] = tuple(2**k for k in range(18, 25))
#: Ids routed, and bags pooled, per timed call.
IDS: int = 1 << 20
BAGS: int = 1 << 16


def _a2a_worker(rank: int, nproc: int, repeat: int, port: int, q: mp.Queue) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc)
        out = []
        for size in SIZES:
            x = torch.zeros(size // 4, dtype=torch.float32)
            y = torch.empty_like(x)
            samples = []
            for i in range(repeat + 2):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_to_all_single(y, x)
                if i >= 2:
                    samples.append(time.perf_counter() - t0)
            out.append(statistics.median(samples) * 1e3)
        dist.destroy_process_group()
        q.put((rank, out, None))
    except Exception as e:  # noqa: BLE001 (reported to the parent)
        q.put((rank, None, repr(e)))


def network_bandwidth(nproc: int, repeat: int) -> tuple[float, float]:
    """``(bytes/ms, latency ms)``: least-squares fit of all-to-all time against remote bytes per rank."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_a2a_worker, args=(r, nproc, repeat, port, q)) for r in range(nproc)]
    times = run_workers(procs, q, "all_to_all")
    ms = np.max(np.array([times[r] for r in range(nproc)]), axis=0)
    remote = np.array(SIZES, dtype=np.float64) * (nproc - 1) / nproc
    slope, intercept = np.polyfit(remote, ms, 1)
    return 1.0 / slope, float(intercept)


def bucketize_ns(nproc: int, repeat: int) -> float:
    """ns per id of hash_roundrobin routing over ``nproc`` ranks."""
    from recpipe.pipeline.routing.ops import block_bucketize_sparse_features, dist_type_code

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    lengths = torch.ones(IDS, dtype=torch.int64)
    ids = torch.randint(0, 10_000_000, (IDS,), generator=g)
    one = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731

    def call() -> None:
        block_bucketize_sparse_features(
            lengths,
            ids,
            one(-(-10_000_000 // nproc)),
            one(dist_type_code("hash_roundrobin")),
            nproc,
            table_sizes=one(10_000_000),
        )

    return time_it(call, repeat=repeat) / IDS * 1e9


def bag_ns(repeat: int) -> float:
    """ns per bag of ``embedding_bag`` beyond the rows it reads."""
    torch.set_num_threads(1)
    weight = torch.randn(1_000_000, 64)
    ids = torch.randint(0, 1_000_000, (BAGS,), generator=torch.Generator().manual_seed(1))
    many = torch.arange(BAGS, dtype=torch.int64)
    one = torch.zeros(1, dtype=torch.int64)
    t_many = time_it(lambda: torch.nn.functional.embedding_bag(ids, weight, many, mode="sum"), repeat=repeat)
    t_one = time_it(lambda: torch.nn.functional.embedding_bag(ids, weight, one, mode="sum"), repeat=repeat)
    return max(t_many - t_one, 0.0) / BAGS * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=positive_int, default=2, help="gloo ranks of the all-to-all (default 2)")
    parser.add_argument("--repeat", type=positive_int, default=9, help="timed calls per measurement (default 9)")
    args = parser.parse_args()
    if args.nproc < 2:
        parser.error("--nproc must be >= 2: an all-to-all over one rank moves nothing")
    print(hardware_line(threads=1))
    bw, latency = network_bandwidth(args.nproc, args.repeat)
    print(f"network_bw   = {bw:.4g} bytes/ms  (all_to_all_single, {args.nproc} gloo ranks; latency {latency:.3f} ms)")
    print(f"bucketize_ns = {bucketize_ns(args.nproc, args.repeat):.3g} ns/id  (hash_roundrobin, 1 thread)")
    print(f"bag_ns       = {bag_ns(args.repeat):.3g} ns/bag  (embedding_bag sum, dim 64, 1 thread)")


if __name__ == "__main__":
    main()
