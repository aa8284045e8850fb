"""Issuing one pipelined module's lookup and output all-to-all into a batch's context.

Owns ``LookupIssuer``. Imports ``recpipe.pipeline.train_pipeline`` modules.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Set

import torch
from torchrec.distributed.model_parallel import ShardedModule

from recpipe.pipeline.train_pipeline.context import FusedLookupPipelineContext, pipelined_name
from recpipe.pipeline.train_pipeline.forward import PipelinedLookupUnavailableError
from recpipe.pipeline.train_pipeline.relookup import LookupInputs
from recpipe.pipeline.train_pipeline.streams import LookupStreams
from recpipe.pipeline.train_pipeline.take_back import LookupTakeBack


class LookupIssuer:
    """Issues a pipelined module's lookup for a batch (on the lookup stream on CUDA) and
    records what it read (``inputs``) and how it moved its counters (``counters``); ``who`` is the
    pipeline its errors name."""

    def __init__(self, streams: LookupStreams, counters: LookupTakeBack, inputs: LookupInputs, who: str) -> None:
        self._streams = streams
        self._counters = counters
        self._inputs = inputs
        self._who = who

    def issue_all(
        self,
        modules: Sequence[ShardedModule],
        context: FusedLookupPipelineContext,
        tables_updated: Optional[torch.Event],
        after_optimizer: Set[str],
    ) -> None:
        """Issues the lookups of ``modules`` into ``context`` in order.

        On CUDA a lookup waits for ``tables_updated``, or, when that is None or the module
        is in ``after_optimizer``, for an event recorded now. After a lookup that raised,
        the later modules are deferred to the forward: torchrec's forward stops at that
        module, so no further lookup (nor its all-to-all) is issued.
        """
        waits_now = [tables_updated is None or pipelined_name(m) in after_optimizer for m in modules]
        now = self._streams.main_stream_event() if any(waits_now) else None
        for module, wait_now in zip(modules, waits_now):
            if context.lookup_errors:
                context.deferred_lookups.add(pipelined_name(module))
                continue
            self.issue(module, context, now if wait_now else tables_updated)

    def issue(
        self,
        module: ShardedModule,
        context: FusedLookupPipelineContext,
        tables_ready: Optional[torch.Event],
        defer_errors: bool = True,
    ) -> None:
        """Issues ``module``'s lookup and output all-to-all into ``context``, after ``tables_ready``
        (CUDA); ``defer_errors`` keeps the lookup's exception in ``context.lookup_errors``. Raises
        ``PipelinedLookupUnavailableError`` when the module's input dist was consumed."""
        name: str = pipelined_name(module)
        if name not in context.input_dist_tensors_requests:
            raise PipelinedLookupUnavailableError(
                f"{self._who}: the input dist of module {name!r} for batch "
                f"{context.index} is not available for its lookup (available: "
                f"{sorted(context.input_dist_tensors_requests)}): it was consumed already. This "
                f"typically means {name!r} is called more than once in the model's forward: a "
                "pipelined embedding module (EBC, EC, ...) can be called once per forward, as in "
                "torchrec's TrainPipelineSparseDist. Call it once and reuse its output (or give "
                "each call its own module)."
            )
        module_ctx = context.module_contexts[name]
        request = context.input_dist_tensors_requests.pop(name)
        counters_before = self._counters.read(name)

        def lookup(kjt: Any) -> None:
            self.compute_and_output_dist(module, context, module_ctx, kjt, defer_errors)

        event = self._streams.run_lookup(name, request, module_ctx, tables_ready, lookup)
        if event is not None:
            context.lookup_events[name] = event
        context.lookup_counters[name] = list(zip(counters_before, self._counters.read(name)))
        context.lookup_inputs[name] = self._inputs.read(module)

    @staticmethod
    def compute_and_output_dist(
        module: ShardedModule, context: FusedLookupPipelineContext, module_ctx: Any, kjt: Any, defer_errors: bool = True
    ) -> None:
        """Runs ``compute_and_output_dist``; with ``defer_errors`` its exception is kept for
        the module's pipelined forward, where torchrec's pipeline looks it up."""
        name: str = pipelined_name(module)
        try:
            context.embedding_a2a_requests[name] = module.compute_and_output_dist(module_ctx, kjt)
        except Exception as error:  # noqa: BLE001 - raised again by the module's forward
            if not defer_errors:
                raise
            context.lookup_errors[name] = error
