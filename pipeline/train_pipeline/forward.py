"""The pipelined forward installed on each sharded module by the fused, semi-sync and eval pipelines.

``FusedLookupPipelinedForward`` (installed through torchrec's ``_pipelined_forward_type``)
hands the model the output-dist awaitable the pipeline issued during the previous step,
lazily, with its wait timed. Unlike torchrec's ``InSyncEmbeddingPipelinedForward``, its
device is the pipeline's (torchrec's defaults to cuda without a stream, which fails on
CPU), on CUDA it waits on the lookup stream's event, and on CPU it makes no stream call.
Owns it, ``PipelinedLookupUnavailableError`` and ``record_on_stream``. Imports train modules.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch.profiler import record_function
from torchrec.distributed.model_parallel import ShardedModule
from torchrec.distributed.train_pipeline.pipeline_context import EmbeddingTrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import InSyncEmbeddingPipelinedForward
from torchrec.distributed.train_pipeline.types import CallArgs

from recpipe.pipeline.train_pipeline.context import FusedLookupPipelineContext
from recpipe.pipeline.train_pipeline.stats import PipelineStageStats, time_awaitable_tree
from recpipe.pipeline.train_pipeline.streams import STREAM_DEVICE_TYPES


class PipelinedLookupUnavailableError(RuntimeError, AssertionError):
    """A pipelined embedding module found no lookup (or input dist) for the batch in forward.

    Also an ``AssertionError``, as torchrec's ``PipelinedForward`` raises in the same
    situations, so code written against torchrec's pipeline catches it unchanged.
    """


def record_on_stream(result: Any, stream: torch.Stream) -> None:
    """Registers an embedding result (tensor, KT, JT, or a dict / tuple / list of them)
    with the caching allocator of the consuming CUDA ``stream``."""
    if isinstance(result, (dict, tuple, list)):
        for v in result.values() if isinstance(result, dict) else result:
            record_on_stream(v, stream)
    elif hasattr(result, "record_stream"):  # tensors, KeyedTensor, JaggedTensor
        result.record_stream(stream)


class FusedLookupPipelinedForward(InSyncEmbeddingPipelinedForward):
    """Hands the already-issued output-dist awaitable of its batch to the model.

    Args: as torchrec's ``InSyncEmbeddingPipelinedForward`` (``stream``: the data-dist
    stream, None on CPU).
    """

    def __init__(
        self,
        name: str,
        args: CallArgs,
        module: ShardedModule,
        context: EmbeddingTrainPipelineContext,
        stream: Optional[torch.Stream] = None,
    ) -> None:
        super().__init__(name, args, module, context, stream)
        # torchrec's BaseForward defaults the device to cuda without a stream;
        # without a stream we are on a stream-less device (CPU).
        self._device = stream.device if stream is not None else torch.device("cpu")
        self._stats: Optional[PipelineStageStats] = None
        self._lookup: Optional[Callable[[ShardedModule, FusedLookupPipelineContext], None]] = None
        self._who = type(self).__name__  # the pipeline its errors name, once bound

    def bind(
        self,
        stats: PipelineStageStats,
        device: torch.device,
        lookup: Callable[[ShardedModule, FusedLookupPipelineContext], None],
        who: str,
    ) -> None:
        """Attaches the pipeline's stage stats (output-dist wait), device and lookup, run by the
        forward for a module in the context's ``deferred_lookups`` (its exceptions propagate),
        and ``who``, the pipeline's class name, which its errors name."""
        self._stats = stats
        self._device = device
        self._lookup = lookup
        self._who = who

    def __call__(self, *input: Any, **kwargs: Any) -> Any:
        context = self._context
        if isinstance(context, FusedLookupPipelineContext):
            context.forward_started = True
            error = context.lookup_errors.pop(self._name, None)
            if error is not None:
                # torchrec's forward runs this lookup here and raises (its input dist consumed)
                context.module_contexts.pop(self._name, None)
                raise error
            if self._name in context.deferred_lookups and self._lookup is not None:
                context.deferred_lookups.discard(self._name)
                self._lookup(self._module, context)
        if self._name not in context.embedding_a2a_requests:
            raise PipelinedLookupUnavailableError(
                f"{self._who}: the embedding lookup of module {self._name!r} "
                f"is not available for batch {context.index} (available for: "
                f"{sorted(context.embedding_a2a_requests)}): it was consumed already. Either the "
                "model's forward calls this module more than once (each pipelined embedding "
                "module may be called once per forward: call it once and reuse its output), or "
                "the model was called outside pipeline.progress(), or an earlier progress() "
                "raised after its forward had called this module and progress() is being "
                "retried on the same batch (torchrec's TrainPipelineSparseDist cannot rerun "
                "that batch either: call pipeline.reset() to drop the in-flight batches, "
                "then continue with progress())."
            )
        context.module_contexts.pop(self._name, None)
        awaitable = context.embedding_a2a_requests.pop(self._name)
        on_ready = None
        if self._stream is not None and self._device.type in STREAM_DEVICE_TYPES:
            dev = torch.get_device_module(self._device)
            cur = dev.current_stream()
            lookup_event = (
                context.lookup_events.pop(self._name, None) if isinstance(context, FusedLookupPipelineContext) else None
            )
            with record_function(f"## wait_embedding_lookup {self._name} {context.index} ##"):
                if lookup_event is not None:
                    cur.wait_event(lookup_event)
                else:
                    cur.wait_stream(self._stream)
            on_ready = functools.partial(record_on_stream, stream=cur)

        return time_awaitable_tree(
            awaitable, self._stats, f"## output_dist_wait {self._name} {context.index} ##", on_ready
        )
