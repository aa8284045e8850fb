"""The CUDA path of tiered tables: fbgemm's TBE, no host sync per training step.

On CUDA a ``TieredEmbeddingShard`` runs fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen``
(the ``fbgemm`` tier backend): CACHING as a MANAGED_CACHING table, HYBRID as
a DEVICE + MANAGED pair split by the shard's hash.

Run here (CPU only):

* the placement -> fbgemm mapping (tables, locations, cache sets, cache algorithm,
  optimizer type and hyper-parameters) against values derived by hand from the
  placement, and the TBE fbgemm builds from it (fbgemm's CPU TBE);
* the byte formula of what fbgemm allocates per tier, against hand-computed numbers
  and ``recpipe.pipeline.placement.shard_storage`` where they agree;
* the fbgemm backend on CPU (the same tables as fbgemm HOST tables, no cache)
  against the compiled CPU kernel: pooled, weighted, mean and sequence-style
  lookups, fused SGD / row-wise Adagrad, the HYBRID split (equal hit counts),
  export / load across backends;
* a tripwire: no call from recpipe's pipeline files during a step of the fbgemm
  backend reads a tensor back (``item``, ``tolist``, ``bool``, ``nonzero``,
  ``unique``, boolean-mask indexing, unsized ``repeat_interleave``, ...).

Skipped without a GPU:

* a training step of a tiered shard (every mode, optimizer and cache policy)
  under ``torch.cuda.set_sync_debug_mode("error")`` after one warm-up step (fbgemm
  reads its optimizer step counter back once, on the first step);
* ``TrainPipelineFusedSparseDist`` on one process (NCCL, world size 1) over tiered
  tables: no synchronizing CUDA call issued from recpipe's pipeline package
  (``set_sync_debug_mode("warn")``; torchrec's own input distribution does sync);
* CUDA lookups and fused updates equal to the CPU kernel and CACHING equal to an
  all-in-HBM table (float tolerance), and the allocated bytes equal
  ``fbgemm_tier_bytes``.
"""

from __future__ import annotations

import os
import socket
import warnings
from typing import Any, Iterator, List, Optional, Tuple

import pytest
import torch

from recpipe.pipeline.placement import FBGEMM_CACHE_ASSOC, FusedOptimizerKind, fbgemm_tier_bytes, shard_storage
from recpipe.pipeline.tiered import native_ops  # registers the fake kernels
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig
from recpipe.pipeline.tiered.tbe_tables import FbgemmTable, Layout, fbgemm_tbe_kwargs, plan_fbgemm_tier

D = 8
ATOL = 2e-5
RTOL = 2e-5
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _opt(name: str = "sgd", **kw: Any) -> TieredOptimizerConfig:
    return TieredOptimizerConfig(optimizer=name, **kw)


# ------------------------------------------------------------ the mapping
@pytest.mark.parametrize(
    "rows, mode, x, policy, layout, tables, sets, algorithm",
    [
        (1000, "CACHING", 0.2, "lru", Layout.CACHING, [(1000, "MANAGED_CACHING", False)], 6, "LRU"),
        (1000, "CACHING", 0.2, "lfu", Layout.CACHING, [(1000, "MANAGED_CACHING", False)], 6, "LFU"),
        (1000, "CACHING", 0.5, "lfu", Layout.CACHING, [(1000, "MANAGED_CACHING", False)], 15, "LFU"),
        (50, "CACHING", 0.3, "lru", Layout.CACHING, [(50, "MANAGED_CACHING", False)], 1, "LRU"),  # 15 slots -> 1 set
        (1000, "HYBRID", 0.3, "lfu", Layout.HYBRID, [(300, "DEVICE", True), (700, "MANAGED", False)], 0, None),
        (7, "HYBRID", 0.1, "lfu", Layout.HYBRID, [(7, "MANAGED", False)], 0, None),  # floor(0.7) = 0 fast rows
        (1000, "HYBRID", 1.0, "lfu", Layout.ALL_FAST, [(1000, "DEVICE", True)], 0, None),
        (1000, "CACHING", 1.0, "lru", Layout.ALL_FAST, [(1000, "DEVICE", True)], 0, None),
    ],
)
def test_plan_maps_placement_to_fbgemm_tables(
    rows: int,
    mode: str,
    x: float,
    policy: str,
    layout: Layout,
    tables: List[Tuple[int, str, bool]],
    sets: int,
    algorithm: Optional[str],
) -> None:
    plan = plan_fbgemm_tier(
        num_rows=rows, embedding_dim=D, mode=mode, cache_load_factor=x, cache_policy=policy, optimizer=_opt()
    )
    assert plan.layout is layout
    assert plan.tables == tuple(FbgemmTable(*t) for t in tables)
    assert (plan.cache_sets, plan.cache_algorithm) == (sets, algorithm)
    assert plan.cache_slots == sets * FBGEMM_CACHE_ASSOC
    # the HYBRID split keeps the placement's fast rows
    assert sum(t.rows for t in plan.tables) == rows
    # CPU plans: the same tables as HOST tables, without a cache
    cpu = plan_fbgemm_tier(
        num_rows=rows,
        embedding_dim=D,
        mode=mode,
        cache_load_factor=x,
        cache_policy=policy,
        optimizer=_opt(),
        compute_device="cpu",
    )
    assert [(t.rows, t.location, t.fast) for t in cpu.tables] == [(r, "HOST", f) for r, _, f in tables]
    assert cpu.cache_sets == 0


