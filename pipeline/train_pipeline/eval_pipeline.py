"""``EvalPipelinePrefetch``: an evaluation pipeline whose next batches' input dist and
embedding lookup run ahead of the current batch's dense forward.

Eval reads the tables and writes nothing, so looking batch B+1 up before batch B's forward
gives the outputs a plain ``model(batch)`` loop gives, bit for bit. Owns the eval schedule
and ``EvalPrefetchContext``; the lookup collaborators (``lookup``, ``take_back``, ``streams``,
``forward``) and their binding on attach come from ``lookup_pipeline``. Imports
``recpipe.pipeline.train_pipeline`` modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, cast

import torch
from torch.profiler import record_function
from torchrec.distributed.model_parallel import ShardedModule

from recpipe.pipeline.train_pipeline.context import FusedLookupPipelineContext
from recpipe.pipeline.train_pipeline.lookup_pipeline import FusedLookupPipelineBase, check_bool_flags, check_device
from recpipe.pipeline.train_pipeline.relookup import LookupInputs
from recpipe.pipeline.train_pipeline.stats import STAGE_LOOKUP, StageTimer

__all__ = ["EvalBatchStage", "EvalPipelinePrefetch", "EvalPrefetchContext"]

_WHO = "EvalPipelinePrefetch"


class EvalBatchStage(IntEnum):
    """How far an in-flight batch has gone, in order."""

    ENQUEUED = 0
    """Copied to the device; no collective issued."""
    SPLITS = 1
    """The input dist's splits all-to-all issued."""
    INPUT_DIST = 2
    """The input dist's tensors all-to-all issued."""
    LOOKUP = 3
    """The embedding lookup run and its output all-to-all issued."""


STAGE_TARGETS: Tuple[EvalBatchStage, ...] = (
    EvalBatchStage.LOOKUP,  # batch B: forwarded in this progress()
    EvalBatchStage.LOOKUP,  # batch B+1: looked up before B's forward
    EvalBatchStage.INPUT_DIST,  # batch B+2: its tensors all-to-all in flight during B's forward
    EvalBatchStage.SPLITS,  # batch B+3: its splits all-to-all in flight during B's forward
)
"""The stage each queue position reaches in a ``progress()`` before batch B's forward; its
length is the number of batches in flight."""


@dataclass
class EvalPrefetchContext(FusedLookupPipelineContext):
    """The fused pipeline's per-batch context plus how far the batch has gone."""

    stage: EvalBatchStage = EvalBatchStage.ENQUEUED


class _NoLookupInputs(LookupInputs):
    """Records nothing per lookup: eval tables are checked once per ``progress()`` instead
    (``_TableVersions``), not per lookup as the fused pipeline's relookup does."""

    def read(self, module: ShardedModule) -> Tuple[Any, ...]:
        return ()


class _TableVersions:
    """A number per pipelined module that grows whenever its tables are written in place
    (as ``relookup.tables_version``: its parameters' and buffers' version counters and its
    tiered tables' ``rows_writes``), read from tensors collected once, at attach."""

    def __init__(self) -> None:
        self._sources: Dict[str, Tuple[List[torch.Tensor], List[Any]]] = {}

    def bind(self, modules: Dict[str, torch.nn.Module], tiered_shards: Dict[str, List[Any]]) -> None:
        self._sources = {
            name: ([*module.parameters(), *module.buffers()], tiered_shards.get(name, []))
            for name, module in modules.items()
        }

    def read(self) -> Dict[str, int]:
        return {
            name: sum(t._version for t in tensors) + sum(shard.rows_writes for shard in shards)
            for name, (tensors, shards) in self._sources.items()
        }


def _check_arguments(model: Any, device: Any, flags: Dict[str, Any]) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{_WHO}: model must be a torch.nn.Module, got {type(model).__name__}.")
    check_device(_WHO, device)
    check_bool_flags(_WHO, flags, none_allowed=False)


