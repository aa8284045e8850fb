"""The contract every data source meets, and the id -> KJT step shared by all.

A :class:`BatchSource` gives deterministic batches addressed by global step: the
batch of rank ``r`` at step ``s`` depends only on (config, world size, r, s). That
makes resume exact (restart at step ``s``) and lets two pipelines see identical data.
Every feature carries one raw id per sample; the model decides how ids become table
rows (:class:`IdTransform`).
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
    """Maps one feature's raw ids to table rows, as the model's tables expect.

    ``dlrm``: ``id mod rows`` (one row per id, pooling factor 1).
    ``micro_dlrm_dram``: ``k`` hashed rows in a virtual table (pooling factor ``k``).

    Args:
        config: the run's config (model, virtual_rows, hash_k, seed).
        spec: the data source's spec (table sizes for ``dlrm``).
    """

    def __init__(self, config: TrainConfig, spec: DatasetSpec) -> None:
        self.model = config.model
        self.rows = table_rows(config, spec)
        self.projector = (
            VirtualTableProjector(config.virtual_rows, config.hash_k, seed=config.seed)
            if config.model == "micro_dlrm_dram"
            else None
        )

    def to_kjt(self, keys: tuple[str, ...], ids: torch.Tensor) -> KeyedJaggedTensor:
        """Builds the KJT of one batch.

        Args:
            keys: feature names.
            ids: int64 ``(F, B)`` raw ids.

        Returns:
            KJT with ``F`` keys, ``B`` samples each, values grouped by key.
        """
        num_f, batch = ids.shape
        if self.projector is None:
            rows = torch.stack([ids[f] % self.rows[f] for f in range(num_f)])
            lengths = torch.ones(num_f * batch, dtype=torch.int32)
            values = rows.reshape(-1)
        else:
            rows = torch.stack([self.projector(ids[f], f) for f in range(num_f)])  # (F, B, k)
            lengths = torch.full((num_f * batch,), self.projector.k, dtype=torch.int32)
            values = rows.reshape(-1)
        return KeyedJaggedTensor.from_lengths_sync(keys=list(keys), values=values, lengths=lengths)


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
        """This rank's evaluation batches (the same count on every rank)."""

    def total_steps(self) -> int:
        """Steps of the whole run: ``max_steps`` or ``epochs * steps_per_epoch``."""
        if self.config.max_steps is not None:
            return self.config.max_steps
        spe = self.steps_per_epoch
        if spe is None:
            raise ValueError(f"dataset={self.config.dataset!r} is endless: set max_steps")
        return self.config.epochs * spe


def make_data_source(config: TrainConfig, rank: int, world_size: int) -> BatchSource:
    """The configured data source for one rank.

    Args:
        config: the run's config (``dataset`` selects the source).
        rank: this process's rank.
        world_size: number of ranks.

    Returns:
        A :class:`BatchSource`.
    """
    if config.dataset == "movielens100k":
        from recpipe.recipes.data.movielens import MovieLens100kSource

        return MovieLens100kSource(config, rank, world_size)
    if config.dataset == "synthetic":
        from recpipe.recipes.data.synthetic import SyntheticCriteoSource

        return SyntheticCriteoSource(config, rank, world_size)
    from recpipe.recipes.data.criteo import CriteoTsvSource

    return CriteoTsvSource(config, rank, world_size)
