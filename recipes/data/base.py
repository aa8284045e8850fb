"""The contract every data source meets, and the id -> KJT step shared by all.

A :class:`BatchSource`'s batch of rank ``r`` at step ``s`` depends only on (config,
world size, r, s): resume is exact and two pipelines see identical data. Imports no
source (the sources import it).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data.hashing import VirtualKeyProjector, VirtualTableProjector


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """Shape of a data source's samples."""

    name: str  # TrainConfig.dataset
    dense_in_features: int
    feature_names: tuple[str, ...]  # in KJT key order
    cardinalities: tuple[int, ...]  # raw id space per feature


class DataFormatError(ValueError):
    """A data file's row breaks its dataset's format; the message names file, line, column and value.

    Attributes:
        path, line: the file and 1-based line (``None`` when a row was parsed on its own).
        column, value: the 1-based column and bad value (``None`` for a row-level problem).
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
        self.path, self.line, self.column, self.value = path, line, column, value


class IdTransform:
    """Maps raw ids to table rows for all features at once (a few vectorized ops per batch).

    ``dlrm``: ``id mod rows`` (pooling factor 1; Python's sign rule, so a negative id maps to a
    row ``>= 0``); ``micro_dlrm_dram``: ``k`` hashed rows in a virtual table (pooling factor ``k``).
    With ``dynamic_tables`` the keys of dynamic tables: ``dlrm``'s are the raw ids themselves,
    ``micro_dlrm_dram``'s ``k`` distinct int64 keys per id (:class:`VirtualKeyProjector`).
    """

    def __init__(self, config: TrainConfig, spec: DatasetSpec) -> None:
        self.rows = table_rows(config, spec)
        self._rows_col = torch.tensor(self.rows, dtype=torch.int64).unsqueeze(1)  # (F, 1)
        self.raw_keys: bool = config.dynamic_tables and config.model == "dlrm"
        """The ids pass through unchanged (dynamic tables key their rows by them)."""
        self.projector: VirtualTableProjector | VirtualKeyProjector | None = None
        if config.model == "micro_dlrm_dram" and config.dynamic_tables:
            self.projector = VirtualKeyProjector(config.hash_k, seed=config.seed)
        elif config.model == "micro_dlrm_dram":
            self.projector = VirtualTableProjector(config.virtual_rows, config.hash_k, seed=config.seed)

    @property
    def per_sample(self) -> int:
        """Table rows per raw id: ``hash_k`` for micro-DLRM, else 1."""
        return self.projector.k if self.projector is not None else 1

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ``(F, N, per_sample)`` table rows (dynamic tables: keys) of int64 ``(F, N)`` raw ids (with
        :attr:`raw_keys`, the ids).

        A source whose ids repeat maps its whole dataset once and builds batches with
        :meth:`kjt_of_rows` (the same KJT as :meth:`to_kjt`, without hashing per batch).
        """
        if ids.dtype != torch.int64:
            raise TypeError(f"IdTransform: ids must be int64, got {ids.dtype}; convert with ids.long()")
        if ids.dim() != 2 or ids.shape[0] != len(self.rows):
            raise ValueError(
                f"IdTransform: ids must be (F, B) with F = {len(self.rows)} features "
                f"(one per key); got ids {tuple(ids.shape)}"
            )
        if self.raw_keys:
            return ids.unsqueeze(2)
        if self.projector is None:
            return (ids % self._rows_col.to(ids.device)).unsqueeze(2)
        return self.projector.project(ids)

    def kjt_of_rows(self, keys: tuple[str, ...], rows: torch.Tensor) -> KeyedJaggedTensor:
        """The KJT of one batch from its ``(F, B, per_sample)`` rows (values by key, sample, slot)."""
        if rows.dim() != 3 or rows.shape[0] != len(keys) or rows.shape[2] != self.per_sample:
            raise ValueError(
                f"IdTransform.kjt_of_rows: rows must be (F={len(keys)}, B, {self.per_sample}), got {tuple(rows.shape)}"
            )
        num_f, batch, per_sample = rows.shape
        lengths = torch.full((num_f * batch,), per_sample, dtype=torch.int32, device=rows.device)
        return KeyedJaggedTensor.from_lengths_sync(keys=list(keys), values=rows.reshape(-1), lengths=lengths)

    def to_kjt(self, keys: tuple[str, ...], ids: torch.Tensor) -> KeyedJaggedTensor:
        """The KJT of one batch from int64 ``(F, B)`` raw ids, row ``f`` for ``keys[f]``."""
        return self.kjt_of_rows(keys, self.rows_of(ids))


# Label of the padding of an eval split's short last batch (sharded tables need equal batch
# sizes on every rank); the evaluation drops these samples.
EVAL_PAD_LABEL: float = -1.0


def padded_eval_batch(rows: list | torch.Tensor, rank: int, batch_size: int, to_batch: Callable[[Any], Batch]) -> Batch:
    """``to_batch`` of rank ``rank``'s ``batch_size`` rows of a non-empty global eval batch.

    A short share is padded with copies of the first row, labelled :data:`EVAL_PAD_LABEL`.
    """
    first = rank * batch_size
    mine = rows[first : first + batch_size]
    real = len(mine)
    if real == batch_size:
        return to_batch(mine)
    if isinstance(rows, torch.Tensor):  # ``mine`` again, sliced from the narrowed tensor
        batch = to_batch(torch.cat([rows[first : first + real], rows[:1].expand(batch_size - real)]))
    else:
        batch = to_batch(list(mine) + [rows[0]] * (batch_size - real))
    labels = batch.labels.clone()
    labels[real:] = EVAL_PAD_LABEL
    return Batch(dense_features=batch.dense_features, sparse_features=batch.sparse_features, labels=labels)


def table_rows(config: TrainConfig, spec: DatasetSpec) -> tuple[int, ...]:
    """Rows of each feature's table for the configured model."""
    if config.model == "micro_dlrm_dram":
        return tuple(config.virtual_rows for _ in spec.feature_names)
    if spec.name == "movielens100k":
        return spec.cardinalities
    return tuple(min(c, config.num_embeddings) for c in spec.cardinalities)


class BatchSource(abc.ABC):
    """Deterministic per-rank batches addressed by global step."""

    spec: DatasetSpec
    """The samples' shape (each source sets it in ``__init__``)."""
    steps_per_epoch: int | None = None
    """Training steps per epoch (``None`` for an endless stream)."""

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        self.config, self.rank, self.world_size = config, rank, world_size

    @abc.abstractmethod
    def train_batches(self, start: int, stop: int) -> Iterator[Batch]:
        """This rank's training batches for global steps ``start .. stop-1``."""

    @abc.abstractmethod
    def eval_batches(self) -> Iterator[Batch]:
        """This rank's evaluation batches (the same count and size on every rank).

        A short last batch is padded with samples labelled :data:`EVAL_PAD_LABEL`.
        """

    def eval_batch_count(self) -> int | None:
        """This rank's evaluation batch count, known up front (``None``: unknown); equal on every rank."""
        return None

    def total_steps(self) -> int:
        """Steps of the whole run: ``max_steps`` or ``epochs * steps_per_epoch``."""
        if self.config.max_steps is not None:
            return self.config.max_steps
        if self.steps_per_epoch is None:
            raise ValueError(f"dataset={self.config.dataset!r} is endless: set max_steps")
        return self.config.epochs * self.steps_per_epoch
