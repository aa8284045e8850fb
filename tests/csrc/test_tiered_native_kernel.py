"""The compiled tiered kernel (csrc/tiered.cpp) against the device-generic torch path.

The ``torch`` tier backend (``recpipe.pipeline.tiered.backends.torch_backend``, what non-CPU
devices run) is an independent implementation of the same placement,
cache and optimizer rules. Two shards with the same rows, one on each path, see the
same batches (including a lookup issued before the previous batch's backward, as the
fused pipeline does): the cache maps must agree exactly and every row, optimizer
state and output to float rounding. Then ``torch.library.opcheck`` and the fake
kernels' shapes.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import pytest
import torch

from recpipe.pipeline.tiered import native_ops  # noqa: F401  (registers the fake kernels)
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig

D = 8
ATOL = 2e-5
RTOL = 2e-5


def _pair(
    mode: str, x: float, optimizer: str, pooling: str, policy: str, rows: int, world: int = 1, rank: int = 0
) -> Tuple[TieredEmbeddingShard, TieredEmbeddingShard]:
    def make(backend: str) -> TieredEmbeddingShard:
        torch.manual_seed(3)
        return TieredEmbeddingShard(
            num_embeddings=rows,
            embedding_dim=D,
            mode=mode,
            cache_load_factor=x,
            optimizer=TieredOptimizerConfig(optimizer=optimizer, learning_rate=0.05),
            pooling=pooling,
            cache_policy=policy,
            dist_type="roundrobin",
            world_size=world,
            rank=rank,
            split_seed=11,
            backend=backend,
        )

    native, reference = make("native"), make("torch")
    assert native.backend == "native" and reference.backend == "torch"
    return native, reference


def _batches(
    rows: int, steps: int, weighted: bool, seed: int
) -> List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.arange(1, rows + 1, dtype=torch.float64).pow(-1.1)
    out = []
    for _ in range(steps):
        bags = int(torch.randint(1, 24, (1,), generator=gen))
        lengths = torch.randint(0, 6, (bags,), generator=gen)
        n = int(lengths.sum())
        ids = torch.multinomial(probs, max(n, 1), replacement=True, generator=gen)[:n]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        psw = torch.rand(n, generator=gen) if weighted else None
        out.append((ids, offsets, psw, torch.randn(bags, D, generator=gen)))
    return out


def _assert_same_state(a: TieredEmbeddingShard, b: TieredEmbeddingShard, where: str) -> None:
    if a.tiers.caching:
        for name in ("row_map", "slot_row", "slot_score"):
            assert torch.equal(getattr(a.tiers, name), getattr(b.tiers, name)), f"{name} differs {where}"
    for name in ("fast_weights", "fast_state", "slow_weights", "slow_state"):
        torch.testing.assert_close(
            getattr(a.tiers, name), getattr(b.tiers, name), atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} {where}: {m}"
        )
    assert a.tiers.stats.tolist() == b.tiers.stats.tolist(), f"stats differ {where}"


CASES = [
    ("HYBRID", 0.3, "sgd", "sum", "lfu"),
    ("HYBRID", 0.7, "rowwise_adagrad", "mean", "lfu"),
    ("HYBRID", 1.0, "adam", "sum", "lfu"),
    ("CACHING", 0.1, "rowwise_adagrad", "sum", "lfu"),
    ("CACHING", 0.3, "adam", "mean", "lfu"),
    ("CACHING", 0.2, "sgd", "sum", "lru"),
    ("CACHING", 0.5, "rowwise_adagrad", "mean", "lru"),
    ("CACHING", 1.0, "sgd", "sum", "lfu"),
]


@pytest.mark.parametrize(
    "mode,x,optimizer,pooling,policy,weighted",
    [c + (False,) for c in CASES] + [c + (True,) for c in CASES if c[3] == "sum"],  # weights need sum pooling
)
def test_kernel_matches_torch_path_step_by_step(
    mode: str, x: float, optimizer: str, pooling: str, policy: str, weighted: bool
) -> None:
    rows = 97
    native, reference = _pair(mode, x, optimizer, pooling, policy, rows, world=3, rank=1)
    local_rows = native.num_rows
    batches = _batches(local_rows, 30, weighted, seed=hash((mode, x, optimizer, policy)) % 1000)
    pending: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for step, (ids, offsets, psw, grad) in enumerate(batches):
        outs = []
        for shard in (native, reference):
            outs.append(shard(ids, offsets, psw))
        torch.testing.assert_close(outs[0], outs[1], atol=ATOL, rtol=RTOL, msg=lambda m: f"out {step}: {m}")
        pending.append((outs[0], outs[1], grad))
        # the fused pipeline issues batch i+1's lookup before batch i's backward
        if len(pending) == 2 or step == len(batches) - 1:
            while pending:
                a, b, g = pending.pop(0)
                a.backward(g)
                b.backward(g)
        _assert_same_state(native, reference, f"after step {step}")
    assert native.tier_stats() == reference.tier_stats()
    assert native.flush() == reference.flush()
    _assert_same_state(native, reference, "after flush")


def test_kernel_cache_counts_and_write_back() -> None:
    native, reference = _pair("CACHING", 0.2, "sgd", "sum", "lfu", 50)
    ids = torch.tensor([3, 3, 3, 7, 7, 9])
    offsets = torch.tensor([0, 3, 6])
    for _ in range(3):
        for shard in (native, reference):
            shard(ids, offsets).sum().backward()
    st = native.tier_stats()
    assert st["lookups"] == 6 and st["unique_rows"] == 3 and st["hit_rate"] == 1.0
    assert native.tier_stats()["cumulative_hit_rate"] == pytest.approx(12 / 18)
    # rows 3, 7, 9 were admitted on the first lookup (cache of 10 slots); the updates stay dirty
    tiers = native.tiers
    assert sorted(tiers.slot_row[tiers.slot_row >= 0].tolist()) == [3, 7, 9]
    assert int((tiers.slot_score & 1).sum()) == 3
    before = tiers.slow_weights[[3, 7, 9]].clone()
    assert native.flush() == 3 and reference.flush() == 3
    assert not torch.equal(before, tiers.slow_weights[[3, 7, 9]])  # the updates reached the slow tier
    torch.testing.assert_close(tiers.slow_weights, reference.tiers.slow_weights)


def _op_args(shard: TieredEmbeddingShard, ids: torch.Tensor, offsets: torch.Tensor) -> tuple:
    t = shard.tiers
    return (
        ids,
        offsets,
        None,
        t.fast_weights.clone(),
        t.fast_state.clone(),
        t.slow_weights.clone(),
        t.slow_state.clone(),
        t._op_row_map.clone(),
        t._op_slot_row.clone(),
        t._op_slot_score.clone(),
        torch.zeros_like(t.stats),
        shard.num_rows,
        shard.fast_rows,
        shard.split_seed,
        t._op_mode,
        t._op_policy,
        1,
        t._op_pooling,
    )


@pytest.mark.parametrize("mode,x", [("HYBRID", 0.4), ("CACHING", 0.3), ("HYBRID", 1.0)])
def test_opcheck_and_fake_shapes(mode: str, x: float) -> None:
    shard = TieredEmbeddingShard(
        num_embeddings=40,
        embedding_dim=D,
        mode=mode,
        cache_load_factor=x,
        optimizer=TieredOptimizerConfig(optimizer="rowwise_adagrad"),
    )
    ids = torch.tensor([1, 5, 5, 39, 0, 1])
    offsets = torch.tensor([0, 2, 2, 6])
    args = _op_args(shard, ids, offsets)
    torch.library.opcheck(
        torch.ops.recpipe.tiered_lookup.default,
        args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
    out, uniq, inverse = torch.ops.recpipe.tiered_lookup(*_op_args(shard, ids, offsets))
    assert uniq.tolist() == [0, 1, 5, 39]
    assert torch.equal(uniq[inverse], ids)
    grad = torch.randn(3, D)
    bargs = (
        grad,
        uniq,
        inverse,
        offsets,
        None,
        args[3],
        args[4],
        args[5],
        args[6],
        args[7],
        args[9],
        shard.num_rows,
        shard.fast_rows,
        shard.split_seed,
        shard.tiers._op_mode,
        shard.tiers._op_pooling,
        1,
        0.1,
        1e-8,
        0.9,
        0.999,
        0.0,
        1,
    )
    torch.library.opcheck(
        torch.ops.recpipe.tiered_backward.default,
        bargs,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    real = _op_args(shard, ids, offsets)
    with FakeTensorMode(shape_env=ShapeEnv()) as fake:
        fargs = tuple(fake.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in real)
        f_out, f_uniq, f_inv = torch.ops.recpipe.tiered_lookup(*fargs)
    assert tuple(f_out.shape) == (3, D) and tuple(f_inv.shape) == (6,) and f_uniq.dim() == 1


def test_kernel_bad_inputs_name_the_argument() -> None:
    shard = TieredEmbeddingShard(num_embeddings=10, embedding_dim=D, mode="CACHING", cache_load_factor=0.5)
    with pytest.raises(IndexError, match=r"ids out of range: got ids in \[0, 10\]"):  # the kernel's own check
        torch.ops.recpipe.tiered_lookup(*_op_args(shard, torch.tensor([0, 10]), torch.tensor([0, 2])))
    with pytest.raises(IndexError, match=r"ids out of range for table '.*' shard 0: got ids in \[0, 10\]"):
        shard(torch.tensor([0, 10]), torch.tensor([0, 2]))  # re-raised by the shard, naming the table
    with pytest.raises(ValueError, match="offsets must start at 0, be non-decreasing"):
        shard(torch.tensor([1, 2]), torch.tensor([0, 2, 1, 2]))
    with pytest.raises(ValueError, match="per_sample_weights must have the shape of ids"):
        shard(torch.tensor([1, 2]), torch.tensor([0, 2]), torch.ones(3))
    mean = TieredEmbeddingShard(
        num_embeddings=10, embedding_dim=D, mode="HYBRID", cache_load_factor=0.5, pooling="mean"
    )
    with pytest.raises(ValueError, match="per_sample_weights need pooling='sum'"):
        mean(torch.tensor([1, 2]), torch.tensor([0, 2]), torch.ones(2))
    args = list(_op_args(shard, torch.tensor([1]), torch.tensor([0, 1])))
    args[14] = 5  # mode
    with pytest.raises(RuntimeError, match="tiered `mode` must be 0"):
        torch.ops.recpipe.tiered_lookup(*args)
    args = list(_op_args(shard, torch.tensor([1]), torch.tensor([0, 1])))
    args[3] = args[3].double()
    with pytest.raises(RuntimeError, match="fast_weights` must be a contiguous float32"):
        torch.ops.recpipe.tiered_lookup(*args)
