"""The contract's value types and their checks: int / load-factor / dtype parsing,
routing and optimizer enums, local rows. Imports nothing of recpipe."""

from __future__ import annotations

import enum
import functools
import math
import operator
from typing import Any, Dict, FrozenSet, Optional, Tuple, Type, TypeVar, Union

import torch

#: Name -> code of the routing op's ``dist_types`` tensor (csrc/bucketize_math.h
#: ``DistType``; :mod:`recpipe.pipeline.routing.ops` checks the extension agrees).
DIST_TYPES: Dict[str, int] = {"continuous": 0, "roundrobin": 1, "hash_roundrobin": 2}


def check_int(value: Any, argument: str, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    """``value`` as a Python int (not a bool, float, tensor or string) in ``[minimum, maximum]``.

    Raises:
        ValueError: naming ``argument`` and the fix.
    """
    n = None
    if not isinstance(value, (bool, torch.Tensor)):
        try:
            n = operator.index(value)
        except TypeError:
            pass
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
    """Rows rank ``rank`` owns under roundrobin routing (id ``h`` on rank ``h % W`` at ``h // W``)."""
    world_size = check_int(world_size, "world_size", 1)
    rank = check_int(rank, "rank")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
    num_embeddings = check_int(num_embeddings, "num_embeddings", 0)
    return max(0, (num_embeddings - rank + world_size - 1) // world_size)


E = TypeVar("E", bound=enum.Enum)


def parse_enum(
    cls: Type[E], value: Union[E, str], argument: str, aliases: Optional[Dict[str, str]] = None, hint: str = ""
) -> E:
    """A member of a string-valued enum from itself or its case-insensitive value.

    Args:
        value: a member or its value in any case (other string enums, e.g. fbgemm's ``EmbOptimType``, by value).
        argument: the argument's name, for the error message.
        aliases: other lower-case names mapped to lower-case values.
        hint: said after the allowed values when ``value`` is none of them.
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
    """Placement mode: HYBRID (static hashed split) or CACHING (fast-tier cache over a full slow tier)."""

    HYBRID = "HYBRID"
    CACHING = "CACHING"

    @classmethod
    def parse(cls, value: Union["Mode", str], argument: str = "mode") -> "Mode":
        """A mode from a ``Mode`` or its case-insensitive name."""
        return parse_enum(cls, value, argument)


class DistType(enum.StrEnum):
    """Routing of a table's ids to ranks. CONTINUOUS: fbgemm's blocks of ``ceil(N / W)`` rows. ROUNDROBIN: owner
    ``id % W``. HASH_ROUNDROBIN: roundrobin over a seeded bijection of ``[0, N)`` (the tiered default)."""

    CONTINUOUS = "continuous"
    ROUNDROBIN = "roundrobin"
    HASH_ROUNDROBIN = "hash_roundrobin"

    @property
    def code(self) -> int:
        """Integer code of the routing op's ``dist_types`` tensor (:data:`DIST_TYPES`)."""
        return DIST_TYPES[self.value]

    @classmethod
    def parse(cls, value: Union["DistType", str], argument: str = "dist_type") -> "DistType":
        """A dist type from a ``DistType`` or its case-insensitive name."""
        try:
            return parse_enum(cls, value, argument)
        except ValueError:
            raise ValueError(f"unknown {argument} {value!r}; choose one of {sorted(m.value for m in cls)}") from None


if {m.value for m in DistType} != set(DIST_TYPES):  # pragma: no cover - guards the two tables above
    raise ImportError(f"DistType {sorted(m.value for m in DistType)} disagrees with DIST_TYPES {sorted(DIST_TYPES)}.")

#: Dist types whose shards hold ``local_rows(N, W, r)`` rows (the byte formulas' layout).
ROUTED_DIST_TYPES: FrozenSet[DistType] = frozenset({DistType.ROUNDROBIN, DistType.HASH_ROUNDROBIN})

# fbgemm / torchrec spellings of the fused optimizers (``EmbOptimType`` values).
_OPTIMIZER_ALIASES: Dict[str, str] = {
    "exact_sgd": "sgd",
    "exact_row_wise_adagrad": "rowwise_adagrad",
    "row_wise_adagrad": "rowwise_adagrad",
    "exact_rowwise_adagrad": "rowwise_adagrad",
    "exact_adagrad": "adagrad",
}


class FusedOptimizerKind(enum.StrEnum):
    """Fused (in-backward) optimizer of a table; sets the optimizer-state bytes per row. The byte formulas
    know all four; the tiered kernel runs :data:`SUPPORTED_OPTIMIZERS`."""

    SGD = "sgd"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAGRAD = "adagrad"
    ADAM = "adam"

    @classmethod
    def parse(cls, value: Union["FusedOptimizerKind", str], argument: str = "optimizer") -> "FusedOptimizerKind":
        """An optimizer from a ``FusedOptimizerKind``, its name or an ``EmbOptimType``."""
        return parse_enum(
            cls,
            value,
            argument,
            aliases=_OPTIMIZER_ALIASES,
            hint="tables fuse SGD, row-wise Adagrad, Adagrad or Adam into the backward "
            "(the tiered kernel runs SGD, row-wise Adagrad and Adam).",
        )


#: The fused optimizers the tiered kernel runs (every backend); the planner can
#: size ADAGRAD too but refuses to plan it for a tiered table.
SUPPORTED_OPTIMIZERS: FrozenSet[FusedOptimizerKind] = frozenset(
    {FusedOptimizerKind.SGD, FusedOptimizerKind.ROWWISE_ADAGRAD, FusedOptimizerKind.ADAM}
)


#: Row dtypes a tiered table holds on every backend (the planner refuses others).
TIERED_DTYPES: FrozenSet[torch.dtype] = frozenset({torch.float32})

# Short names accepted for dtypes, besides torch's own attribute names.
_DTYPE_ALIASES: Dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8"}


@functools.lru_cache(maxsize=None)
def _resolve_dtype(value: Union[torch.dtype, str]) -> Optional[torch.dtype]:
    if isinstance(value, torch.dtype):
        return value
    name = value.lower().replace("torch.", "")
    resolved = getattr(torch, _DTYPE_ALIASES.get(name, name), None)
    return resolved if isinstance(resolved, torch.dtype) else None


def resolve_dtype(value: Union[torch.dtype, str], argument: str = "dtype") -> torch.dtype:
    """A torch dtype from itself or its name (``"float32"``, ``"torch.float16"``, ``"bf16"``)."""
    resolved = _resolve_dtype(value) if isinstance(value, (torch.dtype, str)) else None
    if resolved is None:
        raise ValueError(
            f"{argument} {value!r} is not a torch dtype: use e.g. 'float32', 'float16', 'bfloat16' or 'int8'."
        )
    return resolved


def dtype_name(dtype: Union[torch.dtype, str]) -> str:
    """The name of a dtype as fused params and plans write it: ``str(dtype)`` without ``torch.``."""
    return str(resolve_dtype(dtype)).removeprefix("torch.")


@functools.lru_cache(maxsize=None)
def dtype_itemsize(dtype: Union[torch.dtype, str]) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty((), dtype=resolve_dtype(dtype)).element_size()


def check_load_factor(x: float, argument: str = "cache_load_factor") -> None:
    """Raises ValueError unless ``x`` is a number in ``(0, 1]``."""
    if isinstance(x, bool) or not (isinstance(x, (int, float)) and 0.0 < float(x) <= 1.0):
        raise ValueError(f"{argument} must be in (0, 1], got {x!r}: use e.g. 0.1 ... 1.0 (1.0 = every row in HBM).")


def check_load_factors(xs: Any, argument: str = "load_factors") -> Tuple[float, ...]:
    """``xs``, a non-empty sequence of load factors in ``(0, 1]``, as a tuple of floats."""
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
