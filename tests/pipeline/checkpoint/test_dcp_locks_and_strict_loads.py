"""Save locks, argument checks and strict loads of recpipe.pipeline.checkpoint.

* ``save`` holds an exclusive ``flock`` on ``<checkpoint_id>/.recpipe_save.lock`` for the whole
  save (``recpipe.pipeline.checkpoint.integrity.acquire_save_lock``, the recipe's lock too); a
  save finding it held raises ``CheckpointSaveError`` on every rank, naming the holder and the
  fix, and writes nothing (the directory keeps its older save).
* ``load_dcp_state_dict`` / ``verify_checkpoint`` of a missing directory say so.
* Every tiered export is read and checked (one at a time) on every rank before anything is
  written: a load refusing NaN / inf rows leaves the model as it was.
* ``strict`` is ``load_state_dict``'s: ``strict=False`` keeps the model's values of entries
  (or a whole tiered table) the checkpoint lacks; ``strict=True`` refuses checkpoint entries
  the model lacks by name, before anything is read.
* ``verify=True`` with an fsspec reader names the limit (local files only) and ``verify=False``.
* ``save`` into a file says the path is a file.

The tiered model and batches are those of ``tests/harness/dcp_models.py`` (tiered t0 HYBRID,
t1 CACHING, a torchrec ROW_WISE FUSED t2, row-wise Adagrad, a dense head; 2 gloo ranks).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest
import torch
from harness.dcp_models import (
    SAVE_PLACEMENTS,
    TABLES,
    TRAIN_STEPS,
    dense_opt,
    poison_a_row_of_rank1,
    shard_arrays,
    tiered_model,
    train_step,
)
from harness.gloo import run_gloo

LOCK = ".recpipe_save.lock"  # recpipe.pipeline.checkpoint.SAVE_LOCK_NAME, the recipe's lock file too


def _hold_lock(directory: Path) -> int:
    """Takes the save lock as another job's rank 0 would (its own open file, so another
    holder than any file descriptor recpipe opens), naming itself in the file."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.write(fd, b"pid 4242 on otherhost\n")
    return fd


def _linear(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def _lock_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    import torch.distributed as dist

    from recpipe.pipeline import checkpoint as recpipe_dcp

    directory = Path(root)
    model = _linear(0)
    recpipe_dcp.save(model, directory)  # the older save
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    before = {p.name: p.read_bytes() for p in directory.iterdir()} if rank == 0 else None
    dist.barrier()
    fd = _hold_lock(directory) if rank == 0 else None
    dist.barrier()
    out: Dict[str, Any] = {}
    try:
        recpipe_dcp.save(_linear(1), directory)
        out["error"] = None
    except recpipe_dcp.CheckpointSaveError as e:
        out["error"] = str(e)
    finally:
        dist.barrier()
        if fd is not None:
            os.close(fd)
    if rank == 0:
        after = {p.name: p.read_bytes() for p in directory.iterdir()}
        out["untouched"] = {k: after.get(k) == v for k, v in before.items() if k != LOCK}  # type: ignore[union-attr]
    fresh = _linear(2)
    recpipe_dcp.load(fresh, directory)  # still the older save, committed
    out["loaded_equal"] = all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    dist.barrier()
    recpipe_dcp.save(_linear(1), directory)  # the lock is free again
    dist.barrier()  # rank 0 releases the lock as it returns
    out["listing"] = sorted(p.name for p in directory.iterdir())
    return out


def test_dcp_save_refuses_a_directory_another_save_holds_on_every_rank(tmp_path: Path) -> None:
    for rank, out in enumerate(run_gloo(2, _lock_body, str(tmp_path / "ckpt"))):
        msg = out["error"]
        assert msg is not None, f"rank {rank}: saved into a directory another save held"
        assert "another save (pid 4242 on otherhost)" in msg and LOCK in msg, msg
        assert "its own checkpoint directory" in msg and "Possible solutions" in msg, msg
        assert out["loaded_equal"], f"rank {rank}: the older save was changed"
        if rank == 0:
            assert out["untouched"] and all(out["untouched"].values()), out["untouched"]
        # once free, a save goes through and leaves no lock file behind
        assert LOCK not in out["listing"] and "recpipe_digests.json" in out["listing"], out["listing"]


def test_dcp_save_outside_torch_distributed_refuses_a_held_directory(tmp_path: Path) -> None:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    directory = tmp_path / "ckpt"
    fd = _hold_lock(directory)
    try:
        with pytest.raises(recpipe_dcp.CheckpointSaveError, match=r"another save \(pid 4242 on otherhost\)"):
            recpipe_dcp.save(_linear(0), directory)
    finally:
        os.close(fd)
    assert sorted(p.name for p in directory.iterdir()) == [LOCK]  # nothing written
    model = _linear(0)
    recpipe_dcp.save(model, directory)
    fresh = _linear(1)
    recpipe_dcp.load(fresh, directory)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k], v, rtol=0, atol=0)


