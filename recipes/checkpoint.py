"""Checkpoints for exact resume: one file per rank, restored in place.

Every rank saves its local view of the model and optimizer state: plain tensors, and
for each ``ShardedTensor`` its local shards with their offsets. Loading copies the
saved values into the live tensors of a freshly built run (the same tensors
``state_dict()`` returns, so fused table weights and their optimizer state are
updated where they live). A checkpoint is only valid for the same world size,
table placement and model shape; anything else raises :class:`CheckpointMismatchError`
(resharding across world sizes belongs to the tables' own export, ARCHITECTURE.md).

Layout::

    <checkpoint_dir>/step_00000040/rank0.pt, rank1.pt
    <checkpoint_dir>/latest          # "40", written by rank 0 after all ranks saved
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recpipe.pipeline.ops import ROUTING_VERSION
from recpipe.pipeline.sharders import TIERED_STATE_KEY
from recpipe.recipes.config import TrainConfig

# Config fields that change the state's shapes or the data order: a resumed run must match.
FINGERPRINT_FIELDS: tuple[str, ...] = (
    "model",
    "dataset",
    "batch_size",
    "embedding_dim",
    "num_embeddings",
    "virtual_rows",
    "hash_k",
    "dense_arch",
    "over_arch",
    "seed",
    "synthetic_id_space",
    "zipf_alpha",
    "eval_fraction",
)
_SHARDED = "__sharded_local_shards__"


class CheckpointMismatchError(RuntimeError):
    """The checkpoint was written by a run with another world size, placement or model."""


def _to_saved(obj: Any) -> Any:
    if isinstance(obj, ShardedTensor):
        return {
            _SHARDED: [
                (list(s.metadata.shard_offsets), s.tensor.detach().clone())
                for s in obj.local_shards()
            ]
        }
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _to_saved(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_saved(v) for v in obj)
    return obj


def _restore(live: Any, saved: Any, where: str) -> None:
    if isinstance(live, ShardedTensor):
        shards = live.local_shards()
        if not (isinstance(saved, dict) and _SHARDED in saved) or len(saved[_SHARDED]) != len(shards):
            raise CheckpointMismatchError(f"{where}: local shards differ from the checkpoint's")
        for shard, (offsets, value) in zip(shards, saved[_SHARDED]):
            if list(shard.metadata.shard_offsets) != offsets or shard.tensor.shape != value.shape:
                raise CheckpointMismatchError(
                    f"{where}: shard at {list(shard.metadata.shard_offsets)} {tuple(shard.tensor.shape)} "
                    f"!= saved {offsets} {tuple(value.shape)}"
                )
            shard.tensor.copy_(value)
        return
    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or live.shape != saved.shape:
            raise CheckpointMismatchError(f"{where}: shape {tuple(live.shape)} differs from the checkpoint's")
        live.copy_(saved)
        return
    if isinstance(live, dict):
        if not isinstance(saved, dict) or set(live) != set(saved):
            missing = sorted(map(str, set(live) - set(saved or {})))
            extra = sorted(map(str, set(saved or {}) - set(live)))
            raise CheckpointMismatchError(f"{where}: keys differ (missing {missing[:5]}, extra {extra[:5]})")
        for k in live:
            _restore(live[k], saved[k], f"{where}.{k}")
        return
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(live) != len(saved):
            raise CheckpointMismatchError(f"{where}: length differs from the checkpoint's")
        for i, (a, b) in enumerate(zip(live, saved)):
            _restore(a, b, f"{where}[{i}]")
    # Other leaves (learning rates, flags) come from the config, not the checkpoint.


def fingerprint(config: TrainConfig) -> dict[str, Any]:
    """The config values a checkpoint must agree with."""
    d = config.to_dict()
    return {k: d[k] for k in FINGERPRINT_FIELDS}


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` without the tiered tables' row exports.

    Those rows are saved once, under ``"tiered"``, where every rank's export can be
    read back whatever the routing (:func:`_restore_tiered`).
    """
    infix = f".{TIERED_STATE_KEY}."
    return {k: v for k, v in model.state_dict().items() if infix not in k}


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save_checkpoint(
    directory: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    table_ranks: dict[str, Any],
) -> Path:
    """Saves this rank's state at ``step`` (a collective: every rank must call it).

    Args:
        directory: checkpoint root.
        step: completed training steps.
        model: the DMP model.
        optimizer: the combined optimizer.
        config: the run's config (its fingerprint is stored).
        table_ranks: where each table lives (owner rank, or its planned placement);
            stored and checked on load.

    Returns:
        The step directory.
    """
    rank, world = _rank_world()
    step_dir = Path(directory) / f"step_{step:08d}"
    step_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "meta": {
            "step": step,
            "rank": rank,
            "world_size": world,
            "table_ranks": dict(table_ranks),
            "fingerprint": fingerprint(config),
            # row-wise shards in "model" hold rows in local-id order of this routing
            "routing_version": ROUTING_VERSION,
        },
        "model": _to_saved(_model_state(model)),
        "optimizer": _to_saved(optimizer.state_dict()),
        # torchrec's sharded state_dict skips CUSTOMIZED_KERNEL (tiered) tables:
        # they export (global id, value, optimizer state) themselves.
        "tiered": {
            fqn: m.tiered_state() for fqn, m in model.named_modules() if hasattr(m, "tiered_state")
        },
    }
    tmp = step_dir / f"rank{rank}.pt.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, step_dir / f"rank{rank}.pt")
    if world > 1:
        dist.barrier()
    if rank == 0:
        latest_tmp = Path(directory) / "latest.tmp"
        latest_tmp.write_text(str(step))
        os.replace(latest_tmp, Path(directory) / "latest")
    if world > 1:
        dist.barrier()
    return step_dir


