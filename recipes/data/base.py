"""The contract every data source meets, and the id -> KJT step shared by all.

A :class:`BatchSource` gives deterministic batches addressed by global step: the
batch of rank ``r`` at step ``s`` depends only on (config, world size, r, s). That
makes resume exact (restart at step ``s``) and lets two pipelines see identical data.
Every feature carries one raw id per sample; the model decides how ids become table
rows (:class:`IdTransform`). The sources themselves and the dispatch
:func:`~recpipe.recipes.data.registry.make_data_source` live in their own modules:
this one imports none of them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Iterator

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data.hashing import VirtualTableProjector


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """Shape of a data source's samples.

    Example::

        DatasetSpec(name="movielens100k", dense_in_features=5,
                    feature_names=("user_id", "item_id"), cardinalities=(944, 1683))
    """

    name: str
    """Data source name (``TrainConfig.dataset``)."""
    dense_in_features: int
    """Dense features per sample."""
    feature_names: tuple[str, ...]
    """Sparse feature names, in KJT key order."""
    cardinalities: tuple[int, ...]
    """Raw id space per feature (ids lie in ``[0, cardinality)``)."""


class IdTransform:
    """Maps raw ids to table rows, as the model's tables expect, for all features at once.

    ``dlrm``: ``id mod rows`` (one row per id, pooling factor 1).
    ``micro_dlrm_dram``: ``k`` hashed rows in a virtual table (pooling factor ``k``).

    A batch costs a few vectorized ops whatever the number of features and ``k``
    (one broadcast ``%`` for ``dlrm``, one
    :func:`~recpipe.recipes.data.hashing.hash_ids_grid` for micro-DLRM).

    Args:
        config: the run's config (model, virtual_rows, hash_k, seed).
        spec: the data source's spec (table sizes for ``dlrm``).
    """

    def __init__(self, config: TrainConfig, spec: DatasetSpec) -> None:
        self.model = config.model
        self.rows = table_rows(config, spec)
        self._rows_col = torch.tensor(self.rows, dtype=torch.int64).unsqueeze(1)  # (F, 1)
        self.projector = (
            VirtualTableProjector(config.virtual_rows, config.hash_k, seed=config.seed)
            if config.model == "micro_dlrm_dram"
            else None
        )

    @property
    def per_sample(self) -> int:
        """Table rows per raw id: ``hash_k`` for micro-DLRM, else 1."""
        return self.projector.k if self.projector is not None else 1

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The table rows of raw ids, for all features at once.

        A source whose ids repeat (MovieLens) maps its whole dataset once with this and
        builds each batch with :meth:`kjt_of_rows` from a gather of the result: the same
        KJT as :meth:`to_kjt` of the batch's ids, without hashing every batch.

        Args:
            ids: int64 ``(F, N)`` raw ids, row ``f`` for feature ``f``.

        Returns:
            int64 ``(F, N, per_sample)`` rows: ``[f, n, j]`` is hash slot ``j`` of
            ``ids[f, n]`` (micro-DLRM) or ``ids[f, n] mod rows[f]`` (``j = 0``).
        """
        if ids.dtype != torch.int64:
            raise TypeError(f"IdTransform: ids must be int64, got {ids.dtype}; convert with ids.long()")
        if ids.dim() != 2 or ids.shape[0] != len(self.rows):
            raise ValueError(
                f"IdTransform: ids must be (F, B) with F = {len(self.rows)} features "
                f"(one per key); got ids {tuple(ids.shape)}"
            )
        if self.projector is None:
            return (ids % self._rows_col.to(ids.device)).unsqueeze(2)
        return self.projector.project(ids)

    def kjt_of_rows(self, keys: tuple[str, ...], rows: torch.Tensor) -> KeyedJaggedTensor:
        """Builds the KJT of one batch from its table rows.

        Args:
            keys: feature names.
            rows: int64 ``(F, B, per_sample)`` rows, as :meth:`rows_of` returns them.

        Returns:
            KJT with ``F`` keys, ``B`` samples each, values grouped by key (then sample,
            then hash slot for micro-DLRM).
        """
        if rows.dim() != 3 or rows.shape[0] != len(keys) or rows.shape[2] != self.per_sample:
            raise ValueError(
                f"IdTransform.kjt_of_rows: rows must be (F={len(keys)}, B, {self.per_sample}), "
                f"got {tuple(rows.shape)}"
            )
        num_f, batch, per_sample = rows.shape
        lengths = torch.full((num_f * batch,), per_sample, dtype=torch.int32, device=rows.device)
        return KeyedJaggedTensor.from_lengths_sync(keys=list(keys), values=rows.reshape(-1), lengths=lengths)

    def to_kjt(self, keys: tuple[str, ...], ids: torch.Tensor) -> KeyedJaggedTensor:
        """Builds the KJT of one batch.

        Args:
            keys: feature names.
            ids: int64 ``(F, B)`` raw ids, row ``f`` for ``keys[f]``.

        Returns:
            KJT with ``F`` keys, ``B`` samples each, values grouped by key (then sample,
            then hash slot for micro-DLRM).
        """
        if ids.dtype != torch.int64:
            raise TypeError(f"IdTransform.to_kjt: ids must be int64, got {ids.dtype}; convert with ids.long()")
        if ids.dim() != 2 or ids.shape[0] != len(keys) or len(keys) != len(self.rows):
            raise ValueError(
                f"IdTransform.to_kjt: ids must be (F, B) with F = {len(self.rows)} features "
                f"(one per key); got ids {tuple(ids.shape)} and {len(keys)} keys"
            )
        return self.kjt_of_rows(keys, self.rows_of(ids))


