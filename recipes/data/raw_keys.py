"""``synthetic_raw_keys``: a deterministic CTR stream of raw int64 keys, for dynamic tables.

13 dense and 26 sparse features, as the ``synthetic`` stream. Feature ``f`` draws a Zipf rank
``r`` in ``[0, n)`` (``n = synthetic_id_space`` distinct keys per feature;
:func:`~recpipe.recipes.data.synthetic.sample_zipf` with exponent ``zipf_alpha + 0.02 f``, so
``P(r) = F(r + 2) - F(r + 1)`` with ``F(x) = (x ** (1 - a) - 1) / ((n + 1) ** (1 - a) - 1)``, its limit
``log x / log(n + 1)`` at ``a = 1``) and
emits the key ``scramble_f(r) - KEY_OFFSET``: ``scramble_f`` is a seeded Feistel permutation of
``[0, 2**40)`` (:func:`scramble`), so keys are spread over a 40-bit space and about half of them
are negative.

Labels come from a hidden teacher over the keys: each (feature, key) has a weight that is a pure
hash of the two, standard normal (:meth:`RawKeySource.teacher_weights`); the logit is the sum of
the 26 weights times :data:`KEY_WEIGHT` plus a linear term of the dense features, and the label is
a seeded Bernoulli draw of its sigmoid. A table of fewer rows than keys (the static recipe's
``key mod num_embeddings``, Python's sign rule, so every row is ``>= 0``) makes unrelated keys
share a row and so mixes their weights; a dynamic table (``--dynamic-tables``) keys its rows by
the raw key.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torchrec.datasets.utils import Batch

from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data.base import BatchSource, DatasetSpec, IdTransform
from recpipe.recipes.data.hashing import fmix32, hash_ids_grid, mix_seed
from recpipe.recipes.data.synthetic import (
    FEATURES,
    NUM_DENSE,
    NUM_SPARSE,
    SPLIT_EVAL,
    SPLIT_TRAIN,
    sample_zipf,
    zipf_exponents,
)

# Keys are scrambled ranks in [0, 2**KEY_BITS), shifted down by KEY_OFFSET: [-2**39, 2**39).
KEY_BITS: int = 40
KEY_OFFSET: int = 2 ** (KEY_BITS - 1)
# The Feistel permutation works on two halves of KEY_BITS / 2 bits; 4 rounds mix every bit into every other.
_HALF_BITS: int = KEY_BITS // 2
_HALF_MASK: int = (1 << _HALF_BITS) - 1
FEISTEL_ROUNDS: int = 4
# Teacher scales: 26 N(0, 1) key weights times KEY_WEIGHT (std ~1.8 together) dominate the dense
# term (std DENSE_WEIGHT), so most of what can be learned is in the keys.
KEY_WEIGHT: float = 0.35
DENSE_WEIGHT: float = 0.5
TEACHER_BIAS: float = -0.5
# Tags mixed into the seed of each of the stream's random parts (distinct from the synthetic stream's).
_TAG_BATCH, _TAG_SCRAMBLE, _TAG_TEACHER, _TAG_DENSE = 0x4B31, 0x4B32, 0x4B33, 0x4B34


def feistel_round_keys(seed: int, num_features: int) -> torch.Tensor:
    """int64 ``(num_features, FEISTEL_ROUNDS)`` 32-bit round keys of each feature's :func:`scramble`."""
    return torch.tensor(
        [[mix_seed(seed, _TAG_SCRAMBLE, f, i) for i in range(FEISTEL_ROUNDS)] for f in range(num_features)],
        dtype=torch.int64,
    ).reshape(num_features, FEISTEL_ROUNDS)


