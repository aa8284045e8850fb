"""The vectorized recipe data path against straightforward per-feature / per-slot references.

Batches must be bit-identical to a per-feature, per-slot loop (resume and two-pipeline
comparisons depend on it). The references below are independent of the code under test:
MurmurHash3's fmix32 written out on Python ints, and a loop over features and hash slots
calling ``hash_ids``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import random

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.recipes import config as config_module
from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data import base, hashing
from recpipe.recipes.data.base import BatchSource, IdTransform
from recpipe.recipes.data.hashing import (
    VirtualTableProjector,
    _hash_grid_numpy,
    _hash_grid_torch,
    hash_ids,
    hash_ids_grid,
    mix_seed,
)
from recpipe.recipes.data.registry import DATA_SOURCES, make_data_source
from recpipe.recipes.data.synthetic import NUM_SPARSE, SPARSE_WEIGHT

MASK32 = 0xFFFFFFFF


# ---------------------------------------------------------------- pure-Python reference
def ref_fmix32(h: int) -> int:
    """MurmurHash3's fmix32 on a Python int (smhasher's reference, written out)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) % 2**32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) % 2**32
    return h ^ (h >> 16)


def ref_hash(raw_id: int, seed: int) -> int:
    """``hash_ids`` of one id: fold the high 32 bits in, xor the seed, finalise."""
    lo, hi = raw_id & MASK32, (raw_id >> 32) & MASK32
    return ref_fmix32((lo ^ ref_fmix32(hi)) ^ (seed & MASK32))


def ref_values(ids: torch.Tensor, config: TrainConfig, rows: tuple[int, ...]) -> list[int]:
    """Values of the batch KJT: loop over features, samples and (for micro-DLRM) slots."""
    out: list[int] = []
    for f, feature_ids in enumerate(ids.tolist()):
        for raw in feature_ids:
            if config.model == "dlrm":
                out.append(raw % rows[f])
            else:
                for j in range(config.hash_k):
                    out.append(ref_hash(raw, mix_seed(config.seed, f, j)) % config.virtual_rows)
    return out


# ---------------------------------------------------------------- the replaced tensor code
def old_project(ids: torch.Tensor, feature: int, num_rows: int, k: int, seed: int) -> torch.Tensor:
    """``VirtualTableProjector.__call__`` as a loop (one hash per slot)."""
    cols = [hash_ids(ids, mix_seed(seed, feature, j)) % num_rows for j in range(k)]
    return torch.stack(cols, dim=1)


def old_to_kjt(
    config: TrainConfig, rows: tuple[int, ...], keys: tuple[str, ...], ids: torch.Tensor
) -> KeyedJaggedTensor:
    """``IdTransform.to_kjt`` as a loop over features."""
    num_f, batch = ids.shape
    if config.model != "micro_dlrm_dram":
        r = torch.stack([ids[f] % rows[f] for f in range(num_f)])
        lengths = torch.ones(num_f * batch, dtype=torch.int32)
    else:
        r = torch.stack([old_project(ids[f], f, config.virtual_rows, config.hash_k, config.seed) for f in range(num_f)])
        lengths = torch.full((num_f * batch,), config.hash_k, dtype=torch.int32)
    return KeyedJaggedTensor.from_lengths_sync(keys=list(keys), values=r.reshape(-1), lengths=lengths)


def old_hidden_logits(
    dense: torch.Tensor, ids: torch.Tensor, dense_w: torch.Tensor, bias: float, seed: int
) -> torch.Tensor:
    """``SyntheticCriteoSource.hidden_logits`` as a loop."""
    logit = dense.double() @ dense_w + bias
    for f in range(NUM_SPARSE):
        u = hash_ids(ids[f], mix_seed(seed, 0x1D, f)).double() / 2.0**32
        logit = logit + SPARSE_WEIGHT * (2.0 * u - 1.0)
    return logit


def assert_same_kjt(got: KeyedJaggedTensor, want: KeyedJaggedTensor) -> None:
    assert got.keys() == want.keys()
    assert got.values().dtype == want.values().dtype == torch.int64
    assert got.lengths().dtype == want.lengths().dtype == torch.int32
    assert torch.equal(got.values(), want.values())
    assert torch.equal(got.lengths(), want.lengths())
    assert got.stride() == want.stride()
    assert got.length_per_key() == want.length_per_key()
    assert got.offset_per_key() == want.offset_per_key()


# ---------------------------------------------------------------- hashing kernels
def _random_ids(rng: random.Random, shape: tuple[int, int]) -> torch.Tensor:
    """Ids of every magnitude: small, around 2**31 and 2**32, up to 2**63 - 1."""
    pool = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**63 - 1]
    vals = [
        rng.choice(pool) if rng.random() < 0.1 else rng.randrange(2 ** rng.choice((8, 20, 31, 32, 40, 63)))
        for _ in range(shape[0] * shape[1])
    ]
    return torch.tensor(vals, dtype=torch.int64).reshape(shape)


