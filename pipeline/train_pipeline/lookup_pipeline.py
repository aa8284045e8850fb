"""What the fused, semi-sync and eval pipelines share: torchrec's ``TrainPipelineSparseDist`` with
recpipe's lookup collaborators (``lookup``, ``take_back``, ``relookup``, ``streams``, ``forward``)
built, bound to the pipelined modules on attach, and driven through one ``progress()`` frame.

``FusedLookupPipelineBase`` owns the collaborators and their binding (all three pipelines);
``FusedLookupTrainPipelineBase`` adds the training frame (attach / reset / progress, batch i's
lookup at the start of its step, the stages every training step shares). Each pipeline module
keeps only its own schedule (``_step``) and its context check (``_context_at``).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Type

import torch
from torch.profiler import record_function
from torchrec.distributed.model_parallel import ShardedModule
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.types import PipelineState

from recpipe.pipeline.train_pipeline.context import FusedLookupPipelineContext, pipelined_name
from recpipe.pipeline.train_pipeline.forward import FusedLookupPipelinedForward
from recpipe.pipeline.train_pipeline.lookup import LookupIssuer
from recpipe.pipeline.train_pipeline.relookup import LookupInputs, lookup_mode
from recpipe.pipeline.train_pipeline.stats import STAGE_LOOKUP, STAGE_OPTIMIZER, PipelineStageStats, StageTimer
from recpipe.pipeline.train_pipeline.streams import LookupStreams
from recpipe.pipeline.train_pipeline.take_back import LookupTakeBack, fused_tbes

__all__ = ["FusedLookupPipelineBase", "FusedLookupTrainPipelineBase", "check_bool_flags", "check_device"]


def check_device(who: str, device: Any) -> None:
    """Refuses a ``device`` that is not a ``torch.device``.

    Raises:
        TypeError: naming ``who`` and the ``torch.device(...)`` to pass instead.
    """
    if not isinstance(device, torch.device):
        raise TypeError(
            f"{who}: device must be a torch.device, got {type(device).__name__} {device!r}; "
            f"pass torch.device({str(device)!r})."
        )


def check_bool_flags(who: str, flags: Dict[str, Any], none_allowed: bool = True) -> None:
    """Refuses a flag of ``flags`` (argument name -> value) that is not a bool.

    Args:
        who (str): the pipeline named in the message.
        flags (Dict[str, Any]): the constructor's bool arguments.
        none_allowed (bool): None means "not given" and is accepted.

    Raises:
        TypeError: naming the argument and the value's type.
    """
    for arg, value in flags.items():
        if not (none_allowed and value is None) and not isinstance(value, bool):
            raise TypeError(f"{who}: {arg} must be a bool, got {type(value).__name__} {value!r}.")


class FusedLookupPipelineBase(TrainPipelineSparseDist[Any, Any]):
    """torchrec's sparse-dist pipeline with recpipe's lookup collaborators, bound on attach.

    A subclass calls :meth:`_init_lookup_parts` after torchrec's constructor and may override the
    hooks :meth:`_check_pipelined` (may refuse the pipelined modules with an exception listed in
    ``_refused_model_errors``) and :meth:`_on_pipelined` (more bindings).
    """

    _pipelined_forward_type = FusedLookupPipelinedForward
    _refused_model_errors: Tuple[Type[Exception], ...] = ()
    """Exceptions of ``_check_pipelined`` after which the model is detached before they propagate."""
    _in_forward_label: str = "embedding_lookup_in_forward"
    """Profiler label of a lookup run inside the forward (``_lookup_in_forward``)."""

    stats: PipelineStageStats
    """Per-stage host seconds (lookup issue, output-dist wait, optimizer)."""

    def _init_lookup_parts(self, device: torch.device, emb_lookup_stream: str, inputs: LookupInputs) -> None:
        """Builds the stage stats, streams, take-back and lookup issuer (after torchrec's ``__init__``,
        which creates the data-dist stream).

        Args:
            device (torch.device): the compute device.
            emb_lookup_stream (str): ``'new'``, ``'data_dist'`` or ``'current'`` (``LookupStreams``).
            inputs (LookupInputs): what each lookup records besides the batch.
        """
        self.stats = PipelineStageStats()
        self._streams = LookupStreams(device, self._data_dist_stream, emb_lookup_stream)
        self._inputs = inputs
        self._take_back = LookupTakeBack(self._streams, self.stats)
        self._lookups = LookupIssuer(self._streams, self._take_back, self._inputs, type(self).__name__)

    def _pipeline_model(
        self,
        batch: Optional[Any],
        context: TrainPipelineContext,
        pipelined_forward: Type[PipelinedForward] = PipelinedForward,
    ) -> None:
        """Rewrites the model (torchrec), then checks and binds the pipelined modules; the model
        is detached before an exception of ``_refused_model_errors`` propagates."""
        super()._pipeline_model(batch, context, pipelined_forward)
        modules = {pipelined_name(m): m for m in self._pipelined_modules}
        try:
            self._check_pipelined(modules)
        except self._refused_model_errors:
            self.detach()
            raise
        tbes = {name: fused_tbes(module) for name, module in modules.items()}
        tiered_shards = {
            name: list(module.tiered_tables().values())
            for name, module in modules.items()
            if callable(getattr(module, "tiered_tables", None))
        }
        self._inputs.bind(tbes, tiered_shards)
        self._take_back.bind(modules, tbes, tiered_shards)
        for module in self._pipelined_modules:
            forward = module.forward
            if isinstance(forward, FusedLookupPipelinedForward):
                forward.bind(self.stats, self._device, self._lookup_in_forward, type(self).__name__)
        self._on_pipelined(modules, tiered_shards)

    def _check_pipelined(self, modules: Dict[str, torch.nn.Module]) -> None:
        """Hook: validates (and sorts) the pipelined modules by name; accepts every module here."""

    def _on_pipelined(self, modules: Dict[str, torch.nn.Module], tiered_shards: Dict[str, List[Any]]) -> None:
        """Hook: binds what else reads the pipelined modules and their tiered shards; nothing here."""

    def detach(self) -> torch.nn.Module:
        """Gives back the original model (torchrec); on CUDA the default stream first waits for
        the lookup stream, so a write to the detached model's tables cannot race it. The
        in-flight batches and their lookups are kept."""
        self._streams.main_waits_for_lookups()
        return super().detach()

    def _lookup_in_forward(self, module: ShardedModule, context: FusedLookupPipelineContext) -> None:
        """Looks a deferred ``module`` up inside the forward; its exceptions propagate."""
        with StageTimer(self.stats, STAGE_LOOKUP, f"## {self._in_forward_label} {context.index} ##"):
            self._lookups.issue(module, context, self._streams.main_stream_event(), defer_errors=False)


class FusedLookupTrainPipelineBase(FusedLookupPipelineBase):
    """The training frame the fused and semi-sync pipelines share around their own schedule.

    A subclass implements :meth:`_context_at` (its context type check), :meth:`_step` (the stages
    of one ``progress()``), :meth:`_lookup_is_stale` and :meth:`_lookup_at_step_start` (how batch
    i's own lookup is judged and issued at the start of its step).
    """

    @abstractmethod
    def _context_at(self, position: int) -> FusedLookupPipelineContext:
        """``self.contexts[position]``; ``TypeError`` unless it is this pipeline's context type."""

    @abstractmethod
    def _step(self, dataloader_iter: Iterator[Any], current: Any) -> Any:
        """The stages of one ``progress()`` call on batch i (``current``); returns the model's output."""

    @abstractmethod
    def _lookup_is_stale(self, current: Any) -> bool:
        """Whether batch i's issued lookup must be issued again (its forward has not started)."""

    @abstractmethod
    def _lookup_at_step_start(self, current: Any) -> None:
        """Issues every pipelined module's lookup of batch i (its input dist waited)."""

    def attach(self, model: Optional[torch.nn.Module] = None, sparse_dist: bool = True) -> None:
        """Re-attaches the model (torchrec), discarding the in-flight batch's lookup issued
        before ``detach()`` (the tables may have changed); the next ``progress()`` reissues it.

        With ``sparse_dist=True`` torchrec restarts the batch's input dist and the next
        ``progress()`` finishes it (keeping the old one breaks a sequence EC's output
        all-to-all); with False the old input dist is kept unless the lookup consumed it.
        A batch whose forward started in a ``progress()`` that raised keeps its state.
        """
        super().attach(model, sparse_dist)
        if self.contexts and not self._context_at(0).forward_started:
            self._take_back.drop_issued_lookup(self._context_at(0), input_dist_restarted=sparse_dist)

    def reset(self) -> None:
        """Drops the in-flight batches (torchrec), first taking back their unconsumed lookups."""
        for context in self.contexts:
            if isinstance(context, FusedLookupPipelineContext):
                self._take_back.drop_issued_lookup(context, input_dist_restarted=False, relookup=False)
        super().reset()

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Runs one training step of batch i; returns the model's output.

        After a step that raised, the lookups issued for batches whose forward had not started are
        taken back (TBE and tiered counters, dynamic inserts) and issued again when needed.

        Raises:
            StopIteration: when every batch has been processed.
            TypeError: a queued context is not of this pipeline's context type.
        """
        self._state = PipelineState.IDLE
        if not self._model_attached:
            self.attach(self._model)
        self.fill_pipeline(dataloader_iter)
        if not self.batches:
            raise StopIteration
        current = self._context_at(0)
        for position in range(1, len(self.contexts)):
            self._context_at(position)
        try:
            return self._step(dataloader_iter, current)
        except Exception:
            self._take_back.after_failure(self.contexts)
            raise

    def _issue_lookups(
        self,
        context: FusedLookupPipelineContext,
        modules: Sequence[ShardedModule],
        label: str,
        tables_updated: Optional[torch.Event] = None,
        after_opt_modules: Optional[Set[str]] = None,
    ) -> None:
        """Issues the lookups and output all-to-alls of ``modules`` for ``context``'s batch (its
        input dist waited), profiled as ``label``; on CUDA the modules not in ``after_opt_modules``
        wait only for ``tables_updated`` (None: an event of the default stream recorded now)."""
        if not modules:
            return
        context.lookup_mode = lookup_mode(self._model)
        with StageTimer(self.stats, STAGE_LOOKUP, f"## {label} {context.index} ##"):
            self._lookups.issue_all(modules, context, tables_updated, after_opt_modules or set())

    def _ensure_lookup(self, current: FusedLookupPipelineContext) -> None:
        """Issues batch i's lookup if none was issued or it is stale; never for a batch whose
        forward already ran (torchrec's retried forward fails on its consumed input dist)."""
        if current.lookup_started and not current.forward_started and self._lookup_is_stale(current):
            self._take_back.drop_issued_lookup(current, input_dist_restarted=False)
        if not current.lookup_started:
            self._finish_input_dist(current, self.batches[0])
            self._lookup_at_step_start(current)
            current.lookup_started = True

    def _finish_input_dist(self, context: FusedLookupPipelineContext, batch: Any) -> None:
        """After ``attach()`` or a failure: waits the input dist torchrec restarted, or restarts it."""
        names = [pipelined_name(m) for m in self._pipelined_modules]
        if all(n in context.input_dist_tensors_requests for n in names):
            return
        if not context.fused_splits_awaitables:
            self.start_sparse_data_dist(batch, context)
        self.wait_sparse_data_dist(context)

    def _begin_step(self, current: FusedLookupPipelineContext) -> None:
        """The first stage of batch i's step: its module context and, training, ``zero_grad``."""
        self._set_module_context(current)
        if self._model.training:
            # torchrec's fused optimizers hand the learning rate to the TBEs here, before the lookup
            with record_function("## zero_grad ##"):
                self._optimizer.zero_grad()

    def _wait_for_current(self, current: FusedLookupPipelineContext) -> None:
        """Waits batch i's copy to the device; drops its input-dist inputs (``clear_data_dist_inputs``)."""
        self._wait_for_batch()
        if self._clear_data_dist_inputs:
            self.clear_sparse_data_dist_inputs(current)

    def _enqueue_before_forward(self, dataloader_iter: Iterator[Any], current: FusedLookupPipelineContext) -> None:
        """Loads the last queued batch before batch i's forward; on ``StopIteration`` (before the
        forward, where torchrec's pipeline ends without looking batch i up) takes batch i's lookup back."""
        try:
            self.enqueue_batch(dataloader_iter)
        except StopIteration:
            self._take_back.drop_issued_lookup(current, input_dist_restarted=False, relookup=False)
            raise

    def _forward(self, current: FusedLookupPipelineContext) -> Tuple[torch.Tensor, Any]:
        """Batch i's forward; returns the model's ``(losses, output)``."""
        with record_function(f"## forward {current.index} ##"):
            self._state = PipelineState.CALL_FWD
            return self._model_fwd(self.batches[0])

    def _backward_and_sync(self, losses: torch.Tensor, current: FusedLookupPipelineContext) -> None:
        """Batch i's backward (its fused tables are updated) and torchrec's embedding sync."""
        self._state = PipelineState.CALL_BWD
        self._backward(losses)
        self.sync_embeddings(self._model, self._dmp_collection_sync_interval_batches, current)

    def _optimizer_step(self) -> None:
        """The dense optimizer step of batch i, timed as ``STAGE_OPTIMIZER``."""
        with StageTimer(self.stats, STAGE_OPTIMIZER, f"## optimizer {self.contexts[0].index} ##"):
            self._optimizer.step()

    def _end_step(self, output: Any) -> Any:
        """Counts the step and dequeues batch i; returns ``output``."""
        self.stats.steps += 1
        self.dequeue_batch()
        return output
