"""Benchmark of tiered embedding storage (issue 5) against an untiered FUSED table.

For Zipf(1.05) ids and for MovieLens-100k item ids (from the installed ``recbole``
wheel), measures forward+backward lookups/s of ``TieredEmbeddingShard`` per mode
and cache load factor x in {0.1, 0.2, 0.5, 1.0} next to fbgemm's CPU TBE
(``SplitTableBatchedEmbeddingBagsCodegen``, the kernel behind torchrec's FUSED
compute kernel) with the same optimizer (row-wise Adagrad), the CACHING hit rate
next to the LFU oracle (a static cache of the top floor(x * R) rows by their true
frequency: the Zipf probabilities, or MovieLens counts over all 100k interactions),
a hindsight oracle (top rows by their counts in the measured stream itself, an
upper bound that also profits from sampling noise), and bytes moved between tiers
per step.

Targets (issue 18): on both id streams, every mode and x, forward+backward time
<= 1.10x the FUSED time; CACHING hit rate within 3 points of the LFU oracle.

Usage::

    PYTHONPATH=build/dev .venv/bin/python scripts/bench_storage.py [--rows 100000] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys
import time
from pathlib import Path
from typing import Callable, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import hardware_line, int_at_least, positive_int, print_table, time_it  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen  # noqa: E402

from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig  # noqa: E402

# Zipf exponent of the synthetic ids (issue 5 / TorchEasyRec PR #508: alpha = 1.05).
ZIPF_ALPHA: float = 1.05
LOAD_FACTORS: Tuple[float, ...] = (0.1, 0.2, 0.5, 1.0)
LR: float = 0.01  # fbgemm default learning rate
MOVIELENS_INTERACTIONS: int = 100_000  # ml-100k: ids a MovieLens step may take at most


Batch = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ids, offsets, grad


def zipf_stream(
    rows: int, steps: int, bags: int, pooling: int, dim: int, seed: int
) -> Tuple[torch.Tensor, List[Batch]]:
    """Batches of Zipf(ZIPF_ALPHA) ids; hot ranks scattered over rows by a permutation.

    Returns the true per-row probabilities and the batches."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.arange(1, rows + 1, dtype=torch.float64).pow(-ZIPF_ALPHA)
    perm = torch.randperm(rows, generator=gen)
    out = []
    for _ in range(steps):
        ranks = torch.multinomial(probs, bags * pooling, replacement=True, generator=gen)
        ids = perm[ranks]
        offsets = torch.arange(0, bags * pooling + 1, pooling, dtype=torch.int64)
        out.append((ids, offsets, torch.randn(bags, dim, generator=gen)))
    true_freq = torch.empty(rows, dtype=torch.float64)
    true_freq[perm] = probs / probs.sum()
    return true_freq, out


def movielens_stream(steps: int, bags: int, pooling: int, dim: int, seed: int) -> Tuple[torch.Tensor, List[Batch]]:
    """Item ids of MovieLens-100k interactions in timestamp order, ``pooling`` per bag.

    Returns the true item frequencies (counts over all 100k interactions) and the batches."""
    path = importlib.resources.files("recbole") / "dataset_example" / "ml-100k" / "ml-100k.inter"
    items: List[int] = []
    stamps: List[float] = []
    with path.open() as f:
        next(f)  # header: user_id:token item_id:token rating:float timestamp:float
        for line in f:
            parts = line.split("\t")
            items.append(int(parts[1]) - 1)  # ids 1..1682 -> rows 0..1681
            stamps.append(float(parts[3]))
    order = torch.argsort(torch.tensor(stamps, dtype=torch.float64), stable=True)
    ids_all = torch.tensor(items, dtype=torch.int64)[order]
    rows = int(ids_all.max()) + 1
    per = bags * pooling
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        start = (s * per) % max(1, ids_all.numel() - per)
        ids = ids_all[start : start + per].clone()
        offsets = torch.arange(0, per + 1, pooling, dtype=torch.int64)
        out.append((ids, offsets, torch.randn(bags, dim, generator=gen)))
    return torch.bincount(ids_all, minlength=rows).to(torch.float64), out


def make_tbe(rows: int, dim: int) -> SplitTableBatchedEmbeddingBagsCodegen:
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
    )


def make_shard(rows: int, dim: int, mode: str, x: float) -> TieredEmbeddingShard:
    return TieredEmbeddingShard(
        num_embeddings=rows,
        embedding_dim=dim,
        mode=mode,
        cache_load_factor=x,
        optimizer=TieredOptimizerConfig(optimizer="rowwise_adagrad", learning_rate=LR),
        dist_type="roundrobin",  # W = 1: local id == global id
    )


def step_fn(module: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], stream: List[Batch]) -> Callable[[], None]:
    state = {"i": 0}

    def run() -> None:
        ids, offsets, grad = stream[state["i"] % len(stream)]
        state["i"] += 1
        module(ids, offsets).backward(grad)

    return run


