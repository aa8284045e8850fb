"""Data types of the placement planner: table specs, options, plans, errors.

The placement enums (``Mode`` ...) and ``parse_enum`` come from the placement
contract, :mod:`recpipe.pipeline.placement`, and are re-exported here.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.types import KernelConfig, Topology, TopologyFactory, TrainerConfig
from torchrec.distributed.planner.types import PlannerError as _TorchrecPlannerError
from torchrec.distributed.types import CacheStatistics, EmbeddingModuleShardingPlan, ShardingPlan, ShardingType

from recpipe.pipeline.routing.ops import check_int
from recpipe.pipeline.placement import (
    CachePolicy,
    DistType,
    FusedOptimizer,
    Mode,
    PlacementParams,
    ShardStorage,
    check_load_factor,
    check_load_factors,
    dtype_name,
    machine_sum,
    max_local_rows,
    parse_enum,
    resolve_dtype,
    row_bytes,
    shard_storage,
)
from recpipe.planner.sharding import PlacementParameterSharding, row_wise_sharding_spec

# torchrec's default Zipf-like skew used by the seed's sweep (TorchEasyRec PR #508:
# "pow-law alpha=1.05"). Dimensionless.
DEFAULT_ZIPF_ALPHA: float = 1.05
# Default cache load factor grid of the seed enumerator (PR #508): 0.1, 0.2, ..., 1.0.
DEFAULT_LOAD_FACTORS: Tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(1, 11))

#: Tiered-table backends whose byte layouts the planner budgets: ``native`` (recpipe's
#: own layout, ``recpipe.pipeline.placement.shard_storage``: the CPU kernel and the
#: torch backend) and ``fbgemm`` (fbgemm's TBE on CUDA,
#: ``recpipe.pipeline.tiered.fbgemm.fbgemm_shard_storage``).
STORAGE_BACKENDS: Tuple[str, ...] = ("native", "fbgemm")


class PlannerErrorType(enum.Enum):
    """Why the planner failed (torchrec style)."""

    INSUFFICIENT_HBM = "insufficient_hbm"
    INSUFFICIENT_DDR = "insufficient_ddr"
    INSUFFICIENT_STORAGE = "insufficient_storage"
    TABLE_DOES_NOT_FIT = "table_does_not_fit"
    STRICT_CONSTRAINTS = "strict_constraints"
    INPUT_VALIDATION = "input_validation"


class PlannerError(_TorchrecPlannerError):
    """Planner failure with a typed reason; a subclass of torchrec's ``PlannerError``.

    Args:
        message (str): the explanation, including numbered "Possible solutions".
        error_type (PlannerErrorType): the reason.
    """

    def __init__(self, message: str, error_type: PlannerErrorType) -> None:
        super().__init__(message)
        # torchrec stores its own enum here; ours is richer, keep both readable.
        self.error_type = error_type  # type: ignore[assignment]
        self.planner_error_type: PlannerErrorType = error_type


class PlannerInputError(PlannerError, ValueError):
    """A ``PlannerError`` of type ``INPUT_VALIDATION`` that is also a ``ValueError``: an argument
    the planner cannot take (the message names it, quotes its value and lists numbered
    "Possible solutions"), caught by ``except ValueError`` as the planner's other argument
    checks are.

    Args:
        message (str): the explanation, including numbered "Possible solutions".
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, PlannerErrorType.INPUT_VALIDATION)


def format_bytes(num: float, round_up: bool = False) -> str:
    """Human readable bytes in binary units, e.g. ``1.50 GiB``.

    Args:
        num (float): bytes.
        round_up (bool): round up to the 2 decimals shown (for a size the user must
            reach: a minimum never reads smaller than it is).

    Returns:
        str: formatted size.

    Raises:
        ValueError: ``num`` is not a finite number (None, a string, a bool, nan, inf),
            or ``round_up`` is not a bool.
    """
    if isinstance(num, bool) or not isinstance(num, numbers.Real) or not math.isfinite(num):
        raise ValueError(
            f"format_bytes(num): num must be a finite number of bytes, got {type(num).__name__} {num!r}; "
            "pass a byte count such as 1536 (a nan or inf size is a bug in the caller's arithmetic)."
        )
    if not isinstance(round_up, bool):
        raise ValueError(f"format_bytes(round_up): round_up must be True or False, got {type(round_up).__name__} "
                         f"{round_up!r}.")
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    value = float(num)
    for unit in units:
        if abs(value) < 1024.0 or unit == units[-1]:
            if unit == "B":
                return f"{math.ceil(value) if round_up else value:.0f} {unit}"
            return f"{math.ceil(value * 100) / 100 if round_up else value:.2f} {unit}"
        value /= 1024.0
    return f"{value:.2f} PiB"  # pragma: no cover


def _load_factor_text(x: float) -> str:
    """``x`` with 2 decimals (``0.20``), or every decimal it has when 2 would change it (``0.125``)."""
    two = f"{x:.2f}"
    return two if float(two) == x else repr(float(x))


#: Largest table the planner accepts, in bytes (values + optimizer state): its byte
#: arithmetic runs in int64 (numpy arrays, torch tensors), which a 2^62 bound keeps
#: clear of overflow after sums over a few tables. Source: int64 range, 2^63 - 1.
MAX_TABLE_BYTES: int = 2**62


