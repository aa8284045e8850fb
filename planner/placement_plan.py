"""The planner's answer: :class:`PlacementPlan` (a :class:`TablePlacement` per table), its report, JSON
form and torchrec ``ShardingPlan``."""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan, ShardingType

from recpipe.pipeline.placement import (
    CachePolicy,
    DistType,
    DynamicTableOptions,
    FusedOptimizerKind,
    Mode,
    PlacementParams,
    ShardStorage,
    check_int,
    check_load_factor,
    dtype_name,
    dynamic_shard_storage,
    machine_sum,
    max_local_rows,
    resolve_dtype,
)
from recpipe.planner.errors import format_bytes, solutions
from recpipe.planner.specs import BACKEND_SHARD_STORAGE, STORAGE_BACKENDS
from recpipe.planner.torchrec_plan import (
    PlacementParameterSharding,
    column_shards,
    column_wise_sharding_spec,
    row_wise_sharding_spec,
    table_wise_sharding_spec,
)

_ROW_WISE, _COLUMN_WISE = ShardingType.ROW_WISE.value, ShardingType.COLUMN_WISE.value


def option_text(o: Any) -> str:
    """A placement option in words: ``table_wise FUSED``, ``column_wise FUSED`` or ``row_wise CACHING x=0.20``."""
    if o.fused:
        return f"{o.sharding_type} FUSED"
    storage = o.mode.name if o.cache_load_factor < 1.0 else "HBM"
    return f"{o.sharding_type} {storage} x={_load_factor_text(o.cache_load_factor)}"


def _load_factor_text(x: float) -> str:
    """``x`` with 2 decimals (``0.20``), or every decimal it has when 2 would change it (``0.125``)."""
    two = f"{x:.2f}"
    return two if float(two) == x else repr(float(x))


