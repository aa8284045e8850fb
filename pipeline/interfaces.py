"""Extension points of the pipeline: the interfaces a new implementation fills in.

:class:`TierBackend` (a tiered shard's storage and kernels, registered by name with
``recpipe.pipeline.tiered.backends.register_backend``), :class:`ShardRouting` (global id <->
local row; ``TieredEmbeddingShard(routing=)``), :class:`RowOptimizer` (the fused optimizer;
``TieredEmbeddingShard(optimizer=)``) and :class:`CheckpointStorage`. Imports only
``recpipe.pipeline.placement`` (and torch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, FrozenSet, List, Mapping, Optional, Protocol, Tuple, runtime_checkable

import torch

from recpipe.pipeline.placement import CachePolicy, Mode, tier_rows

__all__ = ["InputCheck", "RowOptimizer", "ShardRouting", "TierBackend", "TierSpec", "TierTensors"]

#: Every tensor a backend allocated: ``{"fast" | "slow" | "counters": [(name, tensor), ...]}``.
TierTensors = Dict[str, List[Tuple[str, torch.Tensor]]]

#: The shard's host checks of a lookup's ``(ids, offsets, per_sample_weights)``, naming the table.
InputCheck = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], None]


@runtime_checkable
class RowOptimizer(Protocol):
    """A tiered shard's fused row optimizer: its kind, hyper-parameters and update.

    ``recpipe.pipeline.tiered.optim.TieredOptimizerConfig`` is the built-in one. ``name`` is
    one of the built-in kinds, whose row state layout (``state_cols``) the optimizer keeps:
    exports, checkpoints and the byte formulas read it. Backends whose
    ``TierBackend.calls_optimizer_update`` is True (``torch``) apply :meth:`update`; the others
    (``native``, ``fbgemm``) run their compiled kernel of the kind with the hyper-parameters and
    take only ``TieredOptimizerConfig``.
    """

    learning_rate: float
    eps: float
    beta1: float
    beta2: float
    weight_decay: float

    @property
    def name(self) -> str:
        """The kind (``sgd``, ``rowwise_adagrad``, ``adam``: a ``FusedOptimizerKind`` value)."""

    def state_cols(self, dim: int) -> int:
        """fp32 optimizer-state columns per row of width ``dim`` (the kind's layout)."""

    def update(self, weights: torch.Tensor, state: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        """Applies one update in place to gathered ``[n, dim]`` rows and their ``[n, state_cols]``
        state; ``grad`` is summed per unique row, ``step`` is 1-based."""


@dataclass(frozen=True)
class TierSpec:
    """The rows a backend stores and how: one shard's geometry, placement and live optimizer."""

    num_rows: int
    embedding_dim: int
    dtype: torch.dtype
    mode: Mode
    cache_load_factor: float
    cache_policy: CachePolicy
    pooling: str
    optimizer: RowOptimizer
    device: torch.device
    split_seed: int
    table_name: str

    @property
    def tiers(self) -> Tuple[int, int, int]:
        """``(fast rows, slow rows, cache slots)``."""
        return tier_rows(self.num_rows, self.mode, self.cache_load_factor)

    @property
    def all_fast(self) -> bool:
        """Every row lives in the fast tier (``x == 1``)."""
        _, slow, slots = self.tiers
        return slow == 0 and slots == 0

    @property
    def caching(self) -> bool:
        """A CACHING shard with a cache smaller than the table."""
        return self.mode is Mode.CACHING and self.cache_load_factor < 1.0

    @property
    def state_cols(self) -> int:
        """fp32 optimizer-state columns per row."""
        return self.optimizer.state_cols(self.embedding_dim)


class TierBackend(ABC):
    """Storage and kernels of one tiered shard's rows (local ids ``[0, num_rows)``)."""

    #: Registry name (``TieredEmbeddingShard(backend=name)``).
    name: ClassVar[str]
    #: Device types on which this backend is the default (``"*"``: any device without one).
    default_devices: ClassVar[FrozenSet[str]] = frozenset()
    #: The backward applies ``RowOptimizer.update`` (any ``RowOptimizer`` plugs in); False: the
    #: backend's kernels implement the built-in optimizers and a shard gives it only
    #: ``TieredOptimizerConfig``.
    calls_optimizer_update: ClassVar[bool] = False

    spec: TierSpec
    #: int64 counters on the device: the last lookup's ``TIERED_STATS``, then running totals.
    stats: torch.Tensor
    #: The optimizer step the shard records and exports.
    step: int
    #: Rows written back by flushes since the last lookup.
    flushed_rows: int

    def __init__(self, spec: TierSpec) -> None:
        """Allocates the rows of ``spec`` (a backend is built from its shard's ``TierSpec``)."""
        self.spec = spec

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        """Raises ValueError naming the fix when this backend cannot run on ``device``."""

    @property
    @abstractmethod
    def moved_row_bytes(self) -> int:
        """Bytes a cache load or write-back moves per row."""

    @abstractmethod
    def tier_tensors(self) -> TierTensors:
        """Every tensor allocated: the fast and slow tiers' buffers and the counters."""

    @abstractmethod
    def lookup(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor],
        optimizer: RowOptimizer,
        check: InputCheck,
    ) -> torch.Tensor:
        """Pooled ``[B, embedding_dim]`` lookup of local ids (``B + 1`` offsets); its backward
        applies ``optimizer`` to the rows in place."""

    @abstractmethod
    def read_rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every row's value and fp32 state, in local-id order (the caller flushes first)."""

    @abstractmethod
    def write_rows(
        self, weights: torch.Tensor, state: Optional[torch.Tensor], rows: Optional[torch.Tensor] = None
    ) -> None:
        """Sets local ``rows`` (None: every row, in local-id order) to ``weights`` and ``state``
        (None: zeros). Only with the cache empty (:meth:`empty_cache`)."""

    @abstractmethod
    def empty_cache(self) -> None:
        """Drops every cached row without writing it back."""

    @abstractmethod
    def flush(self) -> int:
        """Writes every dirty cached row back to the slow tier; returns the rows written."""

    @abstractmethod
    def set_optimizer_step(self, step: int) -> None:
        """Sets the recorded step as fbgemm's ``set_optimizer_step``."""

    @abstractmethod
    def load_step(self, step: int) -> None:
        """Sets the step of loaded rows: the next update is step ``step + 1``."""

    def export_step(self) -> int:
        """The step an export records."""
        return self.step

    def set_learning_rate(self, lr: float) -> None:
        """Forwards a learning-rate change to kernels that keep their own copy."""

    def update_hyper_parameters(self, params: Mapping[str, float]) -> None:
        """Forwards hyper-parameter changes to kernels that keep their own copy."""

    def lookup_counters(self) -> Optional[Any]:
        """Host snapshot of the counters a lookup advances (None: a lookup advances none)."""
        return None

    def undo_lookup(self, before: Optional[Any], after: Optional[Any]) -> None:
        """Takes back one discarded lookup's counters (:meth:`lookup_counters` before / after it)."""


class ShardRouting(ABC):
    """Which rows of a table one shard holds: global id <-> (owner rank, local row)."""

    num_embeddings: int
    world_size: int
    rank: int
    dist_type: str
    seed: int

    @property
    @abstractmethod
    def num_rows(self) -> int:
        """Local rows of this shard."""

    @abstractmethod
    def global_ids(self, local: torch.Tensor) -> torch.Tensor:
        """Global id of local rows of this shard (int64, same shape)."""

    @abstractmethod
    def route(self, global_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(owner rank, local row)`` of global ids (int64 CPU tensors)."""

    @abstractmethod
    def metadata(self) -> Dict[str, Any]:
        """``dist_type``, ``routing_seed``, ``routing_version``, ``world_size``, ``rank`` for exports."""

    def routes_as(self, metadata: Mapping[str, Any]) -> bool:
        """Whether an export's metadata describes this routing of a table of the same size (rank
        ``r``'s export then holds exactly rank ``r``'s rows, in local-id order)."""
        mine = self.metadata()
        return (
            metadata.get("num_embeddings") == self.num_embeddings
            and all(metadata.get(k) == mine[k] for k in ("world_size", "dist_type", "routing_seed"))
            and int(metadata.get("routing_version", 1)) == mine["routing_version"]
        )


class CheckpointStorage(Protocol):
    """Where a checkpoint's own records (digests, ``latest`` marker) go and how stale files are
    removed; DCP's data files go through DCP's own storage writer."""

    def write_atomic(self, path: Any, data: bytes) -> None:
        """Writes ``data`` atomically and durably: a reader sees the old file or the new one."""

    def names(self, directory: Any) -> List[str]:
        """The file names in ``directory`` (empty when it cannot be listed)."""

    def remove_files(self, directory: Any, doomed: Callable[[str], bool]) -> None:
        """Removes the files of ``directory`` whose name ``doomed`` accepts, ignoring errors."""
