"""MovieLens-100k read from the ``recbole==1.2.1`` wheel (never copied into the repo).

943 users, 1682 items, 100,000 ratings; label = rating >= 4. Sparse features are
``user_id`` and ``item_id``; the five dense features come from the timestamp
(hour-of-day and weekday on the unit circle, and position in the collection span).
"""

from __future__ import annotations

import importlib.resources
import math
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torchrec.datasets.utils import Batch

from recpipe.recipes.config import ConfigError, TrainConfig
from recpipe.recipes.data.base import BatchSource, DataFormatError, DatasetSpec, IdTransform, padded_eval_batch
from recpipe.recipes.data.hashing import mix_seed

# Facts of the MovieLens-100k release (GroupLens README): 943 users, 1682 items, 100k ratings.
ML100K_USERS: int = 943
ML100K_ITEMS: int = 1682
# Ratings are 1..5 stars; >= 4 is a positive (the usual implicit-feedback threshold).
MIN_RATING: float = 1.0
MAX_RATING: float = 5.0
POSITIVE_RATING: float = 4.0
FEATURES: tuple[str, ...] = ("user_id", "item_id")
DENSE_FEATURES: int = 5


def movielens100k_path() -> Path:
    """Path of ``ml-100k.inter`` inside the installed recbole wheel (FileNotFoundError without it)."""
    try:
        root = importlib.resources.files("recbole")
    except ModuleNotFoundError as e:
        raise FileNotFoundError(
            "MovieLens-100k comes from the recbole wheel, which is not installed. "
            "Fix: pip install --no-deps recbole==1.2.1 (make venv does)"
        ) from e
    path = Path(str(root / "dataset_example" / "ml-100k" / "ml-100k.inter"))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the recbole wheel; reinstall recbole==1.2.1")
    return path


class MovieLensFormatError(DataFormatError):
    """A line of ``ml-100k.inter`` is not a row of four numbers, or holds an id outside the release,
    a rating outside 1-5 or a non-finite timestamp."""


#: Columns of ``ml-100k.inter`` (1-based column = index + 1) and the ids each may hold.
COLUMNS: tuple[str, ...] = ("user_id", "item_id", "rating", "timestamp")
_ID_RANGES: dict[int, int] = {0: ML100K_USERS, 1: ML100K_ITEMS}
_RATING: int = COLUMNS.index("rating")
# What a row holds, for the errors of a malformed line.
_ROW_FORMAT: str = (
    f"a row holds {len(COLUMNS)} tab-separated numbers: user_id (1-{ML100K_USERS}), item_id (1-{ML100K_ITEMS}), "
    f"rating ({MIN_RATING:g}-{MAX_RATING:g}) and timestamp (Unix seconds)"
)
_FIX: str = "Fix: repair or remove that line (reinstall recbole==1.2.1 for the original file)"


def _wanted(col: int) -> str:
    """What column ``col`` (0-based) must hold."""
    if col in _ID_RANGES:
        return f"a whole number in [1, {_ID_RANGES[col]}]"
    if col == _RATING:
        return f"a number in [{MIN_RATING:g}, {MAX_RATING:g}] (MovieLens ratings are 1-5 stars)"
    return "a finite number"


def _check_rows(path: Path, table: np.ndarray) -> None:
    """Raises :class:`MovieLensFormatError` for the first bad row of ``table`` (row ``i`` is line
    ``i + 2``): an id that is not a whole number in ``[1, count]``, a rating outside
    ``[MIN_RATING, MAX_RATING]`` or a timestamp that is NaN or infinite."""
    bad = ~np.isfinite(table)
    with np.errstate(invalid="ignore"):
        for col, count in _ID_RANGES.items():
            ids = table[:, col]
            bad[:, col] |= (ids != np.floor(ids)) | (ids < 1) | (ids > count)
        bad[:, _RATING] |= (table[:, _RATING] < MIN_RATING) | (table[:, _RATING] > MAX_RATING)
    rows, cols = np.nonzero(bad)
    if rows.size == 0:
        return
    row, col = int(rows[0]), int(cols[0])
    value = repr(float(table[row, col]))
    line = row + 2  # the header is line 1
    raise MovieLensFormatError(
        f"{path}:{line}: column {col + 1} ({COLUMNS[col]}) holds {value}, but it must be {_wanted(col)}. {_FIX}",
        path=str(path),
        line=line,
        column=col + 1,
        value=value,
    )


