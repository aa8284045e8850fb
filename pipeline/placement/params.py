"""The fused-param encoding of a table's placement: the ``FUSED_PARAM_*`` keys, :class:`PlacementParams`
and its errors. Imports only this package's other modules."""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from recpipe.pipeline.placement.cache_policies import CachePolicy
from recpipe.pipeline.placement.dynamic_options import DynamicTableOptions
from recpipe.pipeline.placement.sizing import row_bytes
from recpipe.pipeline.placement.values import (
    DistType,
    FusedOptimizerKind,
    Mode,
    check_load_factor,
    dtype_name,
    resolve_dtype,
)

#: Prefix of every recpipe fused-param key; a key with it outside :data:`FUSED_PARAM_KEYS` is refused (a typo
#: would otherwise be ignored). Each ``FUSED_PARAM_<FIELD>`` key carries that :class:`PlacementParams` field.
FUSED_PARAM_PREFIX: str = "recpipe_"
FUSED_PARAM_MODE: str = "recpipe_mode"
FUSED_PARAM_CACHE_LOAD_FACTOR: str = "recpipe_cache_load_factor"
FUSED_PARAM_DIST_TYPE: str = "recpipe_dist_type"
FUSED_PARAM_SEED: str = "recpipe_seed"
FUSED_PARAM_CACHE_POLICY: str = "recpipe_cache_policy"
FUSED_PARAM_OPTIMIZER: str = "recpipe_optimizer"
FUSED_PARAM_DTYPE: str = "recpipe_dtype"
#: Tiered kernel backend (``"native"`` / ``"fbgemm"`` / ``"torch"``; absent: the device's default). Not
#: planned: the tiered sharders' ``backend=`` argument writes it.
FUSED_PARAM_BACKEND: str = "recpipe_backend"
#: A dynamic table's ``DynamicTableOptions`` (as its dict); absent for a table of fixed ids.
FUSED_PARAM_DYNAMIC: str = "recpipe_dynamic"
#: recpipe fused-param keys the sharders write outside the contract; ``from_fused_params`` accepts them.
FUSED_PARAM_RUNTIME_KEYS: Tuple[str, ...] = (FUSED_PARAM_BACKEND,)


class PlacementContractError(ValueError):
    """A table's fused params do not hold a valid placement (missing, unknown or bad key)."""


class PlacementMismatchError(PlacementContractError):
    """A table's planned placement disagrees with what the model trains (fused optimizer or row dtype),
    so the runtime would allocate other bytes than the plan budgeted."""


def _parse_load_factor(value: Any, argument: str) -> float:
    check_load_factor(value, argument)
    return float(value)


