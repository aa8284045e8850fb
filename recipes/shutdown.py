"""How a recipe process ends: with its exit code, never with SIGABRT.

A gloo process group outlives ``dist.destroy_process_group()`` once a
``DistributedDataParallel`` has been built on it (torch keeps a C++ reference; the
group's worker, transport-loop and TCPStore threads keep running). If one of those
threads completes a collective while the interpreter finalizes, the completion needs
the GIL, the thread is made to exit mid-C++ and the process dies in ``std::terminate``
("terminate called without an active exception", exit -6), although the run already
reported its result or its error. No public torch API joins those threads, so the
entry point flushes what the process owns and ends it without finalizing the
interpreter. Imports nothing of recpipe.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Callable, NoReturn

# Exit code of a process stopped by Ctrl-C, as a shell reports SIGINT (128 + 2).
KEYBOARD_INTERRUPT_EXIT_CODE: int = 130


def exit_process(code: int) -> NoReturn:
    """Flushes logging and the standard streams, then ends the process with ``code``.

    Skips interpreter finalization (``os._exit``): callers close what they own first
    (the recipe's ``run`` closes its pipeline, TensorBoard writer and process group).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to flush
            pass
    os._exit(code)


def exit_code(result: object) -> int:
    """The process exit code for what ``main`` returned or ``SystemExit`` carried."""
    if result is None:
        return 0
    if isinstance(result, int):
        return result
    print(result, file=sys.stderr)  # sys.exit("message") prints the message and exits 1
    return 1


def run_main(main: Callable[[], object]) -> NoReturn:
    """Runs an entry point's ``main`` and ends the process with its exit code.

    A returned int (or ``SystemExit``) is the code; an uncaught exception prints its
    traceback and exits 1; ``KeyboardInterrupt`` exits 130.
    """
    try:
        code = exit_code(main())
    except SystemExit as e:
        code = exit_code(e.code)
    except KeyboardInterrupt:
        code = KEYBOARD_INTERRUPT_EXIT_CODE
    except BaseException:  # noqa: BLE001 - the traceback is the report; the code says it failed
        traceback.print_exc()
        code = 1
    exit_process(code)
