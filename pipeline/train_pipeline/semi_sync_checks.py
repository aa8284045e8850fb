"""Where ``TrainPipelineSemiSync`` issues each pipelined module's lookup, and the models it refuses.

In the semi-sync phase batch i+1's lookup is issued right after batch i's forward, before batch
i's backward, so it reads tables last updated by batch i-1. Two kinds of pipelined module cannot
take that point and still train correctly:

* modules holding weights the dense optimizer steps (a feature processor, a DENSE or
  DATA_PARALLEL table, any parameter of the module the dense optimizer holds without an
  in-backward optimizer): the early lookup would read them before batch i's optimizer step
  overwrites them in place, under batch i+1's autograd graph. Refused unless
  ``allow_dense_tables=True``, which issues their lookup after the optimizer step;
* modules that map ids to storage slots while they look up (dynamic tables, torchrec's
  managed-collision modules): batch i+1's inserts may evict a key batch i looked up and give its
  slot to a new key, and batch i's backward would then update the new key's row. Their lookup is
  issued after batch i's backward.

A rank holds only its own table shards, so each rank's findings are gathered from every rank of
the modules' process group: all ranks take the same schedule and raise the same error. Owns
``SemiSyncModelError``, ``SemiSyncModulePoints`` and ``semi_sync_module_points``. Imports train modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import torch
import torch.distributed as dist

from recpipe.pipeline.train_pipeline.take_back import mch_counter_sources
from recpipe.pipeline.train_pipeline.validation import FusedLookupExactnessChecker

__all__ = ["SemiSyncModelError", "SemiSyncModulePoints", "semi_sync_module_points"]

_WHO = "TrainPipelineSemiSync"


class SemiSyncModelError(ValueError):
    """A pipelined module the semi-sync schedule cannot keep correct (raised on attach)."""


@dataclass(frozen=True)
class SemiSyncModulePoints:
    """Pipelined modules whose semi-sync lookup of batch i+1 is not issued after batch i's forward.

    Args:
        after_backward (Tuple[str, ...]): modules mapping ids to slots (dynamic tables, managed
            collision): looked up right after batch i's backward.
        after_optimizer (Tuple[str, ...]): modules holding dense-stepped weights (accepted with
            ``allow_dense_tables=True``): looked up right after batch i's optimizer step.
    """

    after_backward: Tuple[str, ...] = ()
    after_optimizer: Tuple[str, ...] = ()


def _optimizer_parameter_ids(optimizer: Any) -> Set[int]:
    """Ids of the tensors in ``optimizer.param_groups`` (empty for an optimizer without them)."""
    groups = getattr(optimizer, "param_groups", None) or ()
    return {id(p) for group in groups for p in group.get("params", ())}


def dense_stepped_weights(modules: Mapping[str, torch.nn.Module], optimizer: Any) -> Dict[str, List[str]]:
    """Module name -> what in it the dense optimizer steps (feature processor parameters, DENSE /
    DATA_PARALLEL tables, parameters the optimizer holds without an in-backward optimizer)."""
    checker = FusedLookupExactnessChecker(allow_dense_tables=True)
    found: Dict[str, List[str]] = {}
    for fp in checker.feature_processed_modules(modules):
        found.setdefault(fp.module, []).append(f"feature processor (parameters {list(fp.parameters)})")
    for table in checker.dense_updated_tables(modules):
        found.setdefault(table.module, []).append(f"table {table.table!r} ({table.reason})")
    held = _optimizer_parameter_ids(optimizer)
    for name, module in modules.items():
        shared = [
            pname
            for pname, p in module.named_parameters()
            if id(p) in held and not getattr(p, "_in_backward_optimizers", None)
        ]
        if shared:
            found.setdefault(name, []).append(f"parameters {shared} held by the dense optimizer")
    return found


def slot_remapping_modules(modules: Mapping[str, torch.nn.Module]) -> Dict[str, List[str]]:
    """Module name -> why it maps ids to slots while looking up: a dynamic table among this rank's
    tiered shards (duck-typed: a shard with ``dynamic_rows()``), or a managed-collision module."""
    found: Dict[str, List[str]] = {}
    for name, module in modules.items():
        tiered = getattr(module, "tiered_tables", None)
        shards = tiered() if callable(tiered) else {}
        dynamic = sorted(t for t, s in shards.items() if callable(getattr(s, "dynamic_rows", None)))
        if dynamic:
            found.setdefault(name, []).append(f"dynamic tables {dynamic}")
        if hasattr(module, "_managed_collision_collection") or mch_counter_sources(module):
            found.setdefault(name, []).append("managed collision")
    return found


def process_group_of(modules: Mapping[str, torch.nn.Module]) -> Optional[dist.ProcessGroup]:
    """The process group of the first sharded module carrying torchrec's ``_env`` (None: none does)."""
    for module in modules.values():
        group = getattr(getattr(module, "_env", None), "process_group", None)
        if group is not None:
            return group
    return None


