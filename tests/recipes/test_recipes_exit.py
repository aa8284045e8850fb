"""A recipe process ends with its exit code, never SIGABRT from a collective finishing at exit.

Rank 1 leaves with an all-reduce still pending (a completion callback attached, as
torchrec's awaitables attach them); rank 0 joins it only once rank 1 is exiting, while
rank 1's last ``atexit`` hook holds the GIL. Ending through ``sys.exit``, the callback
takes the GIL once the interpreter finalizes and the process dies in ``std::terminate``
(exit -6, in most runs: when the main thread releases the GIL is up to the interpreter).
Ending through :func:`recpipe.recipes.shutdown.run_main` (what ``python -m
recpipe.recipes.train`` does), the process never finalizes: no ``atexit`` hook runs and
it exits with its code, every run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from recpipe.recipes.shutdown import KEYBOARD_INTERRUPT_EXIT_CODE

RANK_SCRIPT = textwrap.dedent(
    """
    import atexit, ctypes, os, sys, time
    from pathlib import Path

    # The last atexit hook (registered first): sleep 3 s in a PyDLL call, which keeps the
    # GIL with no Python bytecode after it, so the pending collective's completion callback
    # (rank 0 joins meanwhile) can take the GIL only once the interpreter is finalizing.
    atexit.register(ctypes.PyDLL(None).usleep, 3_000_000)
    import torch, torch.distributed as dist
    from recpipe.recipes.shutdown import run_main

    marks = Path(sys.argv[1])
    ending = sys.argv[2]
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        # Join rank 1's all-reduce only once rank 1 is exiting (or has gone).
        while not (marks / "exiting").exists() and not (marks / "rank1-exited").exists():
            time.sleep(0.01)
        try:
            dist.all_reduce(torch.ones(4))
        except RuntimeError:
            pass
        os._exit(0)

    atexit.register((marks / "exiting").touch)  # runs just before the sleeping hook
    work = dist.all_reduce(torch.ones(4), async_op=True)
    work.get_future().then(lambda fut: fut.value())

    def main():
        # Left in stdout's buffer: flushing it at finalization releases the GIL (a write).
        sys.stdout.write("rank 1 leaves\\n")
        return 3

    if ending == "sys.exit":
        sys.exit(main())
    run_main(main)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_pair(tmp_path: Path, ending: str) -> tuple[int, str]:
    """Runs both ranks; returns rank 1's exit code and output."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(marks), ending],
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    out1, _ = procs[1].communicate(timeout=120)
    (marks / "rank1-exited").touch()
    procs[0].communicate(timeout=120)
    return procs[1].returncode, out1


def test_run_main_exits_with_the_code_while_a_collective_is_pending(tmp_path: Path) -> None:
    """The entry point's exit path: the code ``main`` returned, no abort, no finalization."""
    code, out = _run_pair(tmp_path, "run_main")
    assert code == 3, out
    assert "terminate called" not in out
    assert not (tmp_path / "marks" / "exiting").exists()  # atexit hooks never ran: no finalization


def _exit_code_of(body: str) -> subprocess.CompletedProcess[str]:
    program = f"from recpipe.recipes.shutdown import run_main\n{body}\nrun_main(main)\n"
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("body", "expected", "stderr_part"),
    [
        ("def main():\n    return 0", 0, ""),
        ("def main():\n    return 2", 2, ""),
        ("def main():\n    print('last line', flush=False)", 0, ""),
        ("import sys\ndef main():\n    sys.exit(5)", 5, ""),
        ("import sys\ndef main():\n    sys.exit('bad thing')", 1, "bad thing"),
        ("def main():\n    raise ValueError('boom')", 1, "ValueError: boom"),
        ("def main():\n    raise KeyboardInterrupt", KEYBOARD_INTERRUPT_EXIT_CODE, ""),
    ],
)
def test_run_main_maps_every_ending_to_its_exit_code(body: str, expected: int, stderr_part: str) -> None:
    """Return value, ``SystemExit``, an uncaught exception and Ctrl-C each give their code."""
    proc = _exit_code_of(body)
    assert proc.returncode == expected, proc.stderr
    assert stderr_part in proc.stderr


def test_run_main_flushes_buffered_output_before_exiting() -> None:
    """``os._exit`` skips the interpreter's own flush: buffered stdout must still arrive."""
    proc = _exit_code_of("import sys\ndef main():\n    sys.stdout.write('x' * 10000 + 'END')")
    assert proc.returncode == 0
    assert proc.stdout.endswith("END")
