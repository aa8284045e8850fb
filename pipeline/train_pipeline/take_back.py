"""Taking back a lookup issued early that torchrec's pipeline would not have run.

A discarded early lookup (a step that raised, ``reset()``, ``attach()``, a relookup,
``StopIteration`` before the batch's forward) is completed, its results dropped, and the
counters it advanced restored: fbgemm TBEs' ``step`` / ``iter``, fbgemm-backed tiered
shards' lookup counters and MCH modules' profile counters. Owns the counter sources and
``LookupTakeBack``. Imports ``recpipe.pipeline.tiered.tbe_tables`` and train modules.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Sequence, Set, Tuple

import torch

from recpipe.pipeline.tiered.tbe_tables import tbe_counters, undo_tbe_lookup
from recpipe.pipeline.train_pipeline.context import FusedLookupPipelineContext
from recpipe.pipeline.train_pipeline.stats import PipelineStageStats
from recpipe.pipeline.train_pipeline.streams import LookupStreams

CounterSource = Tuple[Callable[[], Any], Callable[[Any, Any], None]]
"""``(read, undo)``: reads the counters a lookup advances; ``undo(before, after)`` takes one back."""

_MCH_COUNTERS = ("_current_iter", "_current_iter_tensor", "_current_history_buffer_offset", "_last_eviction_iter")


def fused_tbes(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The fbgemm TBEs (modules with a ``learning_rate_tensor``) of a sharded module, each once.

    torchrec keeps a sharded module's lookups in a plain list (``_lookups``), not as
    submodules, so every submodule's ``_lookups`` is searched too (a sharded MC-EBC / EC
    holds its sharded EBC / EC as a submodule).
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
            lookups = getattr(m, "_lookups", None)
            if isinstance(lookups, (list, tuple, torch.nn.ModuleList)):  # not another module's counter of that name
                roots.extend(lookups)
    return list(found.values())


def lookup_counter_sources(tbes: Sequence[torch.nn.Module], tiered_shards: Sequence[Any]) -> List[CounterSource]:
    """One ``(read, undo)`` per fbgemm TBE and per tiered shard of a sharded module.

    Tiered shards are duck-typed (``lookup_counters()`` / ``undo_lookup``): a fbgemm-backed
    shard counts steps at lookup time; a native one counts in the backward and reads None.
    """
    sources: List[CounterSource] = [
        (functools.partial(tbe_counters, tbe), functools.partial(undo_tbe_lookup, tbe)) for tbe in tbes
    ]
    sources += [
        (shard.lookup_counters, shard.undo_lookup)
        for shard in tiered_shards
        if callable(getattr(shard, "lookup_counters", None)) and callable(getattr(shard, "undo_lookup", None))
    ]
    return sources


def mch_counter_sources(module: torch.nn.Module) -> List[CounterSource]:
    """One ``(read, undo)`` per MCH module (duck-typed) of a managed-collision module.

    torchrec's ``MCHManagedCollisionModule.profile`` counts each training lookup and
    appends its ids to the input history; restoring them keeps eviction at torchrec's
    step. A lookup that coalesced the history (an eviction step) cannot be taken back.
    """
    return [
        (functools.partial(_mch_counters, m), functools.partial(_undo_mch_profile, m))
        for m in module.modules()
        if all(hasattr(m, attr) for attr in _MCH_COUNTERS)
    ]


def _mch_counters(mch: Any) -> Tuple[int, int, int]:
    """A managed-collision module's (iter, history offset, last eviction iter): host ints."""
    return (mch._current_iter, mch._current_history_buffer_offset, mch._last_eviction_iter)


def _undo_mch_profile(mch: Any, before: Tuple[int, int, int], after: Tuple[int, int, int]) -> None:
    if after[0] == before[0]:
        return  # not profiled (eval mode)
    if before[0] != -1 and after[2] != before[2]:
        return  # the history was coalesced (eviction): not reversible
    # One profile per lookup: the buffer moved by one (no host read of it).
    mch._current_iter_tensor.data -= 1
    mch._current_iter = before[0]  # -1: re-read from the buffer at the next profile
    mch._current_history_buffer_offset = before[1]
    mch._last_eviction_iter = before[2]


class LookupTakeBack:
    """Reads the counters a module's lookup advances, and takes discarded lookups back."""

    def __init__(self, streams: LookupStreams, stats: PipelineStageStats) -> None:
        self._streams = streams
        self._stats = stats
        self._sources: Dict[str, List[CounterSource]] = {}

    def bind(
        self,
        modules: Dict[str, torch.nn.Module],
        tbes: Dict[str, List[torch.nn.Module]],
        tiered_shards: Dict[str, List[Any]],
    ) -> None:
        """Finds the counter sources of every pipelined module, by name."""
        self._sources = {
            name: lookup_counter_sources(tbes[name], tiered_shards.get(name, ())) + mch_counter_sources(module)
            for name, module in modules.items()
        }

    def read(self, name: str) -> List[Any]:
        """The current readings of module ``name``'s counter sources."""
        return [read() for read, _ in self._sources.get(name, ())]

    def take_back_pending(self, context: FusedLookupPipelineContext) -> List[str]:
        """Completes ``context``'s lookups no forward consumed (and those that raised), drops
        their results and takes back their counters; returns those modules' names."""
        pending = list(context.embedding_a2a_requests) + list(context.lookup_errors)
        context.lookup_errors.clear()  # a lookup that raised is taken back too (counters)
        context.deferred_lookups.clear()
        self._streams.wait_and_drop(context.embedding_a2a_requests, self._streams.lookup)
        self._streams.main_waits_for_lookups()  # the undos below write counters the lookup advanced
        for name in pending:
            moves = context.lookup_counters.pop(name, ())
            for (_, undo), (before, after) in zip(self._sources.get(name, ()), moves):
                undo(before, after)
            context.lookup_events.pop(name, None)
        return pending

    def drop_issued_lookup(
        self, context: FusedLookupPipelineContext, input_dist_restarted: bool, relookup: bool = True
    ) -> None:
        """Completes and discards ``context``'s issued lookup (every rank does, so the
        collectives stay matched), taking back the lookups no forward consumed. Drops the old
        input-dist tensors if consumed or ``input_dist_restarted``; ``relookup`` counts it
        in ``stats.relookups``."""
        consumed_input_dist = context.lookup_started
        if context.lookup_started and relookup:
            self._stats.relookups += 1
        self.take_back_pending(context)
        context.forward_started = False
        context.lookup_counters.clear()
        context.lookup_events.clear()
        context.lookup_inputs.clear()
        context.lookup_started = False
        if input_dist_restarted or consumed_input_dist:
            self._streams.wait_and_drop(context.input_dist_tensors_requests, self._streams.data_dist)

    def after_failure(self, contexts: Sequence[Any]) -> None:
        """After a step raised, takes back the lookups torchrec's pipeline would not have run.

        A context whose forward has not started is dropped as after ``reset()``; one whose
        forward started keeps its state (a retried ``progress()`` fails as torchrec's does)
        and only the lookups its forward did not reach are taken back.
        """
        for context in contexts:
            if not isinstance(context, FusedLookupPipelineContext) or not (
                context.embedding_a2a_requests or context.lookup_errors
            ):
                continue
            if context.forward_started:
                self.take_back_pending(context)
            else:
                self.drop_issued_lookup(context, input_dist_restarted=False, relookup=False)