def _round(half: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The Feistel round function: ``fmix32(half ^ key)`` cut to a half's bits."""
    return fmix32(half ^ key) & _HALF_MASK


def _check_grid(name: str, values: torch.Tensor, round_keys: torch.Tensor) -> None:
    if values.dtype != torch.int64 or values.dim() != 2:
        raise ValueError(f"{name}: values must be an int64 (F, N) tensor, got {values.dtype} {tuple(values.shape)}")
    if round_keys.shape != (values.shape[0], FEISTEL_ROUNDS):
        raise ValueError(
            f"{name}: round_keys must be (F={values.shape[0]}, {FEISTEL_ROUNDS}) (feistel_round_keys), "
            f"got {tuple(round_keys.shape)}"
        )


def scramble(ranks: torch.Tensor, round_keys: torch.Tensor) -> torch.Tensor:
    """A bijection of ``[0, 2**KEY_BITS)`` per feature: row ``f`` of int64 ``(F, N)`` ``ranks`` is
    permuted by a Feistel network keyed by ``round_keys[f]`` (:func:`feistel_round_keys`).

    Raises:
        ValueError: ``ranks`` is not int64 ``(F, N)`` within ``[0, 2**KEY_BITS)``, or ``round_keys`` not ``(F, 4)``.
    """
    _check_grid("scramble", ranks, round_keys)
    if ranks.numel() and (int(ranks.min()) < 0 or int(ranks.max()) >> KEY_BITS):
        raise ValueError(
            f"scramble: ranks must lie in [0, 2**{KEY_BITS}), got [{int(ranks.min())}, {int(ranks.max())}]"
        )
    left, right = ranks >> _HALF_BITS, ranks & _HALF_MASK
    for i in range(FEISTEL_ROUNDS):
        left, right = right, left ^ _round(right, round_keys[:, i : i + 1])
    return (left << _HALF_BITS) | right


def unscramble(values: torch.Tensor, round_keys: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`scramble`: ``unscramble(scramble(r, k), k) == r``.

    Raises:
        ValueError: as :func:`scramble`.
    """
    _check_grid("unscramble", values, round_keys)
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >> KEY_BITS):
        raise ValueError(
            f"unscramble: values must lie in [0, 2**{KEY_BITS}), got [{int(values.min())}, {int(values.max())}]"
        )
    left, right = values >> _HALF_BITS, values & _HALF_MASK
    for i in reversed(range(FEISTEL_ROUNDS)):
        left, right = right ^ _round(left, round_keys[:, i : i + 1]), left
    return (left << _HALF_BITS) | right


class RawKeySource(BatchSource):
    """Endless batches of raw int64 keys; rank ``r``'s batch at step ``s`` is seeded by (seed, s, r).

    ``synthetic_id_space`` is each feature's distinct key count, ``zipf_alpha`` the first
    feature's Zipf exponent. Without ``--dynamic-tables`` the recipe's tables take ``key mod
    num_embeddings`` (:class:`~recpipe.recipes.data.base.IdTransform`).
    """

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        super().__init__(config, rank, world_size)
        self._keys_per_feature = config.synthetic_id_space
        self._alphas = zipf_exponents(config.zipf_alpha)
        self.spec = DatasetSpec(
            name="synthetic_raw_keys",
            dense_in_features=NUM_DENSE,
            feature_names=FEATURES,
            cardinalities=tuple(self._keys_per_feature for _ in FEATURES),
        )
        self._transform = IdTransform(config, self.spec)
        self.round_keys = feistel_round_keys(config.seed, NUM_SPARSE)
        gen = torch.Generator().manual_seed(mix_seed(config.seed, _TAG_DENSE))
        self.dense_weights = (
            DENSE_WEIGHT * torch.randn(NUM_DENSE, generator=gen, dtype=torch.float64) / math.sqrt(NUM_DENSE)
        )
        # Feature f's two teacher hash seeds (Box-Muller's two uniforms), an (F, 2) grid for hash_ids_grid.
        self._teacher_seeds = torch.tensor(
            [[mix_seed(config.seed, _TAG_TEACHER, f, j) for j in range(2)] for f in range(NUM_SPARSE)],
            dtype=torch.int64,
        )

    def keys_of_ranks(self, ranks: torch.Tensor) -> torch.Tensor:
        """int64 ``(26, N)`` keys of Zipf ranks ``(26, N)`` (row ``f``: feature ``f``)."""
        return scramble(ranks, self.round_keys) - KEY_OFFSET

    def ranks_of_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`keys_of_ranks` (a key no rank maps to gives a rank ``>= synthetic_id_space``).

        Raises:
            ValueError: a key outside ``[-KEY_OFFSET, KEY_OFFSET)``.
        """
        return unscramble(keys + KEY_OFFSET, self.round_keys)

    def teacher_weights(self, keys: torch.Tensor) -> torch.Tensor:
        """float64 ``(26, N)`` hidden weights of int64 keys ``(26, N)``: standard normal, a pure function
        of (seed, feature, key), by Box-Muller on two 32-bit hashes of the key."""
        h = hash_ids_grid(keys, self._teacher_seeds).double()  # (26, N, 2) in [0, 2**32)
        u1 = (h[:, :, 0] + 0.5) / 2.0**32  # (0, 1): the log is finite
        u2 = h[:, :, 1] / 2.0**32
        return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)

    def teacher_logits(self, dense: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """float64 ``(B,)`` teacher logits of dense ``(B, 13)`` and keys ``(26, B)``: ``TEACHER_BIAS +
        dense @ dense_weights + KEY_WEIGHT * sum_f w_f(key)``, the features added in order 0..25."""
        logit = dense.double() @ self.dense_weights + TEACHER_BIAS
        terms = KEY_WEIGHT * self.teacher_weights(keys)
        return torch.cat([logit.unsqueeze(0), terms]).cumsum(0)[-1]

    def raw_batch(self, split: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense ``(B, 13)``, raw keys ``(26, B)`` and labels ``(B,)`` of this rank at ``step`` of ``split``."""
        b, n = self.config.batch_size, self._keys_per_feature
        gen = torch.Generator().manual_seed(mix_seed(self.config.seed, _TAG_BATCH, split, step, self.rank))
        dense = torch.randn(b, NUM_DENSE, generator=gen)
        ranks = torch.stack([sample_zipf(n, a, b, gen) for a in self._alphas])
        keys = self.keys_of_ranks(ranks)
        p = torch.sigmoid(self.teacher_logits(dense, keys))
        labels = (torch.rand(b, generator=gen, dtype=torch.float64) < p).float()
        return dense, keys, labels

    def _batch(self, split: int, step: int) -> Batch:
        dense, keys, labels = self.raw_batch(split, step)
        return Batch(dense_features=dense, sparse_features=self._transform.to_kjt(FEATURES, keys), labels=labels)

    def eval_batch_count(self) -> int:
        return self.config.eval_batches

    def train_batches(self, start: int, stop: int) -> Iterator[Batch]:
        return (self._batch(SPLIT_TRAIN, step) for step in range(start, stop))

    def eval_batches(self) -> Iterator[Batch]:
        return (self._batch(SPLIT_EVAL, i) for i in range(self.config.eval_batches))
