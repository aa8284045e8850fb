"""Multi-process test harness: run a function on W gloo ranks, collect results.

Usage::

    def body(rank: int, world_size: int, x: int) -> float:
        # torch.distributed is initialised (backend gloo) when body runs
        ...
        return value

    results = run_gloo(2, body, 3)   # [value_rank0, value_rank1]

The body must be a module-level function (it is pickled to spawned processes).
An exception on any rank is re-raised in the parent with that rank's traceback.
"""

from __future__ import annotations

import os
import queue as queue_mod  # noqa: F401 - queue.Empty is raised by Queue.get
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the gloo rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], queue: Any, threads: int
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        queue.put((rank, False, traceback.format_exc()))
        return
    # The body ran and its process group is destroyed (a crash in either is still
    # an error or a missing result). Flush the result and leave without the
    # interpreter's teardown: C++ static destructors racing torch's background
    # threads once aborted a rank after it had reported ("terminate called without
    # an active exception", 1 run in ~40 CI runs, not reproducible in 36 reruns).
    queue.close()
    queue.join_thread()
    os._exit(0)


def run_gloo(
    world_size: int, fn: Callable[..., Any], *args: Any, threads_per_rank: int = 1, timeout_s: float = 600.0
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Args:
        world_size: number of processes.
        fn: module-level function; its return value must be picklable.
        *args: extra arguments passed to ``fn``.
        threads_per_rank: ``torch.set_num_threads`` in each rank.
        timeout_s: seconds to wait for all ranks before failing.

    Returns:
        The per-rank return values, ordered by rank.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, threads_per_rank), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = queue.get(timeout=timeout_s)
            except Exception:  # queue.Empty
                errors.append(f"timed out after {timeout_s} s waiting for the ranks")
                break
            if ok:
                results[rank] = payload
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=timeout_s if not errors else 5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("a gloo rank failed:\n" + "\n".join(errors))
    bad = [r for r, p in enumerate(procs) if p.exitcode not in (0, None)]
    if bad or len(results) != world_size:
        raise RuntimeError(f"gloo ranks {bad} exited abnormally; results from {sorted(results)}")
    return [results[r] for r in range(world_size)]
