"""Exactness check of the fused pipeline: which lookups may run before the optimizer.

Batch i+1's lookup, issued before batch i's dense optimizer step, is exact only when
that step writes nothing it reads: every table updated by its fused in-backward
optimizer and no feature processor (stepped by the dense optimizer) inside the pipelined
module. Owns ``FusedLookupExactnessChecker`` and ``FusedLookupExactnessError``.
Imports no recpipe module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ParameterSharding, ShardingType

# Compute kernels whose weights the dense optimizer steps (not fused into the TBE backward).
DENSE_UPDATED_KERNELS = frozenset({EmbeddingComputeKernel.DENSE.value})
# Sharding types whose replicated tables the dense optimizer updates after the all-reduce.
DENSE_UPDATED_SHARDINGS = frozenset({ShardingType.DATA_PARALLEL.value})


class FusedLookupExactnessError(ValueError):
    """A pipelined module reads weights the dense optimizer writes (raised on attach)."""


@dataclass(frozen=True)
class DenseUpdatedTable:
    """One table of a pipelined module stepped by the dense optimizer: the module's name, the
    table's (a parameter's without a sharding plan) and why, e.g. ``compute_kernel='dense'``."""

    module: str
    table: str
    reason: str


def _dense_tables_from_plan(module_name: str, plan: Mapping[str, ParameterSharding]) -> List[DenseUpdatedTable]:
    found: List[DenseUpdatedTable] = []
    for table, ps in plan.items():
        reasons = []
        if ps.compute_kernel in DENSE_UPDATED_KERNELS:
            reasons.append(f"compute_kernel={ps.compute_kernel!r}")
        if ps.sharding_type in DENSE_UPDATED_SHARDINGS:
            reasons.append(f"sharding_type={ps.sharding_type!r}")
        if reasons:
            found.append(DenseUpdatedTable(module_name, table, ", ".join(reasons)))
    return found


def _dense_params_without_plan(module_name: str, module: torch.nn.Module) -> List[DenseUpdatedTable]:
    # Fused TBE weights carry `_in_backward_optimizers`; anything else is dense-updated.
    return [
        DenseUpdatedTable(module_name, name, "parameter without an in-backward optimizer")
        for name, p in module.named_parameters()
        if p.requires_grad and not getattr(p, "_in_backward_optimizers", None)
    ]


def _sharding_plan_of(module: torch.nn.Module) -> Optional[Mapping[str, ParameterSharding]]:
    plan = getattr(module, "module_sharding_plan", None)
    if plan is None:  # a sharded FeatureProcessedEmbeddingBagCollection wraps a sharded EBC that carries it
        plan = getattr(getattr(module, "_embedding_bag_collection", None), "module_sharding_plan", None)
    return plan


@dataclass(frozen=True)
class FeatureProcessedModule:
    """A pipelined module applying a feature processor inside its lookup: its name, its plan's
    tables and the processor's trainable parameters, e.g. ``position_weights.f_t0``."""

    module: str
    tables: Tuple[str, ...]
    parameters: Tuple[str, ...]


class FusedLookupExactnessChecker:
    """Decides, per pipelined module, whether its lookup may precede the optimizer.

    Args:
        allow_dense_tables (bool): report modules holding a dense-updated table or feature
            processor as "after optimizer" instead of raising.
    """

    def __init__(self, allow_dense_tables: bool) -> None:
        self._allow_dense_tables = allow_dense_tables

    def feature_processed_modules(self, modules: Mapping[str, torch.nn.Module]) -> List[FeatureProcessedModule]:
        """The modules (name -> module) applying a feature processor inside the lookup, in order."""
        found: List[FeatureProcessedModule] = []
        for name, m in modules.items():
            fp = getattr(m, "_feature_processors", None)
            if fp is None:
                fp = getattr(m, "_feature_processor", None)
            if fp is None:
                continue
            plan = _sharding_plan_of(m)
            params = (
                tuple(n for n, p in fp.named_parameters() if p.requires_grad) if isinstance(fp, torch.nn.Module) else ()
            )
            found.append(FeatureProcessedModule(name, tuple(plan or ()), params))
        return found

    def dense_updated_tables(self, modules: Mapping[str, torch.nn.Module]) -> List[DenseUpdatedTable]:
        """Every table of the pipelined modules (name -> module) stepped by the dense optimizer.

        Decided from the sharding plan (identical on every rank, so all ranks take the same
        schedule); a module without a plan by its parameters' ``_in_backward_optimizers``.
        """
        found: List[DenseUpdatedTable] = []
        for name, m in modules.items():
            plan = _sharding_plan_of(m)
            found += _dense_tables_from_plan(name, plan) if plan is not None else _dense_params_without_plan(name, m)
        return found

    def check(self, modules: Mapping[str, torch.nn.Module]) -> Sequence[str]:
        """Validates the pipelined modules (name -> module).

        Returns:
            Sequence[str]: sorted names of the modules whose lookup must follow the optimizer
            step (empty unless ``allow_dense_tables=True``).

        Raises:
            FusedLookupExactnessError: a feature processor or dense-updated table, and
                ``allow_dense_tables`` is False.
        """
        fp_modules = self.feature_processed_modules(modules)
        fp = [f.module for f in fp_modules]
        if fp and not self._allow_dense_tables:
            details = "; ".join(
                f"module {f.module!r} tables {list(f.tables)} feature-processor parameters {list(f.parameters)}"
                for f in fp_modules
            )
            raise FusedLookupExactnessError(
                f"TrainPipelineFusedSparseDist: pipelined module(s) {fp} apply a feature "
                f"processor inside the embedding lookup ({len(fp)} of {len(modules)} pipelined "
                f"modules: {details}). Its weights are stepped by the dense optimizer, so a "
                "lookup issued before the optimizer reads weights the optimizer then overwrites "
                "in place: the next backward fails autograd's check ('modified by an inplace "
                "operation'), or, for a processor that copies its weights, training silently "
                "uses stale values.\n"
                "Possible solutions:\n"
                "  1) Use torchrec.distributed.train_pipeline.TrainPipelineSparseDist for this "
                "model (its lookup runs inside the forward).\n"
                f"  2) Move the feature processor out of {fp[0]!r} into the dense part of the "
                "model, or remove it.\n"
                f"  3) Pass allow_dense_tables=True: the lookup of {fp} is then issued after "
                "the optimizer step (exact, but it no longer overlaps the optimizer)."
            )
        dense = self.dense_updated_tables(modules)
        if dense and not self._allow_dense_tables:
            listed = "; ".join(f"module {d.module!r} table {d.table!r} ({d.reason})" for d in dense)
            per_module = {d.module for d in dense}
            raise FusedLookupExactnessError(
                f"TrainPipelineFusedSparseDist: {len(dense)} table(s) in {len(per_module)} "
                f"pipelined module(s) are updated by the dense optimizer, not by a fused "
                f"in-backward optimizer: {listed}. Looking them up before the optimizer step "
                "would read stale weights.\n"
                "Possible solutions:\n"
                "  1) Shard these tables with a fused compute kernel (e.g. "
                "compute_kernel='fused') and a model-parallel sharding type (table_wise, "
                "column_wise, row_wise) instead of 'dense' / 'data_parallel'.\n"
                "  2) Pass allow_dense_tables=True: the lookup of the "
                f"{len(per_module)} module(s) {sorted(per_module)} is then issued after the "
                "optimizer step (exact, but it no longer overlaps the optimizer)."
            )
        return sorted(set(fp) | {d.module for d in dense})
