"""The recipe's checkpoint policy: when a step is saved, which one ``--resume`` continues from,
and what recipe state goes with the model.

Each checkpoint is one ``recpipe.pipeline.checkpoint`` save into ``<dir>/step_NNNNNNNN``; every
rank's recipe state (dense optimizer state, step, config fingerprint, placement, routing version)
is its digested ``extra_state``. ``<dir>/latest`` names the newest committed step; rank 0 holds
``<dir>/.recpipe_save.lock`` while saving. Under another world size and placement, rank ``r``
reads the recipe state of saving rank ``r % W``. Every error here is a
``recpipe.pipeline.checkpoint.CheckpointError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

import recpipe.pipeline.checkpoint as checkpoint
from recpipe.pipeline.checkpoint import CheckpointError, CheckpointNotFoundError, FileSystemStorage
from recpipe.pipeline.checkpoint.collectives import all_gather, rank_world
from recpipe.pipeline.checkpoint.integrity import SaveLock, acquire_save_lock, release_save_lock
from recpipe.pipeline.routing.ops import ROUTING_VERSION
from recpipe.recipes.config import TrainConfig, checkpoint_steps

# Config fields that change the state's shapes or the data order: a resumed run must match
# (``dynamic_tables``: a dynamic table's state is its key index and slots, not rows of id mod num_embeddings).
FINGERPRINT_FIELDS: tuple[str, ...] = tuple(
    "model dataset batch_size embedding_dim num_embeddings virtual_rows hash_k dense_arch over_arch seed "
    "synthetic_id_space zipf_alpha eval_fraction dynamic_tables".split()
)
# Config fields a resumed run may change that make its losses differ from an uninterrupted
# run's: each checkpoint records them and the resume line names every change. ``pipeline`` and
# ``semi_sync_start_batch`` change no state's shape (no pipeline keeps state across a checkpoint step,
# where every pipeline has drained), but ``semi_sync`` trains from stale lookups.
RESUME_NOTED_FIELDS: tuple[str, ...] = (
    "embedding_lr",
    "dense_lr",
    "data_path",
    "placement",
    "sharding_types",
    "fast_tier_mb",
    "pipeline",
    "semi_sync_start_batch",
)
LATEST_NAME: str = "latest"  # the marker naming the newest committed step


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was written by a run with another model, data or routing."""


_FRESH_RUN = "start a fresh run (drop --resume or use another --checkpoint-dir)"


def _mismatch(what: str, *fixes: str) -> CheckpointMismatchError:
    """``what``, then the fixes as numbered possible solutions."""
    return CheckpointMismatchError(
        f"{what}. Possible solutions:\n" + "\n".join(f"  {i}. {fix}" for i, fix in enumerate(fixes, 1))
    )


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file (or step directory) ``path`` is missing, truncated, altered or unreadable."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path, self.problem = Path(path), problem
        super().__init__(
            f"checkpoint file {self.path} is damaged: {problem}. Possible solutions:\n"
            "  1. resume without naming a step: --resume falls back to the newest intact checkpoint\n"
            "  2. restore the file from a copy, or delete its step directory"
        )


class NoIntactCheckpointError(CheckpointError):
    """Resume was asked for, checkpoints exist, but every one of them is damaged."""


class CheckpointWriteError(CheckpointError):
    """The checkpoint of a step could not be written (not committed)."""


class NonFiniteStateError(CheckpointError):
    """The state to be saved holds NaN or inf values; no checkpoint file was written."""


class CheckpointDirectoryError(CheckpointError):
    """``--checkpoint-dir`` holds what the recipe's saves cannot write over (refused at start)."""


def step_dir_name(step: int) -> str:
    """Name of the directory holding the checkpoint of ``step`` (``step_00000040``)."""
    return f"step_{step:08d}"