@pytest.mark.parametrize("modulus", [None, 1, 7, 1 << 20, 2**31 - 1, 2**32 - 1, 2**32, 2**40])
@pytest.mark.parametrize("kernel", [hash_ids_grid, _hash_grid_numpy, _hash_grid_torch])
def test_hash_grid_matches_pure_python(kernel, modulus: int | None) -> None:
    rng = random.Random(modulus or 0)
    ids = _random_ids(rng, (3, 97))
    seeds = torch.tensor([[rng.randrange(2**32) for _ in range(5)] for _ in range(3)], dtype=torch.int64)
    if kernel is not hash_ids_grid and modulus is not None and modulus >= 2**32:
        modulus = None  # the private kernels take an already-reduced modulus (hash_ids_grid's job)
    got = kernel(ids, seeds, modulus)
    assert got.shape == (3, 97, 5) and got.dtype == torch.int64
    m = modulus or 2**64
    want = [[[ref_hash(i, s) % m for s in seeds[f].tolist()] for i in ids[f].tolist()] for f in range(3)]
    assert got.tolist() == want


def test_hash_grid_equals_hash_ids_and_rejects_bad_input() -> None:
    ids = _random_ids(random.Random(5), (2, 300))
    seeds = torch.tensor([[mix_seed(9, f, j) for j in range(3)] for f in range(2)], dtype=torch.int64)
    grid = hash_ids_grid(ids, seeds)
    for f in range(2):
        for j in range(3):
            assert torch.equal(grid[f, :, j], hash_ids(ids[f], int(seeds[f, j])))
    # non-contiguous ids (a transposed view) and an empty batch
    assert torch.equal(hash_ids_grid(ids.t().contiguous().t(), seeds), grid)
    assert hash_ids_grid(ids[:, :0], seeds, 10).shape == (2, 0, 3)
    with pytest.raises(TypeError, match="int64"):
        hash_ids_grid(ids.int(), seeds)
    with pytest.raises(ValueError, match="share F"):
        hash_ids_grid(ids, seeds[:1])
    with pytest.raises(ValueError, match="modulus"):
        hash_ids_grid(ids, seeds, 0)


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("seed", [0, 3, 2**40 + 11])
def test_projector_matches_per_slot_loop(k: int, seed: int) -> None:
    num_rows = 1_048_576
    ids = _random_ids(random.Random(k * 31 + seed), (26, 64))
    proj = VirtualTableProjector(num_rows, k, seed)
    rows = proj.project(ids)
    assert rows.shape == (26, 64, k)
    for f in (0, 1, 13, 25):
        want = old_project(ids[f], f, num_rows, k, seed)
        assert torch.equal(rows[f], want)
        assert torch.equal(proj(ids[f], f), want)
        pure = [[ref_hash(i, mix_seed(seed, f, j)) % num_rows for j in range(k)] for i in ids[f].tolist()]
        assert rows[f].tolist() == pure
    # fewer features after more: the cached seeds are sliced, not recomputed wrongly
    assert torch.equal(proj.project(ids[:2]), rows[:2])
    assert proj.slot_seeds(3).tolist() == [[mix_seed(seed, f, j) for j in range(k)] for f in range(3)]


# ---------------------------------------------------------------- whole batches
def _configs() -> list[TrainConfig]:
    out = []
    for dataset in ("movielens100k", "synthetic"):
        for model in ("micro_dlrm_dram", "dlrm"):
            for seed, batch, k in ((0, 256, 4), (7, 33, 1), (12345, 1, 3)):
                out.append(
                    TrainConfig(
                        dataset=dataset,
                        model=model,
                        seed=seed,
                        batch_size=batch,
                        hash_k=k,
                        virtual_rows=1_048_576 if k == 4 else 65_521,
                        num_embeddings=100_000 if seed else 997,
                        max_steps=1000,
                    )
                )
    return out


def movielens_raw_ids(src: BatchSource, step: int) -> torch.Tensor:
    """Raw ``(user, item)`` ids of a MovieLens source's training batch, from its split."""
    epoch, i = divmod(step, src.steps_per_epoch)
    g, b = src._global_batch, src.config.batch_size
    rows = src._epoch_perm(epoch)[i * g : (i + 1) * g][src.rank * b : (src.rank + 1) * b]
    return src._ids[:, rows]