def _parse_seed(value: Any, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
        raise ValueError(
            f"{argument} must be an int64 (the routing op's seed), got {value!r}: e.g. 0, or the run's seed."
        )
    return int(value)


_enum_value = attrgetter("value")
# PlacementParams field -> (fused-param key, parser(value, argument) raising a ValueError that names the
# argument, encoder to a plain str / float / int: torchrec deep-copies fused params and compares them).
_CODEC: Dict[str, Tuple[str, Callable[[Any, str], Any], Callable[[Any], Any]]] = {
    "mode": (FUSED_PARAM_MODE, Mode.parse, _enum_value),
    "cache_load_factor": (FUSED_PARAM_CACHE_LOAD_FACTOR, _parse_load_factor, float),
    "dist_type": (FUSED_PARAM_DIST_TYPE, DistType.parse, _enum_value),
    "seed": (FUSED_PARAM_SEED, _parse_seed, int),
    "cache_policy": (FUSED_PARAM_CACHE_POLICY, CachePolicy.parse, _enum_value),
    "optimizer": (FUSED_PARAM_OPTIMIZER, FusedOptimizerKind.parse, _enum_value),
    "dtype": (FUSED_PARAM_DTYPE, resolve_dtype, dtype_name),
}
#: Every key of the contract, in :class:`PlacementParams` field order.
FUSED_PARAM_KEYS: Tuple[str, ...] = tuple(key for key, _, _ in _CODEC.values())

_PLAN_FIX = (
    "plan the model with recpipe.planner: PlacementPlanner(topology).plan(model).to_sharding_plan() "
    "writes every key into each table's PlacementParameterSharding"
)


@dataclass(frozen=True, kw_only=True)
class PlacementParams:
    """The placement of one tiered table: what the planner sized, what the runtime builds. Strings are accepted for the
    enum fields and the dtype and normalized; :meth:`to_fused_params` and :meth:`from_fused_params` are the encoding
    into torchrec fused params."""

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
    optimizer: FusedOptimizerKind
    """Fused optimizer the table was sized for; the runtime refuses any other."""
    dtype: torch.dtype
    """Row dtype the table was sized for (e.g. ``torch.float32``); the runtime refuses any other."""
    dynamic: Optional[DynamicTableOptions] = None
    """A dynamic table's options (raw int64 keys in a scored hash index); None: ids in ``[0, num_embeddings)``."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in _CODEC:
                value = _CODEC[f.name][1](getattr(self, f.name), f"PlacementParams.{f.name}")
                object.__setattr__(self, f.name, value)
        if self.dynamic is not None and not isinstance(self.dynamic, DynamicTableOptions):
            object.__setattr__(self, "dynamic", DynamicTableOptions.from_fused_param(self.dynamic))

    def row_bytes(self, dim: int) -> int:
        """Bytes of one row of this table (values plus optimizer state)."""
        return row_bytes(dim, self.dtype, self.optimizer)

    def to_fused_params(self) -> Dict[str, Any]:
        """The torchrec fused params carrying this placement (plain str / float / int values)."""
        out = {key: encode(getattr(self, name)) for name, (key, _, encode) in _CODEC.items()}
        if self.dynamic is not None:
            out[FUSED_PARAM_DYNAMIC] = self.dynamic.to_fused_param()
        return out

    @classmethod
    def from_fused_params(cls, fused_params: Optional[Mapping[str, Any]], table_name: str) -> "PlacementParams":
        """Reads and validates the placement a table's fused params carry. Other (torchrec / fbgemm) keys are ignored;
        every :data:`FUSED_PARAM_KEYS` key must be present, and no other ``recpipe_`` key but
        :data:`FUSED_PARAM_RUNTIME_KEYS`.

        Raises:
            PlacementContractError: a key is missing, unknown or holds a bad value.
        """
        fp = dict(fused_params or {})
        known = FUSED_PARAM_KEYS + FUSED_PARAM_RUNTIME_KEYS + (FUSED_PARAM_DYNAMIC,)
        unknown = sorted(k for k in fp if isinstance(k, str) and k.startswith(FUSED_PARAM_PREFIX) and k not in known)
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
                "  2) in a hand-written plan, give the table a recpipe.planner.torchrec_plan.PlacementParameterSharding "
                "(not a plain ParameterSharding) with compute_kernel customized_kernel."
            )
        values: Dict[str, Any] = {}
        for name, (key, parse, _) in _CODEC.items():
            try:
                values[name] = parse(fp[key], key)
            except ValueError as e:
                raise PlacementContractError(
                    f"table {table_name!r}: fused param {key!r} holds an invalid value: {e}\n"
                    f"Possible solutions:\n  1) {_PLAN_FIX};\n"
                    f"  2) correct {key!r} where the plan (or the sharder's fused_params) sets it."
                ) from None
        if fp.get(FUSED_PARAM_DYNAMIC) is not None:
            try:
                values["dynamic"] = DynamicTableOptions.from_fused_param(fp[FUSED_PARAM_DYNAMIC])
            except ValueError as e:
                raise PlacementContractError(
                    f"table {table_name!r}: fused param {FUSED_PARAM_DYNAMIC!r} holds invalid dynamic-table options: "
                    f"{e}\nPossible solutions:\n  1) {_PLAN_FIX};\n  2) pass recpipe.pipeline.DynamicTableOptions "
                    "through recpipe.planner.PlacementConstraints(dynamic=...)."
                ) from None
        return cls(**values)

    def check_runtime(
        self,
        table_name: str,
        *,
        optimizer: Union[FusedOptimizerKind, str],
        dtype: Union[torch.dtype, str],
        dim: Optional[int] = None,
    ) -> None:
        """Raises :class:`PlacementMismatchError` unless the model trains the table as planned (``dim``,
        when given, adds the bytes per row to the message)."""
        actual_opt = FusedOptimizerKind.parse(optimizer)
        actual_dtype = resolve_dtype(dtype)
        what: List[str] = []
        fixes = [
            "re-plan with the model: PlacementPlanner(topology).plan(model) reads each table's fused "
            "optimizer (apply_optimizer_in_backward, or the planner's fused_params=) and dtype from it; "
            "call apply_optimizer_in_backward before planning"
        ]
        if actual_opt is not self.optimizer:
            what.append(f"fused optimizer {self.optimizer.value}, but the model trains it with {actual_opt.value}")
            fixes.append(
                f"train the table with the planned {self.optimizer.value} instead: change "
                "apply_optimizer_in_backward (or the sharder's fused_params 'optimizer') for it"
            )
        if actual_dtype != self.dtype:
            what.append(f"row dtype {dtype_name(self.dtype)}, but the table's data_type is {dtype_name(actual_dtype)}")
            fixes.append(f"set the table config's data_type to the planned {dtype_name(self.dtype)} instead")
        if not what:
            return
        sizes = ""
        if dim is not None:
            sizes = (
                f" The tiered kernel would allocate {row_bytes(dim, actual_dtype, actual_opt)} bytes per row "
                f"where the plan budgeted {self.row_bytes(dim)}."
            )
        raise PlacementMismatchError(
            f"table {table_name!r} was planned for {' and '.join(what)}.{sizes} Refusing to build it.\n"
            "Possible solutions:\n" + "\n".join(f"  {i + 1}) {s}" for i, s in enumerate(fixes))
        )
