"""Multi-process test harness: run a function on W gloo ranks, collect results.

Usage::

    def body(rank: int, world_size: int, x: int) -> float:
        # torch.distributed is initialised (backend gloo) when body runs
        ...
        return value

    results = run_gloo(2, body, 3)   # [value_rank0, value_rank1]

The body must be a module-level function (it is pickled by module path to the
ranks). An exception on any rank is re-raised in the parent with that rank's
traceback.

The ranks are a pool of spawned worker processes, one pool per world size, started
on first use and reused by later calls of the same pytest process: importing torch,
torchrec and recpipe costs seconds per process, a body often less. Each call gets a
fresh rendezvous (a new port), the caller's environment variables, working directory
and ``sys.path``, ``torch.set_num_threads(threads_per_rank)``, the torch RNG state
the worker started with, and a gloo group that is destroyed after the body, also
when it raises. What a body may change in its process is put back after it (see
:class:`_ProcessState`).
State that cannot be put back retires the pool after the call, so the next call runs
on new processes: a function of a test file bound to a module or class attribute
outside the tests (a body's monkeypatch), Python threads the body left running, or
a worker grown past :data:`MAX_WORKER_RSS_BYTES`. A failure, a timeout or a dead
worker kills the pool (the other ranks may be stuck in a collective); the next call
starts a new one. ``run_gloo(..., fresh=True)`` runs one call on new processes that
end with it, for a body that must not share a process with other bodies.

:func:`shutdown_pools` ends every pool; it runs at interpreter exit and at the end
of the pytest session (tests/conftest.py).
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import gc
import logging
import os
import pickle
import queue as queue_mod
import signal
import socket
import sys
import threading
import time
import traceback
import types
import warnings
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: A worker whose resident memory passes this after a call is retired with its pool
#: (bodies that build DistributedDataParallel leave their gloo group's C++ state behind).
MAX_WORKER_RSS_BYTES: int = 3 * 2**30

# Folder of the test tree: functions defined under it are the tests' own code.
_TESTS_ROOT: str = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

# Modules (and packages, by prefix) whose attributes and classes' attributes are checked
# for a body's monkeypatch after each call: scanning every loaded module costs ~10x more.
_WATCHED_MODULES: FrozenSet[str] = frozenset({"torch", "os", "os.path", "shutil", "builtins", "io", "tempfile", "time"})
_WATCHED_PACKAGES: Tuple[str, ...] = ("recpipe.", "torch.distributed", "torchrec", "fbgemm_gpu", "pathlib")

# Seconds between checks that the workers are alive while the parent waits for results.
_POLL_S: float = 0.5

# Seconds an idle worker waits for a task before checking that its parent is alive.
_IDLE_POLL_S: float = 2.0

# Environment variables each call sets per rank (the caller's values are replaced).
_RANK_ENV: Tuple[str, ...] = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the gloo rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------


@dataclass
class _Task:
    """One call as a worker receives it (``payload`` is ``(fn, args)`` pickled for this rank)."""

    call_id: int
    port: int
    threads: int
    env: Dict[str, str]
    cwd: str
    sys_path: List[str]
    payload: bytes


@dataclass
class _Reply:
    """A worker's answer to one task: the pickled result, or the traceback when ``ok`` is False.

    ``retire`` lists what the call left behind that the worker cannot put back (the
    pool is then ended after the call).
    """

    call_id: int
    rank: int
    ok: bool
    data: Any
    retire: List[str] = field(default_factory=list)


@dataclass
class _ProcessState:
    """Process-wide state a body may change, captured when a worker starts.

    :meth:`restore` puts it back before and after each call. Environment variables,
    the working directory and ``sys.path`` are set from the caller's per call instead.
    """

    rng: torch.Tensor
    default_dtype: torch.dtype
    deterministic: bool
    deterministic_warn_only: bool
    grad_enabled: bool
    anomaly: bool
    warning_filters: List[Any]
    showwarning: Any
    signals: Dict[int, Any]
    root_handlers: List[logging.Handler]
    root_level: int
    logging_disable: int
    streams: Tuple[Any, Any, Any]

    @classmethod
    def capture(cls) -> "_ProcessState":
        """The state of this process now."""
        handlers: Dict[int, Any] = {}
        for sig in signal.valid_signals():
            try:
                handlers[int(sig)] = signal.getsignal(sig)
            except (OSError, ValueError):  # signals Python cannot query
                continue
        return cls(
            rng=torch.get_rng_state(),
            default_dtype=torch.get_default_dtype(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            grad_enabled=torch.is_grad_enabled(),
            anomaly=torch.is_anomaly_enabled(),
            warning_filters=list(warnings.filters),
            showwarning=warnings.showwarning,
            signals=handlers,
            root_handlers=list(logging.root.handlers),
            root_level=logging.root.level,
            logging_disable=logging.root.manager.disable,
            streams=(sys.stdin, sys.stdout, sys.stderr),
        )

    def restore(self) -> None:
        """Puts the captured state back (the warnings' once-registries are reset too)."""
        torch.set_rng_state(self.rng)
        torch.set_default_dtype(self.default_dtype)
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
        torch.set_grad_enabled(self.grad_enabled)
        torch.autograd.set_detect_anomaly(self.anomaly)
        warnings.filters[:] = self.warning_filters
        warnings._filters_mutated()  # type: ignore[attr-defined] - invalidates "once"/"default" registries
        warnings.showwarning = self.showwarning
        for sig, handler in self.signals.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        logging.root.handlers[:] = self.root_handlers
        logging.root.setLevel(self.root_level)
        logging.disable(self.logging_disable)
        sys.stdin, sys.stdout, sys.stderr = self.streams


_FUNCTION_TYPES = (types.FunctionType, staticmethod, classmethod, types.MethodType, functools.partial)


def _test_code_file(value: Any) -> Optional[str]:
    """The file of a function-like ``value`` when it is defined under the tests, else None."""
    if isinstance(value, (staticmethod, classmethod, types.MethodType)):
        value = value.__func__
    elif isinstance(value, functools.partial):
        value = value.func
    if isinstance(value, types.FunctionType) and value.__code__.co_filename.startswith(_TESTS_ROOT):
        return value.__code__.co_filename
    return None


def _watched_namespaces() -> List[Tuple[str, Any]]:
    """``(name, __dict__)`` of the watched modules and of the classes they define."""
    found: List[Tuple[str, Any]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated module attributes warn when touched
        for name, module in list(sys.modules.items()):
            if not isinstance(module, types.ModuleType) or not (
                name in _WATCHED_MODULES or name.startswith(_WATCHED_PACKAGES)
            ):
                continue
            found.append((name, vars(module)))
            found.extend(
                (f"{name}.{attr}", vars(value))
                for attr, value in list(vars(module).items())
                if isinstance(value, type) and vars(value).get("__module__") == name
            )
    return found


# The watched namespaces, listed again when the number of loaded modules changes.
_NAMESPACES: Tuple[int, List[Tuple[str, Any]]] = (-1, [])


def _patched_attributes() -> List[str]:
    """Attributes of the watched modules and their classes that hold a function of a test file."""
    global _NAMESPACES
    if _NAMESPACES[0] != len(sys.modules):
        _NAMESPACES = (len(sys.modules), _watched_namespaces())
    return [
        f"{name}.{attr}"
        for name, namespace in _NAMESPACES[1]
        for attr, value in list(namespace.items())
        if type(value) in _FUNCTION_TYPES and _test_code_file(value) is not None
    ]


def _resident_bytes() -> int:
    """This process's resident memory (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _leftovers(threads_before: set[int]) -> List[str]:
    """What a call left that this process cannot put back (reasons to retire the pool)."""
    reasons = [f"patched {a}" for a in _patched_attributes()]
    deadline = time.monotonic() + 1.0
    started = [t for t in threading.enumerate() if t.ident not in threads_before and not t.daemon]
    for t in started:  # threads finishing their last work get a moment
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    reasons += [f"thread {t.name!r} still running" for t in started if t.is_alive()]
    rss = _resident_bytes()
    if rss > MAX_WORKER_RSS_BYTES:
        reasons.append(f"resident memory {rss >> 20} MiB > {MAX_WORKER_RSS_BYTES >> 20} MiB")
    return reasons


def _enter_call(rank: int, world_size: int, task: _Task, state: _ProcessState) -> None:
    """Sets up this process for ``task``: the caller's env, cwd and sys.path, the rank's
    rendezvous variables, threads and the captured torch state."""
    os.environ.clear()
    os.environ.update(task.env)
    rank_env = ("127.0.0.1", str(task.port), str(rank), str(rank), str(world_size), str(world_size))
    os.environ.update(zip(_RANK_ENV, rank_env))
    os.chdir(task.cwd)
    sys.path[:] = task.sys_path
    state.restore()
    torch.set_num_threads(task.threads)


def _run_task(rank: int, world_size: int, task: _Task, state: _ProcessState) -> _Reply:
    """Runs one call on this rank: init the group, the body, destroy the group."""
    threads_before = {t.ident for t in threading.enumerate() if t.ident is not None}
    try:
        _enter_call(rank, world_size, task, state)
        fn, args = pickle.loads(task.payload)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        data = bytes(ForkingPickler.dumps(out))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        return _Reply(task.call_id, rank, False, traceback.format_exc())
    finally:
        state.restore()
        # Cyclic garbage of the call goes now; what survives is frozen out of later
        # collections, which then cost in proportion to what the next call creates.
        gc.collect()
        gc.freeze()
    return _Reply(task.call_id, rank, True, data, _leftovers(threads_before))


def _serve(rank: int, world_size: int, tasks: Any, replies: Any) -> None:
    """A worker's loop: one :class:`_Task` at a time until ``None`` or its parent is gone."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks on a timeout
    state = _ProcessState.capture()
    parent = mp.parent_process()
    while True:
        try:
            task = tasks.get(timeout=_IDLE_POLL_S)
        except queue_mod.Empty:
            if parent is not None and not parent.is_alive():
                break
            continue
        if task is None:
            break
        replies.put(_run_task(rank, world_size, task, state))
    # Flush the replies and leave without the interpreter's teardown: C++ static
    # destructors racing torch's background threads (gloo groups that a
    # DistributedDataParallel keeps alive) can abort a finalizing process.
    replies.close()
    replies.join_thread()
    os._exit(0)


# ---------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------


def _exit_text(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _WorkerPool:
    """``world_size`` spawned workers that run calls of :func:`run_gloo` one at a time."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.replies = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=_serve, args=(r, world_size, self.tasks[r], self.replies), daemon=False)
            for r in range(world_size)
        ]
        self._call_id = 0
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        """Whether every worker is running."""
        return all(p.is_alive() for p in self.procs)

    def call(self, fn: Callable[..., Any], args: Tuple[Any, ...], threads: int, timeout_s: float) -> List[_Reply]:
        """Runs ``fn`` on every worker; the replies ordered by rank.

        Raises:
            RuntimeError: a rank raised (its traceback), a worker died, or ``timeout_s`` passed.
        """
        # pickled once per rank: a tensor shared through a file descriptor is handed out once
        payloads = [bytes(ForkingPickler.dumps((fn, args))) for _ in range(self.world_size)]
        self._call_id += 1
        port, env, cwd = free_port(), dict(os.environ), os.getcwd()
        for rank, q in enumerate(self.tasks):
            q.put(_Task(self._call_id, port, threads, env, cwd, list(sys.path), payloads[rank]))
        replies: Dict[int, _Reply] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < self.world_size:
            reply = self._next_reply(deadline, timeout_s, sorted(replies))
            if reply.call_id != self._call_id:
                continue
            if not reply.ok:
                raise RuntimeError("a gloo rank failed:\n" + "\n".join(self._errors(reply, set(replies))))
            replies[reply.rank] = reply
        return [replies[r] for r in range(self.world_size)]

    def _next_reply(self, deadline: float, timeout_s: float, done: List[int]) -> _Reply:
        while True:
            try:
                return self.replies.get(timeout=max(0.0, min(_POLL_S, deadline - time.monotonic())))
            except queue_mod.Empty:
                pass
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
            if dead:
                try:  # a rank's error may have been sent before another rank died
                    return self.replies.get(timeout=_POLL_S)
                except queue_mod.Empty:
                    pass
                what = "; ".join(f"rank {r} {_exit_text(code)}" for r, code in dead)
                raise RuntimeError(f"a gloo worker died while running the body: {what}; results from ranks {done}")
            if time.monotonic() >= deadline:
                self._dump_stacks()
                pending = [r for r in range(self.world_size) if r not in done]
                raise RuntimeError(
                    f"timed out after {timeout_s} s waiting for the ranks (ranks {pending} did not answer; "
                    "their stacks are on stderr)"
                )

    def _errors(self, first: _Reply, answered: set[int]) -> List[str]:
        """The failing rank's traceback, and those of other ranks that fail within a second
        (``answered``: the ranks that returned before ``first`` came)."""
        errors = [f"--- rank {first.rank} ---\n{first.data}"]
        answered = answered | {first.rank}
        end = time.monotonic() + 1.0
        while len(answered) < self.world_size and time.monotonic() < end:
            try:
                reply = self.replies.get(timeout=0.1)
            except queue_mod.Empty:
                continue
            if reply.call_id == first.call_id:
                answered.add(reply.rank)
                if not reply.ok:
                    errors.append(f"--- rank {reply.rank} ---\n{reply.data}")
        errors += [f"--- rank {r} {_exit_text(p.exitcode)} ---" for r, p in enumerate(self.procs) if not p.is_alive()]
        return errors

    def _dump_stacks(self) -> None:
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1.0)

    def close(self, kill: bool = False) -> None:
        """Ends the workers: asks them to stop (or kills them with ``kill``), then reaps them."""
        if not kill:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            if not kill:
                p.join(timeout=10.0)
            if p.is_alive():
                p.kill()
            p.join()
        for q in [*self.tasks, self.replies]:
            q.cancel_join_thread()  # a killed reader must not block this process's exit
            q.close()


# One pool per world size, in this process.
_POOLS: Dict[int, _WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def shutdown_pools() -> None:
    """Ends every worker pool of this process (idle workers stop; others are killed)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close(kill=not pool.alive())


atexit.register(shutdown_pools)


def _check_arguments(world_size: int, fn: Callable[..., Any], threads_per_rank: int, timeout_s: float) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not callable(fn):
        raise ValueError(f"fn must be a module-level function (it is pickled by name), got {fn!r}")
    if not isinstance(threads_per_rank, int) or threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be an int >= 1, got {threads_per_rank!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")


def run_gloo(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    threads_per_rank: int = 1,
    timeout_s: float = 600.0,
    fresh: bool = False,
) -> List[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Args:
        world_size: number of ranks (processes).
        fn: module-level function; its return value must be picklable.
        *args: extra arguments passed to ``fn``.
        threads_per_rank: ``torch.set_num_threads`` in each rank.
        timeout_s: seconds to wait for all ranks before failing.
        fresh: run on new processes that end with the call, instead of the shared pool
            (for a body whose process state must not meet other bodies).

    Returns:
        The per-rank return values, ordered by rank.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message), a worker died, or
            the ranks did not answer within ``timeout_s``.
        ValueError: an argument is out of range.
    """
    _check_arguments(world_size, fn, threads_per_rank, timeout_s)
    with _POOLS_LOCK:
        pool = None if fresh else _POOLS.pop(world_size, None)
        if pool is not None and not pool.alive():
            pool.close(kill=True)
            pool = None
        pool = pool or _WorkerPool(world_size)
    try:
        replies = pool.call(fn, args, threads_per_rank, timeout_s)
        # unpickled while the workers live: a shared tensor is fetched from its rank
        results = [pickle.loads(r.data) for r in replies]
    except BaseException:
        pool.close(kill=True)
        raise
    retire = [f"rank {r.rank}: {why}" for r in replies for why in r.retire]
    if retire:
        print(f"run_gloo: {fn.__qualname__} retired its workers: " + "; ".join(retire), file=sys.stderr)
    with _POOLS_LOCK:
        if fresh or retire or world_size in _POOLS:
            pool.close()
        else:
            _POOLS[world_size] = pool
    return results