@dataclass(kw_only=True)
class TableSpec:
    """One embedding table to place.

    Example::

        TableSpec(name="t0", rows=4_000_000, dim=128, optimizer=FusedOptimizer.ADAM,
                  lookups_per_step=65536)
    """

    name: str
    """Table name (unique within a module)."""
    rows: int
    """Rows of the whole table (``num_embeddings``)."""
    dim: int
    """Embedding dimension."""
    dtype: Union[torch.dtype, str] = torch.float32
    """Dtype of the embedding values (a name such as ``"float16"`` is read as the torch dtype).
    The byte formulas take any dtype; the planner plans only the ones tiered tables
    hold (``TIERED_DTYPES``: float32)."""
    optimizer: Union[FusedOptimizer, str] = FusedOptimizer.ADAM
    """Fused optimizer: sgd, rowwise_adagrad, adagrad or adam (sets state bytes). The
    planner plans only the ones tiered tables run (sgd, rowwise_adagrad, adam)."""
    lookups_per_step: float = 512.0
    """Expected rows looked up per rank per training step (batch x pooling factor)."""
    zipf_alpha: float = DEFAULT_ZIPF_ALPHA
    """Skew of the access distribution (Zipf exponent) when no measurement is given."""
    access_counts: Optional[Sequence[float]] = None
    """Measured per-row access counts; overrides ``zipf_alpha`` when given."""
    cache_stats: Optional[CacheStatistics] = None
    """torchrec ``CacheStatistics``; overrides the other access models when given."""
    module_path: str = ""
    """FQN of the embedding module holding the table ("" for a bare EBC/EC)."""
    feature_names: Tuple[str, ...] = ()
    """Features looking the table up (informational)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableSpec.name must be a non-empty string (the table's name), got {self.name!r}.")
        if not isinstance(self.module_path, str):
            raise ValueError(f"TableSpec({self.name}).module_path must be a string (the FQN of the embedding module, "
                             f"'' for a bare EBC / EC), got {self.module_path!r}.")
        if isinstance(self.feature_names, (str, bytes)) or not hasattr(self.feature_names, "__iter__") \
                or not all(isinstance(f, str) for f in self.feature_names):
            raise ValueError(f"TableSpec({self.name}).feature_names must be a list of feature names (str), got "
                             f"{self.feature_names!r}; e.g. ['f0'] for one feature.")
        for field_name in ("rows", "dim"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"TableSpec({self.name}).{field_name} must be a positive int, got {value!r} "
                    f"({type(value).__name__}); write a whole number, without a decimal point or quotes."
                )
        self.dtype = resolve_dtype(self.dtype, f"TableSpec({self.name}).dtype")
        self.optimizer = FusedOptimizer.parse(self.optimizer, f"TableSpec({self.name}).optimizer")
        table_bytes = self.rows * row_bytes(self.dim, self.dtype, self.optimizer)
        if table_bytes > MAX_TABLE_BYTES:
            raise ValueError(
                f"TableSpec({self.name}) needs {table_bytes} bytes ({self.rows} rows x "
                f"{row_bytes(self.dim, self.dtype, self.optimizer)} bytes per row), above the planner's "
                f"limit of 2^62 bytes per table; check rows={self.rows} (a typo?) or split the table."
            )
        for field_name in ("lookups_per_step", "zipf_alpha"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"TableSpec({self.name}).{field_name} must be a number, got {value!r}.")
        if not (self.lookups_per_step >= 0 and math.isfinite(self.lookups_per_step)):
            raise ValueError(
                f"TableSpec({self.name}).lookups_per_step must be a finite number >= 0, "
                f"got {self.lookups_per_step!r}."
            )
        if not (self.zipf_alpha >= 0 and math.isfinite(self.zipf_alpha)):
            raise ValueError(f"TableSpec({self.name}).zipf_alpha must be a finite number >= 0, got {self.zipf_alpha!r}.")
        if self.access_counts is not None and len(self.access_counts) == 0:
            raise ValueError(
                f"TableSpec({self.name}).access_counts is empty: pass per-row counts or None."
            )
        if self.access_counts is not None:
            self._check_access_counts()
        self.feature_names = tuple(self.feature_names)

    def _check_access_counts(self) -> None:
        """Refuses ``access_counts`` that are not one finite count >= 0 per row, not all 0."""
        fix = "pass one measured count per row (row i's lookups), or access_counts=None to model access by zipf_alpha"
        try:
            counts = np.asarray(self.access_counts, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(
                f"TableSpec({self.name}).access_counts must be numbers, got {type(self.access_counts).__name__}; {fix}."
            ) from None
        if counts.ndim != 1 or counts.size != self.rows:
            raise ValueError(
                f"TableSpec({self.name}).access_counts has {counts.size} entries (shape {tuple(counts.shape)}) for "
                f"rows={self.rows}; {fix}."
            )
        bad = np.flatnonzero(~(np.isfinite(counts) & (counts >= 0)))
        if bad.size:
            raise ValueError(
                f"TableSpec({self.name}).access_counts must be finite numbers >= 0, got {float(counts[bad[0]])!r} at row "
                f"{int(bad[0])} ({bad.size} such rows); {fix}."
            )
        if not counts.any():
            raise ValueError(
                f"TableSpec({self.name}).access_counts are all 0: they measure no lookup, so they give no hit rate; {fix}."
            )

    @property
    def fqn(self) -> str:
        """``module_path.name`` (or ``name`` for a bare module)."""
        return f"{self.module_path}.{self.name}" if self.module_path else self.name


@dataclass(kw_only=True)
class PlacementConstraints:
    """User pins for one table; unset fields are chosen by the planner.

    Example::

        PlacementPlanner(topo, constraints={"t0": PlacementConstraints(mode=Mode.CACHING)})
    """

    mode: Optional[Union[Mode, str]] = None
    """Pin the placement mode (x = 1.0 stays allowed: every row in HBM, which the plan calls
    HYBRID x = 1.0 whatever mode is pinned; the report shows it as HBM)."""
    cache_load_factor: Optional[float] = None
    """Pin the cache load factor x in (0, 1]."""
    load_factors: Optional[Sequence[float]] = None
    """Restrict this table's x grid (instead of the planner-wide grid)."""

    def __post_init__(self) -> None:
        if self.mode is not None:
            self.mode = Mode.parse(self.mode)
        if self.cache_load_factor is not None:
            check_load_factor(self.cache_load_factor, "PlacementConstraints.cache_load_factor")
        if self.load_factors is not None:
            check_load_factors(self.load_factors, "PlacementConstraints.load_factors")


