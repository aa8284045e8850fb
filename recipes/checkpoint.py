"""Checkpoints for exact resume: one file per rank, verified on load, restored in place.

Every rank saves its local view of the model and optimizer state: plain tensors, and
for each ``ShardedTensor`` its local shards with their offsets. Loading copies the
saved values into the live tensors of a freshly built run (the same tensors
``state_dict()`` returns, so fused table weights and their optimizer state are
updated where they live). A checkpoint is only valid for the same world size,
table placement and model shape; anything else raises :class:`CheckpointMismatchError`
(resharding across world sizes belongs to the tables' own export, ARCHITECTURE.md).

Layout::

    <checkpoint_dir>/step_00000040/rank0.pt, rank1.pt   # each rank's state (torch.save)
    <checkpoint_dir>/step_00000040/manifest.json        # bytes + sha256 of every rank file
    <checkpoint_dir>/latest                              # "40"

With ``config.checkpoint_format == "dcp"`` the model (tiered tables included) and
its fused optimizer are written by torch.distributed.checkpoint
(:mod:`recpipe.pipeline.checkpoint.dcp`) into the same step directory (``.metadata``,
``__R_N.distcp``); each ``rankR.pt`` then holds the metadata and the dense optimizer
state, and the manifest records every file of the directory. The integrity checks and
the resume fallback are the same; such a checkpoint also loads under another world size
and the placement planned for it (rank ``r`` reads ``rank{r % W}.pt``; DCP and the
tiered exports reshard).

Saving (a collective) is crash-safe: the state is checked for NaN / inf first
(:class:`NonFiniteStateError`, nothing is written); each rank writes its file to a
temporary name in the step directory, fsyncs it and ``os.replace``-s it into place,
hashing the bytes as they are written; rank 0 gathers every rank's size and digest
and writes ``manifest.json`` (its own digest inside), then ``latest``, both
atomically. The manifest is the commit record of a step directory; ``latest`` names
the newest committed step. Rank 0 holds an exclusive ``flock`` on
``<checkpoint_dir>/.recpipe_save.lock`` during each save: a second run saving into the
same directory at that moment raises :class:`CheckpointWriteError` (naming the holder)
instead of mixing the two runs' files in one step directory.

Loading verifies before it touches the model: the manifest, then each file it
reads (size, sha256, unpickling, the file's own step / rank / world size), then the
metadata against this run (world size, placement, routing version, config
fingerprint) and the state's structure. A damaged file raises
:class:`CheckpointCorruptError` naming the file and what is wrong. Resuming
(:func:`load_checkpoint` without ``step``) instead falls back to the newest intact
checkpoint at or below ``latest`` (every step directory when ``latest`` is missing or
unreadable), printing one line (rank 0) that names what was skipped and why; with none intact
it raises :class:`NoIntactCheckpointError`. Rank 0 chooses the candidates and every
rank's verdict is gathered, so all ranks load the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from recpipe.pipeline.checkpoint import dcp as recpipe_dcp
from recpipe.pipeline.checkpoint.integrity import (SAVE_LOCK_NAME, SaveLock, acquire_save_lock, atomic_file, atomic_write_bytes,
                                         file_entry, file_problem, is_file_entry, json_digest, release_save_lock)
from recpipe.pipeline.routing.ops import ROUTING_VERSION
from recpipe.pipeline.tiered.sharders import TIERED_STATE_KEY
from recpipe.recipes.config import CHECKPOINT_FORMATS, STEP_DIR_PATTERN, TrainConfig, checkpoint_steps

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
# Config fields a resumed run may change that make its losses differ from an uninterrupted
# run's: each checkpoint records them and the resume line names every change.
RESUME_NOTED_FIELDS: tuple[str, ...] = ("embedding_lr", "dense_lr", "data_path", "placement")
MANIFEST_NAME: str = "manifest.json"
"""The commit record of a step directory: size and sha256 of every rank file."""
LATEST_NAME: str = "latest"
"""The marker naming the newest committed step."""
# SAVE_LOCK_NAME (imported above, recpipe.pipeline.checkpoint.integrity): the file rank 0 holds an
# exclusive ``flock`` on while it saves (it names the holder); recpipe.pipeline.checkpoint.dcp.save
# takes the same lock in its checkpoint directory.
MANIFEST_FORMAT: str = "recpipe-checkpoint/1"
DCP_METADATA_NAME: str = recpipe_dcp.DCP_METADATA_NAME
"""The metadata file torch.distributed.checkpoint writes into a ``dcp`` step directory."""
_DCP_DATA_FILE = recpipe_dcp.DCP_DATA_FILE
_SHARDED = "__sharded_local_shards__"
# What a rank file holds, per checkpoint format ("dcp": the model and fused optimizer
# state live in the DCP files; the rank file keeps the metadata and dense optimizer).
_PAYLOAD_KEYS: dict[str, tuple[str, ...]] = {
    "pt": ("meta", "model", "optimizer", "tiered"),
    "dcp": ("meta", "optimizer"),
}


class CheckpointError(RuntimeError):
    """Base class of the checkpoint errors below."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was written by a run with another world size, placement or model."""


#: The fix every refused resume offers.
_FRESH_RUN = "start a fresh run (drop --resume or use another --checkpoint-dir)"


def _mismatch(what: str, *fixes: str) -> CheckpointMismatchError:
    """A :class:`CheckpointMismatchError`: ``what``, then the fixes as numbered possible solutions."""
    return CheckpointMismatchError(
        f"{what}. Possible solutions:\n" + "\n".join(f"  {i}. {fix}" for i, fix in enumerate(fixes, 1))
    )


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated, altered or unreadable.

    Args:
        path: the damaged file (or the step directory).
        problem: what is wrong with it.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(
            f"checkpoint file {self.path} is damaged: {problem}. Possible solutions:\n"
            "  1. resume without naming a step: --resume falls back to the newest intact checkpoint\n"
            "  2. restore the file from a copy, or delete its step directory"
        )


