"""Benchmark of dynamic tables (issue 50): the cost of dynamism, memory per row and insert scale.

* cost: forward+backward of a dynamic shard (raw keys: Zipf(1.05) ranks scrambled over the int64 range)
  next to the static tiered shard of the same capacity looked up by ids that are a fixed random
  permutation of the ranks (a static table's ids of raw values: hot rows scattered over the table as a
  dynamic table's slots are; same rows, same hit rates: every key fits), ``native`` backend, HYBRID x = 1
  and CACHING 0.2, row-wise Adagrad, in the same process, timed in ``--repeat`` alternating rounds of 8 steps
  each (the ratio: the median of the rounds' ratios). Target: dynamic <= 1.5x static.
* memory: bytes per slot measured from the allocated tensors (rows, state, index) next to the planner's
  formula (``shard_storage`` of the slots plus ``dynamic_index_bytes``), and the index metadata per slot.
  Targets: within 5% of the formula; metadata <= 24 B per row.
* scale: ``--scale-keys`` distinct keys inserted into 2 shards (keys split by owner as the raw-key
  routing does, each shard sized for load factor ``--load-factor``), in batches; failed inserts and inserts/s.
  Target: 10M keys, load factor <= 0.9, no failed insert.

Usage::

    PYTHONPATH=build/dev .venv/bin/python scripts/bench_dynamic.py [--capacity 1000000] [--scale-keys 10000000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import hardware_line, int_at_least, print_table, unit_fraction  # noqa: E402

from recpipe.pipeline.placement import DynamicTableOptions, dynamic_index_bytes, shard_storage  # noqa: E402
from recpipe.pipeline.tiered.dynamic.dynamic_shard import DynamicEmbeddingShard  # noqa: E402
from recpipe.pipeline.tiered.dynamic.key_hashing import mix64  # noqa: E402
from recpipe.pipeline.tiered.optim import TieredOptimizerConfig  # noqa: E402
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard  # noqa: E402
from recpipe.pipeline.tiered.shard_routing import WholeTableRouting  # noqa: E402


def zipf_ranks(n: int, rows: int, gen: torch.Generator, alpha: float = 1.05) -> torch.Tensor:
    """``n`` Zipf(alpha) ranks in ``[0, rows)``."""
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-alpha)
    return torch.multinomial(weights, n, replacement=True, generator=gen)


def scramble(ranks: torch.Tensor) -> torch.Tensor:
    """Raw int64 keys of ranks: a bijective mix (negatives and large values)."""
    return mix64(ranks + 0x5DEECE66D)


def _optimizer() -> TieredOptimizerConfig:
    return TieredOptimizerConfig(optimizer="rowwise_adagrad", learning_rate=0.01)


def interleaved(
    base: Callable[[], None], other: Callable[[], None], rounds: int, steps: int
) -> Tuple[float, float, float]:
    """Median seconds per call of ``base`` and ``other`` and the median of their per-round ratio (other / base),
    timed in alternating rounds of ``steps`` calls each (the machine's speed drifts between rounds, not within)."""
    base(), other()  # warm
    tb: List[float] = []
    to: List[float] = []
    for _ in range(rounds):
        for fn, out in ((base, tb), (other, to)):
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            out.append((time.perf_counter() - t0) / steps)
    return statistics.median(tb), statistics.median(to), statistics.median(o / b for b, o in zip(tb, to))


def cost_rows(capacity: int, dim: int, bags: int, pooling: int, repeat: int) -> List[Sequence[object]]:
    gen = torch.Generator().manual_seed(0)
    ranks = [zipf_ranks(bags * pooling, capacity, gen) for _ in range(8)]
    perm = torch.randperm(capacity, generator=gen)
    steps = [perm[r] for r in ranks]
    offsets = torch.arange(0, bags * pooling + 1, pooling)
    grad = torch.randn(bags, dim, generator=gen)
    rows: List[Sequence[object]] = []
    for mode, x in (("HYBRID", 1.0), ("CACHING", 0.2)):
        place = dict(mode=mode, cache_load_factor=x, backend="native", optimizer=_optimizer())
        options = DynamicTableOptions(capacity=capacity, on_full="ignore")
        dynamic = DynamicEmbeddingShard(num_embeddings=capacity, embedding_dim=dim, options=options, **place)
        slots = dynamic.num_rows
        static = TieredEmbeddingShard(
            num_embeddings=slots, embedding_dim=dim, routing=WholeTableRouting(slots), **place
        )
        keys = [scramble(r) for r in ranks]
        for k, ids in zip(keys, steps):  # warm: insert every key once, fill both caches (hit rates alike afterwards)
            dynamic(k, offsets).backward(grad)
            static(ids, offsets).backward(grad)
        it = {"d": 0, "s": 0}

        def step_dynamic() -> None:
            i = it["d"] = (it["d"] + 1) % len(keys)
            dynamic(keys[i], offsets).backward(grad)

        def step_static() -> None:
            i = it["s"] = (it["s"] + 1) % len(steps)
            static(steps[i], offsets).backward(grad)

        t_static, t_dynamic, ratio = interleaved(step_static, step_dynamic, rounds=repeat, steps=len(keys))
        stats = dynamic.tier_stats()
        rows.append(
            (
                f"{mode} {x}",
                f"{t_static * 1e3:.2f}",
                f"{t_dynamic * 1e3:.2f}",
                f"{ratio:.2f}x",
                f"{stats['occupancy']:.0f}",
                f"{stats['evicted']:.0f}",
            )
        )
    return rows


def memory_rows(capacity: int, dim: int) -> List[Sequence[object]]:
    rows: List[Sequence[object]] = []
    for mode, x, admit in (("HYBRID", 1.0, 1), ("CACHING", 0.2, 1), ("HYBRID", 1.0, 3)):
        options = DynamicTableOptions(capacity=capacity, admit_after=admit)
        shard = DynamicEmbeddingShard(
            num_embeddings=capacity,
            embedding_dim=dim,
            options=options,
            mode=mode,
            cache_load_factor=x,
            backend="native",
            optimizer=_optimizer(),
        )
        slots = shard.num_rows
        tiers = shard.tier_bytes()
        index = sum(t.untyped_storage().nbytes() for part in shard.index.tensors().values() for _, t in part)
        measured = tiers.fast_bytes + tiers.slow_bytes + index
        formula_rows = shard_storage(slots, dim, torch.float32, "rowwise_adagrad", mode, x)
        formula = (
            formula_rows.fast_bytes + formula_rows.slow_bytes + dynamic_index_bytes(slots, shard.index.counter_slots)
        )
        rows.append(
            (
                f"{mode} {x} admit_after={admit}",
                slots,
                f"{measured / slots:.2f}",
                f"{formula / slots:.2f}",
                f"{measured / formula:.4f}",
                f"{index / slots:.2f}",
            )
        )
    return rows


def scale_rows(keys_total: int, load_factor: float, dim: int, batch: int) -> List[Sequence[object]]:
    capacity = int(keys_total / load_factor)
    all_keys = scramble(torch.randperm(keys_total, generator=torch.Generator().manual_seed(1)))
    owner = (mix64(all_keys ^ 0x1234) & 1).to(torch.bool)
    rows: List[Sequence[object]] = []
    for rank in (0, 1):
        mine = all_keys[owner if rank else ~owner]
        shard = DynamicEmbeddingShard(
            num_embeddings=capacity,
            embedding_dim=dim,
            options=DynamicTableOptions(capacity=capacity, on_full="ignore"),
            shards=2,
            key_rank=rank,
            backend="native",
            optimizer=_optimizer(),
        )
        t0 = time.perf_counter()
        with torch.no_grad():
            for lo in range(0, mine.numel(), batch):
                part = mine[lo : lo + batch]
                shard._insert(part)
        dt = time.perf_counter() - t0
        stats = shard.tier_stats()
        rows.append(
            (
                rank,
                mine.numel(),
                shard.num_rows,
                f"{mine.numel() / shard.num_rows:.3f}",
                f"{stats['inserted']:.0f}",
                f"{stats['evicted']:.0f}",
                f"{stats['failed']:.0f}",
                f"{mine.numel() / dt / 1e6:.2f}",
            )
        )
        del shard
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capacity", type=int_at_least(1024), default=1_000_000)
    p.add_argument("--dim", type=int_at_least(1), default=64)
    p.add_argument("--bags", type=int_at_least(8), default=2048)
    p.add_argument("--pooling", type=int_at_least(1), default=16)
    p.add_argument("--repeat", type=int_at_least(1), default=15)
    p.add_argument("--threads", type=int_at_least(1), default=1)
    p.add_argument("--scale-keys", type=int_at_least(0), default=10_000_000)
    p.add_argument("--load-factor", type=unit_fraction, default=0.9)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(hardware_line(args.threads))
    print(
        f"\ncost of dynamism: capacity {args.capacity}, dim {args.dim}, {args.bags} bags x {args.pooling} ids, Zipf 1.05"
    )
    print_table(
        ["placement", "static ms", "dynamic ms", "dynamic / static", "keys held", "evicted"],
        cost_rows(args.capacity, args.dim, args.bags, args.pooling, args.repeat),
    )
    print(f"\nmemory per slot (dim {args.dim}, row-wise Adagrad)")
    print_table(
        ["placement", "slots", "measured B/slot", "formula B/slot", "measured / formula", "index B/slot"],
        memory_rows(args.capacity, args.dim),
    )
    if args.scale_keys:
        print(f"\nscale: {args.scale_keys} distinct keys into 2 shards at load factor {args.load_factor}, dim 16")
        print_table(
            ["shard", "keys", "slots", "load", "inserted", "evicted", "failed", "M inserts/s"],
            scale_rows(args.scale_keys, args.load_factor, 16, 65536),
        )


if __name__ == "__main__":
    main()
