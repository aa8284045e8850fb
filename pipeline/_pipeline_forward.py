"""The pipelined forward installed on each sharded module by the fused pipeline.

``FusedLookupPipelinedForward`` replaces a sharded module's ``forward`` (through
torchrec's ``_rewrite_model`` extension point, ``_pipelined_forward_type``). The
embedding lookup and output all-to-all of its batch were already issued by the
pipeline during the previous step; the forward only hands the in-flight
output-dist awaitable to the model, lazily, with its wait timed.

It differs from torchrec's ``InSyncEmbeddingPipelinedForward`` in three ways:
its device is the pipeline's (torchrec's defaults to cuda when there is no
stream, which fails on CPU); on CUDA it waits on the event recorded on the
*lookup* stream (not only the data-dist stream) and registers the consumer
stream on the results; on CPU it makes no stream call at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.profiler import record_function
from torchrec.distributed.model_parallel import ShardedModule
from torchrec.distributed.train_pipeline.pipeline_context import EmbeddingTrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import InSyncEmbeddingPipelinedForward
from torchrec.distributed.train_pipeline.types import CallArgs
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

from recpipe.pipeline._pipeline_stats import PipelineStageStats, time_awaitable_tree


@dataclass
class FusedLookupPipelineContext(EmbeddingTrainPipelineContext):
    """Per-batch context of ``TrainPipelineFusedSparseDist``.

    Adds to torchrec's ``EmbeddingTrainPipelineContext`` whether this batch's
    lookup has been issued, in which grad/train mode, and (CUDA only) the events
    recorded on the lookup stream after each module's lookup and output-dist
    launch.
    """

    lookup_started: bool = False
    """True once every pipelined module's lookup for this batch was issued."""

    lookup_events: Dict[str, torch.Event] = field(default_factory=dict)
    """Module name -> event on the lookup stream after its lookup (CUDA only)."""

    lookup_mode: Optional[Tuple[bool, bool]] = None
    """(grad enabled, model.training) when the lookup was issued: a step run in
    another mode (``model.train()`` / ``eval()`` or ``torch.no_grad()`` toggled
    between steps) looks its batch up again, as torchrec's forward would."""

    lookup_counters: Dict[str, List[Tuple[Any, Any]]] = field(default_factory=dict)
    """Module name -> the counters of its fbgemm TBEs ((step, iter)) and fbgemm-backed
    tiered shards before and after the lookup (``train_pipeline.lookup_counter_sources``):
    a discarded lookup takes its increments back (Adam's bias correction counts
    lookups)."""

    lookup_inputs: Dict[str, Tuple[Any, ...]] = field(default_factory=dict)
    """Module name -> what its lookup read besides the batch: the tables' write
    version and the fused optimizers' hyper-parameters (fbgemm's TBE takes the
    learning rate its backward applies at lookup time). A module whose tables
    were written since (``load_state_dict``, in-place edits) or whose fused
    learning rate changed (an LR scheduler stepped between two ``progress()``
    calls) is looked up again."""


def record_on_stream(result: Any, stream: torch.Stream) -> None:
    """Registers an embedding result with the caching allocator of ``stream``.

    Args:
        result (Any): ``KeyedTensor``, ``Dict[str, JaggedTensor]``, ``JaggedTensor``,
            tensor, or a tuple/list of those (managed-collision modules).
        stream (torch.Stream): the consuming CUDA stream (never a CPU stream).
    """
    if result is None:
        return
    if isinstance(result, (torch.Tensor, KeyedTensor, JaggedTensor)):
        result.record_stream(stream)
    elif isinstance(result, dict):
        for v in result.values():
            record_on_stream(v, stream)
    elif isinstance(result, (tuple, list)):
        for v in result:
            record_on_stream(v, stream)
    elif hasattr(result, "record_stream"):
        result.record_stream(stream)


class FusedLookupPipelinedForward(InSyncEmbeddingPipelinedForward):
    """Hands the already-issued output-dist awaitable of its batch to the model.

    Args:
        name (str): fully qualified name of the sharded module.
        args (CallArgs): how to rebuild the module's inputs from the batch.
        module (ShardedModule): the sharded module.
        context (EmbeddingTrainPipelineContext): the context of the batch in forward.
        stream (Optional[torch.Stream]): the data-dist stream (None on CPU).

    Example::

        # installed by TrainPipelineFusedSparseDist through torchrec's _rewrite_model;
        # afterwards the pipeline calls bind(...) with its stats and device.
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

    def bind(self, stats: PipelineStageStats, device: torch.device) -> None:
        """Attaches the pipeline's stage stats and device.

        Args:
            stats (PipelineStageStats): accumulator for the output-dist wait.
            device (torch.device): the pipeline's device.
        """
        self._stats = stats
        self._device = device

    def _uses_streams(self) -> bool:
        return self._stream is not None and self._device.type in ("cuda", "mtia")

    def __call__(self, *input: Any, **kwargs: Any) -> Any:
        context = self._context
        if self._name not in context.embedding_a2a_requests:
            raise RuntimeError(
                f"TrainPipelineFusedSparseDist: the embedding lookup of module {self._name!r} "
                f"was not issued for batch {context.index} (issued for: "
                f"{sorted(context.embedding_a2a_requests)}). Each pipelined embedding module "
                "may be called once per forward; call the model only through "
                "pipeline.progress()."
            )
        context.module_contexts.pop(self._name, None)
        awaitable = context.embedding_a2a_requests.pop(self._name)
        on_ready = None
        if self._uses_streams():
            dev = torch.get_device_module(self._device)
            cur = dev.current_stream()
            lookup_event = (
                context.lookup_events.pop(self._name, None)
                if isinstance(context, FusedLookupPipelineContext)
                else None
            )
            with record_function(f"## wait_embedding_lookup {self._name} {context.index} ##"):
                if lookup_event is not None:
                    cur.wait_event(lookup_event)
                else:
                    cur.wait_stream(self._stream)

            def on_ready(result: Any, _cur: torch.Stream = cur) -> None:
                record_on_stream(result, _cur)

        return time_awaitable_tree(
            awaitable,
            self._stats,
            f"## output_dist_wait {self._name} {context.index} ##",
            on_ready,
        )
