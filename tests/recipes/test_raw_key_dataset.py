"""The ``synthetic_raw_keys`` stream: deterministic batches of raw int64 keys over a signed 40-bit space,
Zipf-distributed as its documented law, labelled by a hidden teacher over the keys, so that hashing the
keys into fewer buckets measurably costs a learner quality; the recipe trains on it.
"""

from __future__ import annotations

import math
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torchmetrics.functional.classification import binary_auroc

from recpipe.recipes.config import ConfigError, TrainConfig
from recpipe.recipes.data import dataset_names
from recpipe.recipes.data.raw_keys import (
    KEY_BITS,
    KEY_OFFSET,
    KEY_WEIGHT,
    TEACHER_BIAS,
    RawKeySource,
    feistel_round_keys,
    scramble,
    unscramble,
)
from recpipe.recipes.data.registry import make_data_source
from recpipe.recipes.train import run

RAW = dict(dataset="synthetic_raw_keys", model="dlrm", max_steps=4)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread, as the recipe runs by default (the test machine's cores are shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def source(rank: int = 0, world: int = 1, **overrides: object) -> RawKeySource:
    src = make_data_source(TrainConfig(**{**RAW, **overrides}), rank, world)  # type: ignore[arg-type]
    assert isinstance(src, RawKeySource)
    return src


def test_raw_keys_is_a_registered_endless_dataset() -> None:
    assert "synthetic_raw_keys" in dataset_names()
    with pytest.raises(
        ConfigError, match="max_steps=None: the synthetic_raw_keys stream is endless. Fix: pass --max-steps"
    ):
        TrainConfig(dataset="synthetic_raw_keys")
    src = source(batch_size=8)
    assert src.spec.name == "synthetic_raw_keys" and src.steps_per_epoch is None and src.total_steps() == 4
    assert src.spec.dense_in_features == 13 and len(src.spec.feature_names) == 26
    assert src.spec.cardinalities == (src.config.synthetic_id_space,) * 26


def test_batches_depend_only_on_seed_split_step_and_rank() -> None:
    a, b = source(1, 2, batch_size=64), source(1, 2, batch_size=64)
    for x, y in zip(a.train_batches(2, 4), b.train_batches(2, 4)):
        assert torch.equal(x.dense_features, y.dense_features) and torch.equal(x.labels, y.labels)
        assert torch.equal(x.sparse_features.values(), y.sparse_features.values())
    keys = a.raw_batch(0, 2)[1]
    assert torch.equal(keys, b.raw_batch(0, 2)[1])
    others = [a.raw_batch(0, 3)[1], a.raw_batch(1, 2)[1], source(0, 2, batch_size=64).raw_batch(0, 2)[1]]
    others.append(source(1, 2, batch_size=64, seed=1).raw_batch(0, 2)[1])
    for other in others:  # another step, split, rank or seed: other keys
        assert not torch.equal(keys, other)


def test_scramble_is_a_bijection_of_the_40_bit_space() -> None:
    round_keys = feistel_round_keys(seed=7, num_features=2)
    top = 2**KEY_BITS
    ranks = torch.stack([torch.arange(1 << 16), torch.arange(top - (1 << 16), top)])
    values = scramble(ranks, round_keys)
    assert int(values.min()) >= 0 and int(values.max()) < top
    assert all(row.unique().numel() == 1 << 16 for row in values)  # injective on each range
    assert torch.equal(unscramble(values, round_keys), ranks)
    # the two features' permutations differ; consecutive ranks land far apart
    assert not torch.equal(values[0], scramble(ranks[:1].expand(2, -1).contiguous(), round_keys)[1])
    assert (values[0, 1:] - values[0, :-1]).abs().float().median() > 2**30
    for bad in (torch.tensor([[-1], [0]]), torch.tensor([[top], [0]])):
        with pytest.raises(ValueError, match=r"must lie in \[0, 2\*\*40\)"):
            scramble(bad, round_keys)
        with pytest.raises(ValueError, match=r"must lie in \[0, 2\*\*40\)"):
            unscramble(bad, round_keys)


def test_keys_span_a_signed_40_bit_space() -> None:
    src = source(batch_size=4096, synthetic_id_space=1_000_000)
    keys = src.raw_batch(0, 0)[1]
    assert keys.dtype == torch.int64 and keys.shape == (26, 4096)
    assert -KEY_OFFSET <= int(keys.min()) < -(2**32) and 2**32 < int(keys.max()) < KEY_OFFSET
    assert 0.4 < (keys < 0).double().mean().item() < 0.6  # about half are negative
    assert (keys.abs() > 2**32).double().mean().item() > 0.9  # most need more than 32 bits
    ranks = src.ranks_of_keys(keys)
    assert int(ranks.min()) >= 0 and int(ranks.max()) < 1_000_000  # every key is one of the feature's n keys
    assert torch.equal(src.keys_of_ranks(ranks), keys)


def zipf_mass(rank: int, n: int, alpha: float) -> float:
    """P(rank) of the bounded continuous Zipf law on [1, n + 1) the module documents, in closed form."""
    if abs(alpha - 1.0) < 1e-9:
        cdf = lambda x: math.log(x) / math.log(n + 1)  # noqa: E731
    else:
        cdf = lambda x: (x ** (1 - alpha) - 1) / ((n + 1) ** (1 - alpha) - 1)  # noqa: E731
    return cdf(rank + 2) - cdf(rank + 1)


@pytest.mark.parametrize("alpha", [1.1, 1.0])
def test_head_key_frequencies_follow_the_documented_zipf_law(alpha: float) -> None:
    n, batch, steps = 50_000, 4096, 4
    src = source(batch_size=batch, synthetic_id_space=n, zipf_alpha=alpha)
    keys = torch.cat([src.raw_batch(0, s)[1] for s in range(steps)], dim=1)
    samples = batch * steps
    for feature in (0, 25):
        feature_alpha = min(3.0, alpha + 0.02 * feature)
        head = src.keys_of_ranks(torch.arange(5).repeat(26, 1))[feature]  # the five hottest keys
        for r, key in enumerate(head.tolist()):
            p = zipf_mass(r, n, feature_alpha)
            count = int((keys[feature] == key).sum())
            assert abs(count - p * samples) < 5 * math.sqrt(samples * p * (1 - p)) + 1, (feature, r, count, p)
        # the head is far hotter than uniform
        assert int((keys[feature] == head[0]).sum()) > 1000 * samples / n


def test_teacher_weights_are_a_pure_standard_normal_function_of_feature_and_key() -> None:
    src = source(batch_size=2048, synthetic_id_space=1_000_000)
    keys = torch.cat([src.raw_batch(0, s)[1] for s in range(3)], dim=1)
    w = src.teacher_weights(keys)
    # the same key of a feature always has the same weight, wherever it appears
    for f in (0, 13):
        first = {}
        for k, v in zip(keys[f].tolist(), w[f].tolist()):
            assert first.setdefault(k, v) == v
    # over distinct keys: standard normal moments and mass within one sigma
    distinct = src.keys_of_ranks(torch.arange(20_000).repeat(26, 1))
    z = src.teacher_weights(distinct).flatten()
    assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1.0) < 0.01
    assert abs((z.abs() < 1).double().mean().item() - 0.6827) < 0.005
    # features and seeds are independent: the same keys weigh differently
    same_keys = distinct[:1].expand(26, -1).contiguous()
    ws = src.teacher_weights(same_keys)
    assert abs(torch.corrcoef(ws[:2])[0, 1].item()) < 0.05
    other_seed = source(batch_size=2048, synthetic_id_space=1_000_000, seed=5).teacher_weights(same_keys)
    assert abs(torch.corrcoef(torch.stack([ws[0], other_seed[0]]))[0, 1].item()) < 0.05


