"""DCP checkpoints (recpipe.pipeline.checkpoint) vs per-rank ``.pt`` exports (a torch.save baseline).

Two gloo CPU ranks hold a DMP EBC whose tables are tiered (ROW_WISE, hash_roundrobin,
fused row-wise Adagrad; placement ``--mode`` / ``--load-factor``). Per table set:

* ours, save: ``recpipe.pipeline.checkpoint.save(model, dir)`` (export, DCP write, fsync);
* ours, load: ``recpipe.pipeline.checkpoint.load(model, dir)`` (each rank streams every saving
  rank's export, keeps its own rows by global id);
* .pt, save: each rank ``torch.save`` s its ``tiered_state()`` to ``rank<r>.pt`` and fsyncs
  (no digests);
* .pt, load: each rank ``torch.load`` s every rank's file and calls ``load_tiered_state``.
* reshard: the same loads into a model whose tables are routed with another seed
  (every row changes owner: each rank reads every saving rank's export and keeps
  its rows by global id, as for another world size); timed in the last run only.

Times are wall seconds of the slower rank between two barriers, best of ``--repeat`` runs
(which of DCP / .pt goes first alternates: disk writeback of one slows the other);
GB/s = table bytes (values + optimizer state, every rank) / seconds. Loads read files the
save just wrote, so they come from the page cache when memory allows.

Usage::

    .venv/bin/python scripts/bench_checkpoint.py                 # ~1 GB set and the recipe's set
    .venv/bin/python scripts/bench_checkpoint.py --sets 2x1048576x64 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import hardware_line, positive_int, print_table, run_workers, unit_fraction, writable_dir  # noqa: E402

WORLD = 2
OPS = ("ours_save", "ours_load", "ours_reshard", "pt_save", "pt_load", "pt_reshard")


def _parse_set(text: str) -> Tuple[int, int, int]:
    try:
        tables, rows, dim = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"table set {text!r}: expected TABLESxROWSxDIM, e.g. 2x1048576x64") from None
    if min(tables, rows, dim) <= 0:
        raise argparse.ArgumentTypeError(f"table set {text!r}: every number must be positive")
    return tables, rows, dim


def adagrad_ebc(n_tables: int, rows: int, dim: int) -> Tuple[Any, List[str]]:
    """A meta-device EBC of ``n_tables`` tables ``t<i>`` (``rows x dim``, one feature each) with
    torchrec's fused row-wise Adagrad (lr 0.05), and the tables' names."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    names = [f"t{i}" for i in range(n_tables)]
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, num_embeddings=rows, embedding_dim=dim, feature_names=[f"f_{n}"]) for n in names
        ],
        device=torch.device("meta"),
    )
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.05})
    return ebc, names


def _model(n_tables: int, rows: int, dim: int, mode: str, x: float, seed: int = 1) -> Any:
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan, ShardingType

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder
    from recpipe.planner.torchrec_plan import PlacementParameterSharding, row_wise_sharding_spec

    ebc, names = adagrad_ebc(n_tables, rows, dim)
    sharder = TieredEmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        ebc,
        {n: row_wise() for n in names},
        sharder=sharder,  # type: ignore[arg-type]
        local_size=WORLD,
        world_size=WORLD,
        device_type="cpu",
    )
    for n in names:
        plan[n] = PlacementParameterSharding(
            sharding_type=ShardingType.ROW_WISE.value,
            compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
            ranks=list(range(WORLD)),
            sharding_spec=row_wise_sharding_spec(rows, dim, WORLD, WORLD, "cpu"),
            dist_type="hash_roundrobin",
            mode=mode,
            cache_load_factor=x,
            seed=seed,
        )
    return DistributedModelParallel(
        ebc,
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )


def _timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _pt_save(model: Any, directory: str, rank: int) -> None:
    path = os.path.join(directory, f"rank{rank}.pt")
    with open(path, "wb") as f:
        torch.save(model.module.tiered_state(), f)
        f.flush()
        os.fsync(f.fileno())


