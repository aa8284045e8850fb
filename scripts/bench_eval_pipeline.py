"""Benchmark: recpipe's EvalPipelinePrefetch vs a plain eval loop, 2 gloo ranks, CPU.

The model is the recipes' synthetic DLRM rows of ``bench_recipe.py``: 26 tables x 200k rows x 64,
table-wise FUSED (torchrec's sharder), dense arch 64,64, over arch 64,1, Criteo-like batches
(13 dense features, one id per sparse feature), batch 512 and 2048 per rank. Every variant
evaluates the same ``--batches`` batches per pass on its own copy of one model (same weights),
in eval mode under ``torch.no_grad()``:

* ``plain loop``: ``model(batch)`` per batch (the baseline);
* ``torchrec EvalPipelineSparseDist``: torchrec 1.9.2's eval pipeline (input dist ahead only);
  if it fails on this device, its error is printed instead;
* ``recpipe fused (eval mode)``: ``TrainPipelineFusedSparseDist`` driven in eval mode, which
  the recipes evaluated with before ``EvalPipelinePrefetch``;
* ``recpipe EvalPipelinePrefetch``: batch B+1's input dist and lookup ahead of B's forward.

Variants run interleaved (one pass each per round, order rotated each round); a pass is timed
whole (pipeline fill and drain included) after one barrier. Columns: median ms per batch,
global samples/s, the median over rounds of (plain pass time / variant pass time, same round)
with its inter-quartile range, and whether every output of every pass equals the plain loop's
bit for bit (``torch.equal``, every rank). Target: EvalPipelinePrefetch >= 1.15x the plain loop.

Usage::

    python scripts/bench_eval_pipeline.py                      # ~5 min on 2 busy cores
    python scripts/bench_eval_pipeline.py --rows 20000 --rounds 3 --batch-sizes 512   # quick
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
import traceback
import zlib
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchutil import hardware_line, iter_reports, positive_int, positive_int_list, print_table

PLAIN = "plain loop"
TORCHREC_EVAL = "torchrec EvalPipelineSparseDist"
FUSED_EVAL = "recpipe fused (eval mode)"
PREFETCH = "recpipe EvalPipelinePrefetch"
TARGET = 1.15  # EvalPipelinePrefetch vs the plain loop, samples/s


def _make_batches(args: argparse.Namespace, batch: int, rank: int) -> List[Any]:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(4321 + 7 * rank + batch)
    out = []
    for _ in range(args.batches):
        lengths = torch.full((args.tables * batch,), args.pooling, dtype=torch.int64)
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{t}" for t in range(args.tables)], values=values, lengths=lengths
        )
        out.append(
            Batch(
                dense_features=torch.randn(batch, args.dense_in, generator=g),
                sparse_features=kjt,
                labels=torch.randint(0, 2, (batch,), generator=g).float(),
            )
        )
    return out


def _build(args: argparse.Namespace, device: torch.device) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A table-wise FUSED DLRM on the world and a dense Adam (the fused pipeline's argument)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t{t}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f{t}"])
            for t in range(args.tables)
        ],
        device=torch.device("meta"),
    )
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=args.dense_in,
            dense_arch_layer_sizes=list(args.dense_arch),
            over_arch_layer_sizes=list(args.over_arch),
            dense_device=device,
        )
    )
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.01})
    ws = dist.get_world_size()
    sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        ebc,
        {f"t{t}": table_wise(rank=t % ws, compute_kernel="fused") for t in range(args.tables)},
        sharder=sharder,
        local_size=ws,
        world_size=ws,
        device_type=device.type,
    )
    dmp = DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        device=device,
        plan=ShardingPlan({"model.sparse_arch.embedding_bag_collection": plan}),
        sharders=[sharder],
    )
    # Identical tables in every copy: each shard drawn from its own seeded generator
    # (meta-device tables are initialised by DMP).
    with torch.no_grad():
        for name, t in dmp.state_dict().items():
            if "embedding_bags" in name and hasattr(t, "local_shards"):
                for shard in t.local_shards():
                    off = shard.metadata.shard_offsets
                    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + off[0] * 7 + off[1])
                    shard.tensor.copy_(torch.rand(shard.tensor.shape, generator=gen).mul_(0.2).sub_(0.1))
    opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: torch.optim.Adam(params, lr=1e-3)
    )
    return dmp, opt


def _pipeline_pass(pipe: Any, batches: Sequence[Any]) -> List[torch.Tensor]:
    """Drives ``pipe.progress`` over ``batches`` until StopIteration; the logits of each batch."""
    it = iter(batches)
    out = []
    while True:
        try:
            output = pipe.progress(it)
        except StopIteration:
            return out
        out.append(output[1])


def _variants(args: argparse.Namespace, device: torch.device) -> Tuple[Dict[str, Callable[..., Any]], Any]:
    """Variant name -> a function running one eval pass; and torchrec's eval pipeline's error (or None)."""
    from torchrec.distributed.train_pipeline import EvalPipelineSparseDist

    from recpipe.pipeline import EvalPipelinePrefetch, TrainPipelineFusedSparseDist

    models = [_build(args, device) for _ in range(4)]  # the same weights in every copy
    for model, _ in models:
        model.eval()

    def plain(batches: Sequence[Any]) -> List[torch.Tensor]:
        with torch.no_grad():
            return [models[0][0](b)[1][1] for b in batches]

    runs: Dict[str, Callable[..., Any]] = {PLAIN: plain}
    torchrec_eval = EvalPipelineSparseDist(models[1][0], models[1][1], device)

    def torchrec_pass(batches: Sequence[Any]) -> List[torch.Tensor]:
        with torch.no_grad():
            out = _pipeline_pass(torchrec_eval, batches)
        torchrec_eval.reset()  # its loader thread holds the pass's iterator
        return out

    error = None
    try:
        torchrec_pass(_make_batches(args, 8, dist.get_rank())[:2])
        runs[TORCHREC_EVAL] = torchrec_pass
    except Exception as e:  # noqa: BLE001 - reported in the table
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:90] if str(e) else ''}"
        dist.barrier()
    fused = TrainPipelineFusedSparseDist(models[2][0], models[2][1], device)

    def fused_pass(batches: Sequence[Any]) -> List[torch.Tensor]:
        with torch.no_grad():
            return _pipeline_pass(fused, batches)

    runs[FUSED_EVAL] = fused_pass
    prefetch = EvalPipelinePrefetch(models[3][0], device)
    runs[PREFETCH] = lambda batches: _pipeline_pass(prefetch, batches)
    return runs, error


def _measure(args: argparse.Namespace, batch: int, device: torch.device) -> Dict[str, Any]:
    """One workload: every variant's pass times and whether its outputs equal the plain loop's."""
    batches = _make_batches(args, batch, dist.get_rank())
    runs, error = _variants(args, device)
    names = list(runs)
    want = runs[PLAIN](batches)
    same = {n: True for n in names}
    times: Dict[str, List[float]] = {n: [] for n in names}
    cpu: Dict[str, List[float]] = {n: [] for n in names}
    for name in names:  # warm-up pass
        got = runs[name](batches)
        same[name] &= len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            got = runs[name](batches)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            same[name] &= len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    return {"times": times, "cpu": cpu, "same": same, "torchrec_error": error}


def _worker(rank: int, ws: int, port: int, args: argparse.Namespace, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.set_num_threads(args.threads)
        dist.init_process_group("gloo", rank=rank, world_size=ws)
        device = torch.device("cpu")
        out = {batch: _measure(args, batch, device) for batch in args.batch_sizes}
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        q.put((rank, False, traceback.format_exc()))


def _pct(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100.0 * (len(s) - 1))))]


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=positive_int, default=26, help="embedding tables (default 26)")
    ap.add_argument("--rows", type=positive_int, default=200_000, help="rows per table (default 200k)")
    ap.add_argument("--dim", type=positive_int, default=64, help="embedding dim (default 64)")
    ap.add_argument(
        "--batch-sizes",
        type=positive_int_list,
        default=[512, 2048],
        help="samples per rank per batch, one workload each, comma-separated (default 512,2048)",
    )
    ap.add_argument("--pooling", type=positive_int, default=1, help="ids per sample per feature (default 1, Criteo)")
    ap.add_argument("--dense-in", type=positive_int, default=13, help="dense features (default 13, Criteo)")
    ap.add_argument("--dense-arch", type=positive_int_list, default=[64, 64], help="dense arch (default 64,64)")
    ap.add_argument("--over-arch", type=positive_int_list, default=[64, 1], help="over arch (default 64,1)")
    ap.add_argument("--batches", type=positive_int, default=20, help="batches per eval pass (default 20)")
    ap.add_argument("--rounds", type=positive_int, default=20, help="interleaved rounds (default 20)")
    ap.add_argument(
        "--threads", type=positive_int, default=1, help="torch threads per rank (default 1: 2 ranks, 2 cores)"
    )
    args = ap.parse_args()
    if args.dense_arch[-1] != args.dim:
        ap.error(f"argument --dense-arch: its last width {args.dense_arch[-1]} must equal --dim {args.dim} (DLRM)")
    if args.over_arch[-1] != 1:
        ap.error(f"argument --over-arch: its last width must be 1 (one logit), got {args.over_arch[-1]}")
    return args


def _report(args: argparse.Namespace, res: Dict[int, Any], wall: float, load0: float) -> None:
    import torchrec

    print("\n" + hardware_line(threads=args.threads))
    print(
        f"bench_eval_pipeline: torchrec {torchrec.__version__}, 2 ranks x {args.threads} thread(s), gloo, CPU; "
        f"DLRM {args.tables} tables x {args.rows} rows x {args.dim} (table-wise FUSED), dense arch "
        f"{','.join(map(str, args.dense_arch))}, over arch {','.join(map(str, args.over_arch))}, {args.pooling} "
        f"id(s)/feature; {args.batches} batches per pass, {args.rounds} interleaved rounds; wall {wall:.0f} s"
    )
    rows = []
    verdicts = []
    for batch in args.batch_sizes:
        r0 = res[0][batch]
        base = r0["times"][PLAIN]
        for name, times in r0["times"].items():
            ratios = [b / t for b, t in zip(base, times)]
            ms = 1e3 * statistics.median(times) / args.batches
            sps = 2 * batch * args.batches / statistics.median(times)
            same = all(res[r][batch]["same"][name] for r in res)
            cpu_ms = 1e3 * statistics.median(r0["cpu"][name]) / args.batches
            ratio, iqr = statistics.median(ratios), f"{_pct(ratios, 25):.2f}-{_pct(ratios, 75):.2f}"
            rows.append([batch, name, ms, cpu_ms, sps, ratio, iqr, same])
            if name == PREFETCH:
                verdicts.append((batch, statistics.median(ratios), same))
        if r0["torchrec_error"]:
            rows.append([batch, TORCHREC_EVAL, "-", "-", "-", "-", "-", f"fails on CPU: {r0['torchrec_error']}"])
    headers = ["batch/rank", "eval", "ms/batch", "CPU ms/batch", "samples/s", "x plain", "x IQR", "bit-identical"]
    print_table(headers, rows)
    print(
        "x plain: median over rounds of (plain pass time / variant pass time, same round); samples/s: both ranks;\n"
        "CPU ms/batch: rank 0's process CPU time (main and gloo threads) per batch, median pass: the work, apart\n"
        f"from the waits. Machine load (1-min average): {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, "
        f"on {os.cpu_count()} cores (above the 2 ranks' 2: other processes share the cores and the waits)."
    )
    for batch, ratio, same in verdicts:
        met = "meets" if ratio >= TARGET and same else "MISSES"
        print(
            f"batch {batch}: EvalPipelinePrefetch {ratio:.3f}x the plain loop, bit-identical {same}: {met} >= {TARGET}x"
        )


def main() -> None:
    args = _parse()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, q)) for r in range(2)]
    t0, load0 = time.time(), os.getloadavg()[0]
    for p in procs:
        p.start()
    res: Dict[int, Any] = {}
    try:
        for rank, ok, payload in iter_reports(q, procs):
            if not ok:
                raise SystemExit(f"rank {rank} failed:\n{payload}")
            res[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    _report(args, res, time.time() - t0, load0)


if __name__ == "__main__":
    main()
