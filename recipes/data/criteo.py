"""Criteo TSV files (label, 13 integer, 26 hex categorical columns), read strictly.

Unlike torchrec's row mapper (bad values become 0), a bad row raises :class:`CriteoFormatError`
naming ``file:line``, column and value; empty cells are 0. Dense values become
``log(1 + max(x, 0))``. Global step ``s`` takes the ``s``-th run of ``batch_size * world_size``
rows in file order, rank ``r`` its slice; a pass wraps at the last full run. A file that shrinks
or vanishes mid-run raises :class:`CriteoDataChangedError`.
"""

from __future__ import annotations

import itertools
import os
import re
from typing import Iterable, Iterator

import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT
from torchrec.datasets.utils import Batch

from recpipe.recipes.config import ConfigError, TrainConfig, cli_flag, split_paths
from recpipe.recipes.data.base import BatchSource, DataFormatError, DatasetSpec, IdTransform, padded_eval_batch

FEATURES: tuple[str, ...] = tuple(f"cat_{i}" for i in range(CAT_FEATURE_COUNT))
NUM_COLUMNS: int = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
# Categorical values are 32-bit hex hashes in the Criteo release.
CAT_ID_SPACE: int = 2**32
# Integer columns must fit in int64 (so they are finite, if rounded, as float32).
INT_MIN: int = -(2**63)
INT_MAX: int = 2**63 - 1
# Column names, as torchrec's Criteo datasets call them (label, int_0.., cat_0..).
COLUMN_NAMES: tuple[str, ...] = ("label",) + tuple(f"int_{i}" for i in range(INT_FEATURE_COUNT)) + FEATURES

Row = tuple[int, list[int], list[int]]

_DECIMAL = re.compile(r"-?[0-9]+")
_HEX = re.compile(r"[0-9a-fA-F]+")
# A valid row needing no range check (<= 18 decimal digits, <= 8 hex digits); other rows
# go through parse_criteo_row, which accepts the remaining valid ones and names a bad field.
_FAST_ROW = re.compile(
    rb"[01]" + rb"\t(?:-?[0-9]{1,18})?" * INT_FEATURE_COUNT + rb"\t[0-9a-fA-F]{0,8}" * CAT_FEATURE_COUNT
)


class CriteoFormatError(DataFormatError):
    """A Criteo TSV row breaks the (label, 13 ints, 26 hex ids) format."""


