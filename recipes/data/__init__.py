"""Data sources of the recipes: MovieLens-100k, a synthetic Criteo-like stream, Criteo TSV.

:mod:`.base` declares :class:`~.base.BatchSource`; :mod:`.registry` maps ``--dataset``
names to sources. May import :mod:`recpipe.recipes.config`.
"""
