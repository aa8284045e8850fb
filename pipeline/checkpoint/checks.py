"""Checks of a checkpoint's regular part against the loading model, before anything is read:
fused optimizer state, unexpected entries and routed row orders; every rank refuses together.
Imports ``checkpoint.{adopt, errors, layout}`` and ``routing.row_order``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from recpipe.pipeline.checkpoint.adopt import Adoption
from recpipe.pipeline.checkpoint.errors import CheckpointLoadError, all_gather, rank_world
from recpipe.pipeline.checkpoint.layout import FUSED_OPTIMIZER_KEY, Source, is_recpipe_key, read_row_orders
from recpipe.pipeline.routing.row_order import ROW_ORDER_KEY, describe_row_order, row_order_refusal


def check_fused_optimizer(
    src: Source,
    state: Dict[str, Any],
    strict: bool,
    process_group: Optional[dist.ProcessGroup],
    adopted_without_state: Sequence[str] = (),
) -> None:
    """Refuses with ``strict`` a checkpoint without fused optimizer state (e.g. torchrec's own
    ``dcp.save(model.state_dict())``) for ``state`` or for this rank's adopted tables whose
    optimizer keeps state (``adopted_without_state``); without ``strict``, drops
    :data:`FUSED_OPTIMIZER_KEY` from ``state`` so the model keeps its own (DCP alone would fail
    with "Missing key" even without ``strict``)."""
    expected = (
        flatten_state_dict({FUSED_OPTIMIZER_KEY: state[FUSED_OPTIMIZER_KEY]})[0] if FUSED_OPTIMIZER_KEY in state else {}
    )
    if FUSED_OPTIMIZER_KEY in state and not expected:
        # nothing to load on this rank (e.g. it holds no FUSED shard: {"state": {}}), which DCP
        # would look for as an entry of its own ("Missing key in checkpoint state_dict: fused_optimizer")
        del state[FUSED_OPTIMIZER_KEY]
    found = any(key in src.metadata.state_dict_metadata for key in expected)
    lacks = (bool(expected) and not found) or bool(adopted_without_state)
    if not strict:
        if expected and not found:
            del state[FUSED_OPTIMIZER_KEY]
        return
    world = rank_world(process_group)[1]
    verdicts = all_gather((lacks, found), world, process_group)
    # refused only when no rank finds any of its state (a checkpoint holding some of it: DCP
    # names each missing entry)
    if not any(lack for lack, _ in verdicts) or any(f for _, f in verdicts):
        return
    problem = (
        f"it holds no fused optimizer state (no {FUSED_OPTIMIZER_KEY}.* entry): it was saved from model.state_dict() "
        "alone, e.g. by torchrec's own torch.distributed.checkpoint.save(model.state_dict(), ...)"
    )
    fixes = (
        "pass strict=False to load its weights and keep this model's fused optimizer state (e.g. fresh Adagrad "
        "accumulators; a tiered table loading a torchrec table's rows starts from zero state: training goes on, "
        "but not exactly as the saving job's would)",
        f"save with recpipe.pipeline.checkpoint.dcp.save, or add model.fused_optimizer.state_dict() under the key "
        f"{FUSED_OPTIMIZER_KEY!r} of the state dict you save",
    )
    raise CheckpointLoadError(src.where, [(problem, list(range(world)))], fixes)


def check_unexpected_entries(
    src: Source,
    state: Dict[str, Any],
    strict: bool,
    process_group: Optional[dist.ProcessGroup],
    adopted: Sequence[Adoption] = (),
) -> None:
    """With ``strict``, refuses (``CheckpointLoadError``, naming up to 5 and their number) a
    checkpoint holding regular entries this model lacks (``dcp.load`` would drop them silently);
    the ``adopted`` tables' entries count as the model's."""
    if not strict:
        return
    metadata = src.metadata
    expected = set(flatten_state_dict(state)[0])
    for a in adopted:
        row_order = a.weight_key[: -len("weight")] + ROW_ORDER_KEY + "."
        expected.update(a.state_keys)
        expected.add(a.weight_key)
        expected.update(k for k in metadata.state_dict_metadata if k.startswith(row_order))
    unexpected = [k for k in metadata.state_dict_metadata if k not in expected and not is_recpipe_key(k)]
    world = rank_world(process_group)[1]
    # a rank's state holds only its own shards' optimizer entries: an entry is the model's when any rank has it
    parts = all_gather(unexpected, world, process_group)
    names = sorted(set(parts[0]).intersection(*parts[1:]))
    if not names:
        return
    listed = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
    problem = f"it holds entries this model does not have: {listed} (saved by a model with other modules or tables)"
    fixes = (
        "build the model as the saving job did (the same modules, tables and optimizer)",
        "pass strict=False to load the entries this model has and ignore the others",
        "start from fresh weights instead of this checkpoint",
    )
    raise CheckpointLoadError(src.where, [(problem, list(range(world)))], fixes)


def check_row_orders(src: Source, state: Dict[str, Any], process_group: Optional[dist.ProcessGroup]) -> None:
    """Refuses (``RowOrderMismatchError``, naming each table and both row orders), before any row
    is read, sharded weights saved in another row order than this model's (routed rows that DCP
    would reshard as contiguous blocks, in place, on other ids)."""
    weights = [
        k
        for k, v in state.items()
        if k.endswith(".weight") and isinstance(v, (ShardedTensor, DTensor)) and k in src.metadata.state_dict_metadata
    ]
    bases = [k[: -len("weight")] + ROW_ORDER_KEY for k in weights]
    saved = read_row_orders(src, bases)
    problems: List[str] = []
    for weight, base in zip(weights, bases):
        theirs = saved.get(base)
        if theirs != state.get(base):
            problems.append(
                f"table {weight[: -len('.weight')]!r}: the checkpoint holds "
                f"{describe_row_order(theirs)}, this model {describe_row_order(state.get(base))}"
            )
    world = rank_world(process_group)[1]
    everyone = sorted({p for part in all_gather(problems, world, process_group) for p in part})
    if everyone:
        raise row_order_refusal(f"recpipe.pipeline.checkpoint.dcp.load of {src.where}", everyone)