def _pt_load(model: Any, directory: str) -> None:
    exports = [torch.load(os.path.join(directory, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    model.module.load_tiered_state({name: [e[name] for e in exports] for name in exports[0]})


def _worker(rank: int, port: int, args: argparse.Namespace, root: str, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")  # torchrec's deprecation warnings, once per rank
    try:  # everything inside: a failure always reaches the parent
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        from recpipe.pipeline import checkpoint as recpipe_dcp

        results: List[Dict[str, Any]] = []
        for n_tables, rows, dim in args.sets:
            model = _model(n_tables, rows, dim, args.mode, args.load_factor)
            # another routing seed: every row moves, each rank reads every saving rank's export
            other = _model(n_tables, rows, dim, args.mode, args.load_factor, seed=2)
            set_dir = os.path.join(root, f"{n_tables}x{rows}x{dim}")
            times: Dict[str, List[float]] = {k: [] for k in OPS}
            for i in range(args.repeat):
                dcp_dir, pt_dir = os.path.join(set_dir, f"dcp{i}"), os.path.join(set_dir, f"pt{i}")
                if rank == 0:
                    os.makedirs(pt_dir, exist_ok=True)
                dist.barrier()
                ours = [
                    ("ours_save", lambda: recpipe_dcp.save(model, dcp_dir)),
                    ("ours_load", lambda: recpipe_dcp.load(model, dcp_dir)),
                    ("ours_reshard", lambda: recpipe_dcp.load(other, dcp_dir)),
                ]
                pt = [
                    ("pt_save", lambda: _pt_save(model, pt_dir, rank)),
                    ("pt_load", lambda: _pt_load(model, pt_dir)),
                    ("pt_reshard", lambda: _pt_load(other, pt_dir)),
                ]
                for key, fn in ours + pt if i % 2 == 0 else pt + ours:  # alternate which goes first
                    if key.endswith("reshard") and i != args.repeat - 1:
                        continue  # once per set (keeps the default run near 2 minutes)
                    times[key].append(_timed(fn))
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(dcp_dir, ignore_errors=True)
                    shutil.rmtree(pt_dir, ignore_errors=True)
            shard = next(iter(model.module.tiered_tables().values()))
            results.append(
                {"set": (n_tables, rows, dim), "row_bytes": shard.row_bytes, **{k: min(v) for k, v in times.items()}}
            )
            model = other = None  # frees this set's tables before the next is built
        queue.put((rank, results, None))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        import traceback

        queue.put((rank, None, f"{exc!r}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sets",
        type=_parse_set,
        nargs="+",
        default=[_parse_set("2x2097152x64"), _parse_set("2x1048576x64")],
        help="table sets TABLESxROWSxDIM (default: ~1 GB set, the default recipe's set)",
    )
    parser.add_argument(
        "--mode",
        default="HYBRID",
        choices=["HYBRID", "CACHING"],
        help="tiered placement mode of the tables (default HYBRID)",
    )
    parser.add_argument(
        "--load-factor",
        type=unit_fraction,
        default=0.5,
        help="cache load factor x in (0, 1] of the tiered tables (default 0.5)",
    )
    parser.add_argument(
        "--repeat",
        type=positive_int,
        default=2,
        help="runs per set (best of; the order of DCP and .pt alternates; default 2)",
    )
    parser.add_argument(
        "--dir",
        type=writable_dir,
        default=None,
        help="existing directory to checkpoint into (default: a temporary one on /tmp's disk)",
    )
    args = parser.parse_args()

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, root, queue)) for r in range(WORLD)]
    try:
        out = run_workers(procs, queue)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(hardware_line(threads=1) + f"; {WORLD} gloo ranks; checkpoints in {os.path.dirname(root)}")
    print(
        f"tiered tables: ROW_WISE hash_roundrobin, {args.mode} {args.load_factor}, row-wise Adagrad fp32; "
        f"best of {args.repeat}; seconds = slower rank between barriers"
    )
    rows_out = []
    for i, res in enumerate(out[0]):
        n_tables, rows, dim = res["set"]
        gb = n_tables * rows * res["row_bytes"] / 1e9
        t = {k: max(out[r][i][k] for r in range(WORLD)) for k in OPS}
        for what in ("save", "load", "reshard"):
            ours, pt = t[f"ours_{what}"], t[f"pt_{what}"]
            rows_out.append([f"{n_tables} x {rows:,} x {dim}", gb, what, ours, gb / ours, pt, gb / pt, ours / pt])
    print_table(["tables", "GB", "op", "DCP s", "DCP GB/s", ".pt s", ".pt GB/s", "DCP / .pt"], rows_out)


if __name__ == "__main__":
    main()
