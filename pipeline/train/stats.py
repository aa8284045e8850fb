"""Per-stage timing of a sparse-dist train pipeline (host wall clock).

``PipelineStageStats`` accumulates, per training step, how long the host spends in
the stages the fused pipeline re-orders: issuing the embedding lookup and its
output all-to-all, blocking in the forward until the output all-to-all has
landed, and the dense optimizer step. ``TimedLazyAwaitable`` wraps a sharded
module's output-dist awaitable so the forward's blocking wait is measured where
it really happens (the model's first use of the embeddings), without changing
when that wait happens. The bench uses the same wrapper for torchrec's
``TrainPipelineSparseDist`` so both pipelines are measured the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generic, Optional, TypeVar

from torch.profiler import record_function
from torchrec.distributed.types import Awaitable, LazyAwaitable, LazyGetItemMixin

W = TypeVar("W")

# Stage names, in the order one step runs them; also the keys of
# ``PipelineStageStats.seconds``.
STAGE_LOOKUP = "embedding_lookup"
STAGE_OUTPUT_DIST_WAIT = "output_dist_wait"
STAGE_OPTIMIZER = "optimizer"
STAGES = (STAGE_LOOKUP, STAGE_OUTPUT_DIST_WAIT, STAGE_OPTIMIZER)


@dataclass
class PipelineStageStats:
    """Host wall-clock seconds spent per stage, summed over ``steps`` steps.

    On CPU these are the real stage costs. On CUDA they are host-side times
    (kernel enqueue, plus any host synchronisation the stage performs): the
    output-dist wait then measures how long the host blocks on the collective.

    Example::

        pipeline = TrainPipelineFusedSparseDist(model, optimizer, device)
        for _ in range(10):
            pipeline.progress(it)
        print(pipeline.stats.per_step_ms())
    """

    steps: int = 0
    """Training steps counted (one per ``progress`` call that ran a batch)."""

    seconds: Dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    """Summed seconds per stage name (keys: ``STAGES``)."""

    relookups: int = 0
    """Batches whose early lookup was discarded and issued again (``attach()``,
    a train/eval or grad-mode switch, tables written or a new fused learning
    rate between steps); 0 in uninterrupted training."""

    def add(self, stage: str, seconds: float) -> None:
        """Adds ``seconds`` to ``stage``.

        Args:
            stage (str): one of ``STAGES``.
            seconds (float): wall-clock seconds to add.
        """
        if stage not in self.seconds:
            raise KeyError(f"unknown pipeline stage {stage!r}; expected one of {STAGES}")
        self.seconds[stage] += seconds

    def reset(self) -> None:
        """Zeroes every counter (e.g. after warm-up steps)."""
        self.steps = 0
        self.relookups = 0
        for stage in self.seconds:
            self.seconds[stage] = 0.0

    def per_step_ms(self) -> Dict[str, float]:
        """Mean milliseconds per step for every stage.

        Returns:
            Dict[str, float]: stage name -> ms per step (0.0 before any step).
        """
        n = max(self.steps, 1)
        return {stage: 1e3 * s / n for stage, s in self.seconds.items()}


class StageTimer:
    """Context manager: a ``record_function`` label plus a perf_counter accumulator.

    Args:
        stats (Optional[PipelineStageStats]): where to add the elapsed time; None
            only labels the region for the profiler.
        stage (str): stage name (one of ``STAGES``) to accumulate into.
        label (str): the ``record_function`` label shown in profiler traces.

    Example::

        with StageTimer(stats, STAGE_OPTIMIZER, "## optimizer 3 ##"):
            optimizer.step()
    """

    def __init__(self, stats: Optional[PipelineStageStats], stage: str, label: str) -> None:
        self._stats = stats
        self._stage = stage
        self._rf = record_function(label)
        self._t0 = 0.0

    def __enter__(self) -> "StageTimer":
        self._rf.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        elapsed = time.perf_counter() - self._t0
        self._rf.__exit__(*exc)
        if self._stats is not None:
            self._stats.add(self._stage, elapsed)


class TimedLazyAwaitable(LazyGetItemMixin[Any, Any], LazyAwaitable[W], Generic[W]):
    """Wraps an output-dist awaitable; times its ``wait()`` into the stats.

    The wrapper stays lazy: the wait happens when the model first uses the
    embeddings (exactly as with the wrapped awaitable), and the blocking time is
    added to ``STAGE_OUTPUT_DIST_WAIT``.

    Args:
        inner (Awaitable[W]): the awaitable returned by
            ``ShardedModule.compute_and_output_dist``.
        stats (Optional[PipelineStageStats]): accumulator (None: label only).
        label (str): ``record_function`` label of the wait.
        on_ready (Optional[Callable[[W], None]]): called with the result once it
            is available (the pipeline registers the consumer stream there).

    Example::

        out = TimedLazyAwaitable(module.compute_and_output_dist(ctx, kjt), stats, "## wait ##")
    """

    def __init__(
        self,
        inner: Awaitable[W],
        stats: Optional[PipelineStageStats],
        label: str,
        on_ready: Optional[Callable[[W], None]] = None,
    ) -> None:
        super().__init__()
        self._inner = inner
        self._stats = stats
        self._label = label
        self._on_ready = on_ready

    def _wait_impl(self) -> W:
        with StageTimer(self._stats, STAGE_OUTPUT_DIST_WAIT, self._label):
            result = self._inner.wait()
        if self._on_ready is not None:
            self._on_ready(result)
        return result


def time_awaitable_tree(
    awaitable: Any,
    stats: Optional[PipelineStageStats],
    label: str,
    on_ready: Optional[Callable[[Any], None]] = None,
) -> Any:
    """Wraps an awaitable (or a tuple of them, as managed-collision modules return).

    Args:
        awaitable (Any): an ``Awaitable`` or a tuple/list of ``Awaitable``.
        stats (Optional[PipelineStageStats]): accumulator.
        label (str): ``record_function`` label of the wait.
        on_ready (Optional[Callable[[Any], None]]): see ``TimedLazyAwaitable``.

    Returns:
        Any: the same structure with every awaitable wrapped.
    """
    if isinstance(awaitable, (tuple, list)):
        return type(awaitable)(time_awaitable_tree(a, stats, label, on_ready) for a in awaitable)
    if isinstance(awaitable, Awaitable):
        return TimedLazyAwaitable(awaitable, stats, label, on_ready)
    raise TypeError(
        f"expected an Awaitable (or a tuple of them) from compute_and_output_dist, got "
        f"{type(awaitable).__name__}"
    )

