"""Enumerator: every (mode, cache_load_factor) option of every table, with bytes and cost."""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from torchrec.distributed.planner.constants import HBM_MEM_BW, HBM_TO_DDR_MEM_BW

from recpipe.pipeline.placement import (
    CACHE_ROW_MAP_BYTES,
    FBGEMM_CACHE_ASSOC,
    SPLIT_MAP_BYTES,
    SUPPORTED_OPTIMIZERS,
    TIERED_DTYPES,
    CachePolicy,
    DynamicTableOptions,
    FusedOptimizerKind,
    Mode,
    ShardStorage,
    cache_policy_spec,
    check_int,
    check_load_factors,
    decimal_ratio,
    dtype_itemsize,
    dtype_name,
    dynamic_shard_storage,
    fbgemm_bytes,
    fbgemm_cache_sets,
    machine_split,
    machine_sum,
    max_local_rows,
    native_tier_bytes,
    optimizer_state_bytes_per_row,
    row_bytes,
    tier_split,
)
from recpipe.planner.communication import PLANNED_SHARDING_TYPES, CommCostModel
from recpipe.planner.constraints import (
    COLUMN_WISE,
    ROW_WISE,
    TABLE_WISE,
    check_constraint_keys,
    check_constraints,
    check_sharding_types,
    constraint_for,
    no_option_error,
)
from recpipe.planner.cost_models import dynamic_lookup_costs, dynamic_priced_table
from recpipe.planner.errors import PlacementErrorType, PlacementPlannerError, solutions
from recpipe.planner.option_arrays import MODE_CODE, SHARDING_CODE, SHARDING_OF_CODE, OptionArrays
from recpipe.planner.specs import (
    BACKEND_SHARD_STORAGE,
    DEFAULT_LOAD_FACTORS,
    MAX_TABLE_BYTES,
    STORAGE_BACKENDS,
    PlacementConstraints,
    PlacementOption,
    TableSpec,
    per_row_format,
)
from recpipe.planner.torchrec_plan import column_shard_dim, column_shards
from recpipe.planner.types import CostModel

# A table's column layout: (candidates, row-wise tiered, table-wise FUSED, table-wise tiered, column-wise FUSED).
_LayoutKey = Tuple[Tuple[Tuple[Mode, float], ...], bool, bool, bool, bool]