class CriteoDataChangedError(ValueError):
    """A Criteo file shrank or can no longer be read mid-run (``path``: the first such file)."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


def _changed_fix(flag: str) -> str:
    """The fix of a :class:`CriteoDataChangedError` for the files of ``flag`` (e.g. ``--data-path``)."""
    return (
        f"Fix: do not modify, truncate or replace the {flag} files while a run reads them (give the run "
        "a copy), then resume from the last checkpoint (--resume)"
    )


def _unreadable(flag: str, path: str, error: OSError, detail: str = "") -> CriteoDataChangedError:
    """The error of a ``flag`` file that can no longer be read (``error``) mid-run."""
    return CriteoDataChangedError(
        f"{flag} file {path} can no longer be read while this run reads it ({error.strerror or error}){detail}. "
        "Fix: restore the file (do not move or delete the files of a running job), then resume from the last "
        "checkpoint (--resume)",
        path=path,
    )


def _bad_value(column: int, value: str, why: str) -> CriteoFormatError:
    return CriteoFormatError(
        f"column {column + 1} ({COLUMN_NAMES[column]}) has a malformed value {value!r}: {why}",
        column=column + 1,
        value=value,
    )


def _parse_int(column: int, v: str) -> int:
    if not v:
        return 0
    if not _DECIMAL.fullmatch(v):
        raise _bad_value(column, v, "not a decimal integer (digits with an optional leading '-')")
    x = int(v)
    if not INT_MIN <= x <= INT_MAX:
        raise _bad_value(
            column,
            v,
            f"{len(v.lstrip('-'))} digits do not fit in 64 bits (Criteo integer features are "
            "counts; as a float32 dense feature this value would be inf or meaningless)",
        )
    return x


def _parse_hex(column: int, v: str) -> int:
    if not v:
        return 0
    if not _HEX.fullmatch(v):
        raise _bad_value(
            column,
            v,
            "not a hexadecimal id (Criteo ids are unsigned 32-bit hex, e.g. '68fd1e64': no sign, no '0x', no spaces)",
        )
    x = int(v, 16)
    if x >= CAT_ID_SPACE:
        raise _bad_value(column, v, "wider than 32 bits (Criteo ids are at most 8 hex digits)")
    return x


def parse_criteo_row(cols: list[str]) -> Row:
    """Strictly parses one split TSV row into ``(label, ints, cats)`` (empty cells are 0).

    Raises:
        CriteoFormatError: wrong column count or a bad value (naming the column and value).
    """
    if len(cols) != NUM_COLUMNS:
        raise CriteoFormatError(
            f"row has {len(cols)} columns, expected {NUM_COLUMNS} tab-separated columns "
            f"(label, {INT_FEATURE_COUNT} integers, {CAT_FEATURE_COUNT} hex ids): {cols[:4]}..."
        )
    if cols[0] not in ("0", "1"):
        raise _bad_value(0, cols[0], "the label must be 0 or 1")
    label = int(cols[0])
    ints = [_parse_int(1 + i, v) for i, v in enumerate(cols[1 : 1 + INT_FEATURE_COUNT])]
    cats = [_parse_hex(1 + INT_FEATURE_COUNT + i, v) for i, v in enumerate(cols[1 + INT_FEATURE_COUNT :])]
    return label, ints, cats


def read_criteo_rows(paths: Iterable[str], file_rows: list[int] | None = None) -> Iterator[Row]:
    """Streams the rows of Criteo TSV files in order, strictly parsed (every line is a row).

    Args:
        file_rows: if given, receives each file's row count once it is read to its end.

    Raises:
        CriteoFormatError: the first bad row, its message starting with ``file:line:``.
    """
    n_int = 1 + INT_FEATURE_COUNT
    for path in paths:
        lineno = 0
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = raw.removesuffix(b"\n").removesuffix(b"\r")
                if _FAST_ROW.fullmatch(line):
                    cols = line.split(b"\t")
                    yield (
                        1 if cols[0] == b"1" else 0,
                        [int(v) if v else 0 for v in cols[1:n_int]],
                        [int(v, 16) if v else 0 for v in cols[n_int:]],
                    )
                    continue
                try:
                    if not line:
                        raise CriteoFormatError(
                            f"blank line; every line must be a row of {NUM_COLUMNS} tab-separated columns"
                        )
                    text = line.decode("utf-8", errors="backslashreplace")  # bad bytes shown as \xff
                    row = parse_criteo_row(text.split("\t"))
                except CriteoFormatError as e:
                    raise CriteoFormatError(
                        f"{path}:{lineno}: {e}. Fix: correct or remove this line",
                        path=path,
                        line=lineno,
                        column=e.column,
                        value=e.value,
                    ) from None
                yield row
        if file_rows is not None:
            file_rows.append(lineno)


def count_file_rows(paths: list[str], limit: int | None = None) -> list[int]:
    """Lines per file for a prefix of ``paths``, stopping once ``limit`` lines (``None``: all) are counted."""
    counts: list[int] = []
    for p in paths:
        left = None if limit is None else limit - sum(counts)
        if left is not None and left <= 0:
            break
        with open(p, "rb") as f:
            counts.append(sum(1 for _ in itertools.islice(f, left)))
    return counts


def count_rows(paths: list[str], limit: int | None = None) -> int:
    """Number of lines over all files, counting at most ``limit`` (``None``: all)."""
    return sum(count_file_rows(paths, limit))


class CriteoTsvSource(BatchSource):
    """Batches streamed from Criteo TSV files (``data_path``, ``eval_data_path``).

    Without ``max_steps`` the training rows are counted up front; with it,
    ``steps_per_epoch`` is learned from the first pass that reaches the files' end. The
    evaluation's rows are counted up front, so every rank knows its eval batch count.

    Raises:
        ConfigError: the training or eval files hold fewer rows than one global batch.
    """

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        super().__init__(config, rank, world_size)
        self._paths = split_paths(config.data_path)
        self._eval_paths = split_paths(config.eval_data_path) or self._paths
        self.spec = DatasetSpec(
            name="criteo_tsv",
            dense_in_features=INT_FEATURE_COUNT,
            feature_names=FEATURES,
            cardinalities=tuple(CAT_ID_SPACE for _ in FEATURES),
        )
        self._transform = IdTransform(config, self.spec)
        self._global_batch = config.batch_size * world_size
        # rows of each data_path file in a full pass: a pass that ends early names the file that shrank
        self._file_rows: list[int] | None = None
        # sizes at start: a first pass ending on a smaller file is a truncation, not the pass length
        self._start_bytes = [os.path.getsize(p) for p in self._paths]
        if config.max_steps is None:
            self._file_rows = count_file_rows(self._paths)
            rows = sum(self._file_rows)
            self.steps_per_epoch = rows // self._global_batch
        else:  # one global batch of rows is enough to decide
            rows = count_rows(self._paths, self._global_batch)
        self._check_one_global_batch("data_path", rows)
        # the evaluation reads at most eval_batches global batches, the last one maybe short
        self._eval_file_rows = count_file_rows(self._eval_paths, config.eval_batches * self._global_batch)
        self._eval_rows = sum(self._eval_file_rows)
        if config.eval_data_path:
            self._check_one_global_batch("eval_data_path", self._eval_rows)
        self._eval_count = -(-self._eval_rows // self._global_batch)

    def eval_batch_count(self) -> int:
        return self._eval_count

    def _check_one_global_batch(self, name: str, rows: int) -> None:
        """Raises :class:`ConfigError` when the files of field ``name`` hold fewer than one global batch."""
        if rows >= self._global_batch:
            return
        b, w = self.config.batch_size, self.world_size
        smaller = f" to at most {rows // w}" if rows // w else ""
        raise ConfigError(
            f"invalid config value {name}={getattr(self.config, name)!r}: it holds {rows} rows, fewer than one "
            f"global batch (batch_size {b} x {w} rank(s) = {self._global_batch} rows), so it gives no batch. "
            f"Fix: lower --batch-size{smaller} or pass more rows in --{cli_flag(name)}"
        )

    def _changed(
        self, name: str, paths: list[str], before: list[int] | None, now: list[int], what: str, exact: bool = True
    ) -> CriteoDataChangedError:
        """The error of field ``name``'s files holding fewer rows (``now``) than counted (``before``;
        with ``exact=False`` its last count is a lower bound)."""
        flag = f"--{cli_flag(name)}"
        fix = _changed_fix(flag)
        for path, had, has in zip(paths, before or [], now):
            if has < had:
                return CriteoDataChangedError(
                    f"{flag} file {path} shrank while this run read it: it now holds {has} rows, "
                    f"{'' if exact else 'at least '}{had} when the run counted them, so {what}. {fix}",
                    path=path,
                )
        if len(paths) == 1:
            return CriteoDataChangedError(
                f"{flag} file {paths[0]} shrank while this run read it: it now holds {now[0]} rows, so {what}. {fix}",
                path=paths[0],
            )
        per_file = ", ".join(f"{p}: {n}" for p, n in zip(paths, now))
        return CriteoDataChangedError(
            f"{flag} files changed while this run read them: they now hold {sum(now)} rows ({per_file}), so {what}. "
            f"{fix}",
            path=paths[0],
        )

    def _global_batches(
        self,
        name: str,
        paths: list[str],
        file_rows: list[int],
        counted: list[int] | None,
        exact: bool = True,
        short_last: bool = False,
    ) -> Iterator[list[Row]]:
        """The global batches of field ``name``'s files, telling a file changed mid-run from a bad file.

        An unreadable file, or a malformed row of a file that now holds fewer rows than
        counted or than the row's line number (truncated mid-read), is a
        :class:`CriteoDataChangedError`; other malformed rows stay :class:`CriteoFormatError`.
        """
        rows: list[Row] = []
        try:
            for row in read_criteo_rows(paths, file_rows):
                rows.append(row)
                if len(rows) == self._global_batch:
                    yield rows
                    rows = []
        except OSError as e:
            path = str(e.filename) if e.filename is not None else paths[len(file_rows)]
            raise _unreadable(f"--{cli_flag(name)}", path, e) from None
        except CriteoFormatError as e:
            index = len(file_rows)  # the file being read: every earlier one was read to its end
            if e.path is None or e.line is None or index >= len(paths):
                raise
            try:
                now = count_rows([e.path])
            except OSError:
                raise e from None
            had = counted[index] if counted is not None and index < len(counted) else None
            if e.line <= now and (had is None or now >= had):
                raise  # the file holds this row: it is malformed
            raise self._changed(
                name,
                [e.path],
                None if had is None else [had],
                [now],
                f"line {e.line}, which the run was reading, was cut or is past the file's end",
                exact,
            ) from None
        if short_last and rows:  # the files' last rows (evaluation only)
            yield rows

    def _to_batch(self, mine: list[Row]) -> Batch:
        labels = torch.tensor([r[0] for r in mine], dtype=torch.float32)
        dense = torch.tensor([r[1] for r in mine], dtype=torch.float32).clamp_(min=0).log1p_()
        ids = torch.tensor([r[2] for r in mine], dtype=torch.int64).t().contiguous()
        return Batch(dense_features=dense, sparse_features=self._transform.to_kjt(FEATURES, ids), labels=labels)

    def train_batches(self, start: int, stop: int) -> Iterator[Batch]:
        step = start
        while step < stop:
            offset = step % self.steps_per_epoch if self.steps_per_epoch else step
            passed = 0  # full global batches of this pass
            file_rows: list[int] = []  # rows of each file read to its end in this pass
            batches = self._global_batches("data_path", self._paths, file_rows, self._file_rows)
            for i, rows in enumerate(batches):
                passed = i + 1
                if i < offset:
                    continue
                b = self.config.batch_size
                yield self._to_batch(rows[self.rank * b : (self.rank + 1) * b])
                step += 1
                if step >= stop or (self.steps_per_epoch is not None and i + 1 >= self.steps_per_epoch):
                    break
            else:  # the files ended: this pass held `passed` steps, the next one wraps
                if self.steps_per_epoch is not None:  # fewer than the pass the run counted
                    raise self._changed(
                        "data_path",
                        self._paths,
                        self._file_rows,
                        file_rows,
                        f"its pass holds {passed} global batches of {self._global_batch} rows, not the "
                        f"{self.steps_per_epoch} counted before (step {step + 1} cannot take the batch an "
                        "uninterrupted run takes)",
                    )
                if passed == 0:  # the run started with at least one global batch
                    raise self._changed(
                        "data_path",
                        self._paths,
                        None,
                        file_rows,
                        f"they hold no global batch of {self._global_batch} rows (the run started with at least one)",
                    )
                for path, size, read_rows in zip(self._paths, self._start_bytes, file_rows):
                    try:
                        now = os.path.getsize(path)
                    except OSError as e:  # deleted (or moved) once read to its end
                        raise _unreadable(
                            "--data-path",
                            path,
                            e,
                            f": it held {read_rows} rows when this run read it and holds none now, so the first pass, "
                            f"which ended at step {step}, cannot be repeated",
                        ) from None
                    if now < size:  # this pass's length is not the files'
                        raise CriteoDataChangedError(
                            f"--data-path file {path} shrank while this run read it: it now holds {now} bytes "
                            f"({read_rows} rows read), {size} bytes when the run started, so the first pass ended "
                            f"early at step {step} and its length ({passed} global batches) is not the files'. "
                            + _changed_fix("--data-path"),
                            path=path,
                        )
                self.steps_per_epoch = passed
                self._file_rows = file_rows

    def eval_batches(self) -> Iterator[Batch]:
        file_rows: list[int] = []
        count = 0
        name = "eval_data_path" if self.config.eval_data_path else "data_path"
        batches = self._global_batches(
            name, self._eval_paths, file_rows, self._eval_file_rows, exact=False, short_last=True
        )
        for i, rows in enumerate(batches):
            if i >= self._eval_count:
                break
            yield padded_eval_batch(rows, self.rank, self.config.batch_size, self._to_batch)
            count += 1
        if count < self._eval_count:  # every rank must evaluate the same number of batches
            raise self._changed(
                name,
                self._eval_paths,
                self._eval_file_rows,
                file_rows,
                f"the evaluation got {count} global batches, not the {self._eval_count} of its "
                f"{self._eval_rows} rows counted at start",
                exact=False,
            )