def _restore(live: Any, saved: Any, where: str, copy: bool = True) -> None:
    """Copies ``saved`` into ``live`` (``copy=False``: only checks that they fit)."""
    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or live.shape != saved.shape:
            raise CheckpointMismatchError(f"{where}: shape {tuple(live.shape)} differs from the checkpoint's")
        if copy:
            live.copy_(saved)
    elif isinstance(live, dict):
        if not isinstance(saved, dict) or set(live) != set(saved):
            missing = sorted(map(str, set(live) - set(saved or {})))
            extra = sorted(map(str, set(saved or {}) - set(live)))
            raise CheckpointMismatchError(f"{where}: keys differ (missing {missing[:5]}, extra {extra[:5]})")
        for k in live:
            _restore(live[k], saved[k], f"{where}.{k}", copy)
    elif isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(live) != len(saved):
            raise CheckpointMismatchError(f"{where}: length differs from the checkpoint's")
        for i, (a, b) in enumerate(zip(live, saved)):
            _restore(a, b, f"{where}[{i}]", copy)
    # Other leaves (learning rates, flags) come from the config, not the checkpoint.


def _floating_tensors(obj: Any, where: str) -> list[tuple[str, torch.Tensor]]:
    """Every non-empty floating-point tensor this rank holds in ``obj``, with its path."""
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
    return [t for key, value in items for t in _floating_tensors(value, f"{where}.{key}" if where else str(key))]


def _non_finite(parts: dict[str, Any], limit: int = 5) -> list[str]:
    """Paths of tensors in ``parts`` holding NaN or inf (at most ``limit``); ``amax`` / ``amin`` propagate
    NaN and reach +-inf: no full-size temporary, one host read per device."""
    tensors = [(k, t) for part, value in parts.items() for k, t in _floating_tensors(value, part)]
    if not tensors:
        return []
    flags: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, (_, t) in enumerate(tensors):
        flags.setdefault(t.device, []).append((i, torch.isfinite(torch.stack([t.amax(), t.amin()])).all()))
    finite = [True] * len(tensors)
    for items in flags.values():
        for (i, _), ok in zip(items, torch.stack([f for _, f in items]).tolist()):
            finite[i] = ok
    return [name for (name, _), ok in zip(tensors, finite) if not ok][:limit]


# Fingerprint fields only micro_dlrm_dram's tables use: changing them elsewhere is no mismatch.
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
    """``"; changed since it was saved: dense_lr 0.01 -> 0.02 (...)"`` (world size included) or ``""``."""
    saved = meta["noted"] if isinstance(meta.get("noted"), dict) else {}
    changes = [f"{k} {saved[k]!r} -> {v!r}" for k, v in _noted(config).items() if k in saved and saved[k] != v]
    saved_world = meta.get("world_size")
    if isinstance(saved_world, int) and saved_world != world:
        changes.append(
            f"world size {saved_world} -> {world} (global batch {config.batch_size * saved_world} -> "
            f"{config.batch_size * world} samples per step)"
        )
    if not changes:
        return ""
    return (
        f"; changed since it was saved: {', '.join(changes)} "
        "(training continues with the new values, so losses differ from an uninterrupted run's)"
    )


def _meta(step: int, rank: int, world: int, config: TrainConfig, table_ranks: dict[str, Any]) -> dict[str, Any]:
    """The metadata every rank's recipe state carries (checked on load)."""
    return {
        "step": step,
        "rank": rank,
        "world_size": world,
        "table_ranks": dict(table_ranks),
        "fingerprint": fingerprint(config),
        "noted": _noted(config),
        # row-wise shards hold rows in local-id order of this routing
        "routing_version": ROUTING_VERSION,
    }


def _dense_optimizer_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    """State dicts of the parts of ``optimizer`` other than ``model.fused_optimizer`` (the DCP save holds that)."""
    fused = getattr(model, "fused_optimizer", None)
    if optimizer is fused:
        return []
    parts = getattr(optimizer, "optimizers", None)
    dense = [optimizer] if parts is None else [opt for _, opt in parts if opt is not fused]
    return [opt.state_dict() for opt in dense]