@pytest.mark.parametrize(
    "optimizer, optim_type", [("sgd", "EXACT_SGD"), ("rowwise_adagrad", "EXACT_ROWWISE_ADAGRAD"), ("adam", "ADAM")]
)
def test_plan_maps_fused_optimizer_and_hyper_parameters(optimizer: str, optim_type: str) -> None:
    cfg = TieredOptimizerConfig(
        optimizer=optimizer,
        learning_rate=0.03,
        eps=1e-6,
        beta1=0.8,
        beta2=0.95,
        weight_decay=0.01 if optimizer == "adam" else 0.0,
    )
    plan = plan_fbgemm_tier(
        num_rows=100, embedding_dim=D, mode="CACHING", cache_load_factor=0.5, cache_policy="lfu", optimizer=cfg
    )
    assert plan.optim_type == optim_type and plan.optimizer is FusedOptimizerKind(optimizer)
    kw = fbgemm_tbe_kwargs(plan, torch.device("cuda"))
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm, EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice

    assert kw["optimizer"] is EmbOptimType[optim_type]
    assert (kw["learning_rate"], kw["eps"], kw["beta1"], kw["beta2"]) == (0.03, 1e-6, 0.8, 0.95)
    assert kw["weight_decay"] == (0.01 if optimizer == "adam" else 0.0)
    assert kw["embedding_specs"] == [(100, D, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA)]
    assert kw["feature_table_map"] == [0]
    assert kw["cache_algorithm"] is CacheAlgorithm.LFU
    assert kw["cache_sets"] == 1 and kw["cache_load_factor"] == 32 / 100
    assert kw["pooling_mode"] is PoolingMode.SUM
    assert kw["device"] == torch.device("cuda")


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])  # fbgemm's CPU TBE has no Adam
def test_cpu_plan_builds_the_mapped_tbe(optimizer: str) -> None:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    cfg = TieredOptimizerConfig(optimizer=optimizer, learning_rate=0.07, eps=1e-5)
    plan = plan_fbgemm_tier(
        num_rows=101,
        embedding_dim=D,
        mode="HYBRID",
        cache_load_factor=0.4,
        cache_policy="lfu",
        optimizer=cfg,
        compute_device="cpu",
    )
    tbe = SplitTableBatchedEmbeddingBagsCodegen(**fbgemm_tbe_kwargs(plan))
    assert [tuple(w.shape) for w in tbe.split_embedding_weights()] == [(40, D), (61, D)]
    assert tbe.optimizer == EmbOptimType[plan.optim_type]
    assert tbe.get_learning_rate() == pytest.approx(0.07)
    assert tbe.optimizer_args.eps == pytest.approx(1e-5)


def test_plan_refuses_what_fbgemm_cannot_build() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        plan_fbgemm_tier(
            num_rows=10, embedding_dim=6, mode="CACHING", cache_load_factor=0.5, cache_policy="lfu", optimizer=_opt()
        )
    with pytest.raises(ValueError, match="num_rows"):
        plan_fbgemm_tier(
            num_rows=0, embedding_dim=D, mode="CACHING", cache_load_factor=0.5, cache_policy="lfu", optimizer=_opt()
        )
    with pytest.raises(ValueError, match="compute_device"):
        plan_fbgemm_tier(
            num_rows=10,
            embedding_dim=D,
            mode="CACHING",
            cache_load_factor=0.5,
            cache_policy="lfu",
            optimizer=_opt(),
            compute_device="mps",
        )
    with pytest.raises(ValueError, match="backend 'native'"):
        TieredEmbeddingShard(
            num_embeddings=10, embedding_dim=D, mode="HYBRID", cache_load_factor=0.5, device="meta", backend="native"
        )
    with pytest.raises(ValueError, match="backend must be one of"):
        TieredEmbeddingShard(num_embeddings=10, embedding_dim=D, mode="HYBRID", cache_load_factor=0.5, backend="uvm")


