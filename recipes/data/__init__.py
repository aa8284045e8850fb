"""Data sources of the recipes: MovieLens-100k, a synthetic Criteo-like stream, Criteo TSV, and a
synthetic stream of raw int64 keys (for dynamic tables).

:mod:`.base` declares :class:`~.base.BatchSource`, the contract of a source; :data:`DATASETS` names
every ``--dataset`` and its source; :mod:`.registry` registers more
(:func:`~.registry.register_dataset`) and builds a rank's source. Adding a dataset is a module
here with a ``BatchSource`` subclass and one line in :data:`DATASETS` (docs/recipes.md, "Adding a
dataset"). Imports nothing, so validating a config (the torchx launcher does) imports no source,
torch or torchrec.
"""

from __future__ import annotations

from typing import Union

DATASETS: dict[str, Union[str, type]] = {
    "movielens100k": "recpipe.recipes.data.movielens:MovieLens100kSource",
    "synthetic": "recpipe.recipes.data.synthetic:SyntheticCriteoSource",
    "criteo_tsv": "recpipe.recipes.data.criteo:CriteoTsvSource",
    "synthetic_raw_keys": "recpipe.recipes.data.raw_keys:RawKeySource",
}
"""Every registered ``--dataset`` name -> its ``BatchSource`` subclass, or the ``"module:Class"``
reference of it, imported on first use. The built-in datasets are the lines above; others are added
by :func:`recpipe.recipes.data.registry.register_dataset`, which checks the entry."""


def dataset_names() -> tuple[str, ...]:
    """Every registered dataset name, in registration order (the built-in ones first)."""
    return tuple(DATASETS)
