"""Dataset name -> :class:`~recpipe.recipes.data.base.BatchSource` class, and the dispatch.

This module imports every source; :mod:`recpipe.recipes.data.base` (which the sources
import) imports none of them, so there is no import cycle.
"""

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
    """The configured data source for one rank.

    Args:
        config: the run's config (``dataset`` selects the source).
        rank: this process's rank.
        world_size: number of ranks.

    Returns:
        A :class:`~recpipe.recipes.data.base.BatchSource`.

    Raises:
        ValueError: ``config.dataset`` names no source.
    """
    try:
        source = DATA_SOURCES[config.dataset]
    except KeyError:
        raise ValueError(
            f"dataset={config.dataset!r} names no data source; choose one of {sorted(DATA_SOURCES)}"
        ) from None
    return source(config, rank, world_size)
