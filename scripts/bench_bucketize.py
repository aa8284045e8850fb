"""Benchmark: torch.ops.recpipe.block_bucketize_sparse_features vs fbgemm's CPU op.

1M keys over F=8 features (bag lengths uniform in [0, 64], ids uniform over
10M-row tables, int64), for W in {2, 8, 64}, sequence off/on, 1 thread and all
threads, and three inputs:

* plain: every feature has the same batch size (the 12 cells of issue 20);
* vbe: a variable batch per feature (``batch_size_per_feature``; each feature
  keeps 50-100% of the bags), as torchrec's VBE KeyedJaggedTensors;
* pos: uneven row-wise shards (``block_bucketize_pos``: each table cut at W - 1
  random rows), continuous only.

Columns (Mkeys/s = 1e6 keys per second, best of interleaved repeats):

* fbgemm: ``torch.ops.fbgemm.block_bucketize_sparse_features`` with the same
  arguments (continuous; fbgemm-gpu-cpu runs it on one thread whatever torch's
  thread count).
* cont / rr / hash: recpipe continuous, roundrobin, hash_roundrobin.
* x fbgemm: cont time ratio (fbgemm time / ours). Target >= 3 in every cell.
* hash/cont: hash_roundrobin time over continuous time. Target <= 1.3.

Timing: every variant of a cell is warmed twice, then the variants run
interleaved, ``--repeat`` rounds, each in a fresh random order (seeded), and each
keeps its BEST round: the machine is shared, and the best of interleaved rounds
compares every variant at its least disturbed. ``--isa`` forces the build of
recpipe's hash-key loop (RECPIPE_ISA: avx512, avx2, baseline).

Heap (``--heap``): both ops allocate their outputs (up to 24 MB a call here)
and Python frees them after the call. With glibc's defaults the freed top of
the heap is often returned to the OS and every later call page-faults its
outputs afresh (for fbgemm and recpipe alike). ``steady`` (default) sets
M_MMAP_THRESHOLD = M_TRIM_THRESHOLD = 1 GiB for this process with mallopt, so
freed buffers are reused, as in a long-running trainer on a tuned allocator
(jemalloc/tcmalloc, or the same MALLOC_*_THRESHOLD_ environment variables);
``default`` keeps glibc's settings. The line above the table says which.

Usage: python scripts/bench_bucketize.py [--keys 1000000] [--repeat 15] [--isa auto] [--heap steady]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fbgemm_gpu  # noqa: E402,F401
from benchutil import hardware_line, int_at_least, positive_int, print_table  # noqa: E402

from recpipe.pipeline.routing import ops  # noqa: E402

F = 8
TABLE_ROWS = 10_000_000  # rows per feature table
M_TRIM_THRESHOLD = -1  # glibc malloc.h mallopt parameters
M_MMAP_THRESHOLD = -3
STEADY_HEAP_BYTES = 1 << 30


def steady_heap() -> str:
    """Keeps freed buffers in this process's heap (glibc mallopt); returns what was set."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, STEADY_HEAP_BYTES) and libc.mallopt(M_TRIM_THRESHOLD, STEADY_HEAP_BYTES)
    except (OSError, AttributeError):
        ok = 0
    if not ok:
        return "heap: glibc defaults (mallopt unavailable: not glibc?)"
    return "heap: steady (mallopt M_MMAP_THRESHOLD = M_TRIM_THRESHOLD = 1 GiB: outputs reuse freed memory)"


