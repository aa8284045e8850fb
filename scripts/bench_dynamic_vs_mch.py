"""Benchmark of dynamic tables against torchrec's managed collisions on raw ids (issue 50).

The same stream of raw int64 keys (Zipf(1.05) ranks over ``--key-space`` ranks, scrambled into
[0, 2^63): MCH's input range) feeds, in the same process, one table of ``--capacity`` rows and
``--dim`` columns, ``--bags`` bags of ``--pooling`` keys per step; more distinct keys than
capacity, so both sides evict:

* torchrec 1.9.2: ``ManagedCollisionEmbeddingBagCollection`` (an ``MCHManagedCollisionModule``,
  LRU or distance-LFU, evicting every ``--eviction-interval`` steps, in front of an
  ``EmbeddingBagCollection``) sharded row-wise by ``ManagedCollisionEmbeddingBagCollectionSharder``
  under DMP on 1 gloo rank with the FUSED kernel (fbgemm's CPU TBE); where that does not run on
  the CPU, the unsharded module with the optimizer applied in the backward;
* recpipe: ``DynamicEmbeddingShard`` (``native`` backend, HYBRID x = 1) of the same capacity, and,
  when torchrec ran sharded, the same table under DMP on 1 gloo rank through the tiered sharder.

Timed: the whole training step of the embedding part (MCH's remap, history and eviction work, the
lookup, the backward with the fused update), per batch, in rounds of one eviction interval that
alternate the variants (every round holds one MCH eviction; the mean over the rounds is reported).
The optimizer: ``auto`` tries torchrec's FUSED row-wise Adagrad on a small table first; fbgemm's
``reset_weight_momentum`` (MCH's eviction reset of the Adagrad state) has no CPU kernel, so ``auto``
prints that error and uses SGD everywhere. ``rowwise_adagrad`` forces it: torchrec then runs unsharded.
Semantics differ: MCH admits new keys only at each eviction (until then they share its last row,
and the unsharded module does not reset evicted rows); recpipe gives a key its row at first sight.
Target: recpipe's dynamic table >= 2x faster than torchrec's MCH-EBC.

Usage::

    PYTHONPATH=build/dev .venv/bin/python scripts/bench_dynamic_vs_mch.py [--capacity 262144] [--threads 1]
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import hardware_line, int_at_least, print_table  # noqa: E402

#: Rows per bucket of a dynamic table (``recpipe.pipeline.placement.BUCKET_SLOTS``): a capacity that is a
#: multiple of it gives the dynamic table exactly ``--capacity`` slots, as MCH has.
BUCKET_SLOTS = 16
#: MCH's key range: ``MCHManagedCollisionModule``'s default ``input_hash_size`` (2^63 - 1).
KEY_MASK = (1 << 63) - 1
LEARNING_RATE = 0.01


def capacity_arg(text: str) -> int:
    """argparse type: a capacity, an int >= 1024 and a multiple of :data:`BUCKET_SLOTS`."""
    value = int_at_least(1024)(text)
    if value % BUCKET_SLOTS:
        raise argparse.ArgumentTypeError(
            f"must be a multiple of {BUCKET_SLOTS} (a dynamic table's bucket), got {value}; "
            f"e.g. {value + BUCKET_SLOTS - value % BUCKET_SLOTS}"
        )
    return value


# ---------------------------------------------------------------- the key stream
def key_stream(steps: int, key_space: int, ids: int, seed: int = 0) -> List[torch.Tensor]:
    """``steps`` batches of ``ids`` raw keys: Zipf(1.05) ranks in ``[0, key_space)`` scrambled by a
    bijective 64-bit mix into ``[0, 2^63)`` (the most frequent keys are not small numbers)."""
    from recpipe.pipeline.tiered.dynamic.key_hashing import mix64

    cdf = torch.arange(1, key_space + 1, dtype=torch.float64).pow_(-1.05).cumsum_(0)
    cdf /= cdf[-1].item()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ranks = torch.searchsorted(cdf, torch.rand(ids, generator=gen, dtype=torch.float64))
        out.append(mix64(ranks.clamp_(max=key_space - 1) + 0x5DEECE66D) & KEY_MASK)
    return out


# ---------------------------------------------------------------- variants
@dataclass
class Variant:
    """One measured table: ``step(keys)`` runs a training step of the embedding part on one batch;
    ``counts()`` returns ``(keys held, inserted, evicted)`` since it was built."""

    name: str
    optimizer: str
    step: Callable[[torch.Tensor], None]
    counts: Callable[[], Tuple[int, int, int]]
    torchrec: bool
    seconds: float = 0.0
    steps: int = 0
    notes: List[str] = field(default_factory=list)


def _policy(eviction: str) -> Any:
    """An MCH eviction policy (``lru`` or ``distance_lfu``) that also counts its admissions and
    evictions: an evicted slot whose ``last_access_iter`` was not 0 held a key (MCH's iterations
    start at 1, so only never-used slots read 0)."""
    from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, LRU_EvictionPolicy

    base = {"lru": LRU_EvictionPolicy, "distance_lfu": DistanceLFU_EvictionPolicy}[eviction]

    class CountingPolicy(base):  # type: ignore[valid-type, misc]
        inserted = 0
        evicted = 0

        def update_metadata_and_generate_eviction_scores(self, *args: Any, **kwargs: Any) -> Any:
            metadata = kwargs["mch_metadata"] if "mch_metadata" in kwargs else args[6]
            occupied = metadata["last_access_iter"] != 0
            evicted, selected = super().update_metadata_and_generate_eviction_scores(*args, **kwargs)
            self.inserted += int(evicted.numel())
            self.evicted += int(occupied[evicted].sum())
            return evicted, selected

    return CountingPolicy()


def _in_backward(params: Sequence[nn.Parameter], optimizer: str) -> None:
    """Applies ``optimizer`` (``sgd`` or ``rowwise_adagrad``) in the backward: torchrec's sharders read
    it into the FUSED kernel (and the tiered sharders into the tiered one)."""
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    cls = {"sgd": torch.optim.SGD, "rowwise_adagrad": RowWiseAdagrad}[optimizer]
    apply_optimizer_in_backward(cls, list(params), {"lr": LEARNING_RATE})


class _MCHModel(nn.Module):
    """One MCH-EBC (table ``t``, feature ``f``) whose forward returns the pooled values."""

    def __init__(self, capacity: int, dim: int, policy: Any, interval: int, device: torch.device) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
        from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule

        config = EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=capacity, feature_names=["f"])
        ebc = EmbeddingBagCollection(tables=[config], device=device)
        mch = MCHManagedCollisionModule(
            zch_size=capacity, device=torch.device("cpu"), eviction_policy=policy, eviction_interval=interval
        )
        mcc = ManagedCollisionCollection({"t": mch}, ebc.embedding_bag_configs())
        self.mc = ManagedCollisionEmbeddingBagCollection(ebc, mcc)

    def forward(self, features: Any) -> torch.Tensor:
        pooled, _ = self.mc(features)
        return pooled.values()


def _kjt(keys: torch.Tensor, bags: int) -> Any:
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=["f"], values=keys, lengths=torch.full((bags,), keys.numel() // bags))


def torchrec_variant(args: argparse.Namespace, optimizer: str, sharded: bool) -> Variant:
    """torchrec's MCH-EBC: sharded row-wise (FUSED, DMP on the 1-rank group) or unsharded."""
    policy = _policy(args.eviction)
    model = _MCHModel(
        args.capacity, args.dim, policy, args.eviction_interval, torch.device("meta" if sharded else "cpu")
    )
    _in_backward(model.mc._embedding_module.parameters(), optimizer)
    module: nn.Module = model
    if sharded:
        from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
        from torchrec.distributed.types import ShardingPlan

        sharder = ManagedCollisionEmbeddingBagCollectionSharder()
        plan = construct_module_sharding_plan(
            model.mc,
            per_param_sharding={"t": row_wise(compute_kernel="fused")},
            sharder=sharder,  # type: ignore[arg-type]
            local_size=1,
            world_size=1,
            device_type="cpu",
        )
        module = DistributedModelParallel(
            model, device=torch.device("cpu"), plan=ShardingPlan({"mc": plan}), sharders=[sharder]
        )
    grad = torch.randn(args.bags, args.dim, generator=torch.Generator().manual_seed(1))

    def step(keys: torch.Tensor) -> None:
        module(_kjt(keys, args.bags)).backward(grad)

    def counts() -> Tuple[int, int, int]:
        return policy.inserted - policy.evicted, policy.inserted, policy.evicted

    how = "sharded, DMP 1 gloo rank, FUSED" if sharded else "unsharded, in-backward optimizer"
    return Variant(f"torchrec MCH-EBC ({how})", optimizer, step, counts, torchrec=True)