@dataclass(frozen=True)
class PlacementOption:
    """One (mode, x) candidate for a table, with its bytes and modelled cost.

    Args:
        mode (Mode): placement mode (``x == 1`` is reported as HYBRID).
        cache_load_factor (float): x in (0, 1].
        hbm_bytes_per_rank (int): fast-tier bytes on the most loaded rank.
        ddr_bytes_per_rank (int): slow-tier bytes on the most loaded rank.
        hbm_bytes_per_machine (int): fast-tier bytes summed over the most loaded machine.
        ddr_bytes_per_machine (int): slow-tier bytes summed over the most loaded machine.
        cost (float): modelled step cost in ms (per rank).
    """

    mode: Mode
    cache_load_factor: float
    hbm_bytes_per_rank: int
    ddr_bytes_per_rank: int
    hbm_bytes_per_machine: int
    ddr_bytes_per_machine: int
    cost: float = 0.0


@dataclass(frozen=True)
class TablePlacement:
    """The chosen placement of one table.

    Args:
        table (str): table name.
        module_path (str): FQN of its embedding module.
        rows (int): rows of the whole table.
        dim (int): embedding dimension.
        mode (Mode): chosen mode.
        cache_load_factor (float): chosen x.
        hbm_bytes_per_rank (int): fast-tier bytes, most loaded rank.
        ddr_bytes_per_rank (int): slow-tier bytes, most loaded rank.
        hbm_bytes_per_machine (int): fast-tier bytes, most loaded machine.
        ddr_bytes_per_machine (int): slow-tier bytes, most loaded machine.
        cost (float): modelled step cost in ms.
        optimizer (FusedOptimizer): fused optimizer the bytes were sized for.
        dtype (torch.dtype): row dtype the bytes were sized for.
    """

    table: str
    module_path: str
    rows: int
    dim: int
    mode: Mode
    cache_load_factor: float
    hbm_bytes_per_rank: int
    ddr_bytes_per_rank: int
    hbm_bytes_per_machine: int
    ddr_bytes_per_machine: int
    cost: float
    optimizer: FusedOptimizer
    dtype: torch.dtype

    @property
    def fqn(self) -> str:
        """``module_path.table``."""
        return f"{self.module_path}.{self.table}" if self.module_path else self.table