def test_dcp_save_into_a_file_names_it(tmp_path: Path) -> None:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    f = tmp_path / "ckpt"
    f.write_bytes(b"x")
    with pytest.raises(recpipe_dcp.CheckpointSaveError, match=r"(?s)is a file, not a directory.*pass a directory"):
        recpipe_dcp.save(_linear(0), f)
    assert f.read_bytes() == b"x"


@pytest.mark.parametrize("verify", [True, False])
def test_load_dcp_state_dict_of_a_missing_directory_says_so(tmp_path: Path, verify: bool) -> None:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    missing = tmp_path / "missing_dir"
    model = _linear(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(recpipe_dcp.CheckpointNotFoundError) as err:
        recpipe_dcp.load_dcp_state_dict(model, str(missing), verify=verify)
    msg = str(err.value)
    assert f"{str(missing)!r} (`checkpoint`) does not exist" in msg, msg
    assert "recpipe_digests.json" not in msg, msg
    with pytest.raises(recpipe_dcp.CheckpointNotFoundError, match=r"\(`checkpoint_id`\) does not exist"):
        recpipe_dcp.verify_checkpoint(missing)
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v)


def _snapshot(model: Any) -> Dict[str, Any]:
    """Everything a load writes: tiered rows, torchrec shards, fused optimizer state, head."""
    sd = model.state_dict()
    out: Dict[str, Any] = {
        k: shard_arrays(v) for k, v in sd.items() if isinstance(v, torch.Tensor) and "tiered" not in k
    }
    for name, st in model.module.ebc.tiered_state().items():
        out[f"tiered/{name}"] = (
            st.global_ids.numpy().copy(),
            st.weights.numpy().copy(),
            st.optimizer_state.numpy().copy(),
            st.step,
        )
    for param_key, states in model.fused_optimizer.state_dict()["state"].items():
        for state_key, value in states.items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{param_key}/{state_key}"] = shard_arrays(value)
    return out


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
    else:
        assert a == b, where


def _refused_rows_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    model = _saved_poisoned_model(rank, world, root)
    out: Dict[str, Any] = {}
    # t1's placement swapped (the same routing: only this rank's own export is read)
    for label, placements in {
        "same": SAVE_PLACEMENTS,
        "swapped": dict(SAVE_PLACEMENTS, t1=dict(mode="HYBRID", cache_load_factor=0.5, seed=3)),
    }.items():
        fresh = tiered_model(world, placements)
        before = _snapshot(fresh)
        try:
            recpipe_dcp.load(fresh, root)
            out[label] = {"error": None}
        except recpipe_dcp.CheckpointTableError as e:
            out[label] = {"error": str(e)}
        out[label]["before"] = before
        out[label]["after"] = _snapshot(fresh)
        # the trained model differs from a fresh one: a partial load would show
        out[label]["differs"] = not np.array_equal(
            before["head.weight"][0][1], model.state_dict()["head.weight"].numpy()
        )
    return out


def test_dcp_load_refusing_tiered_rows_leaves_the_model_unchanged_on_every_rank(tmp_path: Path) -> None:
    outs = run_gloo(2, _refused_rows_body, str(tmp_path / "ckpt"))
    for rank, out in enumerate(outs):
        for label, case in out.items():
            msg = case["error"]
            assert msg is not None, f"rank {rank} ({label}): loaded NaN rows"
            assert case["differs"]
            _assert_same(case["after"], case["before"], f"rank {rank} ({label})")
            assert "rank 1:" in msg and "'t1'" in msg and "NaN" in msg and "unchanged" in msg, msg
            assert "partly loaded" not in msg, msg


def _one_rank_refused_rows_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    fresh = tiered_model(world, SAVE_PLACEMENTS)  # another routing than the 2 saving ranks': every export is read
    before = _snapshot(fresh)
    try:
        recpipe_dcp.load(fresh, root)
        error = None
    except recpipe_dcp.CheckpointTableError as e:
        error = str(e)
    return {"error": error, "before": before, "after": _snapshot(fresh)}


def _saved_poisoned_model(rank: int, world: int, root: str) -> Any:
    """Trains a tiered model, puts a NaN into a row rank 1 holds and saves it by hand (the
    README's save, which does not check the rows); returns the model."""
    import torch.distributed.checkpoint as dcp

    from recpipe.pipeline import checkpoint as recpipe_dcp

    model = tiered_model(world, SAVE_PLACEMENTS)
    opt = dense_opt(model)
    for step in range(TRAIN_STEPS):
        train_step(model, opt, TABLES, step, [rank])
    poison_a_row_of_rank1(model)
    dcp.save(recpipe_dcp.dcp_state_dict(model), checkpoint_id=root)
    recpipe_dcp.write_digests(root)
    return model


