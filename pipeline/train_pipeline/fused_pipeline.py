"""``TrainPipelineFusedSparseDist``: torchrec's sparse-dist pipeline with the next batch's
embedding lookup issued as soon as the fused-TBE backward has updated the tables, so the
lookup and its output all-to-all overlap the dense optimizer step. Exact (bit-identical to
``TrainPipelineSparseDist``) on CUDA and CPU; a drop-in replacement.

Owns the schedule of one step; the frame it shares with the semi-sync pipeline is
``lookup_pipeline``, its collaborators live in the sibling modules (``lookup``, ``take_back``,
``relookup``, ``streams``, ``validation``, ``stats``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Type

import torch
from torchrec.distributed.model_parallel import ShardedModule
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext

from recpipe.pipeline.train_pipeline.context import FusedLookupPipelineContext, checked_context, pipelined_name
from recpipe.pipeline.train_pipeline.lookup_pipeline import FusedLookupTrainPipelineBase, check_bool_flags, check_device
from recpipe.pipeline.train_pipeline.lookup_schedule import LookupSchedule, resolve_lookup_schedule
from recpipe.pipeline.train_pipeline.relookup import LookupInputs, lookup_mode
from recpipe.pipeline.train_pipeline.validation import FusedLookupExactnessChecker, FusedLookupExactnessError

__all__ = ["TrainPipelineFusedSparseDist"]

_WHO = "TrainPipelineFusedSparseDist"


def _check_arguments(device: Any, context_type: Any, flags: Dict[str, Any]) -> None:
    """Type-checks the constructor's device, context type and bool flags (None: not given)."""
    check_device(_WHO, device)
    if not (isinstance(context_type, type) and issubclass(context_type, FusedLookupPipelineContext)):
        raise TypeError(
            f"{_WHO}: context_type must subclass "
            f"FusedLookupPipelineContext, got {context_type!r}; derive your context from "
            "recpipe.pipeline.train_pipeline.context.FusedLookupPipelineContext."
        )
    check_bool_flags(_WHO, flags)


class TrainPipelineFusedSparseDist(FusedLookupTrainPipelineBase):
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

    _refused_model_errors = (FusedLookupExactnessError,)

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
        self._init_lookup_parts(device, self._schedule.emb_lookup_stream, LookupInputs())

    def _check_pipelined(self, modules: Dict[str, torch.nn.Module]) -> None:
        """Validates the pipelined modules and records those looked up after the optimizer.

        Raises:
            FusedLookupExactnessError: a feature processor or dense-updated table without
                ``allow_dense_tables`` (the model is detached first).
        """
        self._after_opt_modules = set(self._checker.check(modules))

    @property
    def lookup_schedule(self) -> LookupSchedule:
        """The stream and issue point the constructor's recpipe / torchrec arguments resolved to."""
        return self._schedule

    @property
    def after_optimizer_modules(self) -> Sequence[str]:
        """Pipelined modules whose lookup is ordered after the optimizer step (known on attach)."""
        return sorted(self._after_opt_modules)

    def _context_at(self, position: int) -> FusedLookupPipelineContext:
        """``self.contexts[position]``; ``TypeError`` unless it is a ``FusedLookupPipelineContext``."""
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
        self._issue_lookups(context, modules, "start_embedding_lookup", tables_updated, self._after_opt_modules)

    def _split_modules(self) -> Tuple[List[ShardedModule], List[ShardedModule]]:
        """(modules looked up after backward, modules looked up after the optimizer)."""
        early: List[ShardedModule] = []
        late: List[ShardedModule] = []
        for m in self._pipelined_modules:
            name: str = pipelined_name(m)
            after_opt = self._schedule.embedding_lookup_after_opt or name in self._after_opt_modules
            (late if after_opt else early).append(m)
        return early, late

    def _lookup_is_stale(self, current: FusedLookupPipelineContext) -> bool:
        """Whether batch i's lookup read tables, optimizer state or a mode that changed since."""
        reason = self._inputs.stale_reason(current, self._pipelined_modules, lookup_mode(self._model))
        self._inputs.note(reason, stacklevel=4)  # progress > _step > _ensure_lookup > here: points at progress()
        return reason is not None

    def _lookup_at_step_start(self, current: FusedLookupPipelineContext) -> None:
        """Issues batch i's lookup of every pipelined module (``start_embedding_lookup``)."""
        self.start_embedding_lookup(current, self._pipelined_modules)

    def _step(self, dataloader_iter: Iterator[Any], current: FusedLookupPipelineContext) -> Any:
        """The stages of one ``progress()`` call."""
        after_data_dist = self._schedule.embedding_lookup_after_data_dist
        self._begin_step(current)
        if not after_data_dist:
            self._ensure_lookup(current)
        self._wait_for_current(current)
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])
        if not self._enqueue_batch_after_forward:
            self._enqueue_before_forward(dataloader_iter, current)
        if after_data_dist:  # torchrec's embedding_lookup_after_data_dist=True
            self._ensure_lookup(current)
        losses, output = self._forward(current)
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
        return self._end_step(output)

    def _wait_next_input_dist(self) -> Optional[FusedLookupPipelineContext]:
        """Stage 6: waits batch i+1's input dist; returns its context (None: no batch i+1)."""
        if len(self.batches) < 2:
            return None
        nxt = self._context_at(1)
        self._streams.data_dist_waits_for_forward()
        self.wait_sparse_data_dist(nxt)
        return nxt

    def _backward_and_update(
        self, losses: torch.Tensor, current: FusedLookupPipelineContext, nxt: Optional[FusedLookupPipelineContext]
    ) -> None:
        """Stages 7-9: backward, batch i+1's lookup (None: none issued here) and the optimizer step."""
        self._backward_and_sync(losses, current)
        # CUDA: lookups of tables the dense optimizer does not write wait for this event only
        tables_updated = self._streams.main_stream_event()
        early, late = self._split_modules()
        if nxt is not None:
            self.start_embedding_lookup(nxt, early, tables_updated)
        self._optimizer_step()
        if nxt is not None:
            self.start_embedding_lookup(nxt, late, tables_updated)
            nxt.lookup_started = True