@dataclass(frozen=True)
class TablePlacement:
    """The chosen placement of one table.

    ``*_per_rank`` / ``*_per_machine`` bytes are those of the most loaded rank / machine (a table-wise
    table's: its owner ``rank``'s; a column-wise table's: one shard per rank, the whole table per machine);
    ``cost`` is the modelled step cost in ms, ``lookup_cost`` plus ``comm_cost``; ``optimizer`` and ``dtype``
    are what the bytes were sized for; ``reason`` says why the option won. ``fused``: torchrec's FUSED table
    (all in the fast tier: mode HYBRID, x = 1), whole on ``rank`` (TABLE_WISE) or in column shards on
    ``ranks`` (COLUMN_WISE, shard ``j`` on ``ranks[j]``); every other table is a recpipe tiered table, whole on
    ``rank`` (TABLE_WISE) or over every rank (ROW_WISE). ``dynamic``: a dynamic table's options (a tiered table
    whose shards hold ``dynamic_local_slots(capacity, shards)`` rows and a hash index), None for a static table.
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
    optimizer: FusedOptimizerKind
    dtype: torch.dtype
    sharding_type: str = ShardingType.ROW_WISE.value
    fused: bool = False
    rank: Optional[int] = None
    lookup_cost: float = 0.0
    comm_cost: float = 0.0
    reason: str = ""
    ranks: Optional[Tuple[int, ...]] = None
    dynamic: Optional[DynamicTableOptions] = None

    @property
    def table_wise(self) -> bool:
        """Whether the whole table lives on ``rank`` (a FUSED or a tiered table)."""
        return self.sharding_type == ShardingType.TABLE_WISE.value

    @property
    def owner_ranks(self) -> Tuple[int, ...]:
        """The ranks holding a whole shard: a table-wise table's owner, a column-wise table's shard owners; ``()``
        for a row-wise table (every rank holds a row shard)."""
        if self.sharding_type == ShardingType.COLUMN_WISE.value:
            return tuple(self.ranks or ())
        return (self.rank,) if self.table_wise and self.rank is not None else ()

    @property
    def storage(self) -> str:
        """``FUSED`` (torchrec's table), ``HBM`` (tiered, all in the fast tier), ``HYBRID`` or ``CACHING``."""
        if self.fused:
            return "FUSED"
        return self.mode.name if self.cache_load_factor < 1.0 else "HBM"

    @property
    def fqn(self) -> str:
        """``module_path.table``."""
        return f"{self.module_path}.{self.table}" if self.module_path else self.table


@dataclass
class PlacementPlan:
    """A placement for every table (in input order) plus the budgets it was planned against.

    The budgets are usable bytes after reservation; ``dist_type``, ``seed`` and ``cache_policy`` are carried
    to the sharders; ``backend`` is the layout (``fbgemm`` / ``native``) whose bytes the plan budgets.
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

    def rank_hbm_bytes(self) -> List[int]:
        """Fast-tier bytes of every rank: each row-wise table's largest shard plus the table-wise tables and
        column shards it owns."""
        row_wise = sum(p.hbm_bytes_per_rank for p in self.placements if p.sharding_type == _ROW_WISE)
        out = [row_wise] * self.world_size
        for p in self.placements:
            for r in p.owner_ranks:
                out[r] += p.hbm_bytes_per_rank
        return out

    @property
    def hbm_bytes_per_rank(self) -> int:
        """Total fast-tier bytes on the most loaded rank."""
        return max(self.rank_hbm_bytes(), default=0)

    def machine_ddr_bytes(self) -> List[int]:
        """Slow-tier bytes of every machine: each row-wise table's most loaded machine's bytes plus the
        table-wise tables its ranks own."""
        row_wise = sum(p.ddr_bytes_per_machine for p in self.placements if p.sharding_type == _ROW_WISE)
        out = [row_wise] * (self.world_size // self.local_world_size)
        for p in self.placements:
            for r in p.owner_ranks:  # a column-wise (FUSED) table has no slow tier
                out[r // self.local_world_size] += p.ddr_bytes_per_machine
        return out

    @property
    def ddr_bytes_per_machine(self) -> int:
        """Total slow-tier bytes on the most loaded machine."""
        return max(self.machine_ddr_bytes(), default=0)

    @property
    def total_cost(self) -> float:
        """Modelled step cost (ms) summed over tables."""
        return float(sum(p.cost for p in self.placements))

    def placement(self, table: str, module_path: Optional[str] = None) -> TablePlacement:
        """The placement of ``table``; ``module_path`` disambiguates a name several modules hold.

        Raises:
            KeyError: no table matches, or several do and ``module_path`` is None.
        """
        found = [
            p for p in self.placements if p.table == table and (module_path is None or p.module_path == module_path)
        ]
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
        """The placement contract of one table, as the sharders will read it."""
        p = table if isinstance(table, TablePlacement) else self.placement(table, module_path)
        return PlacementParams(
            mode=p.mode,
            cache_load_factor=p.cache_load_factor,
            dist_type=self.dist_type,
            seed=self.seed,
            cache_policy=self.cache_policy,
            optimizer=p.optimizer,
            dtype=p.dtype,
            dynamic=p.dynamic,
        )

    def report(self) -> str:
        """The plan as text: one row per table, then totals against the budgets."""
        head = (
            "table",
            "sharding",
            "rank",
            "mode",
            "x",
            "optimizer",
            "HBM/rank",
            "DDR/rank",
            "DDR/machine",
            "lookup ms",
            "comm ms",
            "cost ms",
            "why",
        )
        rows = [
            (
                p.fqn + (" (dynamic)" if p.dynamic is not None else ""),
                p.sharding_type,
                ",".join(map(str, p.owner_ranks)) or "all",
                p.storage,
                _load_factor_text(p.cache_load_factor),
                p.optimizer.value,
                format_bytes(p.hbm_bytes_per_rank),
                format_bytes(p.ddr_bytes_per_rank),
                format_bytes(p.ddr_bytes_per_machine),
                f"{p.lookup_cost:.4f}",
                f"{p.comm_cost:.4f}",
                f"{p.cost:.4f}",
                p.reason,
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
            *(fmt.format(*r) for r in rows),
        ]
        hbm_pct = 100.0 * self.hbm_bytes_per_rank / max(self.hbm_budget_per_rank, 1)
        ddr_pct = 100.0 * self.ddr_bytes_per_machine / max(self.ddr_budget_per_machine, 1)
        lines += [
            "",
            f"HBM per rank:    {format_bytes(self.hbm_bytes_per_rank)} ({self.hbm_bytes_per_rank} B)"
            f" of {format_bytes(self.hbm_budget_per_rank)} ({hbm_pct:.1f}%)",
            f"DDR per machine: {format_bytes(self.ddr_bytes_per_machine)} ({self.ddr_bytes_per_machine} B)"
            f" of {format_bytes(self.ddr_budget_per_machine)} ({ddr_pct:.1f}%)",
            f"modelled cost:   {self.total_cost:.4f} ms/step; "
            f"modes: {sum(p.storage == 'HYBRID' for p in self.placements)} HYBRID, "
            f"{sum(p.storage == 'CACHING' for p in self.placements)} CACHING, "
            f"{sum(p.storage == 'HBM' for p in self.placements)} all-HBM, "
            f"{sum(p.fused and p.table_wise for p in self.placements)} table-wise FUSED; "
            f"{sum(p.table_wise for p in self.placements)} table-wise, "
            f"{sum(p.sharding_type == _ROW_WISE for p in self.placements)} row-wise, "
            f"{sum(p.sharding_type == _COLUMN_WISE for p in self.placements)} column-wise",
        ]
        return "\n".join(lines)

    def to_sharding_plan(self, compute_device: Optional[str] = None) -> ShardingPlan:
        """:func:`to_torchrec_sharding_plan` of this plan."""
        return _to_sharding_plan(self, compute_device)

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-serialisable dict of the plan (read back by :meth:`from_dict`)."""
        d = asdict(self)
        for p in d["placements"]:
            if p["ranks"] is None:
                del p["ranks"]  # plans without column-wise tables read as before
            else:
                p["ranks"] = list(p["ranks"])
            if p["dynamic"] is None:
                del p["dynamic"]
            p["mode"] = p["mode"].name
            p["optimizer"] = p["optimizer"].value
            p["dtype"] = dtype_name(p["dtype"])
        d["dist_type"] = self.dist_type.value
        d["cache_policy"] = self.cache_policy.value
        return d

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "PlacementPlan":
        """Inverse of :meth:`to_dict`; a ValueError names the bad key and the fix."""
        try:
            return cls._from_dict(data)
        except ValueError as e:
            raise ValueError(f"PlacementPlan.from_dict(data): {e}") from None

    @classmethod
    def _from_dict(cls, data: Any) -> "PlacementPlan":
        fix = (
            "pass the dict PlacementPlan.to_dict() returns (or json.load of a file PlacementPlan.save wrote); "
            "re-plan with PlacementPlanner(topology).plan(model) and save it again if the file was edited"
        )
        _check_keys(data, "data", _PLAN_REQUIRED_KEYS, _PLAN_OPTIONAL_KEYS, fix)
        placements_data = data["placements"]
        if isinstance(placements_data, (str, bytes)) or not isinstance(placements_data, Sequence):
            raise ValueError(
                f"data['placements'] must be a list of table placements, got "
                f"{type(placements_data).__name__} {placements_data!r:.80}; {fix}."
            )
        placements = [_placement_from_dict(p, k, fix) for k, p in enumerate(placements_data)]
        seen: Dict[str, int] = {}
        for k, p in enumerate(placements):
            first = seen.setdefault(p.fqn, k)
            if first != k:
                raise ValueError(
                    f"data['placements'][{k}] places table {p.fqn!r} like data['placements'][{first}]: "
                    f"a plan places each table once; {fix}."
                )
        values = {key: data[key] for key in _PLAN_REQUIRED_KEYS + _PLAN_OPTIONAL_KEYS if key in data}
        for key in ("world_size", "local_world_size"):
            values[key] = check_int(values[key], f"data[{key!r}]", 1)
        if values["world_size"] % values["local_world_size"]:
            raise ValueError(
                f"data['local_world_size'] ({values['local_world_size']}) must divide data['world_size'] "
                f"({values['world_size']}); {fix}."
            )
        for key in ("hbm_budget_per_rank", "ddr_budget_per_machine"):
            values[key] = check_int(values[key], f"data[{key!r}]", 0)
        for key in ("compute_device", "cost_model", "backend"):
            if key in values and (not isinstance(values[key], str) or not values[key]):
                raise ValueError(
                    f"data[{key!r}] must be a non-empty string, got {type(values[key]).__name__} "
                    f"{values[key]!r}; {fix}."
                )
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
        """Write the plan as JSON to ``path``."""
        _check_path(path, "PlacementPlan.save")
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))

    @classmethod
    def load(cls, path: Union[str, Path]) -> "PlacementPlan":
        """Read a plan written by :meth:`save`.

        Raises:
            ValueError: ``path`` is not a path, or the file is not a plan; the message names the file.
            OSError: the file cannot be read.
        """
        _check_path(path, "PlacementPlan.load")
        text = Path(path).read_bytes()
        where, what = f"PlacementPlan.load({str(path)!r})", "a JSON placement plan as PlacementPlan.save writes it"
        if not text.strip():
            raise ValueError(f"{where}: the file is empty; expected {what}.")
        try:
            data = json.loads(text.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: the file is not UTF-8 text (byte {e.start}); expected {what}.") from None
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{where}: the file is not JSON ({e.msg} at line {e.lineno} column {e.colno}); expected {what}."
            ) from None
        if not isinstance(data, dict):
            raise ValueError(
                f"{where}: the file holds a JSON {type(data).__name__}, not a plan; expected {what} (a JSON "
                f"object with keys {list(_PLAN_REQUIRED_KEYS)})."
            )
        try:
            return cls._from_dict(data)
        except ValueError as e:
            raise ValueError(f"{where}: the file is not a valid plan: {e}") from None


