"""``TrainPipelineSemiSync``: torchrec 1.9.2's semi-synchronous pipeline, on CPU (gloo) and CUDA.

From batch ``start_batch`` on, batch i+1's embedding lookup and output all-to-all are issued right
after batch i's forward, before its backward: batch i+1's prediction uses tables last updated by
batch i-1 (torchrec: "parameters which were last updated B-2"), and the all-to-all overlaps batch
i's backward and optimizer step. Before ``start_batch`` it is synchronous and bit-identical to
``TrainPipelineSparseDist``. Shares its frame with the fused pipeline (``lookup_pipeline``:
attach / reset / progress over the ``lookup``, ``take_back``, ``relookup``, ``streams`` and
``forward`` collaborators) and owns its schedule; which module may be looked up when is
``semi_sync_checks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torchrec.distributed.model_parallel import ShardedModule

from recpipe.pipeline.train_pipeline.context import FusedLookupPipelineContext, pipelined_name
from recpipe.pipeline.train_pipeline.lookup_pipeline import FusedLookupTrainPipelineBase, check_bool_flags, check_device
from recpipe.pipeline.train_pipeline.lookup_schedule import LookupSchedule, resolve_lookup_schedule
from recpipe.pipeline.train_pipeline.relookup import REASON_MODE, LookupInputs, lookup_mode
from recpipe.pipeline.train_pipeline.semi_sync_checks import (
    SemiSyncModelError,
    SemiSyncModulePoints,
    process_group_of,
    semi_sync_module_points,
)

__all__ = ["SemiSyncPipelineContext", "TrainPipelineSemiSync"]

_WHO = "TrainPipelineSemiSync"


@dataclass
class SemiSyncPipelineContext(FusedLookupPipelineContext):
    """The fused pipeline's per-batch context plus whether the batch's lookup is stale by design."""

    semi_sync_lookup: bool = False
    """True when the lookup was issued before the previous batch's backward (semi-sync phase):
    only a train/eval or grad-mode switch makes the pipeline issue it again."""


class GradientStash:
    """``stash_gradients``: the dense optimizer applies each batch's gradients one step late."""

    def __init__(self) -> None:
        self._grads: Optional[Dict[str, Optional[torch.Tensor]]] = None

    def swap(self, model: torch.nn.Module) -> bool:
        """Stashes every parameter's gradient and gives it the one stashed at the previous swap.

        A parameter without a gradient now stashes None. The stash holds copies: DDP's gradient
        buckets, which ``.grad`` may view, are overwritten by the next backward.

        Returns:
            bool: whether a previous swap stashed anything (False: nothing to apply this step).
        """
        previous = self._grads
        current: Dict[str, Optional[torch.Tensor]] = {}
        for name, param in model.named_parameters():
            current[name] = param.grad.clone() if param.grad is not None else None
            param.grad = previous.get(name) if previous is not None else None
        self._grads = current
        return previous is not None

    def clear(self) -> None:
        """Drops the stashed gradients (``reset()``: they belong to a batch dropped with the pipeline)."""
        self._grads = None


def _check_arguments(device: Any, start_batch: Any, flags: Dict[str, Any]) -> None:
    """Type-checks the constructor's device, ``start_batch`` and bool flags (None: not given)."""
    check_device(_WHO, device)
    if isinstance(start_batch, bool) or not isinstance(start_batch, int) or start_batch < 0:
        raise ValueError(
            f"{_WHO}: start_batch must be an int >= 0 (the first batch whose successor is looked up "
            f"early), got {type(start_batch).__name__} {start_batch!r}; pass e.g. start_batch=900 "
            "(torchrec's default) or 0 to be semi-synchronous from the first batch."
        )
    check_bool_flags(_WHO, flags)


