"""Criteo TSV files (label, 13 integer, 26 hex categorical columns) for users with real data.

Rows are streamed with torchrec's :class:`~torchrec.datasets.criteo.CriteoIterDataPipe`
under a strict row mapper: a row with the wrong column count or a non-integer /
non-hex value raises :class:`CriteoFormatError` naming the problem (torchrec's default
mapper silently replaces bad values with 0). Dense values become ``log(1 + max(x, 0))``,
as in torchrec's DLRM recipe. Order is the file order (no shuffling); global step ``s``
takes the ``s``-th run of ``batch_size * world_size`` rows and rank ``r`` its slice.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT, CriteoIterDataPipe
from torchrec.datasets.utils import Batch

from recpipe.recipes.config import TrainConfig, split_paths
from recpipe.recipes.data.base import BatchSource, DatasetSpec, IdTransform

FEATURES: tuple[str, ...] = tuple(f"cat_{i}" for i in range(CAT_FEATURE_COUNT))
NUM_COLUMNS: int = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
# Categorical values are 32-bit hex hashes in the Criteo release.
CAT_ID_SPACE: int = 2**32

Row = tuple[int, list[int], list[int]]


class CriteoFormatError(ValueError):
    """A Criteo TSV row does not have the (label, 13 ints, 26 hex) layout."""


def parse_criteo_row(cols: list[str]) -> Row:
    """Strictly parses one split TSV row.

    Args:
        cols: the row's 40 columns as strings.

    Returns:
        ``(label, ints, cats)``; empty integer cells are 0, empty categorical cells 0.

    Raises:
        CriteoFormatError: wrong column count, or a value that does not parse.
    """
    if len(cols) != NUM_COLUMNS:
        raise CriteoFormatError(
            f"Criteo TSV row has {len(cols)} columns, expected {NUM_COLUMNS} "
            f"(label, {INT_FEATURE_COUNT} integers, {CAT_FEATURE_COUNT} hex): {cols[:4]}..."
        )
    try:
        label = int(cols[0])
        ints = [int(v) if v else 0 for v in cols[1 : 1 + INT_FEATURE_COUNT]]
        cats = [int(v, 16) if v else 0 for v in cols[1 + INT_FEATURE_COUNT :]]
    except ValueError as e:
        raise CriteoFormatError(f"Criteo TSV row has a malformed value ({e}): {cols[:4]}...") from e
    if label not in (0, 1):
        raise CriteoFormatError(f"Criteo TSV label must be 0 or 1, got {label}")
    return label, ints, cats


def count_rows(paths: list[str]) -> int:
    """Number of lines over all files."""
    total = 0
    for p in paths:
        with open(p, "rb") as f:
            total += sum(1 for _ in f)
    return total


class CriteoTsvSource(BatchSource):
    """Batches streamed from Criteo TSV files (``data_path``, ``eval_data_path``)."""

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
        if config.max_steps is None:
            rows = count_rows(self._paths)
            self._spe = rows // self._global_batch
            if self._spe == 0:
                raise ValueError(
                    f"data_path holds {rows} rows, fewer than one global batch "
                    f"({config.batch_size} x {world_size}). Fix: lower --batch-size"
                )

    @property
    def spec(self) -> DatasetSpec:
        return self._spec

    @property
    def steps_per_epoch(self) -> int | None:
        return self._spe

    def _global_batches(self, paths: list[str]) -> Iterator[list[Row]]:
        rows: list[Row] = []
        for row in CriteoIterDataPipe(paths, row_mapper=parse_criteo_row):
            rows.append(row)
            if len(rows) == self._global_batch:
                yield rows
                rows = []

    def _to_batch(self, rows: list[Row]) -> Batch:
        b = self.config.batch_size
        mine = rows[self.rank * b : (self.rank + 1) * b]
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
            produced = False
            for i, rows in enumerate(self._global_batches(self._paths)):
                if i < offset:
                    continue
                yield self._to_batch(rows)
                produced = True
                step += 1
                if step >= stop or (self._spe is not None and i + 1 >= self._spe):
                    break
            if not produced:
                raise ValueError(
                    f"data_path ran out of rows at step {step} (max_steps={self.config.max_steps}). "
                    "Fix: lower --max-steps or leave it unset to train whole epochs"
                )

    def eval_batches(self) -> Iterator[Batch]:
        for i, rows in enumerate(self._global_batches(self._eval_paths)):
            if i >= self.config.eval_batches:
                break
            yield self._to_batch(rows)