#: Keys of a plan dict (``PlacementPlan.to_dict``): always written / optional on reading.
_PLAN_REQUIRED_KEYS: Tuple[str, ...] = tuple(f.name for f in fields(PlacementPlan) if f.default is MISSING)
_PLAN_OPTIONAL_KEYS: Tuple[str, ...] = tuple(f.name for f in fields(PlacementPlan) if f.default is not MISSING)
_PLACEMENT_KEYS: Tuple[str, ...] = tuple(f.name for f in fields(TablePlacement) if f.default is MISSING)
_PLACEMENT_OPTIONAL_KEYS: Tuple[str, ...] = tuple(f.name for f in fields(TablePlacement) if f.default is not MISSING)


def _check_path(path: Any, caller: str) -> None:
    if not isinstance(path, (str, os.PathLike)) or os.fspath(path) in ("", b""):
        raise ValueError(
            f"{caller}(path): path must be a plan file's path (a str or pathlib.Path, e.g. "
            f"'plan.json'), got {type(path).__name__} {path!r}."
        )


def _check_keys(data: Any, where: str, required: Sequence[str], optional: Sequence[str], fix: str) -> None:
    """Refuses ``data`` unless it is a dict with every ``required`` key and none outside ``required + optional``."""
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{where} must be a dict with keys {list(required)}, got {type(data).__name__} {data!r:.80}; {fix}."
        )
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
    _check_keys(p, where, _PLACEMENT_KEYS, _PLACEMENT_OPTIONAL_KEYS, fix)
    for key in ("table", "module_path"):
        if not isinstance(p[key], str) or (key == "table" and not p[key]):
            raise ValueError(
                f"{where}[{key!r}] must be a{' non-empty' if key == 'table' else ''} string, got "
                f"{type(p[key]).__name__} {p[key]!r}; {fix}."
            )
    ints = {
        key: check_int(p[key], f"{where}[{key!r}]", 1 if key in ("rows", "dim") else 0)
        for key in _PLACEMENT_KEYS
        if key in ("rows", "dim") or key.endswith(("_per_rank", "_per_machine"))
    }
    check_load_factor(p["cache_load_factor"], f"{where}['cache_load_factor']")
    for key in ("cost", "lookup_cost", "comm_cost"):
        cost = p.get(key, 0.0)
        if isinstance(cost, bool) or not isinstance(cost, numbers.Real) or cost < 0 or not cost < math.inf:
            raise ValueError(
                f"{where}[{key!r}] must be a finite number >= 0 (modelled ms), got {type(cost).__name__} {cost!r}; "
                f"{fix}."
            )
    sharding_type, rank, ranks, fused = _sharding_from_dict(p, where, ints["dim"], fix)
    dynamic = None
    if p.get("dynamic") is not None:
        try:
            dynamic = DynamicTableOptions.from_fused_param(p["dynamic"])
        except ValueError as e:
            raise ValueError(f"{where}['dynamic'] holds invalid dynamic-table options: {e}; {fix}.") from None
        if fused:
            raise ValueError(f"{where}['dynamic'] is set on a FUSED table: a dynamic table is a tiered table; {fix}.")
    reason = p.get("reason", "")
    if not isinstance(reason, str):
        raise ValueError(f"{where}['reason'] must be a string, got {type(reason).__name__}; {fix}.")
    return TablePlacement(
        table=p["table"],
        module_path=p["module_path"],
        mode=Mode.parse(p["mode"], f"{where}['mode']"),
        cache_load_factor=float(p["cache_load_factor"]),
        cost=float(p["cost"]),
        optimizer=FusedOptimizerKind.parse(p["optimizer"], f"{where}['optimizer']"),
        dtype=resolve_dtype(p["dtype"], f"{where}['dtype']"),
        sharding_type=sharding_type,
        fused=fused,
        rank=rank,
        ranks=ranks,
        lookup_cost=float(p.get("lookup_cost", 0.0)),
        comm_cost=float(p.get("comm_cost", 0.0)),
        reason=reason,
        dynamic=dynamic,
        **ints,
    )