# ---------------------------------------------------------------- memory
def test_fbgemm_bytes_hand_computed() -> None:
    # R = 1000, D = 16 fp32 (v = 64 bytes), x = 0.2: 200 planned slots -> 6 sets = 192 slots
    def plan(mode: str, x: float, policy: str, optimizer: str) -> Any:
        return plan_fbgemm_tier(
            num_rows=1000,
            embedding_dim=16,
            mode=mode,
            cache_load_factor=x,
            cache_policy=policy,
            optimizer=_opt(optimizer),
        )

    got = fbgemm_tier_bytes(plan("CACHING", 0.2, "lru", "sgd"))
    assert (got.fast_bytes, got.slow_bytes) == (192 * 64 + 192 * 8 + 1000 * 4 + 192 * 8, 1000 * 64)
    got = fbgemm_tier_bytes(plan("CACHING", 0.2, "lfu", "sgd"))
    assert (got.fast_bytes, got.slow_bytes) == (192 * 64 + 192 * 8 + 1000 * 4 + 1001 * 8, 1000 * 64)
    # row-wise Adagrad: fbgemm keeps the per-row momentum of UVM tables in HBM
    got = fbgemm_tier_bytes(plan("CACHING", 0.2, "lru", "rowwise_adagrad"))
    assert (got.fast_bytes, got.slow_bytes) == (1000 * 4 + 192 * 64 + 192 * 8 + 1000 * 4 + 192 * 8, 1000 * 64)
    # Adam: per-element state follows the table into UVM, the cache holds values only
    got = fbgemm_tier_bytes(plan("CACHING", 0.2, "lru", "adam"))
    assert (got.fast_bytes, got.slow_bytes) == (192 * 64 + 192 * 8 + 1000 * 4 + 192 * 8, 1000 * (64 + 128))
    got = fbgemm_tier_bytes(plan("HYBRID", 0.3, "lfu", "rowwise_adagrad"))
    assert (got.fast_bytes, got.slow_bytes) == (300 * 68 + 700 * 4 + 1000 * 4, 700 * 64)
    # the planner's budget for the same CACHING shard, for comparison
    want = shard_storage(1000, 16, torch.float32, "sgd", "CACHING", 0.2)
    assert (want.fast_bytes, want.slow_bytes) == (200 * 64 + 1000 * 8 + 200 * 16, 1000 * 64)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("mode", ["HYBRID", "CACHING"])
def test_fbgemm_bytes_agree_with_planner_where_state_moves_with_rows(optimizer: str, mode: str) -> None:
    """x = 1 (one DEVICE table) equals shard_storage; HYBRID differs by the 4-byte split map only."""
    for rows in (1, 7, 240, 1000):
        for x in (0.1, 0.5, 1.0):
            plan = plan_fbgemm_tier(
                num_rows=rows,
                embedding_dim=D,
                mode=mode,
                cache_load_factor=x,
                cache_policy="lfu",
                optimizer=_opt(optimizer),
            )
            got = fbgemm_tier_bytes(plan)
            want = shard_storage(rows, D, torch.float32, optimizer, mode, x)
            if x == 1.0:
                assert got == want, (rows, x)
            elif mode == "HYBRID":
                assert (got.fast_bytes, got.slow_bytes) == (want.fast_bytes + 4 * rows, want.slow_bytes), (rows, x)
            else:
                assert got.slow_bytes == want.slow_bytes, (rows, x)


def test_cpu_fbgemm_backend_holds_every_row_once() -> None:
    """On CPU every fbgemm buffer is HOST memory: their total is the planner's fast + slow bytes."""
    for mode, x in (("HYBRID", 0.3), ("CACHING", 0.2), ("HYBRID", 1.0)):
        for optimizer in ("sgd", "rowwise_adagrad"):
            shard = TieredEmbeddingShard(
                num_embeddings=240,
                embedding_dim=D,
                mode=mode,
                cache_load_factor=x,
                optimizer=_opt(optimizer),
                backend="fbgemm",
            )
            got = shard.tier_bytes()
            want = shard_storage(240, D, torch.float32, optimizer, "HYBRID", x)  # no cache metadata on CPU
            split_map = 4 * 240 if mode == "HYBRID" and x < 1 else 0
            assert got.fast_bytes + got.slow_bytes == want.fast_bytes + want.slow_bytes + split_map, (mode, x)