@contextlib.contextmanager
def _save_lock(root: Path, step: int) -> Iterator[None]:
    """Rank 0 holds an exclusive ``flock`` on ``root/SAVE_LOCK_NAME`` for the whole save (a collective), so
    another run saving into the same directory cannot mix its files and ``latest`` with ours. Raises
    :class:`CheckpointWriteError` on every rank (nothing written) when another process holds the lock or it
    cannot be created; a file system without ``flock`` saves unlocked.
    """
    rank, world = rank_world(None)
    lock: SaveLock | None = None
    problem: str | None = None
    if rank == 0:
        lock = acquire_save_lock(root)
        if lock.error is not None:
            problem = (
                f"rank 0: creating {lock.path} failed ({type(lock.error).__name__}: {lock.error}). Fix: check "
                "the free space and permissions of --checkpoint-dir"
            )
        elif lock.holder is not None:
            problem = (
                f"another run ({lock.holder}) is saving into {root} at the same time (it holds {lock.path}); two runs "
                "writing one --checkpoint-dir would mix their files. Fix: give each run its own --checkpoint-dir"
            )
    problem = all_gather(problem, world, None)[0]
    if problem is not None:
        raise CheckpointWriteError(f"checkpoint of step {step} was not committed: {problem}")
    try:
        yield
    finally:
        if lock is not None:
            release_save_lock(lock)


def _not_committed(step: int, problem: str) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"checkpoint of step {step} was not committed: {problem}. "
        "Fix: check the free space and permissions of --checkpoint-dir"
    )


def save_checkpoint(
    directory: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    table_ranks: dict[str, Any],
) -> Path:
    """Saves the run's state at ``step`` into ``directory/step_NNNNNNNN``, then names it in
    ``latest`` (a collective). Returns the step directory.

    Args:
        step: completed training steps.
        table_ranks: where each table lives (owner rank, or its planned placement), recorded.

    Raises:
        NonFiniteStateError: some rank's state holds NaN / inf (nothing was written).
        CheckpointWriteError: the step was not committed (``latest`` unchanged), or another
            run is saving into ``directory`` (nothing was written).
    """
    root = Path(directory)
    step_dir = root / step_dir_name(step)
    rank, world = rank_world(None)
    dense = _dense_optimizer_states(model, optimizer)

    def refuse_non_finite(state: dict[str, Any]) -> None:
        found = all_gather(_non_finite({"model": state, "optimizer": dense}), world, None)
        bad = [(r, names) for r, names in enumerate(found) if names]
        if bad:
            listed = "; ".join(f"rank {r}: {', '.join(names)}" for r, names in bad)
            raise NonFiniteStateError(
                f"refusing to save the checkpoint of step {step} into {step_dir}: the state holds NaN/inf "
                f"({listed}). No file was written; {root / LATEST_NAME} still names the last good "
                "checkpoint. Fix: find the first non-finite loss or input (lower --dense-lr / --embedding-lr on "
                "divergence) and resume from the last good checkpoint"
            )

    with _save_lock(root, step):
        try:
            checkpoint.save(
                model,
                step_dir,
                extra_state={"meta": _meta(step, rank, world, config, table_ranks), "optimizer": dense},
                check_state=refuse_non_finite,
            )
        except checkpoint.CheckpointSaveError as e:
            raise _not_committed(
                step, f"writing {step_dir} failed: " + "; ".join(checkpoint.describe_failures(e.problems))
            ) from None
        commit_error: str | None = None
        if rank == 0:
            try:
                FileSystemStorage().write_atomic(root / LATEST_NAME, f"{step}\n".encode())
            except OSError as e:
                commit_error = f"rank 0: writing {root / LATEST_NAME} failed ({e})"
        commit_error = all_gather(commit_error, world, None)[0]  # every rank waits for the commit
        if commit_error:
            raise _not_committed(step, commit_error)
    return step_dir


def _directory_problem(root: Path) -> str | None:
    """Why every save into ``root`` would fail to commit (``root`` a file, ``latest`` not a file), or None."""
    if root.exists() and not root.is_dir():
        return f"{root} is a file, not a directory. Fix: pass a directory (created if missing) as --checkpoint-dir"
    latest = root / LATEST_NAME
    if latest.exists() and not latest.is_file():
        return (
            f"{latest} is a directory (or another non-file), where the recipe writes the marker naming the newest "
            "committed step: every save would fail to commit and --resume could not tell which step is newest. "
            f"Fix: move {latest} out of {root} (or delete it), or pass another --checkpoint-dir"
        )
    return None


