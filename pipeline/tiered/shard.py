"""One shard of an embedding table split between a fast and a slow tier.

``HYBRID(x)`` keeps ``floor(x * R)`` of the shard's ``R`` rows in the fast tier (chosen by a
seeded hash); ``CACHING(x)`` keeps every row in the slow tier and caches ``floor(x * R)`` of them
(LFU or LRU); ``x == 1`` puts every row in the fast tier. The optimizer is fused into the backward
like fbgemm's TBE; rows live in a ``TierBackend``. May import ``recpipe.pipeline.placement``,
``recpipe.pipeline.interfaces``, ``recpipe.pipeline.routing`` and the tiered modules below it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import warnings
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn

from recpipe.pipeline.interfaces import RowOptimizer, ShardRouting, TierBackend, TierSpec, TierTensors
from recpipe.pipeline.placement import TIERED_DTYPES, CachePolicy, Mode, ShardStorage, check_int, row_bytes, tier_rows
from recpipe.pipeline.routing.rows import check_dist_type
from recpipe.pipeline.tiered.backends import BACKENDS, resolve_backend
from recpipe.pipeline.tiered.backends.common import check_psw_pooling
from recpipe.pipeline.tiered.native_ops import TIERED_STATS
from recpipe.pipeline.tiered.optim import (
    FusedOptimizerKind,
    OptimizerControlMixin,
    TieredOptimizerConfig,
    check_row_optimizer,
)
from recpipe.pipeline.tiered.shard_routing import RowWiseRouting
from recpipe.pipeline.tiered.state import ShardStateMixin

__all__ = [
    "FUSED_PARAM_BOUNDS_CHECK_MODE",
    "CachePolicy",
    "FusedOptimizerKind",
    "Mode",
    "TieredEmbeddingShard",
    "TieredOptimizerConfig",
    "bounds_check_mode_of",
]

#: fused param naming how a lookup treats ids outside the table (fbgemm's, torchrec's).
FUSED_PARAM_BOUNDS_CHECK_MODE: str = "bounds_check_mode"

#: fbgemm's ``V2_*`` modes and the mode each checks as (its TBE maps them so too).
_V2_BOUNDS_CHECK_MODES: Dict[str, str] = {"V2_IGNORE": "IGNORE", "V2_WARNING": "WARNING", "V2_FATAL": "FATAL"}


def bounds_check_mode_of(fused_params: Optional[Mapping[str, Any]], table_name: str) -> BoundsCheckMode:
    """The ``bounds_check_mode`` a table's lookups apply, resolved as fbgemm's TBE does (fused param,
    default ``WARNING``, overridden by env ``FBGEMM_TBE_BOUNDS_CHECK_MODE``; ``V2_*`` as their mode)."""
    value: Any = (fused_params or {}).get(FUSED_PARAM_BOUNDS_CHECK_MODE, BoundsCheckMode.WARNING)
    where = f"fused param {FUSED_PARAM_BOUNDS_CHECK_MODE!r}"
    env = os.environ.get("FBGEMM_TBE_BOUNDS_CHECK_MODE")
    if env is not None:
        value, where = env, "environment variable FBGEMM_TBE_BOUNDS_CHECK_MODE"
    return _parse_bounds_check_mode(value, where, table_name)


def _parse_bounds_check_mode(value: Any, where: str, table_name: str) -> BoundsCheckMode:
    """``value`` (a ``BoundsCheckMode`` or its int) as the mode it checks as; ``where`` names it in errors."""
    try:
        if isinstance(value, BoundsCheckMode):
            mode = value
        elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
            mode = BoundsCheckMode(int(value))
        elif isinstance(value, int) and not isinstance(value, bool):
            mode = BoundsCheckMode(value)
        else:
            raise ValueError(value)
    except ValueError:
        raise ValueError(
            f"tiered table {table_name!r}: {where} must be an fbgemm BoundsCheckMode (or its int value), got "
            f"{type(value).__name__} {value!r}; pass e.g. fused_params={{'bounds_check_mode': "
            "BoundsCheckMode.WARNING}} (from fbgemm_gpu.split_table_batched_embeddings_ops_common), as for "
            "torchrec's FUSED tables."
        ) from None
    return BoundsCheckMode[_V2_BOUNDS_CHECK_MODES.get(mode.name, mode.name)]


def _check_table_args(
    table_name: str, x: Any, embedding_dim: Any, num_embeddings: Any, pooling: Any, dtype: Any
) -> None:
    """Refuses a table's sizes, load factor, pooling or dtype, naming the argument."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 < float(x) <= 1.0:
        raise ValueError(
            f"cache_load_factor must be in (0, 1], got {x!r}: use e.g. 0.1 ... 1.0 (1.0 = every row in the fast tier)."
        )
    for name, value in (("embedding_dim", embedding_dim), ("num_embeddings", num_embeddings)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    if pooling not in ("sum", "mean"):
        raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}.")
    if dtype not in TIERED_DTYPES:
        raise ValueError(
            f"tiered table {table_name!r}: dtype {dtype} is not supported by the tiered kernel yet: "
            "use torch.float32 (the table's data_type DataType.FP32)."
        )