class EvalPipelinePrefetch(FusedLookupPipelineBase):
    """Evaluation pipeline: batch B+1's input dist and embedding lookup overlap B's dense forward.

    Up to four batches are in flight (``STAGE_TARGETS``). A ``progress()`` on batch B:

    1. ``eval_embedding_lookup B+1``: waits B+1's input dist, runs its lookup and issues the
       output all-to-all;
    2. ``wait_sparse_data_dist B+2``: issues B+2's tensors all-to-all;
    3. ``copy_batch_to_gpu B+3`` and ``start_sparse_data_dist B+3``: its splits all-to-all;
    4. ``eval_forward B``: the model's forward, which waits B's output all-to-all (issued in
       the previous ``progress()``); returns the model's output (the second element of its
       ``(loss, output)``).

    Every collective thus has a dense forward between its issue and its wait. On CPU gloo's
    worker thread carries the all-to-alls while the main thread computes; on CUDA the lookup
    runs on the lookup stream, so batch B+1's lookup kernels overlap B's forward. The first
    ``progress()`` fills the pipeline; after the dataloader ends the in-flight batches are
    evaluated, then ``StopIteration`` is raised (also by every later call with that iterator).

    Eval is read-only: the forwards and lookups run under ``torch.no_grad()``, no optimizer
    exists, and the model's mode is the caller's. The model must be in eval mode
    (``model.eval()``): a model or submodule in training mode is refused, not switched,
    because training mode changes outputs and state (dropout, batch norm, a managed-collision
    module's profiling; a dynamic table inserts unseen keys when grad is on) and the caller
    owns the mode. Outputs are bit-identical to
    ``model.eval(); with torch.no_grad(): model(batch)`` per batch, for every table kind
    (torchrec FUSED / DENSE, recpipe tiered and dynamic tables) and sharding type.

    Tables must not be written while lookups are in flight (between two ``progress()``
    calls); after such a write (``load_state_dict``, ``load_global_weights``) call
    ``attach()`` on every rank: it discards the in-flight lookups and input dists and the
    next ``progress()`` issues them again. A write is detected through the tables' version
    counters and refused with a ``RuntimeError``. ``reset()`` drops the in-flight batches
    (their lookups' TBE / tiered counters are taken back); ``detach()`` gives the model
    back with its original forwards, keeping the in-flight batches, which the next
    ``progress()`` (or ``attach()``) looks up again.

    Args:
        model (torch.nn.Module): the sharded model (``DistributedModelParallel``); its
            forward returns ``(loss, output)``, as torchrec's pipelines expect.
        device (torch.device): the compute device.
        apply_jit (bool): torchrec's: ``torch.jit.script`` the non-pipelined modules.
        pipeline_postproc (bool): torchrec's: pipeline postproc modules.
        custom_model_fwd (Optional[Callable]): torchrec's: called instead of the model with
            the batch; returns ``(loss, output)``.
        use_emb_lookup_stream (bool): CUDA: the lookups run on a dedicated stream (its own
            caching-allocator pool) instead of torchrec's data-dist stream. Selects nothing
            on CPU.

    Raises:
        TypeError: a model that is not a module, a device that is not a ``torch.device``
            or a flag that is not a bool.
    """

    _in_forward_label = "eval_embedding_lookup_in_forward"
    _model_attached: bool  # torchrec's, set by its __init__ / attach / detach

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        *,
        apply_jit: bool = False,
        pipeline_postproc: bool = False,
        custom_model_fwd: Optional[Callable[[Optional[Any]], Tuple[torch.Tensor, Any]]] = None,
        use_emb_lookup_stream: bool = False,
    ) -> None:
        _check_arguments(
            model,
            device,
            {
                "apply_jit": apply_jit,
                "pipeline_postproc": pipeline_postproc,
                "use_emb_lookup_stream": use_emb_lookup_stream,
            },
        )
        super().__init__(
            model=model,
            # eval has no optimizer; torchrec's base calls it only for a model in training mode
            optimizer=cast(torch.optim.Optimizer, None),
            device=device,
            execute_all_batches=True,
            apply_jit=apply_jit,
            context_type=EvalPrefetchContext,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
        )
        self._custom_model_fwd = custom_model_fwd is not None
        self._init_lookup_parts(device, "new" if use_emb_lookup_stream else "data_dist", _NoLookupInputs())
        self._model_pipelined = False
        self._table_versions = _TableVersions()
        self._versions: Dict[str, int] = {}
        self._mode_modules: List[torch.nn.Module] = []

    # ------------------------------------------------------------------ public API
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Evaluates the next batch; returns the model's output for it.

        Raises:
            StopIteration: every batch of ``dataloader_iter`` has been evaluated.
            ValueError: the model (or a submodule) is in training mode.
            RuntimeError: tables were written while lookups were in flight (call ``attach()``).
        """
        self._check_eval_mode()
        if not self._model_attached:
            self.attach(self._model)
        self._check_tables_unchanged()
        try:
            with torch.no_grad():
                self._advance_all(dataloader_iter)
                if not self.batches:
                    raise StopIteration
                return self._forward_first()
        finally:  # what this call's own lookups wrote (a CACHING tier's fills) is no table write
            if self._model_pipelined:
                self._versions = self._table_versions.read()

    def attach(self, model: Optional[torch.nn.Module] = None, sparse_dist: bool = True) -> None:
        """Attaches ``model`` (None: the current one) and discards the in-flight batches'
        lookups and input dists (the tables may have changed); the next ``progress()`` issues
        them again on the model as it is then. Call on every rank (their collectives match).

        Args:
            model (Optional[torch.nn.Module]): the model to evaluate from now on.
            sparse_dist (bool): torchrec's signature; every in-flight batch's input dist is
                issued again whatever its value.
        """
        self._drop_in_flight_work()
        if self._model_attached and self._model_pipelined:
            super().detach()  # the original forwards back before the model is rewritten again
        if model is not None:
            self._model = model
            if not self._custom_model_fwd:
                self._model_fwd = model
        self._model_attached = True
        self._model_pipelined = False

    def detach(self) -> torch.nn.Module:
        """Gives back the model with its original forwards (torchrec); the in-flight batches
        are kept and looked up again when the model is attached. On CUDA the default stream
        first waits for the lookups, so a write to the detached model cannot race them."""
        model = super().detach()
        self._model_pipelined = False
        return model

    def reset(self) -> None:
        """Drops the in-flight batches (torchrec), first completing their issued collectives
        and taking back their lookups' counters. Call on every rank."""
        self._drop_in_flight_work()
        super().reset()

    # ------------------------------------------------------------------ torchrec hooks
    def _on_pipelined(self, modules: Dict[str, torch.nn.Module], tiered_shards: Dict[str, List[Any]]) -> None:
        """After torchrec rewrote the model and the lookup collaborators were bound: collects the
        tables' version sources and the modules whose mode ``progress()`` checks."""
        self._table_versions.bind(modules, tiered_shards)
        self._mode_modules = list(self._model.modules())
        self._model_pipelined = True

    # ------------------------------------------------------------------ the schedule
    def _advance_all(self, dataloader_iter: Iterator[Any]) -> None:
        """Brings each queue position to its ``STAGE_TARGETS`` stage, loading batches as needed."""
        for position, target in enumerate(STAGE_TARGETS):
            if position >= len(self.batches) and not self.enqueue_batch(dataloader_iter):
                return
            self._advance(position, target)

    def _advance(self, position: int, target: EvalBatchStage) -> None:
        """Issues the collectives and lookup that take the batch at ``position`` to ``target``."""
        context = self._eval_context(position)
        while context.stage < target:
            if context.stage == EvalBatchStage.ENQUEUED:
                if self._model_pipelined:
                    self.start_sparse_data_dist(self.batches[position], context)
                else:  # the first batch after construction or attach(): rewrite the model
                    self._pipeline_model(self.batches[position], context, self._pipelined_forward_type)
                context.stage = EvalBatchStage.SPLITS
            elif context.stage == EvalBatchStage.SPLITS:
                self.wait_sparse_data_dist(context)
                context.stage = EvalBatchStage.INPUT_DIST
            else:
                with StageTimer(self.stats, STAGE_LOOKUP, f"## eval_embedding_lookup {context.index} ##"):
                    self._lookups.issue_all(self._pipelined_modules, context, None, set())
                context.lookup_started = True
                context.stage = EvalBatchStage.LOOKUP

    def _forward_first(self) -> Any:
        """Runs the forward of the batch at the head of the queue and dequeues it."""
        context = self._eval_context(0)
        self._set_module_context(context)
        self._wait_for_batch()
        with record_function(f"## eval_forward {context.index} ##"):
            _, output = self._model_fwd(self.batches[0])
        # CUDA, lookups on the data-dist stream: the next input dist must not reuse the
        # output all-to-all's receive buffers the forward read
        self._streams.data_dist_waits_for_forward()
        self.stats.steps += 1
        self.dequeue_batch()
        return output

    def _drop_in_flight_work(self) -> None:
        """Completes and discards every in-flight batch's issued lookups (taking back their
        counters) and input dists; each batch starts again from ``ENQUEUED``. A splits
        all-to-all is dropped unwaited (waiting it would issue a new collective)."""
        for position, context in enumerate(self.contexts):
            if isinstance(context, FusedLookupPipelineContext):
                self._take_back.drop_issued_lookup(context, input_dist_restarted=True, relookup=False)
            self.contexts[position] = self._context_type(index=context.index, version=1)

    # ------------------------------------------------------------------ checks
    def _eval_context(self, position: int) -> EvalPrefetchContext:
        context = self.contexts[position]
        if not isinstance(context, EvalPrefetchContext):
            raise TypeError(
                f"{_WHO}: pipeline.contexts[{position}] is a {type(context).__qualname__}, expected an "
                "EvalPrefetchContext (it records how far the batch has gone). Create contexts with "
                "pipeline._create_context()."
            )
        return context

    def _check_eval_mode(self) -> None:
        """Refuses a model, or any of its submodules, in training mode (the modules are
        collected once per attach)."""
        if self._model_pipelined and not any(m.training for m in self._mode_modules):
            return
        for name, module in self._model.named_modules():
            if module.training:
                what = "the model" if not name else f"its submodule {name!r} ({type(module).__name__})"
                raise ValueError(
                    f"{_WHO}: {what} is in training mode (training=True). In training mode the "
                    "outputs and the model's state differ from evaluation's (dropout, batch-norm "
                    "statistics, a managed-collision module's profiling and eviction), and this "
                    "pipeline does not switch the mode the caller owns. Fix: call model.eval() "
                    "before progress() (and model.train() after the evaluation)."
                )

    def _check_tables_unchanged(self) -> None:
        """Refuses tables written since the last ``progress()`` while lookups are in flight."""
        if not self._model_pipelined or not any(
            isinstance(c, EvalPrefetchContext) and c.stage == EvalBatchStage.LOOKUP for c in self.contexts
        ):
            return
        now = self._table_versions.read()
        changed = sorted(name for name, version in now.items() if self._versions.get(name) != version)
        if changed:
            raise RuntimeError(
                f"{_WHO}: the tables of pipelined module(s) {changed} were written since the last "
                "progress(), while lookups of the next batches were in flight: their outputs "
                "would come from the old tables. Fix: after writing the tables, call "
                "pipeline.attach() on every rank; it discards the in-flight lookups and the "
                "next progress() issues them again."
            )