def oracle_hit_rate(stream: List[Batch], freq: torch.Tensor, x: float) -> float:
    """Hit rate on ``stream`` of a static cache of the top floor(x * R) rows by ``freq``."""
    rows = freq.numel()
    counts = torch.zeros(rows, dtype=torch.int64)
    for ids, _, _ in stream:
        counts += torch.bincount(ids, minlength=rows)
    k = int(x * rows + 1e-9)
    top = torch.topk(freq, k).indices if k else torch.zeros(0, dtype=torch.int64)
    return float(counts[top].sum()) / float(counts.sum())


def run_dataset(name: str, freq: torch.Tensor, dim: int, stream: List[Batch], warm: List[Batch], repeat: int) -> None:
    rows = freq.numel()
    ids_per_step = stream[0][0].numel()
    tbe = make_tbe(rows, dim)
    t_ref = time_it(step_fn(tbe, stream), repeat=repeat, warmup=2)
    table = [["FUSED (fbgemm TBE)", "-", f"{ids_per_step / t_ref / 1e6:.3f}", 1.0, "-", "-", "-", "-", "-"]]
    for mode in ("HYBRID", "CACHING"):
        for x in LOAD_FACTORS:
            shard = make_shard(rows, dim, mode, x)
            # hit rate / bytes: warm the cache on `warm`, then measure one pass over `stream`
            for ids, offsets, grad in warm:
                shard(ids, offsets).backward(grad)
            hits = lookups = moved = 0.0
            for ids, offsets, grad in stream:
                shard(ids, offsets).backward(grad)
                st = shard.tier_stats()
                hits += st["hit_rate"] * st["lookups"]
                lookups += st["lookups"]
                moved += st["bytes_moved"]
            hit = hits / lookups
            t = time_it(step_fn(shard, stream), repeat=repeat, warmup=1)
            cache = mode == "CACHING" and x < 1.0
            oracle = oracle_hit_rate(stream, freq, x) if cache else float("nan")
            # hindsight: top rows by their counts in the measured stream itself (an upper bound)
            hindsight = (
                oracle_hit_rate(stream, sum(torch.bincount(b[0], minlength=rows) for b in stream).double(), x)
                if cache
                else float("nan")
            )
            gap = (oracle - hit) * 100 if cache else float("nan")
            table.append(
                [
                    f"{mode}",
                    x,
                    f"{ids_per_step / t / 1e6:.3f}",
                    round(t / t_ref, 3),
                    f"{hit:.4f}",
                    "-" if oracle != oracle else f"{oracle:.4f}",
                    "-" if gap != gap else f"{gap:+.2f}",
                    "-" if hindsight != hindsight else f"{hindsight:.4f}",
                    f"{moved / len(stream) / 1024:.1f}",
                ]
            )
    print(
        f"\n### {name}: R={rows} rows x dim {dim}, {ids_per_step} ids/step "
        f"({len(stream[0][1]) - 1} bags), row-wise Adagrad, fwd+bwd"
    )
    print_table(
        [
            "table",
            "x",
            "Mlookups/s",
            "time / FUSED",
            "hit rate",
            "LFU oracle",
            "oracle - hit (pts)",
            "hindsight oracle",
            "KiB moved/step",
        ],
        table,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rows",
        type=int_at_least(100),
        default=100_000,
        help="Zipf table rows (>= 100: the smallest cache, x = 0.1, needs 10 rows; default 100k)",
    )
    ap.add_argument("--dim", type=positive_int, default=64, help="embedding dim (default 64)")
    ap.add_argument(
        "--bags",
        type=int_at_least(8),
        default=1024,
        help="bags per Zipf step (>= 8: MovieLens steps take bags / 8; default 1024)",
    )
    ap.add_argument("--pooling", type=positive_int, default=16, help="ids per bag (default 16)")
    ap.add_argument(
        "--steps",
        type=positive_int,
        default=40,
        help="warm-up steps, then as many measured steps per stream (default 40)",
    )
    ap.add_argument("--threads", type=positive_int, default=1, help="intra-op threads (default 1)")
    ap.add_argument("--repeat", type=positive_int, default=15, help="timed runs per cell, median (default 15)")
    args = ap.parse_args()
    if args.bags // 8 * args.pooling > MOVIELENS_INTERACTIONS:
        ap.error(
            f"argument --pooling: a MovieLens step takes --bags / 8 x --pooling = "
            f"{args.bags // 8 * args.pooling} ids, more than its {MOVIELENS_INTERACTIONS} interactions; "
            "lower --bags or --pooling"
        )
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(hardware_line())
    print(
        f"fbgemm_gpu TBE on CPU as the untiered FUSED baseline; same process, same batches; "
        f"hit rate measured after {args.steps} warm-up steps; time = median fwd+bwd step."
    )
    t0 = time.perf_counter()
    zfreq, zipf = zipf_stream(args.rows, 2 * args.steps, args.bags, args.pooling, args.dim, seed=1)
    run_dataset(f"Zipf({ZIPF_ALPHA})", zfreq, args.dim, zipf[args.steps :], zipf[: args.steps], args.repeat)
    mfreq, ml = movielens_stream(2 * args.steps, args.bags // 8, args.pooling, args.dim, seed=2)
    run_dataset(
        "MovieLens-100k item ids (timestamp order)", mfreq, args.dim, ml[args.steps :], ml[: args.steps], args.repeat
    )
    print(f"\nwall time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