def test_labels_are_draws_of_the_teachers_probabilities() -> None:
    src = source(batch_size=10_000)
    dense, keys, labels = src.raw_batch(0, 0)
    logits = src.teacher_logits(dense, keys)
    # the teacher logit is its bias, a dense linear term and KEY_WEIGHT per key weight
    expected = TEACHER_BIAS + dense.double() @ src.dense_weights + KEY_WEIGHT * src.teacher_weights(keys).sum(0)
    torch.testing.assert_close(logits, expected)
    assert binary_auroc(logits.float(), labels.long()).item() > 0.7
    p = torch.sigmoid(logits)
    for lo, hi in ((0.0, 0.2), (0.2, 0.5), (0.5, 0.8), (0.8, 1.0)):  # calibrated within each probability band
        band = (p >= lo) & (p < hi)
        m = int(band.sum())
        assert m > 500
        sd = math.sqrt((p[band] * (1 - p[band])).sum().item())
        assert abs(labels[band].sum().item() - p[band].sum().item()) < 5 * sd, (lo, hi)


def _cat(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts], 1), torch.cat([p[2] for p in parts])


def _raw_columns(train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One weight per (feature, key) seen in training; a key unseen there gets column ``P`` (weight 0)."""
    offset = torch.arange(26).unsqueeze(1) * 2**41  # features apart: keys lie in [-2**39, 2**39)
    a, b = train + offset, test + offset
    seen, columns = torch.unique(a, return_inverse=True)
    p = seen.numel()
    pos = torch.searchsorted(seen, b).clamp(max=p - 1)
    return columns, torch.where(seen[pos] == b, pos, torch.full_like(pos, p)), p


def _fit_and_score(
    train: tuple[torch.Tensor, ...], test: tuple[torch.Tensor, ...], columns: tuple[torch.Tensor, torch.Tensor], p: int
) -> tuple[float, float]:
    """(test AUROC, test log loss) of an L2-regularised logistic regression on one-hot key columns + dense."""
    w = torch.zeros(p + 1, dtype=torch.float64, requires_grad=True)
    v = torch.zeros(13, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(p + 1, dtype=torch.float64)
    mask[p] = 0.0  # the unseen-key column stays 0

    def logits(cols: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return (w * mask)[cols].sum(0) + dense.double() @ v + bias

    opt = torch.optim.LBFGS([w, v, bias], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(logits(columns[0], train[0]), train[2].double())
        loss = loss + 1e-3 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        out = logits(columns[1], test[0])
        return binary_auroc(out.float(), test[2].long()).item(), F.binary_cross_entropy_with_logits(
            out, test[2].double()
        ).item()


def test_hashing_keys_into_buckets_costs_a_learner_quality() -> None:
    # A logistic regression with one weight per raw key, against the same model with one weight per
    # bucket (key mod buckets, the static recipe's id -> row): collisions mix unrelated keys' teacher
    # weights, so the hashed model predicts held-out labels worse, the fewer buckets the worse.
    src = source(batch_size=5000, synthetic_id_space=1000, seed=3)
    train = _cat([src.raw_batch(0, s) for s in range(4)])
    test = _cat([src.raw_batch(1, s) for s in range(2)])
    raw_train, raw_test, p = _raw_columns(train[1], test[1])
    raw_auc, raw_loss = _fit_and_score(train, test, (raw_train, raw_test), p)
    scores = {}
    for buckets in (16, 64):
        offset = torch.arange(26).unsqueeze(1) * buckets
        hashed = (train[1] % buckets + offset, test[1] % buckets + offset)
        scores[buckets] = _fit_and_score(train, test, hashed, 26 * buckets)
    teacher_auc = binary_auroc(src.teacher_logits(test[0], test[1]).float(), test[2].long()).item()
    assert raw_auc < teacher_auc  # no learner beats the labels' own model
    assert raw_auc > scores[64][0] + 0.02 and raw_loss < scores[64][1] - 0.01, (raw_auc, raw_loss, scores)
    assert scores[16][0] < scores[64][0] and scores[16][1] > scores[64][1], scores


@pytest.mark.parametrize("dynamic", [False, True])
def test_tables_take_keys_mod_num_embeddings_or_with_dynamic_tables_the_raw_keys(dynamic: bool) -> None:
    src = source(batch_size=512, num_embeddings=1000, dynamic_tables=dynamic)
    keys = src.raw_batch(0, 1)[1]
    kjt = next(src.train_batches(1, 2)).sparse_features
    assert kjt.keys() == list(src.spec.feature_names) and kjt.lengths().tolist() == [1] * (26 * 512)
    values = kjt.values().reshape(26, 512)
    if dynamic:
        assert torch.equal(values, keys) and int(values.min()) < 0
    else:  # Python's modulo: a row in [0, 1000) for every key, negative ones included
        expected = torch.tensor([[k % 1000 for k in row] for row in keys.tolist()])
        assert torch.equal(values, expected)


def test_recipe_trains_and_evaluates_on_raw_keys() -> None:
    config = TrainConfig(
        **RAW,
        num_embeddings=500,
        synthetic_id_space=100_000,
        embedding_dim=8,
        dense_arch=(16, 8),
        over_arch=(16, 1),
        batch_size=32,
        eval_batches=2,
        progress_bar=False,
        placement="table_wise",
    )
    result = run(config)
    assert result.steps == 4 == len(result.losses)
    assert all(math.isfinite(x) and x > 0 for x in result.losses)
    assert 0.0 <= result.final_auroc <= 1.0