def _union_across_ranks(
    found: Tuple[Dict[str, List[str]], ...], group: Optional[dist.ProcessGroup]
) -> Tuple[Dict[str, List[str]], ...]:
    """Every rank's findings merged (module name -> what, first seen first); this rank's own without
    a process group or an initialised ``torch.distributed``."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return found
    gathered: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, found, group=group)
    merged: Tuple[Dict[str, List[str]], ...] = tuple({} for _ in found)
    for rank_found in gathered:
        for into, part in zip(merged, rank_found):
            for name, what in part.items():
                into.setdefault(name, []).extend(w for w in what if w not in into.get(name, ()))
    return merged


def semi_sync_module_points(
    modules: Mapping[str, torch.nn.Module],
    optimizer: Any,
    allow_dense_tables: bool,
    group: Optional[dist.ProcessGroup] = None,
) -> SemiSyncModulePoints:
    """Sorts the pipelined modules (name -> module) by the point of their semi-sync lookup.

    A collective over ``group`` (every rank of it must call it): the findings of all ranks decide.

    Returns:
        SemiSyncModulePoints: the modules looked up after the backward or after the optimizer
        step; every other module is looked up right after the forward.

    Raises:
        SemiSyncModelError: a module holds dense-stepped weights and ``allow_dense_tables`` is False.
    """
    dense, remapping = _union_across_ranks(
        (dense_stepped_weights(modules, optimizer), slot_remapping_modules(modules)), group
    )
    if dense and not allow_dense_tables:
        listed = "; ".join(f"module {name!r}: {', '.join(dense[name])}" for name in sorted(dense))
        raise SemiSyncModelError(
            f"{_WHO}: pipelined module(s) {sorted(dense)} hold weights the dense optimizer steps "
            f"({listed}). A semi-sync lookup of batch i+1 runs right after batch i's forward, so it "
            "would read these weights under batch i+1's autograd graph before batch i's optimizer "
            "step overwrites them in place: batch i+1's backward then runs against weights that "
            "changed under it (autograd refuses saved tensors modified in place; a kernel that "
            "copied them computes stale gradients).\n"
            "Possible solutions:\n"
            f"  1) Pass allow_dense_tables=True: the lookup of {sorted(dense)} is then issued after "
            "batch i's optimizer step (those modules are not stale and do not overlap).\n"
            "  2) Shard these tables with a fused compute kernel (compute_kernel='fused') and a "
            "model-parallel sharding type, and move feature processors into the dense model.\n"
            "  3) Use TrainPipelineFusedSparseDist or TrainPipelineSparseDist (exact)."
        )
    after_optimizer = tuple(sorted(dense))
    after_backward = tuple(n for n in sorted(remapping) if n not in dense)
    return SemiSyncModulePoints(after_backward=after_backward, after_optimizer=after_optimizer)
