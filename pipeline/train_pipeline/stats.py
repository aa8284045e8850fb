"""Per-stage host wall-clock timing of a sparse-dist train pipeline.

Owns ``PipelineStageStats``, ``StageTimer`` and ``TimedLazyAwaitable``, which times an
output-dist wait where the model first uses the embeddings (the bench wraps torchrec's
``TrainPipelineSparseDist`` the same way). Imports no recpipe module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generic, Optional, TypeVar

from torch.profiler import record_function
from torchrec.distributed.types import Awaitable, LazyAwaitable, LazyGetItemMixin

W = TypeVar("W")

# Stage names, in step order; the keys of ``PipelineStageStats.seconds``.
STAGE_LOOKUP = "embedding_lookup"
STAGE_OUTPUT_DIST_WAIT = "output_dist_wait"
STAGE_OPTIMIZER = "optimizer"
STAGES = (STAGE_LOOKUP, STAGE_OUTPUT_DIST_WAIT, STAGE_OPTIMIZER)


@dataclass
class PipelineStageStats:
    """Host wall-clock seconds spent per stage, summed over ``steps`` steps.

    On CUDA these are host-side times (kernel enqueue plus any host synchronisation):
    the output-dist wait measures how long the host blocks on the collective.
    """

    steps: int = 0
    """Training steps counted (one per ``progress`` call that ran a batch)."""

    seconds: Dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    """Summed seconds per stage name (keys: ``STAGES``)."""

    relookups: int = 0
    """Batches whose early lookup was discarded and issued again; 0 in uninterrupted training."""

    def add(self, stage: str, seconds: float) -> None:
        """Adds ``seconds`` to ``stage`` (one of ``STAGES``)."""
        if stage not in self.seconds:
            raise KeyError(f"unknown pipeline stage {stage!r}; expected one of {STAGES}")
        self.seconds[stage] += seconds

    def reset(self) -> None:
        """Zeroes every counter (e.g. after warm-up steps)."""
        self.steps = self.relookups = 0
        self.seconds.update(dict.fromkeys(self.seconds, 0.0))

    def per_step_ms(self) -> Dict[str, float]:
        """Stage name -> mean milliseconds per step (0.0 before any step)."""
        n = max(self.steps, 1)
        return {stage: 1e3 * s / n for stage, s in self.seconds.items()}


class StageTimer:
    """Context manager: a ``record_function(label)`` whose elapsed time is added to
    ``stats`` (None: label only) under ``stage``."""

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
    """Wraps an output-dist awaitable, still lazy; times its ``wait()`` into ``STAGE_OUTPUT_DIST_WAIT``.

    ``on_ready`` is called with the result (the pipeline registers the consumer stream there).
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
    awaitable: Any, stats: Optional[PipelineStageStats], label: str, on_ready: Optional[Callable[[Any], None]] = None
) -> Any:
    """Wraps an awaitable, or each of a tuple/list of them (managed-collision modules),
    in ``TimedLazyAwaitable``; returns the same structure."""
    if isinstance(awaitable, (tuple, list)):
        return type(awaitable)(time_awaitable_tree(a, stats, label, on_ready) for a in awaitable)
    if isinstance(awaitable, Awaitable):
        return TimedLazyAwaitable(awaitable, stats, label, on_ready)
    raise TypeError(
        f"expected an Awaitable (or a tuple of them) from compute_and_output_dist, got {type(awaitable).__name__}"
    )