class NoIntactCheckpointError(CheckpointError):
    """Resume was asked for, checkpoints exist, but every one of them is damaged."""


class CheckpointWriteError(CheckpointError):
    """A rank could not write its checkpoint file (no checkpoint of that step was committed)."""


class NonFiniteStateError(FloatingPointError):
    """The state to be saved holds NaN or inf values; no checkpoint file was written."""


# ---------------------------------------------------------------- state <-> payload
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


def _restore(live: Any, saved: Any, where: str, copy: bool = True) -> None:
    """Copies ``saved`` into ``live`` (``copy=False``: only checks that they fit)."""
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
            if copy:
                shard.tensor.copy_(value)
        return
    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or live.shape != saved.shape:
            raise CheckpointMismatchError(f"{where}: shape {tuple(live.shape)} differs from the checkpoint's")
        if copy:
            live.copy_(saved)
        return
    if isinstance(live, dict):
        if not isinstance(saved, dict) or set(live) != set(saved):
            missing = sorted(map(str, set(live) - set(saved or {})))
            extra = sorted(map(str, set(saved or {}) - set(live)))
            raise CheckpointMismatchError(f"{where}: keys differ (missing {missing[:5]}, extra {extra[:5]})")
        for k in live:
            _restore(live[k], saved[k], f"{where}.{k}", copy)
        return
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(live) != len(saved):
            raise CheckpointMismatchError(f"{where}: length differs from the checkpoint's")
        for i, (a, b) in enumerate(zip(live, saved)):
            _restore(a, b, f"{where}[{i}]", copy)
    # Other leaves (learning rates, flags) come from the config, not the checkpoint.


def _floating_tensors(obj: Any, where: str) -> list[tuple[str, torch.Tensor]]:
    """Every non-empty floating-point tensor in a payload, with its path.

    A ShardedTensor counts as its local shards (``where.0``, ``where.1``, ...) and a
    DTensor as its local tensor, the values this rank holds.
    """
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, ShardedTensor):
        items: list[tuple[Any, Any]] = list(enumerate(s.tensor for s in obj.local_shards()))
    elif isinstance(obj, torch.Tensor):
        return [(where, obj)] if obj.is_floating_point() and obj.numel() else []
    elif isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    else:
        return []
    out: list[tuple[str, torch.Tensor]] = []
    for key, value in items:
        out += _floating_tensors(value, f"{where}.{key}" if where else str(key))
    return out


def _non_finite(payload: dict[str, Any], limit: int = 5) -> list[str]:
    """Paths of tensors in ``payload`` holding NaN or inf (at most ``limit``).

    Two reductions per tensor (``amax`` / ``amin`` propagate NaN and reach +-inf), no
    full-size temporary, and one host read in the common all-finite case.
    """
    tensors = [(k, t) for part in ("model", "optimizer", "tiered") for k, t in _floating_tensors(payload[part], part)]
    if not tensors:
        return []
    flags: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, (_, t) in enumerate(tensors):
        flags.setdefault(t.device, []).append((i, torch.isfinite(torch.stack([t.amax(), t.amin()])).all()))
    finite = [True] * len(tensors)
    for items in flags.values():  # one host read per device
        for (i, _), ok in zip(items, torch.stack([f for _, f in items]).tolist()):
            finite[i] = ok
    return [name for (name, _), ok in zip(tensors, finite) if not ok][:limit]


# Fingerprint fields that only shape the tables of some runs (``data.base.table_rows`` /
# ``IdTransform``): left out where the model ignores them, so changing them is no mismatch.
_MICRO_DLRM_FIELDS: tuple[str, ...] = ("virtual_rows", "hash_k")


def fingerprint(config: TrainConfig) -> dict[str, Any]:
    """The config values a checkpoint must agree with (those this run's model uses)."""
    d = config.to_dict()
    unused = set(_MICRO_DLRM_FIELDS) if config.model != "micro_dlrm_dram" else set()
    if config.model == "micro_dlrm_dram" or config.dataset == "movielens100k":
        unused.add("num_embeddings")  # tables of virtual_rows / MovieLens' own cardinalities
    return {k: d[k] for k in FINGERPRINT_FIELDS if k not in unused}


def _noted(config: TrainConfig) -> dict[str, Any]:
    """The ``RESUME_NOTED_FIELDS`` values of ``config``."""
    d = config.to_dict()
    return {k: d[k] for k in RESUME_NOTED_FIELDS}


def _changed_since(meta: dict[str, Any], config: TrainConfig, world: int) -> str:
    """``"; changed since it was saved: dense_lr 0.01 -> 0.02 (...)"`` or ``""``.

    Also names a world size change (a ``dcp`` checkpoint resumed on another number of
    ranks): the global batch is ``batch_size * world_size`` samples per step, so it
    changes with it. Checkpoints written before the fields were recorded note nothing.
    """
    saved = meta.get("noted")
    if not isinstance(saved, dict):
        saved = {}
    changes = [f"{k} {saved[k]!r} -> {v!r}" for k, v in _noted(config).items() if k in saved and saved[k] != v]
    saved_world = meta.get("world_size")
    if isinstance(saved_world, int) and saved_world != world:
        changes.append(f"world size {saved_world} -> {world} (global batch {config.batch_size * saved_world} -> "
                       f"{config.batch_size * world} samples per step)")
    if not changes:
        return ""
    return (f"; changed since it was saved: {', '.join(changes)} "
            "(training continues with the new values, so losses differ from an uninterrupted run's)")


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


