"""The placement contract between the planner (writer) and the tiered runtime (reader).

``recpipe.planner`` plans tables for the runtime and writes one
:class:`PlacementParams` into each table's torchrec ``ParameterSharding``
(``recpipe.planner.sharding.PlacementParameterSharding``); torchrec merges it into
the table's fused params (``get_additional_fused_params``) and the sharders
(``recpipe.pipeline.routing.sharding`` / ``recpipe.pipeline.tiered.sharders``) read it back with
:meth:`PlacementParams.from_fused_params`, validating every value, and check it
against what the model actually trains (:meth:`PlacementParams.check_runtime`).

This module is the bottom of ``recpipe.pipeline``: it imports nothing else of
recpipe (not even the extension), so the planner can load it without the kernels.
Everything that crosses the contract is defined here, once:

* the enums :class:`Mode`, :class:`DistType`, :class:`CachePolicy`,
  :class:`FusedOptimizer` (``str`` enums: a member equals its value, so
  ``DistType.HASH_ROUNDROBIN == "hash_roundrobin"``) and :func:`parse_enum`;
* the fused-param keys ``FUSED_PARAM_*`` (:data:`FUSED_PARAM_KEYS`, and the sharders'
  :data:`FUSED_PARAM_RUNTIME_KEYS`);
* the byte formulas (THE single source of truth, see below), which
  ``recpipe.planner.storage`` re-exports;
* :class:`PlacementParams` and its errors :class:`PlacementContractError` /
  :class:`PlacementMismatchError`.

Byte accounting. Every number of bytes the planner budgets, and every buffer the
tiered-storage runtime allocates, comes from the functions below. The runtime
must allocate exactly ``shard_storage(...)`` bytes per tier (its tests check
equality), so change a formula here and both sides move together.

Vocabulary:

* **fast tier**: device HBM on CUDA (a host buffer standing in for it on CPU).
* **slow tier**: host DDR, shared by the ``local_world_size`` ranks of a machine.
* **local rows**: rows a rank owns under ``roundrobin`` / ``hash_roundrobin``
  routing, where global (hashed) id ``h`` lives on rank ``h % W`` at local id
  ``h // W``.
* **HYBRID**: a static split. ``floor(x * rows)`` rows live in the fast tier, the
  rest in the slow tier; no metadata.
* **CACHING**: the full table lives in the slow tier (backing store) and
  ``floor(x * rows)`` fast-tier slots cache rows, with a row -> slot map and
  per-slot metadata in the fast tier.
* ``x == 1.0``: every row in the fast tier, no slow tier, no cache (both modes
  collapse to "all in HBM").
"""

from __future__ import annotations

import enum
import functools
import math
import operator
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any, Callable, Dict, FrozenSet, Mapping, Optional, Tuple, Type, TypeVar, Union

import torch

__all__ = [
    "CACHE_ROW_MAP_BYTES",
    "CACHE_SLOT_BYTES",
    "FUSED_PARAM_BACKEND",
    "FUSED_PARAM_CACHE_LOAD_FACTOR",
    "FUSED_PARAM_CACHE_POLICY",
    "FUSED_PARAM_DIST_TYPE",
    "FUSED_PARAM_DTYPE",
    "FUSED_PARAM_KEYS",
    "FUSED_PARAM_MODE",
    "FUSED_PARAM_OPTIMIZER",
    "FUSED_PARAM_PREFIX",
    "FUSED_PARAM_RUNTIME_KEYS",
    "FUSED_PARAM_SEED",
    "ROUTED_DIST_TYPES",
    "TIERED_DTYPES",
    "DIST_TYPES",
    "CachePolicy",
    "DistType",
    "FusedOptimizer",
    "Mode",
    "PlacementContractError",
    "PlacementMismatchError",
    "PlacementParams",
    "ShardStorage",
    "check_load_factor",
    "check_load_factors",
    "decimal_ratio",
    "dtype_itemsize",
    "dtype_name",
    "check_int",
    "floor_fraction",
    "local_rows",
    "machine_storage",
    "machine_sum",
    "max_local_rows",
    "optimizer_state_bytes_per_row",
    "parse_enum",
    "resolve_dtype",
    "row_bytes",
    "shard_storage",
    "tier_rows",
]

#: Name -> code of the routing op's ``dist_types`` tensor (csrc/bucketize_math.h
#: ``DistType``; :mod:`recpipe.pipeline.routing.ops` checks the extension agrees).
DIST_TYPES: Dict[str, int] = {"continuous": 0, "roundrobin": 1, "hash_roundrobin": 2}


