"""A frozen rank fails the job within ``--timeout-s`` instead of hanging it forever.

Two ranks of the real recipe run under torchrun; once training is under way one
worker is frozen with SIGSTOP. The other must fail in its next collective (gloo
honours the process group's timeout on all-to-all, all-reduce and barrier) with an
error that names the timeout and points at a dead or frozen rank, and the job must
exit non-zero, not sit in the collective for gloo's default 30 minutes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

TIMEOUT_S: int = 10
# After a worker fails, torchrun SIGTERMs the others and SIGKILLs those still alive
# 30 s later (LocalElasticAgent._stop_workers; fixed, not configurable): a stopped
# process never handles SIGTERM, so the job ends only after that grace.
TORCHRUN_KILL_GRACE_S: int = 30
SLACK_S: int = 30
# Startup (imports, planning, sharding) on a loaded 2-core machine.
START_LIMIT_S: int = 300

RECIPE_ARGS: list[str] = [
    "--dataset",
    "synthetic",
    "--model",
    "dlrm",
    "--pipeline",
    "fused",
    "--num-embeddings",
    "2000",
    "--synthetic-id-space",
    "50000",
    "--embedding-dim",
    "8",
    "--dense-arch",
    "16,8",
    "--over-arch",
    "16,1",
    "--batch-size",
    "64",
    "--max-steps",
    "1000000",
    "--log-every",
    "2",
    "--no-progress-bar",
    "--timeout-s",
    str(TIMEOUT_S),
]


def _children(pid: int) -> list[int]:
    """Live child processes of ``pid`` (from /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            kids.append(int(entry.name))
    return kids


def _rank_of(pid: int) -> int | None:
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _is_recipe_worker(pid: int) -> bool:
    """True while ``pid`` is a live process of the recipe (guards against pid reuse)."""
    try:
        cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False
    return b"recpipe.recipes.train" in cmdline and not _has_exited(pid)


def _has_exited(pid: int) -> bool:
    """True once ``pid`` is gone or a zombie (exited, not yet reaped by torchrun)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads worker processes from /proc")
def test_frozen_rank_fails_the_job_within_the_timeout() -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "recpipe.recipes.train",
        *RECIPE_ARGS,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []
    training = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "[recpipe] step 6/" in line:
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    frozen: int | None = None
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while not training.wait(0.5):
            if proc.poll() is not None or time.monotonic() > deadline:
                reader.join(timeout=10)
                pytest.fail(f"training did not start (exit code {proc.poll()}):\n" + "".join(lines[-60:]))
        workers = {_rank_of(p): p for p in _children(proc.pid)}
        assert set(workers) == {0, 1}, (workers, "".join(lines[-30:]))
        frozen, survivor = workers[1], workers[0]
        os.kill(frozen, signal.SIGSTOP)
        t0 = time.monotonic()

        while not _has_exited(survivor) and time.monotonic() - t0 < TIMEOUT_S + SLACK_S:
            time.sleep(0.2)
        survivor_s = time.monotonic() - t0
        assert _has_exited(survivor), f"rank 0 still waits {survivor_s:.0f} s after rank 1 froze"
        # it waited for the timeout (it did not fail for another reason first)
        assert survivor_s >= TIMEOUT_S - 1, survivor_s

        job_limit = TIMEOUT_S + TORCHRUN_KILL_GRACE_S + SLACK_S
        try:
            code = proc.wait(timeout=max(1.0, job_limit - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job still runs {job_limit} s after rank 1 froze:\n" + "".join(lines[-40:]))
        reader.join(timeout=10)
        out = "".join(lines)
        assert code != 0
        # the surviving rank's error names the timeout and the likely cause
        assert "CollectiveFailureError: rank 0: a collective did not complete" in out, out[-4000:]
        assert f"--timeout-s {TIMEOUT_S}" in out and "dead or frozen" in out
        # gloo's own message is kept (which one depends on where the timeout caught the pair)
        assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in out or "Application timeout caused pair closure" in out, (
            out[-4000:]
        )
    finally:
        # nothing may outlive the test: torchrun's workers run in their own sessions
        leftovers = set(_children(proc.pid)) if proc.poll() is None else set()
        if frozen is not None and _is_recipe_worker(frozen):
            leftovers.add(frozen)
        for pid in leftovers:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        reader.join(timeout=10)


def test_collective_errors_are_explained_and_others_left_alone() -> None:
    from recpipe.recipes.config import TrainConfig
    from recpipe.recipes.faults import CollectiveFailureError, explain_collective_failure

    cfg = TrainConfig(timeout_s=45)
    gloo_timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 45000ms for recv")
    explained = explain_collective_failure(gloo_timeout, cfg)
    assert isinstance(explained, CollectiveFailureError)
    assert "within the timeout (--timeout-s 45, 45 s)" in str(explained) and "dead or frozen" in str(explained)
    assert str(explained).endswith(str(gloo_timeout))
    pair_closed = RuntimeError("[gloo/transport/tcp/pair.cc:534] Application timeout caused pair closure")
    assert "within the timeout (--timeout-s 45, 45 s)" in str(explain_collective_failure(pair_closed, cfg))
    peer_gone = RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:6554")
    assert "probably crashed or was killed" in str(explain_collective_failure(peer_gone, cfg))
    assert explain_collective_failure(RuntimeError("shape mismatch"), cfg) is None
    assert explain_collective_failure(ValueError("Timed out waiting"), cfg) is None
    assert explain_collective_failure(explained, cfg) is None  # never wrapped twice