def _all_gather(obj: Any, world: int) -> list[Any]:
    """``obj`` of every rank, in rank order (small picklable values only)."""
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any, world: int) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------- files
def step_dir_name(step: int) -> str:
    """Name of the directory holding the checkpoint of ``step`` (``step_00000040``)."""
    return f"step_{step:08d}"


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


class _HashingWriter:
    """File-like sink for ``torch.save`` that counts and hashes the bytes it writes."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        self.sha256.update(data)
        self.bytes += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self._f.flush()


def _write_rank_file(path: Path, payload: dict[str, Any]) -> dict[str, Any]:
    """Saves ``payload`` atomically; returns its manifest entry (bytes, sha256).

    Raises:
        OSError: the file could not be written (e.g. a full disk); the temporary file
            is removed.
    """
    with atomic_file(path) as f:
        sink = _HashingWriter(f)
        try:
            torch.save(payload, sink)
        except RuntimeError as e:
            # torch.save's zip writer reports a failed write (ENOSPC, EIO) as a
            # RuntimeError about the stream position; the OSError is its context.
            cause = _os_error_in(e)
            if cause is None:
                raise
            raise cause from None
    return {"bytes": sink.bytes, "sha256": sink.sha256.hexdigest()}


def _os_error_in(error: BaseException) -> OSError | None:
    """The first :class:`OSError` in ``error``'s chain of causes / contexts, or None."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _write_manifest(
    step_dir: Path, step: int, world: int, files: dict[str, dict[str, Any]], checkpoint_format: str = "pt"
) -> None:
    body = {"format": MANIFEST_FORMAT, "step": step, "world_size": world, "files": files}
    if checkpoint_format != "pt":  # manifests of .pt checkpoints stay as they were
        body["checkpoint_format"] = checkpoint_format
    text = json.dumps(dict(body, manifest_sha256=json_digest(body)), indent=1, sort_keys=True)
    atomic_write_bytes(step_dir / MANIFEST_NAME, (text + "\n").encode())


