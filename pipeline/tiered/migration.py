"""Migration of table state between torchrec and tiered tables, in global row order.

:func:`gather_full_weights` / :func:`gather_full_optimizer_state` (collective) give every sharded
table as full CPU tensors; ``load_state_dict(full, strict=False)`` and :func:`load_full_optimizer_state`
load them into tiered or FUSED tables of any world size or routing; ``recpipe.pipeline.checkpoint``
shares the optimizer-state views. May import ``recpipe.pipeline.placement``, ``.routing`` and other
``.tiered`` modules.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer

from recpipe.pipeline.placement import FusedOptimizerKind
from recpipe.pipeline.routing.row_order import ROW_ORDER_KEY, RowOrder
from recpipe.pipeline.tiered.fused_optimizer import TieredFusedOptimizer
from recpipe.pipeline.tiered.tiered_collections import TIERED_STATE_KEY, state_dict_without_tiered_rows


def gather_full_weights(
    model: nn.Module, *, process_group: Optional[dist.ProcessGroup] = None
) -> Dict[str, torch.Tensor]:
    """Every sharded embedding table of ``model`` as one full CPU tensor in global row order.

    Crosses layouts the sharded ``state_dict()`` cannot (routed FUSED tables of another world size,
    tiered <-> torchrec, unsharded); ``load_state_dict(full, strict=False)`` loads it. Collective
    over ``process_group`` (default: the world): each rank writes its rows into zeros, then the
    tensors are summed (every row has one owner). Keys are the ``.weight`` keys of ``state_dict()``;
    data-parallel tables are left out. Raises ValueError for a DTensor weight of a routed table.
    """
    state = model.state_dict()
    tiered_suffix = f".{TIERED_STATE_KEY}.global_ids"
    full: Dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(tiered_suffix):
            base = key[: -len(tiered_suffix)]
            md = state[f"{base}.{TIERED_STATE_KEY}._extra_state"]
            weights = state[f"{base}.{TIERED_STATE_KEY}.weights"]
            out = torch.zeros(int(md["num_embeddings"]), int(md["embedding_dim"]), dtype=weights.dtype)
            out[value.cpu()] = weights.cpu()
            full[f"{base}.weight"] = out
        elif not key.endswith(".weight") or not isinstance(value, (ShardedTensor, DTensor)):
            continue
        else:
            order = _row_order(state, key[: -len(".weight")])
            if isinstance(value, DTensor):
                if order is not None:
                    raise ValueError(
                        f"gather_full_weights: {key} is a DTensor of a routed table; gather the "
                        "model's ShardedTensor state_dict (torchrec's default) instead."
                    )
                full[key] = value.full_tensor().cpu()
                continue
            out = torch.zeros(tuple(value.size()), dtype=value.dtype)
            for shard in value.local_shards():
                t = shard.tensor.detach().cpu()
                c0 = shard.metadata.shard_offsets[1]
                out[shard_global_rows(shard.metadata, t.shape[0], order), c0 : c0 + t.shape[1]] = t
            full[key] = out
    if dist.is_initialized():
        # a table-wise tiered table is exported by its owner only: every rank sums zeros for it
        shapes: List[Dict[str, Tuple[Tuple[int, ...], torch.dtype]]] = [{}] * dist.get_world_size(process_group)
        mine = {k: (tuple(v.shape), v.dtype) for k, v in full.items()}
        dist.all_gather_object(shapes, mine, group=process_group)
        for seen in shapes:
            for key, (shape, dtype) in seen.items():
                if key not in full:
                    full[key] = torch.zeros(shape, dtype=dtype)
        for key in sorted(full):  # same order on every rank (DTensors are complete already)
            if not isinstance(state.get(key), DTensor):
                full[key] = _all_reduce_cpu(full[key], dist.ReduceOp.SUM, process_group)
    return full


def _row_order(state: Mapping[str, Any], base: str) -> Optional[RowOrder]:
    """The ``RowOrder`` recorded beside routed FUSED table ``base``'s weight (None: contiguous shards)."""
    record = state.get(f"{base}.{ROW_ORDER_KEY}")
    return RowOrder(*(record[f] for f in RowOrder._fields)) if record is not None else None