def _init_range(table_name: str, num_embeddings: int, lo: Optional[float], hi: Optional[float]) -> Tuple[float, float]:
    """The uniform initial rows' range: the given ends, by default ``+-sqrt(1 / num_embeddings)``."""
    bound = math.sqrt(1.0 / num_embeddings)
    init = [-bound if lo is None else lo, bound if hi is None else hi]
    for name, v in zip(("weight_init_min", "weight_init_max"), init):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ValueError(
                f"tiered table {table_name!r}: {name} must be a finite number or None, got {v!r}; "
                "set it in the table's EmbeddingBagConfig (or leave it None for +-sqrt(1 / rows))."
            )
    if init[0] > init[1]:
        raise ValueError(
            f"tiered table {table_name!r}: weight_init_min={init[0]} exceeds weight_init_max="
            f"{init[1]}; swap them in the table's EmbeddingBagConfig."
        )
    return float(init[0]), float(init[1])


class TieredEmbeddingShard(ShardStateMixin, OptimizerControlMixin, nn.Module):
    """One shard of an embedding-bag table stored in a fast and a slow tier.

    Args:
        num_embeddings (int): rows ``N`` of the whole (global) table.
        mode (Mode | str): ``HYBRID`` or ``CACHING``.
        cache_load_factor (float): ``x`` in ``(0, 1]`` (see the module docstring).
        optimizer (RowOptimizer | None): fused optimizer: a ``TieredOptimizerConfig`` (default SGD
            lr 0.01), or another ``RowOptimizer`` on a backend that applies its ``update`` (``torch``).
        cache_policy (CachePolicy | str): ``lfu`` (default) or ``lru``; CACHING only.
        rank, world_size, dist_type, routing_seed: the default row-wise routing
            (``hash_roundrobin``, ``roundrobin`` or ``continuous``).
        split_seed (int): seed of the HYBRID fast/slow split hash.
        device (torch.device | str | None): fast-tier device (default CPU).
        backend (str | None): a registered ``TierBackend``'s name (``native``, ``fbgemm``, ``torch``,
            or one added by ``register_backend``); default ``native`` on CPU, ``fbgemm`` on CUDA,
            ``torch`` elsewhere.
        weight_init_min, weight_init_max (float | None): uniform init range (default
            ``+-sqrt(1 / num_embeddings)``, as torchrec).
        bounds_check_mode (BoundsCheckMode | None): local ids ``>= num_rows`` raise under
            ``FATAL`` (default) and ``NONE``; ``WARNING`` (warns) and ``IGNORE`` look row 0 up
            instead, as fbgemm's CPU TBE. Negative ids raise under every mode.
        routing (ShardRouting | None): the rows this shard holds (default: a ``RowWiseRouting``
            of ``rank``, ``world_size``, ``dist_type``, ``routing_seed``).

    Raises:
        ValueError: a bad argument, named with the fix.
    """

    def __init__(
        self,
        *,
        num_embeddings: int,
        embedding_dim: int,
        mode: Union[Mode, str],
        cache_load_factor: float,
        optimizer: Optional[RowOptimizer] = None,
        pooling: str = "sum",
        cache_policy: Union[CachePolicy, str] = CachePolicy.LFU,
        rank: int = 0,
        world_size: int = 1,
        dist_type: str = "hash_roundrobin",
        routing_seed: int = 0,
        split_seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: Optional[Union[torch.device, str]] = None,
        table_name: str = "table",
        backend: Optional[str] = None,
        weight_init_min: Optional[float] = None,
        weight_init_max: Optional[float] = None,
        bounds_check_mode: Optional[BoundsCheckMode] = None,
        routing: Optional[ShardRouting] = None,
    ) -> None:
        super().__init__()
        self.mode: Mode = Mode.parse(mode)
        self.bounds_check_mode: BoundsCheckMode = (
            BoundsCheckMode.FATAL
            if bounds_check_mode is None
            else _parse_bounds_check_mode(bounds_check_mode, "bounds_check_mode", table_name)
        )
        _check_table_args(table_name, cache_load_factor, embedding_dim, num_embeddings, pooling, dtype)
        self.cache_load_factor: float = float(cache_load_factor)
        self.pooling: str = pooling
        self.cache_policy: CachePolicy = CachePolicy.parse(cache_policy)
        self.num_embeddings: int = num_embeddings
        self.embedding_dim: int = embedding_dim
        self.dtype: torch.dtype = dtype
        self.table_name: str = table_name
        if routing is None:
            dist_type = check_dist_type(dist_type)
            routing_seed = check_int(routing_seed, "routing_seed", -(2**63), 2**63 - 1)
        self.split_seed: int = check_int(split_seed, "split_seed", -(2**63), 2**63 - 1)
        self.weight_init_range: Tuple[float, float] = _init_range(
            table_name, num_embeddings, weight_init_min, weight_init_max
        )
        self.device: torch.device = torch.device(device) if device is not None else torch.device("cpu")
        self.routing: ShardRouting = self._routing(routing, rank, world_size, dist_type, routing_seed)
        self.num_rows: int = self.routing.num_rows
        self.backend: str = resolve_backend(backend, self.device)
        self.optimizer: RowOptimizer = check_row_optimizer(
            table_name, optimizer, embedding_dim, self.backend, BACKENDS[self.backend].calls_optimizer_update
        )
        self.fast_rows, self.slow_rows, self.cache_slots = tier_rows(self.num_rows, self.mode, self.cache_load_factor)
        self.row_bytes: int = row_bytes(embedding_dim, dtype, self.optimizer.name)
        self.state_cols: int = self.optimizer.state_cols(embedding_dim)
        # Bulk writes of the rows (init, loads): lets the fused pipeline see a table written
        # between steps (recpipe.pipeline.train_pipeline.relookup.tables_version).
        self.rows_writes: int = 0
        spec = TierSpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TierSpec)})
        self.tiers: TierBackend = BACKENDS[self.backend](spec)
        self.reset_parameters()

    def _routing(
        self, routing: Optional[ShardRouting], rank: int, world_size: int, dist_type: str, seed: int
    ) -> ShardRouting:
        """``routing`` or the row-wise routing of the arguments, mirrored in the routing attributes."""
        if routing is None:
            routing = RowWiseRouting(self.num_embeddings, world_size, rank, dist_type, seed)
        elif not isinstance(routing, ShardRouting):
            raise ValueError(
                f"tiered table {self.table_name!r}: routing must be a ShardRouting (recpipe.pipeline.interfaces) "
                f"or None, got {type(routing).__name__}; subclass ShardRouting, or pass rank, world_size, "
                "dist_type and routing_seed for the built-in row-wise routing."
            )
        elif routing.num_embeddings != self.num_embeddings:
            raise ValueError(
                f"tiered table {self.table_name!r}: routing is of a table of {routing.num_embeddings} "
                f"rows, the table has num_embeddings={self.num_embeddings}; route this table."
            )
        self.rank: int = routing.rank
        self.world_size: int = routing.world_size
        self.dist_type: str = routing.dist_type
        self.routing_seed: int = routing.seed
        return routing

    @property
    def moved_row_bytes(self) -> int:
        """Bytes a cache load / write-back moves per row (fbgemm's cache: values only)."""
        return self.tiers.moved_row_bytes

    def tier_tensors(self) -> TierTensors:
        """Every tensor the shard allocated (``counters`` are statistics, not table storage)."""
        return self.tiers.tier_tensors()

    def tier_bytes(self) -> ShardStorage:
        """Bytes allocated per tier, read from the tensors' storages (matches the planner's
        ``shard_storage``, or ``fbgemm_tier_bytes`` for fbgemm on CUDA)."""
        tiers = self.tier_tensors()
        return ShardStorage(
            **{f"{k}_bytes": sum(t.untyped_storage().nbytes() for _, t in tiers[k]) for k in ("fast", "slow")}
        )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draws rows uniformly over ``weight_init_range`` (global RNG, local-id order); zeroes state."""
        w = torch.empty((self.num_rows, self.embedding_dim), dtype=self.dtype).uniform_(*self.weight_init_range)
        self.write_local_rows(w.to(self.device), None, reset_cache=True)

    @torch.no_grad()
    def flush(self) -> int:
        """Writes every dirty cached row (and its state) back to the slow tier; returns the rows written."""
        return self.tiers.flush()

    def forward(
        self, ids: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Pooled ``[B, embedding_dim]`` lookup of local ids (``B + 1`` offsets); the backward applies
        the fused optimizer in place. ``per_sample_weights`` are cast to float32, as fbgemm."""
        for name, t in (("ids", ids), ("offsets", offsets), ("per_sample_weights", per_sample_weights)):
            if not isinstance(t, torch.Tensor) and (t is not None or name != "per_sample_weights"):
                raise ValueError(
                    f"tiered table {self.table_name!r}: {name} must be a torch.Tensor, got {type(t).__name__}; "
                    f"pass e.g. torch.as_tensor({name}, dtype=torch.{'float32' if name[0] == 'p' else 'int64'})."
                )
        if per_sample_weights is not None:  # fbgemm's TBE casts them to float32 too (autograd sees the cast)
            per_sample_weights = per_sample_weights.float()
        ids = self._bounds_check(ids)
        return self.tiers.lookup(ids, offsets, per_sample_weights, self.optimizer, self._check_inputs)

    def _check_inputs(self, ids: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor]) -> None:
        """Host checks of a lookup's inputs, naming the table (the backends call them)."""
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"ids must be a 1-D int32/int64 tensor of local row ids, got {ids.dtype} with shape {list(ids.shape)}."
            )
        if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64) or offsets.numel() < 1:
            raise ValueError(
                "offsets must be a 1-D int32/int64 tensor of B + 1 bag offsets "
                f"(include_last_offset), got shape {list(offsets.shape)}."
            )
        if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel() or bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError(
                f"offsets must start at 0, be non-decreasing and end at len(ids)={ids.numel()}; "
                f"got first {int(offsets[0])}, last {int(offsets[-1])}."
            )
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_rows:
                raise IndexError(
                    f"ids out of range for table {self.table_name!r} shard {self.rank}: got ids in "
                    f"[{lo}, {hi}] but the shard has {self.num_rows} local rows. Possible solutions:\n"
                    f"  1. route global ids with recpipe.pipeline.routing.ops.route_ids / routing.kjt.bucketize_kjt "
                    f"(dist_type={self.dist_type!r}, world_size={self.world_size}) before the lookup.\n"
                    f"  2. check num_embeddings={self.num_embeddings} matches the feature's id space (global ids "
                    f"in [0, {self.num_embeddings}); recpipe's row-wise sharding sends a global id v >= "
                    f"{self.num_embeddings} (or negative, read as unsigned) to rank v % world_size as local id "
                    "v // world_size, as torchrec's does).\n"
                    f"  3. to look ids past the shard's rows up as local row 0 instead of raising, as fbgemm's TBE "
                    f"does, give the table the fused param bounds_check_mode=BoundsCheckMode.WARNING or IGNORE "
                    f"(now {self.bounds_check_mode.name})."
                )
        check_psw_pooling(self.pooling, psw)
        if psw is not None and psw.shape != ids.shape:
            raise ValueError(f"per_sample_weights must have the shape of ids {list(ids.shape)}, got {list(psw.shape)}.")

    def _bounds_check(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` with ids ``>= num_rows`` replaced by 0 under ``WARNING`` / ``IGNORE`` (fbgemm's
        ``bounds_check_indices``); other modes and negative ids are left to the lookup's checks."""
        if (
            self.bounds_check_mode not in (BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE)
            or ids.dim() != 1
            or ids.dtype not in (torch.int32, torch.int64)
            or ids.numel() == 0
        ):
            return ids
        if ids.device.type == "cpu":  # a host check: a CUDA batch is replaced without a sync
            if int(ids.max()) < self.num_rows:  # the usual batch: one reduction, nothing allocated
                return ids
        past = ids >= self.num_rows
        if ids.device.type == "cpu" and self.bounds_check_mode is BoundsCheckMode.WARNING:
            first = int(past.nonzero()[0, 0])
            warnings.warn(
                f"tiered table {self.table_name!r} shard {self.rank}: {int(past.sum())} id(s) past the shard's "
                f"{self.num_rows} local rows (first: local id {int(ids[first])} at position {first}) are looked "
                "up as local row 0 (bounds_check_mode=WARNING, as fbgemm's TBE); the global ids of the feature "
                f"must lie in [0, {self.num_embeddings}). Set bounds_check_mode=BoundsCheckMode.FATAL to raise "
                "instead, or IGNORE to silence this.",
                RuntimeWarning,
                stacklevel=3,
            )
        return torch.where(past, torch.zeros_like(ids), ids)

    def tier_stats(self) -> Dict[str, float]:
        """Statistics of the last lookup and the cumulative hit rate (``hit_rate``: ids whose row
        was fast before the step's cache loads). Synchronizes CUDA: call it when logging."""
        if self.device.type == "cuda":
            # the counters may have been written on the pipeline's lookup stream
            torch.cuda.synchronize(self.device)
        counts = [float(v) for v in self.tiers.stats.tolist()]  # the one host read of the counters
        k = len(TIERED_STATS)
        last = dict(zip(TIERED_STATS, counts[:k]))
        total = dict(zip(TIERED_STATS, counts[k:]))
        lookups = max(last["lookups"], 1.0)
        moved = last["rows_loaded"] + last["rows_written_back"]
        row = self.moved_row_bytes
        return {
            "hit_rate": last["hits"] / lookups,
            "fast_fraction": last["fast_lookups"] / lookups,
            "cumulative_hit_rate": total["hits"] / max(total["lookups"], 1.0),
            "cumulative_lookups": total["lookups"],
            **{k: last[k] for k in ("lookups", "unique_rows", "rows_loaded", "rows_evicted", "rows_written_back")},
            "bytes_loaded": last["rows_loaded"] * row,
            "bytes_written_back": last["rows_written_back"] * row,
            "bytes_moved": moved * row,
            "flushed_rows": float(self.tiers.flushed_rows),
        }

    def extra_repr(self) -> str:
        return (
            f"table={self.table_name!r}, rows={self.num_rows}/{self.num_embeddings}, dim={self.embedding_dim}, "
            f"mode={self.mode.name}, x={self.cache_load_factor}, optimizer={self.optimizer.name}, "
            f"rank={self.rank}/{self.world_size}, dist_type={self.dist_type}"
        )
