"""Recipe progress output, truncated data and batch-count agreement, each checked against
an independent reference.

* a failing run closes its tqdm progress bar before the error line, and log lines do not
  continue the bar's line;
* Criteo files that shrink while a run reads them give one error line naming the file;
* ranks given different numbers of batches (e.g. each node reading its own copy of
  ``--data-path``) are refused at start naming each rank's count;
* a resumed run's TensorBoard holds the steps and values of an uninterrupted run, also
  when the checkpoint step is not a multiple of ``--log-every``;
* ``--checkpoint-every`` without ``--checkpoint-dir`` is refused.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from harness.criteo_files import CRITEO, write_criteo
from harness.gloo import run_gloo
from harness.recipe_configs import SYNTHETIC, scalars

import recpipe.recipes.train as train_module
from recpipe.recipes.config import ConfigError, TrainConfig
from recpipe.recipes.data.registry import make_data_source
from recpipe.recipes.faults import BatchCountError, CollectiveFailureError, explain_collective_failure
from recpipe.recipes.loop import TrainResult
from recpipe.recipes.train import main, run


def scalars_of(result: TrainResult, tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalar events of a finished run's TensorBoard directory."""
    assert result.tb_dir == str(tb_dir)
    return scalars(tb_dir)


def _flags(config: dict[str, Any]) -> list[str]:
    return [
        f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
        for k, v in config.items()
        if k != "progress_bar" and v is not None
    ]


# ---------------------------------------------------------------- progress bar
def test_a_failing_run_closes_the_progress_bar_before_its_error_line(tmp_path: Path) -> None:
    data = tmp_path / "day_0.tsv"
    write_criteo(data, 320)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        # a diverging dense lr: NonFiniteLossError at step 2, with the bar (on by default) drawn
        code = main([*_flags(CRITEO), f"--data-path={data}", "--dense-lr=1e30", "--log-every=10"])
    assert code == 1
    text = err.getvalue()
    assert "\rtrain:" in text, text  # the bar was drawn (tqdm redraws a line after '\r')
    (line,) = [line for line in text.split("\n") if "NonFiniteLossError" in line]
    assert line.startswith("error: NonFiniteLossError: non-finite training loss at step 2"), repr(line)


def test_log_lines_do_not_continue_the_progress_bar_line(tmp_path: Path) -> None:
    """Stdout and stderr on one terminal: each ``[recpipe] step`` / ``eval`` line starts on a
    line of its own, not after the bar's text on the bar's line."""
    both = io.StringIO()
    with contextlib.redirect_stderr(both), contextlib.redirect_stdout(both):
        run(TrainConfig(**dict(SYNTHETIC, progress_bar=True), max_steps=8, log_every=4, eval_every=4))
    text = both.getvalue()
    assert "\rtrain:" in text, text  # the bar was drawn
    logged = [line for line in text.split("\n") if "[recpipe] step" in line or "[recpipe] eval" in line]
    assert len(logged) == 4, text
    for line in logged:  # what a terminal shows of the line: the text after its last carriage return
        assert line.split("\r")[-1].startswith("[recpipe] "), repr(line)