def _dynamic_options(args: argparse.Namespace) -> Any:
    from recpipe.pipeline.placement import DynamicTableOptions

    eviction = {"lru": "lru", "distance_lfu": "lfu"}[args.eviction]
    return DynamicTableOptions(capacity=args.capacity, eviction=eviction, on_full="ignore")


def _shard_counts(shard: Any) -> Callable[[], Tuple[int, int, int]]:
    def counts() -> Tuple[int, int, int]:
        stats = shard.tier_stats()
        return int(stats["occupancy"]), int(stats["inserted"]), int(stats["evicted"])

    return counts


def recpipe_shard_variant(args: argparse.Namespace, optimizer: str) -> Variant:
    """recpipe's ``DynamicEmbeddingShard`` (native, HYBRID x = 1), called directly."""
    from recpipe.pipeline.tiered.dynamic.dynamic_shard import DynamicEmbeddingShard
    from recpipe.pipeline.tiered.optim import TieredOptimizerConfig

    shard = DynamicEmbeddingShard(
        num_embeddings=args.capacity,
        embedding_dim=args.dim,
        options=_dynamic_options(args),
        mode="HYBRID",
        cache_load_factor=1.0,
        backend="native",
        optimizer=TieredOptimizerConfig(optimizer=optimizer, learning_rate=LEARNING_RATE),
    )
    offsets = torch.arange(0, args.bags * args.pooling + 1, args.pooling)
    grad = torch.randn(args.bags, args.dim, generator=torch.Generator().manual_seed(1))

    def step(keys: torch.Tensor) -> None:
        shard(keys, offsets).backward(grad)

    return Variant("recpipe DynamicEmbeddingShard (native, HYBRID 1.0)", optimizer, step, _shard_counts(shard), False)