# ------------------------------------------------- fbgemm backend on CPU
def _batches(
    rows: int, steps: int, seed: int, weighted: bool, sequence: bool
) -> Iterator[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.arange(1, rows + 1, dtype=torch.float64).pow(-1.1)
    for _ in range(steps):
        bags = int(torch.randint(1, 24, (1,), generator=gen))
        lengths = torch.ones(bags, dtype=torch.int64) if sequence else torch.randint(0, 6, (bags,), generator=gen)
        n = int(lengths.sum())
        ids = torch.multinomial(probs, max(n, 1), replacement=True, generator=gen)[:n]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        psw = torch.rand(n, generator=gen) if weighted else None
        yield ids, offsets, psw, torch.randn(bags, D, generator=gen)


def _shard(
    backend: Optional[str],
    mode: str,
    x: float,
    optimizer: str,
    pooling: str,
    policy: str,
    rows: int,
    device: str = "cpu",
    **kw: Any,
) -> TieredEmbeddingShard:
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
        split_seed=11,
        device=device,
        backend=backend,
        **kw,
    )


def _export(shard: TieredEmbeddingShard) -> Tuple[torch.Tensor, torch.Tensor, int]:
    st = shard.export_state()
    return st.weights, st.optimizer_state, st.step


CPU_CASES = [
    ("HYBRID", 0.3, "sgd", "sum", "lfu", False, False),
    ("HYBRID", 0.7, "rowwise_adagrad", "mean", "lfu", False, False),
    ("HYBRID", 0.5, "sgd", "sum", "lfu", True, False),  # per-sample weights
    ("HYBRID", 0.05, "rowwise_adagrad", "sum", "lfu", False, False),  # fast rows of a 97-row shard: 4
    ("HYBRID", 1.0, "rowwise_adagrad", "sum", "lfu", False, False),
    ("CACHING", 0.2, "sgd", "sum", "lru", False, False),
    ("CACHING", 0.3, "rowwise_adagrad", "mean", "lfu", False, False),
    ("CACHING", 0.3, "sgd", "sum", "lfu", False, True),  # sequence (EmbeddingCollection) lookups
    ("HYBRID", 0.5, "rowwise_adagrad", "sum", "lfu", False, True),
]


