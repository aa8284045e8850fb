"""TrainPipelineFusedSparseDist: torchrec's sparse-dist pipeline with the next
batch's embedding lookup issued as soon as the current batch's fused-TBE backward
has updated the tables, so the lookup and its output all-to-all overlap the
dense optimizer step. Exact (bit-identical to ``TrainPipelineSparseDist``) on CUDA
and CPU; a one-line drop-in::

    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    pipeline = TrainPipelineFusedSparseDist(model, optimizer, device)
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Type

import torch
from torch.profiler import record_function
from torchrec.distributed.model_parallel import ShardedModule
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.types import PipelineState

from recpipe.pipeline.train.forward import (
    FusedLookupPipelineContext,
    FusedLookupPipelinedForward,
    PipelinedLookupUnavailableError,
)
from recpipe.pipeline.train.stats import (
    STAGE_LOOKUP,
    STAGE_OPTIMIZER,
    PipelineStageStats,
    StageTimer,
)
from recpipe.pipeline.train.validation import (
    FusedLookupExactnessChecker,
    FusedLookupExactnessError,
)
from recpipe.pipeline.tiered.fbgemm import tbe_counters, undo_tbe_lookup

__all__ = [
    "FusedLookupExactnessError",
    "FusedLookupPipelineContext",
    "PipelineStageStats",
    "PipelinedLookupUnavailableError",
    "TrainPipelineFusedSparseDist",
    "fused_tbes",
    "lookup_counter_sources",
    "mch_counter_sources",
    "tables_version",
    "tbe_counters",
    "undo_tbe_lookup",
]

_STREAM_DEVICE_TYPES = ("cuda", "mtia")


def tables_version(module: torch.nn.Module) -> int:
    """A number that grows whenever ``module``'s tables are written in place.

    The sum of the version counters of its parameters and buffers (bumped by
    every in-place op on them or their views: ``load_state_dict``, edits of
    state-dict shards; not by fbgemm's fused TBE backward) and of the write
    counts of recpipe's tiered tables (``rows_writes``), whose rows live outside
    parameters.

    Args:
        module (torch.nn.Module): a sharded embedding module.
    """
    version = sum(t._version for t in module.parameters()) + sum(t._version for t in module.buffers())
    tiered = getattr(module, "tiered_tables", None)
    if callable(tiered):
        version += sum(shard.rows_writes for shard in tiered().values())
    return version


def fused_tbes(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The fbgemm TBEs (modules with a ``learning_rate_tensor``) of a sharded module.

    torchrec keeps a sharded module's lookups in a plain list (``_lookups``), not
    as registered submodules, so they are searched there too, on every submodule:
    a sharded managed-collision EBC / EC keeps its sharded EBC / EC (and that
    module's ``_lookups``) as a submodule (``_embedding_module``).

    Args:
        module (torch.nn.Module): a sharded embedding module.
    """
    found: Dict[int, torch.nn.Module] = {}
    seen: Set[int] = set()
    roots: List[Any] = [module]
    while roots:
        root = roots.pop(0)
        if not isinstance(root, torch.nn.Module) or id(root) in seen:
            continue
        seen.add(id(root))
        for m in root.modules():
            if isinstance(getattr(m, "learning_rate_tensor", None), torch.Tensor):
                found.setdefault(id(m), m)
            roots.extend(getattr(m, "_lookups", None) or ())
    return list(found.values())


def _wait_tree(request: Any) -> None:
    """Waits an awaitable, or each awaitable of a tuple / list of them (a
    managed-collision module's ``compute_and_output_dist`` returns the
    embeddings' and the remapped features' awaitables); None entries are skipped."""
    if isinstance(request, (tuple, list)):
        for r in request:
            _wait_tree(r)
    elif request is not None:
        request.wait()


CounterSource = Tuple[Callable[[], Any], Callable[[Any, Any], None]]
"""``(read, undo)``: reads the counters a lookup advances; takes back one lookup's
increments given the readings before and after it."""


def lookup_counter_sources(tbes: Sequence[torch.nn.Module], tiered_shards: Sequence[Any]) -> List[CounterSource]:
    """What a sharded module's lookup advances besides the tables, and how to take it back.

    The fbgemm TBEs of :func:`fused_tbes` (:func:`tbe_counters` / :func:`undo_tbe_lookup`)
    and its tiered shards (``lookup_counters()`` / ``undo_lookup(before, after)``,
    duck-typed: a fbgemm-backed shard's TBE lives outside the module tree and its shard
    and tier count steps at lookup time; a native shard counts in the backward and
    reads None).

    Args:
        tbes (Sequence[torch.nn.Module]): the module's fbgemm TBEs.
        tiered_shards (Sequence[Any]): the module's tiered shards.

    Returns:
        List[CounterSource]: one ``(read, undo)`` per TBE and per tiered shard.
    """
    sources: List[CounterSource] = [
        (functools.partial(tbe_counters, tbe), functools.partial(undo_tbe_lookup, tbe)) for tbe in tbes
    ]
    sources += [(shard.lookup_counters, shard.undo_lookup) for shard in tiered_shards
                if callable(getattr(shard, "lookup_counters", None)) and callable(getattr(shard, "undo_lookup", None))]
    return sources


_MCH_COUNTERS = ("_current_iter", "_current_iter_tensor", "_current_history_buffer_offset", "_last_eviction_iter")


def mch_counter_sources(module: torch.nn.Module) -> List[CounterSource]:
    """What a lookup of a managed-collision module advances in its MCH modules, and how to take it back.

    torchrec's ``MCHManagedCollisionModule.profile`` (run by the sharded module's
    ``compute`` in training) counts the lookup (``_current_iter`` and its
    ``_current_iter_tensor`` buffer) and appends its ids to the input history
    (``_current_history_buffer_offset``). Taking a discarded lookup back restores
    them, so eviction comes at torchrec's step with torchrec's history; a lookup
    that coalesced the history (an eviction step) cannot be taken back and stays.

    Args:
        module (torch.nn.Module): a sharded embedding module.

    Returns:
        List[CounterSource]: one ``(read, undo)`` per MCH module (duck-typed).
    """
    return [
        (functools.partial(_mch_counters, m), functools.partial(_undo_mch_profile, m))
        for m in module.modules()
        if all(hasattr(m, attr) for attr in _MCH_COUNTERS)
    ]


def _mch_counters(mch: torch.nn.Module) -> Tuple[int, int, int]:
    return (mch._current_iter, mch._current_history_buffer_offset, mch._last_eviction_iter)  # pyre-ignore[7]


def _undo_mch_profile(mch: torch.nn.Module, before: Tuple[int, int, int], after: Tuple[int, int, int]) -> None:
    if after[0] == before[0]:
        return  # not profiled (eval mode)
    if before[0] != -1 and after[2] != before[2]:
        return  # the history was coalesced (eviction): not reversible
    # One profile per lookup: the buffer moved by one (no host read of it).
    mch._current_iter_tensor.data -= 1  # pyre-ignore[16]
    mch._current_iter = before[0]  # -1: re-read from the buffer at the next profile
    mch._current_history_buffer_offset = before[1]
    mch._last_eviction_iter = before[2]


class TrainPipelineFusedSparseDist(TrainPipelineSparseDist[Any, Any]):
    """Sparse-dist train pipeline whose next-batch embedding lookup overlaps the optimizer.

    Same schedule as torchrec's ``TrainPipelineSparseDist`` except where batch
    i+1's embedding lookup and output all-to-all (``compute_and_output_dist``) are
    issued: not inside batch i+1's forward, but right after batch i's backward,
    when the fused TBE backward has already written the tables. Stages of one
    ``progress()`` call (batch i), with the stream (CUDA) / thread (CPU) each uses:

    1. ``## zero_grad ##`` - default stream / main thread.
    2. ``## wait_for_batch i ##`` - default stream waits for the data-dist stream.
    3. ``## start_sparse_data_dist i+1 ##`` - input-dist splits all-to-all of
       batch i+1 - data-dist stream / main thread (gloo runs it in the background).
    4. ``## copy_batch_to_gpu i+2 ##`` - memcpy stream / main thread.
    5. ``## forward i ##`` - default stream / main thread. The pipelined modules
       return the output all-to-all issued one step earlier; the model's first use
       blocks in ``## output_dist_wait <module> i ##`` (timed in ``stats``).
    6. ``## wait_sparse_data_dist i+1 ##`` - input-dist tensors all-to-all of
       batch i+1 - data-dist stream / main thread.
    7. ``## backward i ##`` - default stream / main thread; fused tables are
       updated here.
    8. ``## start_embedding_lookup i+1 ##`` - lookup + output all-to-all of
       batch i+1 - lookup stream (``use_emb_lookup_stream=True``) or the data-dist
       stream, after an event wait on the default stream (recorded after backward,
       or after the optimizer for modules holding dense-updated tables) and on
       the data-dist stream / main thread, gloo carries the all-to-all in the
       background. Issued before or after stage 9 (``embedding_lookup_after_opt``).
    9. ``## optimizer i ##`` - dense optimizer step - default stream / main thread.

    The first batch (and a batch whose lookup was not issued, e.g. after
    ``reset()``) is looked up at the start of its own step. With
    ``execute_all_batches=False`` an exhausted dataloader raises
    ``StopIteration`` in stage 4, before batch i's forward, as in torchrec,
    which then has not looked batch i up: its early lookup is taken back (TBE
    ``step`` / ``iter``) and issued again if a later ``progress()`` resumes it. ``attach()`` after
    ``detach()`` discards the lookup already issued for the in-flight batch (the
    detached model's tables may have been changed) and it is issued again at the
    start of that batch's step. In eval mode (no backward) the lookup of batch
    i+1 is issued after stage 6. An early lookup is likewise issued again at the
    start of its step (after stage 1) when the step runs in another grad/train
    mode (``model.train()`` after eval steps under ``torch.no_grad()``: that
    lookup has no autograd graph), the module's tables were written since
    (``load_state_dict`` or an in-place edit between two ``progress()`` calls,
    seen through tensor version counters, ``tables_version``), or its fused
    learning rate / optimizer arguments changed (fbgemm's TBE takes them at
    lookup time; torchrec's fused optimizers set them in ``zero_grad()`` and
    ``step()``, so an LR scheduler stepped between two ``progress()`` calls
    changes them). Each costs one lookup, counted in ``stats.relookups`` (0 in
    uninterrupted training). A learning rate changed at every step (a per-step
    scheduler, or torchrec's ``WarmupOptimizer`` during its warm-up, which sets
    the new rate after its fused ``step()``) makes it one per step, without
    overlap; a ``RuntimeWarning`` says so once.

    CUDA: the lookup stream waits on an event recorded on the default stream
    after backward, so it runs concurrently with the optimizer kernels; the
    forward waits on an event recorded on the lookup stream; the input KJT and
    module context are recorded on every consuming stream and the embeddings on
    the default stream. With the lookups on the data-dist stream, that stream waits
    for the forward before batch i+1's input dist allocates there (the forward
    reads the output all-to-all's receive buffers, allocated on it); ``detach()``
    and a discarded lookup make the default stream wait for the lookup stream
    before anything writes the tables or the counters the lookup advanced. CPU: no stream exists and no CUDA or stream call is made;
    there is no lookup thread (with 2 ranks on 2 cores no core is idle, and on
    1 rank 2 intra-op threads beat a lookup thread, both measured), so the flags
    set the order in which the lookup and its output all-to-all are *issued*
    relative to the optimizer, and gloo's worker thread carries the all-to-all
    while the main thread runs the optimizer (``embedding_lookup_after_opt=False``)
    or the next step's input dist, batch copy and dense forward (True). Measured
    on 2 CPU ranks (scripts/bench_pipeline.py), False hides more of the wait
    (forward wait cut ~77% vs ~40-68% for True); CUDA keeps the default True.

    Exactness: a lookup issued before the optimizer is exact only if the
    optimizer writes nothing the lookup reads. When the model is attached (the
    first ``progress()`` or ``attach()``), every pipelined module is checked: a
    feature processor inside a pipelined module (e.g. torchrec's
    ``FeatureProcessedEmbeddingBagCollection`` with a
    ``PositionWeightedModuleCollection``, whose position weights the dense
    optimizer steps), or a table updated by the dense optimizer (compute kernel
    ``dense`` or sharding ``data_parallel``) raises ``FusedLookupExactnessError``
    naming the module and table, unless ``allow_dense_tables=True`` - then the
    lookup of the modules holding such tables or feature processors is issued
    after the optimizer step (and, on CUDA, waits on an event recorded after it),
    which keeps them exact but removes their overlap; the other modules keep
    theirs (``after_optimizer_modules`` lists the late ones).

    Failures: when a step raises (forward, backward, optimizer, dataloader), the
    lookups issued early that torchrec (which looks a batch up in its forward) had
    not run yet are taken back (TBE ``step`` / ``iter``); a retried ``progress()``
    on a batch whose forward had started raises ``PipelinedLookupUnavailableError``
    (an ``AssertionError``, as torchrec's ``PipelinedForward``), also after
    ``attach()``; ``reset()`` drops every in-flight batch. A lookup that raises
    keeps its exception in the batch's context (``lookup_errors``): the forward
    of that batch raises it where the module is called, as torchrec does, and
    the lookups after it are issued from the forward (``deferred_lookups``).

    Contexts: every batch's context must be a ``FusedLookupPipelineContext``
    (``context_type``); create them with ``_create_context()``, torchrec's
    extension point, never by appending a plain ``TrainPipelineContext`` to
    ``contexts`` (``progress()`` raises ``TypeError`` before running anything).

    Args:
        model (torch.nn.Module): model to pipeline (usually a
            ``DistributedModelParallel``).
        optimizer (torch.optim.Optimizer): the dense optimizer.
        device (torch.device): device of the forward/backward.
        execute_all_batches (bool): run the batches left in the pipeline after
            the dataloader is exhausted.
        apply_jit (bool): ``torch.jit.script`` the non-pipelined modules.
        context_type (Type[TrainPipelineContext]): per-batch context; must
            subclass ``FusedLookupPipelineContext``.
        pipeline_postproc (bool): pipeline postproc modules (torchrec).
        custom_model_fwd (Optional[Callable]): replaces ``model(batch)``.
        dmp_collection_sync_interval_batches (Optional[int]): 2D-sharding sync
            interval (torchrec).
        enqueue_batch_after_forward (bool): copy batch i+2 after the forward.
        enable_inplace_copy_batch (bool): torchrec's in-place batch copy.
        free_features_storage_early (bool): torchrec's early KJT storage release.
        clear_data_dist_inputs (bool): torchrec's early input-dist release.
        async_inplace_copy (bool): torchrec's background in-place copy.
        use_emb_lookup_stream (bool): keyword-only. True: a dedicated lookup
            stream (its own caching-allocator pool: more memory). False: reuse the
            data-dist stream. No effect on CPU.
        embedding_lookup_after_opt (bool): keyword-only. True: issue the next
            lookup after the optimizer step is enqueued (on CUDA it fills the gap
            before the next forward; on CPU the all-to-all overlaps the next step's
            input dist and dense forward). False: right after backward, before the
            optimizer (on CPU the all-to-all overlaps the optimizer).
        allow_dense_tables (bool): keyword-only. Accept tables updated by the
            dense optimizer and feature processors (their weights are stepped by
            the dense optimizer); the lookups of the modules holding them are
            ordered after it.

    Example::

        pipeline = TrainPipelineFusedSparseDist(
            dmp_model, dense_optimizer, torch.device("cpu"), embedding_lookup_after_opt=False
        )
        it = iter(dataloader)
        while True:
            try:
                output = pipeline.progress(it)
            except StopIteration:
                break
        print(pipeline.stats.per_step_ms())
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
        use_emb_lookup_stream: bool = False,
        embedding_lookup_after_opt: bool = True,
        allow_dense_tables: bool = False,
    ) -> None:
        if not isinstance(device, torch.device):
            raise TypeError(
                f"TrainPipelineFusedSparseDist: device must be a torch.device, got "
                f"{type(device).__name__} {device!r}; pass torch.device({str(device)!r})."
            )
        if not (isinstance(context_type, type) and issubclass(context_type, FusedLookupPipelineContext)):
            raise TypeError(
                f"TrainPipelineFusedSparseDist: context_type must subclass "
                f"FusedLookupPipelineContext, got {context_type!r}; derive your context from "
                "recpipe.pipeline.train.pipeline.FusedLookupPipelineContext."
            )
        for arg, value in (
            ("use_emb_lookup_stream", use_emb_lookup_stream),
            ("embedding_lookup_after_opt", embedding_lookup_after_opt),
            ("allow_dense_tables", allow_dense_tables),
        ):
            if not isinstance(value, bool):
                raise TypeError(
                    f"TrainPipelineFusedSparseDist: {arg} must be a bool, got "
                    f"{type(value).__name__} {value!r}."
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
        self._use_emb_lookup_stream = use_emb_lookup_stream
        self._embedding_lookup_after_opt = embedding_lookup_after_opt
        self._checker = FusedLookupExactnessChecker(allow_dense_tables=allow_dense_tables)
        self._after_opt_modules: Set[str] = set()
        self._fused_tbes: Dict[str, List[torch.nn.Module]] = {}
        self._tiered_shards: Dict[str, List[Any]] = {}
        self._counter_sources: Dict[str, List[CounterSource]] = {}
        self._optimizer_relookup_streak = 0
        self._warned_optimizer_relookups = False
        self.stats = PipelineStageStats()
        """Per-stage host seconds (lookup issue, output-dist wait, optimizer)."""

        self._lookup_stream: Optional[torch.Stream] = None
        if device.type in _STREAM_DEVICE_TYPES:
            self._lookup_stream = (
                torch.get_device_module(device).Stream(priority=-1)
                if use_emb_lookup_stream
                else self._data_dist_stream
            )

    # ------------------------------------------------------------------ attach

    def _pipeline_model(
        self,
        batch: Optional[Any],
        context: TrainPipelineContext,
        pipelined_forward: Type[PipelinedForward] = PipelinedForward,
    ) -> None:
        """Rewrites the model (torchrec), then validates and binds the pipelined modules.

        Raises:
            FusedLookupExactnessError: see the class docstring; the model is
                detached (original forwards restored) before raising.
        """
        super()._pipeline_model(batch, context, pipelined_forward)
        modules = self._modules_by_name()
        try:
            after_opt = self._checker.check(modules)
        except FusedLookupExactnessError:
            self.detach()
            raise
        self._after_opt_modules = set(after_opt)
        self._fused_tbes = {name: fused_tbes(module) for name, module in modules.items()}
        self._tiered_shards = {  # found once: walking the module tree at every lookup costs host time
            name: list(module.tiered_tables().values())  # pyre-ignore[16]
            for name, module in modules.items()
            if callable(getattr(module, "tiered_tables", None))
        }
        self._counter_sources = {
            name: lookup_counter_sources(self._fused_tbes[name], self._tiered_shards.get(name, ()))
            + mch_counter_sources(module)
            for name, module in modules.items()
        }
        for module in self._pipelined_modules:
            forward = module.forward
            if isinstance(forward, FusedLookupPipelinedForward):
                forward.bind(self.stats, self._device)
                forward.bind_lookup(self._lookup_in_forward)

    def attach(self, model: Optional[torch.nn.Module] = None, sparse_dist: bool = True) -> None:
        """Re-attaches the model after ``detach()`` (torchrec), discarding the lookup
        of the next batch that was issued before the pause.

        When ``progress()`` returns, batch i+1's lookup has already read the
        tables; a paused pipeline may come back to other weights (a checkpoint
        loaded into the detached model), so that lookup is waited, dropped and
        issued again by the next ``progress()``, as torchrec's pipeline looks the
        batch up in its forward. With ``sparse_dist=True`` torchrec restarts the
        batch's input dist here with new module contexts; the next ``progress()``
        finishes it (torchrec 1.9.2's own pipeline keeps the old input dist
        instead, which breaks the output all-to-all of a sequence EC). With
        ``sparse_dist=False`` the old input dist is kept if the lookup had not
        consumed it, else it is redone at the next ``progress()``. Tiered
        tables count the discarded lookup in ``tier_stats()`` (it was served).
        A batch whose forward started in a ``progress()`` that raised keeps its
        state: retrying it fails as in torchrec (call ``reset()``).

        Args:
            model (Optional[torch.nn.Module]): the model to attach (default: the
                detached one).
            sparse_dist (bool): restart the in-flight batch's input dist now
                (torchrec); False defers it to ``progress()``.
        """
        super().attach(model, sparse_dist)
        if self.contexts and not self._fused_context(0).forward_started:
            # (a batch whose forward ran and raised keeps its state: torchrec's
            # pipeline fails on its consumed input dist when progress() retries it)
            self._drop_issued_lookup(self._fused_context(0), input_dist_restarted=sparse_dist)

    def detach(self) -> torch.nn.Module:
        """Gives back the original model (torchrec); on CUDA the default stream first
        waits for the lookup stream, where the lookup issued for the in-flight batch
        may still run: a write to the detached model's tables (``load_state_dict``,
        an eval forward's cache loads) must not race with it.

        Returns:
            torch.nn.Module: the model.
        """
        self._main_waits_for_lookups()
        return super().detach()

    def _main_waits_for_lookups(self) -> None:
        """CUDA: the default stream waits for everything issued on the lookup stream."""
        if self._lookup_stream is not None:
            torch.get_device_module(self._device).current_stream().wait_stream(self._lookup_stream)

    def reset(self) -> None:
        """Drops the in-flight batches (torchrec), first completing and taking back
        every lookup issued for them that no forward consumed (its TBE counters),
        as if it never ran: the next batch's, and after a ``progress()`` that raised
        (e.g. in the optimizer step with ``embedding_lookup_after_opt=False``) the
        one issued for the batch after it."""
        for context in self.contexts:
            if isinstance(context, FusedLookupPipelineContext):
                self._drop_issued_lookup(context, input_dist_restarted=False, relookup=False)
        super().reset()

    def _take_back_after_failure(self) -> None:
        """Called when a step raised: takes back the lookups torchrec's pipeline,
        which looks a batch up inside its forward, would not have run by then.

        A context whose forward has not started (the next batch after an
        optimizer or backward failure; the current one when its forward was not
        reached, e.g. the dataloader raised) is dropped as after ``reset()``
        (``progress()`` looks it up again if it resumes that batch, as torchrec's
        forward would). A context whose forward started before it raised keeps
        its state (a retried ``progress()`` fails on the first consumed module
        as torchrec's does) and only the lookups its forward did not reach are
        taken back.
        """
        for context in self.contexts:
            if not isinstance(context, FusedLookupPipelineContext) or not (
                context.embedding_a2a_requests or context.lookup_errors
            ):
                continue
            if context.forward_started:
                self._take_back_pending(context)
            else:
                self._drop_issued_lookup(context, input_dist_restarted=False, relookup=False)

    def _take_back_pending(self, context: FusedLookupPipelineContext) -> List[str]:
        """Completes the lookups of ``context`` no forward consumed (its
        ``embedding_a2a_requests``), drops their results and takes back the
        counters they advanced (:func:`lookup_counter_sources`,
        :func:`mch_counter_sources`).

        Returns:
            List[str]: the modules whose lookup was taken back.
        """
        pending = list(context.embedding_a2a_requests) + list(context.lookup_errors)
        context.lookup_errors.clear()  # a lookup that raised is taken back too (counters)
        context.deferred_lookups.clear()
        self._wait_and_drop(context.embedding_a2a_requests, self._lookup_stream)
        self._main_waits_for_lookups()  # the undos below write counters the lookup advanced
        for name in pending:
            moves = context.lookup_counters.pop(name, ())
            for (_, undo), (before, after) in zip(self._counter_sources.get(name, ()), moves):
                undo(before, after)
            context.lookup_events.pop(name, None)
        return pending

    def _drop_issued_lookup(
        self, context: FusedLookupPipelineContext, input_dist_restarted: bool, relookup: bool = True
    ) -> None:
        """Completes and discards ``context``'s issued lookup (and, when torchrec
        restarted its input dist, its old input-dist tensors) on this rank; every
        rank attaches, so the collectives stay matched. The counters the lookup
        advanced (fbgemm TBEs', fbgemm-backed tiered shards' steps:
        :func:`lookup_counter_sources`; MCH profiling: :func:`mch_counter_sources`)
        are taken back, for the lookups no forward consumed; ``relookup`` counts it in ``stats``."""
        consumed_input_dist = context.lookup_started
        if context.lookup_started and relookup:
            self.stats.relookups += 1
        # Only lookups no forward consumed are taken back: a forward that ran
        # (e.g. before StopIteration with enqueue_batch_after_forward=True) did
        # its lookup in torchrec's pipeline too.
        self._take_back_pending(context)
        context.forward_started = False
        context.lookup_counters.clear()
        context.lookup_events.clear()
        context.lookup_inputs.clear()
        context.lookup_started = False
        if input_dist_restarted or consumed_input_dist:
            self._wait_and_drop(context.input_dist_tensors_requests, self._data_dist_stream)

    def _wait_and_drop(self, requests: Dict[str, Any], stream: Optional[torch.Stream]) -> None:
        """Waits every awaitable of ``requests`` (on CUDA, on ``stream``, where it
        was issued) and empties the dict; on CPU no stream call is made."""
        for name in list(requests):
            request = requests.pop(name)
            if self._lookup_stream is None:
                _wait_tree(request)
            else:
                with torch.get_device_module(self._device).stream(stream):
                    _wait_tree(request)

    def _finish_input_dist(self, context: FusedLookupPipelineContext, batch: Any) -> None:
        """Makes ``context``'s input-dist tensors available after ``attach()``:
        waits the input dist torchrec restarted, or restarts it."""
        names = [m.forward.name for m in self._pipelined_modules]  # pyre-ignore[16]
        if all(n in context.input_dist_tensors_requests for n in names):
            return
        if not context.fused_splits_awaitables:
            self.start_sparse_data_dist(batch, context)
        self.wait_sparse_data_dist(context)

    def _modules_by_name(self) -> Dict[str, ShardedModule]:
        return {m.forward.name: m for m in self._pipelined_modules}  # pyre-ignore[16]

    @property
    def after_optimizer_modules(self) -> Sequence[str]:
        """Pipelined modules whose lookup is ordered after the optimizer step.

        Non-empty only with ``allow_dense_tables=True`` and dense-updated tables
        or feature processors (known once the model is attached).
        """
        return sorted(self._after_opt_modules)

    # ------------------------------------------------------------------ lookup

    def _main_stream_event(self) -> Optional[torch.Event]:
        if self._lookup_stream is None:
            return None
        return torch.get_device_module(self._device).current_stream().record_event()

    def _issue_module_lookup(
        self,
        module: ShardedModule,
        context: FusedLookupPipelineContext,
        tables_ready: Optional[torch.Event],
        defer_errors: bool = True,
    ) -> None:
        name: str = module.forward.name  # pyre-ignore[16]
        if name not in context.input_dist_tensors_requests:
            raise PipelinedLookupUnavailableError(
                f"TrainPipelineFusedSparseDist: the input dist of module {name!r} for batch "
                f"{context.index} is not available for its lookup (available: "
                f"{sorted(context.input_dist_tensors_requests)}): it was consumed already. This "
                f"typically means {name!r} is called more than once in the model's forward: a "
                "pipelined embedding module (EBC, EC, ...) can be called once per forward, as in "
                "torchrec's TrainPipelineSparseDist. Call it once and reuse its output (or give "
                "each call its own module)."
            )
        module_ctx = context.module_contexts[name]
        request = context.input_dist_tensors_requests.pop(name)
        counters_before = [read() for read, _ in self._counter_sources.get(name, ())]
        if self._lookup_stream is None:
            # CPU: no streams; the all-to-all runs on gloo's worker thread.
            kjt = request.wait()
            self._compute_and_output_dist(module, context, module_ctx, kjt, defer_errors)
            self._record_lookup(context, module, counters_before)
            return
        dev = torch.get_device_module(self._device)
        main = dev.current_stream()
        dist_stream = self._data_dist_stream
        if dist_stream is None:
            raise RuntimeError(
                f"TrainPipelineFusedSparseDist: device {self._device} has a lookup stream but "
                "torchrec's TrainPipelineSparseDist created no data-dist stream for it "
                f"(expected one for device types {_STREAM_DEVICE_TYPES}); the input dist of "
                f"module {name!r} cannot be waited. Report this with your torchrec version."
            )
        with dev.stream(dist_stream):
            kjt = request.wait()
            input_ready = dist_stream.record_event()
        lookup = self._lookup_stream
        with dev.stream(lookup):
            lookup.wait_event(input_ready)
            if tables_ready is not None:
                lookup.wait_event(tables_ready)
            # The KJT and module context were allocated on the data-dist stream;
            # register every other stream that reads them.
            for consumer in (lookup, main):
                if consumer != dist_stream:
                    kjt.record_stream(consumer)
                    module_ctx.record_stream(consumer)
            self._compute_and_output_dist(module, context, module_ctx, kjt, defer_errors)
            context.lookup_events[name] = lookup.record_event()
        self._record_lookup(context, module, counters_before)

    @staticmethod
    def _compute_and_output_dist(
        module: ShardedModule,
        context: FusedLookupPipelineContext,
        module_ctx: Any,
        kjt: Any,
        defer_errors: bool = True,
    ) -> None:
        """Issues ``module``'s lookup and output all-to-all into ``context``; with
        ``defer_errors`` an exception it raises is kept in ``context.lookup_errors``
        and raised by the module's pipelined forward, where torchrec's pipeline
        looks it up."""
        name: str = module.forward.name  # pyre-ignore[16]
        try:
            context.embedding_a2a_requests[name] = module.compute_and_output_dist(module_ctx, kjt)
        except Exception as error:  # noqa: BLE001 - raised again by the module's forward
            if not defer_errors:
                raise
            context.lookup_errors[name] = error

    def _record_lookup(
        self,
        context: FusedLookupPipelineContext,
        module: ShardedModule,
        counters_before: List[Any],
    ) -> None:
        """Records what an issued lookup read and how it moved the counters of its
        :func:`lookup_counter_sources` (TBEs, fbgemm-backed tiered shards)."""
        name: str = module.forward.name  # pyre-ignore[16]
        after = [read() for read, _ in self._counter_sources.get(name, ())]
        context.lookup_counters[name] = list(zip(counters_before, after))
        context.lookup_inputs[name] = self._lookup_inputs(module)

    def start_embedding_lookup(
        self,
        context: FusedLookupPipelineContext,
        modules: Sequence[ShardedModule],
        tables_updated: Optional[torch.Event] = None,
    ) -> None:
        """Issues the lookup and output all-to-all of ``modules`` for ``context``'s batch.

        On CUDA the lookup stream first waits on an event of the default stream:
        ``tables_updated`` (recorded after the backward, which updated the fused
        tables) for modules whose tables the dense optimizer does not write, so
        their lookup runs concurrently with the optimizer kernels; else (and for
        the modules of ``after_optimizer_modules``) one recorded now, so that
        everything enqueued there so far - backward, and the optimizer if already
        issued - precedes the lookup.

        Args:
            context (FusedLookupPipelineContext): the batch's context; its input
                dist must have been waited (``wait_sparse_data_dist``).
            modules (Sequence[ShardedModule]): pipelined modules to look up.
            tables_updated (Optional[torch.Event]): the default stream's event
                after the backward of the previous batch (None: record one now).
        """
        if not modules:
            return
        context.lookup_mode = self._lookup_mode()
        with StageTimer(self.stats, STAGE_LOOKUP, f"## start_embedding_lookup {context.index} ##"):
            # wait for what is enqueued now: no ``tables_updated``, or dense-updated tables
            waits_now = [tables_updated is None or m.forward.name in self._after_opt_modules  # pyre-ignore[16]
                         for m in modules]
            now = self._main_stream_event() if any(waits_now) else None
            for module, wait_now in zip(modules, waits_now):
                if context.lookup_errors:
                    # an earlier lookup of this batch raised: torchrec's forward
                    # stops there, so no further lookup (nor its all-to-all) is issued
                    context.deferred_lookups.add(module.forward.name)  # pyre-ignore[16]
                    continue
                self._issue_module_lookup(module, context, now if wait_now else tables_updated)

    def _lookup_in_forward(self, module: ShardedModule, context: FusedLookupPipelineContext) -> None:
        """Looks ``module`` up from inside the forward (a lookup deferred because an
        earlier one of the batch raised), as torchrec's pipeline does: its
        exceptions propagate from the forward.

        Args:
            module (ShardedModule): the pipelined module the forward calls.
            context (FusedLookupPipelineContext): the batch's context.
        """
        with StageTimer(self.stats, STAGE_LOOKUP, f"## embedding_lookup_in_forward {context.index} ##"):
            self._issue_module_lookup(module, context, self._main_stream_event(), defer_errors=False)

    def _lookup_mode(self) -> Tuple[bool, bool]:
        """(grad enabled, model.training): what a lookup's result depends on
        besides the tables (autograd graph, training-only kernel work)."""
        return torch.is_grad_enabled(), self._model.training

    def _stale_lookup_reason(self, context: FusedLookupPipelineContext) -> Optional[str]:
        """Why the lookup issued by the previous step is not what this step's
        forward would compute, or None: another grad/train mode (under
        ``no_grad`` in eval it has no autograd graph), a table written since
        (every in-place write bumps a tensor version; fbgemm's fused backward,
        which ran before the lookup, does not), or other fused optimizer
        hyper-parameters (learning rate)."""
        if context.lookup_mode != self._lookup_mode():
            return "mode"
        for m in self._pipelined_modules:
            if m.forward.name in context.deferred_lookups:  # pyre-ignore[16]
                continue  # looked up in the forward
            then = context.lookup_inputs.get(m.forward.name)  # pyre-ignore[16]
            now = self._lookup_inputs(m)
            if then is None or then[0] != now[0]:
                return "tables"
            if then[1] != now[1]:
                return "optimizer"
        return None

    def _note_relookup(self, reason: str) -> None:
        """Warns once when the fused learning rate changes at consecutive steps:
        every lookup is then done twice and nothing overlaps."""
        self._optimizer_relookup_streak = self._optimizer_relookup_streak + 1 if reason == "optimizer" else 0
        if self._optimizer_relookup_streak == 2 and not self._warned_optimizer_relookups:
            self._warned_optimizer_relookups = True
            warnings.warn(
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
                "step.",
                RuntimeWarning,
                stacklevel=3,
            )

    def _lookup_inputs(self, module: ShardedModule) -> Tuple[Any, ...]:
        """What ``module``'s lookup reads besides the batch: ``tables_version``
        and, per fbgemm TBE, the learning rate and optimizer arguments it hands
        its backward (taken at lookup time, set by torchrec's fused optimizers
        in ``zero_grad()`` / ``step()``), and per tiered table its optimizer
        hyper-parameters (also taken at lookup time, set by ``TieredFusedOptimizer``;
        host floats; a fbgemm-backed shard mirrors them into its TBE, whose
        ``learning_rate_tensor`` is therefore not read here)."""
        name = module.forward.name  # pyre-ignore[16]
        tbes = self._fused_tbes.get(name, ())
        return (
            tables_version(module),
            tuple((float(m.learning_rate_tensor), getattr(m, "optimizer_args", None)) for m in tbes)
            + tuple(tuple(vars(t.optimizer).values()) for t in self._tiered_shards.get(name, ())),
        )

    def _split_modules(self) -> Tuple[List[ShardedModule], List[ShardedModule]]:
        """(modules looked up after backward, modules looked up after the optimizer)."""
        early: List[ShardedModule] = []
        late: List[ShardedModule] = []
        for m in self._pipelined_modules:
            if self._embedding_lookup_after_opt or m.forward.name in self._after_opt_modules:  # pyre-ignore[16]
                late.append(m)
            else:
                early.append(m)
        return early, late

    def _fused_context(self, position: int) -> FusedLookupPipelineContext:
        """``self.contexts[position]``, checked to be a ``FusedLookupPipelineContext``.

        Raises:
            TypeError: the context was not built by ``_create_context()``.
        """
        context = self.contexts[position]
        if not isinstance(context, FusedLookupPipelineContext):
            got = type(context)
            raise TypeError(
                f"TrainPipelineFusedSparseDist: pipeline.contexts[{position}] (batch "
                f"{getattr(context, 'index', '?')}) is a {got.__module__}.{got.__qualname__}; "
                "expected a recpipe.pipeline.train.pipeline.FusedLookupPipelineContext (this "
                f"pipeline's context_type is {self._context_type.__qualname__}), which records "
                "whether the batch's embedding lookup was issued. Create contexts with "
                "pipeline._create_context() (it builds context_type) instead of constructing "
                f"{got.__qualname__} yourself; a subclass overriding _create_context() must "
                "return a FusedLookupPipelineContext subclass."
            )
        return context

    def _enqueue_before_forward(self, dataloader_iter: Iterator[Any], current: FusedLookupPipelineContext) -> None:
        """Loads batch i+2 before batch i's forward (torchrec's ``enqueue_batch``).

        With ``execute_all_batches=False`` an exhausted dataloader raises
        ``StopIteration`` here, before the forward: torchrec's pipeline ends
        without looking batch i up, so the lookup issued for it is taken back
        (its TBE ``step`` / ``iter`` increments; Adam and row-wise Adagrad count
        ``iter``) and, if ``progress()`` resumes batch i (a new dataloader), it
        is issued again at the start of that step.

        Args:
            dataloader_iter (Iterator[Any]): the batches.
            current (FusedLookupPipelineContext): batch i's context.

        Raises:
            StopIteration: the dataloader is exhausted and
                ``execute_all_batches=False``.
        """
        try:
            self.enqueue_batch(dataloader_iter)
        except StopIteration:
            self._drop_issued_lookup(current, input_dist_restarted=False, relookup=False)
            raise

    def _optimizer_step(self) -> None:
        with StageTimer(self.stats, STAGE_OPTIMIZER, f"## optimizer {self.contexts[0].index} ##"):
            self._optimizer.step()

    # ------------------------------------------------------------------ step

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Runs one training step (forward, backward, optimizer of batch i).

        Args:
            dataloader_iter (Iterator[Pipelineable]): the batches.

        Returns:
            Any: the model's output for batch i.

        Raises:
            StopIteration: when every batch has been processed.
            FusedLookupExactnessError: on attach, see the class docstring.
            TypeError: a context in ``contexts`` is not a
                ``FusedLookupPipelineContext`` (raised before the step runs).
        """
        self._state = PipelineState.IDLE
        if not self._model_attached:
            self.attach(self._model)
        self.fill_pipeline(dataloader_iter)
        if not self.batches:
            raise StopIteration

        # Every queued context is checked before anything of this step runs.
        current = self._fused_context(0)
        for position in range(1, len(self.contexts)):
            self._fused_context(position)
        try:
            return self._step(dataloader_iter, current)
        except Exception:
            # torchrec looks a batch up inside its forward: lookups issued early
            # that its pipeline would not have run by now are taken back.
            self._take_back_after_failure()
            raise

    def _step(self, dataloader_iter: Iterator[Any], current: FusedLookupPipelineContext) -> Any:
        """The stages of one ``progress()`` call (see the class docstring)."""
        self._set_module_context(current)
        if self._model.training:
            # torchrec's fused optimizers hand the learning rate to the TBEs here,
            # before the lookup of this batch (inside the forward in torchrec).
            with record_function("## zero_grad ##"):
                self._optimizer.zero_grad()
        if current.lookup_started and not current.forward_started:
            # (a batch whose forward already ran and raised is not looked up again:
            # torchrec's retried forward fails on its consumed input dist)
            reason = self._stale_lookup_reason(current)
            if reason is not None:
                self._note_relookup(reason)
                self._drop_issued_lookup(current, input_dist_restarted=False)
            else:
                self._optimizer_relookup_streak = 0
        if not current.lookup_started:
            # First batch (nothing earlier to overlap with), after reset/attach, a
            # change of mode, a table write or a new fused learning rate.
            self._finish_input_dist(current, self.batches[0])
            self.start_embedding_lookup(current, self._pipelined_modules)
            current.lookup_started = True

        self._wait_for_batch()

        if self._clear_data_dist_inputs:
            self.clear_sparse_data_dist_inputs(current)

        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])

        if not self._enqueue_batch_after_forward:
            self._enqueue_before_forward(dataloader_iter, current)

        with record_function(f"## forward {current.index} ##"):
            self._state = PipelineState.CALL_FWD
            losses, output = self._model_fwd(self.batches[0])

        if self._enqueue_batch_after_forward:
            self.enqueue_batch(dataloader_iter)

        nxt: Optional[FusedLookupPipelineContext] = None
        if len(self.batches) >= 2:
            nxt = self._fused_context(1)
            if self._lookup_stream is not None and self._lookup_stream is self._data_dist_stream:
                # CUDA, lookups on the data-dist stream: the forward read the output
                # all-to-all's receive buffers (allocated on that stream) on the
                # default stream and dropped them; the data-dist stream waits for the
                # forward before it allocates again, else the caching allocator may
                # hand those blocks to batch i+1's input dist while they are read
                self._data_dist_stream.wait_stream(torch.get_device_module(self._device).current_stream())
            self.wait_sparse_data_dist(nxt)

        if self._model.training:
            self._state = PipelineState.CALL_BWD
            self._backward(losses)
            self.sync_embeddings(
                self._model, self._dmp_collection_sync_interval_batches, current
            )
            # CUDA: the fused tables are updated; lookups of tables the dense
            # optimizer does not write wait for this, not for the optimizer
            tables_updated = self._main_stream_event()
            early, late = self._split_modules()
            if nxt is not None:
                self.start_embedding_lookup(nxt, early, tables_updated)
            self._optimizer_step()
            if nxt is not None:
                self.start_embedding_lookup(nxt, late, tables_updated)
                nxt.lookup_started = True
        elif nxt is not None:
            self.start_embedding_lookup(nxt, self._pipelined_modules)
            nxt.lookup_started = True

        self.stats.steps += 1
        self.dequeue_batch()
        return output