def read_manifest(step_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads and checks the manifest of a step directory.

    Args:
        step_dir: e.g. ``<checkpoint_dir>/step_00000040``.

    Returns:
        ``{"format", "step", "world_size", "checkpoint_format", "files": {"rank0.pt":
        {"bytes", "sha256"}, ...}}``; a ``dcp`` checkpoint's files also hold DCP's
        ``.metadata`` and ``__R_N.distcp`` files. ``checkpoint_format`` is ``"pt"`` for
        manifests that do not record one.

    Raises:
        CheckpointCorruptError: the manifest is missing, unreadable, altered (its own
            digest), or does not describe this directory.
    """
    step_dir = Path(step_dir)
    path = step_dir / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointCorruptError(
            path, "missing: the save did not finish, or the checkpoint predates manifests"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(path, f"unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise CheckpointCorruptError(path, f"not a {MANIFEST_FORMAT} manifest")
    body = {k: v for k, v in data.items() if k != "manifest_sha256"}
    if data.get("manifest_sha256") != json_digest(body):
        raise CheckpointCorruptError(path, "its content does not match its own sha256 (altered after the save)")
    m = STEP_DIR_PATTERN.match(step_dir.name)
    world, files = data.get("world_size"), data.get("files")
    if m is None or data.get("step") != int(m.group(1)):
        raise CheckpointCorruptError(path, f"records step {data.get('step')!r}, but lies in {step_dir.name}")
    if not isinstance(world, int) or world < 1 or not isinstance(files, dict):
        raise CheckpointCorruptError(path, f"bad world_size {world!r} or files table")
    checkpoint_format = data.get("checkpoint_format", "pt")
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise CheckpointCorruptError(path, f"unknown checkpoint_format {checkpoint_format!r}")
    expected = {_rank_file(r) for r in range(world)}
    if checkpoint_format == "pt" and set(files) != expected:
        raise CheckpointCorruptError(path, f"lists files {sorted(files)}, expected {sorted(expected)}")
    if checkpoint_format == "dcp":
        required = expected | {DCP_METADATA_NAME}
        other = sorted(n for n in set(files) - required if not _DCP_DATA_FILE.match(n))
        if not required <= set(files) or other:
            raise CheckpointCorruptError(
                path,
                f"lists files {sorted(files)}, expected {sorted(required)} and DCP's __R_N.distcp files",
            )
    for name, entry in files.items():
        if not is_file_entry(entry):
            raise CheckpointCorruptError(path, f"bad entry for {name}: {entry!r}")
    data["checkpoint_format"] = checkpoint_format
    return data


def _verify_file(step_dir: Path, manifest: dict[str, Any], name: str) -> Path:
    """Checks one file's size and sha256 against the manifest; returns its path."""
    path = step_dir / name
    problem = file_problem(path, manifest["files"][name], MANIFEST_NAME)
    if problem is not None:
        raise CheckpointCorruptError(path, problem)
    return path


def _read_rank_file(step_dir: Path, manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    """Verifies one rank file against the manifest and unpickles it (on the CPU)."""
    path = _verify_file(step_dir, manifest, _rank_file(rank))
    try:
        payload = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise CheckpointCorruptError(path, f"cannot be unpickled ({type(e).__name__}: {e})") from None
    keys_needed = _PAYLOAD_KEYS[manifest["checkpoint_format"]]
    if not isinstance(payload, dict) or any(k not in payload for k in keys_needed):
        keys = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointCorruptError(path, f"holds {keys}, not a recpipe checkpoint {list(keys_needed)}")
    meta = payload["meta"]
    got = tuple(meta.get(k) for k in ("step", "rank", "world_size")) if isinstance(meta, dict) else None
    want = (manifest["step"], rank, manifest["world_size"])
    if isinstance(meta, dict) and meta.get("checkpoint_format", "pt") != manifest["checkpoint_format"]:
        raise CheckpointCorruptError(
            path, f"holds a {meta.get('checkpoint_format', 'pt')!r} checkpoint, but {MANIFEST_NAME} records "
            f"{manifest['checkpoint_format']!r} (a file from another checkpoint)"
        )
    if got != want:
        raise CheckpointCorruptError(
            path, f"its metadata (step, rank, world size) is {got}, expected {want} (a file from another checkpoint)"
        )
    return payload


def verify_checkpoint(step_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Verifies every file of one checkpoint without a model: manifest, sizes, sha256,
    unpickling and each rank file's own step / rank / world size (and, for the ``dcp``
    format, the size and sha256 of DCP's ``.metadata`` and ``.distcp`` files).

    Args:
        step_dir: e.g. ``<checkpoint_dir>/step_00000040``.

    Returns:
        The manifest.

    Raises:
        CheckpointCorruptError: naming the first damaged file and what is wrong.
    """
    step_dir = Path(step_dir)
    manifest = read_manifest(step_dir)
    for r in range(manifest["world_size"]):
        _read_rank_file(step_dir, manifest, r)
    for name in _dcp_files(manifest):
        _verify_file(step_dir, manifest, name)
    return manifest


def _dcp_files(manifest: dict[str, Any]) -> list[str]:
    """The manifest's files that are not rank files (DCP's, in the ``dcp`` format)."""
    ranks = {_rank_file(r) for r in range(manifest["world_size"])}
    return sorted(n for n in manifest["files"] if n not in ranks)


def reseal_checkpoint(step_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Rewrites the manifest of a checkpoint from the rank files as they are now.

    For tools and tests that edit a checkpoint on purpose (a migration, a deliberately
    altered payload): the edited files then verify again. Never use it to make a
    damaged checkpoint load.

    Args:
        step_dir: e.g. ``<checkpoint_dir>/step_00000040``; its ``rank*.pt`` files must
            be ``rank0.pt .. rank{W-1}.pt``. With DCP's ``.metadata`` present it is a
            ``dcp`` checkpoint and every other file in it is recorded too.

    Returns:
        The new manifest.
    """
    step_dir = Path(step_dir)
    m = STEP_DIR_PATTERN.match(step_dir.name)
    if m is None:
        raise ValueError(f"reseal_checkpoint: {step_dir} is not a step_NNNNNNNN directory")
    ranks = sorted(int(p.stem[4:]) for p in step_dir.glob("rank*.pt") if p.stem[4:].isdigit())
    if not ranks or ranks != list(range(len(ranks))):
        raise ValueError(f"reseal_checkpoint: {step_dir} holds rank files {ranks}, expected rank0.pt..rankN.pt")
    files = {_rank_file(r): file_entry(step_dir / _rank_file(r)) for r in ranks}
    checkpoint_format = "dcp" if (step_dir / DCP_METADATA_NAME).is_file() else "pt"
    if checkpoint_format == "dcp":
        files.update(_dcp_entries(step_dir, set(files)))
    _write_manifest(step_dir, int(m.group(1)), len(ranks), files, checkpoint_format)
    return read_manifest(step_dir)


def _dcp_entries(step_dir: Path, skip: set[str]) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file in ``step_dir`` but the manifest, temporaries and ``skip``."""
    return {
        p.name: file_entry(p)
        for p in sorted(step_dir.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME and not p.name.endswith(".tmp") and p.name not in skip
    }


# ---------------------------------------------------------------- save
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

    With ``config.checkpoint_format == "dcp"`` the model (tiered tables included) and
    its fused optimizer state are written by torch.distributed.checkpoint
    (:func:`recpipe.pipeline.checkpoint.dcp.dcp_state_dict`), each rank's ``rankR.pt`` holds the
    metadata and the dense optimizer state, and rank 0 records every file of the step
    directory (DCP's too) in the manifest: the same commit protocol. Rank 0 holds an
    exclusive lock on ``directory/SAVE_LOCK_NAME`` for the whole save, so a second run
    saving into the same directory at the same time fails instead of mixing its files
    with this one's.

    Returns:
        The step directory.

    Raises:
        NonFiniteStateError: some rank's state holds NaN / inf (nothing was written).
        CheckpointWriteError: some rank could not write its file (the step is not
            committed: no manifest, ``latest`` unchanged), or another run is saving
            into ``directory`` at the same time (nothing was written).
    """
    with _save_lock(Path(directory), step):
        if config.checkpoint_format == "dcp":
            return _save_dcp_checkpoint(directory, step, model, optimizer, config, table_ranks)
        return _save_pt_checkpoint(directory, step, model, optimizer, config, table_ranks)


@contextlib.contextmanager
def _save_lock(root: Path, step: int) -> Iterator[None]:
    """Rank 0 holds an exclusive ``flock`` on ``root/SAVE_LOCK_NAME`` for the whole save
    (a collective: every rank learns the outcome before anyone writes). Another run
    saving into the same directory at the same time would otherwise mix its files with
    this one's: the recipe empties a ``dcp`` step directory first, both write the same
    file names, and the manifest records the files as they are at commit time.

    Raises:
        CheckpointWriteError: on every rank, when another process holds the lock (named)
            or the lock file cannot be created; nothing was written. A file system
            without ``flock`` saves unlocked.
    """
    rank, world = _rank_world()
    lock: SaveLock | None = None
    problem: str | None = None
    if rank == 0:
        lock = acquire_save_lock(root)
        if lock.error is not None:  # the directory cannot be written: neither can the checkpoint
            problem = (f"rank 0: creating {lock.path} failed ({type(lock.error).__name__}: {lock.error}). Fix: check "
                       "the free space and permissions of --checkpoint-dir")
        elif lock.holder is not None:
            problem = (f"another run ({lock.holder}) is saving into {root} at the same time (it holds {lock.path}); "
                       "two runs writing one --checkpoint-dir would mix their files. Fix: give each run its "
                       "own --checkpoint-dir")
    problem = _broadcast(problem, world)
    if problem is not None:
        raise CheckpointWriteError(f"checkpoint of step {step} was not committed: {problem}")
    try:
        yield
    finally:
        if lock is not None:
            release_save_lock(lock)


def _save_pt_checkpoint(
    directory: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    table_ranks: dict[str, Any],
) -> Path:
    """:func:`save_checkpoint` in the ``pt`` format (see there)."""
    rank, world = _rank_world()
    root = Path(directory)
    step_dir = root / step_dir_name(step)
    payload = {
        "meta": _meta(step, rank, world, config, table_ranks),
        "model": _to_saved(_model_state(model)),
        "optimizer": _to_saved(optimizer.state_dict()),
        # torchrec's sharded state_dict skips CUSTOMIZED_KERNEL (tiered) tables:
        # they export (global id, value, optimizer state) themselves.
        "tiered": {
            fqn: m.tiered_state() for fqn, m in model.named_modules() if hasattr(m, "tiered_state")
        },
    }
    _refuse_non_finite(_all_gather(_non_finite(payload), world), step, step_dir)
    path = step_dir / _rank_file(rank)
    try:
        step_dir.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            # An older save of this step is no longer the commit record of these files.
            (step_dir / MANIFEST_NAME).unlink(missing_ok=True)
            # Its files that no rank of this save writes (DCP's of a ``dcp`` save, rank files
            # of a larger world) would stay for good, and reseal_checkpoint would take DCP's
            # stale .metadata for a ``dcp`` checkpoint.
            for p in step_dir.iterdir():
                stale_rank = re.fullmatch(r"rank(\d+)\.pt", p.name)
                if p.is_file() and (p.name == DCP_METADATA_NAME or _DCP_DATA_FILE.match(p.name)
                                    or (stale_rank is not None and int(stale_rank.group(1)) >= world)):
                    p.unlink()
        written: Any = _write_rank_file(path, payload)
    except OSError as e:
        written = f"rank {rank}: writing {path} failed ({type(e).__name__}: {e})"
    _commit(root, step_dir, step, rank, world, _all_gather(written, world), "pt")
    return step_dir


def _meta(step: int, rank: int, world: int, config: TrainConfig, table_ranks: dict[str, Any]) -> dict[str, Any]:
    """The metadata every rank file carries (checked on load)."""
    return {
        "step": step,
        "rank": rank,
        "world_size": world,
        "table_ranks": dict(table_ranks),
        "fingerprint": fingerprint(config),
        "noted": _noted(config),
        # row-wise shards in "model" hold rows in local-id order of this routing
        "routing_version": ROUTING_VERSION,
        "checkpoint_format": config.checkpoint_format,
    }


def _refuse_non_finite(per_rank: list[list[str]], step: int, step_dir: Path) -> None:
    """Raises :class:`NonFiniteStateError` when any rank reported non-finite tensors."""
    bad = [(r, names) for r, names in enumerate(per_rank) if names]
    if bad:
        listed = "; ".join(f"rank {r}: {', '.join(names)}" for r, names in bad)
        raise NonFiniteStateError(
            f"refusing to save the checkpoint of step {step} into {step_dir}: the state holds NaN/inf "
            f"({listed}). No file was written; {step_dir.parent / LATEST_NAME} still names the last good "
            "checkpoint. Fix: find the first non-finite loss or input (lower --dense-lr / --embedding-lr on "
            "divergence) and resume from the last good checkpoint"
        )


def _raise_write_errors(entries: list[Any], step: int) -> None:
    errors = list(dict.fromkeys(e for e in entries if isinstance(e, str)))  # a DCP failure: the same on every rank
    if errors:
        raise CheckpointWriteError(
            f"checkpoint of step {step} was not committed: " + "; ".join(errors)
            + ". Fix: check the free space and permissions of --checkpoint-dir"
        )


def _commit(
    root: Path, step_dir: Path, step: int, rank: int, world: int, entries: list[Any], checkpoint_format: str
) -> None:
    """Rank 0 writes the manifest (every rank's entry; for ``dcp`` also DCP's files), then ``latest``."""
    _raise_write_errors(entries, step)
    commit_error: str | None = None
    if rank == 0:
        try:
            files = {_rank_file(r): e for r, e in enumerate(entries)}
            if checkpoint_format == "dcp":
                files.update(_dcp_entries(step_dir, set(files)))
            _write_manifest(step_dir, step, world, files, checkpoint_format)
            atomic_write_bytes(root / LATEST_NAME, f"{step}\n".encode())
        except OSError as e:
            commit_error = f"rank 0: writing {step_dir / MANIFEST_NAME} or {root / LATEST_NAME} failed ({e})"
    # Every rank waits for the commit (and learns whether it failed).
    commit_error = _broadcast(commit_error, world)
    if commit_error:
        raise CheckpointWriteError(
            f"checkpoint of step {step} was not committed: {commit_error}. "
            "Fix: check the free space and permissions of --checkpoint-dir"
        )


def _dense_optimizer_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    """State dicts of the parts of ``optimizer`` a DCP checkpoint of ``model`` does not hold.

    :func:`recpipe.pipeline.checkpoint.dcp.dcp_state_dict` saves ``model.fused_optimizer``; the
    recipe's ``CombinedOptimizer([fused, dense])`` adds the dense Adagrad, which the
    rank files carry.
    """
    fused = getattr(model, "fused_optimizer", None)
    if optimizer is fused:
        return []
    parts = getattr(optimizer, "optimizers", None)
    dense = [optimizer] if parts is None else [opt for _, opt in parts if opt is not fused]
    return [opt.state_dict() for opt in dense]


def _save_dcp_checkpoint(
    directory: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    table_ranks: dict[str, Any],
) -> Path:
    """:func:`save_checkpoint` in the ``dcp`` format (see there)."""
    rank, world = _rank_world()
    root = Path(directory)
    step_dir = root / step_dir_name(step)
    # What recpipe.pipeline.checkpoint.dcp.save writes, built once so it is checked for NaN / inf first.
    state = recpipe_dcp.dcp_state_dict(model)
    payload = {
        "meta": _meta(step, rank, world, config, table_ranks),
        "optimizer": _to_saved(_dense_optimizer_states(model, optimizer)),
    }
    check = {"model": state, "optimizer": payload["optimizer"], "tiered": {}}
    _refuse_non_finite(_all_gather(_non_finite(check), world), step, step_dir)
    prepared: str | None = None
    try:
        step_dir.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            # An older save of this step is no longer committed; its files (maybe of
            # another world size or format) would otherwise be recorded with the new ones.
            (step_dir / MANIFEST_NAME).unlink(missing_ok=True)
            for p in step_dir.iterdir():
                if p.is_file():
                    p.unlink()
    except OSError as e:
        prepared = f"rank {rank}: preparing {step_dir} failed ({type(e).__name__}: {e})"
    # Nobody writes before rank 0 has emptied the directory; all ranks enter DCP's save or none.
    _raise_write_errors(_all_gather(prepared, world), step)
    written: Any
    try:
        torch_dcp.save(state, storage_writer=FileSystemWriter(step_dir), no_dist=not dist.is_initialized())
    except CheckpointException as e:  # a BaseException, raised on every rank with every rank's failure
        failures = "; ".join(recpipe_dcp.describe_failures(recpipe_dcp.dcp_failures(e)))
        written = f"torch.distributed.checkpoint.save into {step_dir} failed: {failures}"
    except Exception as e:  # noqa: BLE001 - told to every rank by _commit
        written = f"rank {rank}: torch.distributed.checkpoint.save into {step_dir} failed ({type(e).__name__}: {e})"
    else:
        path = step_dir / _rank_file(rank)
        try:
            written = _write_rank_file(path, payload)
        except OSError as e:
            written = f"rank {rank}: writing {path} failed ({type(e).__name__}: {e})"
    entries = _all_gather(written, world)
    if any(isinstance(e, str) for e in entries):
        # Not committed, and rank 0 emptied the directory before anyone wrote: every file in
        # it is this failed save's. Partial files would keep a full disk full.
        recpipe_dcp.remove_rank_files(step_dir, rank)
        for name in [_rank_file(rank)] + ([DCP_METADATA_NAME] if rank == 0 else []):
            with contextlib.suppress(OSError):
                (step_dir / name).unlink(missing_ok=True)
    _commit(root, step_dir, step, rank, world, entries, "dcp")
    return step_dir


# ---------------------------------------------------------------- load
def latest_step(directory: str) -> int | None:
    """The step ``latest`` names, or None when it is missing.

    Raises:
        CheckpointCorruptError: ``latest`` exists but does not hold a step number.
    """
    p = Path(directory) / LATEST_NAME
    if not p.is_file():
        return None
    try:
        text = p.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(p, f"unreadable ({type(e).__name__}: {e})") from None
    if not text.isdigit() or not text.isascii():
        raise CheckpointCorruptError(p, f"holds {text[:40]!r}, not a step number")
    return int(text)


def _resume_candidates(directory: str) -> tuple[list[int], list[str]]:
    """Steps to try, newest first, and notes on the ``latest`` marker.

    With a readable ``latest`` whose directory exists, only steps at or below it:
    a newer step directory is an uncommitted save, or a leftover of an earlier run
    in the same directory. Otherwise every step directory.
    """
    steps = checkpoint_steps(directory)
    notes: list[str] = []
    try:
        latest = latest_step(directory)
    except CheckpointCorruptError as e:
        notes.append(f"{e.path} {e.problem}")
        return steps, notes
    if latest is None:
        if steps:
            notes.append(f"{Path(directory) / LATEST_NAME} is missing")
    elif latest in steps:
        steps = [s for s in steps if s <= latest]
    else:
        notes.append(f"{Path(directory) / LATEST_NAME} names step {latest}, which has no directory")
    return steps, notes


def resume_step_at_or_past(directory: str, total: int) -> int | None:
    """The step ``--resume`` would continue from, when it is ``total`` or later (else None).

    The choice :func:`load_checkpoint` makes, without a model: the candidates newest
    first, damaged ones skipped (:func:`verify_checkpoint`); the walk stops at the first
    step before ``total``, so only checkpoints at or past it are read. Lets a run that
    would train nothing fail before it builds anything.

    Args:
        directory: checkpoint root.
        total: the run's last step.

    Returns:
        The step of the newest intact checkpoint when it is ``>= total``, else None.
    """
    for step in _resume_candidates(directory)[0]:
        if step < total:
            return None
        try:
            verify_checkpoint(Path(directory) / step_dir_name(step))
        except CheckpointCorruptError:
            continue  # the loader skips it too
        return step
    return None


def _check_fit(
    path: Path,
    meta: dict[str, Any],
    world: int,
    config: TrainConfig,
    table_ranks: dict[str, Any],
) -> None:
    """Raises :class:`CheckpointMismatchError` when a verified file does not fit this run.

    A ``dcp`` checkpoint may have another world size and placement (DCP and the
    tiered exports reshard on load, and ``recpipe.pipeline.checkpoint.dcp.load`` moves tables
    between tiered and torchrec placements, ``--placement planned`` <-> ``table_wise``);
    the config fingerprint and routing still apply.
    """
    problems = []
    resharding = meta.get("checkpoint_format", "pt") == "dcp"
    if meta.get("world_size") != world and not resharding:
        problems.append(f"world size {meta.get('world_size')} (checkpoint) != {world} (now)")
    saved_ranks = meta.get("table_ranks") or {}
    if saved_ranks != table_ranks and not resharding:
        differ = sorted(t for t in {*saved_ranks, *table_ranks} if saved_ranks.get(t) != table_ranks.get(t))
        problems.append(
            f"placement of {len(differ)} of {len(table_ranks)} tables (checkpoint -> now): "
            + "; ".join(f"{t} {saved_ranks.get(t, 'absent')} -> {table_ranks.get(t, 'absent')}" for t in differ)
            + "; resume with the checkpoint's --placement and sizes"
        )
    saved_routing = meta.get("routing_version", 1)  # checkpoints before version 2 lack the key
    if saved_routing != ROUTING_VERSION:
        problems.append(
            f"hash_roundrobin routing version {saved_routing} (checkpoint) != {ROUTING_VERSION} (this recpipe): "
            "row-wise shards saved in local-id order would load into the wrong rows"
        )
    now = fingerprint(config)
    saved_fp = meta.get("fingerprint") or {}
    diff = {k: (saved_fp.get(k), now[k]) for k in now if saved_fp.get(k) != now[k]}
    if diff:
        problems.append(f"config fields differ (checkpoint, now): {diff}")
    if problems:
        raise _mismatch(
            f"checkpoint {path} does not fit this run: " + "; ".join(problems),
            f"resume with the checkpoint's world size ({meta.get('world_size')}) and config values",
            _FRESH_RUN,
            "on a routing version mismatch, resume with the recpipe release that wrote the checkpoint",
        )


def _check_state_fits(path: Path, live: Any, saved: Any, where: str) -> None:
    """Raises :class:`CheckpointMismatchError` naming ``path`` when ``saved`` (read
    from it) does not fit ``live``; copies nothing (``_restore(copy=False)``)."""
    try:
        _restore(live, saved, where, copy=False)
    except CheckpointMismatchError as e:
        raise _mismatch(
            f"checkpoint {path} does not fit this run's state: {e}",
            "resume with the config the checkpoint was saved with",
            _FRESH_RUN,
        ) from None


def _prepare(
    step_dir: Path,
    rank: int,
    world: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    table_ranks: dict[str, Any],
    needs_all_files: bool,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Verifies what this rank will read of one checkpoint; changes nothing.

    Returns:
        This rank's payload and every rank's tiered exports (empty unless
        ``needs_all_files``).
    """
    manifest = read_manifest(step_dir)
    if manifest["checkpoint_format"] == "dcp":
        return _prepare_dcp(step_dir, manifest, rank, world, model, optimizer, config, table_ranks), []
    if manifest["world_size"] != world:
        # Checked before the files: a larger world has no file for the new ranks.
        raise _mismatch(
            f"checkpoint {step_dir / MANIFEST_NAME} does not fit this run: world size "
            f"{manifest['world_size']} (checkpoint) != {world} (now)",
            f"resume with {manifest['world_size']} ranks",
            _FRESH_RUN,
        )
    payload = _read_rank_file(step_dir, manifest, rank)
    path = step_dir / _rank_file(rank)
    _check_fit(path, payload["meta"], world, config, table_ranks)
    _check_state_fits(path, _model_state(model), payload["model"], "model")
    _check_state_fits(path, optimizer.state_dict(), payload["optimizer"], "optimizer")
    exports: list[dict[str, Any]] = []
    if needs_all_files:
        for r in range(world):
            other = payload if r == rank else _read_rank_file(step_dir, manifest, r)
            exports.append(other["tiered"])
        for fqn, m in model.named_modules():
            if not hasattr(m, "load_tiered_state"):
                continue
            for r, export in enumerate(exports):
                if not isinstance(export, dict) or fqn not in export:
                    raise _mismatch(
                        f"checkpoint {step_dir / _rank_file(r)} has no tiered tables for module {fqn!r}",
                        "resume with the placement the checkpoint was saved with (--placement)",
                        _FRESH_RUN,
                    )
    return payload, exports


def _prepare_dcp(
    step_dir: Path,
    manifest: dict[str, Any],
    rank: int,
    world: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    table_ranks: dict[str, Any],
) -> dict[str, Any]:
    """:func:`_prepare` of a ``dcp`` checkpoint: returns the rank file this rank uses.

    Rank ``r`` reads ``rank{r % W}.pt`` of the ``W`` saving ranks (the dense optimizer
    state is replicated) and verifies its share (round robin) of the manifest's files
    that no rank reads as its source, DCP's included, so the gathered verdicts cover
    every file before anything is loaded.
    """
    source = rank % manifest["world_size"]
    payload = _read_rank_file(step_dir, manifest, source)
    path = step_dir / _rank_file(source)
    _check_fit(path, payload["meta"], world, config, table_ranks)
    sources = {_rank_file(r % manifest["world_size"]) for r in range(world)}
    others = sorted(n for n in manifest["files"] if n not in sources)
    for name in others[rank::world]:
        _verify_file(step_dir, manifest, name)
    live = _dense_optimizer_states(model, optimizer)
    _check_state_fits(path, live, payload["optimizer"], "optimizer")
    return payload


def _restore_dcp(step_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: Any) -> None:
    """Loads a verified ``dcp`` checkpoint (a collective): DCP state, then the dense optimizer."""
    # verified against the manifest by _prepare_dcp; its save refused non-finite rows before writing
    recpipe_dcp.load(model, step_dir, verify=False, check_rows=False)
    with torch.no_grad():
        _restore(_dense_optimizer_states(model, optimizer), saved, "optimizer")


def load_checkpoint(
    directory: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    table_ranks: dict[str, Any],
    step: int | None = None,
) -> int:
    """Restores this rank's state in place from a verified checkpoint (a collective).

    Without ``step`` (``--resume``) it takes the newest intact checkpoint at or below
    ``latest`` (any step directory when ``latest`` is missing or unreadable); each
    damaged one is skipped, and one line on rank 0's stdout names what was
    skipped and why and which step is used. Nothing is modified until every rank has
    verified the chosen checkpoint, and all ranks load the same step.

    Args:
        directory: checkpoint root.
        model: freshly built DMP model (same config, world size and placement).
        optimizer: its combined optimizer, before any step.
        config: the run's config.
        table_ranks: this run's placement per table.
        step: load exactly this step; a damaged file raises instead of falling back.

    Returns:
        The step to continue from.

    Raises:
        FileNotFoundError: no checkpoint in ``directory`` (or no directory for ``step``).
        NoIntactCheckpointError: checkpoints exist but every one is damaged.
        CheckpointCorruptError: ``step`` was given and a file of it is damaged.
        CheckpointMismatchError: world size, placement, routing version or model differ.
    """
    rank, world = _rank_world()
    root = Path(directory)
    if step is not None:
        candidates, notes = [step], []
        if not (root / step_dir_name(step)).is_dir():
            raise FileNotFoundError(f"checkpoint {root / step_dir_name(step)} does not exist")
    else:
        # Rank 0 lists the directory, so every rank tries the same steps in the same order.
        candidates, notes = _broadcast(_resume_candidates(directory) if rank == 0 else None, world)
    if not candidates:
        raise FileNotFoundError(
            f"resume=True but {directory!r} has no checkpoint (no step_* directory, 'latest' missing). "
            "Fix: point --checkpoint-dir at a directory a previous run saved into, or drop --resume"
        )
    needs_all_files = any(hasattr(m, "load_tiered_state") for m in model.modules())
    skipped: list[str] = []
    for candidate in candidates:
        step_dir = root / step_dir_name(candidate)
        verdict: tuple[str, str, str]
        try:
            payload, exports = _prepare(
                step_dir, rank, world, model, optimizer, config, table_ranks, needs_all_files
            )
            verdict = ("ok", "", "")
        except CheckpointCorruptError as e:
            verdict = ("corrupt", str(e.path), e.problem)
        except CheckpointMismatchError as e:
            verdict = ("mismatch", "", str(e))
        except Exception as e:  # noqa: BLE001 - told to every rank below, then re-raised here
            _all_gather(("error", "", f"rank {rank}: {type(e).__name__}: {e}"), world)
            raise
        verdicts = _all_gather(verdict, world)
        errors = [v[2] for v in verdicts if v[0] == "error"]
        if errors:
            raise CheckpointError(f"loading checkpoint {step_dir} failed on another rank: {errors[0]}")
        mismatches = [v[2] for v in verdicts if v[0] == "mismatch"]
        if mismatches:
            raise CheckpointMismatchError(mismatches[0])
        damaged = list(dict.fromkeys((v[1], v[2]) for v in verdicts if v[0] == "corrupt"))
        if damaged:
            if step is not None:
                raise CheckpointCorruptError(*damaged[0])
            skipped.append(f"{step_dir.name} ({'; '.join(f'{p}: {why}' for p, why in damaged)})")
            continue
        changed = _changed_since(payload["meta"], config, world)
        if skipped or notes:
            why = "; ".join(notes + ([f"damaged checkpoint {s}" for s in skipped]))
            if rank == 0:
                print(f"[recpipe] resume: {why}; resuming from {step_dir} instead{changed}", flush=True)
        elif rank == 0:
            print(f"[recpipe] resumed from {step_dir}{changed}", flush=True)
        if payload["meta"].get("checkpoint_format", "pt") == "dcp":
            _restore_dcp(step_dir, model, optimizer, payload["optimizer"])
            return int(payload["meta"]["step"])
        with torch.no_grad():
            _restore(_model_state(model), payload["model"], "model")
            _restore(optimizer.state_dict(), payload["optimizer"], "optimizer")
            _restore_tiered(model, exports)
        return int(payload["meta"]["step"])
    raise NoIntactCheckpointError(
        f"resume=True but no checkpoint in {directory!r} is intact: "
        + "; ".join(notes + [f"damaged checkpoint {s}" for s in skipped])
        + ". Nothing was loaded. Possible solutions:\n"
        "  1. restore the damaged files from a copy\n"
        f"  2. {_FRESH_RUN}"
    )


def _restore_tiered(model: torch.nn.Module, exports: list[dict[str, Any]]) -> None:
    """Loads tiered tables from the exports of every saving rank (global row ids).

    Each rank reads all ranks' exports (checked by :func:`_prepare`) and keeps the
    rows it owns, so no row is lost whatever the routing; the tables validate
    dist_type, seed, world size and shapes of the exports themselves.
    """
    for fqn, module in model.named_modules():
        if not hasattr(module, "load_tiered_state"):
            continue
        per_table: dict[str, list[Any]] = {}
        for export in exports:
            for table, state in export[fqn].items():
                per_table.setdefault(table, []).append(state)
        module.load_tiered_state(per_table)