def check_checkpoint_dir(directory: str) -> None:
    """Refuses, on every rank (a collective) and before anything is built, a ``--checkpoint-dir``
    whose saves would all fail to commit, as rank 0 (the writer of ``latest``) sees it.

    Raises:
        CheckpointDirectoryError: ``directory`` is a file, or ``directory/latest`` is not a file.
    """
    rank, world = rank_world(None)
    problem = all_gather(_directory_problem(Path(directory)) if rank == 0 else None, world, None)[0]
    if problem is not None:
        raise CheckpointDirectoryError(f"checkpoints cannot be saved into {directory}: {problem}")


def latest_step(directory: str) -> int | None:
    """The step ``latest`` names, or None when it is missing.

    Raises:
        CheckpointCorruptError: ``latest`` exists but does not hold a step number.
        CheckpointDirectoryError: ``latest`` is a directory (or another non-file).
    """
    p = Path(directory) / LATEST_NAME
    problem = _directory_problem(Path(directory))
    if problem is not None:
        raise CheckpointDirectoryError(f"checkpoints cannot be read from {directory}: {problem}")
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
    """Steps to try, newest first (with a valid ``latest``, those at or below it: a newer one is an
    uncommitted save), and notes on the ``latest`` marker."""
    steps = checkpoint_steps(directory)
    marker = Path(directory) / LATEST_NAME
    try:
        latest = latest_step(directory)
    except CheckpointCorruptError as e:
        return steps, [f"{e.path} {e.problem}"]
    if latest is None:
        return steps, [f"{marker} is missing"] if steps else []
    if latest in steps:
        return [s for s in steps if s <= latest], []
    return steps, [f"{marker} names step {latest}, which has no directory"]


def resume_step_at_or_past(directory: str, total: int) -> int | None:
    """The step ``--resume`` would continue from, when it is ``total`` or later (else None).

    :func:`load_checkpoint`'s choice without a model and without a collective, reading only
    checkpoints at or past ``total``: lets a run that would train nothing fail before it builds.
    """
    for step in _resume_candidates(directory)[0]:
        if step < total:
            return None
        try:
            checkpoint.verify_checkpoint(Path(directory) / step_dir_name(step), collective=False)
        except checkpoint.CheckpointIntegrityError:
            continue  # the loader skips it too
        return step
    return None


def _check_fit(path: Path, meta: dict[str, Any], config: TrainConfig) -> None:
    """Raises :class:`CheckpointMismatchError` on another config fingerprint or routing version."""
    problems = []
    saved_routing = meta.get("routing_version")
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
            "resume with the checkpoint's config values",
            _FRESH_RUN,
            "on a routing version mismatch, resume with the recpipe release that wrote the checkpoint",
        )


def _prepare(
    step_dir: Path, step: int, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig
) -> dict[str, Any]:
    """Verifies one checkpoint (a collective) and this rank's recipe state against the run;
    changes nothing. Returns the recipe state."""
    try:
        checkpoint.verify_checkpoint(step_dir)
    except checkpoint.CheckpointIntegrityError as e:
        raise CheckpointCorruptError(*e.problems[0]) from None
    extra = checkpoint.read_extra_state(step_dir, rank)
    if extra is None:
        raise CheckpointCorruptError(step_dir, "holds no recipe state (extra_state.rank*): not saved by the recipe")
    saved = extra.value
    meta = saved.get("meta") if isinstance(saved, dict) else None
    got = tuple(meta.get(k) for k in ("step", "rank", "world_size")) if isinstance(meta, dict) else None
    want = (step, extra.rank, extra.world_size)
    if got != want or "optimizer" not in saved:
        raise CheckpointCorruptError(
            extra.path,
            f"its recipe state (step, rank, world size) is {got}, expected {want} (a file from another checkpoint)",
        )
    assert isinstance(meta, dict)
    _check_fit(extra.path, meta, config)
    try:
        _restore(_dense_optimizer_states(model, optimizer), saved["optimizer"], "optimizer", copy=False)
    except CheckpointMismatchError as e:
        raise _mismatch(
            f"checkpoint {extra.path} does not fit this run's state: {e}",
            "resume with the config the checkpoint was saved with",
            _FRESH_RUN,
        ) from None
    return saved


