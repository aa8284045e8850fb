"""The planner's errors (torchrec's ``PlannerError`` with a typed reason) and the byte formatting every
planner message uses."""

from __future__ import annotations

import enum
import math
import numbers
from typing import Sequence

from torchrec.distributed.planner.types import PlannerError as _TorchrecPlannerError


class PlacementErrorType(enum.Enum):
    """Why the planner failed (torchrec style)."""

    INSUFFICIENT_HBM = "insufficient_hbm"
    INSUFFICIENT_DDR = "insufficient_ddr"
    INSUFFICIENT_STORAGE = "insufficient_storage"
    TABLE_DOES_NOT_FIT = "table_does_not_fit"
    STRICT_CONSTRAINTS = "strict_constraints"
    INPUT_VALIDATION = "input_validation"


class PlacementPlannerError(_TorchrecPlannerError):
    """Planner failure with a typed reason (``error_type``); a subclass of torchrec's ``PlannerError``."""

    def __init__(self, message: str, error_type: PlacementErrorType) -> None:
        super().__init__(message)
        # torchrec stores its own enum here; ours is richer, keep both readable.
        self.error_type = error_type
        self.planner_error_type: PlacementErrorType = error_type


class PlannerInputError(PlacementPlannerError, ValueError):
    """An ``INPUT_VALIDATION`` ``PlacementPlannerError`` that is also a ``ValueError``, as the planner's other
    argument checks are."""

    def __init__(self, message: str) -> None:
        super().__init__(message, PlacementErrorType.INPUT_VALIDATION)


def format_bytes(num: float, round_up: bool = False) -> str:
    """Human readable bytes in binary units, e.g. ``1.50 GiB``; ``round_up`` rounds up to the 2 decimals
    shown (a minimum the user must reach never reads smaller than it is)."""
    if isinstance(num, bool) or not isinstance(num, numbers.Real) or not math.isfinite(num):
        raise ValueError(
            f"format_bytes(num): num must be a finite number of bytes, got {type(num).__name__} {num!r}; "
            "pass a byte count such as 1536 (a nan or inf size is a bug in the caller's arithmetic)."
        )
    if not isinstance(round_up, bool):
        raise ValueError(
            f"format_bytes(round_up): round_up must be True or False, got {type(round_up).__name__} {round_up!r}."
        )
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    value = float(num)
    for unit in units:
        if abs(value) < 1024.0 or unit == units[-1]:
            if unit == "B":
                return f"{math.ceil(value) if round_up else value:.0f} {unit}"
            return f"{math.ceil(value * 100) / 100 if round_up else value:.2f} {unit}"
        value /= 1024.0
    return f"{value:.2f} PiB"  # pragma: no cover


def solutions(fixes: Sequence[str]) -> str:
    """The numbered "Possible solutions" block that ends a planner message."""
    return "Possible solutions:\n" + "\n".join(f"  {k + 1}) {fix}" for k, fix in enumerate(fixes))


def sized(num: int) -> str:
    """Bytes for a message: ``18.31 MiB (19195784 B)`` rounded up, or ``512 B`` below 1 KiB.

    Every byte figure of a planner message goes through here or :func:`rounded`, so one byte count reads
    the same wherever a message quotes it.
    """
    n = int(num)
    return f"{n} B" if n < 1024 else f"{rounded(n)} ({n} B)"


def rounded(num: int) -> str:
    """``format_bytes(num, round_up=True)``: the one rounding of byte figures in planner messages."""
    return format_bytes(num, round_up=True)


__all__ = [
    "PlacementPlannerError",
    "PlacementErrorType",
    "PlannerInputError",
    "format_bytes",
    "rounded",
    "sized",
    "solutions",
]