def shard_global_rows(metadata: Any, rows: int, order: Optional[RowOrder]) -> Any:
    """The global rows of a ShardedTensor shard: routed int64 ids, or the slice at its row offset."""
    if order is not None:
        return order.global_ids(metadata.placement.rank())
    r0 = int(metadata.shard_offsets[0])
    return slice(r0, r0 + rows)


def _all_reduce_cpu(t: torch.Tensor, op: Any, process_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``t`` all-reduced over ``process_group`` (through CUDA for nccl), on CPU."""
    out = t.cuda() if dist.get_backend(process_group) == "nccl" else t
    dist.all_reduce(out, op=op, group=process_group)
    return out.cpu()


#: torchrec's names of a table's fused optimizer states, per optimizer the migration carries.
OPTIMIZER_STATE_NAMES: Dict[FusedOptimizerKind, Tuple[str, ...]] = {
    FusedOptimizerKind.SGD: (),
    FusedOptimizerKind.ROWWISE_ADAGRAD: ("momentum1",),
    FusedOptimizerKind.ADAM: ("momentum1", "exp_avg_sq"),
}
#: The entry of a table's :func:`gather_full_optimizer_state` holding its optimizer step (0-dim int64).
OPTIMIZER_STEP_KEY = "step"


class OptimizerTable(NamedTuple):
    """A table's fused optimizer (a :class:`FusedOptimizerKind` value, else a description) and shape."""

    optimizer: str
    rows: int
    dim: int


def _state_shapes(table: str, desc: OptimizerTable) -> Dict[str, Tuple[int, ...]]:
    """torchrec's name -> full shape of each optimizer state of ``table``."""
    opt = FusedOptimizerKind(desc.optimizer)
    row = opt is FusedOptimizerKind.ROWWISE_ADAGRAD  # one momentum per row; Adam: one per element
    return {f"{table}.{n}": (desc.rows,) if row else (desc.rows, desc.dim) for n in OPTIMIZER_STATE_NAMES[opt]}


def _fused_leaf_optimizer(leaf: Any) -> str:
    """The optimizer of a torchrec fused optimizer (``EmbeddingFusedOptimizer``: its fbgemm TBE's)."""
    tbe = getattr(leaf, "_emb_module", None)
    opt = getattr(tbe, "optimizer", None)
    if opt is None:
        return f"the fused optimizer of a {type(leaf).__name__} (not an fbgemm TBE's)"
    if getattr(tbe, "use_rowwise_bias_correction", False):
        return "adam with use_rowwise_bias_correction"
    try:
        parsed = FusedOptimizerKind.parse(opt)
    except ValueError:
        return str(getattr(opt, "name", opt)).lower()
    return parsed.value


def optimizer_tables(model: nn.Module) -> Dict[str, Tuple[Any, ...]]:
    """This rank's tables with a fused optimizer, by ``<collection>.<table>``.

    Entries: ``("tiered", shard)``, ``("fused", leaf optimizer, ShardedTensor weight, table name)``
    or ``("unsupported", reason, rows, dim)``. Raises ValueError without a ``KeyedOptimizer``.
    """
    root = getattr(model, "fused_optimizer", None)
    if not isinstance(root, KeyedOptimizer):
        raise ValueError(
            f"model must be a sharded model with a fused_optimizer (torchrec's DistributedModelParallel, or a "
            f"sharded EmbeddingBagCollection / EmbeddingCollection), got a {type(model).__name__} whose "
            f"fused_optimizer is {type(root).__name__}; pass the DistributedModelParallel-wrapped model."
        )
    out: Dict[str, Tuple[Any, ...]] = {}

    def walk(opt: KeyedOptimizer, prefix: str) -> None:
        if isinstance(opt, CombinedOptimizer):
            for key, sub in opt.optimizers:
                walk(sub, CombinedOptimizer.prepend_opt_key(key, prefix))
            return
        shards = opt.shards if isinstance(opt, TieredFusedOptimizer) else None
        for i, (param_key, param) in enumerate(opt.params.items()):
            full_key = CombinedOptimizer.prepend_opt_key(param_key, prefix)
            if not full_key.endswith(".weight"):
                continue
            base = full_key[: -len(".weight")]
            if shards is not None:
                out[base] = ("tiered", shards[i])
            elif isinstance(param, DTensor):  # refused for every rank alike (describe_optimizer_tables)
                out[base] = (
                    "unsupported",
                    "a DTensor weight and state (torchrec's DTensor state_dict option; use its ShardedTensor default)",
                    *(int(x) for x in param.size()),
                )
            elif isinstance(param, ShardedTensor):
                out[base] = ("fused", opt, param, base.rsplit(".", 1)[-1])

    walk(root, "")
    return out


def describe_optimizer_tables(
    tables: Dict[str, Tuple[Any, ...]], process_group: Optional[dist.ProcessGroup]
) -> Dict[str, OptimizerTable]:
    """Every table's optimizer and shape from this rank's :func:`optimizer_tables`, sorted.

    Collective when distributed, so ranks without a shard of a table learn it and all agree.
    """
    local: Dict[str, OptimizerTable] = {}
    for base, entry in tables.items():
        if entry[0] == "tiered":
            shard = entry[1]
            local[base] = OptimizerTable(shard.optimizer.name, shard.num_embeddings, shard.embedding_dim)
        elif entry[0] == "unsupported":
            local[base] = OptimizerTable(*entry[1:])
        else:
            rows, dim = (int(x) for x in entry[2].size())
            opt = _fused_leaf_optimizer(entry[1])
            if any(int(w.tensor.shape[1]) != dim for w in entry[2].local_shards()):
                opt = (
                    f"{opt}, column-wise sharded (torchrec keeps its row-wise optimizer state per column "
                    "shard; plan it TABLE_WISE or ROW_WISE)"
                )
            local[base] = OptimizerTable(opt, rows, dim)
    if not dist.is_initialized():
        return local
    gathered: List[Any] = [{} for _ in range(dist.get_world_size(process_group))]  # dicts of plain tuples
    dist.all_gather_object(gathered, {k: tuple(v) for k, v in local.items()}, group=process_group)
    merged: Dict[str, OptimizerTable] = {}
    for part in gathered:  # a column-wise table's description on a rank holding a column shard wins
        merged.update({k: OptimizerTable(*v) for k, v in part.items() if k not in merged or "column-wise" in v[0]})
    return dict(sorted(merged.items()))


def _refuse_unsupported(where: str, desc: Dict[str, OptimizerTable], keys: Any) -> None:
    """Refuses the tables ``keys`` of ``desc`` whose optimizer the migration does not carry."""
    unsupported = {k: desc[k] for k in keys if desc[k].optimizer not in {o.value for o in OPTIMIZER_STATE_NAMES}}
    if not unsupported:
        return
    named = ", ".join(f"{k!r} ({d.optimizer})" for k, d in unsupported.items())
    raise ValueError(
        f"{where}: the fused optimizer state of tables {named} cannot be migrated (the migration carries the "
        f"state of {sorted(o.value for o in OPTIMIZER_STATE_NAMES)}, what tiered tables run, from TABLE_WISE / "
        "ROW_WISE ShardedTensor tables). Possible solutions:\n"
        "  1. train them with SGD, row-wise Adagrad or Adam (apply_optimizer_in_backward), planned TABLE_WISE or "
        "ROW_WISE;\n"
        "  2. plan them data-parallel or without a fused optimizer, so that the migration leaves them out."
    )


def gather_full_optimizer_state(
    model: nn.Module, *, process_group: Optional[dist.ProcessGroup] = None
) -> Dict[str, Dict[str, torch.Tensor]]:
    """Every sharded table's fused optimizer state, full CPU tensors in global row order (collective).

    Returns ``{<collection>.<table>: {<table>.<name>: full state, "step": 0-dim int64}}`` with torchrec's
    names (:data:`OPTIMIZER_STATE_NAMES`), the same for FUSED and tiered tables. Raises ValueError
    without a ``fused_optimizer``, or for a table of another optimizer, column-wise or DTensor state.
    """
    tables = optimizer_tables(model)
    desc = describe_optimizer_tables(tables, process_group)
    _refuse_unsupported("gather_full_optimizer_state", desc, desc)
    with state_dict_without_tiered_rows(model):
        state = model.state_dict()  # the row orders of routed FUSED tables
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    steps = torch.full((len(desc),), -1, dtype=torch.int64)
    for i, (base, d) in enumerate(desc.items()):
        table = base.rsplit(".", 1)[-1]
        full = {k: torch.zeros(shape, dtype=torch.float32) for k, shape in _state_shapes(table, d).items()}
        entry = tables.get(base)
        if entry is not None and entry[0] == "tiered":
            st = entry[1].export_state()
            cols = named_to_columns(d, st.optimizer_state, table)
            for k, v in cols.items():
                full[k][st.global_ids] = v
            steps[i] = st.step
        elif entry is not None:
            _, leaf, weight, name = entry
            for k, src in _fused_state_shards(base, d, leaf, weight, name, _row_order(state, base)):
                for rows, shard in src:
                    full[k][rows] = shard.detach().cpu().to(torch.float32)
            steps[i] = _fused_step(leaf)
        out[base] = full
    if dist.is_initialized():
        for base in desc:  # sorted, the same on every rank
            for k in sorted(out[base]):
                out[base][k] = _all_reduce_cpu(out[base][k], dist.ReduceOp.SUM, process_group)
        steps = _all_reduce_cpu(steps, dist.ReduceOp.MAX, process_group)
    for i, base in enumerate(desc):
        out[base][OPTIMIZER_STEP_KEY] = torch.tensor(max(int(steps[i]), 0), dtype=torch.int64)
    return out


def named_to_columns(d: OptimizerTable, state: torch.Tensor, table: str) -> Dict[str, torch.Tensor]:
    """A tiered table's ``[n, state_cols]`` optimizer state as views named ``<table>.<name>`` (torchrec's)."""
    names = list(_state_shapes(table, d))
    if FusedOptimizerKind(d.optimizer) is FusedOptimizerKind.ROWWISE_ADAGRAD:
        return {names[0]: state[:, 0]}
    return {k: state[:, j * d.dim : (j + 1) * d.dim] for j, k in enumerate(names)}


def _columns_from_named(d: OptimizerTable, table: str, given: Mapping[str, Any]) -> torch.Tensor:
    """torchrec's named full states of a table as a tiered shard's ``[rows, state_cols]`` layout."""
    names = list(_state_shapes(table, d))
    if not names:
        return torch.zeros((d.rows, 0), dtype=torch.float32)
    return torch.cat([given[k].detach().reshape(d.rows, -1).to(torch.float32) for k in names], dim=1)


def _fused_state_shards(
    base: str, d: OptimizerTable, leaf: Any, weight: ShardedTensor, name: str, order: Optional[RowOrder]
) -> Iterator[Tuple[str, List[Tuple[Any, torch.Tensor]]]]:
    """For each named state of FUSED table ``base``: (global rows, local state tensor) per local shard
    (torchrec orders the state's local shards as the weight's)."""
    state = leaf.state.get(weight, {})
    w_shards = weight.local_shards()  # whole rows: column-wise tables were refused (describe_optimizer_tables)
    for k in _state_shapes(name, d):
        st = state.get(k)
        if not isinstance(st, ShardedTensor):
            raise ValueError(
                f"{base}: the fused optimizer state of table {name!r} has no ShardedTensor {k!r} (it "
                f"has {sorted(state)}); migrate it from torchrec's ShardedTensor optimizer state."
            )
        o_shards = st.local_shards()
        if len(o_shards) != len(w_shards):
            raise ValueError(f"{base}: {k!r} has {len(o_shards)} local shards, the weight {len(w_shards)}.")
        rows = [shard_global_rows(w.metadata, int(w.tensor.shape[0]), order) for w in w_shards]
        yield k, list(zip(rows, (o.tensor for o in o_shards)))


def _fused_step(leaf: Any) -> int:
    """The optimizer step (``iter``) of a torchrec fused optimizer's fbgemm TBE."""
    it = getattr(getattr(leaf, "_emb_module", None), "iter", None)
    return int(it.reshape(-1)[0]) if isinstance(it, torch.Tensor) and it.numel() else 0


def _given_optimizer(table: str, given: Mapping[str, Any]) -> str:
    """What optimizer's state ``given`` holds, for error messages."""
    m1, m2 = given.get(f"{table}.momentum1"), given.get(f"{table}.exp_avg_sq")
    dims = lambda t: t.dim() if isinstance(t, torch.Tensor) else None  # noqa: E731
    if m1 is None and m2 is None:
        return "sgd"
    if dims(m1) == 1 and m2 is None:
        return "rowwise_adagrad"
    if dims(m1) == 2 and dims(m2) == 2:
        return "adam"
    return "unrecognised"


def _check_table_state(base: str, d: OptimizerTable, given: Any) -> None:
    """Refuses ``given`` unless it is the state of table ``base``'s optimizer and shape."""
    table = base.rsplit(".", 1)[-1]
    shapes = _state_shapes(table, d)
    want = {**{k: list(v) for k, v in shapes.items()}, OPTIMIZER_STEP_KEY: "int >= 0"}
    if not isinstance(given, Mapping):
        raise ValueError(
            f"load_full_optimizer_state: states[{base!r}] must be a dict {want} (an entry of "
            f"gather_full_optimizer_state), got {type(given).__name__}."
        )
    got = {k: (list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__) for k, v in given.items()}
    step = given.get(OPTIMIZER_STEP_KEY)
    step_ok = (isinstance(step, numbers.Integral) and not isinstance(step, bool)) or (
        isinstance(step, torch.Tensor)
        and step.numel() == 1
        and not step.is_floating_point()
        and step.dtype is not torch.bool
    )
    step_ok = step_ok and step is not None and int(step) >= 0
    ok = (
        step_ok
        and set(given) == set(want)
        and all(
            isinstance(given[k], torch.Tensor) and given[k].is_floating_point() and tuple(given[k].shape) == s
            for k, s in shapes.items()
        )
    )
    if not ok:
        source = _given_optimizer(table, given)
        raise ValueError(
            f"load_full_optimizer_state: table {base!r} of the model trains with {d.optimizer} "
            f"([{d.rows}, {d.dim}], optimizer state {want}), but states[{base!r}] holds {source} state {got}. "
            "Possible solutions:\n"
            f"  1. load the state gathered (gather_full_optimizer_state) from a model whose table {table!r} has "
            f"the same shape and trains with {d.optimizer};\n"
            f"  2. train this model's table with the saving model's optimizer ({source}: the optimizer of "
            "apply_optimizer_in_backward, or the sharder's fused_params);\n"
            f"  3. leave {base!r} out of states and pass strict=False (its optimizer state is then left as it is, "
            "zero after loading its weights)."
        )
    bad = [k for k in shapes if not bool(torch.isfinite(given[k]).all())]
    if bad:
        raise ValueError(
            f"load_full_optimizer_state: states[{base!r}] {bad} hold NaN or inf values; load the "
            "state of a healthy run (an earlier checkpoint)."
        )


def load_full_optimizer_state(
    model: nn.Module,
    states: Mapping[str, Mapping[str, Any]],
    *,
    strict: bool = True,
    process_group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Loads :func:`gather_full_optimizer_state` output into ``model``'s tables (collective).

    Each rank writes the rows it holds; a FUSED TBE's shared step becomes the largest of its tables'.
    Load the weights first: loading a full weight zeroes a tiered table's optimizer state. Every table
    is checked before any is loaded; with ``strict=False`` tables missing from ``states`` keep theirs.
    ValueError for an entry not fitting its table, an unknown or missing table, or an uncarried optimizer.
    """
    tables = optimizer_tables(model)
    desc = describe_optimizer_tables(tables, process_group)
    if not isinstance(states, Mapping):
        raise ValueError(
            f"load_full_optimizer_state: states must be the dict gather_full_optimizer_state returns "
            f"({{<collection>.<table>: {{...}}}}), got {type(states).__name__}."
        )
    unknown = sorted(k for k in states if k not in desc)
    if unknown:
        raise ValueError(
            f"load_full_optimizer_state: states has {unknown}, which are no table of the model with a "
            f"fused optimizer (its tables: {list(desc)}); pass the keys gather_full_optimizer_state "
            "gives (<collection>.<table>, as the weight keys of model.state_dict()), or remove them."
        )
    missing = [k for k in desc if k not in states]
    if strict and missing:
        raise ValueError(
            f"load_full_optimizer_state: states has no entry for tables {missing} of the model; "
            "pass the whole gather_full_optimizer_state of the saving model, or strict=False to "
            "leave these tables' optimizer state as it is."
        )
    _refuse_unsupported("load_full_optimizer_state", desc, states)
    for base in sorted(states):  # the same first refusal on every rank
        _check_table_state(base, desc[base], states[base])
    sources = {
        base: (lambda k, rows, given=given: given[k].detach()[rows], int(given[OPTIMIZER_STEP_KEY]))
        for base, given in states.items()
    }
    write_optimizer_rows(model, tables, desc, sources)


#: A table's state for :func:`write_optimizer_rows`: ``rows_of(name, rows)`` -> named state of ``rows``, and the step.
StateSource = Tuple[Callable[[str, Any], torch.Tensor], int]


@torch.no_grad()
def write_optimizer_rows(
    model: nn.Module,
    tables: Dict[str, Tuple[Any, ...]],
    desc: Dict[str, OptimizerTable],
    sources: Mapping[str, StateSource],
) -> None:
    """Writes the (caller-checked) optimizer state of the tables in ``sources`` into ``model``.

    Tiered tables take every row, FUSED tables only their shards' rows; each FUSED TBE's step
    is set to the largest of its tables'.
    """
    with state_dict_without_tiered_rows(model):
        sd = model.state_dict()  # the row orders of routed FUSED tables
    leaf_steps: Dict[int, Tuple[Any, int]] = {}
    for base, entry in tables.items():
        if base not in sources:
            continue
        rows_of, step = sources[base]
        d, table = desc[base], base.rsplit(".", 1)[-1]
        if entry[0] == "tiered":
            every = {k: rows_of(k, slice(None)) for k in _state_shapes(table, d)}
            entry[1].load_global_optimizer_state(_columns_from_named(d, table, every), step)
            continue
        _, leaf, weight, name = entry
        for k, dst in _fused_state_shards(base, d, leaf, weight, name, _row_order(sd, base)):
            for rows, shard in dst:
                shard.copy_(rows_of(k, rows).to(shard.device, shard.dtype))
        prev = leaf_steps.get(id(leaf), (leaf, -1))[1]
        leaf_steps[id(leaf)] = (leaf, max(prev, step))
    for leaf, step in leaf_steps.values():
        leaf.set_optimizer_step(step)
