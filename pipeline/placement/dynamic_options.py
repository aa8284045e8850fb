"""The options of a dynamic table: raw int64 keys in a scored hash storage (``docs/dynamic.md``).

:class:`DynamicTableOptions` marks a table dynamic (``recpipe.planner.PlacementConstraints(dynamic=)``)
and travels to the runtime inside the table's fused params (:meth:`DynamicTableOptions.to_fused_param`,
a JSON string, since torchrec hashes, deep-copies and compares fused params). Imports only this package.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional, Tuple

__all__ = [
    "ADMISSION_CAPACITY_DIVISOR",
    "BUCKET_SLOTS",
    "DYNAMIC_EVICTIONS",
    "DYNAMIC_INIT_MODES",
    "DYNAMIC_ON_FULL",
    "DynamicInitializer",
    "DynamicTableOptions",
    "INDEX_BYTES_PER_SLOT",
    "dynamic_counter_slots",
    "dynamic_index_bytes",
    "dynamic_local_slots",
]

#: Slots per bucket of the hash index: a key lives in one bucket, and a full bucket evicts its lowest score.
BUCKET_SLOTS: int = 16
#: Index bytes per slot: the int64 key and the int64 score (bucket headers: 8 bytes per ``BUCKET_SLOTS``).
INDEX_BYTES_PER_SLOT: int = 16
#: The admission counter table's default keys: the table capacity over this (its bytes per row of the table
#: are ``INDEX_BYTES_PER_SLOT / ADMISSION_CAPACITY_DIVISOR``).
ADMISSION_CAPACITY_DIVISOR: int = 4
#: Eviction scores: ``lru`` (last training lookup), ``lfu`` (occurrences), ``step`` (the table's optimizer
#: step at the last access), ``custom`` (a score the user sets).
DYNAMIC_EVICTIONS: Tuple[str, ...] = ("lru", "lfu", "step", "custom")
#: What a key that finds no slot (every slot of its bucket used by the same batch) gets.
DYNAMIC_ON_FULL: Tuple[str, ...] = ("error", "warning", "ignore")
#: Initial value distributions of a new row.
DYNAMIC_INIT_MODES: Tuple[str, ...] = ("uniform", "normal", "constant")


def _finite(name: str, value: Any, allow_none: bool = True) -> Optional[float]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"DynamicInitializer.{name} must be a finite number{' or None' * allow_none}, got {value!r}.")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class DynamicInitializer:
    """The value of a new row: a pure function of ``(seed, table, key)`` (``docs/dynamic.md``), so it does not
    depend on the world size, the routing or the order keys arrive in."""

    mode: str = "uniform"
    """``uniform`` over ``[lower, upper]``, ``normal(mean, std)`` (clamped to ``[lower, upper]`` when set) or
    ``constant`` (``value``)."""
    mean: float = 0.0
    """Mean of ``normal``."""
    std: float = 1.0
    """Standard deviation of ``normal`` (> 0)."""
    lower: Optional[float] = None
    """Lower bound (``uniform``: default ``-sqrt(1 / num_embeddings)``, torchrec's default range)."""
    upper: Optional[float] = None
    """Upper bound (``uniform``: default ``+sqrt(1 / num_embeddings)``)."""
    value: float = 0.0
    """The value of ``constant``."""

    def __post_init__(self) -> None:
        if self.mode not in DYNAMIC_INIT_MODES:
            raise ValueError(
                f"DynamicInitializer.mode must be one of {list(DYNAMIC_INIT_MODES)}, got {self.mode!r}; "
                "e.g. DynamicInitializer(mode='uniform')."
            )
        for name in ("mean", "std", "value"):
            object.__setattr__(self, name, _finite(name, getattr(self, name), allow_none=False))
        for name in ("lower", "upper"):
            object.__setattr__(self, name, _finite(name, getattr(self, name)))
        if self.std <= 0:
            raise ValueError(f"DynamicInitializer.std must be > 0, got {self.std!r}.")
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            raise ValueError(f"DynamicInitializer.lower={self.lower} exceeds upper={self.upper}; swap them.")

    def bounds(self, num_embeddings: int) -> Tuple[float, float]:
        """``(lower, upper)`` of ``uniform`` (torchrec's ``+-sqrt(1 / num_embeddings)`` where unset); for ``normal``
        the clamp (infinite where unset)."""
        if self.mode == "uniform":
            bound = math.sqrt(1.0 / max(num_embeddings, 1))
            return (-bound if self.lower is None else self.lower, bound if self.upper is None else self.upper)
        return (-math.inf if self.lower is None else self.lower, math.inf if self.upper is None else self.upper)


def _check_int(name: str, value: Any, minimum: int, maximum: int = 2**63 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not minimum <= int(value) <= maximum:
        raise ValueError(f"DynamicTableOptions.{name} must be an int in [{minimum}, {maximum}], got {value!r}.")
    return int(value)


@dataclass(frozen=True, kw_only=True)
class DynamicTableOptions:
    """Marks a table dynamic: its ids are raw int64 keys, given a row on first sight (after admission) and
    evicted by score when their bucket is full. ``recpipe.planner.PlacementConstraints(dynamic=...)``."""

    capacity: Optional[int] = None
    """Rows over all ranks (default: the table's ``num_embeddings``). Each shard holds
    ``ceil(capacity / shards)`` rounded up to whole buckets of :data:`BUCKET_SLOTS`."""
    eviction: str = "lru"
    """Score a full bucket evicts the lowest of: one of :data:`DYNAMIC_EVICTIONS`."""
    admit_after: int = 1
    """Sightings (training occurrences) before a key gets a row; 1: at once."""
    admission_capacity: Optional[int] = None
    """Keys over all ranks whose sightings the admission counter table holds while ``admit_after > 1``
    (default: ``capacity / ADMISSION_CAPACITY_DIVISOR``); a key whose counter bucket is full takes the
    counter of the key seen least (that key's count restarts)."""
    initializer: DynamicInitializer = field(default_factory=DynamicInitializer)
    """The value of a new row."""
    on_full: str = "warning"
    """A key that finds no slot (its bucket's slots all used by the same batch): ``error`` raises before any
    state changes, ``warning`` warns, ``ignore`` is silent; the key pools as nothing."""
    seed: int = 0
    """Seed of the bucket hash, the admission hash and the initial values."""

    def __post_init__(self) -> None:
        if self.capacity is not None:
            object.__setattr__(self, "capacity", _check_int("capacity", self.capacity, 1))
        if self.admission_capacity is not None:
            object.__setattr__(self, "admission_capacity", _check_int("admission_capacity", self.admission_capacity, 1))
        if self.eviction not in DYNAMIC_EVICTIONS:
            raise ValueError(
                f"DynamicTableOptions.eviction must be one of {list(DYNAMIC_EVICTIONS)}, got {self.eviction!r}."
            )
        if self.on_full not in DYNAMIC_ON_FULL:
            raise ValueError(
                f"DynamicTableOptions.on_full must be one of {list(DYNAMIC_ON_FULL)}, got {self.on_full!r}."
            )
        object.__setattr__(self, "admit_after", _check_int("admit_after", self.admit_after, 1, 2**31 - 1))
        object.__setattr__(self, "seed", _check_int("seed", self.seed, -(2**63)))
        if not isinstance(self.initializer, DynamicInitializer):
            raise ValueError(
                "DynamicTableOptions.initializer must be a recpipe.pipeline.DynamicInitializer, got "
                f"{type(self.initializer).__name__}; e.g. DynamicInitializer(mode='normal', std=0.01)."
            )

    def table_capacity(self, num_embeddings: int) -> int:
        """Rows over all ranks: :attr:`capacity`, or ``num_embeddings``."""
        return self.capacity if self.capacity is not None else num_embeddings

    def counter_capacity(self, num_embeddings: int) -> int:
        """Keys over all ranks the admission counter table holds: 0 without admission (``admit_after == 1``),
        else :attr:`admission_capacity`, or the table capacity over :data:`ADMISSION_CAPACITY_DIVISOR`."""
        if self.admit_after == 1:
            return 0
        if self.admission_capacity is not None:
            return self.admission_capacity
        return max(1, self.table_capacity(num_embeddings) // ADMISSION_CAPACITY_DIVISOR)

    def to_fused_param(self) -> str:
        """The fused-param encoding: a JSON string (torchrec groups tables by their fused params, which must
        hash, and deep-copies them)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_fused_param(cls, value: Any) -> "DynamicTableOptions":
        """Parses :meth:`to_fused_param`'s string (or its dict; an instance passes through).

        Raises:
            ValueError: not such a string or dict, or a bad field.
        """
        if isinstance(value, DynamicTableOptions):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"not a DynamicTableOptions JSON string: {e}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"expected DynamicTableOptions or its dict, got {type(value).__name__}")
        fields_ = dict(value)
        init = fields_.pop("initializer", None)
        if init is not None and not isinstance(init, DynamicInitializer):
            if not isinstance(init, Mapping):
                raise ValueError(f"initializer must be a dict, got {type(init).__name__}")
            init = DynamicInitializer(**dict(init))
        try:
            return cls(**fields_, **({"initializer": init} if init is not None else {}))
        except TypeError as e:
            raise ValueError(str(e)) from None


def dynamic_local_slots(capacity: int, shards: int) -> int:
    """Slots of one shard of a dynamic table of ``capacity`` rows over ``shards`` shards: ``ceil(capacity /
    shards)`` rounded up to whole buckets."""
    per_shard = -(-capacity // max(shards, 1))
    return -(-per_shard // BUCKET_SLOTS) * BUCKET_SLOTS


def dynamic_counter_slots(options: DynamicTableOptions, num_embeddings: int, shards: int) -> int:
    """Slots of one shard's admission counter table (0 without admission): ``options.counter_capacity`` over
    ``shards``, rounded up to whole buckets as :func:`dynamic_local_slots` rounds."""
    capacity = options.counter_capacity(num_embeddings)
    return dynamic_local_slots(capacity, shards) if capacity else 0


def dynamic_index_bytes(slots: int, counter_slots: int = 0) -> int:
    """Bytes of a shard's hash index of ``slots`` slots: keys and scores, one int64 bucket header per bucket;
    plus, with admission, its counter table of ``counter_slots`` slots (:func:`dynamic_counter_slots`), laid
    out alike."""

    def table(n: int) -> int:
        return n * INDEX_BYTES_PER_SLOT + (n // BUCKET_SLOTS) * 8

    return table(slots) + table(counter_slots)