class GridPlacementEnumerator:
    """Enumerates per table the tiered options ``{HYBRID, CACHING} x load_factors`` (``x = 1`` once) under
    each of ``sharding_types``: ROW_WISE over all ranks, TABLE_WISE whole on one rank; and torchrec's FUSED
    table (all in the fast tier) TABLE_WISE, and COLUMN_WISE where its width splits into torchrec's column
    shards (``column_shards(dim) > 1``, on more than one rank).

    Tiered bytes are those ``backend``'s tiered tables allocate (``BACKEND_SHARD_STORAGE``): row-wise, the
    largest shard over ``world_size`` ranks; table-wise, the whole table on its owner, of which the knapsack
    sees its share ``ceil(bytes / world_size)`` per rank (a partitioner then picks the owner and checks the
    rank's budget). A FUSED table holds ``rows x row_bytes`` in the fast tier; column-wise, each of its ``k``
    shards ``rows x row_bytes(dim / k)`` on one rank (the knapsack's share: ``ceil(k x shard / world_size)``).
    Costs are the cost model's
    lookup cost (``FUSED_CPU_LOOKUP_RATIO`` times it for a FUSED table on the ``native`` backend) plus
    ``comm_model``'s cost of the sharding type; ``constraints`` (keyed by table name or FQN) narrow a table's
    options within ``sharding_types`` (a pinned sharding type they rule out is refused); ``cache_policy`` sets
    fbgemm's cache metadata bytes.

    A dynamic table (``PlacementConstraints(dynamic=...)``) gets the tiered options only (never torchrec's FUSED
    table): each shard is ``dynamic_shard_storage`` (its slots as a tiered shard plus its hash index in the fast
    tier), every rank of a row-wise one holds one such shard; its lookups are priced by ``dynamic_lookup_costs``
    over the cost model's costs of its slots.
    """

    def __init__(
        self,
        world_size: int,
        local_world_size: int,
        cost_model: CostModel,
        load_factors: Sequence[float] = DEFAULT_LOAD_FACTORS,
        constraints: Optional[Mapping[str, PlacementConstraints]] = None,
        backend: str = "native",
        cache_policy: Union[CachePolicy, str] = CachePolicy.LFU,
        sharding_types: Sequence[str] = PLANNED_SHARDING_TYPES,
        comm_model: Optional[CommCostModel] = None,
    ) -> None:
        load_factors = check_load_factors(load_factors)
        world_size = check_int(world_size, "world_size", 1)
        local_world_size = check_int(local_world_size, "local_world_size", 1, world_size)
        if isinstance(cost_model, type) or not callable(getattr(cost_model, "costs", None)):
            raise ValueError(
                f"cost_model must be a CostModel (with costs(table, options)), got {type(cost_model).__name__} "
                f"{cost_model!r}: e.g. AnalyticCostModel(), or make_cost_model('analytic', ...)."
            )
        if backend not in STORAGE_BACKENDS:
            raise ValueError(f"backend must be one of {list(STORAGE_BACKENDS)}, got {backend!r}.")
        priced = getattr(cost_model, "backend", backend)
        if priced != backend:
            raise ValueError(
                f"cost_model prices the {priced!r} layout but backend is {backend!r}: build it with the same "
                f"backend, e.g. AnalyticCostModel(backend={backend!r})."
            )
        self.world_size, self.local_world_size, self.cost_model = world_size, local_world_size, cost_model
        self.load_factors: Tuple[float, ...] = tuple(sorted({float(x) for x in load_factors}))
        self.sharding_types: Tuple[str, ...] = check_sharding_types(sharding_types)
        check_constraints(constraints, self.sharding_types)
        self.constraints: Mapping[str, PlacementConstraints] = constraints or {}
        self.backend: str = backend
        self.cache_policy: CachePolicy = CachePolicy.parse(cache_policy, "cache_policy")
        #: lookup time of torchrec's FUSED table over a tiered table's at the same placement: fbgemm's TBE on
        #: CUDA runs both; on CPU (``native``) recpipe's kernel is the faster one
        self.fused_lookup_ratio: float = FUSED_CPU_LOOKUP_RATIO if backend == "native" else 1.0
        if comm_model is not None and not isinstance(comm_model, CommCostModel):
            raise ValueError(f"comm_model must be a CommCostModel or None, got {type(comm_model).__name__}.")
        self.comm_model: Optional[CommCostModel] = comm_model

    def shard_bytes(self, table: TableSpec, rows: int, mode: Mode, x: float) -> ShardStorage:
        """Bytes of one shard of ``table`` with ``rows`` local rows, in this backend's layout."""
        return BACKEND_SHARD_STORAGE[self.backend](
            rows, table.dim, table.dtype, table.optimizer, mode, x, self.cache_policy
        )

    def dynamic_shard_bytes(self, table: TableSpec, shards: int, mode: Mode, x: float) -> ShardStorage:
        """Bytes of one shard of dynamic ``table`` over ``shards`` shards (world size row-wise, 1 table-wise):
        ``dynamic_shard_storage`` in this backend's layout."""
        options = self.dynamic_options(table)
        if options is None:
            raise ValueError(f"table {table.fqn!r} is not dynamic: pin PlacementConstraints(dynamic=...) for it.")
        args = (table.dim, table.dtype, table.optimizer, mode, x, self.cache_policy)
        return dynamic_shard_storage(options, table.rows, shards, *args, BACKEND_SHARD_STORAGE[self.backend])

    def dynamic_options(self, table: TableSpec) -> Optional[DynamicTableOptions]:
        """``table``'s dynamic options (its pin's ``dynamic``), or None for a static table."""
        pin = constraint_for(table, self.constraints)
        return pin.dynamic if pin is not None else None

    def candidates(self, table: TableSpec) -> List[Tuple[Mode, float]]:
        """The (mode, x) pairs allowed for ``table``; ``x = 1`` appears once, as HYBRID, even if pinned to CACHING."""
        pin = constraint_for(table, self.constraints) or PlacementConstraints()
        xs: Sequence[float] = self.load_factors
        if pin.load_factors is not None:
            xs = tuple(sorted({float(x) for x in pin.load_factors}))
        if pin.cache_load_factor is not None:
            xs = (float(pin.cache_load_factor),)
        modes = (Mode.HYBRID, Mode.CACHING) if pin.mode is None else (Mode.parse(pin.mode),)
        out: List[Tuple[Mode, float]] = []
        for x in xs:
            if x >= 1.0:
                # Both modes collapse to "all in HBM" (fbgemm: one DEVICE table), which is HYBRID at x = 1;
                # CACHING would read as a cache over a full slow-tier copy (torchrec's FUSED_UVM_CACHING at 1.0).
                out.append((Mode.HYBRID, 1.0))
            else:
                out.extend((m, x) for m in modes)
        return out

    def _allowed(self, table: TableSpec, sharding_type: str) -> bool:
        """Whether ``table`` gets ``sharding_type``'s options: allowed by ``sharding_types`` or its pinned type;
        COLUMN_WISE only where its width splits into torchrec's column shards over more than one rank."""
        if sharding_type == COLUMN_WISE and (column_shards(table.dim) < 2 or self.world_size < 2):
            return False
        pin = constraint_for(table, self.constraints) or PlacementConstraints()
        if pin.sharding_type is not None:
            return pin.sharding_type == sharding_type
        return sharding_type in self.sharding_types

    def enumerate_arrays(self, tables: Sequence[TableSpec]) -> "OptionArrays":
        """Options of every table as ``(tables, options)`` arrays (``cost = inf`` pads short rows).

        Bytes are the backend's formulas evaluated with NumPy over all tables sharing a candidate list at
        once (exact integers, equal to :meth:`shard_bytes` of the largest shard and its ``machine_sum``).
        """
        if isinstance(tables, (str, bytes)) or not isinstance(tables, Sequence):
            raise ValueError(f"tables must be a list of TableSpec, got {type(tables).__name__} {tables!r:.80}.")
        for k, t in enumerate(tables):
            if not isinstance(t, TableSpec):
                raise ValueError(
                    f"tables[{k}] must be a TableSpec, got {type(t).__name__} {t!r:.80}; e.g. "
                    "TableSpec(name='t0', rows=1000, dim=64)."
                )
        check_constraint_keys(self.constraints, tables)
        _check_tiered_tables(tables, self.backend)
        _check_dynamic_tables(tables, self.constraints)
        # tables sharing candidates and allowed options share a column layout: filled together
        layouts: Dict[_LayoutKey, List[int]] = {}
        # tables without constraints share one layout per splittability of their width and FUSED kernel
        unpinned: Dict[Tuple[bool, bool], _LayoutKey] = {}
        for i, t in enumerate(tables):
            if constraint_for(t, self.constraints) is not None:
                key = self._layout(t)
            else:
                kind = (column_shards(t.dim) > 1, self._fused_runs(t))
                key = unpinned.get(kind) or unpinned.setdefault(kind, self._layout(t))
            layouts.setdefault(key, []).append(i)
        width = max((len(c) * (rw + tw) + fu + cw for c, rw, fu, tw, cw in layouts), default=0)
        out = OptionArrays.empty(len(tables), width)
        comm = self._comm_costs(tables)
        for (cand, rw, fused, tw, cw), idx in layouts.items():
            ii = np.asarray(idx, dtype=np.int64)
            lookup = self._lookup_costs([tables[i] for i in idx], cand)  # (tables, candidates)
            col = 0
            if rw:
                self._fill(out, tables, ii, cand, col, whole=False)
                out.lookup_cost[ii, col : col + len(cand)] = lookup
                out.comm_cost[ii, col : col + len(cand)] = comm[SHARDING_CODE[ROW_WISE], ii][:, None]
                col += len(cand)
            fused_lookup = lookup[:, cand.index((Mode.HYBRID, 1.0))] * self.fused_lookup_ratio if fused or cw else None
            if fused and fused_lookup is not None:  # all in the fast tier as torchrec's FUSED table; before the
                # tiered one, which it wins ties of
                self._fill_fused(out, tables, ii, col, TABLE_WISE, fused_lookup, comm)
                col += 1
            if tw:
                self._fill(out, tables, ii, cand, col, whole=True)
                out.lookup_cost[ii, col : col + len(cand)] = lookup
                out.comm_cost[ii, col : col + len(cand)] = comm[SHARDING_CODE[TABLE_WISE], ii][:, None]
                col += len(cand)
            if cw and fused_lookup is not None:  # torchrec's FUSED table in column shards, each whole on one rank
                self._fill_fused(out, tables, ii, col, COLUMN_WISE, fused_lookup, comm)
        valid = out.modes >= 0
        none = np.flatnonzero(~valid.any(axis=1))
        if none.size:
            raise self._no_option_error(tables[int(none[0])], none.size)
        out.cost[valid] = out.lookup_cost[valid] + out.comm_cost[valid]
        return out

    def _layout(self, table: TableSpec) -> "_LayoutKey":
        """``table``'s column layout: its candidates, and whether it gets row-wise tiered, table-wise FUSED,
        table-wise tiered and column-wise FUSED options."""
        cand = tuple(self.candidates(table))
        fused = (constraint_for(table, self.constraints) or PlacementConstraints()).fused
        if self.dynamic_options(table) is not None:
            fused = False  # a dynamic table is a recpipe tiered table
        tw = self._allowed(table, TABLE_WISE)
        all_fast = fused is not False and (Mode.HYBRID, 1.0) in cand and self._fused_runs(table)
        return (
            cand,
            self._allowed(table, ROW_WISE) and fused is not True,  # row-wise tiered
            tw and all_fast,  # table-wise FUSED
            tw and fused is not True,  # table-wise tiered
            self._allowed(table, COLUMN_WISE) and all_fast,  # column-wise FUSED
        )

    def _no_option_error(self, table: TableSpec, count: int) -> PlacementPlannerError:
        """The refusal of ``table``, which has no option (:func:`no_option_error`), naming what keeps torchrec's
        FUSED table from holding it."""
        blocks: List[Tuple[str, str]] = []
        candidates = self.candidates(table)
        if (Mode.HYBRID, 1.0) not in candidates:
            blocks.append(
                (
                    "a FUSED table keeps every row in the fast tier (x = 1), and the x grid of "
                    f"{table.fqn!r} {sorted({x for _, x in candidates})} has no 1.0",
                    "allow x = 1: add 1.0 to load_factors (or to the table's pinned load_factors)",
                )
            )
        if not self._fused_runs(table):
            optimizers = sorted(o.value for o in FUSED_CPU_OPTIMIZERS)
            blocks.append(
                (
                    f"on the native backend (CPU) a FUSED table trains with {optimizers} only (fbgemm-gpu-cpu's "
                    f"TBE), and {table.fqn!r} trains with {FusedOptimizerKind.parse(table.optimizer).value}",
                    f"train {table.fqn!r} with one of {optimizers}, or plan backend='fbgemm' for a CUDA run",
                )
            )
        pin = constraint_for(table, self.constraints) or PlacementConstraints()
        return no_option_error(table, pin, self.sharding_types, self.world_size, blocks, count)

    def _fused_runs(self, table: TableSpec) -> bool:
        """Whether torchrec's FUSED table can train ``table``: on the ``native`` backend (a CPU run) fbgemm-gpu-cpu's
        TBE, which runs only ``FUSED_CPU_OPTIMIZERS``."""
        return self.backend != "native" or table.optimizer in FUSED_CPU_OPTIMIZERS

    def _fill_fused(
        self,
        out: "OptionArrays",
        tables: Sequence[TableSpec],
        ii: np.ndarray,
        col: int,
        sharding_type: str,
        lookup: np.ndarray,
        comm: np.ndarray,
    ) -> None:
        """Writes torchrec's FUSED table of tables ``ii`` (all in the fast tier) into column ``col``, whole on one
        rank (TABLE_WISE) or in ``column_shards(dim)`` shards each whole on one rank (COLUMN_WISE):
        ``owner_bytes`` is one shard's, HBM per rank the knapsack's share ``ceil(table bytes / W)``."""
        group = [tables[i] for i in ii]
        rows = np.array([t.rows for t in group], dtype=np.int64)
        if sharding_type == COLUMN_WISE:
            shards = np.array([column_shards(t.dim) for t in group], dtype=np.int64)
            shard = rows * per_row_format(group, lambda dim, dtype, opt: row_bytes(column_shard_dim(dim), dtype, opt))
        else:
            shards, shard = np.ones_like(rows), rows * per_row_format(group, row_bytes)
        size = shards * shard
        out.modes[ii, col], out.load_factors[ii, col] = MODE_CODE[Mode.HYBRID], 1.0
        out.sharding[ii, col], out.fused[ii, col] = SHARDING_CODE[sharding_type], True
        out.hbm_bytes_per_rank[ii, col] = -(-size // self.world_size)  # the knapsack's share
        out.owner_bytes[ii, col], out.hbm_bytes_per_machine[ii, col] = shard, size
        out.shards[ii, col] = shards
        out.lookup_cost[ii, col] = lookup
        out.comm_cost[ii, col] = comm[SHARDING_CODE[sharding_type], ii]

    def _fill(
        self,
        out: "OptionArrays",
        tables: Sequence[TableSpec],
        ii: np.ndarray,
        cand: Sequence[Tuple[Mode, float]],
        start: int,
        whole: bool,
    ) -> None:
        """Writes the tiered options ``cand`` of tables ``ii`` into columns ``start ..``: modes, load factors,
        sharding and bytes: row-wise shards over all ranks, or (``whole``) the whole table on one rank, whose
        HBM per rank and DDR per machine are the knapsack's shares ``ceil(bytes / W)``, ``ceil(bytes / M)``."""
        W, L = self.world_size, self.local_world_size
        cols = slice(start, start + len(cand))
        out.modes[ii, cols] = [MODE_CODE[m] for m, _ in cand]
        out.load_factors[ii, cols] = [x for _, x in cand]
        out.sharding[ii, cols] = int(whole)
        out.shards[ii, cols] = int(whole)
        group = [tables[i] for i in ii]
        bytes_: Optional[Sequence[np.ndarray]] = self._bulk_storage(group, cand, *((1, 1) if whole else (W, L)))
        scalar = [n for n, t in enumerate(group) if self.dynamic_options(t) is not None]
        if bytes_ is None:  # exact products would overflow int64: scalar formulas
            bytes_ = tuple(np.zeros((len(group), len(cand)), dtype=np.int64) for _ in range(4))
            scalar = list(range(len(group)))
        for n in scalar:  # the dynamic tables, or all where the bulk formulas would overflow
            for j, (mode, x) in enumerate(cand):
                for dst, v in zip(bytes_, self._scalar_bytes(group[n], mode, x, whole)):
                    dst[n, j] = v
        for dst, src in zip(out.byte_arrays, bytes_):
            dst[ii, cols] = src
        out.owner_bytes[ii, cols] = out.hbm_bytes_per_rank[ii, cols]
        out.owner_slow_bytes[ii, cols] = out.ddr_bytes_per_rank[ii, cols]
        if whole:
            out.hbm_bytes_per_rank[ii, cols] = -(-out.owner_bytes[ii, cols] // W)
            out.ddr_bytes_per_machine[ii, cols] = -(-out.owner_slow_bytes[ii, cols] // (W // L))

    def _scalar_bytes(self, table: TableSpec, mode: Mode, x: float, whole: bool) -> Tuple[int, int, int, int]:
        """``(fast, slow)`` bytes of the most loaded rank, then of machine 0, of one tiered option of ``table``
        (``whole``: table-wise), by the scalar formulas: a dynamic table's every rank holds one equal shard."""
        W, L = self.world_size, self.local_world_size
        if self.dynamic_options(table) is not None:
            shard = self.dynamic_shard_bytes(table, 1 if whole else W, mode, x)
            on_machine = 1 if whole else L
            return shard.fast_bytes, shard.slow_bytes, on_machine * shard.fast_bytes, on_machine * shard.slow_bytes
        rank = self.shard_bytes(table, table.rows if whole else max_local_rows(table.rows, W), mode, x)
        mach = rank if whole else machine_sum(table.rows, W, L, lambda r: self.shard_bytes(table, r, mode, x))
        return rank.fast_bytes, rank.slow_bytes, mach.fast_bytes, mach.slow_bytes

    def _comm_costs(self, tables: Sequence[TableSpec]) -> np.ndarray:
        """``(3, tables)`` modelled communication ms per step, a row per sharding code (``SHARDING_OF_CODE``;
        0 without a ``comm_model``)."""
        if self.comm_model is None:
            return np.zeros((len(SHARDING_OF_CODE), len(tables)))
        return np.stack([self.comm_model.cost_array(tables, s) for s in SHARDING_OF_CODE])

    def _lookup_costs(self, tables: Sequence[TableSpec], options: Sequence[Tuple[Mode, float]]) -> np.ndarray:
        """``(tables, options)`` lookup costs: :meth:`_static_costs`, a dynamic table's those of the static table
        of its slots made :func:`_dynamic_costs`."""
        dynamic = {k: d for k, d in enumerate(map(self.dynamic_options, tables)) if d is not None}
        if not dynamic:
            return self._static_costs(tables, options)
        priced = [
            dynamic_priced_table(t, dynamic[k].table_capacity(t.rows)) if k in dynamic else t
            for k, t in enumerate(tables)
        ]
        costs = self._static_costs(priced, options)
        for k in dynamic:
            costs[k] = _dynamic_costs(self.cost_model, tables[k], options, costs[k], self.constraints)
        return costs

    def _static_costs(self, tables: Sequence[TableSpec], options: Sequence[Tuple[Mode, float]]) -> np.ndarray:
        """``(tables, options)`` costs of the cost model: its ``cost_matrix`` when it has one (all tables at
        once), else its ``costs`` table by table, each checked."""
        bulk = getattr(self.cost_model, "cost_matrix", None)
        if bulk is None:
            return np.stack([self._checked_costs(t, options) for t in tables])
        costs = np.asarray(bulk(tables, options), dtype=np.float64)
        if costs.shape != (len(tables), len(options)) or not (np.isfinite(costs) & (costs >= 0)).all():
            return np.stack([self._checked_costs(t, options) for t in tables])  # names the table and option
        return costs

    def _checked_costs(self, table: TableSpec, options: Sequence[Tuple[Mode, float]]) -> np.ndarray:
        """``cost_model.costs(table, options)``, refused unless one finite number >= 0 per option."""
        got = self.cost_model.costs(table, options)
        who = f"cost_model {type(self.cost_model).__name__}.costs(table {table.fqn!r}, {len(options)} options)"
        want = f"it must return one finite cost >= 0 (modelled ms per step) per option, {len(options)} in all"
        try:
            costs = np.asarray(got, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"{who} returned {type(got).__name__} {got!r:.80}; {want}.") from None
        if costs.ndim == 0:
            raise ValueError(f"{who} returned {type(got).__name__} {got!r:.80}; {want}.")
        if costs.shape != (len(options),):
            raise ValueError(f"{who} returned shape {tuple(costs.shape)}; {want}.")
        bad = np.flatnonzero(~(np.isfinite(costs) & (costs >= 0)))
        if bad.size:
            j = int(bad[0])
            mode, x = options[j]
            raise ValueError(f"{who} returned {costs[j]} for option {j} ({Mode.parse(mode).name}, x={x}); {want}.")
        return costs

    def _bulk_storage(
        self, tables: Sequence[TableSpec], cand: Sequence[Tuple[Mode, float]], W: int, L: int
    ) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Bytes of many tables x one candidate list sharded row-wise over ``W`` ranks, ``L`` per machine, as
        ``(tables, options)`` int64 arrays: the contract's array-generic formulas, equal to :meth:`shard_bytes`
        and its ``machine_sum``. None when a product could overflow int64.
        """
        N = np.array([t.rows for t in tables], dtype=np.int64)
        rb = per_row_format(tables, row_bytes)[:, None]
        ratios = [decimal_ratio(x) for _, x in cand]
        num = np.array([r[0] for r in ratios], dtype=np.int64)[None, :]
        den = np.array([r[1] for r in ratios], dtype=np.int64)[None, :]
        spec = cache_policy_spec(self.cache_policy)
        big, n_big, n_small = machine_split(N, W, L)
        per_row = int(rb.max()) + CACHE_ROW_MAP_BYTES + spec.slot_bytes + SPLIT_MAP_BYTES + 8
        if int(big.max()) * max(int(num.max()), per_row) * max(L, 1) >= _INT64_SAFE:
            return None
        caching = np.array([m is Mode.CACHING for m, _ in cand])[None, :]
        cached = caching & (num < den)  # CACHING with x < 1
        if self.backend == "fbgemm":
            v = per_row_format(tables, lambda dim, dtype, _: dim * dtype_itemsize(dtype))[:, None]
            state = per_row_format(tables, lambda dim, _, opt: optimizer_state_bytes_per_row(opt, dim))[:, None]
            rowwise = np.array([t.optimizer is FusedOptimizerKind.ROWWISE_ADAGRAD for t in tables])[:, None]

            def shard(rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
                r = rows[:, None]
                fast_rows, slow_rows, slots = tier_split(r, num, den, caching)
                with_cache = cached & (r > 0)
                S = np.where(with_cache, fbgemm_cache_sets(slots) * FBGEMM_CACHE_ASSOC, 0)
                split_map = (slow_rows > 0) & ~cached
                return fbgemm_bytes(r, fast_rows, S, v, state, rowwise, split_map, spec.fbgemm_state_bytes(r, S))

        else:

            def shard(rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
                r = rows[:, None]
                fast_rows, slow_rows, slots = tier_split(r, num, den, caching)
                return native_tier_bytes(r, fast_rows, slow_rows, slots, rb, cached, spec.slot_bytes)

        fb, sb = shard(big)
        fs, ss = shard(np.maximum(big - 1, 0))
        n_big, n_small = n_big[:, None], n_small[:, None]
        return fb, sb, n_big * fb + n_small * fs, n_big * sb + n_small * ss

    def enumerate(self, tables: Sequence[TableSpec]) -> List[List[PlacementOption]]:
        """:meth:`enumerate_arrays` as ``PlacementOption`` lists per table, in input order."""
        return self.enumerate_arrays(tables).to_options()


#: fbgemm-gpu-cpu's FUSED TBE time over recpipe's tiered CPU kernel at the same rows, forward + backward:
#: the conservative end of 1.05-1.19x (``scripts/bench_storage.py``, one thread, Zipf ids). Dimensionless.
FUSED_CPU_LOOKUP_RATIO: float = 1.05
#: The fused optimizers of recpipe's tiered tables that fbgemm-gpu-cpu's TBE also runs (its CPU mode has no Adam):
#: torchrec's FUSED table is offered on the ``native`` backend (a CPU run) only for these.
FUSED_CPU_OPTIMIZERS: Tuple[FusedOptimizerKind, ...] = (FusedOptimizerKind.SGD, FusedOptimizerKind.ROWWISE_ADAGRAD)
# Bound on the bulk formulas' intermediate products (numerator x rows, rows x bytes/row) to stay exact in int64.
_INT64_SAFE: int = 2**62


def _check_dynamic_tables(tables: Sequence[TableSpec], constraints: Mapping[str, PlacementConstraints]) -> None:
    """Refuses a dynamic table whose capacity's bytes pass the planner's limit of ``MAX_TABLE_BYTES``."""
    for t in tables:
        options = (constraint_for(t, constraints) or PlacementConstraints()).dynamic
        if options is None:
            continue
        capacity, per_row = options.table_capacity(t.rows), row_bytes(t.dim, t.dtype, t.optimizer)
        if capacity * per_row > MAX_TABLE_BYTES:
            raise PlacementPlannerError(
                f"dynamic table {t.fqn!r} needs {capacity * per_row} bytes (DynamicTableOptions.capacity {capacity} "
                f"rows x {per_row} bytes per row), above the planner's limit of 2^62 bytes per table.\n"
                + solutions([f"lower DynamicTableOptions.capacity of {t.fqn!r} (or num_embeddings when unset)"]),
                PlacementErrorType.INPUT_VALIDATION,
            )


def _dynamic_costs(
    cost_model: CostModel,
    table: TableSpec,
    options: Sequence[Tuple[Mode, float]],
    static_costs: np.ndarray,
    constraints: Mapping[str, PlacementConstraints],
) -> np.ndarray:
    """``dynamic_lookup_costs`` of dynamic ``table`` from the costs of its slots, with its pin's ``distinct_keys``
    (default: the capacity) and ``cost_model``'s bandwidths (torchrec's where it has none)."""
    pin = constraint_for(table, constraints) or PlacementConstraints()
    if pin.dynamic is None:
        raise ValueError(f"table {table.fqn!r} is not dynamic: pin PlacementConstraints(dynamic=...) for it.")
    capacity = pin.dynamic.table_capacity(table.rows)
    return dynamic_lookup_costs(
        table,
        options,
        static_costs,
        capacity=capacity,
        distinct_keys=pin.distinct_keys if pin.distinct_keys is not None else capacity,
        admission=pin.dynamic.admit_after > 1,
        hbm_mem_bw=float(getattr(cost_model, "hbm_mem_bw", HBM_MEM_BW)),
        hbm_to_ddr_mem_bw=float(getattr(cost_model, "hbm_to_ddr_mem_bw", HBM_TO_DDR_MEM_BW)),
    )


def _check_tiered_tables(tables: Sequence[TableSpec], backend: str) -> None:
    """Refuses tables no tiered table of ``backend`` can run (dtype, optimizer; fbgemm: dim a multiple of 4)."""
    optimizers = sorted(o.value for o in SUPPORTED_OPTIMIZERS)
    dtypes = sorted(dtype_name(d) for d in TIERED_DTYPES)
    for t in tables:
        problems, fixes = [], []
        if t.dtype not in TIERED_DTYPES:
            problems.append(f"its dtype {dtype_name(t.dtype)} is not one tiered tables hold ({dtypes})")
            fixes.append(
                f"give the table {dtypes[0]} rows (EmbeddingBagConfig data_type=DataType.FP32, or "
                f"dtype: {dtypes[0]} in a tables file)"
            )
        if t.optimizer not in SUPPORTED_OPTIMIZERS:
            optimizer = FusedOptimizerKind.parse(t.optimizer).value
            problems.append(f"its fused optimizer {optimizer} is not one tiered tables run ({optimizers})")
            fixes.append(
                f"train it with one of {optimizers} (apply_optimizer_in_backward with SGD, RowWiseAdagrad "
                "or Adam, or the sharders' fused_params)"
            )
        if backend == "fbgemm" and t.dim % 4 != 0:
            problems.append(f"its dim {t.dim} is not a multiple of 4 (fbgemm's TBE needs one)")
            fixes.append(
                f"use a dim that is a multiple of 4 (e.g. {t.dim + (-t.dim) % 4}), or plan recpipe's own "
                "layout with backend='native' (CPU training, or the torch backend on other devices), which "
                "takes any dim"
            )
        if problems:
            raise PlacementPlannerError(
                f"table {t.fqn!r} cannot be a tiered table on the {backend} backend: {'; '.join(problems)}.\n"
                + solutions(fixes),
                PlacementErrorType.INPUT_VALIDATION,
            )


__all__ = [
    "FUSED_CPU_LOOKUP_RATIO",
    "FUSED_CPU_OPTIMIZERS",
    "COLUMN_WISE",
    "ROW_WISE",
    "TABLE_WISE",
    "GridPlacementEnumerator",
]
