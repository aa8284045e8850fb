"""The dataset registry: a dataset registered with ``register_dataset`` is a ``--dataset`` choice of the
config and the command line, and the recipe trains on it; bad registrations are refused by name.

The toy dataset below is what docs/recipes.md "Adding a dataset" describes: a ``BatchSource`` subclass
and one registration. Its labels are a function of its ids, so a run's batches can be checked against
a recomputation.
"""

from __future__ import annotations

import math
from typing import Iterator

import pytest
import torch
from torchrec.datasets.utils import Batch

from recpipe.recipes.cli import build_arg_parser, parse_config
from recpipe.recipes.config import ConfigError, TrainConfig, field_choices
from recpipe.recipes.data import DATASETS, dataset_names
from recpipe.recipes.data.base import BatchSource, DatasetSpec, IdTransform
from recpipe.recipes.data.registry import DATA_SOURCES, data_source_class, make_data_source, register_dataset
from recpipe.recipes.train import run

TOY = "toy_clicks"
TOY_CARDINALITIES = (40, 25)
TOY_STEPS_PER_EPOCH = 5
# global steps the toy source was asked for, in order (the run builds its source inside run())
STEPS_SERVED: list[int] = []


def toy_ids(seed: int, split: int, step: int, rank: int, batch_size: int) -> torch.Tensor:
    """int64 ``(2, batch_size)`` raw ids of one toy batch."""
    g = torch.Generator().manual_seed(((seed * 2 + split) * 10_000 + step) * 100 + rank)
    return torch.stack([torch.randint(0, c, (batch_size,), generator=g) for c in TOY_CARDINALITIES])


class ToyClicks(BatchSource):
    """Two sparse features and one dense one; a sample is a click iff its feature-a id is even."""

    steps_per_epoch = TOY_STEPS_PER_EPOCH

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        super().__init__(config, rank, world_size)
        self.spec = DatasetSpec(
            name=TOY, dense_in_features=1, feature_names=("a", "b"), cardinalities=TOY_CARDINALITIES
        )
        self._transform = IdTransform(config, self.spec)

    def _batch(self, split: int, step: int) -> Batch:
        ids = toy_ids(self.config.seed, split, step, self.rank, self.config.batch_size)
        return Batch(
            dense_features=ids[1:].T.float() / TOY_CARDINALITIES[1],
            sparse_features=self._transform.to_kjt(self.spec.feature_names, ids),
            labels=(ids[0] % 2 == 0).float(),
        )

    def train_batches(self, start: int, stop: int) -> Iterator[Batch]:
        for step in range(start, stop):
            STEPS_SERVED.append(step)
            yield self._batch(0, step)

    def eval_batch_count(self) -> int:
        return self.config.eval_batches

    def eval_batches(self) -> Iterator[Batch]:
        return (self._batch(1, i) for i in range(self.config.eval_batches))


class NotASource:
    """A class that is no BatchSource."""


@pytest.fixture
def toy_registered() -> Iterator[None]:
    register_dataset(TOY, ToyClicks)
    yield
    del DATASETS[TOY]


def test_unregistered_dataset_is_refused_naming_the_registered_ones() -> None:
    assert TOY not in dataset_names()
    with pytest.raises(ConfigError, match=rf"dataset='{TOY}': unknown choice. Fix: use one of movielens100k, "):
        parse_config(["--dataset", TOY])


def test_registered_dataset_is_a_config_and_cli_choice(toy_registered: None) -> None:
    assert dataset_names() == ("movielens100k", "synthetic", "criteo_tsv", "synthetic_raw_keys", TOY)
    assert field_choices()["dataset"] == dataset_names()
    assert parse_config(["--dataset", TOY, "--batch-size", "8"]).dataset == TOY
    assert TrainConfig(dataset=TOY).dataset == TOY
    help_text = " ".join(build_arg_parser().format_help().split())
    assert f"choices: movielens100k, synthetic, criteo_tsv, synthetic_raw_keys, {TOY};" in help_text
    assert DATA_SOURCES[TOY] is ToyClicks and data_source_class(TOY) is ToyClicks
    register_dataset(TOY, ToyClicks)  # the same registration again (a module imported twice): no change
    register_dataset(TOY, f"{__name__}:ToyClicks")  # its reference too
    assert dataset_names().count(TOY) == 1


def test_recipe_trains_and_evaluates_on_a_registered_dataset(toy_registered: None) -> None:
    config = parse_config(
        ["--dataset", TOY, "--model", "dlrm", "--batch-size", "16", "--embedding-dim", "8"]
        + ["--dense-arch", "8", "--over-arch", "8,1", "--epochs", "2", "--eval-batches", "2"]
        + ["--log-every", "5", "--no-progress-bar", "--placement", "table_wise"]
    )
    source = make_data_source(config, 0, 1)
    assert isinstance(source, ToyClicks) and source.total_steps() == 2 * TOY_STEPS_PER_EPOCH
    (batch,) = list(source.train_batches(3, 4))
    ids = toy_ids(config.seed, 0, 3, 0, 16)
    assert batch.labels.tolist() == [float(i % 2 == 0) for i in ids[0].tolist()]
    assert batch.sparse_features.keys() == ["a", "b"]
    assert batch.sparse_features.values().tolist() == ids.flatten().tolist()  # rows = ids (tables hold them all)
    STEPS_SERVED.clear()
    result = run(config)
    assert result.steps == 2 * TOY_STEPS_PER_EPOCH == len(result.losses)
    assert STEPS_SERVED == list(range(2 * TOY_STEPS_PER_EPOCH))
    assert all(math.isfinite(x) and x > 0 for x in result.losses)
    assert [step for step, _ in result.evals] == [2 * TOY_STEPS_PER_EPOCH]
    assert 0.0 <= result.final_auroc <= 1.0


@pytest.mark.parametrize(
    "name, source, error, message",
    [
        ("Toy", ToyClicks, ValueError, "name='Toy' is not a dataset name. Fix: use lower-case letters"),
        ("toy-clicks", ToyClicks, ValueError, "name='toy-clicks' is not a dataset name"),
        ("synthetic", ToyClicks, ValueError, "dataset 'synthetic' is registered already, to recpipe.recipes"),
        (TOY, NotASource, TypeError, "is not a BatchSource subclass. Fix: pass a subclass"),
        (TOY, "recpipe.recipes.data.toy", ValueError, "is not a 'package.module:ClassName' reference"),
    ],
)
def test_bad_registration_is_refused_naming_it(name: str, source: object, error: type, message: str) -> None:
    before = dict(DATASETS)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(".", r"\.")):
        register_dataset(name, source)  # type: ignore[arg-type]
    assert DATASETS == before


def test_reference_to_a_non_source_fails_at_first_use() -> None:
    register_dataset(TOY, f"{__name__}:NotASource")
    try:
        assert TOY in field_choices()["dataset"]  # registered by name, not imported yet
        with pytest.raises(TypeError, match=rf"dataset '{TOY}' is registered to {__name__}:NotASource"):
            make_data_source(TrainConfig(dataset=TOY), 0, 1)
    finally:
        del DATASETS[TOY]
