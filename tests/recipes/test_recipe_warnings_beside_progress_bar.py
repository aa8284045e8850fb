"""Python warnings emitted while the recipe's progress bar is drawn start on a line of their own.

The training run (a subprocess: stdout and stderr on one stream, as on a terminal) warns
mid-run; the reference is what ``warnings.formatwarning`` prints for that warning. The
previous ``warnings.showwarning`` is restored after the run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

_WARN_RUN = r"""
import sys, warnings
import recpipe.recipes.train as train_module
from recpipe.recipes.data.registry import make_data_source

def warning_source(config, rank, world_size):
    source = make_data_source(config, rank, world_size)
    clean = source.train_batches
    def train_batches(start, stop):
        for index, batch in zip(range(start, stop), clean(start, stop)):
            if index == 3:
                warnings.warn("recpipe-test: a warning during training", UserWarning)
            yield batch
    source.train_batches = train_batches
    return source

train_module.make_data_source = warning_source
before = warnings.showwarning
code = train_module.main(sys.argv[1:])
assert warnings.showwarning is before, "showwarning not restored"
warnings.warn("recpipe-test: after the run", UserWarning)
sys.exit(code)
"""


def test_warnings_during_training_do_not_continue_the_progress_bar_line(tmp_path: Path) -> None:
    """Stdout and stderr on one terminal, the bar drawn: a warning starts on a line of its
    own, not after the bar's text on the bar's line."""
    flags = [
        "--dataset=synthetic",
        "--model=dlrm",
        "--num-embeddings=500",
        "--synthetic-id-space=5000",
        "--embedding-dim=8",
        "--dense-arch=16,8",
        "--over-arch=16,1",
        "--batch-size=32",
        "--eval-batches=2",
        "--max-steps=8",
        "--log-every=4",
        "--eval-every=0",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="always")
    proc = subprocess.run(
        [sys.executable, "-c", _WARN_RUN, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        timeout=300,
    )
    text = proc.stdout.decode()  # bytes: text mode would turn the bar's '\r' into '\n'
    assert proc.returncode == 0, text[-3000:]
    assert "\rtrain:" in text, text  # the bar was drawn
    # the reference: what the default handler prints for it (file:line: Category: message)
    expected = warnings.formatwarning("recpipe-test: a warning during training", UserWarning, "F", 1).split(": ", 1)[1]
    lines = [line for line in text.split("\n") if "recpipe-test: a warning during training" in line]
    assert len(lines) == 1, text
    shown = lines[0].split("\r")[-1]  # what a terminal shows of the line: the text after its last '\r'
    assert re.fullmatch(r"\S+:\d+: " + re.escape(expected.rstrip("\n")), shown), repr(lines[0])
    # after the run, the previous handler prints as before
    (after,) = [line for line in text.split("\n") if "recpipe-test: after the run" in line]
    assert after.endswith("UserWarning: recpipe-test: after the run"), repr(after)
