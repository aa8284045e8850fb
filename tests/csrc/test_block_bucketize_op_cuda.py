"""CUDA kernels of the routing ops vs their CPU reference (compiled in CI; run
only where a GPU exists): bit-identical outputs for every argument of the op,
no host sync with per-feature metadata on the CPU, device asserts on bad values."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from typing import Any

import pytest
import torch

from recpipe.pipeline.routing import ops

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")]

# Tensors the CUDA call takes on the GPU; every other (per-feature metadata) stays on the CPU.
ON_DEVICE = ("lengths", "indices", "weights")


def _random_case(
    rng: random.Random,
    *,
    vbe: bool = False,
    uneven: bool = False,
    num_blocks: bool = False,
    keep_per_feature: bool = False,
    weights_dim: int = 0,
    bad_ids: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of one block_bucketize_sparse_features call (all on the CPU).

    uneven / num_blocks make every feature continuous (the only rule they apply to);
    weights_dim 0: no weights, 1: [n], D > 1: [n, D]; bad_ids: roundrobin /
    hash_roundrobin features get ids outside their table too, with route_bad_ids.
    """
    F = rng.randint(1, 4)
    W = rng.choice([1, 2, 3, 7, 8])
    index_dtype = rng.choice([torch.int32, torch.int64])
    dist = [0] * F if uneven or num_blocks else [rng.randrange(3) for _ in range(F)]
    table = [rng.choice([1, 5, 64, 1000, 50_000]) for _ in range(F)]
    raw = [d == 1 and rng.random() < 0.5 for d in dist]  # roundrobin of raw ids (table size 0)
    G = [W * rng.randint(1, 3) for _ in range(F)]  # total_num_blocks
    block = [max(1, -(-n // (G[f] if num_blocks else W))) for f, n in enumerate(table)]
    kw: dict[str, Any] = {}
    if uneven:
        bounds = []
        for f, n in enumerate(table):
            cuts = sorted(rng.randrange(n + 1) for _ in range(W))
            bounds.append(torch.tensor([0] + cuts, dtype=rng.choice([torch.int32, torch.int64])))
            if num_blocks and rng.random() < 0.5:
                block[f] = 0  # fbgemm's block_size 0 form: key = (id % G) * last / G
        kw["block_bucketize_pos"] = bounds
    if num_blocks:
        kw["total_num_blocks"] = torch.tensor(G)
    batch = [rng.randint(0, 6) for _ in range(F)] if vbe else [rng.randint(1, 6)] * F
    if vbe:
        kw["batch_size_per_feature"] = torch.tensor(batch, dtype=rng.choice([torch.int32, torch.int64]))
        kw["max_B"] = max(batch)
    lengths: list[int] = []
    ids: list[int] = []
    hi = 2**31 - 1 if index_dtype == torch.int32 else 2**40
    for f in range(F):
        for _ in range(batch[f]):
            lengths.append(rng.randrange(8))
            for _ in range(lengths[-1]):
                if (dist[f] == 0 or raw[f] or bad_ids) and rng.random() < 0.2:
                    ids.append(rng.randrange(-hi, hi))  # raw ids, beyond the table, negative
                else:
                    ids.append(rng.randrange(table[f]))
    n = len(ids)
    if keep_per_feature:
        kw["keep_orig_idx_per_feature"] = torch.tensor([rng.random() < 0.5 for _ in range(F)])
    if weights_dim:
        dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32, torch.float64])
        shape = (n,) if weights_dim == 1 else (n, weights_dim)
        kw["weights"] = torch.randn(shape).to(dtype)
    kw.update(
        lengths=torch.tensor(lengths, dtype=rng.choice([torch.int32, torch.int64])),
        indices=torch.tensor(ids, dtype=index_dtype),
        block_sizes=torch.tensor(block),
        dist_types=torch.tensor(dist),
        my_size=W,
        table_sizes=torch.tensor([0 if r else t for r, t in zip(raw, table)]),
        seed=rng.randrange(2**32),
        keep_orig_idx=rng.random() < 0.3,
        sequence=rng.random() < 0.5,
        bucketize_pos=rng.random() < 0.5,
        return_bucket_mapping=rng.random() < 0.5,
    )
    if bad_ids:
        kw["route_bad_ids"] = True
    return kw


def _on_cuda(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cuda() if k in ON_DEVICE else v for k, v in kw.items()}


def _assert_same(kw: dict[str, Any]) -> None:
    cpu = ops.block_bucketize_sparse_features(**kw)
    gpu = ops.block_bucketize_sparse_features(**_on_cuda(kw))
    for name, a, b in zip(
        ("new_lengths", "new_indices", "new_weights", "new_pos", "unbucketize_permute", "bucket_mapping"), cpu, gpu
    ):
        assert (a is None) == (b is None), name
        if a is not None:
            assert b.is_cuda and b.dtype == a.dtype, name
            assert torch.equal(a, b.cpu()), (name, kw)


@pytest.mark.parametrize("vbe", [False, True])
@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("num_blocks", [False, True])
@pytest.mark.parametrize("weights_dim", [0, 1, 3])
def test_cuda_matches_cpu(vbe: bool, uneven: bool, num_blocks: bool, weights_dim: int) -> None:
    rng = random.Random(f"{vbe}{uneven}{num_blocks}{weights_dim}")
    for _ in range(25):
        _assert_same(
            _random_case(
                rng,
                vbe=vbe,
                uneven=uneven,
                num_blocks=num_blocks,
                keep_per_feature=rng.random() < 0.5,
                weights_dim=weights_dim,
            )
        )


@pytest.mark.parametrize("vbe", [False, True])
def test_cuda_route_bad_ids_matches_cpu(vbe: bool) -> None:
    """route_bad_ids: ids outside a roundrobin / hash_roundrobin table (negative, past
    it, tables smaller than W) reach the same rank and local id on both devices
    (without it the CUDA kernel stops on a device-side assert)."""
    rng = random.Random(f"bad{vbe}")
    for _ in range(25):
        _assert_same(_random_case(rng, vbe=vbe, keep_per_feature=rng.random() < 0.5, weights_dim=1, bad_ids=True))


def test_cuda_matches_cpu_large_bags() -> None:
    """Many ids per bag and many bags (grid-stride loops, several blocks)."""
    rng = random.Random(11)
    F, B, W = 3, 5000, 8
    lengths = torch.randint(0, 40, (F * B,))
    n = int(lengths.sum())
    kw = dict(
        lengths=lengths,
        indices=torch.randint(0, 1000, (n,)),
        block_sizes=torch.tensor([125, 125, 125]),
        dist_types=torch.tensor([0, 1, 2]),
        my_size=W,
        table_sizes=torch.tensor([1000] * F),
        seed=rng.randrange(2**32),
        sequence=True,
        bucketize_pos=True,
        return_bucket_mapping=True,
        weights=torch.rand(n, 2),
    )
    _assert_same(kw)


def test_cuda_empty() -> None:
    base = dict(
        block_sizes=torch.tensor([4, 4]),
        dist_types=torch.tensor([0, 2]),
        my_size=3,
        table_sizes=torch.tensor([10, 10]),
        sequence=True,
        bucketize_pos=True,
        return_bucket_mapping=True,
    )
    _assert_same(
        dict(
            base,
            lengths=torch.zeros(6, dtype=torch.int64),
            indices=torch.empty(0, dtype=torch.int64),
            weights=torch.empty(0, 4),
        )
    )
    _assert_same(dict(base, lengths=torch.empty(0, dtype=torch.int32), indices=torch.empty(0, dtype=torch.int64)))
    _assert_same(
        dict(
            base,
            lengths=torch.zeros(0, dtype=torch.int64),
            indices=torch.empty(0, dtype=torch.int32),
            batch_size_per_feature=torch.tensor([0, 0]),
        )
    )


def test_cuda_no_host_sync_with_cpu_metadata() -> None:
    """With per-feature metadata on the CPU the op never synchronizes the host."""
    rng = random.Random(3)
    kw = _random_case(rng, vbe=True, uneven=True, num_blocks=True, keep_per_feature=True, weights_dim=3)
    kw.update(sequence=True, bucketize_pos=True, return_bucket_mapping=True)
    dev = _on_cuda(kw)
    ops.block_bucketize_sparse_features(**dev)  # warm-up: lazy CUDA / pinned-pool setup is not per call
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ops.block_bucketize_sparse_features(**dev)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    cpu = ops.block_bucketize_sparse_features(**kw)
    for a, b in zip(cpu, out):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b.cpu())