@dataclass
class PlacementPlan:
    """A placement for every table plus the budgets it was planned against.

    Args:
        placements (List[TablePlacement]): one per table, in input order.
        world_size (int): ranks ``W``.
        local_world_size (int): ranks per machine ``L``.
        compute_device (str): torchrec compute device of the topology.
        hbm_budget_per_rank (int): usable HBM per device (after reservation).
        ddr_budget_per_machine (int): usable host DDR per machine (after reservation).
        cost_model (str): name of the cost model used.
        dist_type (DistType | str): routing of ids to ranks carried to the sharders.
        seed (int): hash seed carried to the sharders.
        cache_policy (CachePolicy | str): eviction policy of CACHING tables carried to the sharders.
        backend (str): the tiered tables' backend whose bytes the plan budgets
            (``fbgemm`` or ``native``; plans saved before it was recorded were ``native``).
    """

    placements: List[TablePlacement]
    world_size: int
    local_world_size: int
    compute_device: str
    hbm_budget_per_rank: int
    ddr_budget_per_machine: int
    cost_model: str = "analytic"
    dist_type: DistType = DistType.HASH_ROUNDROBIN
    seed: int = 0
    cache_policy: CachePolicy = CachePolicy.LFU
    backend: str = "native"

    def __post_init__(self) -> None:
        self.dist_type = DistType.parse(self.dist_type, "PlacementPlan.dist_type")
        self.cache_policy = CachePolicy.parse(self.cache_policy, "PlacementPlan.cache_policy")
        if self.backend not in STORAGE_BACKENDS:
            raise ValueError(f"PlacementPlan.backend must be one of {list(STORAGE_BACKENDS)}, got {self.backend!r}.")

    # ---- totals -------------------------------------------------------------
    @property
    def hbm_bytes_per_rank(self) -> int:
        """Total fast-tier bytes on the most loaded rank."""
        return sum(p.hbm_bytes_per_rank for p in self.placements)

    @property
    def ddr_bytes_per_machine(self) -> int:
        """Total slow-tier bytes on the most loaded machine."""
        return sum(p.ddr_bytes_per_machine for p in self.placements)

    @property
    def total_cost(self) -> float:
        """Modelled step cost (ms) summed over tables."""
        return float(sum(p.cost for p in self.placements))

    def placement(self, table: str, module_path: Optional[str] = None) -> TablePlacement:
        """The placement of ``table`` (optionally in ``module_path``).

        Args:
            table (str): table name.
            module_path (Optional[str]): module FQN to disambiguate.

        Returns:
            TablePlacement: the placement.

        Raises:
            KeyError: no table matches, or ``table`` names tables of several modules
                and ``module_path`` is None (the message names their full names).
        """
        found = [p for p in self.placements if p.table == table and (module_path is None or p.module_path == module_path)]
        if len(found) > 1:
            raise KeyError(
                f"table {table!r} is ambiguous: {len(found)} modules hold a table of that name "
                f"{[p.fqn for p in found]}; pass module_path, one of {[p.module_path for p in found]} "
                f"(e.g. placement({table!r}, module_path={found[0].module_path!r}))."
            )
        if found:
            return found[0]
        raise KeyError(f"table {table!r} is not in this plan: {[p.fqn for p in self.placements]}")

    def placement_params(self, table: Union[str, TablePlacement], module_path: Optional[str] = None) -> PlacementParams:
        """The placement contract of one table, as the sharders will read it.

        Args:
            table (str | TablePlacement): table name, or one of this plan's placements.
            module_path (Optional[str]): module FQN to disambiguate a name.

        Returns:
            PlacementParams: mode, load factor, routing, seed, cache policy, and the
            optimizer and dtype the table was sized for.
        """
        p = table if isinstance(table, TablePlacement) else self.placement(table, module_path)
        return PlacementParams(
            mode=p.mode,
            cache_load_factor=p.cache_load_factor,
            dist_type=self.dist_type,
            seed=self.seed,
            cache_policy=self.cache_policy,
            optimizer=p.optimizer,
            dtype=p.dtype,
        )

    # ---- reporting ----------------------------------------------------------
    def report(self) -> str:
        """A text table: one row per table, then totals against budgets.

        Returns:
            str: the report.
        """
        head = ("table", "mode", "x", "optimizer", "HBM/rank", "DDR/rank", "DDR/machine", "cost ms")
        rows = [
            (
                p.fqn,
                p.mode.name if p.cache_load_factor < 1.0 else "HBM",
                _load_factor_text(p.cache_load_factor),
                p.optimizer.value,
                format_bytes(p.hbm_bytes_per_rank),
                format_bytes(p.ddr_bytes_per_rank),
                format_bytes(p.ddr_bytes_per_machine),
                f"{p.cost:.4f}",
            )
            for p in self.placements
        ]
        widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
        fmt = " | ".join("{:<%d}" % w for w in widths)
        lines = [
            f"recpipe placement plan: world_size={self.world_size} "
            f"local_world_size={self.local_world_size} device={self.compute_device} "
            f"backend={self.backend} cost_model={self.cost_model}",
            fmt.format(*head),
            "-+-".join("-" * w for w in widths),
        ]
        lines += [fmt.format(*r) for r in rows]
        hbm_pct = 100.0 * self.hbm_bytes_per_rank / max(self.hbm_budget_per_rank, 1)
        ddr_pct = 100.0 * self.ddr_bytes_per_machine / max(self.ddr_budget_per_machine, 1)
        lines += [
            "",
            f"HBM per rank:    {format_bytes(self.hbm_bytes_per_rank)} ({self.hbm_bytes_per_rank} B)"
            f" of {format_bytes(self.hbm_budget_per_rank)} ({hbm_pct:.1f}%)",
            f"DDR per machine: {format_bytes(self.ddr_bytes_per_machine)} ({self.ddr_bytes_per_machine} B)"
            f" of {format_bytes(self.ddr_budget_per_machine)} ({ddr_pct:.1f}%)",
            f"modelled cost:   {self.total_cost:.4f} ms/step; "
            f"modes: {sum(p.mode is Mode.HYBRID and p.cache_load_factor < 1 for p in self.placements)} HYBRID, "
            f"{sum(p.mode is Mode.CACHING and p.cache_load_factor < 1 for p in self.placements)} CACHING, "
            f"{sum(p.cache_load_factor >= 1 for p in self.placements)} all-HBM",
        ]
        return "\n".join(lines)

    # ---- torchrec ------------------------------------------------------------
    def to_sharding_plan(self, compute_device: Optional[str] = None) -> ShardingPlan:
        """Convert to a torchrec ``ShardingPlan`` (ROW_WISE, CUSTOMIZED_KERNEL).

        Args:
            compute_device (Optional[str]): device written in shard placements;
                defaults to the topology's compute device.

        Returns:
            ShardingPlan: one ``PlacementParameterSharding`` per table, carrying
            :meth:`placement_params`.

        Warns:
            UserWarning: ``compute_device`` is given and the tiered sharders' default
                backend there runs another layout than the plan's ``backend`` (see
                :func:`to_sharding_plan`).
        """
        return _to_sharding_plan(self, compute_device)

    # ---- JSON ----------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """A JSON-serialisable dict of the plan.

        Returns:
            Dict[str, Any]: the plan.
        """
        d = asdict(self)
        for p in d["placements"]:
            p["mode"] = p["mode"].name
            p["optimizer"] = p["optimizer"].value
            p["dtype"] = dtype_name(p["dtype"])
        d["dist_type"] = self.dist_type.value
        d["cache_policy"] = self.cache_policy.value
        return d

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "PlacementPlan":
        """Inverse of ``to_dict``.

        Args:
            data (Dict[str, Any]): a dict from ``to_dict`` (e.g. ``json.load`` of a
                file :meth:`save` wrote).

        Returns:
            PlacementPlan: the plan.

        Raises:
            ValueError: ``data`` is not such a dict: not a dict, a key missing or
                unknown, or a value of the wrong type or out of range; the message
                names the key (``data['placements'][i]['rows']``) and the fix.
        """
        try:
            return cls._from_dict(data)
        except ValueError as e:
            raise ValueError(f"PlacementPlan.from_dict(data): {e}") from None

    @classmethod
    def _from_dict(cls, data: Any) -> "PlacementPlan":
        """``from_dict`` without the prefix naming the caller in its errors."""
        fix = ("pass the dict PlacementPlan.to_dict() returns (or json.load of a file PlacementPlan.save wrote); "
               "re-plan with PlacementPlanner(topology).plan(model) and save it again if the file was edited")
        _check_keys(data, "data", _PLAN_REQUIRED_KEYS, _PLAN_OPTIONAL_KEYS, fix)
        placements_data = data["placements"]
        if isinstance(placements_data, (str, bytes)) or not isinstance(placements_data, Sequence):
            raise ValueError(f"data['placements'] must be a list of table placements, got "
                             f"{type(placements_data).__name__} {placements_data!r:.80}; {fix}.")
        placements = [_placement_from_dict(p, k, fix) for k, p in enumerate(placements_data)]
        seen: Dict[str, int] = {}
        for k, p in enumerate(placements):
            first = seen.setdefault(p.fqn, k)
            if first != k:
                raise ValueError(f"data['placements'][{k}] places table {p.fqn!r} like data['placements'][{first}]: "
                                 f"a plan places each table once; {fix}.")
        values = {key: data[key] for key in _PLAN_REQUIRED_KEYS + _PLAN_OPTIONAL_KEYS if key in data}
        for key in ("world_size", "local_world_size"):
            values[key] = check_int(values[key], f"data[{key!r}]", 1)
        if values["world_size"] % values["local_world_size"]:
            raise ValueError(f"data['local_world_size'] ({values['local_world_size']}) must divide data['world_size'] "
                             f"({values['world_size']}); {fix}.")
        for key in ("hbm_budget_per_rank", "ddr_budget_per_machine"):
            values[key] = check_int(values[key], f"data[{key!r}]", 0)
        for key in ("compute_device", "cost_model", "backend"):
            if key in values and (not isinstance(values[key], str) or not values[key]):
                raise ValueError(f"data[{key!r}] must be a non-empty string, got {type(values[key]).__name__} "
                                 f"{values[key]!r}; {fix}.")
        if "seed" in values:
            values["seed"] = check_int(values["seed"], "data['seed']", -(2**63), 2**63 - 1)
        for key, parse in (("dist_type", DistType.parse), ("cache_policy", CachePolicy.parse)):
            if key in values:
                values[key] = parse(values[key], f"data[{key!r}]")
        if values.get("backend", "native") not in STORAGE_BACKENDS:
            raise ValueError(f"data['backend'] must be one of {list(STORAGE_BACKENDS)}, got {values['backend']!r}.")
        values["placements"] = placements
        return cls(**values)

    def save(self, path: Union[str, Path]) -> None:
        """Write the plan as JSON.

        Args:
            path (str | Path): output file.

        Raises:
            ValueError: ``path`` is not a path (a str or ``os.PathLike``).
        """
        _check_path(path, "PlacementPlan.save")
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))

    @classmethod
    def load(cls, path: Union[str, Path]) -> "PlacementPlan":
        """Read a plan written by ``save``.

        Args:
            path (str | Path): input file.

        Returns:
            PlacementPlan: the plan.

        Raises:
            ValueError: ``path`` is not a path, or the file is not a plan (not UTF-8
                JSON, or JSON that :meth:`from_dict` refuses); the message names the file.
            OSError: the file cannot be read (``FileNotFoundError``, ...).
        """
        _check_path(path, "PlacementPlan.load")
        text = Path(path).read_bytes()
        if not text.strip():
            raise ValueError(f"PlacementPlan.load({str(path)!r}): the file is empty; expected a JSON placement plan "
                             "as PlacementPlan.save writes it.")
        what = "a JSON placement plan as PlacementPlan.save writes it"
        try:
            data = json.loads(text.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"PlacementPlan.load({str(path)!r}): the file is not UTF-8 text (byte {e.start}); "
                             f"expected {what}.") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"PlacementPlan.load({str(path)!r}): the file is not JSON ({e.msg} at line {e.lineno} "
                             f"column {e.colno}); expected {what}.") from None
        if not isinstance(data, dict):
            raise ValueError(f"PlacementPlan.load({str(path)!r}): the file holds a JSON {type(data).__name__}, not a "
                             f"plan; expected {what} (a JSON object with keys {list(_PLAN_REQUIRED_KEYS)}).")
        try:
            return cls._from_dict(data)
        except ValueError as e:
            raise ValueError(f"PlacementPlan.load({str(path)!r}): the file is not a valid plan: {e}") from None


#: Keys of a plan dict (``PlacementPlan.to_dict``): always written / optional on reading
#: (plans saved before a key was recorded take its default).
_PLAN_REQUIRED_KEYS: Tuple[str, ...] = (
    "placements", "world_size", "local_world_size", "compute_device", "hbm_budget_per_rank", "ddr_budget_per_machine",
)
_PLAN_OPTIONAL_KEYS: Tuple[str, ...] = ("cost_model", "dist_type", "seed", "cache_policy", "backend")
#: Keys of one placement of a plan dict (``TablePlacement`` fields).
_PLACEMENT_KEYS: Tuple[str, ...] = (
    "table", "module_path", "rows", "dim", "mode", "cache_load_factor", "hbm_bytes_per_rank", "ddr_bytes_per_rank",
    "hbm_bytes_per_machine", "ddr_bytes_per_machine", "cost", "optimizer", "dtype",
)


def _check_path(path: Any, caller: str) -> None:
    """Refuses a ``path`` that is not a file path (a non-empty str or ``os.PathLike``)."""
    if not isinstance(path, (str, os.PathLike)) or os.fspath(path) in ("", b""):
        raise ValueError(f"{caller}(path): path must be a plan file's path (a str or pathlib.Path, e.g. "
                         f"'plan.json'), got {type(path).__name__} {path!r}.")


def _check_keys(data: Any, where: str, required: Sequence[str], optional: Sequence[str], fix: str) -> None:
    """Refuses ``data`` unless it is a dict holding every ``required`` key and no key outside ``required + optional``."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a dict with keys {list(required)}, got {type(data).__name__} "
                         f"{data!r:.80}; {fix}.")
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"{where} has no {missing}; {fix}.")
    unknown = sorted(str(k) for k in data if k not in required and k not in optional)
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown} (allowed: {list(required) + list(optional)}); {fix}.")


