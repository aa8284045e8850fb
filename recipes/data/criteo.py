"""Criteo TSV files (label, 13 integer, 26 hex categorical columns) for users with real data.

Rows are read strictly (torchrec's default Criteo row mapper silently turns bad
values into 0): every row must have 40 tab-separated columns, a ``0`` / ``1``
label, decimal integers that fit in 64 bits (Criteo's are small counts; a longer
number would become ``inf`` in the float32 dense features) and categorical ids of
at most 32 bits written in hex without sign or prefix (the Criteo release's ids are
8 hex digits). Empty cells are 0. A row that breaks a rule raises
:class:`CriteoFormatError` naming ``file:line``, the column and the value; no row is
skipped silently. Dense values become ``log(1 + max(x, 0))``, as in torchrec's DLRM
recipe. Order is the file order (no shuffling); global step ``s`` takes the ``s``-th
run of ``batch_size * world_size`` rows and rank ``r`` its slice; a pass ends at the last
full run and the next pass starts again at the first row (``max_steps`` past one pass
trains further epochs, as on MovieLens).
"""

from __future__ import annotations

import itertools
import re
from typing import Iterable, Iterator

import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT
from torchrec.datasets.utils import Batch

from recpipe.recipes.config import ConfigError, TrainConfig, split_paths
from recpipe.recipes.data.base import BatchSource, DatasetSpec, IdTransform, mark_padding, pad_rank_slice

FEATURES: tuple[str, ...] = tuple(f"cat_{i}" for i in range(CAT_FEATURE_COUNT))
NUM_COLUMNS: int = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
# Categorical values are 32-bit hex hashes in the Criteo release.
CAT_ID_SPACE: int = 2**32
# Integer columns must fit in int64 (so they are finite, if rounded, as float32).
INT_MIN: int = -(2**63)
INT_MAX: int = 2**63 - 1
# Column names, as torchrec's Criteo datasets call them (label, int_0.., cat_0..).
COLUMN_NAMES: tuple[str, ...] = (
    ("label",) + tuple(f"int_{i}" for i in range(INT_FEATURE_COUNT)) + FEATURES
)

Row = tuple[int, list[int], list[int]]

_DECIMAL = re.compile(r"-?[0-9]+")
_HEX = re.compile(r"[0-9a-fA-F]+")
# One whole valid row whose values need no range check: up to 18 decimal digits
# (always within int64), up to 8 hex digits (always below 2**32). Rows that fail it
# go through parse_criteo_row, which accepts the rest of the valid rows (19-digit
# integers within int64, hex ids with leading zeros) and names the first bad field.
_FAST_ROW = re.compile(
    rb"[01]"
    + rb"\t(?:-?[0-9]{1,18})?" * INT_FEATURE_COUNT
    + rb"\t[0-9a-fA-F]{0,8}" * CAT_FEATURE_COUNT
)


class CriteoFormatError(ValueError):
    """A Criteo TSV row breaks the (label, 13 ints, 26 hex ids) format.

    Attributes:
        path: the file (``None`` when a row was parsed on its own).
        line: the 1-based line number in ``path`` (``None`` likewise).
        column: the 1-based column of the bad value (``None`` for a row-level problem).
        value: the bad value (``None`` for a row-level problem).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        column: int | None = None,
        value: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.line = line
        self.column = column
        self.value = value


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
            "not a hexadecimal id (Criteo ids are unsigned 32-bit hex, e.g. '68fd1e64': "
            "no sign, no '0x', no spaces)",
        )
    x = int(v, 16)
    if x >= CAT_ID_SPACE:
        raise _bad_value(column, v, "wider than 32 bits (Criteo ids are at most 8 hex digits)")
    return x


def parse_criteo_row(cols: list[str]) -> Row:
    """Strictly parses one split TSV row.

    Args:
        cols: the row's 40 columns as strings.

    Returns:
        ``(label, ints, cats)``; empty integer cells are 0, empty categorical cells 0.

    Raises:
        CriteoFormatError: wrong column count, or a value breaking the format (the
            message names the column and the value; :func:`read_criteo_rows` adds
            ``file:line``).
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


def read_criteo_rows(paths: Iterable[str]) -> Iterator[Row]:
    """Streams the rows of Criteo TSV files in order, strictly parsed.

    Lines end in ``\\n`` (or ``\\r\\n``); every line is a row (a blank line is an
    error), as :func:`count_rows` counts them.

    Args:
        paths: the files, read one after the other.

    Yields:
        ``(label, ints, cats)`` per line, as :func:`parse_criteo_row` returns them.

    Raises:
        CriteoFormatError: the first bad row, its message starting with ``file:line:``.
    """
    n_int = 1 + INT_FEATURE_COUNT
    for path in paths:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = raw[:-1] if raw.endswith(b"\n") else raw
                if line.endswith(b"\r"):
                    line = line[:-1]
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


