"""A deterministic synthetic Criteo-like stream, generated on the fly.

13 dense and 26 sparse features. Feature ``f`` draws ids from a bounded Zipf law over
its own id space, scattered by a bijection so hot ids are not small integers. Labels
come from a hidden logistic model (dense weights plus a hashed per-id weight per
feature), so learning hot ids' embeddings lowers the loss.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torchrec.datasets.utils import Batch

from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data.base import BatchSource, DatasetSpec, IdTransform
from recpipe.recipes.data.hashing import hash_ids_grid, mix_seed

# Criteo layout (torchrec.datasets.criteo INT_FEATURE_COUNT / CAT_FEATURE_COUNT).
NUM_DENSE: int = 13
NUM_SPARSE: int = 26
FEATURES: tuple[str, ...] = tuple(f"cat_{i}" for i in range(NUM_SPARSE))
# Smallest per-feature id space (ids), so later features keep a long tail.
MIN_ID_SPACE: int = 1_000
# Prime below 2**31 scattering Zipf ranks over the id space: rank * P mod n is a
# bijection when gcd(P, n) = 1 and stays below 2**62 (no int64 overflow).
SCATTER_PRIME: int = 2_147_483_629
# Hidden model scales: per-id weights in [-w, w] for each sparse feature and
# N(0, 1/13) dense weights keep the logit's std near 2 (learnable, not separable).
SPARSE_WEIGHT: float = 0.6
SPLIT_TRAIN: int = 0
SPLIT_EVAL: int = 1


def sample_zipf(n: int, alpha: float, size: int, gen: torch.Generator) -> torch.Tensor:
    """``size`` int64 Zipf-like ranks in ``[0, n)`` (P(r) ~ ``(r + 1) ** -alpha``), by inverting the CDF."""
    u = torch.rand(size, generator=gen, dtype=torch.float64)
    if abs(alpha - 1.0) < 1e-9:
        x = torch.exp(u * math.log(n + 1))
    else:
        one_m = 1.0 - alpha
        top = (n + 1) ** one_m
        x = ((top - 1.0) * u + 1.0) ** (1.0 / one_m)
    return (x.floor().long() - 1).clamp_(0, n - 1)


def zipf_exponents(alpha: float) -> tuple[float, ...]:
    """Zipf exponent of each sparse feature: ``alpha + 0.02 f`` for feature ``f``, at most 3."""
    return tuple(min(3.0, alpha + 0.02 * f) for f in range(NUM_SPARSE))


class SyntheticCriteoSource(BatchSource):
    """Endless Criteo-like batches; rank ``r``'s batch at step ``s`` is seeded by (seed, s, r)."""

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        super().__init__(config, rank, world_size)
        # feature f: max_space / 2**(f mod 10) ids (at least MIN_ID_SPACE), Zipf exponent alpha + 0.02 f (at most 3)
        max_space = config.synthetic_id_space
        self._spaces = tuple(max(min(MIN_ID_SPACE, max_space), max_space >> (f % 10)) for f in range(NUM_SPARSE))
        self._alphas = zipf_exponents(config.zipf_alpha)
        self.spec = DatasetSpec(
            name="synthetic", dense_in_features=NUM_DENSE, feature_names=FEATURES, cardinalities=self._spaces
        )
        self._transform = IdTransform(config, self.spec)
        gen = torch.Generator().manual_seed(mix_seed(config.seed, 0xD15E))
        self._dense_w = torch.randn(NUM_DENSE, generator=gen, dtype=torch.float64) / math.sqrt(NUM_DENSE)
        self._bias = -0.5
        # Seed of feature f's hidden per-id weights, as an (F, 1) column for hash_ids_grid.
        self._id_seeds = torch.tensor([[mix_seed(config.seed, 0x1D, f)] for f in range(NUM_SPARSE)], dtype=torch.int64)

    def hidden_logits(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The hidden model's logits for dense ``(B, 13)`` and raw ids ``(26, B)``.

        ``dense @ w + bias`` plus ``SPARSE_WEIGHT * (2 u - 1)`` per feature, ``u`` the id's
        hash / 2**32; the ``cumsum`` adds the features in order 0..25.
        """
        logit = dense.double() @ self._dense_w + self._bias
        u = hash_ids_grid(ids, self._id_seeds)[:, :, 0].double() / 2.0**32  # (26, B) in [0, 1)
        terms = SPARSE_WEIGHT * (2.0 * u - 1.0)
        return torch.cat([logit.unsqueeze(0), terms]).cumsum(0)[-1]

    def raw_batch(self, split: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense ``(B, 13)``, raw ids ``(26, B)`` and labels ``(B,)`` of this rank at ``step``."""
        b = self.config.batch_size
        gen = torch.Generator().manual_seed(mix_seed(self.config.seed, split, step, self.rank))
        dense = torch.randn(b, NUM_DENSE, generator=gen)
        ids = torch.stack([(sample_zipf(n, a, b, gen) * SCATTER_PRIME) % n for n, a in zip(self._spaces, self._alphas)])
        p = torch.sigmoid(self.hidden_logits(dense, ids))
        labels = (torch.rand(b, generator=gen, dtype=torch.float64) < p).float()
        return dense, ids, labels

    def _batch(self, split: int, step: int) -> Batch:
        dense, ids, labels = self.raw_batch(split, step)
        return Batch(dense_features=dense, sparse_features=self._transform.to_kjt(FEATURES, ids), labels=labels)

    def eval_batch_count(self) -> int:
        return self.config.eval_batches

    def train_batches(self, start: int, stop: int) -> Iterator[Batch]:
        return (self._batch(SPLIT_TRAIN, step) for step in range(start, stop))

    def eval_batches(self) -> Iterator[Batch]:
        return (self._batch(SPLIT_EVAL, i) for i in range(self.config.eval_batches))
