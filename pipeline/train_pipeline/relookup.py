"""When a lookup issued early is not what the step's forward would compute.

The lookup issued during step i for batch i+1 is issued again at the start of step i+1
when the grad/train mode differs, a table of the module was written since
(``tables_version``), or its fused learning rate / optimizer arguments changed (fbgemm's
TBE takes them at lookup time; torchrec's fused optimizers set them in ``zero_grad()``
and ``step()``). Owns ``tables_version``, ``lookup_mode`` and ``LookupInputs``.
Imports ``recpipe.pipeline.train_pipeline.context``.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import torch
from torchrec.distributed.model_parallel import ShardedModule

from recpipe.pipeline.train_pipeline.context import FusedLookupPipelineContext, pipelined_name

REASON_MODE = "mode"
REASON_TABLES = "tables"
REASON_OPTIMIZER = "optimizer"

_OPTIMIZER_RELOOKUP_WARNING = (
    "TrainPipelineFusedSparseDist: the fused embedding optimizers' learning rate (or "
    "arguments) changed between two progress() calls at two consecutive steps, so the "
    "lookup issued early for the next batch was redone each time (fbgemm's TBE takes "
    "the learning rate at lookup time; torchrec's fused optimizers set it in "
    "zero_grad() and step()). Training stays exact, but each such step looks its batch "
    "up twice and nothing overlaps (pipeline.stats.relookups counts them).\n"
    "Possible solutions:\n"
    "  1) Change the embedding learning rate less often (e.g. an LR scheduler stepped "
    "every N steps, or a warm-up that ends).\n"
    "  2) Use torchrec's TrainPipelineSparseDist while the learning rate changes every "
    "step."
)


def tables_version(module: torch.nn.Module) -> int:
    """A number that grows whenever ``module``'s tables are written in place.

    Sums the version counters of its parameters and buffers (not bumped by fbgemm's
    fused TBE backward) and the ``rows_writes`` of its tiered tables, whose rows live
    outside parameters.
    """
    version = sum(t._version for t in module.parameters()) + sum(t._version for t in module.buffers())
    tiered = getattr(module, "tiered_tables", None)
    if callable(tiered):
        version += sum(shard.rows_writes for shard in tiered().values())
    return version


def lookup_mode(model: torch.nn.Module) -> Tuple[bool, bool]:
    """(grad enabled, ``model.training``): what a lookup's result depends on
    besides the tables (autograd graph, training-only kernel work)."""
    return torch.is_grad_enabled(), model.training


class LookupInputs:
    """What each pipelined module's lookup reads besides the batch, and whether it changed.

    A learning rate changed at every step makes one relookup per step, without overlap;
    a ``RuntimeWarning`` says so once.
    """

    def __init__(self) -> None:
        self._tbes: Dict[str, List[torch.nn.Module]] = {}
        self._tiered_shards: Dict[str, List[Any]] = {}
        self._optimizer_streak = 0
        self._warned = False

    def bind(self, tbes: Dict[str, List[torch.nn.Module]], tiered_shards: Dict[str, List[Any]]) -> None:
        """Sets each pipelined module's fbgemm TBEs and tiered shards (found once, at attach)."""
        self._tbes = tbes
        self._tiered_shards = tiered_shards

    def read(self, module: ShardedModule) -> Tuple[Any, ...]:
        """``tables_version``, each fbgemm TBE's learning rate and optimizer arguments, and
        each tiered table's optimizer hyper-parameters (a fbgemm-backed shard mirrors them
        into its TBE, whose ``learning_rate_tensor`` is therefore not read here)."""
        name = pipelined_name(module)
        tbes = self._tbes.get(name, ())
        return (
            tables_version(module),
            tuple((float(cast(torch.Tensor, m.learning_rate_tensor)), getattr(m, "optimizer_args", None)) for m in tbes)
            + tuple(tuple(vars(t.optimizer).values()) for t in self._tiered_shards.get(name, ())),
        )

    def stale_reason(
        self, context: FusedLookupPipelineContext, modules: Sequence[ShardedModule], mode: Tuple[bool, bool]
    ) -> Optional[str]:
        """Why ``context``'s lookup is not what this step (in ``mode``) would compute
        (``REASON_*``), or None."""
        if context.lookup_mode != mode:
            return REASON_MODE
        for m in modules:
            if pipelined_name(m) in context.deferred_lookups:
                continue  # looked up in the forward
            then = context.lookup_inputs.get(pipelined_name(m))
            now = self.read(m)
            if then is None or then[0] != now[0]:
                return REASON_TABLES
            if then[1] != now[1]:
                return REASON_OPTIMIZER
        return None

    def note(self, reason: Optional[str], stacklevel: int) -> None:
        """Counts consecutive relookups for a new learning rate; warns once at two in a row."""
        self._optimizer_streak = self._optimizer_streak + 1 if reason == REASON_OPTIMIZER else 0
        if self._optimizer_streak == 2 and not self._warned:
            self._warned = True
            warnings.warn(_OPTIMIZER_RELOOKUP_WARNING, RuntimeWarning, stacklevel=stacklevel + 1)
