"""Continuous routing == fbgemm's CPU op, argument by argument.

The installed ``torch.ops.fbgemm.block_bucketize_sparse_features`` (and its
``_inference`` and ``_2d_weights`` variants) is the reference: random inputs
exercise each argument recpipe's op shares with it (variable batch per feature,
uneven shards through ``block_bucketize_pos``, ``total_num_blocks``,
``keep_orig_idx`` per feature, the bucket mapping, 2-D weights), alone and
together, and every output must be bit-identical.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm.*)
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recpipe.pipeline.routing import ops
from recpipe.pipeline.routing.kjt import bucketize_kjt


def _case(
    rng: random.Random,
    F: int,
    W: int,
    dtype: torch.dtype,
    *,
    vbe: bool,
    bounds: bool,
    blocks_total: bool,
    zero_blocks: bool,
) -> dict[str, Any]:
    """Random continuous features: sizes, ids (mostly in range, some raw), metadata."""
    B = rng.randrange(0, 8)
    batch = [rng.randrange(0, 8) if vbe else B for _ in range(F)]
    lengths = [rng.randrange(0, 7) for f in range(F) for _ in range(batch[f])]
    G = [W * rng.randrange(1, 4) if blocks_total else W for _ in range(F)]
    blocks = [0 if zero_blocks else rng.randrange(1, 40) for _ in range(F)]
    pos: Optional[list[torch.Tensor]] = None
    if bounds:
        pos = []
        for f in range(F):
            cuts = sorted(rng.randrange(0, 200) for _ in range(W))
            pos.append(torch.tensor([0] + cuts, dtype=dtype))
    hi = 2**31 - 1 if dtype == torch.int32 else 2**40
    indices: list[int] = []
    bag = 0
    for f in range(F):
        rows = int(pos[f][-1]) if pos is not None else blocks[f] * G[f]
        for _ in range(batch[f]):
            for _ in range(lengths[bag]):
                r = rng.random()
                indices.append(rng.randrange(max(rows, 1)) if r < 0.8 else rng.randrange(-hi, hi))
            bag += 1
    return dict(
        lengths=torch.tensor(lengths, dtype=dtype),
        indices=torch.tensor(indices, dtype=dtype),
        block_sizes=torch.tensor(blocks, dtype=dtype),
        batch_size_per_feature=torch.tensor(batch, dtype=dtype) if vbe else None,
        max_B=max(batch) if batch else 0,
        block_bucketize_pos=pos,
        total_num_blocks=torch.tensor(G, dtype=dtype) if blocks_total else None,
    )


def _assert_same(got: tuple, want: tuple, names: list[str]) -> None:
    for name, g, w in zip(names, got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert g.dtype == w.dtype, name
            assert torch.equal(g, w), (name, g, w)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    F=st.integers(1, 4),
    W=st.integers(1, 9),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    vbe=st.booleans(),
    bounds=st.booleans(),
    blocks_total=st.booleans(),
    zero_blocks=st.booleans(),
    sequence=st.booleans(),
    bucketize_pos=st.booleans(),
    weights=st.sampled_from([None, "1d", "2d"]),
    keep=st.sampled_from([False, True, "per_feature"]),
    mapping=st.booleans(),
    case_seed=st.integers(0, 2**32),
)
def test_continuous_matches_fbgemm_every_argument(
    F: int,
    W: int,
    dtype: torch.dtype,
    vbe: bool,
    bounds: bool,
    blocks_total: bool,
    zero_blocks: bool,
    sequence: bool,
    bucketize_pos: bool,
    weights: Optional[str],
    keep: Any,
    mapping: bool,
    case_seed: int,
) -> None:
    rng = random.Random(case_seed)
    c = _case(rng, F, W, dtype, vbe=vbe, bounds=bounds, blocks_total=blocks_total, zero_blocks=zero_blocks)
    n = c["indices"].numel()
    D = rng.randrange(1, 4)
    w = None if weights is None else torch.randn(n) if weights == "1d" else torch.randn(n, D)
    keep_all = keep is True
    keep_f = torch.tensor([rng.random() < 0.5 for _ in range(F)]) if keep == "per_feature" else None
    common = dict(
        batch_size_per_feature=c["batch_size_per_feature"],
        max_B=c["max_B"],
        block_bucketize_pos=c["block_bucketize_pos"],
        keep_orig_idx=keep_all,
        total_num_blocks=c["total_num_blocks"],
        keep_orig_idx_per_feature=keep_f,
    )
    got = ops.block_bucketize_sparse_features(
        c["lengths"],
        c["indices"],
        c["block_sizes"],
        torch.zeros(F, dtype=torch.int64),
        W,
        sequence=sequence,
        bucketize_pos=bucketize_pos,
        weights=w,
        return_bucket_mapping=mapping,
        **common,
    )
    names = list(got._fields)
    if weights == "2d":
        want = torch.ops.fbgemm.block_bucketize_sparse_features_2d_weights(
            c["lengths"], c["indices"], bucketize_pos, sequence, c["block_sizes"], W, w, D, **common
        )
        _assert_same(tuple(got)[:5], want, names)
    else:
        want = torch.ops.fbgemm.block_bucketize_sparse_features_inference(
            c["lengths"],
            c["indices"],
            bucketize_pos,
            sequence,
            c["block_sizes"],
            W,
            w,
            return_bucket_mapping=mapping,
            **common,
        )
        # fbgemm fills the bucket mapping in sequence mode only (its other buffer is
        # uninitialized); recpipe always fills it, checked below.
        _assert_same(tuple(got)[:5], want[:5], names)
        if mapping and sequence:
            _assert_same(tuple(got)[5:], want[5:], names[5:])
    if mapping:
        # the mapping is each id's rank: the rank whose slice of new_indices holds it
        assert got.bucket_mapping is not None
        if sequence:
            slot = got.unbucketize_permute
            ends = torch.cumsum(got.new_lengths.view(W, -1).sum(1), 0)
            assert torch.equal(got.bucket_mapping, torch.searchsorted(ends, slot, right=True).to(dtype))
    else:
        assert got.bucket_mapping is None


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "lengths, indices, W, total_num_blocks, new_lengths, new_indices",
    [
        # fbgemm's test_block_bucketize_sparse_features_total_num_blocks_raw_ids: every id is raw
        ([1], [5], 3, [3], [0, 0, 1], [1]),
        # without total_num_blocks: G = W
        ([2], [5, 1], 2, None, [0, 2], [2, 0]),
    ],
)
def test_zero_block_size_routes_every_id_raw_as_fbgemm(
    dtype: torch.dtype,
    lengths: list,
    indices: list,
    W: int,
    total_num_blocks: Optional[list],
    new_lengths: list,
    new_indices: list,
) -> None:
    """``block_sizes[f] == 0`` without shard bounds: no id falls in a block, so every id goes
    to rank ``(id % G) / (G / W)`` with local id ``id // G`` (G = total_num_blocks, else W)."""
    tnb = None if total_num_blocks is None else torch.tensor(total_num_blocks, dtype=dtype)
    args = (torch.tensor(lengths, dtype=dtype), torch.tensor(indices, dtype=dtype))
    got = ops.block_bucketize_sparse_features(
        *args, torch.tensor([0], dtype=dtype), torch.zeros(1, dtype=torch.int64), W, total_num_blocks=tnb
    )
    want = torch.ops.fbgemm.block_bucketize_sparse_features(
        *args,
        bucketize_pos=False,
        sequence=False,
        block_sizes=torch.tensor([0], dtype=dtype),
        my_size=W,
        total_num_blocks=tnb,
    )
    assert got.new_lengths.tolist() == new_lengths and got.new_indices.tolist() == new_indices
    _assert_same(tuple(got)[:2], want[:2], ["new_lengths", "new_indices"])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_fbgemm_vbe_example(dtype: torch.dtype) -> None:
    """fbgemm's own VBE example (3 features, batch sizes 3, 1, 2) through both ops."""
    lengths = torch.tensor([2, 1, 1, 2, 0, 2], dtype=dtype)
    indices = torch.tensor([1, 8, 5, 6, 7, 8, 8, 4], dtype=dtype)
    batch = torch.tensor([3, 1, 2], dtype=dtype)
    blocks = torch.tensor([5, 10, 8], dtype=dtype)
    got = ops.block_bucketize_sparse_features(
        lengths, indices, blocks, torch.zeros(3, dtype=torch.int64), 2, batch_size_per_feature=batch, max_B=3
    )
    assert got.new_lengths.tolist() == [1, 0, 0, 2, 0, 1, 1, 1, 1, 0, 0, 1]
    assert got.new_indices.tolist() == [1, 7, 8, 4, 3, 0, 1, 0]
    want = torch.ops.fbgemm.block_bucketize_sparse_features(
        lengths, indices, False, False, blocks, 2, None, batch_size_per_feature=batch, max_B=3
    )
    _assert_same(tuple(got)[:5], want, list(got._fields))