def _sharding_from_dict(
    p: Mapping[str, Any], where: str, dim: int, fix: str
) -> Tuple[str, Optional[int], Optional[Tuple[int, ...]], bool]:
    """The sharding fields of a plan entry (``sharding_type``, ``rank``, ``ranks``, ``fused``), each checked
    against the others: a table-wise table has an owner ``rank``, a column-wise one an owner per column shard
    in ``ranks`` and is FUSED, a row-wise one neither and is never FUSED."""
    sharding_type = p.get("sharding_type", _ROW_WISE)
    if sharding_type not in (_ROW_WISE, ShardingType.TABLE_WISE.value, _COLUMN_WISE):
        raise ValueError(
            f"{where}['sharding_type'] must be 'row_wise', 'table_wise' or 'column_wise', got {sharding_type!r}; {fix}."
        )
    rank = p.get("rank")
    if sharding_type == ShardingType.TABLE_WISE.value:
        rank = check_int(rank, f"{where}['rank'] (the owner of a table-wise table)", 0)
    elif rank is not None:
        raise ValueError(
            f"{where}['rank'] must be null for a {sharding_type} table (no one rank holds it), got {rank!r}; {fix}."
        )
    ranks = p.get("ranks")
    if sharding_type == _COLUMN_WISE:
        shards = column_shards(dim)
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or len(ranks) != shards:
            raise ValueError(
                f"{where}['ranks'] must list the owner rank of each of the {shards} column shards of a column_wise "
                f"table of dim {dim}, got {ranks!r}; {fix}."
            )
        ranks = tuple(check_int(r, f"{where}['ranks'][{j}]", 0) for j, r in enumerate(ranks))
    elif ranks is not None:
        raise ValueError(f"{where}['ranks'] must be absent for a {sharding_type} table, got {ranks!r}; {fix}.")
    fused = p.get("fused", False)
    if not isinstance(fused, bool) or (
        fused
        and (sharding_type == _ROW_WISE or p["cache_load_factor"] != 1.0)
        or (sharding_type == _COLUMN_WISE and not fused)
    ):
        raise ValueError(
            f"{where}['fused'] must be a bool, true only for a table_wise table at cache_load_factor 1.0 and for "
            f"every column_wise table, got {fused!r} for a {sharding_type} table; {fix}."
        )
    return sharding_type, rank, ranks, fused


