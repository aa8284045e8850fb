"""``TrainPipelineFusedSparseDist``: torchrec's sparse-dist pipeline with the next batch's
embedding lookup issued as soon as the fused-TBE backward has updated the tables, so the
lookup and its output all-to-all overlap the dense optimizer step. Exact (bit-identical to
``TrainPipelineSparseDist``) on CUDA and CPU; a drop-in replacement.

Owns the schedule of one step; its collaborators live in the sibling modules (``lookup``,
``take_back``, ``relookup``, ``streams``, ``validation``, ``stats``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Type

import torch
from torch.profiler import record_function
from torchrec.distributed.model_parallel import ShardedModule
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.types import PipelineState

from recpipe.pipeline.train_pipeline.context import FusedLookupPipelineContext, checked_context, pipelined_name
from recpipe.pipeline.train_pipeline.forward import FusedLookupPipelinedForward
from recpipe.pipeline.train_pipeline.lookup import LookupIssuer
from recpipe.pipeline.train_pipeline.lookup_schedule import LookupSchedule, resolve_lookup_schedule
from recpipe.pipeline.train_pipeline.relookup import LookupInputs, lookup_mode
from recpipe.pipeline.train_pipeline.stats import STAGE_LOOKUP, STAGE_OPTIMIZER, PipelineStageStats, StageTimer
from recpipe.pipeline.train_pipeline.streams import LookupStreams
from recpipe.pipeline.train_pipeline.take_back import LookupTakeBack, fused_tbes
from recpipe.pipeline.train_pipeline.validation import FusedLookupExactnessChecker, FusedLookupExactnessError

__all__ = ["TrainPipelineFusedSparseDist"]


def _check_arguments(device: Any, context_type: Any, flags: Dict[str, Any]) -> None:
    """Type-checks the constructor's device, context type and bool flags (None: not given)."""
    if not isinstance(device, torch.device):
        raise TypeError(
            f"TrainPipelineFusedSparseDist: device must be a torch.device, got "
            f"{type(device).__name__} {device!r}; pass torch.device({str(device)!r})."
        )
    if not (isinstance(context_type, type) and issubclass(context_type, FusedLookupPipelineContext)):
        raise TypeError(
            f"TrainPipelineFusedSparseDist: context_type must subclass "
            f"FusedLookupPipelineContext, got {context_type!r}; derive your context from "
            "recpipe.pipeline.train_pipeline.context.FusedLookupPipelineContext."
        )
    for arg, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise TypeError(
                f"TrainPipelineFusedSparseDist: {arg} must be a bool, got {type(value).__name__} {value!r}."
            )


