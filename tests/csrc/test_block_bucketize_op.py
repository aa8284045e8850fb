"""torch.ops.recpipe.block_bucketize_sparse_features: parity, opcheck, fake shapes, errors."""

from __future__ import annotations

import random
from typing import Optional

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm.*)
import pytest
import torch
from harness.routing_reference import DIST_CODES, ROUTING_VERSION, RefPermutation, ref_bucketize, route_one
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.pipeline.routing import ops
from recpipe.pipeline.routing.kjt import bucketize_kjt
from recpipe.pipeline.routing.rows import global_row_ids, shard_num_rows

OP = torch.ops.recpipe.block_bucketize_sparse_features
CUDA = torch.cuda.is_available()


def _random_case(
    rng: random.Random,
    F: int,
    B: int,
    W: int,
    *,
    dist: Optional[list[int]] = None,
    max_len: int = 5,
    index_dtype: torch.dtype = torch.int64,
    length_dtype: torch.dtype = torch.int64,
    raw_ids: bool = False,
) -> dict:
    dist_types = dist if dist is not None else [rng.randrange(3) for _ in range(F)]
    table_sizes = [rng.choice([1, 2, 3, 7, 64, 1000, 50_000]) for _ in range(F)]
    block_sizes = [max(1, -(-n // W)) for n in table_sizes]
    lengths = [rng.randrange(max_len + 1) for _ in range(F * B)]
    if raw_ids:
        # a roundrobin feature of raw ids declares no table size (0): the op checks the
        # ids of roundrobin features whose size is given
        table_sizes = [0 if d == 1 else n for d, n in zip(dist_types, table_sizes)]
    indices: list[int] = []
    for bt, ln in enumerate(lengths):
        f = bt // B
        n = table_sizes[f] or 50_000
        for _ in range(ln):
            if dist_types[f] != 2 and raw_ids and rng.random() < 0.3:
                # raw ids beyond block * W, and negative raw ids (fbgemm's unsigned path)
                hi = 2**31 - 1 if index_dtype == torch.int32 else 2**40
                indices.append(rng.randrange(-hi, hi))
            else:
                indices.append(rng.randrange(n))
    return dict(
        lengths=torch.tensor(lengths, dtype=length_dtype),
        indices=torch.tensor(indices, dtype=index_dtype),
        block_sizes=torch.tensor(block_sizes, dtype=torch.int64),
        dist_types=torch.tensor(dist_types, dtype=torch.int64),
        table_sizes=torch.tensor(table_sizes, dtype=torch.int64),
        W=W,
    )


def _check_against_reference(case: dict, *, sequence: bool, pos: bool, weights_dtype, seed: int, keep: bool) -> None:
    n = case["indices"].numel()
    weights = None
    if weights_dtype is not None:
        weights = torch.randn(n, dtype=torch.float64).to(weights_dtype)
    got = ops.block_bucketize_sparse_features(
        case["lengths"],
        case["indices"],
        case["block_sizes"],
        case["dist_types"],
        case["W"],
        sequence=sequence,
        bucketize_pos=pos,
        weights=weights,
        table_sizes=case["table_sizes"],
        seed=seed,
        keep_orig_idx=keep,
    )
    want = ref_bucketize(
        case["lengths"].tolist(),
        case["indices"].tolist(),
        case["block_sizes"].tolist(),
        case["dist_types"].tolist(),
        case["W"],
        sequence=sequence,
        bucketize_pos=pos,
        weights=weights.tolist() if weights is not None else None,
        table_sizes=case["table_sizes"].tolist(),
        seed=seed,
        keep_orig_idx=keep,
        index_bits=32 if case["indices"].dtype == torch.int32 else 64,
    )
    assert got.new_lengths.dtype == case["lengths"].dtype
    assert got.new_indices.dtype == case["indices"].dtype
    assert got.new_lengths.tolist() == want["new_lengths"]
    assert got.new_indices.tolist() == want["new_indices"]
    if weights is None:
        assert got.new_weights is None
    else:
        assert got.new_weights is not None and got.new_weights.dtype == weights.dtype
        assert got.new_weights.tolist() == want["new_weights"]
    if pos:
        assert got.new_pos is not None and got.new_pos.tolist() == want["new_pos"]
    else:
        assert got.new_pos is None
    if sequence:
        assert got.unbucketize_permute is not None
        assert got.unbucketize_permute.tolist() == want["unbucketize_permute"]
    else:
        assert got.unbucketize_permute is None


# ---------------------------------------------------------------------------
# Parity with the pure-Python reference (all modes)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    F=st.integers(1, 6),
    B=st.integers(0, 12),
    W=st.integers(1, 64),
    seed=st.integers(0, 2**63 - 1),
    sequence=st.booleans(),
    pos=st.booleans(),
    keep=st.booleans(),
    weights_dtype=st.sampled_from([None, torch.float32, torch.float64, torch.float16, torch.bfloat16]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    length_dtype=st.sampled_from([torch.int32, torch.int64]),
    case_seed=st.integers(0, 2**32),
)
def test_matches_python_reference(
    F, B, W, seed, sequence, pos, keep, weights_dtype, index_dtype, length_dtype, case_seed
) -> None:
    case = _random_case(
        random.Random(case_seed), F, B, W, index_dtype=index_dtype, length_dtype=length_dtype, raw_ids=True
    )
    _check_against_reference(case, sequence=sequence, pos=pos, weights_dtype=weights_dtype, seed=seed, keep=keep)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    F=st.integers(1, 5),
    W=st.integers(1, 20),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    weights_dim=st.sampled_from([None, 0, 1, 3]),  # None: no weights; 0: [n]; D: [n, D]
    sequence=st.booleans(),
    pos=st.booleans(),
    mapping=st.booleans(),
    case_seed=st.integers(0, 2**32),
)
def test_vbe_keep_per_feature_2d_weights_mapping_match_reference(
    F, W, index_dtype, weights_dim, sequence, pos, mapping, case_seed
) -> None:
    """Every distribution type with a variable batch per feature, keep_orig_idx per
    feature, [n, D] weights and the bucket mapping, against the reference."""
    rng = random.Random(case_seed)
    batch = [rng.randrange(0, 9) for _ in range(F)]
    dist = [rng.randrange(3) for _ in range(F)]
    sizes = [rng.choice([1, 5, 64, 1000, 50_000]) for _ in range(F)]
    lengths = [rng.randrange(0, 6) for f in range(F) for _ in range(batch[f])]
    feature_of_bag = [f for f in range(F) for _ in range(batch[f])]
    indices = [rng.randrange(sizes[f]) for bt, f in enumerate(feature_of_bag) for _ in range(lengths[bt])]
    keep = [rng.random() < 0.4 for _ in range(F)]
    n = len(indices)
    w = None
    if weights_dim is not None:
        w = (
            torch.randn(n, dtype=torch.float64)
            if weights_dim == 0
            else torch.randn(n, weights_dim, dtype=torch.float64)
        )
    got = ops.block_bucketize_sparse_features(
        torch.tensor(lengths, dtype=torch.int64),
        torch.tensor(indices, dtype=index_dtype),
        torch.tensor([max(1, -(-m // W)) for m in sizes]),
        torch.tensor(dist),
        W,
        sequence=sequence,
        bucketize_pos=pos,
        weights=w,
        table_sizes=torch.tensor(sizes),
        seed=3,
        batch_size_per_feature=torch.tensor(batch),
        keep_orig_idx_per_feature=torch.tensor(keep),
        return_bucket_mapping=mapping,
    )
    want = ref_bucketize(
        lengths,
        indices,
        [max(1, -(-m // W)) for m in sizes],
        dist,
        W,
        sequence=sequence,
        bucketize_pos=pos,
        weights=w.tolist() if w is not None else None,
        table_sizes=sizes,
        seed=3,
        index_bits=32 if index_dtype == torch.int32 else 64,
        batch_size_per_feature=batch,
        keep_orig_idx_per_feature=keep,
        return_bucket_mapping=mapping,
    )
    for name in got._fields:
        g, r = getattr(got, name), want[name]
        assert (g is None) == (r is None), name
        if r is not None:
            assert g.tolist() == r, name
    if w is not None:
        assert got.new_weights.shape == w.shape


@pytest.mark.parametrize("threads", [1, 2])
def test_large_input_multithreaded_matches_reference(threads: int) -> None:
    """Above the threading threshold (64k ids per chunk) the chunked kernel must agree too."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = random.Random(7)
        case = _random_case(rng, 3, 6000, 5, dist=[0, 1, 2], max_len=30)
        _check_against_reference(case, sequence=True, pos=True, weights_dtype=torch.float32, seed=11, keep=False)
    finally:
        torch.set_num_threads(old)


# ---------------------------------------------------------------------------
# Edge cases against the reference: hash windows of every width, world sizes,
# bag lengths, raw ids around block * W, long same-rank runs.


def _hash_case(
    rng: random.Random, W: int, index_dtype: torch.dtype, table_sizes: list[int], B: int, max_len: int
) -> dict:
    F = len(table_sizes)
    lengths = [rng.randrange(max_len + 1) for _ in range(F * B)]
    hi = 2**31 - 1 if index_dtype == torch.int32 else 2**63 - 1
    indices = [rng.randrange(min(table_sizes[bt // B], hi)) for bt, ln in enumerate(lengths) for _ in range(ln)]
    return dict(
        lengths=torch.tensor(lengths, dtype=torch.int64),
        indices=torch.tensor(indices, dtype=index_dtype),
        block_sizes=torch.tensor([max(1, -(-n // W)) for n in table_sizes], dtype=torch.int64),
        dist_types=torch.tensor([2] * F, dtype=torch.int64),
        table_sizes=torch.tensor(table_sizes, dtype=torch.int64),
        W=W,
    )


# The hash keys of a run of ids are computed by one loop compiled for AVX-512,
# AVX2 and baseline x86-64 (RECPIPE_ISA picks one): each build must give the same
# outputs; the tests below run every build this CPU has. The portable build
# (recpipe._C.CPU_DISPATCH == "portable") compiles the baseline loop only.
ISAS = ["baseline", "avx2", "avx512"]


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Forces RECPIPE_ISA for the test; skips a build this CPU or this extension cannot run."""
    monkeypatch.setenv("RECPIPE_ISA", request.param)
    probe = _random_case(random.Random(0), 1, 2, 2, dist=[2])
    try:
        OP(
            *_args(
                lengths=probe["lengths"],
                indices=probe["indices"],
                block_sizes=probe["block_sizes"],
                dist_types=probe["dist_types"],
                table_sizes=probe["table_sizes"],
                my_size=2,
            )
        )
    except RuntimeError as e:
        if "this CPU lacks it" in str(e) or "this build is portable" in str(e):
            pytest.skip(str(e))
        raise
    return request.param


def test_isa_env_rejects_unknown_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECPIPE_ISA", "sse9")
    with pytest.raises(RuntimeError, match=r"RECPIPE_ISA is 'sse9'; it must be one of auto, avx512, avx2, baseline"):
        OP(*_args())


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
# W: 1, powers of two, others, and a world larger than 2^16
@pytest.mark.parametrize("W", [1, 2, 7, 64, 100, 300, 70_000])
def test_hash_windows_match_reference(isa: str, index_dtype: torch.dtype, W: int) -> None:
    rng = random.Random(W * 31 + (index_dtype == torch.int32))
    # windows of c = 1..40 bits: n = 2^k one window, n = 2^k + 1 a second window at 1,
    # n = 2^k - 1 windows that overlap in one id, 3 * 2^30 a second window from 2^30.
    sizes = [1, 2, 3, 1000, 2**20 + 1, 2**31 - 1, 2**31, 3 * 2**30, 2**32]
    if index_dtype == torch.int64:
        sizes += [2**32 + 1, 2**40]
    else:  # int32 ids hold local ids up to 2^31 - 1: larger tables are refused (tested below)
        sizes = [n for n in sizes if (n - 1) // W < 2**31]
    B = 3
    if W > 65536:  # new_lengths is W * F * B long, keep the reference quick
        sizes, B = sizes[4:], 1
    case = _hash_case(rng, W, index_dtype, sizes, B=B, max_len=1100)
    _check_against_reference(
        case, sequence=True, pos=True, weights_dtype=torch.float32, seed=rng.randrange(2**63), keep=False
    )


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_mixed_features_match_reference(isa: str, index_dtype: torch.dtype) -> None:
    """continuous/roundrobin features (raw ids >= 2^32 and negative) next to hash
    features, against the reference."""
    rng = random.Random(17)
    for W in (3, 8):
        case = _random_case(rng, 4, 200, W, dist=[2, 0, 2, 1], max_len=40, raw_ids=True, index_dtype=index_dtype)
        _check_against_reference(case, sequence=True, pos=False, weights_dtype=None, seed=5, keep=False)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("W", [2, 5, 64])
def test_continuous_long_bags_bit_identical_to_fbgemm(index_dtype: torch.dtype, W: int) -> None:
    case = _random_case(random.Random(W), 3, 150, W, dist=[0, 0, 0], max_len=40, index_dtype=index_dtype, raw_ids=True)
    lengths = case["lengths"].to(index_dtype)
    block_sizes = case["block_sizes"].to(index_dtype)
    want = torch.ops.fbgemm.block_bucketize_sparse_features(lengths, case["indices"], True, True, block_sizes, W, None)
    got = ops.block_bucketize_sparse_features(
        lengths, case["indices"], block_sizes, case["dist_types"], W, sequence=True, bucketize_pos=True
    )
    for name, g, w in zip(got._fields, got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert torch.equal(g, w), name


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("where", [0, 7, 15, 16, 511, 512, 700, 866])
@pytest.mark.parametrize("value", [-1, 1000, -(2**31)])
def test_report_first_bad_id(isa: str, index_dtype: torch.dtype, where: int, value: int) -> None:
    """The first out-of-range id is the one reported, wherever it sits (the last ids
    included) and whatever bad id follows it."""
    n = 870
    ids = torch.arange(n, dtype=index_dtype) % 1000
    ids[where] = value
    ids[min(where + 50, n - 1)] = 5000  # a later bad id must not be the one reported
    args = _args(
        lengths=torch.tensor([n]),
        indices=ids,
        block_sizes=torch.tensor([500]),
        dist_types=torch.tensor([2]),
        table_sizes=torch.tensor([1000]),
        my_size=2,
    )
    with pytest.raises(IndexError, match=rf"`indices\[{where}\]` = {value} \(feature 0, hash_roundrobin\)"):
        OP(*args)


@pytest.mark.parametrize("threads", [1, 2])
def test_first_bad_id_reported_across_chunks(threads: int) -> None:
    """With several threads the bags are cut into chunks taken in any order; the
    error still names the first out-of-range id of the input."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 300_000  # > 64k ids per thread: chunked
        ids = torch.arange(n, dtype=torch.int64) % 1000
        ids[150_001] = 1000
        ids[290_000] = -5
        args = _args(
            lengths=torch.full((3000,), n // 3000),
            indices=ids,
            block_sizes=torch.tensor([500]),
            dist_types=torch.tensor([2]),
            table_sizes=torch.tensor([1000]),
            my_size=2,
        )
        with pytest.raises(IndexError, match=r"`indices\[150001\]` = 1000 \(feature 0"):
            OP(*args)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("W", [3, 8, 200])
def test_owners_large_blocks_match_reference(W: int) -> None:
    """continuous owners where block * W passes 2^32 or sits just under it, next
    to a small block and roundrobin; ids below and above 2^32 and negative."""
    rng = random.Random(W)
    blocks = [2**31, (2**32 - 1) // W, 1000, 7]
    dist = [0, 0, 0, 1]
    B = 40
    lengths = [rng.randrange(0, 70) for _ in range(len(blocks) * B)]
    indices = []
    for bt, ln in enumerate(lengths):
        blk = blocks[bt // B]
        for _ in range(ln):
            r = rng.random()
            indices.append(
                rng.randrange(2**32)
                if r < 0.85
                else rng.randrange(2**32, 2**40)
                if r < 0.95
                else rng.randrange(blk * W - 3, blk * W + 3)
                if r < 0.98
                else -rng.randrange(1, 2**40)
            )
    case = dict(
        lengths=torch.tensor(lengths),
        indices=torch.tensor(indices, dtype=torch.int64),
        block_sizes=torch.tensor(blocks),
        dist_types=torch.tensor(dist),
        W=W,
        table_sizes=torch.tensor([1, 1, 1, 0]),
    )  # 0: the roundrobin raw ids are unchecked
    _check_against_reference(case, sequence=True, pos=False, weights_dtype=None, seed=0, keep=False)


def _partition_case(rng: random.Random, W: int, index_dtype: torch.dtype, B: int, max_len: int) -> dict:
    """Features continuous, roundrobin, hash over a 10M-row table and (int64) hash
    over a 2^40-row table (64-bit local ids); continuous/roundrobin carry raw
    ids >= block * W, >= 2^32 and negative."""
    sizes = [50_000, 1000, 10_000_000] + ([2**40] if index_dtype == torch.int64 else [])
    dist = [0, 1, 2] + ([2] if index_dtype == torch.int64 else [])
    hi = 2**31 - 1 if index_dtype == torch.int32 else 2**40
    lengths = [rng.randrange(max_len + 1) for _ in range(len(sizes) * B)]
    indices = []
    for bt, ln in enumerate(lengths):
        f = bt // B
        for _ in range(ln):
            raw = dist[f] != 2 and rng.random() < 0.2
            indices.append(rng.randrange(-hi, hi) if raw else rng.randrange(min(sizes[f], hi)))
    return dict(
        lengths=torch.tensor(lengths, dtype=torch.int64),
        indices=torch.tensor(indices, dtype=index_dtype),
        block_sizes=torch.tensor([max(1, -(-n // W)) for n in sizes], dtype=torch.int64),
        dist_types=torch.tensor(dist, dtype=torch.int64),
        # 0: the roundrobin feature's raw ids are unchecked (a given size is enforced)
        table_sizes=torch.tensor([0 if d == 1 else n for d, n in zip(dist, sizes)], dtype=torch.int64),
        W=W,
    )


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
# small world sizes, where most consecutive ids share an owner
@pytest.mark.parametrize("W", [1, 2, 3, 5, 8, 9])
@pytest.mark.parametrize("sequence", [False, True])
@pytest.mark.parametrize("keep", [False, True])
def test_small_world_partition_matches_reference(index_dtype: torch.dtype, W: int, sequence: bool, keep: bool) -> None:
    rng = random.Random(W * 7 + sequence * 3 + keep + (index_dtype == torch.int32) * 100)
    # bags up to 150 ids: several vectors per bag, tails of every length, and
    # features that end mid-vector
    case = _partition_case(rng, W, index_dtype, B=5, max_len=150)
    _check_against_reference(
        case, sequence=sequence, pos=False, weights_dtype=None, seed=rng.randrange(2**63), keep=keep
    )


@pytest.mark.parametrize("W", [3, 4, 7, 8])
def test_count_bag_length_boundaries_match_reference(W: int) -> None:
    """Bags of every length around 32, 64 and 128 ids, one feature per distribution,
    with weights: new_lengths and the scatter's cursors against the reference."""
    rng = random.Random(1000 + W)
    steps = [0, 1, 2, 31, 32, 33, 63, 64, 65, 95, 96, 127, 128, 129, 200]
    lengths = [n for _ in range(3) for n in rng.sample(steps, len(steps))]
    B = len(steps)
    sizes = [10_000, 997, 50_000]
    indices = [rng.randrange(sizes[bt // B]) for bt, n in enumerate(lengths) for _ in range(n)]
    case = dict(
        lengths=torch.tensor(lengths, dtype=torch.int64),
        indices=torch.tensor(indices, dtype=torch.int64),
        block_sizes=torch.tensor([-(-n // W) for n in sizes], dtype=torch.int64),
        dist_types=torch.tensor([0, 1, 2], dtype=torch.int64),
        table_sizes=torch.tensor(sizes, dtype=torch.int64),
        W=W,
    )
    _check_against_reference(case, sequence=True, pos=False, weights_dtype=torch.float32, seed=5, keep=False)


@pytest.mark.parametrize("W", [2, 3, 5, 8])
@pytest.mark.parametrize("pos", [False, True])
def test_long_same_rank_runs_match_reference(W: int, pos: bool) -> None:
    """Runs of 254-700 ids owned by one rank (the last rank included), in one bag
    and across bags, mixed with random ids, int32 and int64 ids, with and
    without new_pos."""
    rng = random.Random(2000 + W)
    rows = 1000 * W
    block = rows // W
    owned = {  # an id of rank r, per distribution type
        0: lambda r: r * block + rng.randrange(block),
        1: lambda r: rng.randrange(rows // W) * W + r,
    }
    bags: list[list[int]] = []
    for dist in (0, 1):
        for r, n in [(W - 1, 700), (0, 255), (W - 1, 254), (W - 1, 256), (1 % W, 511)]:
            bags.append([owned[dist](r) for _ in range(n)])
            bags.append([rng.randrange(rows) for _ in range(rng.randrange(300))])
        # one rank's run across bags: 6 bags x 60 ids, then 3 x 100 mixed with rank 0
        bags += [[owned[dist](W - 1) for _ in range(60)] for _ in range(6)]
        bags += [[owned[dist](rng.choice([0, W - 1])) for _ in range(100)] for _ in range(3)]
    B = len(bags) // 2
    for index_dtype in (torch.int64, torch.int32):
        case = dict(
            lengths=torch.tensor([len(b) for b in bags], dtype=torch.int64),
            indices=torch.tensor([i for b in bags for i in b], dtype=index_dtype),
            block_sizes=torch.tensor([block, block], dtype=torch.int64),
            dist_types=torch.tensor([0, 1], dtype=torch.int64),
            table_sizes=torch.tensor([rows, rows], dtype=torch.int64),
            W=W,
        )
        assert case["lengths"].numel() == 2 * B
        for weights_dtype in (None, torch.float32):
            _check_against_reference(case, sequence=True, pos=pos, weights_dtype=weights_dtype, seed=3, keep=False)


# ---------------------------------------------------------------------------
# Parity with fbgemm (continuous)


@settings(max_examples=80, deadline=None)
@given(
    F=st.integers(1, 5),
    B=st.integers(0, 10),
    W=st.integers(1, 64),
    sequence=st.booleans(),
    pos=st.booleans(),
    weighted=st.booleans(),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    case_seed=st.integers(0, 2**32),
)
def test_continuous_bit_identical_to_fbgemm(F, B, W, sequence, pos, weighted, index_dtype, case_seed) -> None:
    case = _random_case(random.Random(case_seed), F, B, W, dist=[0] * F, index_dtype=index_dtype, raw_ids=True)
    # fbgemm requires lengths, indices and block_sizes to share the index dtype
    lengths = case["lengths"].to(index_dtype)
    block_sizes = case["block_sizes"].to(index_dtype)
    weights = torch.randn(case["indices"].numel()) if weighted else None
    want = torch.ops.fbgemm.block_bucketize_sparse_features(
        lengths, case["indices"], pos, sequence, block_sizes, W, weights
    )
    got = ops.block_bucketize_sparse_features(
        lengths,
        case["indices"],
        block_sizes,
        case["dist_types"],
        W,
        sequence=sequence,
        bucketize_pos=pos,
        weights=weights,
    )
    for name, g, w in zip(got._fields, got, want):
        if w is None:
            assert g is None, name
        else:
            assert g is not None, name
            assert g.dtype == w.dtype, name
            assert torch.equal(g, w), name


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sequence, pos", [(False, False), (True, True)])
def test_zero_block_size_matches_reference_opcheck_and_fake(
    index_dtype: torch.dtype, sequence: bool, pos: bool
) -> None:
    """``block_sizes[f] == 0`` on a continuous feature without shard bounds routes every id
    raw (rank ``id % W``, local ``id // W``): the kernel equals the Python reference, passes
    opcheck, and the fake kernel gives the kernel's shapes."""
    case = _random_case(random.Random(7), 3, 6, 3, dist=[0, 0, 1], index_dtype=index_dtype, raw_ids=True)
    case["block_sizes"] = torch.tensor([0, 0, 4])
    _check_against_reference(case, sequence=sequence, pos=pos, weights_dtype=torch.float32, seed=3, keep=False)
    args = (
        case["lengths"],
        case["indices"],
        case["block_sizes"],
        case["dist_types"],
        case["W"],
        sequence,
        pos,
        None,
        case["table_sizes"],
        3,
        False,
    )
    torch.library.opcheck(OP, args)
    real = OP(*args)
    with FakeTensorMode() as mode:
        fake = OP(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    assert [None if t is None else t.shape for t in fake] == [None if t is None else t.shape for t in real]


def test_sizes_past_int64_are_named_by_the_typed_wrappers() -> None:
    """Sizes the ops' int64 arguments cannot hold are refused naming the argument (torch's
    binder would say only "Expected a value of type 'int'")."""
    lengths, indices = torch.tensor([1]), torch.tensor([5])
    with pytest.raises(ValueError, match=r"`my_size` must be <= 9223372036854775807, got 18446744073709551616"):
        ops.block_bucketize_sparse_features(lengths, indices, torch.tensor([4]), torch.tensor([0]), 2**64)
    with pytest.raises(ValueError, match=r"`seed` must be an int in \[-2\*\*63, 2\*\*63\)"):
        ops.block_bucketize_sparse_features(lengths, indices, torch.tensor([4]), torch.tensor([0]), 2, seed=2**64)
    with pytest.raises(ValueError, match=r"`world_size` must be <= 9223372036854775807"):
        ops.route_ids(indices, 10, 2**64, "roundrobin")
    with pytest.raises(ValueError, match=r"`table_size` must be <= 9223372036854775807"):
        ops.hash_roundrobin_global_ids(torch.tensor([0]), torch.tensor([0]), 2**64, 2)


# ---------------------------------------------------------------------------
# torch.library checks


def _opcheck_cases() -> list[tuple]:
    rng = random.Random(3)
    out = []
    for dist, seq, pos, w in [
        ([0, 1], False, False, False),
        ([2, 0], True, True, True),
        ([1, 2, 2], True, False, True),
    ]:
        c = _random_case(rng, len(dist), 4, 3, dist=dist)
        weights = torch.rand(c["indices"].numel()) if w else None
        out.append(
            (
                c["lengths"],
                c["indices"],
                c["block_sizes"],
                c["dist_types"],
                c["W"],
                seq,
                pos,
                weights,
                c["table_sizes"],
                5,
                False,
            )
        )
    return out


@pytest.mark.parametrize("args", _opcheck_cases())
def test_opcheck(args: tuple) -> None:
    torch.library.opcheck(OP, args)


def test_opcheck_every_argument() -> None:
    """opcheck (schema, fake kernel, autograd registration) with VBE, shard bounds,
    total_num_blocks, keep_orig_idx per feature, the bucket mapping and 2-D weights."""
    lengths = torch.tensor([2, 0, 3, 1, 2, 1], dtype=torch.int64)  # features of 2, 3 and 1 bags
    indices = torch.tensor([1, 8, 5, 6, 7, 3, 9, 4, 2], dtype=torch.int64)
    weights = torch.rand(indices.numel(), 3)
    common = (
        lengths,
        indices,
        torch.tensor([5, 5, 5]),
        torch.tensor([0, 0, 2]),
        2,
        True,
        True,
        weights,
        torch.tensor([10, 10, 10]),
        7,
        False,
        torch.tensor([2, 3, 1]),
        3,
    )
    with_bounds = common + (
        [torch.tensor([0, 3, 10]), torch.tensor([0, 6, 10]), torch.tensor([], dtype=torch.int64)],
        None,
        torch.tensor([True, False, False]),
        True,
    )
    with_blocks = (
        common[:2]
        + (torch.tensor([5, 2, 5]), torch.tensor([0, 0, 0]))
        + common[4:]
        + (None, torch.tensor([2, 4, 2]), None, True)
    )
    for args in (with_bounds, with_blocks):
        torch.library.opcheck(OP, args)
    with FakeTensorMode() as mode:
        fake = [
            mode.from_tensor(a)
            if isinstance(a, torch.Tensor)
            else [mode.from_tensor(t) for t in a]
            if isinstance(a, list)
            else a
            for a in with_bounds
        ]
        out = OP(*fake)
        assert out[2].shape == weights.shape and out[5].shape == indices.shape


def test_opcheck_global_ids() -> None:
    ranks = torch.tensor([0, 1, 2, 0, 1])
    local = torch.tensor([0, 0, 0, 1, 3])
    torch.library.opcheck(torch.ops.recpipe.hash_roundrobin_global_ids, (ranks, local, 100, 3, 9))


def test_fake_tensor_shapes() -> None:
    c = _random_case(random.Random(1), 3, 5, 4, dist=[0, 1, 2])
    w = torch.rand(c["indices"].numel(), dtype=torch.float16)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(c[k]) for k in ("lengths", "indices", "block_sizes", "dist_types")]
        out = OP(*args, 4, True, True, mode.from_tensor(w), mode.from_tensor(c["table_sizes"]), 0, False)
        assert out[0].shape == (4 * c["lengths"].numel(),)
        assert out[0].dtype == c["lengths"].dtype
        assert out[1].shape == c["indices"].shape
        assert out[2].shape == w.shape and out[2].dtype == torch.float16
        assert out[3].shape == c["indices"].shape
        assert out[4].shape == c["indices"].shape
        out2 = OP(*args, 4, False, False, None, mode.from_tensor(c["table_sizes"]), 0, False)
        assert out2[2] is None and out2[3] is None and out2[4] is None


def test_torch_compile_fullgraph() -> None:
    c = _random_case(random.Random(2), 2, 6, 3, dist=[2, 1])

    def f(lengths, indices, bs, dt, ts):
        out = OP(lengths, indices, bs, dt, 3, False, False, None, ts, 1, False)
        return out[0] * 2, out[1] + 1

    eager = f(c["lengths"], c["indices"], c["block_sizes"], c["dist_types"], c["table_sizes"])
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(
        c["lengths"], c["indices"], c["block_sizes"], c["dist_types"], c["table_sizes"]
    )
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def test_fake_kernels_give_the_kernels_strides_for_strided_inputs() -> None:
    """The kernels return contiguous outputs whatever the inputs' strides, so the fake
    kernels must too: transposed [n, D] weights and transposed 2-D route_ids ids (the
    fake outputs kept the inputs' strides, so opcheck and compiled graphs failed)."""
    c = _random_case(random.Random(4), 2, 5, 3, dist=[0, 2])
    n = c["indices"].numel()
    weights = torch.randn(4, n, dtype=torch.float64).t()  # [n, 4], strides (1, n)
    args = (
        c["lengths"],
        c["indices"],
        c["block_sizes"],
        c["dist_types"],
        c["W"],
        True,
        True,
        weights,
        c["table_sizes"],
        5,
        False,
    )
    torch.library.opcheck(OP, args)
    got = OP(*args)
    want = ref_bucketize(
        c["lengths"].tolist(),
        c["indices"].tolist(),
        c["block_sizes"].tolist(),
        c["dist_types"].tolist(),
        c["W"],
        sequence=True,
        bucketize_pos=True,
        weights=weights.tolist(),
        table_sizes=c["table_sizes"].tolist(),
        seed=5,
    )
    assert got[2].tolist() == want["new_weights"] and got[1].tolist() == want["new_indices"]

    ids = torch.arange(12).view(3, 4).t()  # [4, 3], strides (1, 4)
    for dist in ("roundrobin", "hash_roundrobin"):
        torch.library.opcheck(torch.ops.recpipe.route_ids.default, (ids, 20, 3, DIST_CODES[dist], 5))
        owner, local = ops.route_ids(ids, 20, 3, dist, 5)
        want_ids = [route_one(int(i), DIST_CODES[dist], 3, 7, 20, 5, 64) for i in ids.reshape(-1).tolist()]
        assert owner.reshape(-1).tolist() == [p for p, _ in want_ids]
        assert local.reshape(-1).tolist() == [x for _, x in want_ids]


# ---------------------------------------------------------------------------
# The hash bijection and its inverse


def _hash_forward(ids: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """H(ids) through the routing primitive: with W = 1 the local id is H(id)."""
    return ops.route_ids(ids, n, 1, "hash_roundrobin", seed)[1]


def test_routing_constants_come_from_the_kernels_and_match_the_reference() -> None:
    """ROUTING_VERSION and the dist_types codes (ops.DIST_TYPES) are read from the
    extension (csrc/bucketize_math.h), so a kernel change that bumps the hash
    version or renumbers the codes shows up here against the reference's own values."""
    import recpipe._C

    assert ops.ROUTING_VERSION == recpipe._C.ROUTING_VERSION == ROUTING_VERSION
    assert ops.DIST_TYPES == DIST_CODES


# 2^16 and 2^32: one window; 2^16 + 1: the second window starts at 1; 7 and 2^32 - 1:
# the windows overlap in one id.
@pytest.mark.parametrize("n", [1, 2, 7, 1000, 2**16, 2**16 + 1, 2**20 + 3, 2**32 - 1, 2**32, 2**40 + 1])
@pytest.mark.parametrize("seed", [0, 12345])
def test_hash_is_a_bijection_with_inverse(n: int, seed: int) -> None:
    if n <= 2**20 + 3:
        ids = torch.arange(n, dtype=torch.int64)
    else:
        g = torch.Generator().manual_seed(seed)
        ids = torch.cat([torch.tensor([0, 1, n - 2, n - 1]), torch.randint(0, n, (200_000,), generator=g)]).unique()
    h = _hash_forward(ids, n, seed)
    assert int(h.min()) >= 0 and int(h.max()) < n
    assert h.unique().numel() == ids.numel()  # injective on the tested ids
    if ids.numel() == n:
        assert torch.equal(torch.sort(h).values, ids)  # a permutation of [0, n)
    # pure-Python reference on a sample
    ref = RefPermutation(n, seed)
    for x in ids[:: max(1, ids.numel() // 300)].tolist():
        assert ref.forward(x) == int(h[ids == x])
    # inverse round trip for several world sizes
    for W in (1, 3, 8):
        back = ops.hash_roundrobin_global_ids(h % W, h // W, n, W, seed)
        assert torch.equal(back, ids)


def test_route_ids_and_global_ids_round_trip() -> None:
    n, W, seed = 10_007, 6, 99
    ids = torch.arange(n)
    owner, local = ops.route_ids(ids, n, W, "hash_roundrobin", seed)
    counts = torch.bincount(owner, minlength=W)
    # rank r owns exactly ceil((n - r) / W) dense local ids
    for r in range(W):
        want = (n - r + W - 1) // W
        assert int(counts[r]) == want
        assert torch.equal(torch.sort(local[owner == r]).values, torch.arange(want))
    assert torch.equal(ops.hash_roundrobin_global_ids(owner, local, n, W, seed), ids)


def test_seed_changes_the_permutation() -> None:
    ids = torch.arange(1000)
    assert not torch.equal(_hash_forward(ids, 1000, 1), _hash_forward(ids, 1000, 2))


# ---------------------------------------------------------------------------
# Balance on aliased ids


def _max_over_mean(owner: torch.Tensor, W: int) -> float:
    c = torch.bincount(owner, minlength=W).double()
    return float(c.max() / c.mean())


@pytest.mark.parametrize("W", [8, 64])
@pytest.mark.parametrize("pattern", ["k*W+r", "k*2^j", "fixed_low_bits"])
# 2^32: one window; 3e9 + 19: ids below 2^31 pass P_0, those it lands at or above
# n - 2^31 also P_1; 2^30 + 12345: nearly every id passes both windows.
@pytest.mark.parametrize("n", [2**32, 3_000_000_019, 2**30 + 12345])
def test_hash_roundrobin_balances_aliased_ids(W: int, pattern: str, n: int) -> None:
    # A uniform random owner gives max/mean ~ 1 + 2.4 * sqrt(W / ids) (64 ranks), so
    # 1.05 needs ~10k ids per rank to be a statement about the hash, not about luck.
    k = torch.arange(12_500 * W, dtype=torch.int64)
    if pattern == "k*W+r":
        ids = k * W + 3
    elif pattern == "k*2^j":
        ids = k * 2**9
    else:
        ids = (k << 10) | 0x155  # the low 10 bits fixed
    assert ids.unique().numel() >= 50_000 and int(ids.max()) < n
    rr_owner, _ = ops.route_ids(ids, n, W, "roundrobin")
    hash_owner, _ = ops.route_ids(ids, n, W, "hash_roundrobin", seed=0)
    assert _max_over_mean(rr_owner, W) == pytest.approx(W)  # everything on one rank
    assert _max_over_mean(hash_owner, W) <= 1.05


# ---------------------------------------------------------------------------
# KJT helper


def test_bucketize_kjt_matches_op_and_keys() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"],
        values=torch.tensor([1, 5, 9, 2, 40, 41, 7]),
        lengths=torch.tensor([2, 1, 0, 3, 1, 0]),
        weights=torch.rand(7),
    )
    out, perm = bucketize_kjt(
        kjt, 2, {"a": "hash_roundrobin", "b": "continuous"}, {"a": 10, "b": 100}, seed=3, sequence=True
    )
    assert out.keys() == ["a", "b", "a", "b"]
    want = ref_bucketize(
        kjt.lengths().tolist(),
        kjt.values().tolist(),
        [5, 50],
        [2, 0],
        2,
        sequence=True,
        weights=kjt.weights().tolist(),
        table_sizes=[10, 100],
        seed=3,
    )
    assert out.lengths().tolist() == want["new_lengths"]
    assert out.values().tolist() == want["new_indices"]
    assert out.weights().tolist() == want["new_weights"]
    assert perm is not None and perm.tolist() == want["unbucketize_permute"]


def test_bucketize_kjt_names_missing_feature() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"`dist_types` has no entry for features \['a'\]"):
        bucketize_kjt(kjt, 2, {}, {"a": 4})
    with pytest.raises(ValueError, match=r"`table_sizes` has no entry"):
        bucketize_kjt(kjt, 2, {"a": "roundrobin"}, {})
    with pytest.raises(ValueError, match="unknown dist_type 'hashed'"):
        bucketize_kjt(kjt, 2, {"a": "hashed"}, {"a": 4})
    for bad in (True, 2.0, 0):
        with pytest.raises(ValueError, match=r"`world_size` must be an int >= 1 \(the number of ranks\)"):
            bucketize_kjt(kjt, bad, {"a": "roundrobin"}, {"a": 4})


def test_bucketize_kjt_names_the_key_of_an_out_of_range_id() -> None:
    """The op numbers the feature of an id outside its table; bucketize_kjt adds its KJT key."""
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["user", "item"], values=torch.tensor([1, 3, 500, 2]), lengths=torch.tensor([1, 1, 2, 0])
    )
    for dist in ("hash_roundrobin", "roundrobin"):
        with pytest.raises(
            IndexError,
            match=rf"`indices\[2\]` = 500 \(feature 1, {dist}\) is outside "
            r"\[0, table_sizes\[1\] = 97\).* \(feature 1 is the KJT key 'item'\)$",
        ):
            bucketize_kjt(kjt, 2, {"user": "continuous", "item": dist}, {"user": 10, "item": 97})
        # route_bad_ids: 500 goes to rank 500 % 2 = 0 as local id 250, past rank 0's 49 rows
        routed, _ = bucketize_kjt(
            kjt, 2, {"user": "continuous", "item": dist}, {"user": 10, "item": 97}, route_bad_ids=True
        )
        lengths = routed.lengths().tolist()  # rank-major: rank 0's user, item bags, then rank 1's
        rank0 = routed.values()[: sum(lengths[:4])].tolist()
        assert lengths[:2] == [1, 1] and lengths[4:6] == [0, 0] and lengths[2] + lengths[6] == 2
        assert rank0[2:].count(250) == 1 and 250 not in routed.values()[sum(lengths[:4]) :].tolist()


# ---------------------------------------------------------------------------
# Bad input: each message names the argument


def _args(**over):
    base = dict(
        lengths=torch.tensor([1, 2, 0, 1]),
        indices=torch.tensor([0, 3, 2, 5]),
        block_sizes=torch.tensor([4, 4]),
        dist_types=torch.tensor([0, 2]),
        my_size=2,
        sequence=False,
        bucketize_pos=False,
        weights=None,
        table_sizes=torch.tensor([8, 8]),
        seed=0,
        keep_orig_idx=False,
        batch_size_per_feature=None,
        max_B=-1,
        block_bucketize_pos=None,
        total_num_blocks=None,
        keep_orig_idx_per_feature=None,
        return_bucket_mapping=False,
    )
    base.update(over)
    return list(base.values())


# (argument overrides, the error the kernel raises)
BAD_INPUT: list[tuple[dict, str]] = [
    (dict(indices=torch.tensor([0, 3, 2])), r"`lengths` sums past the 3 entries of `indices` at bag 3"),
    (dict(indices=torch.tensor([0, 3, 2, 5, 1])), r"`lengths` sums to 4 but `indices` has 5"),
    (dict(lengths=torch.tensor([1, 2, -1, 2])), r"`lengths\[2\]` is -1"),
    (dict(indices=torch.tensor([0.0, 3.0, 2.0, 5.0])), r"`indices` must be int32 or int64"),
    (dict(lengths=torch.tensor([1.0, 2.0, 0.0, 1.0])), r"`lengths` must be int32 or int64"),
    (dict(dist_types=torch.tensor([0, 3])), r"`dist_types\[1\]` is 3"),
    (dict(dist_types=torch.tensor([0, 2, 1])), r"`block_sizes` has 2 entries but `dist_types` has 3"),
    (dict(dist_types=torch.tensor([0.0, 1.0])), r"`dist_types` must be int32 or int64"),
    (dict(my_size=0), r"`my_size` \(the world size W\) must be >= 1, got 0"),
    (dict(my_size=-3), r"`my_size` \(the world size W\) must be >= 1, got -3"),
    (dict(block_sizes=torch.tensor([-1, 4])), r"`block_sizes\[0\]` is -1 but feature 0 is continuous"),
    (dict(table_sizes=None), r"needs `table_sizes`"),
    (dict(table_sizes=torch.tensor([8, -1])), r"`table_sizes\[1\]` is -1"),  # 0: raw keys (test_raw_key_routing)
    (dict(table_sizes=torch.tensor([8])), r"`table_sizes` has 1 entries"),
    (
        dict(indices=torch.tensor([0, 3, 2, 8])),
        r"`indices\[3\]` = 8 \(feature 1, hash_roundrobin\) is outside \[0, table_sizes\[1\] = 8\)",
    ),
    (dict(indices=torch.tensor([0, 3, 2, -1])), r"`indices\[3\]` = -1"),
    (dict(weights=torch.rand(3)), r"`weights` has 3 entries but `indices` has 4"),
    (dict(weights=torch.ones(4, dtype=torch.int64)), r"`weights` must be float16, bfloat16, float32 or float64"),
    (dict(lengths=torch.tensor([1, 2, 0])), r"`lengths` has 3 entries, not a multiple of the 2 features"),
    (dict(indices=torch.tensor([[0, 3], [2, 5]])), r"`indices` must be 1-D"),
    (dict(indices=torch.tensor([0, 3, 2, 5], device="meta")), r"`indices` is on meta but `lengths` is on cpu"),
    (dict(weights=torch.rand(4, 2, 2)), r"`weights` must be \[n\] or \[n, D\]"),
    (dict(batch_size_per_feature=torch.tensor([1, 2])), r"`batch_size_per_feature` sums to 3 but `lengths` has 4"),
    (dict(batch_size_per_feature=torch.tensor([2, -1])), r"`batch_size_per_feature\[1\]` is -1"),
    (dict(batch_size_per_feature=torch.tensor([4])), r"`batch_size_per_feature` has 1 entries but `dist_types` has 2"),
    (
        dict(lengths=torch.tensor([1, 2, 1]), indices=torch.tensor([0, 3, 2, 5])),
        r"or pass `batch_size_per_feature` for a variable batch per feature",
    ),
    (
        dict(dist_types=torch.tensor([0, 0]), block_bucketize_pos=[torch.tensor([0, 4, 8])]),
        r"`block_bucketize_pos` has 1 tensors but `dist_types` has 2",
    ),
    (
        dict(block_bucketize_pos=[torch.tensor([0, 4, 8]), torch.tensor([0, 4, 8])]),
        r"`block_bucketize_pos` \(uneven row-wise shards\) applies to continuous features only, but feature 1 is "
        r"hash_roundrobin and `block_bucketize_pos\[1\]` has 3 bounds; pass an empty tensor for it",
    ),
    (
        dict(
            dist_types=torch.tensor([0, 0]),
            block_bucketize_pos=[torch.tensor([0, 4, 8]), torch.tensor([], dtype=torch.int64)],
        ),
        r"`block_bucketize_pos\[1\]` is empty but feature 1 is continuous",
    ),
    (
        dict(dist_types=torch.tensor([0, 0]), block_bucketize_pos=[torch.tensor([1, 4, 8]), torch.tensor([0, 4, 8])]),
        r"`block_bucketize_pos\[0\]\[0\]` is 1; shard bounds start at row 0",
    ),
    (
        dict(dist_types=torch.tensor([0, 0]), block_bucketize_pos=[torch.tensor([0, 4, 8]), torch.tensor([0, 5, 3])]),
        r"`block_bucketize_pos\[1\]` decreases at entry 2",
    ),
    (
        dict(dist_types=torch.tensor([0, 0]), block_bucketize_pos=[torch.tensor([0.0, 4.0]), torch.tensor([0, 4])]),
        r"`block_bucketize_pos\[0\]` must be a 1-D int32/int64 tensor",
    ),
    (
        dict(dist_types=torch.tensor([0, 0]), total_num_blocks=torch.tensor([4, 3])),
        r"`total_num_blocks\[1\]` is 3; it must be a positive multiple of `my_size` = 2",
    ),
    (
        dict(total_num_blocks=torch.tensor([4, 4])),
        r"`total_num_blocks` applies to continuous features only, but feature 1",
    ),
    (dict(keep_orig_idx_per_feature=torch.tensor([1, 0])), r"`keep_orig_idx_per_feature` must be a bool tensor"),
    (dict(keep_orig_idx_per_feature=torch.tensor([True])), r"`keep_orig_idx_per_feature` has 1 entries"),
    # int64 sums that wrap back to len(indices) / the bag count
    (
        dict(lengths=torch.tensor([2**63 - 1, 2**63 - 1, 2, 0]), indices=torch.zeros(0, dtype=torch.int64)),
        r"`lengths` sums past the 0 entries of `indices` at bag 0 \(lengths\[0\] = 9223372036854775807\)",
    ),
    (
        dict(batch_size_per_feature=torch.tensor([2**63 - 1, 2**63 - 1 - 4 + 2])),
        r"`batch_size_per_feature` sums past the 4 bags of `lengths` at feature 0",
    ),
    # int32 ids of a hash table whose local ids exceed int32
    (
        dict(indices=torch.tensor([0, 3, 2, 5], dtype=torch.int32), table_sizes=torch.tensor([8, 2**33])),
        r"feature 1 is hash_roundrobin over `table_sizes\[1\]` = 8589934592 rows and 2 ranks, so its local ids "
        r"reach 4294967295, which int32 `indices` cannot hold; pass int64 indices",
    ),
]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_block_zero_shard_bounds_refuse_a_wrapping_key(index_dtype: torch.dtype) -> None:
    """block_sizes 0 with shard bounds keys an id by (id % G) * b[-1] / G: up to the
    largest product the index width holds the op equals fbgemm and plain math; one row
    more is refused (fbgemm's product wraps there and routes ids to wrong ranks)."""
    W, G = 2, 8
    width_max = torch.iinfo(index_dtype).max
    last = width_max // (G - 1)  # (G - 1) * last fits the index width
    ids = [0, 1, 3, 4, 5, 7, 8, 13, 15, 23]

    def call(op, last_bound: int, with_dist: bool):
        kw = dict(dist_types=torch.tensor([0], dtype=torch.int32)) if with_dist else {}
        return op(
            lengths=torch.tensor([len(ids)], dtype=index_dtype),
            indices=torch.tensor(ids, dtype=index_dtype),
            bucketize_pos=False,
            sequence=False,
            block_sizes=torch.tensor([0], dtype=index_dtype),
            my_size=W,
            block_bucketize_pos=[torch.tensor([0, last_bound // 2, last_bound], dtype=index_dtype)],
            total_num_blocks=torch.tensor([G], dtype=index_dtype),
            **kw,
        )

    got = call(OP, last, True)
    want = call(torch.ops.fbgemm.block_bucketize_sparse_features, last, False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # plain math: key = (id % G) * last // G, owner = last bound <= key (< W), local = id // G
    owners = [max(r for r, b in enumerate([0, last // 2, last][:W]) if b <= (i % G) * last // G) for i in ids]
    assert got[0].tolist() == [owners.count(0), owners.count(1)]
    assert got[1].tolist() == [i // G for i, o in zip(ids, owners) if o == 0] + [
        i // G for i, o in zip(ids, owners) if o == 1
    ]
    with pytest.raises(
        RuntimeError,
        match=rf"feature 0 has `block_sizes\[0\]` = 0 with shard bounds.*G = 8 blocks, "
        rf"but \(G - 1\) \* {last + 1} exceeds {width_max}",
    ):
        call(OP, last + 1, True)


# The shape / dtype errors among them, which the fake kernel raises too (the others
# depend on values only the kernel reads).
_STATIC_MARKS = (
    "must be int32 or int64",
    "entries but `dist_types` has",
    "tensors but `dist_types` has",
    "entries but `indices` has",
    "must be float16",
    "not a multiple of",
    "must be 1-D",
    r"must be \[n\] or",
    "must be a 1-D int32/int64 tensor",
    "must be a bool tensor",
    r"`my_size` \(the world size W\) must be >= 1",
    "has 1 entries",
)
STATIC_BAD_INPUT = [c for c in BAD_INPUT if any(m in c[1] for m in _STATIC_MARKS)]


@pytest.mark.parametrize("over, pattern", BAD_INPUT)
def test_bad_input_names_the_argument(over: dict, pattern: str) -> None:
    with pytest.raises((RuntimeError, IndexError), match=pattern):
        OP(*_args(**over))


@pytest.mark.parametrize("over, pattern", STATIC_BAD_INPUT)
def test_fake_kernel_raises_the_kernels_shape_and_dtype_errors(over: dict, pattern: str) -> None:
    """A traced call (torch.compile / fake tensors) fails at trace time with the kernel's message."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    args = [
        mode.from_tensor(a)
        if isinstance(a, torch.Tensor)
        else [mode.from_tensor(t) for t in a]
        if isinstance(a, list)
        else a
        for a in _args(**over)
    ]
    with mode, pytest.raises(RuntimeError, match=pattern):
        OP(*args)


def test_global_ids_bad_input() -> None:
    gid = torch.ops.recpipe.hash_roundrobin_global_ids
    with pytest.raises(RuntimeError, match=r"`ranks` has 2 entries but `local_ids` has 1"):
        gid(torch.tensor([0, 1]), torch.tensor([0]), 10, 2)
    with pytest.raises(RuntimeError, match=r"`world_size` must be >= 1"):
        gid(torch.tensor([0]), torch.tensor([0]), 10, 0)
    with pytest.raises(RuntimeError, match=r"`table_size` must be >= 1"):
        gid(torch.tensor([0]), torch.tensor([0]), -1, 2)  # 0: raw keys (test_raw_key_routing)
    with pytest.raises(RuntimeError, match=r"is not a slot of a table of 10 rows over 2 ranks"):
        gid(torch.tensor([1]), torch.tensor([5]), 10, 2)  # 5 * 2 + 1 = 11 >= 10
    # local * W overflows int64 (2^62 * 4 wraps to 0): still refused, never a wrong global id
    with pytest.raises(RuntimeError, match=r"\(0, 4611686018427387904\) is not a slot of a table of 10 rows"):
        gid(torch.tensor([0]), torch.tensor([2**62]), 10, 4)
    with pytest.raises(RuntimeError, match=r"is not a slot"):
        gid(torch.tensor([3]), torch.tensor([0]), 3, 4)  # rank 3 owns no row of a 3-row table
    with pytest.raises(RuntimeError, match=r"`world_size` must be at most 2147483647"):
        gid(torch.tensor([0]), torch.tensor([0]), 10, 2**62)
    # int32 local ids of a table with global ids beyond int32
    with pytest.raises(RuntimeError, match=r"`local_ids` are int32 but a table of `table_size` = 8589934592 rows"):
        gid(torch.tensor([0]), torch.tensor([0], dtype=torch.int32), 2**33, 4)
    assert gid(torch.tensor([1]), torch.tensor([3], dtype=torch.int32), 2**31, 4).dtype == torch.int32
    big = ops.hash_roundrobin_global_ids(torch.tensor([0, 1]), torch.tensor([0, 1]), 2**33, 4)
    assert big.dtype == torch.int64 and int(big.max()) < 2**33


def test_roundrobin_ids_checked_against_given_table_size() -> None:
    """A roundrobin feature whose table size is given rejects ids outside it (the
    tiered table behind it has no such row); size 0 keeps raw ids (id % W)."""
    for bad in (-1, 15):
        with pytest.raises(
            IndexError,
            match=rf"`indices\[1\]` = {bad} \(feature 0, roundrobin\) is outside "
            r"\[0, table_sizes\[0\] = 10\)",
        ):
            ops.block_bucketize_sparse_features(
                torch.tensor([2]),
                torch.tensor([3, bad]),
                torch.tensor([5]),
                torch.tensor([1]),
                2,
                table_sizes=torch.tensor([10]),
            )
    out = ops.block_bucketize_sparse_features(
        torch.tensor([2]), torch.tensor([3, 15]), torch.tensor([5]), torch.tensor([1]), 2, table_sizes=torch.tensor([0])
    )
    assert out.new_lengths.tolist() == [0, 2] and out.new_indices.tolist() == [1, 7]
    with pytest.raises(RuntimeError, match=r"`table_sizes\[0\]` is -1"):
        ops.block_bucketize_sparse_features(
            torch.tensor([1]),
            torch.tensor([3]),
            torch.tensor([5]),
            torch.tensor([1]),
            2,
            table_sizes=torch.tensor([-1]),
        )
    with pytest.raises(RuntimeError, match=r"`my_size` \(the world size W\) must be at most 2147483647"):
        ops.block_bucketize_sparse_features(
            torch.tensor([1]), torch.tensor([3]), torch.tensor([5]), torch.tensor([1]), 2**63 - 1
        )


def _bad_ids_case(rng: random.Random, W: int, index_dtype: torch.dtype, B: int, max_len: int) -> dict:
    """Continuous, roundrobin and hash_roundrobin features (tables smaller and larger
    than W) whose ids are in range, past the table, negative or near the dtype's ends."""
    dist = [0, 1, 2, 1, 2, 2]
    sizes = [50, 1, 2, 3, 7, 10_000]
    F = len(dist)
    lo, hi = (-(2**31), 2**31 - 1) if index_dtype == torch.int32 else (-(2**63), 2**63 - 1)
    lengths = [rng.randrange(max_len + 1) for _ in range(F * B)]
    indices: list[int] = []
    for bt, ln in enumerate(lengths):
        n = sizes[bt // B]
        for _ in range(ln):
            pick = rng.random()
            indices.append(
                rng.randrange(n)
                if pick < 0.5
                else n + rng.randrange(3 * W + 3)
                if pick < 0.7
                else -1 - rng.randrange(3 * W + 3)
                if pick < 0.85
                else rng.choice([lo, hi, lo + 1, hi - 1])
            )
    return dict(
        lengths=torch.tensor(lengths, dtype=torch.int64),
        indices=torch.tensor(indices, dtype=index_dtype),
        block_sizes=torch.tensor([max(1, -(-n // W)) for n in sizes], dtype=torch.int64),
        dist_types=torch.tensor(dist, dtype=torch.int64),
        table_sizes=torch.tensor(sizes, dtype=torch.int64),
        W=W,
    )


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("W", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("keep", [False, True])
def test_route_bad_ids_match_reference(isa: str, index_dtype: torch.dtype, W: int, keep: bool) -> None:
    """route_bad_ids: an id outside its roundrobin / hash_roundrobin table goes where
    torchrec's row-wise routing sends an id past a table (rank u % W, local u // W, past
    that rank's rows; a rank without rows hands it to one with rows), every output
    against the reference; without the flag the same call is refused."""
    rng = random.Random(W * 7 + (index_dtype == torch.int32) + 2 * keep)
    case = _bad_ids_case(rng, W, index_dtype, B=40, max_len=12)
    weights = torch.randn(case["indices"].numel(), 2)
    args = (case["lengths"], case["indices"], case["block_sizes"], case["dist_types"], W)
    kw = dict(
        sequence=True,
        bucketize_pos=True,
        weights=weights,
        table_sizes=case["table_sizes"],
        seed=77,
        keep_orig_idx=keep,
        return_bucket_mapping=True,
    )
    got = ops.block_bucketize_sparse_features(*args, **kw, route_bad_ids=True)
    want = ref_bucketize(
        *(t.tolist() if isinstance(t, torch.Tensor) else t for t in args),
        sequence=True,
        bucketize_pos=True,
        weights=weights.tolist(),
        table_sizes=case["table_sizes"].tolist(),
        seed=77,
        keep_orig_idx=keep,
        index_bits=32 if index_dtype == torch.int32 else 64,
        return_bucket_mapping=True,
        route_bad_ids=True,
    )
    for name in ("new_lengths", "new_indices", "new_weights", "new_pos", "unbucketize_permute", "bucket_mapping"):
        assert getattr(got, name).tolist() == want[name], name
    assert got.new_indices.dtype == index_dtype
    with pytest.raises(IndexError, match=r"is outside \[0, table_sizes\[\d\] = \d+\).*route_bad_ids=True"):
        ops.block_bucketize_sparse_features(*args, **kw)


def test_route_bad_ids_sends_each_bad_id_past_its_owners_rows() -> None:
    """The property the row-wise input dist relies on, from the routing's definition
    (not the reference): every routed bad id lands on a rank holding rows of its table
    at a local id that is not one of that rank's rows; good ids route as without the flag."""
    W, n = 4, 10  # rank r holds the ids r, r + 4, ...: 3, 3, 2, 2 rows
    rows = [len(range(r, n, W)) for r in range(W)]
    good, bad = [0, 5, 9, 3], [10, 11, 12, 13, 14, 10**12, -1, -2, -7]
    for dist in (1, 2):
        out = ops.block_bucketize_sparse_features(
            torch.tensor([len(good + bad)]),
            torch.tensor(good + bad),
            torch.tensor([3]),
            torch.tensor([dist]),
            W,
            table_sizes=torch.tensor([n]),
            seed=3,
            return_bucket_mapping=True,
            sequence=True,
            route_bad_ids=True,
        )
        local = out.new_indices[out.unbucketize_permute].tolist()
        owner = out.bucket_mapping.tolist()
        ref = ops.block_bucketize_sparse_features(
            torch.tensor([len(good)]),
            torch.tensor(good),
            torch.tensor([3]),
            torch.tensor([dist]),
            W,
            table_sizes=torch.tensor([n]),
            seed=3,
            return_bucket_mapping=True,
            sequence=True,
        )
        assert owner[: len(good)] == ref.bucket_mapping.tolist()
        assert local[: len(good)] == ref.new_indices[ref.unbucketize_permute].tolist()
        for v, p, loc in zip(bad, owner[len(good) :], local[len(good) :]):
            u = v % 2**64
            assert (p, loc) == (u % W, u // W - (2**64 if u // W >= 2**63 else 0)), v
            assert rows[p] > 0 and not 0 <= loc < rows[p], v
    # a table smaller than W: ranks 2, 3 hold no rows of a 2-row table
    out = ops.block_bucketize_sparse_features(
        torch.tensor([4]),
        torch.tensor([2, 3, 7, 1]),
        torch.tensor([1]),
        torch.tensor([1]),
        W,
        table_sizes=torch.tensor([2]),
        return_bucket_mapping=True,
        sequence=True,
        route_bad_ids=True,
    )
    assert out.bucket_mapping.tolist() == [0, 1, 1, 1]
    assert out.new_indices[out.unbucketize_permute].tolist() == [1, 1, 1, 0]


def test_route_bad_ids_across_threads_and_chunks() -> None:
    """A large input split over threads: bad ids in every chunk route as the reference."""
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            case = _bad_ids_case(random.Random(5), 8, torch.int64, B=3000, max_len=30)
            args = (case["lengths"], case["indices"], case["block_sizes"], case["dist_types"], 8)
            got = ops.block_bucketize_sparse_features(
                *args, table_sizes=case["table_sizes"], seed=9, sequence=True, route_bad_ids=True
            )
            want = ref_bucketize(
                *(t.tolist() if isinstance(t, torch.Tensor) else t for t in args),
                sequence=True,
                table_sizes=case["table_sizes"].tolist(),
                seed=9,
                route_bad_ids=True,
            )
            assert got.new_lengths.tolist() == want["new_lengths"]
            assert got.new_indices.tolist() == want["new_indices"]
            assert got.unbucketize_permute.tolist() == want["unbucketize_permute"]
    finally:
        torch.set_num_threads(old)


def test_opcheck_route_bad_ids() -> None:
    case = _bad_ids_case(random.Random(2), 3, torch.int64, B=4, max_len=5)
    args = (
        case["lengths"],
        case["indices"],
        case["block_sizes"],
        case["dist_types"],
        3,
        True,
        True,
        torch.rand(case["indices"].numel()),
        case["table_sizes"],
        5,
        False,
        None,
        -1,
        None,
        None,
        None,
        True,
        True,
    )
    torch.library.opcheck(OP, args)


@pytest.mark.parametrize("dist_type", ["continuous", "roundrobin", "hash_roundrobin"])
@pytest.mark.parametrize("W", [1, 3, 64])
def test_route_ids_matches_reference_and_inverse(dist_type: str, W: int) -> None:
    """route_ids (the per-id routing primitive) against the pure-Python reference, and
    (owner, local) back to the global id for every routing."""
    from harness.routing_reference import route_one

    N = 1000
    code = ops.DIST_TYPES[dist_type]
    ids = torch.randperm(N)
    for dtype in (torch.int64, torch.int32):
        owner, local = ops.route_ids(ids.to(dtype), N, W, dist_type, seed=9)
        assert owner.dtype == torch.int64 and local.dtype == dtype
        want = [route_one(int(g), code, W, max(1, -(-N // W)), N, 9, 64) for g in ids.tolist()]
        assert owner.tolist() == [w[0] for w in want] and local.tolist() == [w[1] for w in want]
    for r in range(W):
        mine = owner == r
        back = global_row_ids(local[mine].to(torch.int64), N, W, r, dist_type, 9)
        assert torch.equal(back, ids[mine].to(torch.int64))


@pytest.mark.parametrize("dist_type", ["continuous", "roundrobin", "hash_roundrobin"])
def test_global_row_ids_refuses_ids_outside_the_shard(dist_type: str) -> None:
    """Every row of a shard maps back to a table id that routes to (rank, local id); a local
    id outside the shard is refused for every routing (continuous and roundrobin returned
    ids past the table's end, e.g. 10 of a 10-row table, or another rank's rows)."""
    N, W = 10, 3
    for r in range(W):
        rows = shard_num_rows(N, W, r, dist_type)
        back = global_row_ids(torch.arange(rows), N, W, r, dist_type, 5)
        owner, local = ops.route_ids(back, N, W, dist_type, seed=5)
        assert bool(owner.eq(r).all()) and torch.equal(local, torch.arange(rows))
        for bad in (-1, rows):
            with pytest.raises((ValueError, RuntimeError), match=r"not all rows of shard|is not a slot"):
                global_row_ids(torch.tensor([0, bad]), N, W, r, dist_type, 5)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=3\), got 3"):
        global_row_ids(torch.tensor([0]), N, W, W, dist_type, 5)


def test_route_ids_bad_input() -> None:
    with pytest.raises(IndexError, match=r"`ids\[1\]` = 10 is outside \[0, table_size = 10\)"):
        ops.route_ids(torch.tensor([0, 10]), 10, 2, "roundrobin")
    with pytest.raises(IndexError, match=r"`ids\[0\]` = -1 is outside"):
        ops.route_ids(torch.tensor([-1]), 10, 2, "continuous")
    with pytest.raises(RuntimeError, match=r"`world_size` must be >= 1, got 0"):
        ops.route_ids(torch.tensor([1]), 10, 0, "roundrobin")
    with pytest.raises(RuntimeError, match=r"`world_size` must be at most"):
        ops.route_ids(torch.tensor([1]), 10, 2**62, "roundrobin")
    with pytest.raises(RuntimeError, match=r"`ids` must be int32 or int64"):
        ops.route_ids(torch.tensor([1.0]), 10, 2, "roundrobin")
    with pytest.raises(RuntimeError, match=r"`table_size` must be >= 1"):
        ops.route_ids(torch.tensor([1]), 0, 2, "roundrobin")
    with pytest.raises(
        RuntimeError,
        match=r"`ids` are int32 but hash_roundrobin over `table_size` = 1099511627776 "
        r"rows and 2 ranks gives local ids up to 549755813887",
    ):
        ops.route_ids(torch.tensor([1], dtype=torch.int32), 2**40, 2, "hash_roundrobin")
    # roundrobin / continuous local ids never exceed the id: int32 stays fine
    assert ops.route_ids(torch.tensor([7], dtype=torch.int32), 2**40, 2, "roundrobin")[1].tolist() == [3]


@pytest.mark.parametrize("call", ["bucketize", "global_ids", "route_ids"])
def test_seed_outside_int64_names_the_argument(call: str) -> None:
    run = {
        "bucketize": lambda seed: ops.block_bucketize_sparse_features(
            torch.tensor([1]),
            torch.tensor([3]),
            torch.tensor([5]),
            torch.tensor([2]),
            2,
            table_sizes=torch.tensor([10]),
            seed=seed,
        ),
        "global_ids": lambda seed: ops.hash_roundrobin_global_ids(torch.tensor([0]), torch.tensor([0]), 10, 2, seed),
        "route_ids": lambda seed: ops.route_ids(torch.tensor([1]), 10, 2, seed=seed),
    }[call]
    for seed in (2**63 - 1, -(2**63)):
        run(seed)  # the int64 range is taken whole
    for seed in (2**63, -(2**63) - 1, True, 1.5):
        with pytest.raises(ValueError, match=r"`seed` must be an int in \[-2\*\*63, 2\*\*63\)"):
            run(seed)


def test_bucketize_kjt_row_bounds_must_be_the_tables_shard_bounds() -> None:
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([0, 4, 8, 9]), lengths=torch.tensor([4]))
    out, _ = bucketize_kjt(kjt, 2, {"a": "continuous"}, {"a": 10}, row_bounds={"a": [0, 5, 10]})
    assert out.lengths().tolist() == [2, 2] and out.values().tolist() == [0, 4, 3, 4]
    for bad in ([0, 5], [0, 2, 5, 10], [0, 5, 7], [1, 5, 10], [0, 6, 5], [0, 5.0, 10]):
        with pytest.raises(
            ValueError,
            match=r"`row_bounds\['a'\]` is .*; it must be 3 non-decreasing ints: 0, "
            r"the first row of each next rank, then the table's 10 rows \(e.g. \[0, 5, 10\]\)",
        ):
            bucketize_kjt(kjt, 2, {"a": "continuous"}, {"a": 10}, row_bounds={"a": bad})
    with pytest.raises(ValueError, match=r"`row_bounds` names features \['b'\] the KJT does not have"):
        bucketize_kjt(kjt, 2, {"a": "continuous"}, {"a": 10}, row_bounds={"b": [0, 5, 10]})


def test_route_ids_opcheck_and_fake_kernels_reject_what_the_kernels_reject() -> None:
    torch.library.opcheck(torch.ops.recpipe.route_ids.default, (torch.tensor([3, 1, 7]), 10, 3, 2, 5))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        owner, local = torch.ops.recpipe.route_ids(torch.empty(6, dtype=torch.int32), 10, 3, 2, 5)
        assert owner.shape == (6,) and owner.dtype == torch.int64 and local.dtype == torch.int32
        with pytest.raises(RuntimeError, match=r"`indices` must be int32 or int64"):
            torch.ops.recpipe.block_bucketize_sparse_features(
                torch.ones(2, dtype=torch.int64),
                torch.empty(2),
                torch.ones(1, dtype=torch.int64),
                torch.ones(1, dtype=torch.int64),
                2,
            )
        with pytest.raises(RuntimeError, match=r"`ids` must be int32 or int64"):
            torch.ops.recpipe.route_ids(torch.empty(2), 10, 3, 2, 5)
        with pytest.raises(
            RuntimeError,
            match=r"`ids` are int32 but hash_roundrobin over `table_size` = "
            r"1099511627776 rows and 2 ranks gives local ids up to 549755813887",
        ):
            torch.ops.recpipe.route_ids(torch.empty(2, dtype=torch.int32), 2**40, 2, 2, 0)
        with pytest.raises(RuntimeError, match=r"`local_ids` are int32 but a table of `table_size` = 8589934592"):
            torch.ops.recpipe.hash_roundrobin_global_ids(
                torch.empty(2, dtype=torch.int64), torch.empty(2, dtype=torch.int32), 2**33, 4
            )


# ---------------------------------------------------------------------------
# Threads (CUDA parity: tests/test_bucketize_cuda.py)


@pytest.mark.parametrize("sequence", [False, True])
@pytest.mark.parametrize("keep", [False, True])
def test_two_ranks_two_threads_match_reference(isa: str, sequence: bool, keep: bool) -> None:
    """W = 2 on 2 threads: ~140k ids cut into chunks, so every chunk's cursors
    start mid-output; a continuous feature with a small block has most raw ids
    >= block * W (the raw-id rule)."""
    rng = random.Random(sequence * 2 + keep)
    sizes = [50_000, 1000, 10_000_000, 300]
    dist = [0, 1, 2, 0]
    blocks = [25_000, 500, 5_000_000, 40]  # the last: ids up to 300 >= 2 * 40
    B = 1100
    lengths = [rng.randrange(0, 65) for _ in range(len(sizes) * B)]
    indices = []
    for bt, ln in enumerate(lengths):
        f = bt // B
        for _ in range(ln):
            raw = dist[f] != 2 and rng.random() < 0.05
            indices.append(rng.randrange(-(2**40), 2**40) if raw else rng.randrange(sizes[f]))
    case = dict(
        lengths=torch.tensor(lengths),
        indices=torch.tensor(indices, dtype=torch.int64),
        block_sizes=torch.tensor(blocks),
        dist_types=torch.tensor(dist),
        W=2,
        table_sizes=torch.tensor([0 if d == 1 else n for d, n in zip(dist, sizes)]),
    )  # 0: raw rr ids
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check_against_reference(case, sequence=sequence, pos=False, weights_dtype=None, seed=5, keep=keep)
    finally:
        torch.set_num_threads(old)
