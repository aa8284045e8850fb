"""A toy implementation plugs into each extension point of the tiered shard (pipeline/interfaces.py).

* ``TierBackend``: a backend registered under a new name with ``register_backend``,
  delegating to the ``torch`` backend and counting lookups, is what
  ``TieredEmbeddingShard(backend=name)`` runs; outputs, updated rows and statistics equal
  the ``torch`` backend's.
* ``RowOptimizer``: a plain SGD written here (not a dataclass, not ``TieredOptimizerConfig``)
  is applied by the ``torch`` backend; the updated rows equal a hand-computed SGD step, and
  the backends that would ignore its ``update`` refuse it.
* ``ShardRouting``: a toy routing (rank ``g % 2``, rows in reverse order) decides which
  global rows a shard holds, for lookups, full-table loads and loads of another routing's
  exports.

Single process, small tables.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import pytest
import torch

from recpipe.pipeline.interfaces import InputCheck, RowOptimizer, ShardRouting, TierBackend, TierSpec, TierTensors
from recpipe.pipeline.tiered.backends import BACKENDS, register_backend
from recpipe.pipeline.tiered.backends.torch_backend import TorchBackend
from recpipe.pipeline.tiered.shard import TieredEmbeddingShard, TieredOptimizerConfig

N, D = 64, 4  # table rows, embedding dim
LR = 0.1


def _bags(seed: int, n_bags: int = 6, max_len: int = 5, rows: int = N) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ids with repeats (within and across bags) in bags of 0..max_len ids, and their B + 1 offsets."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (n_bags,), generator=g)
    ids = torch.randint(0, rows // 4, (int(lengths.sum()),), generator=g)  # few rows: many repeats
    return ids, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])


def _shard(**kwargs: Any) -> TieredEmbeddingShard:
    kwargs.setdefault("dist_type", "roundrobin")  # W = 1 roundrobin: local id == global id
    kwargs.setdefault("mode", "CACHING")
    kwargs.setdefault("cache_load_factor", 0.25)
    torch.manual_seed(0)  # the initial rows: the same for every shard built here
    return TieredEmbeddingShard(num_embeddings=N, embedding_dim=D, **kwargs)


# ---------------------------------------------------------------- TierBackend
class CountingTorchBackend(TierBackend):
    """A ``TierBackend`` holding a ``torch`` backend and forwarding every call to it; counts lookups."""

    name = "counting_torch"
    calls_optimizer_update = True

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.inner = TorchBackend(spec)
        self.lookups = 0

    @property  # type: ignore[override]
    def stats(self) -> torch.Tensor:
        return self.inner.stats

    @property  # type: ignore[override]
    def step(self) -> int:
        return self.inner.step

    @property  # type: ignore[override]
    def flushed_rows(self) -> int:
        return self.inner.flushed_rows

    @property
    def moved_row_bytes(self) -> int:
        return self.inner.moved_row_bytes

    def tier_tensors(self) -> TierTensors:
        return self.inner.tier_tensors()

    def lookup(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor],
        optimizer: RowOptimizer,
        check: InputCheck,
    ) -> torch.Tensor:
        self.lookups += 1
        return self.inner.lookup(ids, offsets, per_sample_weights, optimizer, check)

    def read_rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.inner.read_rows()

    def write_rows(
        self, weights: torch.Tensor, state: Optional[torch.Tensor], rows: Optional[torch.Tensor] = None
    ) -> None:
        self.inner.write_rows(weights, state, rows)

    def empty_cache(self) -> None:
        self.inner.empty_cache()

    def flush(self) -> int:
        return self.inner.flush()

    def set_optimizer_step(self, step: int) -> None:
        self.inner.set_optimizer_step(step)

    def load_step(self, step: int) -> None:
        self.inner.load_step(step)

    def set_learning_rate(self, lr: float) -> None:
        self.inner.set_learning_rate(lr)

    def update_hyper_parameters(self, params: Mapping[str, float]) -> None:
        self.inner.update_hyper_parameters(params)


@pytest.fixture
def counting_backend() -> Iterator[str]:
    assert register_backend(CountingTorchBackend) is CountingTorchBackend
    try:
        yield CountingTorchBackend.name
    finally:
        BACKENDS.pop(CountingTorchBackend.name)


def _train(shard: TieredEmbeddingShard, steps: int) -> List[torch.Tensor]:
    outs = []
    for step in range(steps):
        ids, offsets = _bags(step)
        out = shard(ids, offsets)
        (out * torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)).sum().backward()
        outs.append(out.detach())
    return outs


def test_registered_backend_is_used_and_matches_the_torch_backend(counting_backend: str) -> None:
    optimizer = {"optimizer": "adam", "learning_rate": LR}
    toy = _shard(backend=counting_backend, optimizer=TieredOptimizerConfig(**optimizer))
    ref = _shard(backend="torch", optimizer=TieredOptimizerConfig(**optimizer))
    assert isinstance(toy.tiers, CountingTorchBackend) and toy.backend == counting_backend
    got, want = _train(toy, 5), _train(ref, 5)
    assert toy.tiers.lookups == 5
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}: outputs differ"
    mine, theirs = toy.export_state(), ref.export_state()
    assert torch.equal(mine.weights, theirs.weights) and torch.equal(mine.optimizer_state, theirs.optimizer_state)
    assert mine.step == theirs.step == 5
    assert toy.tier_stats() == ref.tier_stats()
    # the rows moved: the comparison has teeth
    assert not torch.equal(mine.weights, _shard(backend="torch").export_state().weights)


def test_register_backend_refuses_a_taken_name_and_a_non_backend() -> None:
    class Impostor(CountingTorchBackend):
        name = "torch"

    with pytest.raises(ValueError, match=r"the name 'torch' is taken by TorchBackend; give .*Impostor another name"):
        register_backend(Impostor)
    with pytest.raises(ValueError, match="cls must be a subclass of recpipe.pipeline.interfaces.TierBackend"):
        register_backend(dict)  # type: ignore[arg-type]
    assert BACKENDS["torch"] is TorchBackend
    with pytest.raises(ValueError, match=r"backend must be one of \['native', 'fbgemm', 'torch'\]"):
        _shard(backend="counting_torch")  # not registered outside the fixture


# ---------------------------------------------------------------- RowOptimizer
class PlainSGD:
    """``w <- w - lr * g``: a RowOptimizer written without recpipe's TieredOptimizerConfig."""

    def __init__(self, learning_rate: float) -> None:
        self.learning_rate = learning_rate
        self.eps, self.beta1, self.beta2, self.weight_decay = 0.0, 0.0, 0.0, 0.0
        # the steps it applied; shared with the copy a lookup takes (its hyper-parameters, as fbgemm's TBE)
        self.steps: List[int] = []

    @property
    def name(self) -> str:
        return "sgd"

    def state_cols(self, dim: int) -> int:
        return 0

    def update(self, weights: torch.Tensor, state: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        self.steps.append(step)
        weights.copy_(weights - self.learning_rate * grad)


def _sgd_by_hand(
    w0: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, upstream: torch.Tensor, lr: float
) -> torch.Tensor:
    """The rows after one SGD step on ``sum(sum-pooled bags * upstream)``: row r's gradient is
    the sum of ``upstream[bag]`` over its occurrences."""
    grad = torch.zeros_like(w0)
    for bag in range(offsets.numel() - 1):
        for i in ids[offsets[bag] : offsets[bag + 1]].tolist():
            grad[i] += upstream[bag]
    return w0 - lr * grad


@pytest.mark.parametrize("mode, x", [("HYBRID", 0.5), ("CACHING", 0.25), ("HYBRID", 1.0)])
def test_plugged_row_optimizer_updates_rows_as_hand_computed_sgd(mode: str, x: float) -> None:
    sgd = PlainSGD(LR)
    shard = _shard(backend="torch", optimizer=sgd, mode=mode, cache_load_factor=x)
    assert isinstance(sgd, RowOptimizer) and shard.optimizer is sgd
    w0 = torch.randn(N, D, generator=torch.Generator().manual_seed(1))
    shard.load_global_weights(w0)
    ids, offsets = _bags(7)
    upstream = torch.randn(offsets.numel() - 1, D, generator=torch.Generator().manual_seed(2))
    out = shard(ids, offsets)
    want_out = torch.stack([w0[ids[offsets[b] : offsets[b + 1]]].sum(0) for b in range(offsets.numel() - 1)])
    torch.testing.assert_close(out, want_out)
    (out * upstream).sum().backward()
    assert sgd.steps == [1]
    state = shard.export_state()
    got = torch.empty_like(w0)
    got[state.global_ids] = state.weights
    torch.testing.assert_close(got, _sgd_by_hand(w0, ids, offsets, upstream, LR))
    assert not torch.equal(got, w0)
    # fbgemm-style controls reach the plugged optimizer: the next step uses lr 0.5
    shard.update_hyper_parameters({"lr": 0.5})
    assert sgd.learning_rate == 0.5
    shard(ids, offsets).mul(upstream).sum().backward()
    assert sgd.steps == [1, 2]
    state = shard.export_state()
    again = torch.empty_like(w0)
    again[state.global_ids] = state.weights
    torch.testing.assert_close(again, _sgd_by_hand(got, ids, offsets, upstream, 0.5))


class WideStateSGD(PlainSGD):
    def state_cols(self, dim: int) -> int:
        return 1


class LambNamedSGD(PlainSGD):
    @property
    def name(self) -> str:
        return "lamb"


def test_plugged_row_optimizer_refusals_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"backend 'native' runs its own sgd kernel and would ignore PlainSGD\.update"):
        _shard(optimizer=PlainSGD(LR))  # native: the CPU default
    with pytest.raises(ValueError, match=r"WideStateSGD\.state_cols\(4\) is 1, but sgd keeps 0 fp32 state columns"):
        _shard(backend="torch", optimizer=WideStateSGD(LR))
    with pytest.raises(ValueError, match="optimizer must be a RowOptimizer .* got dict"):
        _shard(optimizer={"optimizer": "sgd"})
    with pytest.raises(ValueError, match=r"LambNamedSGD\.name must be one of \['adam', 'rowwise_adagrad', 'sgd'\]"):
        _shard(backend="torch", optimizer=LambNamedSGD(LR))