def make_inputs(keys: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B = max(1, keys // (F * 32))
    lengths = torch.randint(0, 65, (F * B,), generator=g, dtype=torch.int64)
    # trim/pad the last bags so the total is exactly `keys`
    diff = keys - int(lengths.sum())
    i = lengths.numel() - 1
    while diff != 0:
        step = max(-int(lengths[i]), min(64 - int(lengths[i]), diff))
        lengths[i] += step
        diff -= step
        i -= 1
    indices = torch.randint(0, TABLE_ROWS, (keys,), generator=g, dtype=torch.int64)
    return lengths, indices


def best_times(fns: dict[str, Callable[[], object]], *, repeat: int, warmup: int = 2) -> dict[str, float]:
    """Best wall seconds of each callable over ``repeat`` interleaved rounds.

    Args:
        fns: name -> zero-argument callable (one variant of the cell).
        repeat: timed rounds; each round runs every variant once, in an
            order shuffled afresh per round (seeded), so each variant follows
            each of the others about equally often.
        warmup: untimed runs of each variant first (allocator, caches, page faults).

    Returns:
        name -> best (minimum) seconds over the rounds.

    Example::

        best_times({"a": lambda: x.clone(), "b": lambda: y.clone()}, repeat=5)
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = {name: float("inf") for name in fns}
    names = list(fns)
    rng = random.Random(0)
    for _ in range(repeat):
        rng.shuffle(names)
        for name in names:
            fn = fns[name]
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def vbe_inputs(
    lengths: torch.Tensor, indices: torch.Tensor, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain inputs with each feature keeping its first 50-100% of bags (VBE)."""
    g = torch.Generator().manual_seed(seed)
    B = lengths.numel() // F
    keep = torch.randint(B // 2, B + 1, (F,), generator=g)
    per_feature = lengths.view(F, B)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    new_lengths, new_indices = [], []
    for f in range(F):
        b = int(keep[f])
        start = int(offsets[f * B])
        new_lengths.append(per_feature[f, :b])
        new_indices.append(indices[start : start + int(per_feature[f, :b].sum())])
    return torch.cat(new_lengths), torch.cat(new_indices), keep


def uneven_bounds(W: int, seed: int = 2) -> list[torch.Tensor]:
    """Per feature, a 10M-row table cut at W - 1 random rows."""
    g = torch.Generator().manual_seed(seed + W)
    out = []
    for _ in range(F):
        cuts = torch.sort(torch.randint(0, TABLE_ROWS, (W - 1,), generator=g)).values
        out.append(torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([TABLE_ROWS])]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--keys", type=int_at_least(F * 64), default=1_000_000, help=f"ids per call (>= {F * 64}; default 1M)"
    )
    ap.add_argument("--repeat", type=positive_int, default=15, help="timed rounds per cell, best of (default 15)")
    ap.add_argument(
        "--worlds",
        type=positive_int,
        nargs="+",
        default=[2, 8, 64],
        help="world sizes W, one row group each (default 2 8 64)",
    )
    ap.add_argument(
        "--isa",
        choices=["auto", "avx512", "avx2", "baseline"],
        default="auto",
        help="build of recpipe's hash-key loop (sets RECPIPE_ISA)",
    )
    ap.add_argument(
        "--heap",
        choices=["steady", "default"],
        default="steady",
        help="steady: freed outputs stay in the heap (see the module docstring); default: glibc's",
    )
    args = ap.parse_args()
    os.environ["RECPIPE_ISA"] = args.isa
    heap = steady_heap() if args.heap == "steady" else "heap: glibc defaults (freed outputs may be returned to the OS)"

    all_threads = os.cpu_count() or 1
    lengths, indices = make_inputs(args.keys)
    v_lengths, v_indices, v_batch = vbe_inputs(lengths, indices)
    print(hardware_line())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"recpipe hash-key build: RECPIPE_ISA={args.isa}; 1-min load average before the run: {load:.2f} "
        f"(other jobs on the {all_threads} cores make the {all_threads}-thread rows noisy)"
    )
    print(heap)
    print(
        f"fbgemm_gpu {getattr(fbgemm_gpu, '__version__', '?')}; {args.keys} keys, F={F}, "
        f"B={lengths.numel() // F}, int64 ids over {TABLE_ROWS} rows/table; vbe: {v_indices.numel()} keys, "
        f"batch per feature {v_batch.tolist()}"
    )
    rows = []
    sizes = torch.full((F,), TABLE_ROWS, dtype=torch.int64)
    for threads in sorted({1, all_threads}):
        torch.set_num_threads(threads)
        for W in args.worlds:
            block = torch.full((F,), -(-TABLE_ROWS // W), dtype=torch.int64)
            cells = [("plain", False), ("plain", True)]
            if W == 8:
                cells += [("vbe", False), ("pos", False)]
            for kind, seq in cells:
                ln, ids = (v_lengths, v_indices) if kind == "vbe" else (lengths, indices)
                extra: dict = {}
                if kind == "vbe":
                    extra = dict(batch_size_per_feature=v_batch, max_B=int(v_batch.max()))
                if kind == "pos":
                    extra = dict(block_bucketize_pos=uneven_bounds(W))

                def ours(code: int) -> Callable[[], object]:
                    dt = torch.full((F,), code, dtype=torch.int64)
                    return lambda: ops.block_bucketize_sparse_features(
                        ln, ids, block, dt, W, sequence=seq, table_sizes=sizes, seed=1, **extra
                    )

                fns = {
                    "fbgemm": lambda: torch.ops.fbgemm.block_bucketize_sparse_features(
                        ln, ids, False, seq, block, W, None, **extra
                    ),
                    "cont": ours(0),
                }
                if kind != "pos":
                    fns["rr"] = ours(1)
                    fns["hash"] = ours(2)
                t = best_times(fns, repeat=args.repeat)
                mk = ids.numel() / 1e6
                rows.append(
                    [
                        threads,
                        W,
                        kind,
                        "on" if seq else "off",
                        mk / t["fbgemm"],
                        mk / t["cont"],
                        t["fbgemm"] / t["cont"],
                        mk / t["rr"] if "rr" in t else "-",
                        mk / t["hash"] if "hash" in t else "-",
                        t["hash"] / t["cont"] if "hash" in t else "-",
                    ]
                )
    print_table(
        ["threads", "W", "input", "seq", "fbgemm Mk/s", "cont Mk/s", "x fbgemm", "rr Mk/s", "hash Mk/s", "hash/cont"],
        rows,
    )
    worst = min(r[6] for r in rows)
    worst_hash = max(r[9] for r in rows if r[9] != "-")
    print(
        f"targets: x fbgemm >= 3 in every cell (worst {worst:.2f}, {sum(r[6] >= 3 for r in rows)}/{len(rows)} "
        f"cells meet it); hash/cont <= 1.3 (worst {worst_hash:.2f})"
    )


if __name__ == "__main__":
    main()
