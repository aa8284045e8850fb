"""Exactness check of the fused pipeline: which lookups may run before the optimizer.

``TrainPipelineFusedSparseDist`` issues batch i+1's embedding lookup before (or
concurrently with) batch i's dense optimizer step. That is exact only when
nothing the lookup reads is written by that optimizer step: every table must be
updated by its fused in-backward optimizer (compute kernels FUSED, FUSED_UVM,
FUSED_UVM_CACHING, KEY_VALUE, CUSTOMIZED_KERNEL, ...), and no feature processor
(e.g. the position weights of a ``FeatureProcessedEmbeddingBagCollection``,
which the dense optimizer steps) may sit inside the pipelined module.

``FusedLookupExactnessChecker`` inspects the pipelined modules when the model is
attached and either raises ``FusedLookupExactnessError`` or, with
``allow_dense_tables=True``, returns the modules whose lookup must be ordered
after the optimizer (modules holding dense-updated tables or feature
processors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ParameterSharding, ShardingType

# Compute kernels whose weights are plain parameters stepped by the user's
# (dense) optimizer rather than by an optimizer fused into the TBE backward
# (torchrec.distributed.embedding_types.EmbeddingComputeKernel).
DENSE_UPDATED_KERNELS = frozenset({EmbeddingComputeKernel.DENSE.value})
# Sharding types whose tables are replicated and updated after the gradient
# all-reduce by the dense optimizer (torchrec.distributed.types.ShardingType).
DENSE_UPDATED_SHARDINGS = frozenset({ShardingType.DATA_PARALLEL.value})


class FusedLookupExactnessError(ValueError):
    """A pipelined module reads weights the dense optimizer writes.

    Raised by ``TrainPipelineFusedSparseDist`` when the model is attached; the
    message names the module, the table or parameter, and numbered solutions.
    """


@dataclass(frozen=True)
class DenseUpdatedTable:
    """One table (or parameter) of a pipelined module stepped by the dense optimizer."""

    module: str
    """Fully qualified name of the pipelined sharded module."""

    table: str
    """Table name (or parameter name when the module has no sharding plan)."""

    reason: str
    """Why it counts as dense-updated, e.g. ``compute_kernel='dense'``."""


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
    # Fused TBE weights carry `_in_backward_optimizers` (set by torchrec's
    # batched embedding kernels); anything else is stepped by the dense optimizer.
    return [
        DenseUpdatedTable(module_name, name, "parameter without an in-backward optimizer")
        for name, p in module.named_parameters()
        if p.requires_grad and not getattr(p, "_in_backward_optimizers", None)
    ]


def _sharding_plan_of(module: torch.nn.Module) -> Optional[Mapping[str, ParameterSharding]]:
    # Sharded EBC / EC carry `module_sharding_plan`; a sharded
    # FeatureProcessedEmbeddingBagCollection wraps a sharded EBC that carries it.
    plan = getattr(module, "module_sharding_plan", None)
    if plan is None:
        inner = getattr(module, "_embedding_bag_collection", None)
        plan = getattr(inner, "module_sharding_plan", None) if inner is not None else None
    return plan


def _feature_processor_of(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    # ShardedFeatureProcessedEmbeddingBagCollection keeps its processors in
    # `_feature_processors` (a FeatureProcessorsCollection such as
    # PositionWeightedModuleCollection, or a ModuleDict of per-feature modules).
    for attr in ("_feature_processors", "_feature_processor"):
        fp = getattr(module, attr, None)
        if fp is not None:
            return fp
    return None


@dataclass(frozen=True)
class FeatureProcessedModule:
    """A pipelined module that applies a feature processor inside its lookup."""

    module: str
    """Fully qualified name of the pipelined sharded module."""

    tables: Tuple[str, ...]
    """Tables of the module (from its sharding plan; empty without a plan)."""

    parameters: Tuple[str, ...]
    """Trainable feature-processor parameters (stepped by the dense optimizer),
    relative to the processor, e.g. ``position_weights.f_t0``."""


class FusedLookupExactnessChecker:
    """Decides, per pipelined module, whether its lookup may precede the optimizer.

    Args:
        allow_dense_tables (bool): False: any dense-updated table or feature
            processor raises. True: modules holding one are reported as "after
            optimizer".

    Example::

        checker = FusedLookupExactnessChecker(allow_dense_tables=False)
        late = checker.check({"sparse.ebc": sharded_ebc})   # raises or returns []
    """

    def __init__(self, allow_dense_tables: bool) -> None:
        self._allow_dense_tables = allow_dense_tables

    def feature_processor_modules(self, modules: Mapping[str, torch.nn.Module]) -> List[str]:
        """Names of the modules that apply a feature processor inside the lookup.

        Args:
            modules (Mapping[str, torch.nn.Module]): pipelined module name -> module.

        Returns:
            List[str]: offending module names, in input order.
        """
        return [name for name, m in modules.items() if _feature_processor_of(m) is not None]

    def feature_processed_modules(
        self, modules: Mapping[str, torch.nn.Module]
    ) -> List[FeatureProcessedModule]:
        """The modules of ``feature_processor_modules`` with their tables and parameters.

        Args:
            modules (Mapping[str, torch.nn.Module]): pipelined module name -> module.

        Returns:
            List[FeatureProcessedModule]: one entry per feature-processed module,
            in input order.
        """
        found: List[FeatureProcessedModule] = []
        for name, m in modules.items():
            fp = _feature_processor_of(m)
            if fp is None:
                continue
            plan = _sharding_plan_of(m)
            params = (
                tuple(n for n, p in fp.named_parameters() if p.requires_grad)
                if isinstance(fp, torch.nn.Module)
                else ()
            )
            found.append(FeatureProcessedModule(name, tuple(plan or ()), params))
        return found

    def dense_updated_tables(self, modules: Mapping[str, torch.nn.Module]) -> List[DenseUpdatedTable]:
        """Every table of the pipelined modules stepped by the dense optimizer.

        Decided from the module's sharding plan (identical on every rank, so all
        ranks take the same schedule; a feature-processed EBC's is its inner EBC's,
        its feature processor is reported by ``feature_processed_modules``);
        modules without a plan fall back to their parameters'
        ``_in_backward_optimizers`` marker.

        Args:
            modules (Mapping[str, torch.nn.Module]): pipelined module name -> module.

        Returns:
            List[DenseUpdatedTable]: offending tables, module by module.
        """
        found: List[DenseUpdatedTable] = []
        for name, m in modules.items():
            plan = _sharding_plan_of(m)
            if plan is not None:
                found.extend(_dense_tables_from_plan(name, plan))
            else:
                found.extend(_dense_params_without_plan(name, m))
        return found

    def check(self, modules: Mapping[str, torch.nn.Module]) -> Sequence[str]:
        """Validates the pipelined modules.

        Args:
            modules (Mapping[str, torch.nn.Module]): pipelined module name -> module.

        Returns:
            Sequence[str]: sorted names of the modules whose lookup must be issued
            after the optimizer step: those holding a dense-updated table or a
            feature processor (empty unless ``allow_dense_tables=True``).

        Raises:
            FusedLookupExactnessError: a module has a feature processor, or a table
                is dense-updated, and ``allow_dense_tables`` is False.
        """
        fp_modules = self.feature_processed_modules(modules)
        fp = [f.module for f in fp_modules]
        if fp and not self._allow_dense_tables:
            details = "; ".join(
                f"module {f.module!r} tables {list(f.tables)} feature-processor parameters "
                f"{list(f.parameters)}"
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
            per_module: Dict[str, int] = {}
            for d in dense:
                per_module[d.module] = per_module.get(d.module, 0) + 1
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