def _verdict(
    step_dir: Path, rank: int, world: int, prepare: Callable[[], dict[str, Any]]
) -> tuple[dict[str, Any] | None, list[tuple[str, str, str]]]:
    """``prepare()`` (a :func:`_prepare`) on every rank, then every rank's verdict ``(kind, path, problem)``."""
    saved: dict[str, Any] | None = None
    try:
        saved = prepare()
        verdict = ("ok", "", "")
    except CheckpointCorruptError as e:
        verdict = ("corrupt", str(e.path), e.problem)
    except CheckpointMismatchError as e:
        verdict = ("mismatch", "", str(e))
    except Exception as e:  # noqa: BLE001 - told to every rank below, then re-raised here
        all_gather(("error", "", f"rank {rank}: {type(e).__name__}: {e}"), world, None)
        raise
    verdicts = all_gather(verdict, world, None)
    errors = [v[2] for v in verdicts if v[0] == "error"]
    if errors:
        raise CheckpointError(f"loading checkpoint {step_dir} failed on another rank: {errors[0]}")
    mismatches = [v[2] for v in verdicts if v[0] == "mismatch"]
    if mismatches:
        raise CheckpointMismatchError(mismatches[0])
    return saved, verdicts


def load_checkpoint(
    directory: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    step: int | None = None,
) -> int:
    """Restores this rank's state in place from a verified checkpoint (a collective).

    Without ``step`` (``--resume``) it takes the newest intact checkpoint at or below
    ``latest`` (any step directory when ``latest`` is missing or unreadable), skipping damaged
    ones; rank 0 prints one line naming what was skipped and which step is used. Nothing is
    modified until every rank has verified the chosen checkpoint.

    Args:
        model: freshly built DMP model (same config; any world size and placement).
        optimizer: its combined optimizer, before any step.
        step: load exactly this step; a damaged file raises instead of falling back.

    Returns:
        The step to continue from.

    Raises:
        CheckpointNotFoundError: no checkpoint in ``directory`` (or no directory for ``step``).
        NoIntactCheckpointError: checkpoints exist but every one is damaged.
        CheckpointCorruptError: ``step`` was given and a file of it is damaged.
        CheckpointMismatchError: config fingerprint, routing version or model differ.
    """
    rank, world = rank_world(None)
    root = Path(directory)
    if step is not None:
        candidates, notes = [step], []
        if not (root / step_dir_name(step)).is_dir():
            raise CheckpointNotFoundError(f"checkpoint {root / step_dir_name(step)} does not exist")
    else:
        # Rank 0 lists the directory, so every rank tries the same steps in the same order.
        candidates, notes = all_gather(_resume_candidates(directory) if rank == 0 else None, world, None)[0]
    if not candidates:
        raise CheckpointNotFoundError(
            f"resume=True but {directory!r} has no checkpoint (no step_* directory, 'latest' missing). "
            "Fix: point --checkpoint-dir at a directory a previous run saved into, or drop --resume"
        )
    skipped: list[str] = []
    for candidate in candidates:
        step_dir = root / step_dir_name(candidate)
        saved, verdicts = _verdict(
            step_dir, rank, world, lambda: _prepare(step_dir, candidate, rank, model, optimizer, config)
        )
        damaged = list(dict.fromkeys((v[1], v[2]) for v in verdicts if v[0] == "corrupt"))
        if damaged:
            if step is not None:
                raise CheckpointCorruptError(*damaged[0])
            skipped.append(f"damaged checkpoint {step_dir.name} ({'; '.join(f'{p}: {why}' for p, why in damaged)})")
            continue
        assert saved is not None
        changed = _changed_since(saved["meta"], config, world)
        if rank == 0 and (skipped or notes):
            why = "; ".join(notes + skipped)
            print(f"[recpipe] resume: {why}; resuming from {step_dir} instead{changed}", flush=True)
        elif rank == 0:
            print(f"[recpipe] resumed from {step_dir}{changed}", flush=True)
        # verified above; its save refused non-finite rows before writing
        checkpoint.load(model, step_dir, verify=False, check_rows=False)
        with torch.no_grad():
            _restore(_dense_optimizer_states(model, optimizer), saved["optimizer"], "optimizer")
        return int(saved["meta"]["step"])
    raise NoIntactCheckpointError(
        f"resume=True but no checkpoint in {directory!r} is intact: "
        + "; ".join(notes + skipped)
        + ". Nothing was loaded. Possible solutions:\n"
        "  1. restore the damaged files from a copy\n"
        f"  2. {_FRESH_RUN}"
    )