@pytest.mark.parametrize("mode, x, optimizer, pooling, policy, weighted, sequence", CPU_CASES)
def test_fbgemm_backend_on_cpu_equals_native_kernel(
    mode: str, x: float, optimizer: str, pooling: str, policy: str, weighted: bool, sequence: bool
) -> None:
    rows = 97
    native = _shard(None, mode, x, optimizer, pooling, policy, rows)
    fb = _shard("fbgemm", mode, x, optimizer, pooling, policy, rows)
    assert native.backend == "native" and fb.backend == "fbgemm" and fb.tiers.fbgemm is not None
    torch.testing.assert_close(_export(fb)[0], _export(native)[0], atol=0, rtol=0)  # same initial rows
    for step, (ids, offsets, psw, grad) in enumerate(_batches(rows, 8, seed=17, weighted=weighted, sequence=sequence)):
        out_n, out_f = native(ids, offsets, psw), fb(ids, offsets, psw)
        torch.testing.assert_close(out_f, out_n, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {step}: {m}")
        stats_n, stats_f = native.tier_stats(), fb.tier_stats()
        for key in ("lookups", "unique_rows"):
            assert stats_f[key] == stats_n[key], (step, key)
        if mode == "HYBRID":  # the same hashed split: the same rows are fast
            assert stats_f["hit_rate"] == stats_n["hit_rate"], step
            assert stats_f["fast_fraction"] == stats_n["fast_fraction"]
        (out_n * grad).sum().backward()
        (out_f * grad).sum().backward()
    w_n, s_n, step_n = _export(native)
    w_f, s_f, step_f = _export(fb)
    assert step_f == step_n == 8
    assert not torch.equal(w_n, _shard(None, mode, x, optimizer, pooling, policy, rows).export_state().weights)
    torch.testing.assert_close(w_f, w_n, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(s_f, s_n, atol=ATOL, rtol=RTOL)


# Calls that read a CUDA tensor back on the host (or need its data-dependent size).
_HOST_READS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "unique",
    "masked_select",
)
_TORCH_HOST_READS = ("nonzero", "unique", "masked_select", "repeat_interleave")


def _tripwire(monkeypatch: pytest.MonkeyPatch, code_dirs: Tuple[str, ...]) -> List[str]:
    """Makes every host read called directly from a file under ``code_dirs`` fail (recorded)."""
    import sys

    hits: List[str] = []

    def wrap(owner: Any, name: str, cond: Any = None) -> None:
        orig = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            f = sys._getframe(1)
            where = os.path.realpath(f.f_code.co_filename)
            if where.startswith(code_dirs) and (cond is None or cond(args, kwargs)):
                hits.append(f"{name} at {os.path.basename(where)}:{f.f_lineno}")
                raise AssertionError(f"host read {name} at {where}:{f.f_lineno}")
            return orig(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in _HOST_READS:
        wrap(torch.Tensor, name)
    for name in _TORCH_HOST_READS:
        # repeat_interleave syncs unless output_size is given
        wrap(torch, name, (lambda a, k: "output_size" not in k) if name == "repeat_interleave" else None)
    wrap(
        torch.Tensor,
        "__getitem__",  # boolean-mask indexing has a data-dependent size
        lambda a, k: isinstance(a[1], torch.Tensor) and a[1].dtype == torch.bool,
    )
    return hits


@pytest.mark.parametrize(
    "mode, x, optimizer, pooling",
    [
        ("HYBRID", 0.3, "rowwise_adagrad", "sum"),
        ("HYBRID", 0.05, "sgd", "mean"),
        ("HYBRID", 1.0, "sgd", "sum"),
        ("CACHING", 0.2, "rowwise_adagrad", "mean"),
    ],
)
def test_fbgemm_step_code_makes_no_host_read(
    monkeypatch: pytest.MonkeyPatch, mode: str, x: float, optimizer: str, pooling: str
) -> None:
    """The recpipe code a CUDA step runs (the shard's fbgemm forward minus its CPU-only
    input checks, FbgemmTier.forward, and the backward) calls nothing that reads a tensor
    back: checked on CPU by failing every such call made from recpipe's pipeline files.
    (The CACHING branch that reads fbgemm's cache state runs on CUDA only.)"""
    import recpipe.pipeline.tiered.tbe_tables as fbgemm_module

    fb = _shard("fbgemm", mode, x, optimizer, pooling, "lfu", 97)
    native = _shard(None, mode, x, optimizer, pooling, "lfu", 97)
    assert fb.tiers.fbgemm is not None
    pkg_dir = os.path.dirname(os.path.realpath(fbgemm_module.__file__))
    batches = list(_batches(97, 3, seed=2, weighted=False, sequence=False))
    monkeypatch.setattr(fb, "_check_inputs", lambda *a: None)  # CPU-only host checks (error messages)
    hits = _tripwire(monkeypatch, (pkg_dir,))
    outs = []
    for ids, offsets, psw, grad in batches:
        out = fb(ids, offsets, psw)
        (out * grad).sum().backward()
        outs.append(out.detach())
    monkeypatch.undo()
    assert hits == []
    for (ids, offsets, psw, grad), out_f in zip(batches, outs):  # and it computed the right thing
        out_n = native(ids, offsets, psw)
        torch.testing.assert_close(out_f, out_n.detach(), atol=ATOL, rtol=RTOL)
        (out_n * grad).sum().backward()


def test_tripwire_catches_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The detector above fails on the reads the CPU-only checks and the torch path make."""
    here = os.path.dirname(os.path.realpath(__file__))
    hits = _tripwire(monkeypatch, (here,))
    t = torch.tensor([1, 0, 2])
    for read in (
        lambda: t.sum().item(),
        lambda: t.tolist(),
        lambda: bool(t.any()),
        lambda: t[t > 0],
        lambda: torch.unique(t),
        lambda: t.nonzero(),
        lambda: torch.repeat_interleave(t, t),
    ):
        with pytest.raises(AssertionError, match="host read"):
            read()
    torch.repeat_interleave(t, t, output_size=3)  # sized: no read
    monkeypatch.undo()
    assert len(hits) == 7


def test_fbgemm_backend_export_loads_into_native_and_back() -> None:
    fb = _shard("fbgemm", "HYBRID", 0.4, "rowwise_adagrad", "sum", "lfu", 97)
    for ids, offsets, psw, grad in _batches(97, 3, seed=5, weighted=False, sequence=False):
        (fb(ids, offsets, psw) * grad).sum().backward()
    st = fb.export_state()
    native = _shard(None, "CACHING", 0.2, "rowwise_adagrad", "sum", "lfu", 97)
    native.load_states([st])
    back = _shard("fbgemm", "CACHING", 0.5, "rowwise_adagrad", "sum", "lfu", 97)
    back.load_states([native.export_state()])
    again = back.export_state()
    assert again.step == st.step == 3
    assert torch.equal(again.weights, st.weights) and torch.equal(again.optimizer_state, st.optimizer_state)
    # the loaded shard trains on from the loaded state like the native one
    for ids, offsets, psw, grad in _batches(97, 2, seed=6, weighted=False, sequence=False):
        out_n, out_f = native(ids, offsets, psw), back(ids, offsets, psw)
        torch.testing.assert_close(out_f, out_n, atol=ATOL, rtol=RTOL)
        (out_n * grad).sum().backward()
        (out_f * grad).sum().backward()
    torch.testing.assert_close(_export(back)[0], _export(native)[0], atol=ATOL, rtol=RTOL)


def test_fbgemm_backend_module_interface_equals_native() -> None:
    """The TBE is not a submodule: no parameters, the same state_dict keys, loadable from native."""
    fb = _shard("fbgemm", "CACHING", 0.3, "rowwise_adagrad", "sum", "lru", 97)
    native = _shard(None, "HYBRID", 0.5, "rowwise_adagrad", "sum", "lfu", 97)
    for ids, offsets, psw, grad in _batches(97, 2, seed=8, weighted=False, sequence=False):
        (native(ids, offsets, psw) * grad).sum().backward()
    assert list(fb.named_parameters()) == [] and list(fb.named_buffers()) == []
    # fbgemm's cache moves values only; recpipe's moves values and the row-wise Adagrad momentum
    assert (fb.moved_row_bytes, native.moved_row_bytes) == (D * 4, D * 4 + 4)
    assert sorted(fb.state_dict()) == sorted(native.state_dict())
    fb.load_state_dict(native.state_dict())
    assert torch.equal(fb.export_state().weights, native.export_state().weights)
    assert fb.export_state().step == 2


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_fbgemm_backend_undo_lookup_takes_back_its_counters(optimizer: str) -> None:
    """A lookup of the fbgemm backend advances the shard's step, FbgemmTier.step and its TBE's
    ``step`` (and ``iter`` unless SGD); ``undo_lookup`` takes them back, keeping a later
    lookup's, and after a ``load_states`` (which sets the step) takes back only the TBE's own
    ``step``. The native backend counts in the backward: nothing to take back (None)."""
    fb = _shard("fbgemm", "HYBRID", 0.4, optimizer, "sum", "lfu", 97)
    native = _shard(None, "HYBRID", 0.4, optimizer, "sum", "lfu", 97)
    assert native.lookup_counters() is None
    native.undo_lookup(None, None)

    def counters() -> Tuple[int, int, int, int, int]:
        assert fb.tiers.fbgemm is not None
        tbe = fb.tiers.fbgemm.tbe
        return fb.step, fb.tiers.fbgemm.step, tbe.step, int(tbe.iter), int(tbe.iter_cpu)

    batches = list(_batches(97, 3, seed=4, weighted=False, sequence=False))
    ids, offsets, psw, grad = batches[0]
    (fb(ids, offsets, psw) * grad).sum().backward()
    start = counters()
    it = 0 if optimizer == "sgd" else 1
    assert start == (1, 1, 1, it, it)
    before = fb.lookup_counters()
    fb(*batches[1][:3])  # the discarded lookup
    after = fb.lookup_counters()
    (fb(*batches[2][:3]) * batches[2][3]).sum().backward()  # a lookup since: kept
    assert counters() == (3, 3, 3, 3 * it, 3 * it)
    fb.undo_lookup(before, after)
    assert counters() == (2, 2, 2, 2 * it, 2 * it)
    assert fb.export_state().step == 2
    before = fb.lookup_counters()
    fb(*batches[1][:3])
    after = fb.lookup_counters()
    fb.load_states([native.export_state()])  # sets the step (0): the lookup's increments are gone
    fb.undo_lookup(before, after)
    assert counters() == (0, 0, 2, 0, 0)


def test_fbgemm_backend_rejects_ids_outside_the_shard() -> None:
    fb = _shard("fbgemm", "HYBRID", 0.4, "sgd", "sum", "lfu", 97)
    with pytest.raises(IndexError, match="ids out of range"):
        fb(torch.tensor([3, 97]), torch.tensor([0, 2]))


def test_fbgemm_backend_empty_shard() -> None:
    """A rank owning no rows (fewer rows than ranks) has no fbgemm table: empty bags pool to zeros."""
    shard = TieredEmbeddingShard(
        num_embeddings=2,
        embedding_dim=D,
        mode="CACHING",
        cache_load_factor=0.5,
        world_size=4,
        rank=3,
        dist_type="roundrobin",
        backend="fbgemm",
    )
    assert shard.num_rows == 0 and shard.tiers.fbgemm is None
    out = shard(torch.zeros(0, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    assert torch.equal(out, torch.zeros(3, D))
    assert shard.export_state().weights.shape == (0, D)


# ------------------------------------------------------------------- CUDA
CUDA_CASES = [
    (mode, x, optimizer, policy)
    for mode, x, policy in (
        ("CACHING", 0.1, "lru"),
        ("CACHING", 0.1, "lfu"),
        ("HYBRID", 0.3, "lfu"),
        ("HYBRID", 1.0, "lfu"),
    )
    for optimizer in ("sgd", "rowwise_adagrad", "adam")
]


def _cuda_batches(rows: int, steps: int, seed: int) -> List[Tuple[torch.Tensor, torch.Tensor, None, torch.Tensor]]:
    return [
        (i.cuda(), o.cuda(), None, g.cuda())
        for i, o, _, g in _batches(rows, steps, seed=seed, weighted=False, sequence=False)
    ]


@needs_cuda
@pytest.mark.parametrize("mode, x, optimizer, policy", CUDA_CASES)
def test_cuda_training_step_has_no_host_sync(mode: str, x: float, optimizer: str, policy: str) -> None:
    shard = _shard(None, mode, x, optimizer, "sum", policy, 4099, device="cuda")
    assert shard.backend == "fbgemm"
    batches = _cuda_batches(4099, 6, seed=1)
    ids, offsets, psw, grad = batches[0]
    (shard(ids, offsets, psw) * grad).sum().backward()  # warm-up: fbgemm reads its step counter once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ids, offsets, psw, grad in batches[1:]:
            (shard(ids, offsets, psw) * grad).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert shard.tier_stats()["lookups"] == batches[-1][0].numel()  # the host read, after the steps
    k = len(native_ops.TIERED_STATS)
    total = dict(zip(native_ops.TIERED_STATS, shard.tiers.stats[k:].tolist()))  # counted on the device
    assert total["lookups"] == sum(b[0].numel() for b in batches)
    if mode == "CACHING":
        assert total["rows_loaded"] > 0 and 0 < total["hits"] < total["lookups"]
        assert total["rows_written_back"] == total["rows_evicted"]
    elif x < 1.0:
        assert 0 < total["hits"] == total["fast_lookups"] < total["lookups"]
    else:
        assert total["hits"] == total["fast_lookups"] == total["lookups"]


@needs_cuda
@pytest.mark.parametrize("mode, x, optimizer, policy", CUDA_CASES)
def test_cuda_fbgemm_equals_cpu_kernel(mode: str, x: float, optimizer: str, policy: str) -> None:
    rows = 997
    native = _shard(None, mode, x, optimizer, "sum", policy, rows)
    cuda = _shard(None, mode, x, optimizer, "sum", policy, rows, device="cuda")
    for step, (ids, offsets, psw, grad) in enumerate(_batches(rows, 10, seed=9, weighted=False, sequence=False)):
        out_n = native(ids, offsets, psw)
        out_c = cuda(ids.cuda(), offsets.cuda(), None)
        torch.testing.assert_close(out_c.cpu(), out_n, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {step}: {m}")
        (out_n * grad).sum().backward()
        (out_c * grad.cuda()).sum().backward()
    w_n, s_n, step_n = _export(native)
    w_c, s_c, step_c = _export(cuda)
    assert step_c == step_n
    torch.testing.assert_close(w_c, w_n, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(s_c, s_n, atol=ATOL, rtol=RTOL)


@needs_cuda
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cuda_caching_equals_all_in_hbm(optimizer: str, policy: str) -> None:
    rows = 5003
    cached = _shard(None, "CACHING", 0.05, optimizer, "mean", policy, rows, device="cuda")
    hbm = _shard(None, "CACHING", 1.0, optimizer, "mean", policy, rows, device="cuda")
    assert cached.tiers.fbgemm is not None and cached.tiers.fbgemm.plan.layout is Layout.CACHING
    assert hbm.tiers.fbgemm is not None and hbm.tiers.fbgemm.plan.layout is Layout.ALL_FAST
    for ids, offsets, psw, grad in _cuda_batches(rows, 12, seed=4):
        out_c, out_h = cached(ids, offsets, psw), hbm(ids, offsets, psw)
        torch.testing.assert_close(out_c, out_h, atol=ATOL, rtol=RTOL)
        (out_c * grad).sum().backward()
        (out_h * grad).sum().backward()
    assert cached.tier_stats()["cumulative_hit_rate"] < 1.0  # the cache really missed
    torch.testing.assert_close(_export(cached)[0], _export(hbm)[0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(_export(cached)[1], _export(hbm)[1], atol=ATOL, rtol=RTOL)


@needs_cuda
@pytest.mark.parametrize("mode, x, optimizer, policy", CUDA_CASES)
def test_cuda_tier_bytes_equal_fbgemm_formula(mode: str, x: float, optimizer: str, policy: str) -> None:
    shard = _shard(None, mode, x, optimizer, "sum", policy, 4099, device="cuda")
    assert shard.tiers.fbgemm is not None
    assert shard.tier_bytes() == fbgemm_tier_bytes(shard.tiers.fbgemm.plan)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@needs_cuda
def test_cuda_fused_pipeline_issues_no_host_sync_from_recpipe() -> None:
    """TrainPipelineFusedSparseDist over tiered tables on one process (NCCL, world size 1).

    Every synchronizing CUDA call of the measured steps is recorded
    (``set_sync_debug_mode("warn")``); none may be issued from a file of recpipe's
    pipeline package (torchrec's KJT all-to-all reads its splits on the host).
    """
    import torch.distributed as dist
    from harness.pipelines import EMB_DIM, TwoModuleModel, make_batches
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan, ShardingType
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import recpipe.pipeline as pipeline_pkg
    from recpipe.pipeline.tiered.tiered_sharders import (
        TieredEmbeddingBagCollectionSharder,
        TieredEmbeddingCollectionSharder,
    )
    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist
    from recpipe.planner.torchrec_plan import PlacementParameterSharding, row_wise_sharding_spec

    tiered = {"t0": ("ebc", 300, "CACHING", 0.2), "t1": ("ebc", 200, "HYBRID", 0.5), "s0": ("ec", 100, "CACHING", 0.3)}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.manual_seed(5)
        model = TwoModuleModel()
        apply_optimizer_in_backward(
            torch.optim.Adam,
            [model.ebc.embedding_bags[t].weight for t in ("t0", "t1")] + [model.ec.embeddings["s0"].weight],
            {"lr": 0.02},
        )
        plan: dict = {"ebc": {}, "ec": {}}
        for table, (module, rows, mode, x) in tiered.items():
            plan[module][table] = PlacementParameterSharding(
                sharding_type=ShardingType.ROW_WISE.value,
                compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
                ranks=[0],
                sharding_spec=row_wise_sharding_spec(rows, EMB_DIM, 1, 1, "cuda"),
                mode=mode,
                cache_load_factor=x,
                dist_type="hash_roundrobin",
                seed=7,
            )
        dmp = DistributedModelParallel(
            module=model,
            device=device,
            plan=ShardingPlan({k: EmbeddingModuleShardingPlan(v) for k, v in plan.items()}),
            sharders=[TieredEmbeddingBagCollectionSharder(), TieredEmbeddingCollectionSharder()],  # type: ignore[list-item]
        )
        opt = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: torch.optim.Adam(params, lr=0.01)
        )
        pipe = TrainPipelineFusedSparseDist(dmp, opt, device)
        it = iter(make_batches(0, n=8, seed=3))
        for _ in range(3):  # warm-up: pipeline fill, fbgemm's first-step counter read
            pipe.progress(it)
        torch.cuda.synchronize()
        pkg_dir = os.path.dirname(os.path.realpath(pipeline_pkg.__file__))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(3):
                    pipe.progress(it)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        ours = [
            f"{w.filename}:{w.lineno}: {w.message}"
            for w in caught
            if "synchroniz" in str(w.message) and os.path.realpath(w.filename).startswith(pkg_dir)
        ]
        assert not ours, "host syncs issued by recpipe's pipeline:\n" + "\n".join(ours)
        assert all(s.backend == "fbgemm" for s in dmp.module.ebc.tiered_tables().values())
    finally:
        dist.destroy_process_group()