def to_torchrec_sharding_plan(plan: PlacementPlan, compute_device: Optional[str] = None) -> ShardingPlan:
    """torchrec ``ShardingPlan`` for a placement plan.

    A tiered table gets a ``PlacementParameterSharding`` (ROW_WISE over every rank or TABLE_WISE on its
    rank, CUSTOMIZED_KERNEL) carrying ``plan.placement_params(...)``; a FUSED one torchrec's own TABLE_WISE
    FUSED ``ParameterSharding`` on its rank, or COLUMN_WISE FUSED with shard ``j`` on ``ranks[j]``. Warns when
    ``compute_device`` is given and the tiered sharders' default backend there runs another layout than
    ``plan.backend``, with the bytes of both.
    """
    return _to_sharding_plan(plan, compute_device)


def _owner_rank(p: TablePlacement) -> int:
    """The owner ``rank`` of table-wise placement ``p`` (the planner and ``from_dict`` set it)."""
    if p.rank is None:
        raise ValueError(f"placement of {p.fqn!r}: a table_wise table needs its owner rank, got rank=None.")
    return int(p.rank)


def _to_sharding_plan(plan: PlacementPlan, compute_device: Optional[str]) -> ShardingPlan:
    """:func:`to_torchrec_sharding_plan` (one frame below each public entry: the warning points at the user's call)."""
    if compute_device is not None:
        _warn_layout_mismatch(plan, compute_device)
    device = compute_device or plan.compute_device
    modules: Dict[str, EmbeddingModuleShardingPlan] = {}
    for p in plan.placements:
        module_plan = modules.setdefault(p.module_path, EmbeddingModuleShardingPlan())
        if p.sharding_type == _COLUMN_WISE:
            module_plan[p.table] = ParameterSharding(
                sharding_type=_COLUMN_WISE,
                compute_kernel=EmbeddingComputeKernel.FUSED.value,
                ranks=list(p.owner_ranks),
                sharding_spec=column_wise_sharding_spec(p.rows, p.dim, p.owner_ranks, plan.local_world_size, device),
            )
            continue
        if p.fused:
            module_plan[p.table] = ParameterSharding(
                sharding_type=ShardingType.TABLE_WISE.value,
                compute_kernel=EmbeddingComputeKernel.FUSED.value,
                ranks=[_owner_rank(p)],
                sharding_spec=table_wise_sharding_spec(p.rows, p.dim, _owner_rank(p), plan.local_world_size, device),
            )
            continue
        if p.table_wise:
            ranks = [_owner_rank(p)]
            spec = table_wise_sharding_spec(p.rows, p.dim, ranks[0], plan.local_world_size, device)
        else:
            ranks = list(range(plan.world_size))
            spec = row_wise_sharding_spec(p.rows, p.dim, plan.world_size, plan.local_world_size, device)
        module_plan[p.table] = PlacementParameterSharding.from_params(
            plan.placement_params(p),
            sharding_type=p.sharding_type,
            compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,
            ranks=ranks,
            sharding_spec=spec,
        )
    return ShardingPlan(plan=dict(modules))