def _parse_lines(path: Path, lines: list[str]) -> np.ndarray:
    """float64 ``(len(lines), 4)`` of the data lines (``lines[i]`` is line ``i + 2``).

    Raises:
        MovieLensFormatError: the first line that is blank, has another column count or holds a
            cell that is not a number, named as ``file:line`` (1-based, as an editor shows it).
    """
    cells: list[str] = []
    for i, text in enumerate(lines):
        row = text.split("\t")
        if len(row) != len(COLUMNS):
            line = i + 2
            got = "is blank" if not text.strip() else f"holds {len(row)} tab-separated column(s) {row[:6]}"
            raise MovieLensFormatError(
                f"{path}:{line}: the line {got}, but {_ROW_FORMAT}. {_FIX}", path=str(path), line=line
            )
        cells.extend(row)
    try:
        return np.array(cells, dtype=np.float64).reshape(len(lines), len(COLUMNS))
    except ValueError:  # a cell that is not a number: find the first
        for k, cell in enumerate(cells):
            try:
                float(cell)
            except ValueError:
                line, col = k // len(COLUMNS) + 2, k % len(COLUMNS)
                raise MovieLensFormatError(
                    f"{path}:{line}: column {col + 1} ({COLUMNS[col]}) holds {cell!r}, which is not a number, but it "
                    f"must be {_wanted(col)}. {_FIX}",
                    path=str(path),
                    line=line,
                    column=col + 1,
                    value=cell,
                ) from None
        raise


def read_ratings(path: Path) -> dict[str, torch.Tensor]:
    """Every rating of a MovieLens ``.inter`` file, each line validated: every line after the header
    is a row of four tab-separated numbers (the file may end in one newline).

    Returns:
        ``user``, ``item`` (int64 ids, 1-based), ``rating`` (float32), ``timestamp`` (int64 s).

    Raises:
        MovieLensFormatError: the first bad line, its message starting with ``file:line:``.
    """
    with path.open() as f:
        header = f.readline().rstrip("\n").split("\t")
        expected = ["user_id:token", "item_id:token", "rating:float", "timestamp:float"]
        if header != expected:
            raise MovieLensFormatError(f"{path}:1: header {header} differs from {expected}", path=str(path), line=1)
        lines = f.read().split("\n")
    if lines[-1] == "":  # the newline that ends the last row
        lines.pop()
    if not lines:
        raise MovieLensFormatError(
            f"{path}: holds no rating after its header (line 1), but {_ROW_FORMAT}, one per line. {_FIX}",
            path=str(path),
        )
    table = _parse_lines(path, lines)
    _check_rows(path, table)
    dtypes = {"user": np.int64, "item": np.int64, "rating": np.float32, "timestamp": np.int64}  # column order
    return {name: torch.from_numpy(table[:, col].astype(dtype)) for col, (name, dtype) in enumerate(dtypes.items())}


@lru_cache(maxsize=1)
def load_movielens100k() -> dict[str, torch.Tensor]:
    """All ratings of the wheel's MovieLens-100k, read and validated once per process (:func:`read_ratings`)."""
    return read_ratings(movielens100k_path())


