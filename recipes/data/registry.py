"""The dataset registry: registering a ``--dataset`` and building a rank's :class:`~.base.BatchSource`.

The names live in :data:`recpipe.recipes.data.DATASETS` (the built-in ones are listed there by
``"module:Class"`` reference, imported on first use). A dataset outside this package registers its
class with :func:`register_dataset` from its own module, which must be imported before the config is
parsed. :class:`~recpipe.recipes.config.TrainConfig` and ``--help`` read their ``dataset`` choices
when called, so both see every registration.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator, Mapping
from typing import Union

from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data import DATASETS, dataset_names
from recpipe.recipes.data.base import BatchSource

_NAME = re.compile(r"[a-z][a-z0-9_]*")
_REFERENCE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def _reference_of(source: Union[str, type]) -> str:
    """``module:Class`` of a source class, or the reference itself."""
    return source if isinstance(source, str) else f"{source.__module__}:{source.__qualname__}"


def register_dataset(name: str, source: Union[str, type[BatchSource]]) -> None:
    """Registers dataset ``name`` (the value of ``--dataset`` / ``TrainConfig.dataset``), served by ``source``.

    Registering the same source under the same name again does nothing (a module imported twice).

    Args:
        name: lower-case letters, digits and ``_``, starting with a letter.
        source: the ``BatchSource`` subclass (called as ``source(config, rank, world_size)``), or its
            ``"package.module:ClassName"`` reference, imported when the dataset is first used.

    Raises:
        ValueError: a malformed ``name`` or reference, or ``name`` already registered to another source.
        TypeError: ``source`` is neither a ``BatchSource`` subclass nor a reference string.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"register_dataset: name={name!r} is not a dataset name. Fix: use lower-case letters, digits "
            "and '_', starting with a letter (it is typed as --dataset NAME)"
        )
    if isinstance(source, str):
        if not _REFERENCE.fullmatch(source):
            raise ValueError(
                f"register_dataset({name!r}): source={source!r} is not a 'package.module:ClassName' reference. "
                "Fix: pass e.g. 'recpipe.recipes.data.synthetic:SyntheticCriteoSource', or the class itself"
            )
    elif not (isinstance(source, type) and issubclass(source, BatchSource)):
        raise TypeError(
            f"register_dataset({name!r}): source={source!r} is not a BatchSource subclass. Fix: pass a "
            "subclass of recpipe.recipes.data.base.BatchSource, or its 'package.module:ClassName' reference"
        )
    if name in DATASETS:
        if _reference_of(DATASETS[name]) == _reference_of(source):
            return
        raise ValueError(
            f"register_dataset: dataset {name!r} is registered already, to {_reference_of(DATASETS[name])}. "
            "Fix: give the new dataset another name"
        )
    DATASETS[name] = source


def data_source_class(name: str) -> type[BatchSource]:
    """The ``BatchSource`` subclass serving dataset ``name``, imported on first use.

    Raises:
        ValueError: no dataset ``name`` is registered.
        ImportError: the module of its reference cannot be imported.
        TypeError: its reference names no ``BatchSource`` subclass.
    """
    if name not in DATASETS:
        raise ValueError(
            f"dataset={name!r} names no data source; choose one of {', '.join(DATASETS)}, "
            "or register it with recpipe.recipes.data.registry.register_dataset"
        )
    source = DATASETS[name]
    if isinstance(source, str):
        module, _, attribute = source.partition(":")
        resolved = getattr(importlib.import_module(module), attribute, None)
        if not (isinstance(resolved, type) and issubclass(resolved, BatchSource)):
            raise TypeError(
                f"dataset {name!r} is registered to {source}, which is {resolved!r}, not a BatchSource subclass. "
                "Fix: register the dataset's BatchSource subclass"
            )
        DATASETS[name] = source = resolved
    return source


class _DataSources(Mapping[str, type[BatchSource]]):
    """Read-only view of the registry: dataset name -> source class (imported on first access)."""

    def __getitem__(self, name: str) -> type[BatchSource]:
        if name not in DATASETS:
            raise KeyError(name)
        return data_source_class(name)

    def __iter__(self) -> Iterator[str]:
        return iter(dataset_names())

    def __len__(self) -> int:
        return len(DATASETS)


DATA_SOURCES: Mapping[str, type[BatchSource]] = _DataSources()
"""Every registered ``TrainConfig.dataset`` value and the source class that serves it."""


def make_data_source(config: TrainConfig, rank: int, world_size: int) -> BatchSource:
    """The ``config.dataset`` source for one rank (ValueError for an unregistered name)."""
    return data_source_class(config.dataset)(config, rank, world_size)