# Layout the tiered sharders' default backend runs per device (``tiered.backends.resolve_backend``), and
# what the sharders are given to run the other one there.
_DEVICE_LAYOUT: Dict[str, str] = {"cpu": "native", "cuda": "fbgemm"}
_LAYOUT_SHARDER_FIX: Dict[Tuple[str, str], str] = {
    # fbgemm's backend on CPU builds HOST tables without a cache, not the layout the plan budgets
    ("cpu", "fbgemm"): "",
    ("cuda", "native"): "TieredEmbeddingBagCollectionSharder(backend='torch') / "
    "TieredEmbeddingCollectionSharder(backend='torch') (recpipe's layout on CUDA)",
}


def _layout_bytes(plan: PlacementPlan, layout: str) -> List[Optional[Tuple[int, int]]]:
    """Each table's (HBM bytes per rank, DDR bytes per machine) in ``layout`` at its planned mode and load
    factor, or None where that layout cannot hold it (fbgemm needs a dim multiple of 4)."""
    W, L = plan.world_size, plan.local_world_size
    out: List[Optional[Tuple[int, int]]] = []
    for p in plan.placements:
        if p.fused:  # torchrec's FUSED table: the same bytes whichever tiered layout runs
            out.append((p.hbm_bytes_per_rank, p.ddr_bytes_per_machine))
            continue

        def shard(rows: int, p: TablePlacement = p) -> ShardStorage:
            return BACKEND_SHARD_STORAGE[layout](
                rows, p.dim, p.dtype, p.optimizer, p.mode, p.cache_load_factor, plan.cache_policy
            )

        try:
            if p.dynamic is not None:  # every rank holding a shard holds the same slots
                shards, on_machine = (1, 1) if p.table_wise else (W, L)
                args = (p.dim, p.dtype, p.optimizer, p.mode, p.cache_load_factor, plan.cache_policy)
                s = dynamic_shard_storage(p.dynamic, p.rows, shards, *args, BACKEND_SHARD_STORAGE[layout])
                out.append((s.fast_bytes, on_machine * s.slow_bytes))
                continue
            if p.table_wise:  # the whole table on its owner and its machine
                out.append((shard(p.rows).fast_bytes, shard(p.rows).slow_bytes))
                continue
            out.append((shard(max_local_rows(p.rows, W)).fast_bytes, machine_sum(p.rows, W, L, shard).slow_bytes))
        except ValueError:
            out.append(None)
    return out


