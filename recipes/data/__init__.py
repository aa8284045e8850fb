"""Data sources for recpipe recipes: MovieLens-100k, a synthetic Criteo-like stream, Criteo TSV."""

from recpipe.recipes.data.base import BatchSource, DatasetSpec
from recpipe.recipes.data.registry import DATA_SOURCES, make_data_source

__all__ = ["BatchSource", "DATA_SOURCES", "DatasetSpec", "make_data_source"]