# Label of the padding samples of an eval split's last, short global batch: every rank
# evaluates a full ``batch_size`` batch (the sharded tables need the same batch size on
# every rank) and the evaluation drops the samples with this label.
EVAL_PAD_LABEL: float = -1.0


def pad_rank_slice(rows: list | torch.Tensor, rank: int, batch_size: int) -> tuple[list | torch.Tensor, int]:
    """Rank ``rank``'s ``batch_size`` rows of a global batch, padded when it is short.

    Args:
        rows: the global batch's rows (a list, or a tensor of row indices); at most
            ``batch_size * world_size``, at least one.
        rank: this rank.
        batch_size: rows per rank.

    Returns:
        ``(mine, real)``: exactly ``batch_size`` rows, whose first ``real`` are this
        rank's share and the rest copies of the global batch's first row (padding; its
        labels are to be set to :data:`EVAL_PAD_LABEL`).
    """
    mine = rows[rank * batch_size : (rank + 1) * batch_size]
    real = len(mine)
    if real == batch_size:
        return mine, real
    if isinstance(rows, torch.Tensor):
        return torch.cat([mine, rows[:1].expand(batch_size - real)]), real
    return list(mine) + [rows[0]] * (batch_size - real), real


def mark_padding(batch: Batch, real: int) -> Batch:
    """``batch`` with the labels of its samples from ``real`` on set to :data:`EVAL_PAD_LABEL`."""
    if real < batch.labels.numel():
        labels = batch.labels.clone()
        labels[real:] = EVAL_PAD_LABEL
        batch = Batch(dense_features=batch.dense_features, sparse_features=batch.sparse_features, labels=labels)
    return batch


def table_rows(config: TrainConfig, spec: DatasetSpec) -> tuple[int, ...]:
    """Rows of each feature's table for the configured model."""
    if config.model == "micro_dlrm_dram":
        return tuple(config.virtual_rows for _ in spec.feature_names)
    if spec.name == "movielens100k":
        return spec.cardinalities
    return tuple(min(c, config.num_embeddings) for c in spec.cardinalities)


class BatchSource(abc.ABC):
    """Deterministic per-rank batches addressed by global step.

    Args:
        config: the run's config.
        rank: this process's rank.
        world_size: number of ranks.
    """

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        self.config = config
        self.rank = rank
        self.world_size = world_size

    @property
    @abc.abstractmethod
    def spec(self) -> DatasetSpec:
        """The samples' shape."""

    @property
    @abc.abstractmethod
    def steps_per_epoch(self) -> int | None:
        """Training steps per epoch (``None`` for an endless stream)."""

    @abc.abstractmethod
    def train_batches(self, start: int, stop: int) -> Iterator[Batch]:
        """This rank's training batches for global steps ``start .. stop-1``."""

    @abc.abstractmethod
    def eval_batches(self) -> Iterator[Batch]:
        """This rank's evaluation batches (the same count and size on every rank).

        The eval split's last global batch may be short: each rank's batch is then
        padded to ``batch_size`` with samples labelled :data:`EVAL_PAD_LABEL`, which the
        evaluation leaves out, so every sample of the split is evaluated exactly once.
        """

    def eval_batch_count(self) -> int | None:
        """This rank's number of evaluation batches, known before any is read (``None``:
        unknown until :meth:`eval_batches` ends). Every rank must report the same count:
        the training loop compares them at start."""
        return None

    def total_steps(self) -> int:
        """Steps of the whole run: ``max_steps`` or ``epochs * steps_per_epoch``."""
        if self.config.max_steps is not None:
            return self.config.max_steps
        spe = self.steps_per_epoch
        if spe is None:
            raise ValueError(f"dataset={self.config.dataset!r} is endless: set max_steps")
        return self.config.epochs * spe