class _EBCModel(nn.Module):
    """One EBC (table ``t``, feature ``f``) whose forward returns the pooled values."""

    def __init__(self, capacity: int, dim: int) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        config = EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=capacity, feature_names=["f"])
        self.ebc = EmbeddingBagCollection(tables=[config], device=torch.device("meta"))

    def forward(self, features: Any) -> torch.Tensor:
        return self.ebc(features).values()


def recpipe_dmp_variant(args: argparse.Namespace, optimizer: str) -> Variant:
    """The same dynamic table planned row-wise on the 1-rank group and sharded by recpipe's tiered sharder."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan, ShardingType

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder
    from recpipe.planner.torchrec_plan import PlacementParameterSharding, row_wise_sharding_spec

    model = _EBCModel(args.capacity, args.dim)
    _in_backward(model.ebc.parameters(), optimizer)
    sharding = PlacementParameterSharding(
        compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
        mode="HYBRID",
        cache_load_factor=1.0,
        dist_type="hash_roundrobin",
        dynamic=_dynamic_options(args),
        sharding_type=ShardingType.ROW_WISE.value,
        ranks=[0],
        sharding_spec=row_wise_sharding_spec(args.capacity, args.dim, 1, 1, "cpu"),
    )
    dmp = DistributedModelParallel(
        module=model,
        device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": EmbeddingModuleShardingPlan({"t": sharding})}),
        sharders=[TieredEmbeddingBagCollectionSharder(backend="native")],  # type: ignore[list-item]
    )
    shard = dmp.module.ebc.tiered_tables()["t"]
    grad = torch.randn(args.bags, args.dim, generator=torch.Generator().manual_seed(1))

    def step(keys: torch.Tensor) -> None:
        dmp(_kjt(keys, args.bags)).backward(grad)

    return Variant(
        "recpipe dynamic table (DMP 1 gloo rank, tiered sharder)", optimizer, step, _shard_counts(shard), False
    )


# ---------------------------------------------------------------- runs
def fused_adagrad_error(args: argparse.Namespace) -> Optional[str]:
    """Whether torchrec's sharded MCH-EBC trains with FUSED row-wise Adagrad on the CPU: ``None`` if a
    small table (64 rows, eviction every step) survives its evictions, else the error's first line."""
    small = argparse.Namespace(**{**vars(args), "capacity": 64, "eviction_interval": 1, "bags": 8})
    gen = torch.Generator().manual_seed(2)
    try:
        variant = torchrec_variant(small, "rowwise_adagrad", sharded=True)
        for _ in range(3):
            variant.step(torch.randint(0, KEY_MASK, (8 * args.pooling,), generator=gen))
    except Exception as e:  # the error is the measurement
        return _first_sentence(e)
    return None


def _first_sentence(e: BaseException) -> str:
    """``Type: the message's first sentence`` (torch's dispatcher errors go on to list every backend)."""
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text.split('. ')[0]}"


def warm_or_error(variant: Variant, batches: Sequence[torch.Tensor]) -> Optional[str]:
    """Runs ``variant`` over the warm-up ``batches``; the error's first line if it raises."""
    try:
        for keys in batches:
            variant.step(keys)
    except Exception as e:  # torchrec's CPU limits are part of the result
        return _first_sentence(e)
    return None


