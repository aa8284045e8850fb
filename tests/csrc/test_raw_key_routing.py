"""hash_roundrobin over raw int64 keys (table size 0): the routing of dynamic tables.

The op, route_ids and hash_roundrobin_global_ids against the pure-Python reference
(harness.routing_reference: H of the whole 64-bit range in Python ints), opcheck and
fake kernels, balance of aliased keys, and the errors where table size 0 stays invalid.
"""

from __future__ import annotations

import random

import pytest
import torch
from harness.routing_reference import M64, RAW_KEYS, RefPermutation, ref_bucketize, route_one
from torch._subclasses.fake_tensor import FakeTensorMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.pipeline.routing import ops
from recpipe.pipeline.routing.kjt import bucketize_kjt

OP = torch.ops.recpipe.block_bucketize_sparse_features
HASH = 2
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
CUDA = torch.cuda.is_available()


@pytest.fixture(params=["baseline", "avx2", "avx512"])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Forces RECPIPE_ISA (the hash loop's build); skips one this CPU or this extension lacks."""
    monkeypatch.setenv("RECPIPE_ISA", request.param)
    try:
        ops.block_bucketize_sparse_features(
            torch.tensor([1]),
            torch.tensor([3]),
            torch.tensor([1]),
            torch.tensor([HASH]),
            2,
            table_sizes=torch.tensor([0]),
        )
    except RuntimeError as e:
        if "this CPU lacks it" in str(e) or "this build is portable" in str(e):
            pytest.skip(str(e))
        raise
    return request.param


def _keys(rng: random.Random, n: int, bits: int) -> list[int]:
    """n random signed keys of the width, with the edge values (min, max, 0, -1) first."""
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    edges = [lo, hi, 0, -1, 1, lo + 1, hi - 1]
    small = [rng.randrange(-1000, 1000) for _ in range(n // 4)]  # dense around 0, negatives too
    return edges + small + [rng.randrange(lo, hi + 1) for _ in range(n - len(edges) - len(small))]


def _bags(rng: random.Random, n: int, bags: int) -> list[int]:
    """Lengths of `bags` bags summing to n."""
    cuts = sorted(rng.randrange(n + 1) for _ in range(bags - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [n])]


def _check(got: ops.BucketizeResult, want: dict) -> None:
    assert got.new_lengths.tolist() == want["new_lengths"]
    assert got.new_indices.tolist() == want["new_indices"]
    assert got.unbucketize_permute is not None and got.unbucketize_permute.tolist() == want["unbucketize_permute"]
    assert got.bucket_mapping is not None and got.bucket_mapping.tolist() == want["bucket_mapping"]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("W", [1, 2, 3, 8])
def test_raw_keys_match_reference(isa: str, index_dtype: torch.dtype, W: int) -> None:
    """Any key of the index width (negatives, min / max, 0, -1) routes as the reference's
    64-bit H; int32 keys read as uint32 (keep_orig_idx: local ids are the keys)."""
    bits = 32 if index_dtype == torch.int32 else 64
    rng = random.Random(W * 7 + bits)
    keys = _keys(rng, 3000, bits)
    lengths = _bags(rng, len(keys), 12)
    seed = rng.randrange(INT64_MIN, INT64_MAX + 1)
    for keep in (True, False) if bits == 64 else (True,):  # int32 needs keep (see the errors test)
        got = ops.block_bucketize_sparse_features(
            torch.tensor(lengths),
            torch.tensor(keys, dtype=index_dtype),
            torch.tensor([1]),
            torch.tensor([HASH]),
            W,
            sequence=True,
            table_sizes=torch.tensor([0]),
            seed=seed,
            keep_orig_idx=keep,
            return_bucket_mapping=True,
        )
        want = ref_bucketize(
            lengths,
            keys,
            [1],
            [HASH],
            W,
            sequence=True,
            table_sizes=[0],
            seed=seed,
            keep_orig_idx=keep,
            index_bits=bits,
            return_bucket_mapping=True,
        )
        assert got.new_indices.dtype == index_dtype
        _check(got, want)
        if keep:
            assert sorted(got.new_indices.tolist()) == sorted(keys)


def test_reference_raw_h_is_the_full_width_case_of_h() -> None:
    """The reference's H of 2^64 ids: c = 64, one window, shift 32, a bijection whose
    inverse undoes it (independent of the kernels: pins the reference itself)."""
    p = RefPermutation(RAW_KEYS, 11)
    assert (p.h, p.hi, p.mask, p.s) == (RAW_KEYS, 0, M64, 32)
    rng = random.Random(3)
    xs = [0, 1, M64, 2**63, 2**63 - 1] + [rng.randrange(RAW_KEYS) for _ in range(200)]
    ys = [p.forward(x) for x in xs]
    assert len(set(ys)) == len(xs) and all(0 <= y < RAW_KEYS for y in ys)
    assert [p.inverse(y) for y in ys] == xs


def test_keep_per_feature_mixes_raw_and_normal_features(isa: str) -> None:
    """A raw-key feature keeping its keys beside a normal hash feature (dense local ids)
    and a continuous one: op and bucketize_kjt against the reference."""
    rng = random.Random(5)
    W, B, seed = 3, 4, 77
    raw = _keys(rng, 60, 64)
    normal = [rng.randrange(1000) for _ in range(40)]
    cont = [rng.randrange(90) for _ in range(30)]
    lengths = _bags(rng, len(raw), B) + _bags(rng, len(normal), B) + _bags(rng, len(cont), B)
    indices = raw + normal + cont
    dist, sizes, blocks, keep = [HASH, HASH, 0], [0, 1000, 90], [1, 334, 30], [True, False, False]
    got = ops.block_bucketize_sparse_features(
        torch.tensor(lengths),
        torch.tensor(indices),
        torch.tensor(blocks),
        torch.tensor(dist),
        W,
        sequence=True,
        table_sizes=torch.tensor(sizes),
        seed=seed,
        keep_orig_idx_per_feature=torch.tensor(keep),
        return_bucket_mapping=True,
    )
    want = ref_bucketize(
        lengths,
        indices,
        blocks,
        dist,
        W,
        sequence=True,
        table_sizes=sizes,
        seed=seed,
        keep_orig_idx_per_feature=keep,
        return_bucket_mapping=True,
    )
    _check(got, want)
    kjt = KeyedJaggedTensor(keys=["raw", "normal", "cont"], values=torch.tensor(indices), lengths=torch.tensor(lengths))
    out, permute = bucketize_kjt(
        kjt,
        W,
        {"raw": "hash_roundrobin", "normal": "hash_roundrobin", "cont": "continuous"},
        {"raw": 0, "normal": 1000, "cont": 90},
        seed=seed,
        sequence=True,
        keep_orig_idx_per_feature={"raw": True},
    )
    assert out.keys() == ["raw", "normal", "cont"] * W
    assert out.lengths().tolist() == want["new_lengths"]
    assert out.values().tolist() == want["new_indices"]
    assert permute is not None and permute.tolist() == want["unbucketize_permute"]


@pytest.mark.parametrize("W", [1, 2, 3, 8])
def test_route_ids_match_reference_and_global_ids_invert_them(W: int) -> None:
    """route_ids(table_size=0) routes as the reference and as the op's bucket mapping;
    hash_roundrobin_global_ids(table_size=0) gives every key back (W = 1: local ids past
    2^63 - 1 travel as their int64 bit pattern)."""
    rng = random.Random(W)
    keys = _keys(rng, 2000, 64)
    seed = -12345
    ids = torch.tensor(keys)
    owner, local = ops.route_ids(ids, 0, W, "hash_roundrobin", seed)
    want = [route_one(k, HASH, W, 1, 0, seed, 64) for k in keys]
    assert owner.tolist() == [o for o, _ in want]
    assert [v & M64 for v in local.tolist()] == [loc for _, loc in want]
    mapped = ops.block_bucketize_sparse_features(
        torch.tensor([len(keys)]),
        ids,
        torch.tensor([1]),
        torch.tensor([HASH]),
        W,
        table_sizes=torch.tensor([0]),
        seed=seed,
        return_bucket_mapping=True,
    ).bucket_mapping
    assert mapped is not None and torch.equal(mapped, owner)
    back = ops.hash_roundrobin_global_ids(owner, local, 0, W, seed)
    assert back.dtype == torch.int64 and torch.equal(back, ids)
    # the inverse on slots the routing never produced from these keys, against the reference
    perm = RefPermutation(RAW_KEYS, seed)
    ranks = [rng.randrange(W) for _ in range(200)]
    locs = [rng.randrange((RAW_KEYS - 1 - r) // W + 1) for r in ranks]
    got = ops.hash_roundrobin_global_ids(
        torch.tensor(ranks), torch.tensor([v - RAW_KEYS if v > INT64_MAX else v for v in locs]), 0, W, seed
    )
    signed = [(k - RAW_KEYS if k > INT64_MAX else k) for k in (perm.inverse(v * W + r) for r, v in zip(ranks, locs))]
    assert got.tolist() == signed


def test_opcheck_raw_key_calls() -> None:
    """opcheck (schema, fake kernel, autograd registration) of the three ops on raw keys."""
    keys = torch.tensor([INT64_MIN, -1, 0, 5, INT64_MAX, 2**40 + 3])
    args = (
        torch.tensor([3, 3, 0, 1]),
        torch.cat([keys, torch.tensor([7])]),
        torch.tensor([1, 4]),
        torch.tensor([HASH, 0]),
        3,
        True,
        True,
        torch.rand(7),
        torch.tensor([0, 12]),
        9,
        False,
        None,
        -1,
        None,
        None,
        torch.tensor([True, False]),
        True,
    )
    torch.library.opcheck(OP, args)
    torch.library.opcheck(torch.ops.recpipe.route_ids.default, (keys, 0, 3, HASH, 9))
    owner, local = torch.ops.recpipe.route_ids(keys, 0, 3, HASH, 9)
    torch.library.opcheck(torch.ops.recpipe.hash_roundrobin_global_ids, (owner, local, 0, 3, 9))


def test_fake_kernels_accept_raw_keys_and_give_the_kernels_shapes() -> None:
    mode = FakeTensorMode()
    with mode:
        lengths, keys = torch.empty(6, dtype=torch.int64), torch.empty(40, dtype=torch.int64)
        out = OP(
            lengths,
            keys,
            torch.ones(2, dtype=torch.int64),
            torch.tensor([HASH, HASH]),
            4,
            True,
            False,
            None,
            torch.tensor([0, 0]),
            0,
            False,
            None,
            -1,
            None,
            None,
            torch.tensor([True, False]),
            True,
        )
        assert out[0].shape == (24,) and out[1].shape == (40,) and out[1].dtype == torch.int64
        assert out[4] is not None and out[4].shape == (40,) and out[5] is not None and out[5].shape == (40,)
        owner, local = torch.ops.recpipe.route_ids(torch.empty(5, 2, dtype=torch.int64), 0, 3, HASH, 1)
        assert owner.shape == local.shape == (5, 2) and owner.dtype == local.dtype == torch.int64
        back = torch.ops.recpipe.hash_roundrobin_global_ids(owner.view(-1), local.view(-1), 0, 3, 1)
        assert back.shape == (10,) and back.dtype == torch.int64
        with pytest.raises(RuntimeError, match=r"0 \(raw int64 keys, any value\) is accepted by hash_roundrobin"):
            torch.ops.recpipe.route_ids(torch.empty(2, dtype=torch.int64), 0, 3, 1, 1)
        with pytest.raises(RuntimeError, match=r"`ids` are int32 but hash_roundrobin over raw keys"):
            torch.ops.recpipe.route_ids(torch.empty(2, dtype=torch.int32), 0, 3, HASH, 1)
        with pytest.raises(RuntimeError, match=r"`local_ids` are int32 but raw keys \(`table_size` = 0\)"):
            torch.ops.recpipe.hash_roundrobin_global_ids(
                torch.empty(2, dtype=torch.int64), torch.empty(2, dtype=torch.int32), 0, 3
            )


def _max_over_mean(owner: torch.Tensor, W: int) -> float:
    c = torch.bincount(owner, minlength=W).double()
    return float(c.max() / c.mean())


@pytest.mark.parametrize("W", [2, 3, 8, 64])
@pytest.mark.parametrize("pattern", ["sequential", "stride_2^32", "negative_sequential"])
def test_raw_keys_balance_aliased_patterns(W: int, pattern: str) -> None:
    """1e6 keys in a run, or at stride 2^32 (only the high word varies): max / mean owner
    load <= 1.05 (a uniform owner gives about 1 + 2.4 * sqrt(W / 1e6) for 64 ranks)."""
    k = torch.arange(1_000_000, dtype=torch.int64)
    keys = {"sequential": k, "stride_2^32": k << 32, "negative_sequential": -1 - k}[pattern]
    owner, _ = ops.route_ids(keys, 0, W, "hash_roundrobin", seed=0)
    assert _max_over_mean(owner, W) <= 1.05
    counts = ops.block_bucketize_sparse_features(
        torch.tensor([keys.numel()]),
        keys,
        torch.tensor([1]),
        torch.tensor([HASH]),
        W,
        table_sizes=torch.tensor([0]),
        keep_orig_idx=True,
    ).new_lengths
    assert torch.equal(counts, torch.bincount(owner, minlength=W))


def test_raw_key_errors_name_the_argument() -> None:
    """Table size 0 stays refused where it has no meaning, and raw keys need int64 where the
    local ids are H(key) / W."""
    for dist in ("roundrobin", "continuous"):
        with pytest.raises(
            RuntimeError,
            match=rf"`table_size` must be >= 1 \(the table's row count\), got 0 for a {dist} table; 0 \(raw int64 "
            r"keys, any value\) is accepted by hash_roundrobin \(dist_type 2\) only",
        ):
            ops.route_ids(torch.tensor([1]), 0, 2, dist)
    with pytest.raises(RuntimeError, match=r"`ids` are int32 but hash_roundrobin over raw keys \(`table_size` = 0\)"):
        ops.route_ids(torch.tensor([1], dtype=torch.int32), 0, 2, "hash_roundrobin")
    with pytest.raises(RuntimeError, match=r"`table_sizes\[0\]` is -1 but feature 0 is hash_roundrobin.*or 0 for raw"):
        OP(
            torch.tensor([1]),
            torch.tensor([3]),
            torch.tensor([1]),
            torch.tensor([HASH]),
            2,
            table_sizes=torch.tensor([-1]),
        )
    with pytest.raises(
        RuntimeError,
        match=r"feature 0 is hash_roundrobin over raw keys \(`table_sizes\[0\]` = 0\) and 2 ranks, so its local ids "
        r"H\(key\) / W reach 9223372036854775807, which int32 `indices` cannot hold",
    ):
        OP(
            torch.tensor([1]),
            torch.tensor([3], dtype=torch.int32),
            torch.tensor([1]),
            torch.tensor([HASH]),
            2,
            table_sizes=torch.tensor([0]),
        )
    gid = ops.hash_roundrobin_global_ids
    with pytest.raises(RuntimeError, match=r"`table_size` must be >= 1 \(the table's row count\), or 0 for raw"):
        gid(torch.tensor([0]), torch.tensor([0]), -1, 2)
    with pytest.raises(RuntimeError, match=r"`local_ids` are int32 but raw keys"):
        gid(torch.tensor([0]), torch.tensor([0], dtype=torch.int32), 0, 2)
    # slots past 2^64: rank outside [0, W), or local * W + rank >= 2^64 (never a wrapped key)
    with pytest.raises(RuntimeError, match=r"\(3, 0\) is not a slot of a table of 0 rows over 3 ranks"):
        gid(torch.tensor([3]), torch.tensor([0]), 0, 3)
    with pytest.raises(RuntimeError, match=r"is not a slot"):
        gid(torch.tensor([1]), torch.tensor([(2**64 - 1) // 3]), 0, 3)  # 3 * local + 1 = 2^64
    with pytest.raises(RuntimeError, match=r"is not a slot"):
        gid(torch.tensor([0]), torch.tensor([-1]), 0, 2)  # local read as 2^64 - 1
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([4]), lengths=torch.tensor([1]))
    for dist in ("roundrobin", "continuous"):
        with pytest.raises(
            ValueError,
            match=rf"or 0 for a hash_roundrobin feature of raw int64 keys, got \{{'a': 0\}} "
            rf"\(dist types \{{'a': '{dist}'\}}\)",
        ):
            bucketize_kjt(kjt, 2, {"a": dist}, {"a": 0})
    with pytest.raises(ValueError, match=r"`keep_orig_idx_per_feature` names features \['b'\] the KJT does not have"):
        bucketize_kjt(kjt, 2, {"a": "hash_roundrobin"}, {"a": 0}, keep_orig_idx_per_feature={"b": True})
    with pytest.raises(ValueError, match=r"`keep_orig_idx_per_feature` values must be bools, got \{'a': 1\}"):
        bucketize_kjt(kjt, 2, {"a": "hash_roundrobin"}, {"a": 0}, keep_orig_idx_per_feature={"a": 1})


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("W", [1, 3, 8])
def test_cuda_raw_keys_match_cpu(W: int) -> None:
    """The CUDA kernels route raw keys bit for bit as the CPU kernels (same header math)."""
    rng = random.Random(W)
    keys = torch.tensor(_keys(rng, 5000, 64))
    lengths = torch.tensor(_bags(rng, keys.numel(), 16))
    for keep in (True, False):
        args = (torch.tensor([1]), torch.tensor([HASH]), W)
        kw = dict(sequence=True, table_sizes=torch.tensor([0]), seed=3, keep_orig_idx=keep, return_bucket_mapping=True)
        cpu = ops.block_bucketize_sparse_features(lengths, keys, *args, **kw)
        gpu = ops.block_bucketize_sparse_features(lengths.cuda(), keys.cuda(), *args, **kw)
        for a, b in zip(cpu, gpu):
            assert (a is None and b is None) or torch.equal(a, b.cpu())
    owner, local = ops.route_ids(keys.cuda(), 0, W, "hash_roundrobin", 3)
    want_owner, want_local = ops.route_ids(keys, 0, W, "hash_roundrobin", 3)
    assert torch.equal(owner.cpu(), want_owner) and torch.equal(local.cpu(), want_local)
    assert torch.equal(ops.hash_roundrobin_global_ids(owner, local, 0, W, 3).cpu(), keys)
