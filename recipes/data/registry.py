"""Dataset name -> :class:`~recpipe.recipes.data.base.BatchSource` class (imports every source)."""

from __future__ import annotations

from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data.base import BatchSource
from recpipe.recipes.data.criteo import CriteoTsvSource
from recpipe.recipes.data.movielens import MovieLens100kSource
from recpipe.recipes.data.synthetic import SyntheticCriteoSource

DATA_SOURCES: dict[str, type[BatchSource]] = {
    "movielens100k": MovieLens100kSource,
    "synthetic": SyntheticCriteoSource,
    "criteo_tsv": CriteoTsvSource,
}
"""Every ``TrainConfig.dataset`` value and the source class that serves it."""


def make_data_source(config: TrainConfig, rank: int, world_size: int) -> BatchSource:
    """The ``config.dataset`` source for one rank (ValueError for an unknown name)."""
    if config.dataset not in DATA_SOURCES:
        raise ValueError(f"dataset={config.dataset!r} names no data source; choose one of {sorted(DATA_SOURCES)}")
    return DATA_SOURCES[config.dataset](config, rank, world_size)