def _dense_from_timestamp(ts: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """Five dense features per timestamp: hour and weekday on the unit circle, span position."""
    seconds_per_day = 86_400
    day_frac = (ts % seconds_per_day).double() / seconds_per_day
    week_frac = ((ts // seconds_per_day) % 7).double() / 7.0
    span = (ts - t0).double() / max(1, t1 - t0)
    circle = [f(2.0 * math.pi * frac) for frac in (day_frac, week_frac) for f in (torch.sin, torch.cos)]
    return torch.stack([*circle, span], dim=1).float()


class MovieLens100kSource(BatchSource):
    """MovieLens-100k batches; a seeded split holds out ``eval_fraction`` of the ratings.

    Each epoch reshuffles the training ratings; global step ``s`` takes
    ``batch_size * world_size`` ratings and rank ``r`` its slice.

    Raises:
        ConfigError: the training split holds fewer ratings than one global batch.
    """

    steps_per_epoch: int
    """Training steps per epoch: the training split's whole global batches (set in ``__init__``)."""

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        super().__init__(config, rank, world_size)
        data = load_movielens100k()
        n = data["user"].numel()
        gen = torch.Generator().manual_seed(mix_seed(config.seed, 0x3141))
        perm = torch.randperm(n, generator=gen)
        n_eval = int(round(n * config.eval_fraction))
        self._eval_idx, self._train_idx = perm[:n_eval], perm[n_eval:]
        ts = data["timestamp"]
        self._dense = _dense_from_timestamp(ts, int(ts.min()), int(ts.max()))
        self._ids = torch.stack([data["user"], data["item"]])  # (2, n)
        self._labels = (data["rating"] >= POSITIVE_RATING).float()
        self.spec = DatasetSpec(
            name="movielens100k",
            dense_in_features=DENSE_FEATURES,
            feature_names=FEATURES,
            cardinalities=(ML100K_USERS + 1, ML100K_ITEMS + 1),
        )
        self._transform = IdTransform(config, self.spec)
        # Every rating's table rows, mapped once: a batch gathers them instead of hashing.
        self._rows = self._transform.rows_of(self._ids)  # (2, n, per_sample)
        self._global_batch = config.batch_size * world_size
        self._check_training_split()
        self.steps_per_epoch = self._train_idx.numel() // self._global_batch
        self._perm_cache: tuple[int, torch.Tensor] | None = None

    def _check_training_split(self) -> None:
        """Raises :class:`ConfigError` when the training split holds fewer ratings than one global batch."""
        ratings = self._train_idx.numel()
        if ratings >= self._global_batch:
            return
        b, w = self.config.batch_size, self.world_size
        fixes = [f"lower --batch-size to at most {ratings // w}"] if ratings // w else []
        fixes.append(f"lower --eval-fraction (now {self.config.eval_fraction:g})")
        raise ConfigError(
            f"invalid config value batch_size={b}: the MovieLens-100k training split holds {ratings} ratings, "
            f"fewer than one global batch (batch_size {b} x {w} rank(s) = {self._global_batch}), so there is "
            "no training batch. Fix: " + " or ".join(fixes)
        )

    def _epoch_perm(self, epoch: int) -> torch.Tensor:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            gen = torch.Generator().manual_seed(mix_seed(self.config.seed, 0x2718, epoch))
            order = torch.randperm(self._train_idx.numel(), generator=gen)
            self._perm_cache = (epoch, self._train_idx[order])
        return self._perm_cache[1]

    def _batch(self, rows: torch.Tensor) -> Batch:
        return Batch(
            dense_features=self._dense[rows],
            sparse_features=self._transform.kjt_of_rows(FEATURES, self._rows[:, rows]),
            labels=self._labels[rows],
        )

    def train_batches(self, start: int, stop: int) -> Iterator[Batch]:
        for step in range(start, stop):
            epoch, i = divmod(step, self.steps_per_epoch)
            perm = self._epoch_perm(epoch)
            first = i * self._global_batch + self.rank * self.config.batch_size
            yield self._batch(perm[first : first + self.config.batch_size])

    def eval_batch_count(self) -> int:
        # the last global batch may be short
        return min(self.config.eval_batches, -(-self._eval_idx.numel() // self._global_batch))

    def eval_batches(self) -> Iterator[Batch]:
        g = self._global_batch
        for i in range(self.eval_batch_count()):
            yield padded_eval_batch(self._eval_idx[i * g : (i + 1) * g], self.rank, self.config.batch_size, self._batch)