def _placement_from_dict(p: Any, k: int, fix: str) -> TablePlacement:
    """One ``TablePlacement`` from ``data['placements'][k]``, every value checked."""
    where = f"data['placements'][{k}]"
    if isinstance(p, Mapping) and "table" in p:
        where += f" (table {p['table']!r})"
        absent = [key for key in ("optimizer", "dtype") if key not in p]
        if absent:
            raise ValueError(
                f"plan entry for table {p.get('table')!r} has no {absent}: the plan was written before plans "
                "recorded the optimizer and dtype each table is sized for. Re-plan the model with "
                "PlacementPlanner(topology).plan(model) and save it again."
            )
    _check_keys(p, where, _PLACEMENT_KEYS, (), fix)
    for key in ("table", "module_path"):
        if not isinstance(p[key], str) or (key == "table" and not p[key]):
            raise ValueError(f"{where}[{key!r}] must be a{' non-empty' if key == 'table' else ''} string, got "
                             f"{type(p[key]).__name__} {p[key]!r}; {fix}.")
    ints = {key: check_int(p[key], f"{where}[{key!r}]", 1 if key in ("rows", "dim") else 0)
            for key in ("rows", "dim", "hbm_bytes_per_rank", "ddr_bytes_per_rank", "hbm_bytes_per_machine",
                        "ddr_bytes_per_machine")}
    check_load_factor(p["cache_load_factor"], f"{where}['cache_load_factor']")
    cost = p["cost"]
    if isinstance(cost, bool) or not isinstance(cost, numbers.Real) or not 0 <= cost < math.inf:
        raise ValueError(f"{where}['cost'] must be a finite number >= 0 (modelled ms), got {type(cost).__name__} "
                         f"{cost!r}; {fix}.")
    return TablePlacement(
        table=p["table"],
        module_path=p["module_path"],
        mode=Mode.parse(p["mode"], f"{where}['mode']"),
        cache_load_factor=float(p["cache_load_factor"]),
        cost=float(cost),
        optimizer=FusedOptimizer.parse(p["optimizer"], f"{where}['optimizer']"),
        dtype=resolve_dtype(p["dtype"], f"{where}['dtype']"),
        **ints,
    )