def _warn_layout_mismatch(plan: PlacementPlan, compute_device: str) -> None:
    """Warns when the sharders' default backend on ``compute_device`` runs another layout than ``plan.backend``."""
    runs = _DEVICE_LAYOUT.get(compute_device)
    if runs is None or runs == plan.backend:
        return  # an unknown device is refused by row_wise_sharding_spec
    sized = list(zip(plan.placements, _layout_bytes(plan, runs)))
    cannot = [p.fqn for p, b in sized if b is None]
    held = [(p, b) for p, b in sized if b is not None]  # the tables both layouts hold
    differ = [p.fqn for p, b in held if b != (p.hbm_bytes_per_rank, p.ddr_bytes_per_machine)]
    if not differ and not cannot:
        return
    now_h, now_d = sum(p.hbm_bytes_per_rank for p, _ in held), sum(p.ddr_bytes_per_machine for p, _ in held)
    hbm, ddr = sum(b[0] for _, b in held), sum(b[1] for _, b in held)
    names = {"native": "recpipe's native layout", "fbgemm": "fbgemm's layout"}

    def delta(now: int, then: int, budget: int) -> str:
        over = f", over the budget of {format_bytes(budget)} ({budget} B)" if then > budget else ""
        return (
            f"{format_bytes(now)} ({now} B) in {plan.backend} -> {format_bytes(then)} ({then} B) in {runs}, "
            f"{then - now:+d} B{over}"
        )

    fixes = [
        f"re-plan with PlacementPlanner(topology, backend={runs!r}) to size the tables in the layout that "
        f"runs on {compute_device}"
    ]
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
    # stacklevel: the user's call of to_sharding_plan (this, _to_sharding_plan, to_torchrec_sharding_plan or PlacementPlan.to_sharding_plan, user)
    warnings.warn(text + ".\n" + solutions(fixes), UserWarning, stacklevel=4)


__all__ = ["PlacementPlan", "TablePlacement", "option_text", "to_torchrec_sharding_plan"]