class TrainPipelineFusedSparseDist(TrainPipelineSparseDist[Any, Any]):
    """Sparse-dist train pipeline whose next-batch embedding lookup overlaps the optimizer.

    torchrec's ``TrainPipelineSparseDist`` schedule, except that batch i+1's lookup and
    output all-to-all are issued right after batch i's backward, not in batch i+1's
    forward. Stages (profiler labels) of one ``progress()`` on batch i:

    1. ``zero_grad``  2. ``wait_for_batch i``  3. ``start_sparse_data_dist i+1``
    4. ``copy_batch_to_gpu i+2``
    5. ``forward i``: the first use of an embedding blocks in ``output_dist_wait <module> i``
    6. ``wait_sparse_data_dist i+1``  7. ``backward i``: fused tables are updated
    8. ``start_embedding_lookup i+1``: on CUDA on the lookup stream, after an event of the
       default stream; before or after 9. ``optimizer i`` (``embedding_lookup_after_opt``)

    A batch with no issued lookup (the first, or after ``reset()``) is looked up at the
    start of its step; in eval mode batch i+1's lookup follows stage 6. A stale lookup
    (``relookup``) is issued again after stage 1 and counted in ``stats.relookups``; a
    lookup torchrec's pipeline would not have run is taken back (``take_back``). On CPU
    gloo's worker thread carries the all-to-all while the main thread runs the optimizer
    (``embedding_lookup_after_opt=False``) or the next step's input dist and forward.
    With ``embedding_lookup_after_data_dist=True`` (torchrec's schedule) stage 8 is skipped
    and batch i's lookup is issued between stages 4 and 5.

    torchrec's own ``TrainPipelineFusedSparseDist`` arguments are accepted by keyword with
    torchrec's meaning (docs/pipeline.md has the table); the resolved schedule is
    :attr:`lookup_schedule`.

    Args:
        context_type (Type[TrainPipelineContext]): must subclass ``FusedLookupPipelineContext``.
        use_emb_lookup_stream (Optional[bool]): True: a dedicated lookup stream (its own
            caching-allocator pool: more memory); False (default): the data-dist stream.
        embedding_lookup_after_opt (Optional[bool]): True (default): issue batch i+1's lookup
            right after batch i's optimizer step; False: right after its backward.
        emb_lookup_stream (Optional[str]): torchrec's ``'new'`` (= ``use_emb_lookup_stream=
            True``), ``'data_dist'`` (= False) or ``'current'`` (the stream current when the
            pipeline is built: no overlap on CUDA).
        embedding_lookup_after_data_dist (Optional[bool]): torchrec's; False is
            ``embedding_lookup_after_opt=True``, True issues batch i's lookup after batch
            i+1's input dist has started. On CPU the stream arguments select nothing (there
            are no streams); the issue point applies on every device.
        allow_dense_tables (bool): accept tables updated by the dense optimizer and
            feature processors; those modules' lookups are ordered after the optimizer.
        others: as torchrec's ``TrainPipelineSparseDist``.

    Raises:
        TypeError: a flag that is not a bool (or None).
        ValueError: ``emb_lookup_stream`` outside ``'new'`` / ``'current'`` / ``'data_dist'``, or
            a recpipe flag contradicting its torchrec counterpart.
        FusedLookupExactnessError: on attach, a feature processor or dense-updated table
            without ``allow_dense_tables``.
    """

    _pipelined_forward_type = FusedLookupPipelinedForward

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: Type[TrainPipelineContext] = FusedLookupPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Optional[Callable[[Optional[Any]], Tuple[torch.Tensor, Any]]] = None,
        dmp_collection_sync_interval_batches: Optional[int] = 1,
        enqueue_batch_after_forward: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        async_inplace_copy: bool = False,
        *,
        use_emb_lookup_stream: Optional[bool] = None,
        embedding_lookup_after_opt: Optional[bool] = None,
        allow_dense_tables: bool = False,
        emb_lookup_stream: Optional[str] = None,
        embedding_lookup_after_data_dist: Optional[bool] = None,
    ) -> None:
        _check_arguments(
            device,
            context_type,
            {
                "use_emb_lookup_stream": use_emb_lookup_stream,
                "embedding_lookup_after_opt": embedding_lookup_after_opt,
                "embedding_lookup_after_data_dist": embedding_lookup_after_data_dist,
                "allow_dense_tables": allow_dense_tables,
            },
        )
        self._schedule: LookupSchedule = resolve_lookup_schedule(
            use_emb_lookup_stream=use_emb_lookup_stream,
            embedding_lookup_after_opt=embedding_lookup_after_opt,
            emb_lookup_stream=emb_lookup_stream,
            embedding_lookup_after_data_dist=embedding_lookup_after_data_dist,
        )
        super().__init__(
            model=model,
            optimizer=optimizer,
            device=device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            context_type=context_type,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            dmp_collection_sync_interval_batches=dmp_collection_sync_interval_batches,
            enqueue_batch_after_forward=enqueue_batch_after_forward,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            async_inplace_copy=async_inplace_copy,
        )
        self._checker = FusedLookupExactnessChecker(allow_dense_tables=allow_dense_tables)
        self._after_opt_modules: Set[str] = set()
        self.stats = PipelineStageStats()
        """Per-stage host seconds (lookup issue, output-dist wait, optimizer)."""
        self._streams = LookupStreams(device, self._data_dist_stream, self._schedule.emb_lookup_stream)
        self._inputs = LookupInputs()
        self._take_back = LookupTakeBack(self._streams, self.stats)
        self._lookups = LookupIssuer(self._streams, self._take_back, self._inputs)

    def _pipeline_model(
        self,
        batch: Optional[Any],
        context: TrainPipelineContext,
        pipelined_forward: Type[PipelinedForward] = PipelinedForward,
    ) -> None:
        """Rewrites the model (torchrec), then validates and binds the pipelined modules; the
        model is detached before ``FusedLookupExactnessError`` propagates."""
        super()._pipeline_model(batch, context, pipelined_forward)
        modules = {pipelined_name(m): m for m in self._pipelined_modules}
        try:
            after_opt = self._checker.check(modules)
        except FusedLookupExactnessError:
            self.detach()
            raise
        self._after_opt_modules = set(after_opt)
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
                forward.bind(self.stats, self._device, self._lookup_in_forward)

    def attach(self, model: Optional[torch.nn.Module] = None, sparse_dist: bool = True) -> None:
        """Re-attaches the model (torchrec), discarding the in-flight batch's lookup issued
        before ``detach()`` (the tables may have changed); the next ``progress()`` reissues it.

        With ``sparse_dist=True`` torchrec restarts the batch's input dist and the next
        ``progress()`` finishes it (keeping the old one breaks a sequence EC's output
        all-to-all); with False the old input dist is kept unless the lookup consumed it.
        A batch whose forward started in a ``progress()`` that raised keeps its state.
        """
        super().attach(model, sparse_dist)
        if self.contexts and not self._fused_context(0).forward_started:
            self._take_back.drop_issued_lookup(self._fused_context(0), input_dist_restarted=sparse_dist)

    def detach(self) -> torch.nn.Module:
        """Gives back the original model (torchrec); on CUDA the default stream first waits
        for the lookup stream, so a write to the detached model's tables cannot race it."""
        self._streams.main_waits_for_lookups()
        return super().detach()

    def reset(self) -> None:
        """Drops the in-flight batches (torchrec), first taking back their unconsumed lookups."""
        for context in self.contexts:
            if isinstance(context, FusedLookupPipelineContext):
                self._take_back.drop_issued_lookup(context, input_dist_restarted=False, relookup=False)
        super().reset()

    @property
    def lookup_schedule(self) -> LookupSchedule:
        """The stream and issue point the constructor's recpipe / torchrec arguments resolved to."""
        return self._schedule

    @property
    def after_optimizer_modules(self) -> Sequence[str]:
        """Pipelined modules whose lookup is ordered after the optimizer step (known on attach)."""
        return sorted(self._after_opt_modules)

    def _fused_context(self, position: int) -> FusedLookupPipelineContext:
        return checked_context(self.contexts, position, self._context_type)

    def start_embedding_lookup(
        self,
        context: FusedLookupPipelineContext,
        modules: Sequence[ShardedModule],
        tables_updated: Optional[torch.Event] = None,
    ) -> None:
        """Issues the lookup and output all-to-all of ``modules`` for ``context``'s batch (its
        input dist waited). On CUDA, modules not in ``after_optimizer_modules`` wait only for
        ``tables_updated`` (the previous backward; None: an event recorded now), so their
        lookup overlaps the optimizer."""
        if not modules:
            return
        context.lookup_mode = lookup_mode(self._model)
        with StageTimer(self.stats, STAGE_LOOKUP, f"## start_embedding_lookup {context.index} ##"):
            self._lookups.issue_all(modules, context, tables_updated, self._after_opt_modules)

    def _lookup_in_forward(self, module: ShardedModule, context: FusedLookupPipelineContext) -> None:
        """Looks a deferred ``module`` up inside the forward; its exceptions propagate."""
        with StageTimer(self.stats, STAGE_LOOKUP, f"## embedding_lookup_in_forward {context.index} ##"):
            self._lookups.issue(module, context, self._streams.main_stream_event(), defer_errors=False)

    def _split_modules(self) -> Tuple[List[ShardedModule], List[ShardedModule]]:
        """(modules looked up after backward, modules looked up after the optimizer)."""
        early: List[ShardedModule] = []
        late: List[ShardedModule] = []
        for m in self._pipelined_modules:
            name: str = pipelined_name(m)
            after_opt = self._schedule.embedding_lookup_after_opt or name in self._after_opt_modules
            (late if after_opt else early).append(m)
        return early, late

    def _ensure_lookup(self, current: FusedLookupPipelineContext) -> None:
        """Issues batch i's lookup if none was issued or it is stale; never for a batch whose
        forward already ran (torchrec's retried forward fails on its consumed input dist)."""
        if current.lookup_started and not current.forward_started:
            reason = self._inputs.stale_reason(current, self._pipelined_modules, lookup_mode(self._model))
            self._inputs.note(reason, stacklevel=3)  # the warning points at progress()
            if reason is not None:
                self._take_back.drop_issued_lookup(current, input_dist_restarted=False)
        if not current.lookup_started:
            self._finish_input_dist(current, self.batches[0])
            self.start_embedding_lookup(current, self._pipelined_modules)
            current.lookup_started = True

    def _finish_input_dist(self, context: FusedLookupPipelineContext, batch: Any) -> None:
        """After ``attach()``: waits the input dist torchrec restarted, or restarts it."""
        names = [pipelined_name(m) for m in self._pipelined_modules]
        if all(n in context.input_dist_tensors_requests for n in names):
            return
        if not context.fused_splits_awaitables:
            self.start_sparse_data_dist(batch, context)
        self.wait_sparse_data_dist(context)

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Runs one training step of batch i; returns the model's output.

        Raises:
            StopIteration: when every batch has been processed.
            TypeError: a queued context is not a ``FusedLookupPipelineContext``.
        """
        self._state = PipelineState.IDLE
        if not self._model_attached:
            self.attach(self._model)
        self.fill_pipeline(dataloader_iter)
        if not self.batches:
            raise StopIteration

        current = self._fused_context(0)
        for position in range(1, len(self.contexts)):
            self._fused_context(position)
        try:
            return self._step(dataloader_iter, current)
        except Exception:
            self._take_back.after_failure(self.contexts)
            raise

    def _step(self, dataloader_iter: Iterator[Any], current: FusedLookupPipelineContext) -> Any:
        """The stages of one ``progress()`` call."""
        self._set_module_context(current)
        if self._model.training:
            # torchrec's fused optimizers hand the learning rate to the TBEs here, before the lookup
            with record_function("## zero_grad ##"):
                self._optimizer.zero_grad()
        after_data_dist = self._schedule.embedding_lookup_after_data_dist
        if not after_data_dist:
            self._ensure_lookup(current)
        self._wait_for_batch()
        if self._clear_data_dist_inputs:
            self.clear_sparse_data_dist_inputs(current)
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])
        if not self._enqueue_batch_after_forward:
            self._enqueue_before_forward(dataloader_iter, current)
        if after_data_dist:  # torchrec's embedding_lookup_after_data_dist=True
            self._ensure_lookup(current)
        with record_function(f"## forward {current.index} ##"):
            self._state = PipelineState.CALL_FWD
            losses, output = self._model_fwd(self.batches[0])
        if self._enqueue_batch_after_forward:
            self.enqueue_batch(dataloader_iter)
        nxt = self._wait_next_input_dist()
        if after_data_dist:
            nxt = None  # batch i+1 is looked up in its own step
        if self._model.training:
            self._backward_and_update(losses, current, nxt)
        elif nxt is not None:
            self.start_embedding_lookup(nxt, self._pipelined_modules)
            nxt.lookup_started = True
        self.stats.steps += 1
        self.dequeue_batch()
        return output

    def _enqueue_before_forward(self, dataloader_iter: Iterator[Any], current: FusedLookupPipelineContext) -> None:
        """Loads batch i+2 before batch i's forward; on ``StopIteration`` (before the forward,
        where torchrec's pipeline ends without looking batch i up) takes batch i's lookup back."""
        try:
            self.enqueue_batch(dataloader_iter)
        except StopIteration:
            self._take_back.drop_issued_lookup(current, input_dist_restarted=False, relookup=False)
            raise

    def _wait_next_input_dist(self) -> Optional[FusedLookupPipelineContext]:
        """Stage 6: waits batch i+1's input dist; returns its context (None: no batch i+1)."""
        if len(self.batches) < 2:
            return None
        nxt = self._fused_context(1)
        self._streams.data_dist_waits_for_forward()
        self.wait_sparse_data_dist(nxt)
        return nxt

    def _backward_and_update(
        self, losses: torch.Tensor, current: FusedLookupPipelineContext, nxt: Optional[FusedLookupPipelineContext]
    ) -> None:
        """Stages 7-9: backward, batch i+1's lookup (None: none issued here) and the optimizer step."""
        self._state = PipelineState.CALL_BWD
        self._backward(losses)
        self.sync_embeddings(self._model, self._dmp_collection_sync_interval_batches, current)
        # CUDA: lookups of tables the dense optimizer does not write wait for this event only
        tables_updated = self._streams.main_stream_event()
        early, late = self._split_modules()
        if nxt is not None:
            self.start_embedding_lookup(nxt, early, tables_updated)
        self._optimizer_step()
        if nxt is not None:
            self.start_embedding_lookup(nxt, late, tables_updated)
            nxt.lookup_started = True

    def _optimizer_step(self) -> None:
        with StageTimer(self.stats, STAGE_OPTIMIZER, f"## optimizer {self.contexts[0].index} ##"):
            self._optimizer.step()