# ---------------------------------------------------------------- resume between two logs
def test_resume_at_a_step_between_two_logs_logs_what_an_uninterrupted_run_logs(tmp_path: Path) -> None:
    """Checkpoint every 6 steps, log every 4: a checkpoint step ends a logging interval, so the
    resumed run's first interval (steps 7-8) is logged as the uninterrupted run logs it and the
    losses of steps 5-6 are in the event at step 6."""
    cfg = dict(SYNTHETIC, log_every=4, eval_every=0, checkpoint_every=6)
    # the reference: every step's loss, one event per step
    per_step = scalars_of(
        run(TrainConfig(**dict(cfg, log_every=1, checkpoint_every=0), max_steps=12, tb_dir=str(tmp_path / "tb_1"))),
        tmp_path / "tb_1",
    )["train/loss"]
    assert [s for s, _ in per_step] == list(range(1, 13))
    whole = scalars_of(
        run(TrainConfig(**cfg, max_steps=12, checkpoint_dir=str(tmp_path / "ck_a"), tb_dir=str(tmp_path / "tb_a"))),
        tmp_path / "tb_a",
    )
    # a run that went on past its step-6 checkpoint and died (its later checkpoint lost),
    # resumed into the same TensorBoard directory
    ck, tb = tmp_path / "ck_b", tmp_path / "tb_b"
    run(TrainConfig(**cfg, max_steps=8, checkpoint_dir=str(ck), tb_dir=str(tb)))
    shutil.rmtree(ck / "step_00000008")
    (ck / "latest").unlink()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        resumed_result = run(TrainConfig(**cfg, max_steps=12, checkpoint_dir=str(ck), tb_dir=str(tb), resume=True))
    assert resumed_result.start_step == 6
    resumed = scalars_of(resumed_result, tb)
    # every interval's mean is that of its own steps' losses, an interval ending at each log
    # step and at the checkpoint step 6
    losses = dict(per_step)
    bounds = [0, 4, 6, 8, 12]
    expected = [(b, sum(losses[s] for s in range(a + 1, b + 1)) / (b - a)) for a, b in zip(bounds, bounds[1:])]
    for events in (whole, resumed):
        assert [s for s, _ in events["train/loss"]] == [s for s, _ in expected]
        assert [v for _, v in events["train/loss"]] == pytest.approx([v for _, v in expected], rel=1e-6)
        # samples/s and ms/step describe the same interval: the global batch per step
        assert [s for s, _ in events["train/samples_per_s"]] == [s for s, _ in expected]
        for (_, sps), (_, ms) in zip(events["train/samples_per_s"], events["train/step_ms"]):
            assert sps * ms / 1000 == pytest.approx(SYNTHETIC["batch_size"], rel=1e-4)
    # the console names the same steps and losses
    printed = [
        (int(m[1]), float(m[2])) for m in re.finditer(r"\[recpipe\] step (\d+)/12 loss ([0-9.]+) ", out.getvalue())
    ]
    assert printed == [(s, pytest.approx(v, abs=1e-4)) for s, v in expected[2:]]


# ---------------------------------------------------------------- Criteo files that shrink
def _criteo_config(data_path: str, **kwargs: Any) -> TrainConfig:
    return TrainConfig(**{**CRITEO, "max_steps": None, "epochs": 2, "data_path": data_path, **kwargs})


def _truncate_lines(path: Path, lines: int) -> None:
    """Keeps the first ``lines`` lines of ``path`` (in place, as ``truncate`` does)."""
    with open(path, "rb") as f:
        keep = b"".join(f.readline() for _ in range(lines))
    with open(path, "r+b") as f:
        f.truncate(len(keep))


def _lines(path: Path) -> int:
    return len(path.read_bytes().splitlines())


@pytest.mark.parametrize("max_steps", [None, 10])
def test_a_data_file_truncated_during_a_run_is_named(tmp_path: Path, max_steps: int | None) -> None:
    """2 files of 64 rows, one rank, global batches of 16: 8 steps per pass. The second file
    loses 40 rows during the second pass (``max_steps``: the pass length was learned from the
    first pass; without it, counted at start). The error names the file and both row counts."""
    from recpipe.recipes.data.criteo import CriteoDataChangedError

    a, b = tmp_path / "a.tsv", tmp_path / "b.tsv"
    write_criteo(a, 64)
    write_criteo(b, 64)
    source = make_data_source(_criteo_config(f"{a},{b}", max_steps=max_steps), 0, 1)
    batches = source.train_batches(0, 16)
    for _ in range(9):
        next(batches)
    _truncate_lines(b, 24)
    assert _lines(b) == 24
    with pytest.raises(CriteoDataChangedError) as e:
        list(batches)
    assert e.value.path == str(b)
    assert f"--data-path file {b} shrank while this run read it: it now holds 24 rows, 64 when the run counted" in str(
        e.value
    )
    assert "do not modify, truncate or replace the --data-path files" in str(e.value)