# ---------------------------------------------------------------- ShardRouting
class ParityReversedRouting(ShardRouting):
    """Global id ``g`` on rank ``g % 2`` at local row ``rows - 1 - g // 2`` (rows in reverse order)."""

    def __init__(self, num_embeddings: int, rank: int) -> None:
        self.num_embeddings, self.world_size, self.rank = num_embeddings, 2, rank
        self.dist_type, self.seed = "parity_reversed", 0
        self._rows = (num_embeddings - rank + 1) // 2

    @property
    def num_rows(self) -> int:
        return self._rows

    def global_ids(self, local: torch.Tensor) -> torch.Tensor:
        return 2 * (self._rows - 1 - local.to(torch.int64)) + self.rank

    def route(self, global_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        g = global_ids.to(torch.int64)
        owner = g % 2
        rows = (self.num_embeddings - owner + 1) // 2
        return owner, rows - 1 - g // 2

    def metadata(self) -> Dict[str, Any]:
        return {
            "dist_type": self.dist_type,
            "routing_seed": 0,
            "routing_version": 1,
            "world_size": 2,
            "rank": self.rank,
        }


@pytest.mark.parametrize("rank", [0, 1])
def test_plugged_routing_decides_the_rows_a_shard_holds(rank: int) -> None:
    w0 = torch.randn(N, D, generator=torch.Generator().manual_seed(3))
    shard = _shard(routing=ParityReversedRouting(N, rank), mode="HYBRID", cache_load_factor=0.5)
    assert (shard.rank, shard.world_size, shard.num_rows) == (rank, 2, N // 2)
    assert shard.metadata()["dist_type"] == "parity_reversed"
    # the global id of every local row, written out independently of the routing's code
    held = [N - 2 + rank - 2 * local for local in range(N // 2)]
    assert shard.export_state().global_ids.tolist() == held
    shard.load_global_weights(w0)
    one_each = torch.arange(N // 2), torch.arange(N // 2 + 1)  # one local id per bag
    assert torch.equal(shard(*one_each).detach(), w0[held])
    # an export of the built-in hash routing (W = 1) loads by global id into the toy routing
    src = TieredEmbeddingShard(num_embeddings=N, embedding_dim=D, mode="HYBRID", cache_load_factor=0.5)
    w1 = torch.randn(N, D, generator=torch.Generator().manual_seed(4))
    src.load_global_weights(w1)
    shard.load_states([src.export_state()])
    assert torch.equal(shard(*one_each).detach(), w1[held])


def test_routing_that_is_not_a_shard_routing_is_refused() -> None:
    with pytest.raises(ValueError, match="routing must be a ShardRouting .* got dict; subclass ShardRouting"):
        _shard(routing={"rank": 0})