def check_int(value: Any, argument: str, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    """``value`` as a Python int, or a ValueError naming ``argument``.

    The one check every count / size / rank argument of the routing and storage
    helpers goes through: a whole number (Python or numpy int, not a bool, a float
    or a string) in ``[minimum, maximum]``.

    Args:
        value: the argument's value.
        argument (str): the argument's name, for the message.
        minimum (Optional[int]): smallest accepted value, or None.
        maximum (Optional[int]): largest accepted value, or None.

    Returns:
        int: ``operator.index(value)``.

    Raises:
        ValueError: ``value`` is not an int in range; the message names ``argument`` and the fix.
    """
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        n = None
    else:
        try:
            n = operator.index(value)
        except TypeError:
            n = None
    if n is None:
        hint = ""
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            hint = f" (write {int(value)}, without a decimal point)"
        elif isinstance(value, str):
            hint = " (pass a number, not a string)"
        raise ValueError(
            f"`{argument}` must be an int, got {type(value).__name__} {value!r}; pass a whole number{hint}."
        )
    if minimum is not None and n < minimum:
        raise ValueError(f"`{argument}` must be >= {minimum}, got {n}.")
    if maximum is not None and n > maximum:
        raise ValueError(f"`{argument}` must be <= {maximum}, got {n}.")
    return n


def local_rows(num_embeddings: int, world_size: int, rank: int) -> int:
    """Rows rank ``rank`` owns under roundrobin / hash_roundrobin routing.

    Global id ``h`` lives on rank ``h % W`` at local id ``h // W``, so rank ``r``
    owns ``ceil((N - r) / W)`` rows; the counts sum to ``N`` over all ranks.

    Args:
        num_embeddings (int): rows of the whole table ``N``.
        world_size (int): number of ranks ``W``.
        rank (int): rank in ``[0, W)``.

    Returns:
        int: ``(N - rank + W - 1) // W``.

    Example::

        [local_rows(10, 4, r) for r in range(4)]  # [3, 3, 2, 2]
    """
    world_size = check_int(world_size, "world_size", 1)
    rank = check_int(rank, "rank")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
    num_embeddings = check_int(num_embeddings, "num_embeddings", 0)
    return max(0, (num_embeddings - rank + world_size - 1) // world_size)




# ------------------------------------------------------------------ enums ----
E = TypeVar("E", bound=enum.Enum)


def parse_enum(
    cls: Type[E], value: Union[E, str], argument: str, aliases: Optional[Dict[str, str]] = None, hint: str = ""
) -> E:
    """Reads a member of a string-valued enum from itself or its (case-insensitive) value.

    Args:
        cls (Type[E]): the enum.
        value (E | str): a member, or its value in any case (``str(value)`` is
            read, so members of other string enums, e.g. fbgemm's ``EmbOptimType``,
            are read by their value).
        argument (str): the argument's name, for the error message.
        aliases (Optional[Dict[str, str]]): other lower-case names mapped to lower-case values.
        hint (str): said after the allowed values when ``value`` is none of them.

    Returns:
        E: the member.

    Raises:
        ValueError: naming ``argument``, the allowed values and what was given.
    """
    if isinstance(value, cls):
        return value
    name = str(value).lower()
    name = (aliases or {}).get(name, name)
    for member in cls:
        if str(member.value).lower() == name:
            return member
    raise ValueError(
        f"{argument} must be one of {[m.value for m in cls]}, got {value!r}" + (f": {hint}" if hint else ".")
    )


class Mode(enum.StrEnum):
    """Placement mode of a tiered table.

    HYBRID: a static hashed split, ``floor(x * rows)`` rows in HBM and the rest in
    host DDR. CACHING: a cache of ``floor(x * rows)`` slots in HBM in front of
    a full backing store in host DDR.
    """

    HYBRID = "HYBRID"
    CACHING = "CACHING"

    @classmethod
    def parse(cls, value: Union["Mode", str], argument: str = "mode") -> "Mode":
        """Read a mode from a ``Mode`` or its (case-insensitive) name.

        Args:
            value (Mode | str): the mode.
            argument (str): the argument's name, for the error message.

        Returns:
            Mode: the parsed mode.
        """
        return parse_enum(cls, value, argument)


class DistType(enum.StrEnum):
    """Routing of a table's ids to ranks (``torch.ops.recpipe.block_bucketize_sparse_features``).

    CONTINUOUS: fbgemm's contiguous blocks of ``ceil(N / W)`` rows. ROUNDROBIN:
    owner ``id % W``. HASH_ROUNDROBIN: roundrobin over a seeded bijection of
    ``[0, N)`` (recpipe's default for tiered tables). :attr:`code` is the integer
    of the op's ``dist_types`` tensor (``recpipe.pipeline.routing.ops.DIST_TYPES``, read
    from the extension).
    """

    CONTINUOUS = "continuous"
    ROUNDROBIN = "roundrobin"
    HASH_ROUNDROBIN = "hash_roundrobin"

    @property
    def code(self) -> int:
        """Integer code of the routing op (0, 1, 2; ``ops.DIST_TYPES``)."""
        return DIST_TYPES[self.value]

    @classmethod
    def parse(cls, value: Union["DistType", str], argument: str = "dist_type") -> "DistType":
        """Read a dist type from a ``DistType`` or its (case-insensitive) name.

        Args:
            value (DistType | str): the dist type.
            argument (str): the argument's name, for the error message.

        Returns:
            DistType: the parsed dist type.

        Raises:
            ValueError: ``unknown dist_type ...; choose one of [...]``.
        """
        try:
            return parse_enum(cls, value, argument)
        except ValueError:
            raise ValueError(
                f"unknown {argument} {value!r}; choose one of {sorted(m.value for m in cls)}"
            ) from None


if {m.value for m in DistType} != set(DIST_TYPES):  # pragma: no cover - guards the two tables above
    raise ImportError(f"DistType {sorted(m.value for m in DistType)} disagrees with DIST_TYPES {sorted(DIST_TYPES)}.")

#: Dist types whose shards hold ``local_rows(N, W, r)`` rows, the layout the byte
#: formulas and ``recpipe.planner.sharding.row_wise_sharding_spec`` describe.
ROUTED_DIST_TYPES: FrozenSet[DistType] = frozenset({DistType.ROUNDROBIN, DistType.HASH_ROUNDROBIN})


class CachePolicy(enum.StrEnum):
    """Eviction policy of a CACHING table. LFU is the default (closest to the
    frequency oracle on skewed ids); LRU is offered for drifting traffic."""

    LFU = "lfu"
    LRU = "lru"

    @classmethod
    def parse(cls, value: Union["CachePolicy", str], argument: str = "cache_policy") -> "CachePolicy":
        """Reads a policy from a ``CachePolicy`` or its (case-insensitive) name.

        Args:
            value (CachePolicy | str): the policy.
            argument (str): the argument's name, for the error message.

        Returns:
            CachePolicy: the parsed policy.
        """
        return parse_enum(cls, value, argument)


# fbgemm / torchrec spellings of the fused optimizers (``EmbOptimType`` values).
_OPTIMIZER_ALIASES: Dict[str, str] = {
    "exact_sgd": "sgd",
    "exact_row_wise_adagrad": "rowwise_adagrad",
    "row_wise_adagrad": "rowwise_adagrad",
    "exact_rowwise_adagrad": "rowwise_adagrad",
    "exact_adagrad": "adagrad",
}


class FusedOptimizer(enum.StrEnum):
    """Fused (in-backward) optimizer of a table; sets the optimizer-state bytes per row.

    The byte formulas know all four; the tiered kernel runs SGD, ROWWISE_ADAGRAD and
    ADAM (``recpipe.pipeline.tiered.optim.SUPPORTED_OPTIMIZERS``). :meth:`parse`
    also reads fbgemm's ``EmbOptimType`` (``EXACT_SGD`` -> SGD,
    ``EXACT_ROWWISE_ADAGRAD`` -> ROWWISE_ADAGRAD, ``EXACT_ADAGRAD`` -> ADAGRAD).
    """

    SGD = "sgd"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAGRAD = "adagrad"
    ADAM = "adam"

    @classmethod
    def parse(cls, value: Union["FusedOptimizer", str], argument: str = "optimizer") -> "FusedOptimizer":
        """Reads an optimizer from a ``FusedOptimizer``, its name or an ``EmbOptimType``.

        Args:
            value (FusedOptimizer | str | EmbOptimType): the optimizer.
            argument (str): the argument's name, for the error message.

        Returns:
            FusedOptimizer: the parsed optimizer.
        """
        return parse_enum(
            cls, value, argument, aliases=_OPTIMIZER_ALIASES,
            hint="tables fuse SGD, row-wise Adagrad, Adagrad or Adam into the backward "
            "(the tiered kernel runs SGD, row-wise Adagrad and Adam).",
        )


# --------------------------------------------------------- byte formulas ----
# Bytes of fast-tier metadata per LOCAL ROW of a CACHING table: one int64
# row -> slot index (-1 when the row is not cached). Source: recpipe tiered
# storage design (ARCHITECTURE.md "Placement"); int64 = 8 bytes.
CACHE_ROW_MAP_BYTES: int = 8
# Bytes of fast-tier metadata per CACHE SLOT of a CACHING table: one int64
# slot -> row index plus one int64 eviction score (LFU count / timestamp).
# Source: recpipe tiered storage design; 2 x int64 = 16 bytes.
CACHE_SLOT_BYTES: int = 16


def optimizer_state_bytes_per_row(optimizer: Union[FusedOptimizer, str], dim: int) -> int:
    """Bytes of fused optimizer state stored next to each embedding row.

    fp32 state = 4 bytes. Sources: fbgemm_gpu ``EmbOptimType``: rowwise adagrad
    keeps one fp32 momentum per row; adagrad one fp32 per element; adam fp32
    exp_avg + exp_avg_sq per element.

    Args:
        optimizer (FusedOptimizer | str): ``"sgd"``, ``"rowwise_adagrad"``,
            ``"adagrad"`` or ``"adam"`` (case-insensitive; fbgemm spellings too).
        dim (int): embedding dimension.

    Returns:
        int: bytes per row: sgd 0, rowwise_adagrad 4, adagrad ``4 * dim``,
        adam ``8 * dim``.

    Example::

        optimizer_state_bytes_per_row("adam", 128)  # 1024
    """
    dim = check_int(dim, "dim", 1)
    opt = FusedOptimizer.parse(optimizer)
    if opt is FusedOptimizer.SGD:
        return 0
    if opt is FusedOptimizer.ROWWISE_ADAGRAD:
        return 4
    if opt is FusedOptimizer.ADAGRAD:
        return 4 * dim
    return 8 * dim


@functools.lru_cache(maxsize=None)
def decimal_ratio(x: float) -> Tuple[int, int]:
    """``x`` as the exact ratio of its shortest round-trip decimal.

    Args:
        x (float): a load factor.

    Returns:
        Tuple[int, int]: ``(numerator, denominator)``, e.g. ``0.3 -> (3, 10)``.
    """
    f = Fraction(repr(float(x)))
    return f.numerator, f.denominator


# Row dtypes a tiered table holds, on every backend (TieredEmbeddingShard refuses
# others; the planner refuses to plan them). Values are float32 in both tiers.
TIERED_DTYPES: FrozenSet[torch.dtype] = frozenset({torch.float32})

# Short names accepted for dtypes, besides torch's own attribute names.
_DTYPE_ALIASES: Dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8"}


@functools.lru_cache(maxsize=None)
def _resolve_dtype(value: Union[torch.dtype, str]) -> Optional[torch.dtype]:
    if isinstance(value, torch.dtype):
        return value
    if not isinstance(value, str):
        return None
    name = value.lower().replace("torch.", "")
    resolved = getattr(torch, _DTYPE_ALIASES.get(name, name), None)
    return resolved if isinstance(resolved, torch.dtype) else None


def resolve_dtype(value: Union[torch.dtype, str], argument: str = "dtype") -> torch.dtype:
    """A torch dtype from itself or its name (``"float32"``, ``"torch.float16"``, ``"bf16"``).

    Args:
        value (torch.dtype | str): the dtype.
        argument (str): the argument's name, for the error message.

    Returns:
        torch.dtype: the dtype.

    Raises:
        ValueError: naming ``argument`` when ``value`` is not a torch dtype.
    """
    resolved = _resolve_dtype(value) if isinstance(value, (torch.dtype, str)) else None
    if resolved is None:
        raise ValueError(
            f"{argument} {value!r} is not a torch dtype: use e.g. 'float32', 'float16', "
            "'bfloat16' or 'int8'."
        )
    return resolved


def dtype_name(dtype: Union[torch.dtype, str]) -> str:
    """The name of a dtype as written in fused params and plans, e.g. ``"float32"``.

    Args:
        dtype (torch.dtype | str): the dtype.

    Returns:
        str: ``str(dtype)`` without the ``torch.`` prefix.
    """
    return str(resolve_dtype(dtype)).removeprefix("torch.")


@functools.lru_cache(maxsize=None)
def dtype_itemsize(dtype: Union[torch.dtype, str]) -> int:
    """Bytes of one element of ``dtype``.

    Args:
        dtype (torch.dtype | str): the dtype (see :func:`resolve_dtype`).

    Returns:
        int: the element size.
    """
    return torch.empty((), dtype=resolve_dtype(dtype)).element_size()


def row_bytes(dim: int, dtype: Union[torch.dtype, str], optimizer: Union[FusedOptimizer, str]) -> int:
    """Bytes of one embedding row: its values plus its fused optimizer state.

    Args:
        dim (int): embedding dimension.
        dtype (torch.dtype | str): dtype of the embedding values.
        optimizer (FusedOptimizer | str): fused optimizer (see ``optimizer_state_bytes_per_row``).

    Returns:
        int: ``dim * dtype.itemsize + optimizer_state_bytes_per_row(optimizer, dim)``.

    Example::

        row_bytes(128, torch.float32, "adam")  # 512 + 1024 = 1536
    """
    dim = check_int(dim, "dim", 1)
    return dim * dtype_itemsize(resolve_dtype(dtype)) + optimizer_state_bytes_per_row(optimizer, dim)


def max_local_rows(num_embeddings: int, world_size: int) -> int:
    """Rows of the largest shard (rank 0): ``ceil(N / W)``; per-rank sizing uses it.

    Args:
        num_embeddings (int): rows of the whole table.
        world_size (int): number of ranks.

    Returns:
        int: ``local_rows(num_embeddings, world_size, 0)``.
    """
    return local_rows(num_embeddings, world_size, 0)


def check_load_factor(x: float, argument: str = "cache_load_factor") -> None:
    """Raises unless ``x`` is a number in ``(0, 1]``.

    Args:
        x (float): the cache load factor.
        argument (str): the argument's name, for the error message.

    Raises:
        ValueError: ``<argument> must be in (0, 1], got ...``.
    """
    if isinstance(x, bool) or not (isinstance(x, (int, float)) and 0.0 < float(x) <= 1.0):
        raise ValueError(
            f"{argument} must be in (0, 1], got {x!r}: use e.g. 0.1 ... 1.0 "
            "(1.0 = every row in HBM)."
        )


def check_load_factors(xs: Any, argument: str = "load_factors") -> Tuple[float, ...]:
    """``xs`` as a tuple of load factors, or a ValueError naming ``argument``.

    Args:
        xs (Sequence[float]): a non-empty sequence (list, tuple, array) of load factors in ``(0, 1]``.
        argument (str): the argument's name, for the message.

    Returns:
        Tuple[float, ...]: the load factors as floats, in the given order.
    """
    if isinstance(xs, (str, bytes)) or not hasattr(xs, "__iter__") or not hasattr(xs, "__len__"):
        raise ValueError(
            f"{argument} must be a sequence of load factors in (0, 1], got {type(xs).__name__} {xs!r}: "
            "e.g. (0.1, 0.2, ..., 1.0), or [0.5] for one."
        )
    if len(xs) == 0:
        raise ValueError(f"{argument} is empty: give at least one x in (0, 1], e.g. (0.1, ..., 1.0).")
    for x in xs:
        check_load_factor(x, f"{argument}[...]")
    return tuple(float(x) for x in xs)


def floor_fraction(x: float, rows: int) -> int:
    """``floor(x * rows)`` robust to binary float error.

    ``x`` is first read as the shortest decimal that round-trips (``repr``), so
    0.3 means 3/10 exactly (a plain ``int(0.3 * 10)`` gives 2, because
    ``0.3 * 10 == 2.9999999999999996``), then multiplied exactly and floored.
    The runtime must size its tiers with this same function.

    Args:
        x (float): the load factor.
        rows (int): rows of the shard.

    Returns:
        int: ``floor(x * rows)`` with ``x`` read as a decimal.
    """
    check_load_factor(x, "x")
    rows = check_int(rows, "rows", 0)
    num, den = decimal_ratio(float(x))
    return (num * rows) // den


def tier_rows(rows: int, mode: Union[Mode, str], x: float) -> Tuple[int, int, int]:
    """Split a shard's rows between the tiers.

    Args:
        rows (int): local rows of the shard.
        mode (Mode | str): ``HYBRID`` or ``CACHING``.
        x (float): cache load factor in ``(0, 1]``.

    Returns:
        Tuple[int, int, int]: ``(fast_rows, slow_rows, cache_slots)``.
        ``x == 1``: ``(rows, 0, 0)``; HYBRID: ``(k, rows - k, 0)``; CACHING:
        ``(0, rows, k)`` with ``k = floor(x * rows)`` computed exactly (the decimal
        value of ``x`` times ``rows``, floored).

    Example::

        tier_rows(10, "CACHING", 0.3)  # (0, 10, 3)
    """
    check_load_factor(x)
    m = Mode.parse(mode)
    rows = check_int(rows, "rows", 0)
    if float(x) == 1.0:
        return rows, 0, 0
    k = floor_fraction(x, rows)
    if m is Mode.HYBRID:
        return k, rows - k, 0
    return 0, rows, k


@dataclass(frozen=True)
class ShardStorage:
    """Bytes of one shard per tier.

    Args:
        fast_bytes (int): HBM (fast tier) bytes: rows, cache slots and metadata.
        slow_bytes (int): host DDR (slow tier) bytes.
    """

    fast_bytes: int
    slow_bytes: int


def shard_storage(
    rows: int,
    dim: int,
    dtype: Union[torch.dtype, str],
    optimizer: Union[FusedOptimizer, str],
    mode: Union[Mode, str],
    x: float,
) -> ShardStorage:
    """Bytes one shard of ``rows`` local rows needs in each tier.

    ``fast = (fast_rows + cache_slots) * row_bytes`` plus, for CACHING with
    ``x < 1``, ``rows * CACHE_ROW_MAP_BYTES + cache_slots * CACHE_SLOT_BYTES``;
    ``slow = slow_rows * row_bytes``. The per-rank bytes of a table sharded over
    ``W`` ranks are ``shard_storage(max_local_rows(N, W), ...)``.

    Args:
        rows (int): local rows of the shard.
        dim (int): embedding dimension.
        dtype (torch.dtype | str): embedding dtype.
        optimizer (FusedOptimizer | str): fused optimizer.
        mode (Mode | str): ``HYBRID`` or ``CACHING``.
        x (float): cache load factor in ``(0, 1]``.

    Returns:
        ShardStorage: fast and slow tier bytes.

    Example::

        shard_storage(10, 4, torch.float32, "sgd", "CACHING", 0.3)
        # fast = 3 * 16 + 10 * 8 + 3 * 16 = 176, slow = 10 * 16 = 160
    """
    fast_rows, slow_rows, slots = tier_rows(rows, mode, x)
    rb = row_bytes(dim, dtype, optimizer)
    fast = (fast_rows + slots) * rb
    if Mode.parse(mode) is Mode.CACHING and float(x) < 1.0:
        fast += rows * CACHE_ROW_MAP_BYTES + slots * CACHE_SLOT_BYTES
    return ShardStorage(fast_bytes=fast, slow_bytes=slow_rows * rb)


def machine_storage(
    num_embeddings: int,
    world_size: int,
    local_world_size: int,
    dim: int,
    dtype: Union[torch.dtype, str],
    optimizer: Union[FusedOptimizer, str],
    mode: Union[Mode, str],
    x: float,
) -> ShardStorage:
    """Bytes of one table summed over the ranks of the most loaded machine.

    Machine 0 hosts ranks ``0 .. L-1``, which own the largest shards (local rows
    are non-increasing in rank), so it is the most loaded machine for every table.

    Args:
        num_embeddings (int): rows of the whole table.
        world_size (int): number of ranks.
        local_world_size (int): ranks per machine.
        dim (int): embedding dimension.
        dtype (torch.dtype | str): embedding dtype.
        optimizer (FusedOptimizer | str): fused optimizer.
        mode (Mode | str): ``HYBRID`` or ``CACHING``.
        x (float): cache load factor in ``(0, 1]``.

    Returns:
        ShardStorage: fast and slow bytes summed over ranks ``0 .. L-1``.
    """
    return machine_sum(
        num_embeddings, world_size, local_world_size, lambda rows: shard_storage(rows, dim, dtype, optimizer, mode, x)
    )


def machine_sum(
    num_embeddings: int, world_size: int, local_world_size: int, shard: Callable[[int], ShardStorage]
) -> ShardStorage:
    """Bytes of one table summed over machine 0's ranks, from the bytes of one shard.

    Ranks ``r < N % W`` (all ranks when ``W`` divides ``N``) own ``ceil(N / W)`` rows,
    the others one fewer; machine 0 hosts ranks ``0 .. L-1``.

    Args:
        num_embeddings (int): rows of the whole table.
        world_size (int): number of ranks.
        local_world_size (int): ranks per machine.
        shard (Callable[[int], ShardStorage]): bytes of a shard of that many local rows
            (``shard_storage`` for recpipe's tiered layout, ``fbgemm_shard_storage`` for fbgemm's).

    Returns:
        ShardStorage: fast and slow bytes summed over ranks ``0 .. L-1``.
    """
    num_embeddings = check_int(num_embeddings, "num_embeddings", 0)
    world_size = check_int(world_size, "world_size", 1)
    local_world_size = check_int(local_world_size, "local_world_size")
    if not 1 <= local_world_size <= world_size:
        raise ValueError(
            f"local_world_size must be in [1, world_size={world_size}], got {local_world_size}."
        )
    big = max_local_rows(num_embeddings, world_size)
    rem = num_embeddings % world_size
    n_big = local_world_size if rem == 0 else min(rem, local_world_size)
    n_small = local_world_size - n_big
    s_big = shard(big)
    fast, slow = n_big * s_big.fast_bytes, n_big * s_big.slow_bytes
    if n_small:
        s_small = shard(big - 1)
        fast += n_small * s_small.fast_bytes
        slow += n_small * s_small.slow_bytes
    return ShardStorage(fast_bytes=fast, slow_bytes=slow)


# ---------------------------------------------------------- fused params ----
#: Prefix of every recpipe fused-param key; a key with it that is not one of
#: :data:`FUSED_PARAM_KEYS` is refused (a typo would otherwise be ignored).
FUSED_PARAM_PREFIX: str = "recpipe_"
#: Placement mode (``Mode`` value, ``"HYBRID"`` / ``"CACHING"``).
FUSED_PARAM_MODE: str = "recpipe_mode"
#: Cache load factor x in (0, 1] (float).
FUSED_PARAM_CACHE_LOAD_FACTOR: str = "recpipe_cache_load_factor"
#: Routing (``DistType`` value, e.g. ``"hash_roundrobin"``).
FUSED_PARAM_DIST_TYPE: str = "recpipe_dist_type"
#: Seed of the hash_roundrobin routing (int).
FUSED_PARAM_SEED: str = "recpipe_seed"
#: Eviction policy of a CACHING table (``CachePolicy`` value, ``"lfu"`` / ``"lru"``).
FUSED_PARAM_CACHE_POLICY: str = "recpipe_cache_policy"
#: Fused optimizer the table was sized for (``FusedOptimizer`` value).
FUSED_PARAM_OPTIMIZER: str = "recpipe_optimizer"
#: Row dtype the table was sized for (``dtype_name``, e.g. ``"float32"``).
FUSED_PARAM_DTYPE: str = "recpipe_dtype"

# PlacementParams field -> fused-param key (the encoding, in field order).
_FIELD_KEYS: Dict[str, str] = {
    "mode": FUSED_PARAM_MODE,
    "cache_load_factor": FUSED_PARAM_CACHE_LOAD_FACTOR,
    "dist_type": FUSED_PARAM_DIST_TYPE,
    "seed": FUSED_PARAM_SEED,
    "cache_policy": FUSED_PARAM_CACHE_POLICY,
    "optimizer": FUSED_PARAM_OPTIMIZER,
    "dtype": FUSED_PARAM_DTYPE,
}
#: Every key of the contract, in :class:`PlacementParams` field order.
FUSED_PARAM_KEYS: Tuple[str, ...] = tuple(_FIELD_KEYS.values())
#: Tiered kernel backend (``"native"`` / ``"fbgemm"`` / ``"torch"``, see
#: ``recpipe.pipeline.tiered.shard.TieredEmbeddingShard``); absent: the device's default.
#: Not planned (not in :data:`FUSED_PARAM_KEYS`): the tiered sharders' ``backend=``
#: argument writes it into their tiered tables' fused params; the tiered kernel reads it.
FUSED_PARAM_BACKEND: str = "recpipe_backend"
#: recpipe fused-param keys outside the placement contract (optional, written by the
#: sharders, not the planner); :meth:`PlacementParams.from_fused_params` accepts them.
FUSED_PARAM_RUNTIME_KEYS: Tuple[str, ...] = (FUSED_PARAM_BACKEND,)


class PlacementContractError(ValueError):
    """A table's fused params do not hold a valid placement (missing, unknown or bad
    key). The message names the table and the key and lists numbered possible solutions."""


class PlacementMismatchError(PlacementContractError):
    """A table's planned placement disagrees with what the model trains (fused
    optimizer or row dtype): the runtime would allocate other bytes than the plan
    budgeted. The message names the table, both values and the fixes."""


def _parse_load_factor(value: Any, argument: str) -> float:
    check_load_factor(value, argument)
    return float(value)


def _parse_seed(value: Any, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
        raise ValueError(
            f"{argument} must be an int64 (the routing op's seed), got {value!r}: e.g. 0, or the run's seed."
        )
    return int(value)


# Field -> parser(value, argument) raising a ValueError that names the argument.
_PARSERS: Dict[str, Callable[[Any, str], Any]] = {
    "mode": lambda v, a: Mode.parse(v, a),
    "cache_load_factor": _parse_load_factor,
    "dist_type": lambda v, a: DistType.parse(v, a),
    "seed": _parse_seed,
    "cache_policy": lambda v, a: CachePolicy.parse(v, a),
    "optimizer": lambda v, a: FusedOptimizer.parse(v, a),
    "dtype": resolve_dtype,
}
# Field -> plain value written into fused params (str / float / int only: torchrec
# deep-copies fused params and compares them when it groups tables).
_ENCODERS: Dict[str, Callable[[Any], Any]] = {
    "mode": lambda v: v.value,
    "cache_load_factor": float,
    "dist_type": lambda v: v.value,
    "seed": int,
    "cache_policy": lambda v: v.value,
    "optimizer": lambda v: v.value,
    "dtype": dtype_name,
}

_PLAN_FIX = (
    "plan the model with recpipe.planner: PlacementPlanner(topology).plan(model).to_sharding_plan() "
    "writes every key into each table's PlacementParameterSharding"
)


@dataclass(frozen=True, kw_only=True)
class PlacementParams:
    """The placement of one tiered table: what the planner sized, what the runtime builds.

    Strings are accepted for the enum fields and the dtype and normalized. The
    encoding into torchrec fused params is :meth:`to_fused_params` (keys
    ``FUSED_PARAM_*``), read back and validated by :meth:`from_fused_params`.

    Example::

        p = PlacementParams(mode=Mode.CACHING, cache_load_factor=0.2,
                            dist_type=DistType.HASH_ROUNDROBIN, seed=0,
                            optimizer=FusedOptimizer.ADAM, dtype=torch.float32)
        PlacementParams.from_fused_params(p.to_fused_params(), "t0") == p  # True
    """

    mode: Mode
    """``HYBRID`` (static split) or ``CACHING`` (cache over a full slow-tier copy)."""
    cache_load_factor: float
    """x in (0, 1]: fast rows (HYBRID) or cache slots (CACHING) are ``floor(x * rows)``; 1.0 = all fast."""
    dist_type: DistType
    """Routing of the table's ids to ranks (the planner writes hash_roundrobin by default)."""
    seed: int = 0
    """Seed of the hash_roundrobin routing (an int64)."""
    cache_policy: CachePolicy = CachePolicy.LFU
    """Eviction policy of a CACHING table (LFU or LRU); ignored by HYBRID."""
    optimizer: FusedOptimizer
    """Fused optimizer the table was sized for; the runtime refuses any other."""
    dtype: torch.dtype
    """Row dtype the table was sized for (e.g. ``torch.float32``); the runtime refuses any other."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = _PARSERS[f.name](getattr(self, f.name), f"PlacementParams.{f.name}")
            object.__setattr__(self, f.name, value)

    def row_bytes(self, dim: int) -> int:
        """Bytes of one row of this table (values plus optimizer state).

        Args:
            dim (int): embedding dimension.

        Returns:
            int: ``row_bytes(dim, self.dtype, self.optimizer)``.
        """
        return row_bytes(dim, self.dtype, self.optimizer)

    def to_fused_params(self) -> Dict[str, Any]:
        """The torchrec fused params carrying this placement (plain str / float / int values).

        Returns:
            Dict[str, Any]: one entry per key of :data:`FUSED_PARAM_KEYS`.
        """
        return {key: _ENCODERS[name](getattr(self, name)) for name, key in _FIELD_KEYS.items()}

    @classmethod
    def from_fused_params(cls, fused_params: Optional[Mapping[str, Any]], table_name: str) -> "PlacementParams":
        """Reads and validates the placement a table's fused params carry.

        Other (torchrec / fbgemm) keys are ignored; every key of
        :data:`FUSED_PARAM_KEYS` must be present and valid, and no other key may
        start with :data:`FUSED_PARAM_PREFIX` but those of
        :data:`FUSED_PARAM_RUNTIME_KEYS` (read by the tiered kernel, not here).

        Args:
            fused_params (Optional[Mapping[str, Any]]): the table's fused params.
            table_name (str): the table, for error messages.

        Returns:
            PlacementParams: the placement.

        Raises:
            PlacementContractError: a key is missing, unknown or holds a bad
                value; the message names the table and the key.
        """
        fp = dict(fused_params or {})
        unknown = sorted(k for k in fp if isinstance(k, str) and k.startswith(FUSED_PARAM_PREFIX)
                         and k not in FUSED_PARAM_KEYS and k not in FUSED_PARAM_RUNTIME_KEYS)
        if unknown:
            raise PlacementContractError(
                f"table {table_name!r}: unknown placement fused param(s) {unknown}; the contract's keys are "
                f"{list(FUSED_PARAM_KEYS)} (and the sharders' {list(FUSED_PARAM_RUNTIME_KEYS)})."
                "\nPossible solutions:\n"
                f"  1) fix the key's spelling (keys are defined once, in recpipe.pipeline.placement);\n"
                f"  2) {_PLAN_FIX}."
            )
        missing = [key for key in FUSED_PARAM_KEYS if key not in fp]
        if missing:
            raise PlacementContractError(
                f"table {table_name!r}: its fused params lack the placement key(s) {missing}, so its "
                "tiered kernel has no complete placement to build.\nPossible solutions:\n"
                f"  1) {_PLAN_FIX};\n"
                "  2) in a hand-written plan, give the table a recpipe.planner.sharding.PlacementParameterSharding "
                "(not a plain ParameterSharding) with compute_kernel customized_kernel."
            )
        values: Dict[str, Any] = {}
        for name, key in _FIELD_KEYS.items():
            try:
                values[name] = _PARSERS[name](fp[key], key)
            except ValueError as e:
                raise PlacementContractError(
                    f"table {table_name!r}: fused param {key!r} holds an invalid value: {e}\n"
                    f"Possible solutions:\n  1) {_PLAN_FIX};\n"
                    f"  2) correct {key!r} where the plan (or the sharder's fused_params) sets it."
                ) from None
        return cls(**values)

    def check_runtime(
        self,
        table_name: str,
        *,
        optimizer: Union[FusedOptimizer, str],
        dtype: Union[torch.dtype, str],
        dim: Optional[int] = None,
    ) -> None:
        """Raises unless the model trains the table as it was planned.

        Args:
            table_name (str): the table, for the error message.
            optimizer (FusedOptimizer | str): the table's actual fused optimizer
                (torchrec's fused params ``optimizer``).
            dtype (torch.dtype | str): the table's actual row dtype (its config's ``data_type``).
            dim (Optional[int]): embedding dimension (adds the bytes per row to the message).

        Raises:
            PlacementMismatchError: naming the table, the planned and the actual
                value, and the fixes.
        """
        actual_opt = FusedOptimizer.parse(optimizer)
        actual_dtype = resolve_dtype(dtype)
        if actual_opt is self.optimizer and actual_dtype == self.dtype:
            return
        what = []
        if actual_opt is not self.optimizer:
            what.append(f"fused optimizer {self.optimizer.value}, but the model trains it with {actual_opt.value}")
        if actual_dtype != self.dtype:
            what.append(f"row dtype {dtype_name(self.dtype)}, but the table's data_type is {dtype_name(actual_dtype)}")
        sizes = ""
        if dim is not None:
            sizes = (
                f" The tiered kernel would allocate {row_bytes(dim, actual_dtype, actual_opt)} bytes per row "
                f"where the plan budgeted {self.row_bytes(dim)}."
            )
        fixes = [
            "re-plan with the model: PlacementPlanner(topology).plan(model) reads each table's fused "
            "optimizer (apply_optimizer_in_backward, or the planner's fused_params=) and dtype from it; "
            "call apply_optimizer_in_backward before planning",
        ]
        if actual_opt is not self.optimizer:
            fixes.append(
                f"train the table with the planned {self.optimizer.value} instead: change "
                "apply_optimizer_in_backward (or the sharder's fused_params 'optimizer') for it"
            )
        if actual_dtype != self.dtype:
            fixes.append(f"set the table config's data_type to the planned {dtype_name(self.dtype)} instead")
        raise PlacementMismatchError(
            f"table {table_name!r} was planned for {' and '.join(what)}.{sizes} Refusing to build it.\n"
            "Possible solutions:\n" + "\n".join(f"  {i + 1}) {s}" for i, s in enumerate(fixes))
        )