def test_a_data_file_deleted_or_an_eval_file_truncated_during_a_run_is_named(tmp_path: Path) -> None:
    from recpipe.recipes.data.criteo import CriteoDataChangedError

    data, ev = tmp_path / "day_0.tsv", tmp_path / "eval.tsv"
    write_criteo(data, 64)
    write_criteo(ev, 60)
    cfg = _criteo_config(str(data), eval_data_path=str(ev), eval_batches=3)
    source = make_data_source(cfg, 1, 2)  # rank 1 of 2: global batches of 32
    assert len(list(source.eval_batches())) == 2  # 60 rows: 32 + a short 28
    _truncate_lines(ev, 20)  # less than one global batch left
    with pytest.raises(
        CriteoDataChangedError,
        match=rf"--eval-data-path file {re.escape(str(ev))} shrank while "
        r"this run read it: it now holds 20 rows, at least 60 when the run counted them, so the "
        r"evaluation got 1 global batches, not the 2",
    ):
        list(source.eval_batches())
    batches = source.train_batches(0, 4)
    next(batches)
    data.unlink()  # the next pass reopens the file
    next(batches)
    with pytest.raises(
        CriteoDataChangedError,
        match=rf"--data-path file {re.escape(str(data))} can no longer be "
        r"read while this run reads it \(No such file or directory\)",
    ):
        next(batches)


def _truncating_source(config: TrainConfig, rank: int, world_size: int) -> Any:
    """The real source; once the run has taken the batch of step 3, the data file loses rows."""
    source = make_data_source(config, rank, world_size)
    clean = source.train_batches

    def train_batches(start: int, stop: int) -> Any:
        for index, batch in zip(range(start, stop), clean(start, stop)):
            if index == 3:
                _truncate_lines(Path(config.data_path), 40)
            yield batch

    source.train_batches = train_batches  # type: ignore[method-assign]
    return source


def test_the_cli_reports_a_truncated_file_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "day_0.tsv"
    write_criteo(data, 96)  # 6 steps per pass of 16 rows
    monkeypatch.setattr(train_module, "make_data_source", _truncating_source)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([*_flags(dict(CRITEO, max_steps=None)), f"--data-path={data}", "--no-progress-bar"])
    assert code == 1  # as a malformed row (CriteoFormatError)
    (line,) = err.getvalue().strip().splitlines()
    assert line.startswith(
        f"error: CriteoDataChangedError: --data-path file {data} shrank while this run read it: "
        "it now holds 40 rows, 96 when the run counted them"
    ), line


# ---------------------------------------------------------------- ranks with unequal batch counts
def _own_files_body(rank: int, world: int, root: str, case: str) -> str:
    """Each rank reads its own copy of the data (as each node of a multi-node job does)."""
    kwargs: dict[str, Any] = (
        {"max_steps": None, "epochs": 1} if case == "train" else {"max_steps": 2, "eval_batches": 5}
    )
    cfg = TrainConfig(**{**CRITEO, **kwargs, "data_path": f"{root}/rank{rank}.tsv", "timeout_s": 60.0})
    try:
        run(cfg)
    except ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case", ["train", "eval"])
