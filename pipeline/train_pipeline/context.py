"""Per-batch context of ``TrainPipelineFusedSparseDist`` (torchrec's ``pipeline_context``).

Owns ``FusedLookupPipelineContext``, ``checked_context`` and ``pipelined_name``. Imports no recpipe module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torchrec.distributed.train_pipeline.pipeline_context import EmbeddingTrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import BaseForward


@dataclass
class FusedLookupPipelineContext(EmbeddingTrainPipelineContext):
    """torchrec's ``EmbeddingTrainPipelineContext`` plus what the batch's early lookup recorded."""

    lookup_started: bool = False
    """True once every pipelined module's lookup for this batch was issued."""

    lookup_events: Dict[str, torch.Event] = field(default_factory=dict)
    """Module name -> event on the lookup stream after its lookup (CUDA only)."""

    lookup_mode: Optional[Tuple[bool, bool]] = None
    """(grad enabled, model.training) when the lookup was issued; a step in another
    mode looks the batch up again."""

    lookup_counters: Dict[str, List[Tuple[Any, Any]]] = field(default_factory=dict)
    """Module name -> its counter sources' readings (before, after) the lookup, so a
    discarded lookup takes its increments back (Adam's bias correction counts lookups)."""

    lookup_inputs: Dict[str, Tuple[Any, ...]] = field(default_factory=dict)
    """Module name -> what its lookup read besides the batch (``LookupInputs.read``)."""

    lookup_errors: Dict[str, Exception] = field(default_factory=dict)
    """Module name -> the exception its lookup raised; raised by the forward when it
    calls the module, where torchrec looks the batch up."""

    deferred_lookups: Set[str] = field(default_factory=set)
    """Modules not looked up because an earlier lookup of the batch raised; looked up
    inside the forward if it calls them, so no extra collective runs."""

    forward_started: bool = False
    """True once the forward called a pipelined module for this batch: a retried
    ``progress()`` then fails on a consumed module, as torchrec's does."""


def checked_context(contexts: Sequence[Any], position: int, context_type: type) -> FusedLookupPipelineContext:
    """``contexts[position]``; ``TypeError`` unless it is a ``FusedLookupPipelineContext``."""
    context = contexts[position]
    if not isinstance(context, FusedLookupPipelineContext):
        got = type(context)
        raise TypeError(
            f"TrainPipelineFusedSparseDist: pipeline.contexts[{position}] (batch "
            f"{getattr(context, 'index', '?')}) is a {got.__module__}.{got.__qualname__}; "
            "expected a recpipe.pipeline.train_pipeline.context.FusedLookupPipelineContext (this "
            f"pipeline's context_type is {context_type.__qualname__}), which records "
            "whether the batch's embedding lookup was issued. Create contexts with "
            "pipeline._create_context() (it builds context_type) instead of constructing "
            f"{got.__qualname__} yourself; a subclass overriding _create_context() must "
            "return a FusedLookupPipelineContext subclass."
        )
    return context


def pipelined_name(module: torch.nn.Module) -> str:
    """The name torchrec's pipeline gave ``module``: the key of its batch's entries in a context.

    Args:
        module: a sharded module the pipeline rewrote (one of ``pipeline._pipelined_modules``).

    Returns:
        Its pipelined forward's ``name``.

    Raises:
        TypeError: ``module``'s forward is not a torchrec pipelined forward (the module is not
            pipelined, or the model was detached).
    """
    forward = module.forward
    if not isinstance(forward, BaseForward):
        raise TypeError(
            f"TrainPipelineFusedSparseDist: module {type(module).__name__}'s forward is "
            f"{type(forward).__name__}, not a torchrec pipelined forward (BaseForward), so it has no "
            "pipeline name; pass a module of pipeline._pipelined_modules while the model is attached."
        )
    return forward.name
