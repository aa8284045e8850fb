"""Bad arguments to recpipe's DCP checkpoint helpers, refused naming them.

``save``, ``load``, ``load_dcp_state_dict``, ``dcp_state_dict``, ``verify_checkpoint``,
``write_digests`` and ``remove_rank_files`` refuse a bad argument with a ValueError naming
it, not by pathlib nor as a CheckpointSaveError blaming the disk; a refused save leaves the
previous checkpoint whole (reference: the weights saved before it).
"""

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from recpipe.pipeline import checkpoint as recpipe_dcp


@pytest.mark.parametrize(
    "call,arg",
    [
        (lambda d: recpipe_dcp.save(torch.nn.Linear(2, 2), d, thread_count=0), "thread_count"),
        (lambda d: recpipe_dcp.save(torch.nn.Linear(2, 2), d, thread_count=2.0), "thread_count"),
        (lambda d: recpipe_dcp.save(torch.nn.Linear(2, 2), d, thread_count=None), "thread_count"),
        (lambda d: recpipe_dcp.save(None, d), "model"),
        (lambda d: recpipe_dcp.save(torch.nn.Linear(2, 2), None), "checkpoint_id"),
        (lambda d: recpipe_dcp.load(torch.nn.Linear(2, 2), None), "checkpoint_id"),
        (lambda d: recpipe_dcp.load(None, d), "model"),
        (lambda d: recpipe_dcp.load_dcp_state_dict(torch.nn.Linear(2, 2), 3), "checkpoint"),
        (lambda d: recpipe_dcp.dcp_state_dict("model"), "model"),
        (lambda d: recpipe_dcp.verify_checkpoint(None), "checkpoint_id"),
        (lambda d: recpipe_dcp.write_digests(3), "checkpoint_id"),
        (lambda d: recpipe_dcp.remove_rank_files(d, None), "rank"),
        (lambda d: recpipe_dcp.remove_rank_files(d, "0"), "rank"),
    ],
)
def test_dcp_arguments_named(tmp_path: Path, call: Callable[[Path], Any], arg: str) -> None:
    """Bad arguments are refused naming them, not by pathlib nor as a CheckpointSaveError
    blaming the disk."""
    with pytest.raises(ValueError, match=arg):
        call(tmp_path)


def test_dcp_save_bad_thread_count_keeps_previous_checkpoint(tmp_path: Path) -> None:
    """A save refused for ``thread_count=0`` leaves the previous checkpoint whole: it loads
    into a fresh module (reference: the saved weights)."""
    src = torch.nn.Linear(2, 2)
    recpipe_dcp.save(src, tmp_path)
    with pytest.raises(ValueError, match="thread_count"):
        recpipe_dcp.save(torch.nn.Linear(2, 2), tmp_path, thread_count=0)
    dst = torch.nn.Linear(2, 2)
    recpipe_dcp.load(dst, tmp_path)
    torch.testing.assert_close(dst.weight, src.weight)
    torch.testing.assert_close(dst.bias, src.bias)
