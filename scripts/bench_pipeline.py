"""Benchmark: recpipe TrainPipelineFusedSparseDist vs torchrec TrainPipelineSparseDist.

2 ranks, gloo, CPU; a DLRM whose dense optimizer matters (Adam over a
1024-1024-512-1 over-arch) and whose tables dominate memory (default 8 x 200k x 64,
fused SGD in backward), batch 1024 per rank. Rows: torchrec SparseDist (the
baseline), torchrec FusedSparseDist (tried; it fails on CPU and the error is
printed), recpipe with each (use_emb_lookup_stream, embedding_lookup_after_opt), and a
second torchrec SparseDist built last (A/A control: its ratio and wait cut show the
noise and any position bias of the measurement on a shared machine).
Variants run interleaved (A B C ... per round, order rotated each round) on
identically initialised models and the same batches, so their per-step losses
must be bit-identical.

Columns: median / P90 ms per step, the interleaved median ratio to the baseline
(median over rounds of the variant's block of steps / the baseline's block in the
same round) and its inter-quartile range, RSS, loss equality with the baseline, and the two stages the overlap acts on, per step: the forward's
blocking wait for the output all-to-all (timed inside the awaitable's wait, the
same wrapper for every row) and the dense optimizer step.

``--device cuda`` runs the same comparison on 2 GPUs (nccl) and adds each
combination's peak allocated / reserved CUDA memory (``torch.cuda.max_memory_*``
over that combination's blocks of steps, reset before each block); steps are timed
with a device synchronize at block edges. No GPU exists on the machines this was
written on: that mode has not run, and the CPU run says so.

Usage::

    python scripts/bench_pipeline.py                 # the issue's model (~3 min on 2 cores)
    python scripts/bench_pipeline.py --rows 20000 --rounds 3 --steps 4   # quick
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import statistics
import time
import traceback
import zlib
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchutil import hardware_line, iter_reports, nonneg_int, positive_int, positive_int_list


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _make_batches(args: argparse.Namespace, rank: int) -> List[Any]:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1234 + rank)
    out = []
    for _ in range(args.distinct_batches):
        lengths = torch.randint(1, 2 * args.pooling, (args.tables * args.batch,), generator=g)
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{t}" for t in range(args.tables)], values=values, lengths=lengths
        )
        out.append(
            Batch(
                dense_features=torch.randn(args.batch, args.dense_in, generator=g),
                sparse_features=kjt,
                labels=torch.randint(0, 2, (args.batch,), generator=g).float(),
            )
        )
    return out


def _build(args: argparse.Namespace, device: torch.device) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t{t}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f{t}"])
            for t in range(args.tables)
        ],
        device=torch.device("meta"),
    )
    over = list(args.over_arch) + [1]
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=args.dense_in,
            dense_arch_layer_sizes=[512, 256, args.dim],
            over_arch_layer_sizes=over,
            dense_device=device,
        )
    )
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.01})
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
    # Identical tables in every variant: re-initialise each table from its own
    # seeded generator (meta-device modules are initialised by DMP).
    with torch.no_grad():
        for name, t in dmp.state_dict().items():
            if "embedding_bags" in name and hasattr(t, "local_shards"):
                for shard in t.local_shards():
                    off = shard.metadata.shard_offsets
                    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + off[0] * 7 + off[1])
                    shard.tensor.copy_(torch.rand(shard.tensor.shape, generator=gen).mul_(0.02).sub_(0.01))
    opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: torch.optim.Adam(params, lr=1e-3)
    )
    return dmp, opt


def _measured_sparse_dist(model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> Any:
    """torchrec's TrainPipelineSparseDist with the same stage timers as recpipe's pipeline."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward

    from recpipe.pipeline.train_pipeline.stats import (
        STAGE_OPTIMIZER,
        PipelineStageStats,
        StageTimer,
        time_awaitable_tree,
    )

    stats = PipelineStageStats()

    class TimedPipelinedForward(PipelinedForward):
        def __call__(self, *input: Any, **kwargs: Any) -> Any:
            return time_awaitable_tree(
                super().__call__(*input, **kwargs), stats, f"## output_dist_wait {self._name} ##"
            )

    class MeasuredSparseDist(TrainPipelineSparseDist):
        _pipelined_forward_type = TimedPipelinedForward

        def _optimizer_step(self) -> None:
            with StageTimer(stats, STAGE_OPTIMIZER, f"## optimizer {self.contexts[0].index} ##"):
                self._optimizer.step()

        def progress(self, dataloader_iter: Iterator[Any]) -> Any:
            out = super().progress(dataloader_iter)
            stats.steps += 1
            return out

    pipe = MeasuredSparseDist(model, opt, device)
    pipe.stats = stats
    return pipe