class TrainPipelineSemiSync(FusedLookupTrainPipelineBase):
    """Semi-synchronous sparse-dist train pipeline: batch i+1's lookup overlaps batch i's backward.

    torchrec 1.9.2's ``TrainPipelineSemiSync`` interface and staleness, on CPU (gloo) and CUDA.
    Stages of one ``progress()`` on batch i (profiler labels):

    1. ``zero_grad``; batch i's lookup, if none was issued (the first batch, after ``reset()``)
    2. ``start_sparse_data_dist i+2``  3. ``copy_batch_to_gpu i+3``  4. ``forward i``
    5. semi-sync phase (i >= ``start_batch``), training: ``start_embedding_lookup i+1`` of every
       module not listed below; then ``wait_sparse_data_dist i+2``
    6. ``backward i``: batch i's fused tables are updated; ``after_backward_modules`` look batch
       i+1 up (semi-sync phase), or every module does (synchronous phase with
       ``embedding_lookup_after_opt=False``)
    7. semi-sync phase with ``stash_gradients``: the gradients are swapped with the previous
       batch's; ``optimizer i`` (skipped when nothing was stashed yet)
    8. ``after_optimizer_modules`` look batch i+1 up (semi-sync phase), or every remaining module
       does (synchronous phase); in eval mode batch i+1 is looked up right after stage 4.

    Before ``start_batch`` every step is exact (bit-identical to ``TrainPipelineSparseDist``; a
    lookup made stale between two steps is issued again, as in ``TrainPipelineFusedSparseDist``).
    On CPU gloo's worker thread carries the output all-to-all while the main thread runs the
    backward. ``detach()`` keeps the stashed gradients with the in-flight batches and their lookups.
    docs/pipeline.md compares it with torchrec's.

    Args:
        start_batch (int): the first batch whose successor is looked up early (torchrec's).
        stash_gradients (bool): the dense optimizer applies batch i-1's gradients at step i, so
            dense weights are as stale as the tables (torchrec's); False: batch i's.
        strict (bool): torchrec's choice between a warning and an error for a pipelined module
            sharing parameters with the dense optimizer; recpipe refuses every model it cannot keep
            correct whatever its value.
        use_emb_lookup_stream (Optional[bool]): CUDA: True: a dedicated lookup stream; False: the
            data-dist stream; default (nor ``emb_lookup_stream``): the current stream, as torchrec's.
        embedding_lookup_after_opt (Optional[bool]): synchronous phase: True (default): batch i+1's
            lookup after batch i's optimizer step; False: right after its backward.
        emb_lookup_stream (Optional[str]): torchrec's ``'new'`` / ``'data_dist'`` / ``'current'``.
        allow_dense_tables (bool): accept modules holding dense-stepped weights (feature
            processors, DENSE / DATA_PARALLEL tables); they look up after the optimizer step.
        others: as torchrec's ``TrainPipelineSemiSync``.

    Raises:
        TypeError: a flag that is not a bool (or None), or a device that is not a ``torch.device``.
        ValueError: ``start_batch`` not an int >= 0, or contradicting stream arguments.
        SemiSyncModelError: on attach, a module holding dense-stepped weights without
            ``allow_dense_tables``.
    """

    _refused_model_errors = (SemiSyncModelError,)

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        start_batch: int = 900,
        stash_gradients: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Optional[Callable[[Optional[Any]], Tuple[torch.Tensor, Any]]] = None,
        strict: bool = False,
        dmp_collection_sync_interval_batches: Optional[int] = 1,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        use_emb_lookup_stream: Optional[bool] = None,
        embedding_lookup_after_opt: Optional[bool] = None,
        emb_lookup_stream: Optional[str] = None,
        allow_dense_tables: bool = False,
    ) -> None:
        _check_arguments(
            device,
            start_batch,
            {
                "stash_gradients": stash_gradients,
                "strict": strict,
                "use_emb_lookup_stream": use_emb_lookup_stream,
                "embedding_lookup_after_opt": embedding_lookup_after_opt,
                "allow_dense_tables": allow_dense_tables,
            },
        )
        self._schedule: LookupSchedule = resolve_lookup_schedule(
            use_emb_lookup_stream=use_emb_lookup_stream,
            embedding_lookup_after_opt=embedding_lookup_after_opt,
            # neither given: the current stream, where torchrec's semi-sync pipeline looks up
            emb_lookup_stream=(
                "current" if emb_lookup_stream is None and use_emb_lookup_stream is None else emb_lookup_stream
            ),
            embedding_lookup_after_data_dist=None,
            who=_WHO,
        )
        super().__init__(
            model=model,
            optimizer=optimizer,
            device=device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            context_type=SemiSyncPipelineContext,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            dmp_collection_sync_interval_batches=dmp_collection_sync_interval_batches,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
        )
        self._start_batch = start_batch
        self._stash_gradients = stash_gradients
        self._strict = strict
        self._allow_dense_tables = allow_dense_tables
        self._points = SemiSyncModulePoints()
        self._stash = GradientStash()
        self._init_lookup_parts(device, self._schedule.emb_lookup_stream, LookupInputs())

    # ----------------------------------------------------------------------------------- attach

    def _check_pipelined(self, modules: Dict[str, torch.nn.Module]) -> None:
        """Sorts the pipelined modules by the point their next-batch lookup may be issued at. A
        collective over the modules' process group: the sorting gathers every rank's findings (a
        rank holds only its own shards).

        Raises:
            SemiSyncModelError: a module holding dense-stepped weights without ``allow_dense_tables``
                (the model is detached first).
        """
        self._points = semi_sync_module_points(
            modules, self._optimizer, self._allow_dense_tables, process_group_of(modules)
        )

    def reset(self) -> None:
        """Drops the in-flight batches (torchrec), taking back their unconsumed lookups, and the
        stashed gradients; the batch index restarts at 0, so the next ``start_batch`` batches are
        synchronous again (as torchrec's)."""
        self._stash.clear()
        super().reset()

    # ------------------------------------------------------------------------------- properties

    @property
    def lookup_schedule(self) -> LookupSchedule:
        """The lookup stream and the synchronous phase's issue point the arguments resolved to."""
        return self._schedule

    @property
    def after_backward_modules(self) -> Sequence[str]:
        """Pipelined modules looked up after the backward in the semi-sync phase (known on attach)."""
        return list(self._points.after_backward)

    @property
    def after_optimizer_modules(self) -> Sequence[str]:
        """Pipelined modules looked up after the optimizer step in every phase (known on attach)."""
        return list(self._points.after_optimizer)

    def is_semi_sync(self) -> bool:
        """Whether the next ``progress()`` looks the following batch up before its backward (torchrec's)."""
        return bool(self.contexts) and (self.contexts[0].index or 0) >= self._start_batch

    # ---------------------------------------------------------------------------------- lookups

    def number_next_batch(self, index: int) -> None:
        """Numbers the next batch read ``index`` (``start_batch`` compares it), on a drained pipeline.

        torchrec's pipelines number batches per context they create, so a drain (an evaluation, a
        checkpoint) skips numbers and a resumed run starts at 0; a training loop that knows its global
        step calls this after each drain to start the semi-sync phase at the same step in every run.

        Raises:
            ValueError: ``index`` is not an int >= 0, or batches are in flight (``reset()`` or finish them).
        """
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"TrainPipelineSemiSync.number_next_batch: index must be an int >= 0, got {index!r}.")
        if self.contexts:
            raise ValueError(
                f"TrainPipelineSemiSync.number_next_batch: index={index} cannot number the next batch read while "
                f"{len(self.contexts)} batch(es) are in flight; call it "
                "on a drained pipeline (after progress() raised StopIteration, or after reset())."
            )
        self._next_index = index

    def _context_at(self, position: int) -> SemiSyncPipelineContext:
        """``self.contexts[position]``; ``TypeError`` unless it is a ``SemiSyncPipelineContext``."""
        context = self.contexts[position]
        if not isinstance(context, SemiSyncPipelineContext):
            got = type(context)
            raise TypeError(
                f"{_WHO}: pipeline.contexts[{position}] is a {got.__module__}.{got.__qualname__}, not a "
                "recpipe.pipeline.train_pipeline.semi_sync_pipeline.SemiSyncPipelineContext; create "
                "contexts with pipeline._create_context()."
            )
        return context

    def _issue(self, context: SemiSyncPipelineContext, modules: Sequence[ShardedModule], label: str) -> None:
        """Issues the lookups and output all-to-alls of ``modules`` for ``context``'s batch (its input
        dist waited); on CUDA after an event of the default stream recorded now."""
        self._issue_lookups(context, modules, f"start_embedding_lookup {label}")

    def _groups(self, semi: bool) -> Tuple[List[ShardedModule], List[ShardedModule], List[ShardedModule]]:
        """Batch i+1's modules looked up (after the forward, after the backward, after the optimizer)."""
        groups: Tuple[List[ShardedModule], List[ShardedModule], List[ShardedModule]] = ([], [], [])
        for m in self._pipelined_modules:
            name = pipelined_name(m)
            if not self._model.training:
                point = 0  # eval: the tables do not change
            elif name in self._points.after_optimizer:
                point = 2
            elif semi:
                point = 1 if name in self._points.after_backward else 0
            else:
                point = 2 if self._schedule.embedding_lookup_after_opt else 1
            groups[point].append(m)
        return groups

    def _lookup_is_stale(self, current: SemiSyncPipelineContext) -> bool:
        """Whether batch i's lookup must be issued again: a semi-sync lookup only after a train/eval
        or grad-mode switch, a synchronous one as in ``TrainPipelineFusedSparseDist``."""
        mode = lookup_mode(self._model)
        if current.semi_sync_lookup:
            reason = REASON_MODE if current.lookup_mode != mode else None
        else:
            reason = self._inputs.stale_reason(current, self._pipelined_modules, mode)
        return reason is not None

    def _lookup_at_step_start(self, current: SemiSyncPipelineContext) -> None:
        """Issues batch i's lookup of every pipelined module, as a synchronous (exact) lookup."""
        self._issue(current, self._pipelined_modules, "at_step_start")
        current.semi_sync_lookup = False

    # ------------------------------------------------------------------------------------- step

    def fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """Queues up to three batches: i (input dist waited), i+1 (input dist waited), i+2 (copied).

        A drained pipeline with ``execute_all_batches=True`` runs its last batches without
        refilling, as torchrec's.
        """
        if len(self.batches) >= 3 or (self.batches and self._execute_all_batches):
            return
        if not self.batches:
            if not self.enqueue_batch(dataloader_iter):
                return
            self._init_pipelined_modules(self.batches[0], self.contexts[0], self._pipelined_forward_type)
            self.wait_sparse_data_dist(self.contexts[0])
        if len(self.batches) == 1:
            if not self.enqueue_batch(dataloader_iter):
                return
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])
            self.wait_sparse_data_dist(self.contexts[1])
        if len(self.batches) == 2:
            self.enqueue_batch(dataloader_iter)

    def _step(self, dataloader_iter: Iterator[Any], current: SemiSyncPipelineContext) -> Any:
        """The stages of one ``progress()`` call."""
        training = self._model.training
        semi = (current.index or 0) >= self._start_batch
        self._begin_step(current)
        self._ensure_lookup(current)
        self._wait_for_current(current)
        if len(self.batches) >= 3:
            self.start_sparse_data_dist(self.batches[2], self.contexts[2])
        self._enqueue_before_forward(dataloader_iter, current)
        losses, output = self._forward(current)
        nxt = self._context_at(1) if len(self.batches) >= 2 else None
        after_forward, after_backward, after_optimizer = self._groups(semi)
        self._streams.data_dist_waits_for_forward()
        if nxt is not None:
            self._issue(nxt, after_forward, "after_forward")
            nxt.semi_sync_lookup = semi and training
        if len(self.batches) >= 3:
            self.wait_sparse_data_dist(self.contexts[2])
        if training:
            self._backward_and_update(losses, current, nxt, semi, after_backward, after_optimizer)
        if nxt is not None:
            nxt.lookup_started = True
        return self._end_step(output)

    def _backward_and_update(
        self,
        losses: torch.Tensor,
        current: SemiSyncPipelineContext,
        nxt: Optional[SemiSyncPipelineContext],
        semi: bool,
        after_backward: Sequence[ShardedModule],
        after_optimizer: Sequence[ShardedModule],
    ) -> None:
        """Stages 6-8: backward, batch i+1's later lookups, the gradient swap and the optimizer step."""
        # CUDA: batch i's backward writes the rows batch i+1's lookup (on another stream) reads
        self._streams.main_waits_for_lookups()
        self._backward_and_sync(losses, current)
        if nxt is not None:
            self._issue(nxt, after_backward, "after_backward")
        step = True
        if semi and self._stash_gradients:
            step = self._stash.swap(self._model)
        if step:
            self._optimizer_step()
        if nxt is not None:
            self._issue(nxt, after_optimizer, "after_optimizer")