def to_sharding_plan(plan: PlacementPlan, compute_device: Optional[str] = None) -> ShardingPlan:
    """torchrec ``ShardingPlan`` for a placement plan (ROW_WISE, CUSTOMIZED_KERNEL).

    Args:
        plan (PlacementPlan): the placement plan.
        compute_device (Optional[str]): device for shard placements (default the
            plan's compute device).

    Returns:
        ShardingPlan: ``{module_path: {table: PlacementParameterSharding}}``, each
        carrying the table's ``plan.placement_params(...)``.

    Warns:
        UserWarning: ``compute_device`` is given (the device the tiered sharders will
            build the tables on) and their default backend there runs the other layout
            than the one the plan was sized in (``plan.backend``): an ``fbgemm`` plan on
            ``cpu`` (recpipe's native kernel) or a ``native`` plan on ``cuda`` (fbgemm's
            TBE). The warning names the tables whose bytes differ, both layouts, the
            plan's bytes in each and their difference, and the fix.
    """
    return _to_sharding_plan(plan, compute_device)


def _to_sharding_plan(plan: PlacementPlan, compute_device: Optional[str]) -> ShardingPlan:
    """:func:`to_sharding_plan`, called by it and by :meth:`PlacementPlan.to_sharding_plan`
    (one frame each: the warning points at the user's call)."""
    if compute_device is not None:
        _warn_layout_mismatch(plan, compute_device)
    device = compute_device or plan.compute_device
    modules: Dict[str, EmbeddingModuleShardingPlan] = {}
    for p in plan.placements:
        module_plan = modules.setdefault(p.module_path, EmbeddingModuleShardingPlan())
        module_plan[p.table] = PlacementParameterSharding.from_params(
            plan.placement_params(p),
            sharding_type=ShardingType.ROW_WISE.value,
            compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
            ranks=list(range(plan.world_size)),
            sharding_spec=row_wise_sharding_spec(p.rows, p.dim, plan.world_size, plan.local_world_size, device),
        )
    return ShardingPlan(plan=dict(modules))