@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("vbe", [False, True])
@pytest.mark.parametrize("sequence", [False, True])
def test_bucketize_kjt_equals_torchrec_bucketize(uneven: bool, vbe: bool, sequence: bool) -> None:
    """recpipe's KJT routing (continuous features) == torchrec's own
    ``bucketize_kjt_before_all2all``: keys, lengths, values, strides per key per rank
    (VBE) and the unbucketize permutation, with uneven shard bounds or blocks."""
    from torchrec.distributed.embedding_sharding import bucketize_kjt_before_all2all
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rng = random.Random(vbe * 2 + uneven + 4 * sequence)
    W, keys, rows = 3, ["a", "b"], {"a": 50, "b": 31}
    strides = {k: rng.randrange(1, 7) if vbe else 5 for k in keys}
    lengths = [rng.randrange(0, 5) for k in keys for _ in range(strides[k])]
    values: list[int] = []
    i = 0
    for k in keys:
        for _ in range(strides[k]):
            values += [rng.randrange(rows[k]) for _ in range(lengths[i])]
            i += 1
    bounds = {"a": [0, 7, 40, 50], "b": [0, 20, 21, 31]} if uneven else None
    kw: dict[str, Any] = dict(keys=keys, values=torch.tensor(values), lengths=torch.tensor(lengths))
    if vbe:
        kw["stride_per_key_per_rank"] = [[strides[k]] for k in keys]
    kjt = KeyedJaggedTensor(**kw)
    got, perm = bucketize_kjt(kjt, W, {k: "continuous" for k in keys}, rows, sequence=sequence, row_bounds=bounds)
    want, want_perm = bucketize_kjt_before_all2all(
        kjt,
        W,
        torch.tensor([-(-rows[k] // W) for k in keys]),
        output_permute=sequence,
        block_bucketize_row_pos=[torch.tensor(bounds[k]) for k in keys] if uneven else None,
    )
    assert got.keys() == want.keys()
    assert torch.equal(got.lengths(), want.lengths())
    assert torch.equal(got.values(), want.values())
    assert got.variable_stride_per_key() == want.variable_stride_per_key() == vbe
    if vbe:
        assert got.stride_per_key_per_rank() == want.stride_per_key_per_rank()
    else:
        assert got.stride() == want.stride()
    assert (perm is None) == (want_perm is None)
    if perm is not None:
        assert torch.equal(perm, want_perm)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("blocks_total", [False, True])
def test_negative_block_sizes_with_shard_bounds_match_fbgemm(dtype: torch.dtype, blocks_total: bool) -> None:
    """With ``block_bucketize_pos`` fbgemm tests only ``block_sizes[f] == 0``: a negative
    block keys ids by themselves like a positive one (not as 0, the scaled-key rule)."""
    rng = random.Random(11 + blocks_total)
    F, W, B = 3, 3, 6
    lengths = [rng.randrange(0, 5) for _ in range(F * B)]
    bounds = [[0, 3, 5, 10], [0, 5, 6, 10], [0, 0, 40, 41]]
    indices = [
        rng.randrange(50) if rng.random() < 0.8 else rng.randrange(-(2**31), 2**31 - 1) for _ in range(sum(lengths))
    ]
    blocks = torch.tensor([-1, -7, 4], dtype=dtype)
    common = dict(
        block_bucketize_pos=[torch.tensor(b, dtype=dtype) for b in bounds],
        total_num_blocks=torch.tensor([3, 6, 9], dtype=dtype) if blocks_total else None,
    )
    lengths_t, indices_t = torch.tensor(lengths, dtype=dtype), torch.tensor(indices, dtype=dtype)
    w = torch.randn(len(indices))
    got = ops.block_bucketize_sparse_features(
        lengths_t,
        indices_t,
        blocks,
        torch.zeros(F, dtype=torch.int64),
        W,
        sequence=True,
        bucketize_pos=True,
        weights=w,
        **common,
    )
    want = torch.ops.fbgemm.block_bucketize_sparse_features(lengths_t, indices_t, True, True, blocks, W, w, **common)
    _assert_same(tuple(got)[:5], want, list(got._fields))


def test_bucketize_kjt_row_bounds_of_some_features_match_torchrec() -> None:
    """``row_bounds`` naming some continuous features: the others keep torchrec's blocks
    (no empty bounds tensor reaches the kernel); bounds for a routed feature are refused
    naming ``row_bounds``."""
    from torchrec.distributed.embedding_sharding import bucketize_kjt_before_all2all
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rng = random.Random(5)
    W, B, rows = 3, 6, {"a": 50, "b": 31}
    lengths = {k: [rng.randrange(0, 5) for _ in range(B)] for k in rows}
    # ids of b include raw ids past W * ceil(31 / 3) = 33 (the block rule's id % W branch)
    values = {k: [rng.randrange(rows[k] + 10 * (k == "b")) for _ in range(sum(lengths[k]))] for k in rows}
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor(values["a"] + values["b"]),
        lengths=torch.tensor(lengths["a"] + lengths["b"]),
    )
    bounds_a = [0, 7, 40, 50]
    got, perm = bucketize_kjt(
        kjt, W, {"a": "continuous", "b": "continuous"}, rows, sequence=True, row_bounds={"a": bounds_a}
    )
    one = {
        k: KeyedJaggedTensor(keys=[k], values=torch.tensor(values[k]), lengths=torch.tensor(lengths[k])) for k in rows
    }
    want_a, _ = bucketize_kjt_before_all2all(
        one["a"], W, torch.tensor([-(-50 // W)]), block_bucketize_row_pos=[torch.tensor(bounds_a)]
    )
    want_b, _ = bucketize_kjt_before_all2all(one["b"], W, torch.tensor([-(-31 // W)]))
    got_lengths = got.lengths().view(W, 2, B)
    assert torch.equal(got_lengths[:, 0], want_a.lengths().view(W, B))
    assert torch.equal(got_lengths[:, 1], want_b.lengths().view(W, B))
    got_values = torch.split(got.values(), got_lengths.sum(2).view(-1).tolist())  # (rank, feature) slices
    want_values = [torch.split(w.values(), w.lengths().view(W, B).sum(1).tolist()) for w in (want_a, want_b)]
    for r in range(W):
        assert torch.equal(got_values[2 * r], want_values[0][r])
        assert torch.equal(got_values[2 * r + 1], want_values[1][r])
    assert perm is not None and sorted(perm.tolist()) == list(range(kjt.values().numel()))
    with pytest.raises(ValueError, match=r"`row_bounds` names features \['b'\] that are not continuous"):
        bucketize_kjt(
            kjt, W, {"a": "continuous", "b": "hash_roundrobin"}, rows, row_bounds={"a": bounds_a, "b": [0, 10, 20, 31]}
        )