def count_rows(paths: list[str], limit: int | None = None) -> int:
    """Number of lines over all files.

    Args:
        paths: the files.
        limit: stop counting at this many lines (``None``: count them all), so that
            deciding whether the files hold one batch reads one batch, not the files.

    Returns:
        The number of lines, at most ``limit``.
    """
    total = 0
    for p in paths:
        if limit is not None and total >= limit:
            break
        with open(p, "rb") as f:
            total += sum(1 for _ in itertools.islice(f, None if limit is None else limit - total))
    return total


class CriteoTsvSource(BatchSource):
    """Batches streamed from Criteo TSV files (``data_path``, ``eval_data_path``).

    Without ``max_steps`` the training rows are counted up front (``epochs`` passes of
    ``steps_per_epoch`` steps); with it they are not, and ``steps_per_epoch`` is learned
    from the first pass that reaches the files' end, so training wraps into the next
    pass at ``step % steps_per_epoch``, the batch an uninterrupted run takes there.

    Raises:
        ConfigError: the training files, or the ``eval_data_path`` files, hold fewer rows
            than one global batch (the message names the flag and the fix).
    """

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        super().__init__(config, rank, world_size)
        self._paths = split_paths(config.data_path)
        self._eval_paths = split_paths(config.eval_data_path) or self._paths
        self._spec = DatasetSpec(
            name="criteo_tsv",
            dense_in_features=INT_FEATURE_COUNT,
            feature_names=FEATURES,
            cardinalities=tuple(CAT_ID_SPACE for _ in FEATURES),
        )
        self._transform = IdTransform(config, self._spec)
        self._global_batch = config.batch_size * world_size
        self._spe: int | None = None
        # with max_steps set, one global batch of rows is enough to decide
        limit = None if config.max_steps is None else self._global_batch
        rows = count_rows(self._paths, limit)
        self._check_one_global_batch("data_path", rows)
        if config.max_steps is None:
            self._spe = rows // self._global_batch
        if config.eval_data_path:
            self._check_one_global_batch("eval_data_path", count_rows(self._eval_paths, self._global_batch))

    @property
    def spec(self) -> DatasetSpec:
        return self._spec

    @property
    def steps_per_epoch(self) -> int | None:
        return self._spe

    def _check_one_global_batch(self, name: str, rows: int) -> None:
        """Raises :class:`ConfigError` when the files of field ``name`` hold fewer than one global batch."""
        if rows >= self._global_batch:
            return
        b, w = self.config.batch_size, self.world_size
        smaller = f" to at most {rows // w}" if rows // w else ""
        raise ConfigError(
            f"invalid config value {name}={getattr(self.config, name)!r}: it holds {rows} rows, fewer than one "
            f"global batch (batch_size {b} x {w} rank(s) = {self._global_batch} rows), so it gives no batch. "
            f"Fix: lower --batch-size{smaller} or pass more rows in --{name.replace('_', '-')}"
        )

    def _global_batches(self, paths: list[str], short_last: bool = False) -> Iterator[list[Row]]:
        rows: list[Row] = []
        for row in read_criteo_rows(paths):
            rows.append(row)
            if len(rows) == self._global_batch:
                yield rows
                rows = []
        if short_last and rows:  # the files' last rows (evaluation only)
            yield rows

    def _to_batch(self, rows: list[Row], mine_only: bool = False) -> Batch:
        b = self.config.batch_size
        mine = rows if mine_only else rows[self.rank * b : (self.rank + 1) * b]
        labels = torch.tensor([r[0] for r in mine], dtype=torch.float32)
        dense = torch.tensor([r[1] for r in mine], dtype=torch.float32).clamp_(min=0).log1p_()
        ids = torch.tensor([r[2] for r in mine], dtype=torch.int64).t().contiguous()
        return Batch(
            dense_features=dense,
            sparse_features=self._transform.to_kjt(FEATURES, ids),
            labels=labels,
        )

    def train_batches(self, start: int, stop: int) -> Iterator[Batch]:
        step = start
        while step < stop:
            offset = step % self._spe if self._spe else step
            passed = 0  # full global batches of this pass
            for i, rows in enumerate(self._global_batches(self._paths)):
                passed = i + 1
                if i < offset:
                    continue
                yield self._to_batch(rows)
                step += 1
                if step >= stop or (self._spe is not None and i + 1 >= self._spe):
                    break
            else:  # the files ended: this pass held `passed` steps, the next one wraps
                if self._spe is not None or passed == 0:  # the run started with more rows
                    raise ValueError(
                        f"data_path ran out of rows at step {step}: its files now hold {passed} global "
                        "batches, fewer than when this run started. Fix: do not modify the --data-path "
                        "files while a run reads them"
                    )
                self._spe = passed

    def eval_batches(self) -> Iterator[Batch]:
        for i, rows in enumerate(self._global_batches(self._eval_paths, short_last=True)):
            if i >= self.config.eval_batches:
                break
            mine, real = pad_rank_slice(rows, self.rank, self.config.batch_size)
            yield mark_padding(self._to_batch(mine, mine_only=True), real)