#: The layout the tiered sharders' default backend runs on each compute device
#: (``recpipe.pipeline.tiered.shard.resolve_backend``: the native kernel on CPU, fbgemm's TBE
#: on CUDA), as a :data:`STORAGE_BACKENDS` name.
_DEVICE_LAYOUT: Dict[str, str] = {"cpu": "native", "cuda": "fbgemm"}
#: What the tiered sharders are given to run each layout on a device whose default is the other.
_LAYOUT_SHARDER_FIX: Dict[Tuple[str, str], str] = {
    # fbgemm's backend on CPU builds HOST tables without a cache, not the layout the plan budgets
    ("cpu", "fbgemm"): "",
    ("cuda", "native"): "TieredEmbeddingBagCollectionSharder(backend='torch') / "
                        "TieredEmbeddingCollectionSharder(backend='torch') (recpipe's layout on CUDA)",
}


def _layout_bytes(plan: PlacementPlan, layout: str) -> List[Optional[Tuple[int, int]]]:
    """Each table's HBM bytes per rank and DDR bytes per machine in ``layout`` at its planned
    mode and load factor (as the enumerator sizes them), or None for a table that layout
    cannot hold (fbgemm's TBE needs a dim that is a multiple of 4)."""
    from recpipe.pipeline.tiered.fbgemm import fbgemm_shard_storage  # the planner's fbgemm formula

    W, L = plan.world_size, plan.local_world_size
    out: List[Optional[Tuple[int, int]]] = []
    for p in plan.placements:

        def shard(rows: int, p: TablePlacement = p) -> ShardStorage:
            if layout == "fbgemm":
                return fbgemm_shard_storage(rows, p.dim, p.dtype, p.optimizer, p.mode, p.cache_load_factor,
                                            plan.cache_policy)
            return shard_storage(rows, p.dim, p.dtype, p.optimizer, p.mode, p.cache_load_factor)

        try:
            out.append((shard(max_local_rows(p.rows, W)).fast_bytes, machine_sum(p.rows, W, L, shard).slow_bytes))
        except ValueError:
            out.append(None)
    return out


def _warn_layout_mismatch(plan: PlacementPlan, compute_device: str) -> None:
    """Warns when the tiered sharders' default backend on ``compute_device`` runs another
    layout than the one ``plan`` was sized in (``plan.backend``), with the bytes of both."""
    runs = _DEVICE_LAYOUT.get(compute_device)
    if runs is None or runs == plan.backend:
        return  # an unknown device is refused by row_wise_sharding_spec
    sized = _layout_bytes(plan, runs)
    cannot = [p.fqn for p, b in zip(plan.placements, sized) if b is None]
    differ = [p.fqn for p, b in zip(plan.placements, sized)
              if b is not None and b != (p.hbm_bytes_per_rank, p.ddr_bytes_per_machine)]
    if not differ and not cannot:
        return
    held = [(p, b) for p, b in zip(plan.placements, sized) if b is not None]  # the tables both layouts hold
    now_h, now_d = sum(p.hbm_bytes_per_rank for p, _ in held), sum(p.ddr_bytes_per_machine for p, _ in held)
    hbm, ddr = sum(b[0] for _, b in held), sum(b[1] for _, b in held)
    names = {"native": "recpipe's native layout", "fbgemm": "fbgemm's layout"}

    def delta(now: int, then: int, budget: int) -> str:
        over = f", over the budget of {format_bytes(budget)} ({budget} B)" if then > budget else ""
        return (f"{format_bytes(now)} ({now} B) in {plan.backend} -> {format_bytes(then)} ({then} B) in {runs}, "
                f"{then - now:+d} B{over}")

    fixes = [f"re-plan with PlacementPlanner(topology, backend={runs!r}) to size the tables in the layout that "
             f"runs on {compute_device}"]
    sharder_fix = _LAYOUT_SHARDER_FIX.get((compute_device, plan.backend))
    if sharder_fix:
        fixes.append(f"run the plan's layout: give the tiered sharders {sharder_fix}")
    some = f"{len(differ)} of its {len(plan.placements)} tables ({differ[:5]}{' ...' if len(differ) > 5 else ''})"
    text = (
        f"to_sharding_plan(compute_device={compute_device!r}): the plan was sized in {names[plan.backend]} "
        f"(backend={plan.backend!r}), but on {compute_device} the tiered sharders run {names[runs]} (backend="
        f"{runs!r}, their default there)"
    )
    if cannot:
        text += f"; {runs} cannot hold {len(cannot)} table(s) {cannot[:5]} at all"
    if differ:
        text += (
            f"; there {some} need other bytes: HBM per rank {delta(now_h, hbm, plan.hbm_budget_per_rank)}; "
            f"DDR per machine {delta(now_d, ddr, plan.ddr_budget_per_machine)}"
            + (" (the tables it cannot hold left out)" if cannot else "")
        )
    warnings.warn(
        text + ".\nPossible solutions:\n" + "\n".join(f"  {k + 1}) {f}" for k, f in enumerate(fixes)),
        UserWarning,
        stacklevel=4,  # the user's call of to_sharding_plan (this, _to_sharding_plan, to_sharding_plan, user)
    )


