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
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch.profiler import record_function
from torchrec.distributed.model_parallel import ShardedModule
from torchrec.distributed.train_pipeline.pipeline_context import EmbeddingTrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import InSyncEmbeddingPipelinedForward
from torchrec.distributed.train_pipeline.types import CallArgs
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

from recpipe.pipeline.train.stats import PipelineStageStats, time_awaitable_tree


class PipelinedLookupUnavailableError(RuntimeError, AssertionError):
    """A pipelined embedding module found no lookup (or input dist) for the batch in forward.

    torchrec's ``PipelinedForward`` raises an ``AssertionError`` in the same
    situations (a module called twice in one forward; a ``progress()`` retried
    after a step that raised once its forward had called the module), so this
    error is both a ``RuntimeError`` and an ``AssertionError``: code written
    against torchrec's pipeline catches it unchanged.
    """


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

    lookup_errors: Dict[str, Exception] = field(default_factory=dict)
    """Module name -> the exception its lookup raised (e.g. an id out of range with
    fbgemm's ``BoundsCheckMode.FATAL``). torchrec looks a batch up inside its
    forward, so the exception is raised when the forward calls the module, in the
    ``progress()`` of this batch, not in the one that issued the lookup early."""

    deferred_lookups: Set[str] = field(default_factory=set)
    """Modules whose lookup was not issued because an earlier lookup of this batch
    raised (``lookup_errors``): looked up inside the forward, as torchrec's pipeline
    does, if the forward calls them before the module whose lookup raised (no
    collective runs that torchrec's pipeline would not run)."""

    forward_started: bool = False
    """True once the forward called a pipelined module for this batch: its
    lookups are being consumed, so a retried ``progress()`` on this batch fails on
    a consumed module as torchrec's does instead of looking it up again."""


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
        self._lookup: Optional[Callable[[ShardedModule, FusedLookupPipelineContext], None]] = None

    def bind(self, stats: PipelineStageStats, device: torch.device) -> None:
        """Attaches the pipeline's stage stats and device.

        Args:
            stats (PipelineStageStats): accumulator for the output-dist wait.
            device (torch.device): the pipeline's device.
        """
        self._stats = stats
        self._device = device

    def bind_lookup(self, lookup: Callable[[ShardedModule, "FusedLookupPipelineContext"], None]) -> None:
        """Attaches the pipeline's lookup, run by the forward for a module in the
        context's ``deferred_lookups`` (its exceptions propagate from the forward).

        Args:
            lookup (Callable): issues the module's lookup into the context.
        """
        self._lookup = lookup

    def _uses_streams(self) -> bool:
        return self._stream is not None and self._device.type in ("cuda", "mtia")

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
                f"TrainPipelineFusedSparseDist: the embedding lookup of module {self._name!r} "
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