def _save_poisoned_body(rank: int, world: int, root: str) -> None:
    _saved_poisoned_model(rank, world, root)


def test_dcp_load_on_another_world_size_refusing_rows_leaves_the_model_unchanged(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    run_gloo(2, _save_poisoned_body, root)
    (out,) = run_gloo(1, _one_rank_refused_rows_body, root)
    assert out["error"] is not None and "'t1'" in out["error"] and "NaN" in out["error"], out["error"]
    _assert_same(out["after"], out["before"], "1 rank")
    assert "unchanged" in out["error"], out["error"]


class _Net(torch.nn.Module):
    """A dense model; ``extra`` adds a layer (a model changed since the save)."""

    def __init__(self, seed: int, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(3, 2)
        if extra:
            self.b = torch.nn.Linear(2, 2)


def _values(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_dcp_load_strict_false_keeps_entries_the_checkpoint_lacks(tmp_path: Path) -> None:
    """``strict=False`` is ``load_state_dict``'s: an entry the checkpoint lacks (e.g. a layer
    added since) keeps the model's value instead of DCP's "Missing key" refusal."""
    from recpipe.pipeline import checkpoint as recpipe_dcp

    saved = _Net(0)
    recpipe_dcp.save(saved, tmp_path / "ckpt")
    model = _Net(1, extra=True)
    reference = _Net(1, extra=True)  # torch's own partial load of the same state
    reference.load_state_dict(saved.state_dict(), strict=False)
    recpipe_dcp.load(model, tmp_path / "ckpt", strict=False)
    for k, v in _values(reference).items():
        assert torch.equal(model.state_dict()[k], v), k
    # strict=True still refuses it, naming the entry and the strict=False way out
    strict_model = _Net(1, extra=True)
    before = _values(strict_model)
    with pytest.raises(recpipe_dcp.CheckpointLoadError, match=r"(?s)Missing key.*b\.(bias|weight).*strict=False"):
        recpipe_dcp.load(strict_model, tmp_path / "ckpt")
    for k, v in before.items():
        assert torch.equal(strict_model.state_dict()[k], v), k


def test_dcp_load_strict_refuses_entries_the_model_lacks(tmp_path: Path) -> None:
    """A checkpoint of a model with another layer (or table) loaded with ``strict=True`` is
    refused naming the entries this model lacks, before anything is read (DCP alone reads only
    the model's keys and would drop them), as ``load_state_dict(strict=True)`` refuses unexpected
    keys; ``strict=False`` loads the rest as torch's would."""
    from recpipe.pipeline import checkpoint as recpipe_dcp

    saved = _Net(0, extra=True)
    recpipe_dcp.save(saved, tmp_path / "ckpt")
    model = _Net(1)
    before = _values(model)
    with pytest.raises(RuntimeError, match="Unexpected key"):  # torch's verdict on the same state
        _Net(1).load_state_dict(saved.state_dict(), strict=True)
    with pytest.raises(
        recpipe_dcp.CheckpointLoadError, match=r"(?s)entries this model does not have: b\.bias, b\.weight.*strict=False"
    ):
        recpipe_dcp.load(model, tmp_path / "ckpt")
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k
    reference = _Net(1)
    reference.load_state_dict(saved.state_dict(), strict=False)
    recpipe_dcp.load(model, tmp_path / "ckpt", strict=False)
    for k, v in _values(reference).items():
        assert torch.equal(model.state_dict()[k], v), k


def test_load_dcp_state_dict_of_an_fsspec_reader_with_verify_names_the_limit(tmp_path: Path) -> None:
    """``verify`` checks files on the local file system only: with an fsspec reader the
    refusal names ``verify`` and the fix, and ``verify=False`` loads it (no local directory check)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    from recpipe.pipeline import checkpoint as recpipe_dcp

    saved = _Net(0)
    recpipe_dcp.save(saved, tmp_path / "ckpt")
    url = f"file://{tmp_path / 'ckpt'}"
    model = _Net(1)
    before = _values(model)
    with pytest.raises(ValueError, match=r"(?s)FsspecReader.*local file system only.*verify=False"):
        recpipe_dcp.load_dcp_state_dict(model, FsspecReader(url))
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k
    recpipe_dcp.load_dcp_state_dict(model, FsspecReader(url), verify=False)
    for k, v in saved.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def _tiered_table_added_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from recpipe.pipeline import checkpoint as recpipe_dcp

    model = tiered_model(world, SAVE_PLACEMENTS)
    opt = dense_opt(model)
    for step in range(TRAIN_STEPS):
        train_step(model, opt, TABLES, step, [rank])
    # the checkpoint of a model without t1 (added since): none of its entries
    state = {k: v for k, v in recpipe_dcp.dcp_state_dict(model).items() if "embedding_bags.t1." not in k}
    dcp.save(state, checkpoint_id=root)
    recpipe_dcp.write_digests(root)
    out: Dict[str, Any] = {"saved": _snapshot(model)}
    strict_model = tiered_model(world, SAVE_PLACEMENTS)
    out["strict_before"] = _snapshot(strict_model)
    try:
        recpipe_dcp.load(strict_model, root)
        out["strict_error"] = None
    except recpipe_dcp.CheckpointTableError as e:
        out["strict_error"] = str(e)
    out["strict_after"] = _snapshot(strict_model)
    fresh = tiered_model(world, SAVE_PLACEMENTS)
    out["fresh"] = _snapshot(fresh)
    recpipe_dcp.load(fresh, root, strict=False)
    out["loaded"] = _snapshot(fresh)
    return out


def test_dcp_load_strict_false_keeps_a_tiered_table_the_checkpoint_lacks(tmp_path: Path) -> None:
    """A tiered table added since the save (absent from the checkpoint: no rows, no weight
    entry) keeps its rows with ``strict=False``, as ``load_state_dict(strict=False)`` keeps
    missing entries, and everything else loads.
    ``strict=True`` still refuses it by name, changing nothing."""
    for rank, out in enumerate(run_gloo(2, _tiered_table_added_body, str(tmp_path / "ckpt"))):
        msg = out["strict_error"]
        assert msg is not None and "'module.ebc.embedding_bags.t1' is tiered in this model" in msg, msg
        _assert_same(out["strict_after"], out["strict_before"], f"rank {rank} strict")
        loaded, saved, fresh = out["loaded"], out["saved"], out["fresh"]
        _assert_same(loaded["tiered/t1"], fresh["tiered/t1"], f"rank {rank} t1 (kept)")
        for key in ("tiered/t0", "head.weight", "head.bias"):
            _assert_same(loaded[key], saved[key], f"rank {rank} {key}")
        t2 = [k for k in saved if "t2" in k]
        assert t2, sorted(saved)
        for key in t2:  # the torchrec table and its fused optimizer state
            _assert_same(loaded[key], saved[key], f"rank {rank} {key}")


def _rows_check_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    """Which loads read the tiered exports a first time to check them: counted by wrapping
    ``layout.check_tiered_rows`` in this (spawned) process."""
    import json

    import torch.distributed.checkpoint as dcp

    from recpipe.pipeline import checkpoint as recpipe_dcp
    from recpipe.pipeline.checkpoint import layout

    model = tiered_model(world, SAVE_PLACEMENTS)
    opt = dense_opt(model)
    for step in range(TRAIN_STEPS):
        train_step(model, opt, TABLES, step, [rank])
    saved, by_hand = os.path.join(root, "saved"), os.path.join(root, "by_hand")
    recpipe_dcp.save(model, saved)
    dcp.save(recpipe_dcp.dcp_state_dict(model), checkpoint_id=by_hand)  # the README's by-hand save
    recpipe_dcp.write_digests(by_hand)
    calls = []
    original = layout.check_tiered_rows
    layout.check_tiered_rows = lambda *a, **k: (calls.append(a[3]), original(*a, **k))[1]
    out: Dict[str, Any] = {
        "flags": {
            name: json.loads(Path(d, recpipe_dcp.DIGESTS_NAME).read_text()).get("tiered_rows_checked")
            for name, d in (("saved", saved), ("by_hand", by_hand))
        }
    }
    for label, path, kwargs in (
        ("saved", saved, {}),
        ("saved_forced", saved, {"check_rows": True}),
        ("saved_unverified", saved, {"verify": False}),
        ("by_hand", by_hand, {}),
    ):
        fresh = tiered_model(world, SAVE_PLACEMENTS)
        calls.clear()
        recpipe_dcp.load(fresh, path, **kwargs)
        out[label] = {"checked": sorted(calls)}
    return out


def test_dcp_load_reads_rows_twice_only_when_save_did_not_check_them(tmp_path: Path) -> None:
    """``save`` refuses NaN / inf tiered rows before it writes complete exports and records so
    in its verified digests record: loading such a checkpoint skips the first read of the
    exports (it could find nothing; it cost 0.6 s per GB of tiered rows per load). A by-hand
    save (``write_digests`` records no such check), ``verify=False`` or ``check_rows=True``
    keep it."""
    for rank, out in enumerate(run_gloo(2, _rows_check_body, str(tmp_path))):
        assert out["flags"] == {"saved": True, "by_hand": None}, out["flags"]
        tables = [f"module.ebc.embedding_bags.{t}" for t in ("t0", "t1")]
        assert out["saved"]["checked"] == [], (rank, out["saved"])
        for label in ("saved_forced", "saved_unverified", "by_hand"):
            assert out[label]["checked"] == tables, (rank, label, out[label])