def check_topology_args(
    world_size: int,
    local_world_size: int,
    hbm_cap: float,
    ddr_cap: float,
    *,
    names: Tuple[str, str, str, str] = ("world_size", "local_world_size", "hbm_cap", "ddr_cap"),
    positive_sizes: bool = False,
) -> None:
    """The checks a topology's shape and sizes must pass (the CLI's flags, :func:`make_topology`
    and :class:`~recpipe.planner.PlacementPlanner` share this one copy).

    Args:
        world_size (int): ranks.
        local_world_size (int): ranks per machine.
        hbm_cap (float): HBM bytes per device.
        ddr_cap (float): DDR bytes (per rank or per machine, as ``names`` says).
        names (Tuple[str, str, str, str]): how the caller spells the four arguments in
            messages (e.g. the CLI's ``--world-size``).
        positive_sizes (bool): refuse a size of 0 too (the CLI); else 0 bytes is a tier
            of no memory (a recipe's ``slow_tier_mb: 0``).

    Raises:
        ValueError: the first argument out of range, named as in ``names``, with its fix.
    """
    ws_name, lws_name, hbm_name, ddr_name = names
    for name, value in ((ws_name, world_size), (lws_name, local_world_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an int (a number of ranks), got {type(value).__name__} {value!r}; "
                             "pass a whole number.")
    if world_size < 1:
        raise ValueError(f"{ws_name} must be >= 1 (the number of ranks), got {world_size}.")
    if local_world_size < 1:
        raise ValueError(f"{lws_name} must be >= 1 (ranks per machine), got {local_world_size}.")
    if local_world_size > world_size or world_size % local_world_size:
        raise ValueError(
            f"{lws_name} ({local_world_size}) must divide {ws_name} ({world_size}): every machine has "
            f"the same number of ranks (e.g. {lws_name}={math.gcd(world_size, local_world_size)})."
        )
    for name, value in ((hbm_name, hbm_cap), (ddr_name, ddr_cap)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a number of bytes, got {type(value).__name__} {value!r}; "
                             "give the memory in bytes, e.g. 80 * 2**30.")
        if positive_sizes and not value > 0:
            raise ValueError(f"{name} must be a positive size such as 80GiB, got {value} bytes.")
        if not value >= 0:  # also refuses nan
            raise ValueError(f"{name} must be a size >= 0 bytes, got {value}; give the memory in bytes, e.g. 80 * 2**30.")
        if value == math.inf:  # the budgets are whole bytes: int(inf) was an OverflowError when planning
            raise ValueError(f"{name} must be a finite size in bytes, got {value}; for memory that never binds, give "
                             "a size past every table's bytes, e.g. 2**60.")


def make_topology(
    *,
    world_size: int,
    local_world_size: int,
    hbm_cap: int,
    ddr_cap: int,
    compute_device: str = "cuda",
) -> Topology:
    """A torchrec ``Topology`` built by torchrec's ``TopologyFactory`` (as torchrec asks;
    a directly constructed one logs a warning on every construction), with torchrec's
    default bandwidths.

    Args:
        world_size (int): ranks.
        local_world_size (int): ranks per machine.
        hbm_cap (int): HBM bytes per device.
        ddr_cap (int): DDR bytes per rank (torchrec's ``Topology.ddr_cap``).
        compute_device (str): ``cuda`` (the planner models CUDA tables; a CPU run
            passes ``cuda`` with ``backend="native"``) or ``cpu``.

    Returns:
        Topology: equal to ``Topology(world_size=..., local_world_size=...,
        compute_device=..., hbm_cap=..., ddr_cap=...)``.

    Raises:
        ValueError: ``world_size`` or ``local_world_size`` below 1, ``local_world_size``
            not dividing ``world_size``, or a negative cap (:func:`check_topology_args`).
    """
    check_topology_args(world_size, local_world_size, hbm_cap, ddr_cap)
    return TopologyFactory.create_topology(
        TrainerConfig(world_size=world_size, local_world_size=local_world_size, hbm_cap_bytes=hbm_cap,
                      ddr_cap_bytes=ddr_cap),
        kernel_config=KernelConfig(compute_device=compute_device),
    )


__all__ = [
    "DEFAULT_LOAD_FACTORS",
    "check_topology_args",
    "make_topology",
    "DEFAULT_ZIPF_ALPHA",
    "STORAGE_BACKENDS",
    "Mode",
    "PlacementConstraints",
    "PlacementOption",
    "PlacementPlan",
    "PlannerError",
    "PlannerErrorType",
    "PlannerInputError",
    "TablePlacement",
    "TableSpec",
    "format_bytes",
    "parse_enum",
    "to_sharding_plan",
]