def test_ranks_whose_files_give_different_batch_counts_are_refused_at_start(tmp_path: Path, case: str) -> None:
    """Refused on every rank before training, naming each rank's count, instead of a gloo
    abort ("Received data size doesn't match expected size") once the rank with fewer
    batches leaves the step's collectives."""
    rows = (64, 96)
    for rank, n in enumerate(rows):
        write_criteo(tmp_path / f"rank{rank}.tsv", n)
    global_batch = 2 * CRITEO["batch_size"]
    counts = [_lines(tmp_path / f"rank{r}.tsv") // global_batch for r in range(2)]  # full global batches
    evals = [min(5, -(-_lines(tmp_path / f"rank{r}.tsv") // global_batch)) for r in range(2)]
    assert counts == [2, 3] and evals == [2, 3]
    out = run_gloo(2, _own_files_body, str(tmp_path), case, timeout_s=120)
    assert out[0] == out[1], out
    if case == "train":
        assert f"training steps rank 0: {counts[0]}, rank 1: {counts[1]}" in out[0], out[0]
        assert f"Fix: give every rank the same --data-path rows; or pass --max-steps {min(counts)}" in out[0]
    else:
        assert f"evaluation batches rank 0: {evals[0]}, rank 1: {evals[1]}" in out[0], out[0]
        assert "training steps" not in out[0]
        assert f"Fix: give every rank the same --data-path rows; or pass --eval-batches {min(evals)}" in out[0]


def _one_short_source(config: TrainConfig, rank: int, world_size: int) -> Any:
    """The real source, except that rank 1's train_batches gives one batch fewer than asked."""
    source = make_data_source(config, rank, world_size)
    clean = source.train_batches

    def train_batches(start: int, stop: int) -> Any:
        return itertools.islice(clean(start, stop), stop - start - (rank == 1))

    source.train_batches = train_batches  # type: ignore[method-assign]
    return source


def _short_source_body(rank: int, world: int) -> str:
    train_module.make_data_source = _one_short_source  # this spawned process only
    try:
        run(TrainConfig(**{**SYNTHETIC, "max_steps": 4, "timeout_s": 30.0}))
    except (BatchCountError, CollectiveFailureError) as e:
        return f"{type(e).__name__}: {e}"
    except RuntimeError as e:
        explained = explain_collective_failure(e, TrainConfig(**{**SYNTHETIC, "max_steps": 4}))
        return f"{type(explained).__name__}: {explained}" if explained else f"other: {e}"
    return "no error"


def test_a_source_that_gives_a_rank_fewer_batches_stops_that_rank_with_its_counts() -> None:
    out = run_gloo(2, _short_source_body, timeout_s=120)
    assert out[1].startswith("BatchCountError: rank 1, training steps 1..4: the data source gave 3 batches, not 4"), (
        out[1]
    )
    assert out[0].startswith("CollectiveFailureError: rank 0: a collective "), out[0]  # lost its peer (or timed out)


# ---------------------------------------------------------------- flags that did nothing
def test_checkpoint_every_without_a_checkpoint_dir_is_refused(tmp_path: Path) -> None:
    """``--checkpoint-every 2`` without ``--checkpoint-dir`` is refused (it would save nothing)."""
    with pytest.raises(
        ConfigError,
        match=r"invalid config value checkpoint_every=2: checkpoints are saved into "
        r"--checkpoint-dir, which is unset.*Fix: pass --checkpoint-dir DIR, or drop --checkpoint-every",
    ):
        TrainConfig(dataset="synthetic", max_steps=4, checkpoint_every=2)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--dataset", "synthetic", "--max-steps", "4", "--checkpoint-every", "2"])
    assert code == 2 and err.getvalue().startswith("error: invalid config value checkpoint_every=2"), err.getvalue()
    TrainConfig(dataset="synthetic", max_steps=4, checkpoint_every=2, checkpoint_dir=str(tmp_path))  # with one: fine


def test_a_file_truncated_at_a_line_end_during_the_first_pass_is_not_taken_for_the_pass_length(tmp_path: Path) -> None:
    """With ``--max-steps`` the pass length is learned where the first pass ends: a file cut at
    a line end during that pass is an error, not a shorter pass (later steps would take other
    batches than an uninterrupted run's)."""
    from recpipe.recipes.data.criteo import CriteoDataChangedError

    data = tmp_path / "day_0.tsv"
    write_criteo(data, 128)  # 8 global batches of 16
    size = data.stat().st_size
    source = make_data_source(_criteo_config(str(data), max_steps=20), 0, 1)
    batches = source.train_batches(0, 20)
    for _ in range(2):
        next(batches)
    _truncate_lines(data, 96)  # at a line end, past the reader's buffer: no malformed row
    assert _lines(data) == 96 and data.stat().st_size < size
    with pytest.raises(
        CriteoDataChangedError,
        match=rf"--data-path file {re.escape(str(data))} shrank while this run "
        rf"read it: it now holds {data.stat().st_size} bytes \(96 rows read\), {size} bytes when the "
        r"run started, so the first pass ended early at step 6",
    ):
        list(batches)