def test_cuda_metadata_on_gpu() -> None:
    """Metadata on the GPU works too (it is read back: one documented sync)."""
    rng = random.Random(4)
    kw = _random_case(rng, vbe=True, uneven=True, num_blocks=True, keep_per_feature=True, weights_dim=1)
    cpu = ops.block_bucketize_sparse_features(**kw)
    dev = {
        k: (v.cuda() if isinstance(v, torch.Tensor) else [t.cuda() for t in v] if isinstance(v, list) else v)
        for k, v in kw.items()
    }
    for a, b in zip(cpu, ops.block_bucketize_sparse_features(**dev)):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b.cpu())


def test_cuda_route_ids_and_global_ids_match_cpu() -> None:
    h = torch.arange(1000)
    assert torch.equal(
        ops.hash_roundrobin_global_ids(h.cuda() % 3, h.cuda() // 3, 1000, 3, 2).cpu(),
        ops.hash_roundrobin_global_ids(h % 3, h // 3, 1000, 3, 2),
    )
    for dist in (0, 1, 2):
        for dtype in (torch.int32, torch.int64):
            ids = torch.randint(0, 777, (5000,), dtype=dtype)
            cpu = torch.ops.recpipe.route_ids(ids, 777, 5, dist, 9)
            gpu = torch.ops.recpipe.route_ids(ids.cuda(), 777, 5, dist, 9)
            for a, b in zip(cpu, gpu):
                assert torch.equal(a, b.cpu())
    with pytest.raises(IndexError, match=r"`ids\[2\]` = 777 is outside"):
        torch.ops.recpipe.route_ids(torch.tensor([1, 2, 777], device="cuda"), 777, 5, 2, 9)


_ASSERT_SCRIPT = """
import torch
from recpipe.pipeline.routing import ops
lengths, indices = {lengths}, {indices}
ops.block_bucketize_sparse_features(torch.tensor(lengths, device="cuda"), torch.tensor(indices, device="cuda"),
    torch.tensor([4]), torch.tensor([2]), 3, table_sizes=torch.tensor([10]))
torch.cuda.synchronize()
"""


@pytest.mark.parametrize(
    "lengths, indices, message",
    [
        ([1, 2], [1, 2, 10], "`indices[2]` = 10"),  # outside hash_roundrobin's table
        ([1, 1], [1, 2, 3], "`lengths` sums to 2 but `indices` has 3"),
        ([2, -1, 1], [1, 2], "`lengths[1]` is -1"),  # every prefix sum within n: only this assert
        ([2**63 - 1, 2**63 - 1, 4], [1, 2], "`lengths` sums past the 2 entries of `indices` at bag 0"),  # wraps to n
    ],
)
def test_cuda_bad_values_are_device_asserts(lengths: list[int], indices: list[int], message: str) -> None:
    """Values only the device knows fail by a device assert naming the problem (a
    C++ error would need a host sync); the CUDA context is lost, so a subprocess."""
    script = _ASSERT_SCRIPT.format(lengths=lengths, indices=indices)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=os.environ, timeout=300)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