def build_variants(args: argparse.Namespace, optimizer: str, warm: Sequence[torch.Tensor]) -> List[Variant]:
    """torchrec's MCH-EBC (sharded FUSED, else unsharded) and recpipe's dynamic table(s), each warmed on
    ``warm``; prints why torchrec's sharded run failed when it did."""
    variant = torchrec_variant(args, optimizer, sharded=True)
    error = warm_or_error(variant, warm)
    sharded = error is None
    if not sharded:
        print(f"torchrec MCH-EBC sharded FUSED {optimizer} on the CPU failed: {error}; running it unsharded")
        variant = torchrec_variant(args, optimizer, sharded=False)
        variant.notes.append("unsharded: its evict() leaves evicted rows as they were")
        if (error := warm_or_error(variant, warm)) is not None:
            raise SystemExit(f"torchrec MCH-EBC unsharded failed too: {error}")
    variants = [variant, recpipe_shard_variant(args, optimizer)]
    if sharded:
        variants.append(recpipe_dmp_variant(args, optimizer))
    for v in variants[1:]:
        if (error := warm_or_error(v, warm)) is not None:
            raise SystemExit(f"{v.name} failed: {error}")
    return variants


def timed_rounds(variants: Sequence[Variant], rounds: Sequence[Sequence[torch.Tensor]]) -> None:
    """Each round: every variant in turn over the round's batches (one eviction interval)."""
    for batches in rounds:
        for v in variants:
            t0 = time.perf_counter()
            for keys in batches:
                v.step(keys)
            v.seconds += time.perf_counter() - t0
            v.steps += len(batches)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def report(variants: Sequence[Variant]) -> None:
    base = next(v for v in variants if v.torchrec)
    t_base = base.seconds / base.steps
    rows = []
    for v in variants:
        t = v.seconds / v.steps
        rows.append(
            (v.name, v.optimizer, f"{t * 1e3:.2f}", f"{1 / t:.1f}", "-" if v.torchrec else f"{t_base / t:.2f}x")
        )
    print_table(["variant", "optimizer", "ms/step", "steps/s", "speedup over torchrec"], rows)
    print("\nkeys over the whole stream (warm-up and timed steps)")
    print_table(
        ["variant", "keys held", "inserted", "evicted", "note"],
        [(v.name, *v.counts(), "; ".join(v.notes) or "-") for v in variants],
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capacity", type=capacity_arg, default=262_144, help="rows of the table (both sides)")
    p.add_argument("--key-space", type=int_at_least(2), default=10_000_000, help="Zipf ranks drawn from")
    p.add_argument("--dim", type=int_at_least(1), default=64)
    p.add_argument("--bags", type=int_at_least(8), default=2048)
    p.add_argument("--pooling", type=int_at_least(1), default=16)
    p.add_argument("--eviction", choices=("lru", "distance_lfu"), default="lru")
    p.add_argument("--eviction-interval", type=int_at_least(1), default=20, help="MCH steps between evictions")
    p.add_argument("--warmup-intervals", type=int_at_least(1), default=3)
    p.add_argument("--rounds", type=int_at_least(1), default=10, help="timed rounds of one eviction interval")
    p.add_argument("--optimizer", choices=("auto", "sgd", "rowwise_adagrad"), default="auto")
    p.add_argument("--threads", type=int_at_least(1), default=1)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    # raw keys lie outside [0, num_embeddings) by design: torchrec's KJT check would warn about each table
    logging.getLogger("torchrec.sparse.jagged_tensor_validator").setLevel(logging.ERROR)
    print(hardware_line(args.threads))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        optimizer = args.optimizer
        if optimizer == "auto":
            error = fused_adagrad_error(args)
            optimizer = "rowwise_adagrad" if error is None else "sgd"
            if error is not None:
                print(f"torchrec MCH-EBC sharded FUSED rowwise_adagrad on the CPU: {error}\n-> every variant uses SGD")
        interval = args.eviction_interval
        warm_steps = args.warmup_intervals * interval
        stream = key_stream(warm_steps + args.rounds * interval, args.key_space, args.bags * args.pooling)
        distinct = torch.cat(stream).unique().numel()
        print(
            f"\ncapacity {args.capacity}, dim {args.dim}, {args.bags} bags x {args.pooling} keys, Zipf 1.05 over "
            f"{args.key_space} keys: {distinct} distinct in {len(stream)} steps; eviction {args.eviction}, MCH "
            f"interval {interval}; {args.warmup_intervals} warm-up and {args.rounds} timed intervals"
        )
        variants = build_variants(args, optimizer, stream[:warm_steps])
        timed_rounds(variants, [stream[warm_steps + r * interval :][:interval] for r in range(args.rounds)])
        report(variants)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