@pytest.mark.parametrize(
    "config", _configs(), ids=lambda c: f"{c.dataset}-{c.model}-s{c.seed}-b{c.batch_size}-k{c.hash_k}"
)
def test_batches_match_reference(config: TrainConfig) -> None:
    # Dense features and labels are compared with a dlrm source of the same data.
    raw_cfg = dataclasses.replace(config, model="dlrm")
    for world in (1, 2):
        for rank in range(world):
            src = make_data_source(config, rank, world)
            raw_src = make_data_source(raw_cfg, rank, world)
            keys = src.spec.feature_names
            rows = src._transform.rows
            spe = src.steps_per_epoch
            steps = [0, 5] + ([spe + 2] if spe else [311])
            for step in steps:
                batch = next(src.train_batches(step, step + 1))
                raw_batch = next(raw_src.train_batches(step, step + 1))
                if config.dataset == "movielens100k":
                    ids = movielens_raw_ids(src, step)
                else:
                    ids = src.raw_batch(0, step)[1]
                assert ids.shape == (len(keys), config.batch_size)
                kjt = batch.sparse_features
                per = config.hash_k if config.model == "micro_dlrm_dram" else 1
                assert kjt.keys() == list(keys)
                assert kjt.lengths().tolist() == [per] * (len(keys) * config.batch_size)
                assert kjt.values().tolist() == ref_values(ids, config, rows)
                assert_same_kjt(kjt, old_to_kjt(config, rows, keys, ids))
                # dense features and labels do not depend on the id transform
                assert torch.equal(batch.dense_features, raw_batch.dense_features)
                assert torch.equal(batch.labels, raw_batch.labels)


def test_eval_batches_match_reference() -> None:
    config = TrainConfig(seed=3, batch_size=128, hash_k=4, virtual_rows=1_048_576, eval_batches=3)
    src = make_data_source(config, 1, 2)
    raw = make_data_source(dataclasses.replace(config, model="dlrm"), 1, 2)
    assert raw._transform.rows == (944, 1683)  # every raw id is its own dlrm row
    n = 0
    for batch, raw_batch in zip(src.eval_batches(), raw.eval_batches()):
        ids = raw_batch.sparse_features.values().reshape(2, -1)
        assert batch.sparse_features.values().tolist() == ref_values(ids, config, src._transform.rows)
        n += 1
    assert n == 3


@pytest.mark.parametrize("seed", [0, 1, 99])
def test_synthetic_hidden_logits_match_feature_loop(seed: int) -> None:
    config = TrainConfig(dataset="synthetic", model="dlrm", seed=seed, batch_size=2048, max_steps=10)
    src = make_data_source(config, 0, 2)
    for step in (0, 3):
        dense, ids, _ = src.raw_batch(0, step)
        got = src.hidden_logits(dense, ids)
        want = old_hidden_logits(dense, ids, src._dense_w, src._bias, seed)
        assert got.dtype == torch.float64 and torch.equal(got, want)


def test_to_kjt_rejects_bad_ids() -> None:
    config = TrainConfig(batch_size=8)
    transform = IdTransform(config, make_data_source(config, 0, 1).spec)
    keys = ("user_id", "item_id")
    with pytest.raises(TypeError, match="int64"):
        transform.to_kjt(keys, torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="F = 2"):
        transform.to_kjt(keys, torch.zeros(3, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="F = 2"):
        transform.to_kjt(keys[:1], torch.zeros(1, 8, dtype=torch.int64))


# ---------------------------------------------------------------- registry / import graph
def test_registry_covers_every_dataset_and_base_imports_no_source() -> None:
    assert set(DATA_SOURCES) == set(config_module.field_choices()["dataset"])
    assert all(issubclass(cls, BatchSource) for cls in DATA_SOURCES.values())
    imported: set[str] = set()
    for module in (base, hashing):
        for node in ast.walk(ast.parse(inspect.getsource(module))):  # nested (lazy) imports too
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    for name in ("movielens", "synthetic", "criteo", "registry"):
        assert f"recpipe.recipes.data.{name}" not in imported
    config = TrainConfig(batch_size=8)
    config.dataset = "nope"  # bypasses validation on purpose
    with pytest.raises(ValueError, match="nope"):
        make_data_source(config, 0, 1)


@pytest.mark.parametrize("model", ["dlrm", "micro_dlrm_dram"])
def test_rows_of_then_kjt_of_rows_is_to_kjt(model: str) -> None:
    # MovieLens maps its whole dataset once with rows_of and gathers per batch.
    config = TrainConfig(model=model, seed=5, batch_size=64, hash_k=3, virtual_rows=1 << 16)
    src = make_data_source(config, 0, 2)
    transform = src._transform
    keys = src.spec.feature_names
    ids = movielens_raw_ids(src, 7)
    rows = transform.rows_of(ids)
    assert rows.shape == (len(keys), config.batch_size, transform.per_sample)
    assert transform.per_sample == (3 if model == "micro_dlrm_dram" else 1)
    assert_same_kjt(transform.kjt_of_rows(keys, rows), transform.to_kjt(keys, ids))
    assert_same_kjt(next(src.train_batches(7, 8)).sparse_features, transform.to_kjt(keys, ids))
    with pytest.raises(ValueError, match="kjt_of_rows"):
        transform.kjt_of_rows(keys, rows[:, :, :1] if transform.per_sample > 1 else rows.repeat(1, 1, 2))
    with pytest.raises(TypeError, match="int64"):
        transform.rows_of(ids.int())
