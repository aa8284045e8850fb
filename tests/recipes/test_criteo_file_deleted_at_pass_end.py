"""A Criteo data file deleted at the end of the first pass is named in one error line.

With ``--max-steps`` the first pass checks the files' sizes where it ends; a file deleted
just then raises a ``CriteoDataChangedError`` naming the file and the fix, not a bare
FileNotFoundError.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.criteo_files import CRITEO, write_criteo

from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data.criteo import CriteoDataChangedError
from recpipe.recipes.data.registry import make_data_source


def test_a_data_file_deleted_at_the_end_of_the_first_pass_is_named(tmp_path: Path) -> None:
    """With ``--max-steps`` the first pass checks the files' sizes where it ends; a file deleted
    just then is named in a CriteoDataChangedError, not a bare FileNotFoundError."""
    data = tmp_path / "day_0.tsv"
    write_criteo(data, 64)  # 4 global batches of 16
    cfg = TrainConfig(**{**CRITEO, "max_steps": 10, "data_path": str(data)})
    source = make_data_source(cfg, 0, 1)
    batches = source.train_batches(0, 10)
    for _ in range(4):  # the whole first pass; the reader stops before it sees the file's end
        next(batches)
    data.unlink()  # the open file is still read to its end, then its size is checked
    with pytest.raises(CriteoDataChangedError) as e:
        next(batches)
    assert e.value.path == str(data)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(
        f"--data-path file {data} can no longer be read while this run reads it (No such file "
        "or directory): it held 64 rows when this run read it and holds none now"
    ), message
    assert "resume from the last checkpoint (--resume)" in message
