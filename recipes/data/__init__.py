"""Data sources for recpipe recipes: MovieLens-100k, a synthetic Criteo-like stream, Criteo TSV."""

from recpipe.recipes.data.base import BatchSource, DatasetSpec, make_data_source

__all__ = ["BatchSource", "DatasetSpec", "make_data_source"]