def _body(rank: int, args: argparse.Namespace) -> Dict[str, Any]:
    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    batches = _make_batches(args, rank)  # host batches: the pipelines copy them to the device

    def stream_of_batches() -> Iterator[Any]:
        for k in itertools.count():
            yield batches[k % len(batches)]

    result: Dict[str, Any] = {}
    # torchrec's own fused pipeline, tried once on the same model configuration.
    from torchrec.distributed.train_pipeline import TrainPipelineFusedSparseDist as TorchrecFused

    model, opt = _build(args, device)
    try:
        TorchrecFused(model, opt, device).progress(stream_of_batches())
        result["torchrec_fused_error"] = None
    except Exception as e:  # noqa: BLE001 - recorded in the table
        result["torchrec_fused_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:70]}"
    del model, opt
    dist.barrier()

    variants: Dict[str, Any] = {}
    model, opt = _build(args, device)
    variants["torchrec SparseDist"] = _measured_sparse_dist(model, opt, device)
    for stream, after_opt in itertools.product((False, True), (False, True)):
        model, opt = _build(args, device)
        variants[f"recpipe stream={int(stream)} after_opt={int(after_opt)}"] = TrainPipelineFusedSparseDist(
            model, opt, device, use_emb_lookup_stream=stream, embedding_lookup_after_opt=after_opt
        )
    # A/A control: a second, identical baseline built last; its ratio shows the
    # noise and any build-order / position bias of this measurement.
    model, opt = _build(args, device)
    variants["torchrec SparseDist (A/A)"] = _measured_sparse_dist(model, opt, device)
    iters = {name: stream_of_batches() for name in variants}
    names = list(variants)
    losses: Dict[str, List[float]] = {n: [] for n in names}
    times: Dict[str, List[List[float]]] = {n: [] for n in names}
    rss: Dict[str, float] = {n: 0.0 for n in names}
    cuda_peak: Dict[str, List[float]] = {n: [0.0, 0.0] for n in names}  # MB allocated, reserved
    on_cuda = device.type == "cuda"

    def run(name: str, steps: int, record: bool) -> None:
        pipe, it = variants[name], iters[name]
        ts = []
        # One barrier per block of steps (not per step: a per-step barrier would
        # hand the in-flight output all-to-all free time no real loop has).
        dist.barrier()
        if on_cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        step_losses = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step_losses.append(pipe.progress(it)[0].detach())
            ts.append(time.perf_counter() - t0)
        if on_cuda:
            # GPU work is asynchronous: charge what is still queued to the last step.
            t0 = time.perf_counter()
            torch.cuda.synchronize(device)
            ts[-1] += time.perf_counter() - t0
            cuda_peak[name][0] = max(cuda_peak[name][0], torch.cuda.max_memory_allocated(device) / 2**20)
            cuda_peak[name][1] = max(cuda_peak[name][1], torch.cuda.max_memory_reserved(device) / 2**20)
        losses[name].extend(float(x) for x in step_losses)
        if record:
            times[name].append(ts)
            rss[name] = max(rss[name], _rss_mb())

    for name in names:
        run(name, args.warmup, record=False)
        variants[name].stats.reset()
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            run(name, args.steps, record=True)
    result["times"] = times
    result["losses"] = losses
    result["rss"] = rss
    result["peak_rss"] = _peak_rss_mb()
    result["cuda_peak"] = cuda_peak if on_cuda else None
    result["stats"] = {n: variants[n].stats.per_step_ms() for n in names}
    return result


def _worker(rank: int, ws: int, port: int, args: argparse.Namespace, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.set_num_threads(args.threads)
        if args.device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=ws)
        out = _body(rank, args)
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        q.put((rank, False, traceback.format_exc()))


def _pct(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100.0 * (len(s) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=positive_int, default=8, help="embedding tables (default 8)")
    ap.add_argument("--rows", type=positive_int, default=200_000, help="rows per table (default 200k)")
    ap.add_argument("--dim", type=positive_int, default=64, help="embedding dim (default 64)")
    ap.add_argument("--batch", type=positive_int, default=1024, help="samples per rank per step (default 1024)")
    ap.add_argument("--pooling", type=positive_int, default=10, help="mean ids per sample per feature (default 10)")
    ap.add_argument("--dense-in", type=positive_int, default=13, help="dense features (default 13, Criteo)")
    ap.add_argument(
        "--over-arch",
        type=positive_int_list,
        default=[1024, 1024, 512],
        help="over-arch widths, comma-separated (default 1024,1024,512)",
    )
    ap.add_argument("--distinct-batches", type=positive_int, default=8, help="distinct batches cycled (default 8)")
    ap.add_argument("--warmup", type=nonneg_int, default=3, help="warm-up steps per variant (default 3)")
    ap.add_argument("--rounds", type=positive_int, default=20, help="interleaved rounds (default 20)")
    ap.add_argument("--steps", type=positive_int, default=3, help="steps per variant per round (default 3)")
    ap.add_argument(
        "--threads", type=positive_int, default=1, help="torch threads per rank (default 1: 2 ranks, 2 cores)"
    )
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (gloo, default) or cuda (nccl, 2 GPUs; adds peak CUDA memory)",
    )
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        ap.error(f"argument --device: cuda needs 2 CUDA devices, found {torch.cuda.device_count()}; use --device cpu")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, q)) for r in range(2)]
    t0 = time.time()
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
    wall = time.time() - t0
    r0 = res[0]
    names = list(r0["times"])
    base = names[0]
    import torchrec

    print("\n" + hardware_line(threads=args.threads))
    print(
        f"bench_pipeline: torchrec {torchrec.__version__}, 2 ranks x {args.threads} thread(s), "
        f"{'nccl, CUDA ' + torch.cuda.get_device_name(0) if args.device == 'cuda' else 'gloo, CPU'}"
    )
    print(
        f"model: DLRM, {args.tables} tables x {args.rows} rows x {args.dim} (fused SGD), over-arch "
        f"{','.join(map(str, args.over_arch))},1 (Adam), batch {args.batch}/rank, ~{args.pooling} ids/feature; "
        f"{args.rounds} interleaved rounds x {args.steps} steps after {args.warmup} warm-up; wall {wall:.0f} s"
    )
    hdr = (
        f"{'pipeline':<30} {'med ms':>7} {'p90 ms':>7} {'ratio':>6} {'ratio IQR':>11} {'RSS MB':>7} "
        f"{'loss==base':>10} {'a2a wait':>9} {'opt ms':>7} {'lookup':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    base_rounds = r0["times"][base]
    for n in names:
        flat = [t * 1e3 for rnd in r0["times"][n] for t in rnd]
        # per round: this variant's block of steps vs the baseline's block in the same round
        ratios = [sum(v) / sum(b) for v, b in zip(r0["times"][n], base_rounds)]
        same = all(res[r]["losses"][n] == res[r]["losses"][base] for r in res)
        st = r0["stats"][n]
        print(
            f"{n:<30} {statistics.median(flat):7.1f} {_pct(flat, 90):7.1f} {statistics.median(ratios):6.3f} "
            f"{_pct(ratios, 25):5.2f}-{_pct(ratios, 75):5.2f} "
            f"{r0['rss'][n]:7.0f} {str(same):>10} {st['output_dist_wait']:9.2f} {st['optimizer']:7.2f} "
            f"{st['embedding_lookup']:7.2f}"
        )
        if r0["cuda_peak"] is not None:
            alloc, reserved = r0["cuda_peak"][n]
            print(f"{'':<30} CUDA peak allocated {alloc:.0f} MB, reserved {reserved:.0f} MB (rank 0)")
        if n == base:
            err = r0["torchrec_fused_error"]
            where = "CUDA" if args.device == "cuda" else "CPU"
            print(f"{'torchrec FusedSparseDist':<30} {f'FAILS on {where}: ' + str(err) if err else 'ran'}")
    print(
        "ratio: median over rounds of (variant block time / baseline block time, same round), interleaved. a2a wait: ms/step "
        "the forward blocks on the output all-to-all;\nopt ms: dense optimizer ms/step; lookup: ms/step "
        "issuing lookup + output all-to-all outside the forward (recpipe only; torchrec does it inside "
        "the forward).\nRSS MB: rank-0 resident set after that variant's steps (all variants' models "
        f"live in one process; peak {r0['peak_rss']:.0f} MB). "
        + (
            "CUDA peak memory: per row above."
            if args.device == "cuda"
            else "CUDA peak allocated/reserved memory: not measured on CPU (--device cuda needs 2 GPUs; none here)."
        )
    )
    base_wait = r0["stats"][base]["output_dist_wait"]
    for n in names[1:]:
        cut = 1.0 - r0["stats"][n]["output_dist_wait"] / base_wait if base_wait > 0 else float("nan")
        print(f"  {n}: output all-to-all wait cut by {100 * cut:.0f}% vs baseline")


if __name__ == "__main__":
    main()
