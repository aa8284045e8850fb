"""TensorBoard logging on rank 0, including per-table tier statistics.

Tags: ``train/loss``, ``train/samples_per_s``, ``train/step_ms`` (training time only),
``train/staleness`` (every step: 1 when the step's batch was looked up from tables one step stale,
``--pipeline semi_sync``; else 0), ``eval/auroc``, ``tier/<table>/<stat>`` (from every :class:`TierStatsProvider`),
``dynamic/<table>/<counter>`` (the :data:`DYNAMIC_COUNTERS` of a dynamic table) and
``placement/plan`` and ``run/pipeline`` (text: which train pipeline ran).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Protocol, runtime_checkable

from torch import nn
from torch.utils.tensorboard import SummaryWriter

from recpipe.pipeline.checkpoint.collectives import all_gather, rank_world

TierStats = dict[str, dict[str, float]]


@runtime_checkable
class TierStatsProvider(Protocol):
    """Any (sharded) table module reporting ``{table_name: {stat_name: value}}`` tier statistics."""

    def tier_stats(self) -> TierStats:
        """Per-table statistics since the last call (or since start)."""
        ...


# Ratio stats and the count each one is a fraction of (merged as the weighted mean).
RATIO_WEIGHTS: Mapping[str, str] = {
    "hit_rate": "lookups",
    "fast_fraction": "lookups",
    "cumulative_hit_rate": "cumulative_lookups",
}


# The key-index counters a dynamic table's stats add (a table reporting ``occupancy`` is dynamic):
# rows held, keys given a row, rows evicted, unseen keys not yet admitted, keys that found no slot.
# All are counts, summed over ranks by merge_tier_stats.
DYNAMIC_COUNTERS: tuple[str, ...] = ("occupancy", "inserted", "evicted", "not_admitted", "failed")


def merge_tier_stats(parts: Iterable[Mapping[str, Mapping[str, float]]]) -> TierStats:
    """Merges several providers' or ranks' stats of the same tables.

    Ratios (names ending in ``rate`` / ``fraction``) are averaged, weighted by their
    :data:`RATIO_WEIGHTS` count when every part reports it; other stats are summed.
    """
    merged: dict[str, dict[str, list[tuple[float, float | None]]]] = {}
    for part in parts:
        for table, stats in part.items():
            for name, value in stats.items():
                weight = stats.get(RATIO_WEIGHTS.get(name, ""))
                merged.setdefault(table, {}).setdefault(name, []).append(
                    (float(value), None if weight is None else float(weight))
                )

    def combine(name: str, values: list[tuple[float, float | None]]) -> float:
        if not name.endswith(("rate", "fraction")):  # RATIO_WEIGHTS' names among them
            return sum(v for v, _ in values)
        weighted = [(v, w) for v, w in values if w is not None]
        total = sum(w for _, w in weighted)
        if len(weighted) == len(values) and total > 0:
            return sum(v * w for v, w in weighted) / total
        return sum(v for v, _ in values) / len(values)

    return {table: {name: combine(name, vals) for name, vals in stats.items()} for table, stats in merged.items()}


def collect_tier_stats(model: nn.Module) -> TierStats:
    """Stats of the outermost :class:`TierStatsProvider` modules in ``model`` (nested ones would count twice)."""
    providers: list[tuple[str, TierStatsProvider]] = []
    for name, m in model.named_modules():
        if isinstance(m, TierStatsProvider) and not any(name.startswith(outer + ".") for outer, _ in providers):
            providers.append((name, m))
            if name == "":
                break  # the model itself reports everything
    return merge_tier_stats(m.tier_stats() for _, m in providers)


def gather_tier_stats(model: nn.Module) -> TierStats:
    """:func:`collect_tier_stats` merged over all ranks (a collective: every rank calls it at the same step)."""
    local = collect_tier_stats(model)
    world = rank_world(None)[1]
    return local if world == 1 else merge_tier_stats(p for p in all_gather(local, world, None) if p)


class RunLogger:
    """Writes a run's scalars and text to TensorBoard (a no-op when ``log_dir`` is None).

    Args:
        purge_step: a resumed run's first step: TensorBoard drops the events an earlier
            run wrote from there on, so no tag has duplicate steps (``None``: fresh run).
    """

    def __init__(self, log_dir: str | None, purge_step: int | None = None) -> None:
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step) if log_dir else None

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Writes scalar ``values`` at ``step``; non-finite values raise (they hide bugs)."""
        if self._writer is None:
            return
        for tag, value in values.items():
            if not math.isfinite(value):
                raise FloatingPointError(f"{tag} is {value} at step {step}")
            self._writer.add_scalar(tag, value, global_step=step)

    def tier_stats(self, step: int, stats: TierStats) -> None:
        """Writes ``tier/<table>/<stat>`` scalars; a dynamic table's (one reporting ``occupancy``)
        :data:`DYNAMIC_COUNTERS` as ``dynamic/<table>/<counter>`` instead."""
        values: dict[str, float] = {}
        for table, s in sorted(stats.items()):
            dynamic = "occupancy" in s
            for name, v in s.items():
                group = "dynamic" if dynamic and name in DYNAMIC_COUNTERS else "tier"
                values[f"{group}/{table}/{name}"] = v
        self.scalars(step, values)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        """Writes a text entry (rendered as markdown; indented as a code block)."""
        if self._writer is not None:
            block = "\n".join("    " + line for line in text.splitlines())
            self._writer.add_text(tag, block, global_step=step)

    def flush(self) -> None:
        """Flushes pending events to disk."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