def latest_step(directory: str) -> int | None:
    """The step of the newest complete checkpoint in ``directory``, or None."""
    p = Path(directory) / "latest"
    return int(p.read_text().strip()) if p.is_file() else None


def load_checkpoint(
    directory: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    table_ranks: dict[str, Any],
) -> int:
    """Restores this rank's state in place from the newest checkpoint.

    Args:
        directory: checkpoint root.
        model: freshly built DMP model (same config, world size and placement).
        optimizer: its combined optimizer, before any step.
        config: the run's config.
        table_ranks: this run's placement per table.

    Returns:
        The step to continue from.

    Raises:
        FileNotFoundError: no checkpoint in ``directory``.
        CheckpointMismatchError: world size, placement or model differ.
    """
    step = latest_step(directory)
    if step is None:
        raise FileNotFoundError(
            f"resume=True but {directory!r} has no checkpoint ('latest' missing). "
            "Fix: point --checkpoint-dir at a directory a previous run saved into, or drop --resume"
        )
    rank, world = _rank_world()
    path = Path(directory) / f"step_{step:08d}" / f"rank{rank}.pt"
    payload = torch.load(path, weights_only=False)
    meta = payload["meta"]
    problems = []
    if meta["world_size"] != world:
        problems.append(f"world size {meta['world_size']} (checkpoint) != {world} (now)")
    if meta["table_ranks"] != table_ranks:
        problems.append(f"placement {meta['table_ranks']} (checkpoint) != {table_ranks} (now)")
    saved_routing = meta.get("routing_version", 1)  # checkpoints before version 2 lack the key
    if saved_routing != ROUTING_VERSION:
        problems.append(
            f"hash_roundrobin routing version {saved_routing} (checkpoint) != {ROUTING_VERSION} (this recpipe): "
            "row-wise shards saved in local-id order would load into the wrong rows"
        )
    now = fingerprint(config)
    diff = {k: (meta["fingerprint"].get(k), now[k]) for k in now if meta["fingerprint"].get(k) != now[k]}
    if diff:
        problems.append(f"config fields differ (checkpoint, now): {diff}")
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {path} does not fit this run: " + "; ".join(problems) + ". Possible solutions:\n"
            f"  1. resume with the checkpoint's world size ({meta['world_size']}) and config values\n"
            "  2. start a fresh run (drop --resume or use another --checkpoint-dir)\n"
            "  3. on a routing version mismatch, resume with the recpipe release that wrote the checkpoint"
        )
    with torch.no_grad():
        _restore(_model_state(model), payload["model"], "model")
        _restore(optimizer.state_dict(), payload["optimizer"], "optimizer")
        _restore_tiered(model, Path(directory) / f"step_{step:08d}", world)
    return int(meta["step"])


def _restore_tiered(model: torch.nn.Module, step_dir: Path, world: int) -> None:
    """Loads tiered tables from the exports of every saving rank (global row ids).

    Each rank reads all ranks' exports and keeps the rows it owns, so no row is
    lost whatever the routing; the tables validate dist_type, seed, world size and
    shapes of the exports themselves.
    """
    modules = {fqn: m for fqn, m in model.named_modules() if hasattr(m, "load_tiered_state")}
    if not modules:
        return
    exports = [torch.load(step_dir / f"rank{r}.pt", weights_only=False).get("tiered", {}) for r in range(world)]
    for fqn, module in modules.items():
        per_table: dict[str, list[Any]] = {}
        for export in exports:
            if fqn not in export:
                raise CheckpointMismatchError(
                    f"checkpoint {step_dir} has no tiered tables for module {fqn!r}. Possible solutions:\n"
                    "  1. resume with the placement the checkpoint was saved with (--placement)\n"
                    "  2. start a fresh run (drop --resume or use another --checkpoint-dir)"
                )
            for table, state in export[fqn].items():
                per_table.setdefault(table, []).append(state)
        module.load_tiered_state(per_table)
