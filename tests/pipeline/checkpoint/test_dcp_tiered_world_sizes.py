"""DCP checkpoints (recpipe.pipeline.checkpoint) of models with tiered tables, across world sizes.

A DMP model (EBC with tiered tables t0, t1 and a plain torchrec ROW_WISE FUSED table
t2, fused row-wise Adagrad; a dense head under DDP) trains 3 steps on 2 gloo ranks
and is saved with ``recpipe.pipeline.checkpoint.save``. It is loaded on 1 rank and on 2
ranks with the tiered placements swapped (HYBRID <-> CACHING); every table's
(global id -> row, optimizer state) must equal what was saved bit for bit, and the
next step's outputs must equal those of the saving model (which never went through
DCP). A torchrec TABLE_WISE model (plain EmbeddingBagCollectionSharder) is saved and
loaded through the same helpers with its tables moved to the other rank (DCP's own
resharding). Error cases: a checkpoint of another table size is refused naming the
table (a tiered one by recpipe, a torchrec one by DCP, raised as one CheckpointLoadError);
a failed DCP write is a CheckpointSaveError; a checkpoint without a table's tiered rows is refused; a damaged checkpoint
(bit flip, truncation, missing or foreign file, edited or missing digests record) is
refused on every rank, naming the file, before the model changes.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from harness.dcp_models import (
    IO_TABLES,
    LR,
    SAVE_PLACEMENTS,
    SWAPPED_PLACEMENTS,
    TABLES,
    TRAIN_STEPS,
    Model,
    dense_opt,
    make_ebc,
    plain_torchrec_model,
    shard_arrays,
    tiered_model,
    train_step,
)
from harness.gloo import run_gloo

TW_TABLES = [("u0", 40, 4, ["g0"]), ("u1", 30, 4, ["g1"])]


def _table_wise_model(world: int, owners: Dict[str, int]) -> Any:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    ebc = make_ebc(TW_TABLES, seed=2)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": LR})
    sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        ebc,
        {n: table_wise(rank=owners[n]) for n in owners},
        sharder=sharder,
        local_size=world,
        world_size=world,
        device_type="cpu",
    )
    return DistributedModelParallel(
        Model(ebc, sum(d * len(f) for _, _, d, f in TW_TABLES)),
        plan=ShardingPlan({"ebc": plan}),
        sharders=[sharder],  # type: ignore[list-item]
        device=torch.device("cpu"),
    )


def _has_rows(value: Any) -> bool:
    """A ShardedTensor, or a non-empty tensor (tiered tables keep an empty placeholder)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor) or value.numel() > 0


def _view(model: Any) -> Dict[str, Any]:
    """This rank's view of every table: tiered exports, torchrec shards, optimizer shards, dense head."""
    out: Dict[str, Any] = {"tiered": {}, "torchrec": {}, "optim": {}, "head": None}
    module = model.module.ebc
    if hasattr(module, "tiered_state"):
        for name, st in module.tiered_state().items():
            out["tiered"][name] = (st.global_ids.numpy(), st.weights.numpy(), st.optimizer_state.numpy(), st.step)
    sd = model.state_dict()
    for key, value in sd.items():
        if key.startswith("ebc.embedding_bags.") and key.endswith(".weight") and _has_rows(value):
            out["torchrec"][key.split(".")[2]] = shard_arrays(value)
    for param_key, states in model.fused_optimizer.state_dict()["state"].items():
        for state_key, value in states.items():
            if isinstance(value, torch.Tensor) and _has_rows(value) and value.dim() > 0:
                out["optim"][f"{param_key}/{state_key}"] = shard_arrays(value)
    out["head"] = sd["head.weight"].numpy().copy() if "head.weight" in sd else None
    return out


def _assemble(views: List[Dict[str, Any]]) -> Dict[str, np.ndarray]:
    """Global tables from the ranks' views: tiered by global id, torchrec by offsets."""
    full: Dict[str, np.ndarray] = {}
    for view in views:
        for name, (gids, w, s, step) in view["tiered"].items():
            rows = dict((n, r) for n, r, *_ in TABLES)[name]
            for tag, values in (("w", w), ("s", s)):
                buf = full.setdefault(f"{name}/{tag}", np.full((rows, values.shape[1]), np.nan, values.dtype))
                assert np.isnan(buf[gids]).all(), f"{name}: a row appears twice"
                buf[gids] = values
            full[f"{name}/step"] = np.array(step)
        for group in ("torchrec", "optim"):
            for name, shards in view[group].items():
                for offsets, t in shards:
                    key = f"{group}/{name}"
                    shape = [o + n for o, n in zip(offsets, t.shape)]
                    if key in full:
                        old = full[key]
                        grown = np.full([max(a, b) for a, b in zip(old.shape, shape)], np.nan, t.dtype)
                        grown[tuple(slice(0, n) for n in old.shape)] = old
                        full[key] = grown
                    else:
                        full[key] = np.full(shape, np.nan, t.dtype)
                    full[key][tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
        if view["head"] is not None:
            full["head"] = view["head"]
    for key, value in full.items():
        assert not np.isnan(value).any(), f"{key}: rows missing"
    return full


def _save_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    out: Dict[str, Any] = {}
    for kind, model, tables in (
        ("tiered", tiered_model(world, SAVE_PLACEMENTS), TABLES),
        ("tw", _table_wise_model(world, {"u0": 0, "u1": 1}), TW_TABLES),
    ):
        opt = dense_opt(model)
        for step in range(TRAIN_STEPS):
            train_step(model, opt, tables, step, [rank])
        recpipe_dcp.save(model, f"{root}/{kind}")
        out[kind] = _view(model)
        out[kind + "_next"] = train_step(model, opt, tables, TRAIN_STEPS, [rank])
    return out


def _load_body(
    rank: int, world: int, root: str, placements: Dict[str, Dict[str, Any]], table_wise: bool
) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    ranks = list(range(2)) if world == 1 else [rank]
    model = tiered_model(world, placements)
    # placements really differ from the saving job's
    for name, shard in model.module.ebc.tiered_tables().items():
        assert (shard.mode.name, shard.cache_load_factor) == (
            placements[name]["mode"],
            placements[name]["cache_load_factor"],
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recpipe_dcp.load(model, f"{root}/tiered")
    # the per-export reads are single-process DCP loads on purpose: no "single process" warning
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)], caught
    out: Dict[str, Any] = {
        "tiered": _view(model),
        "tiered_next": train_step(model, dense_opt(model), TABLES, TRAIN_STEPS, ranks),
    }
    if table_wise:
        tw = _table_wise_model(world, {"u0": 1, "u1": 0})  # each table on the other rank
        recpipe_dcp.load(tw, f"{root}/tw")
        out["tw"] = _view(tw)
        out["tw_next"] = train_step(tw, dense_opt(tw), TW_TABLES, TRAIN_STEPS, ranks)
    return out


def _assert_same_tables(saved: Dict[str, np.ndarray], loaded: Dict[str, np.ndarray], what: str) -> None:
    assert sorted(saved) == sorted(loaded), what
    for key in saved:
        np.testing.assert_array_equal(loaded[key], saved[key], err_msg=f"{what}: {key}")


def _wrong_size_body(rank: int, world: int, root: str) -> str:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    tables = [("t0", 98, 8, ["f0", "f1"])] + TABLES[1:]  # t0 has one row more than saved
    model = tiered_model(world, SAVE_PLACEMENTS, tables)
    before = _view(model)
    with pytest.raises(recpipe_dcp.CheckpointTableError) as err:
        recpipe_dcp.load(model, f"{root}/tiered")
    after = _view(model)  # checked before anything is loaded: the torchrec table and the head are untouched
    np.testing.assert_array_equal(after["head"], before["head"])
    for (_, t0), (_, t1) in zip(before["torchrec"]["t2"], after["torchrec"]["t2"]):
        np.testing.assert_array_equal(t1, t0)
    return str(err.value)


def test_dcp_tiered_and_table_wise_across_world_sizes_and_placements(tmp_path: Path) -> None:
    saved = run_gloo(2, _save_body, str(tmp_path))
    saved_tiered = _assemble([s["tiered"] for s in saved])
    saved_tw = _assemble([s["tw"] for s in saved])
    assert {"t0/w", "t1/w", "torchrec/t2"} <= set(saved_tiered)
    assert any(k.startswith("optim/") and "t2" in k for k in saved_tiered)  # t2's fused Adagrad state
    assert float(np.abs(saved_tiered["t0/s"]).sum()) > 0  # tiered optimizer state was trained
    assert int(saved_tiered["t0/step"]) == TRAIN_STEPS

    # W = 2, HYBRID <-> CACHING swapped; TABLE_WISE tables moved to the other rank
    loaded = run_gloo(2, _load_body, str(tmp_path), SWAPPED_PLACEMENTS, True)
    _assert_same_tables(saved_tiered, _assemble([r["tiered"] for r in loaded]), "W=2 swapped")
    _assert_same_tables(saved_tw, _assemble([r["tw"] for r in loaded]), "TABLE_WISE")
    for rank in range(2):
        for kind in ("tiered_next", "tw_next"):
            for key in ("emb", "pred"):
                np.testing.assert_array_equal(
                    loaded[rank][kind][key], saved[rank][kind][key], err_msg=f"rank {rank} {kind} {key}"
                )

    # W = 1 (a 1-rank gloo group) holds every row; its next step sees both ranks' batches
    (single,) = run_gloo(1, _load_body, str(tmp_path), SAVE_PLACEMENTS, False)
    _assert_same_tables(saved_tiered, _assemble([single["tiered"]]), "W=1")
    for key in ("emb", "pred"):
        # pooled partial sums are added across 2 ranks when saved, in one bag on 1 rank
        np.testing.assert_allclose(
            single["tiered_next"][key],
            np.concatenate([saved[r]["tiered_next"][key] for r in range(2)]),
            rtol=1e-6,
            atol=1e-6,
            err_msg=f"W=1 next step {key}",
        )


def test_dcp_refuses_a_table_of_another_size(tmp_path: Path) -> None:
    run_gloo(2, _save_body, str(tmp_path))
    (msg,) = run_gloo(1, _wrong_size_body, str(tmp_path))
    assert "'t0'" in msg and "num_embeddings=97" in msg and "num_embeddings=98" in msg, msg


def _torchrec_size_body(rank: int, world: int, root: str) -> str:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    tables = TABLES[:2] + [("t2", 51, 4, ["f3"])]  # the plain torchrec table has one row more than saved
    model = tiered_model(world, SAVE_PLACEMENTS, tables)
    before = _view(model)
    with pytest.raises(Exception) as err:  # DCP's own CheckpointException is a BaseException
        recpipe_dcp.load(model, f"{root}/tiered")
    assert isinstance(err.value, recpipe_dcp.CheckpointLoadError), repr(err.value)
    after = _view(model)  # DCP refuses while planning: nothing was read into the model
    np.testing.assert_array_equal(after["head"], before["head"])
    for name, saved in before["tiered"].items():
        np.testing.assert_array_equal(after["tiered"][name][1], saved[1], err_msg=name)
    return str(err.value)


def test_dcp_refuses_a_torchrec_table_of_another_size_with_one_clear_error(tmp_path: Path) -> None:
    """DCP's "Size mismatch" is raised as a CheckpointLoadError (an Exception, not DCP's
    BaseException with a traceback per rank), the same on every rank, naming the entry,
    both shapes and the ranks, with possible solutions."""
    run_gloo(2, _save_body, str(tmp_path))
    out = run_gloo(2, _torchrec_size_body, str(tmp_path))
    assert out[0] == out[1], out
    msg = out[0]
    assert (
        "ValueError: Size mismatch between saved torch.Size([50, 4]) and current: torch.Size([51, 4]) for "
        "ebc.embedding_bags.t2.weight (ranks 0, 1)"
    ) in msg, msg
    assert msg.count("Size mismatch") == 1 and "Traceback" not in msg and "Possible solutions:" in msg, msg


def test_dcp_save_failure_is_an_error_and_leaves_no_loadable_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed DCP write (here a full disk) is a CheckpointSaveError naming the OS error,
    and the partial directory has no digests record, so load refuses it."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    from recpipe.pipeline import checkpoint as recpipe_dcp

    model = torch.nn.Linear(3, 2)

    def full_disk(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(FileSystemWriter, "write_data", full_disk)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            with pytest.raises(recpipe_dcp.CheckpointSaveError) as err:
                recpipe_dcp.save(model, tmp_path / "ckpt")
    msg = str(err.value)
    assert f"checkpoint {tmp_path / 'ckpt'} was not saved" in msg, msg
    assert "OSError: [Errno 28] No space left on device (rank 0)" in msg and "free space" in msg, msg
    assert not (tmp_path / "ckpt" / recpipe_dcp.DIGESTS_NAME).exists()
    with pytest.raises(recpipe_dcp.CheckpointIntegrityError, match="missing"):
        recpipe_dcp.load(model, tmp_path / "ckpt")


def test_dcp_save_names_a_full_disk_under_a_short_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that fills mid-file makes torch's zip writer fail with "unexpected pos" (a short
    write), the ENOSPC only its context: the save error names "No space left on device"."""
    import errno
    import io

    from torch.distributed.checkpoint import FileSystemWriter

    from recpipe.pipeline import checkpoint as recpipe_dcp

    class ShortWrites(io.RawIOBase):  # a file on a disk with `room` bytes left
        def __init__(self, room: int) -> None:
            self.room = room

        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            if self.room <= 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = min(self.room, len(b))
            self.room -= n
            return n

    def full_disk(self: Any, *args: Any, **kwargs: Any) -> Any:
        torch.save(torch.zeros(1000), ShortWrites(600))

    with monkeypatch.context() as m:
        m.setattr(FileSystemWriter, "write_data", full_disk)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            with pytest.raises(recpipe_dcp.CheckpointSaveError) as err:
                recpipe_dcp.save(torch.nn.Linear(3, 2), tmp_path / "ckpt")
    msg = str(err.value)
    assert "OSError: [Errno 28] No space left on device (RuntimeError: [enforce fail at inline_container.cc" in msg
    assert "unexpected pos" in msg and "(rank 0)" in msg and "free space" in msg, msg
    assert not (tmp_path / "ckpt" / recpipe_dcp.DIGESTS_NAME).exists()


def _record_not_removable_body(rank: int, world: int, root: str) -> str:
    from recpipe.pipeline import checkpoint as recpipe_dcp

    try:
        recpipe_dcp.save(torch.nn.Linear(3, 2), root)
    except recpipe_dcp.CheckpointSaveError as e:
        return str(e)
    return "saved"


def test_dcp_save_that_cannot_replace_the_old_record_fails_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 removes the previous save's digests record first; when that fails (a
    read-only directory, here a record that is a directory) every rank raises
    CheckpointSaveError naming the record before any rank writes (none waits in DCP's save)."""
    from recpipe.pipeline import checkpoint as recpipe_dcp

    root = tmp_path / "ckpt"
    (root / recpipe_dcp.DIGESTS_NAME / "x").mkdir(parents=True)  # unlink(2) fails: EISDIR
    messages = run_gloo(2, _record_not_removable_body, str(root))
    for msg in messages:
        assert f"checkpoint {root} was not saved" in msg, msg
        assert f"removing the old record {root / recpipe_dcp.DIGESTS_NAME} failed" in msg, msg
        assert "(rank 0)" in msg and "permissions" in msg, msg
    assert sorted(p.name for p in root.iterdir()) == [recpipe_dcp.DIGESTS_NAME]  # nothing written


def _damaged_load_body(rank: int, world: int, root: str, cases: List[str]) -> Dict[str, Any]:
    """Loads every damaged copy into one model; each must fail before the model changes."""
    from recpipe.pipeline import checkpoint as recpipe_dcp

    model = tiered_model(world, SAVE_PLACEMENTS)
    before = _view(model)
    messages: Dict[str, str] = {}
    for case in cases:
        with pytest.raises(recpipe_dcp.CheckpointIntegrityError) as err:
            recpipe_dcp.load(model, f"{root}/{case}")
        messages[case] = str(err.value)
    after = _view(model)
    for name, (ids, w, s, step) in before["tiered"].items():
        np.testing.assert_array_equal(after["tiered"][name][1], w, err_msg=f"{name} changed by a refused load")
        np.testing.assert_array_equal(after["tiered"][name][2], s, err_msg=f"{name} state changed")
    for name, shards in before["torchrec"].items():
        for (_, t0), (_, t1) in zip(shards, after["torchrec"][name]):
            np.testing.assert_array_equal(t1, t0, err_msg=f"{name} changed by a refused load")
    # the record is what makes the check possible: without it, verify=False loads as before
    recpipe_dcp.load(model, f"{root}/no_record", verify=False)
    return {"messages": messages, "loaded": _view(model)}


def _flip(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


def test_dcp_load_verifies_every_file_against_the_digests(tmp_path: Path) -> None:
    from recpipe.pipeline.checkpoint import DIGESTS_NAME

    saved = run_gloo(2, _save_body, str(tmp_path))
    good = tmp_path / "tiered"
    record = json.loads((good / DIGESTS_NAME).read_text())
    data_files = sorted(p.name for p in good.glob("*.distcp"))
    assert len(data_files) == 2 and sorted(record["files"]) == [".metadata", *data_files]
    for name, entry in record["files"].items():
        assert entry["bytes"] == (good / name).stat().st_size
    biggest = max(data_files, key=lambda n: (good / n).stat().st_size)

    def damaged(case: str, damage: Any) -> str:
        shutil.copytree(good, tmp_path / case)
        damage(tmp_path / case)
        return case

    def edit_record(d: Path) -> None:
        body = json.loads((d / DIGESTS_NAME).read_text())
        body["files"][biggest]["bytes"] += 1
        (d / DIGESTS_NAME).write_text(json.dumps(body))

    expected = {
        damaged("flip", lambda d: _flip(d / biggest)): (biggest, "sha256"),
        damaged("flip_meta", lambda d: _flip(d / ".metadata")): (".metadata", "sha256"),
        damaged("truncated", lambda d: (d / biggest).write_bytes((d / biggest).read_bytes()[:-100])): (
            biggest,
            "truncated",
        ),
        damaged("missing", lambda d: (d / biggest).unlink()): (biggest, "missing"),
        damaged("edited_record", edit_record): (DIGESTS_NAME, "altered after the save"),
        damaged("no_record_strict", lambda d: (d / DIGESTS_NAME).unlink()): (DIGESTS_NAME, "verify=False"),
        # a data file DCP's metadata does not reference: DCP would ignore it, the record refuses it
        damaged("foreign", lambda d: shutil.copyfile(d / biggest, d / "__7_0.distcp")): (
            "__7_0.distcp",
            f"not listed in {DIGESTS_NAME}",
        ),
    }
    damaged("no_record", lambda d: (d / DIGESTS_NAME).unlink())
    out = run_gloo(2, _damaged_load_body, str(tmp_path), list(expected))
    for case, (name, problem) in expected.items():
        assert out[0]["messages"][case] == out[1]["messages"][case], case  # every rank, same message
        msg = out[0]["messages"][case]
        assert f"{case}/{name}: " in msg and problem in msg and "Possible solutions:" in msg, f"{case}: {msg}"
    assert "move each such file out of the checkpoint directory" in out[0]["messages"]["foreign"]
    _assert_same_tables(_assemble([s["tiered"] for s in saved]), _assemble([r["loaded"] for r in out]), "verify=False")


def _table_kinds_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    from recpipe.pipeline import checkpoint as recpipe_dcp
    from recpipe.pipeline.tiered.migration import gather_full_weights

    plain = tiered_model(world, {})  # t0, t1, t2 all torchrec ROW_WISE FUSED tables
    train_step(plain, dense_opt(plain), TABLES, 0, [rank])
    recpipe_dcp.save(plain, f"{root}/plain")
    saved_plain = gather_full_weights(plain)
    recpipe_dcp.load(plain, f"{root}/tiered")  # tiered when saved: its FUSED tables load the exports' rows
    out: Dict[str, Any] = {"tiered_into_plain_next": train_step(plain, dense_opt(plain), TABLES, TRAIN_STEPS, [rank])}
    tiered = tiered_model(world, SAVE_PLACEMENTS)
    recpipe_dcp.load(tiered, f"{root}/plain")  # torchrec tables when saved: the tiered tables adopt their rows
    loaded = gather_full_weights(tiered)
    out["plain_into_tiered_equal"] = all(torch.equal(loaded[k], v) for k, v in saved_plain.items())
    return out


def test_dcp_loads_tables_of_another_kind_in_both_directions(tmp_path: Path) -> None:
    """Tiered when saved and torchrec tables when loaded, and the reverse: a torchrec model
    loading a tiered checkpoint runs its next step as the saving tiered model did, and tiered
    tables loading a torchrec model's checkpoint hold that model's tables."""
    saved = run_gloo(2, _save_body, str(tmp_path))
    out = run_gloo(2, _table_kinds_body, str(tmp_path))
    for rank in range(2):
        assert out[rank]["plain_into_tiered_equal"], rank
        for key in ("emb", "pred"):
            np.testing.assert_allclose(
                out[rank]["tiered_into_plain_next"][key], saved[rank]["tiered_next"][key], atol=2e-6, rtol=1e-5
            )


def _torchrec_save_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    """A plain torchrec model, trained, saved as torchrec users do (DCP of its state_dict,
    without and with the fused optimizer) and by recpipe.pipeline.checkpoint.save."""
    import torch.distributed.checkpoint as tdcp

    from recpipe.pipeline import checkpoint as recpipe_dcp

    model = plain_torchrec_model(world, {"a0": 0, "a1": 1}, recpipe_sharder=False, seed=2)
    opt = dense_opt(model)
    for step in range(TRAIN_STEPS):
        train_step(model, opt, IO_TABLES, step, [rank])
    tdcp.save(model.state_dict(), checkpoint_id=f"{root}/torchrec")
    tdcp.save(
        dict(model.state_dict(), fused_optimizer=model.fused_optimizer.state_dict()),
        checkpoint_id=f"{root}/torchrec_with_optimizer",
    )
    recpipe_dcp.save(model, f"{root}/recpipe")
    return {"view": _view(model), "next": train_step(model, opt, IO_TABLES, TRAIN_STEPS, [rank])}


def _torchrec_load_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    import torch.distributed.checkpoint as tdcp

    from recpipe.pipeline import checkpoint as recpipe_dcp

    moved = {"a0": 1, "a1": 0}  # each TABLE_WISE table on the other rank, other initial weights
    out: Dict[str, Any] = {}
    model = plain_torchrec_model(world, moved, recpipe_sharder=True, seed=5)
    fresh = _view(model)
    with pytest.raises(recpipe_dcp.CheckpointLoadError) as err:
        recpipe_dcp.load(model, f"{root}/torchrec", verify=False)
    out["strict_error"] = str(err.value)
    out["unchanged"] = _view(model)
    recpipe_dcp.load(model, f"{root}/torchrec", verify=False, strict=False)
    out["weights_only"], out["fresh"] = _view(model), fresh
    model = plain_torchrec_model(world, moved, recpipe_sharder=True, seed=5)
    recpipe_dcp.load(model, f"{root}/torchrec_with_optimizer", verify=False)
    out["with_optimizer"] = _view(model)
    out["with_optimizer_next"] = train_step(model, dense_opt(model), IO_TABLES, TRAIN_STEPS, [rank])
    # the reverse: recpipe's checkpoint read by plain torchrec and DCP (extra keys are ignored)
    plain = plain_torchrec_model(world, moved, recpipe_sharder=False, seed=5)
    state = dict(plain.state_dict(), fused_optimizer=plain.fused_optimizer.state_dict())
    tdcp.load(state, checkpoint_id=f"{root}/recpipe")
    plain.fused_optimizer.load_state_dict(state.pop("fused_optimizer"))
    plain.load_state_dict(state)
    out["reverse"] = _view(plain)
    out["reverse_next"] = train_step(plain, dense_opt(plain), IO_TABLES, TRAIN_STEPS, [rank])
    return out


def test_dcp_interoperates_with_plain_torchrec_checkpoints(tmp_path: Path) -> None:
    """A plain torchrec model (TABLE_WISE and ROW_WISE FUSED, torchrec's own sharder)
    saved with DCP of its state_dict loads into a recpipe model with its tables placed
    otherwise: every table equal to the source's; with the fused optimizer under
    ``fused_optimizer`` the optimizer state and the next step too. Without it, a strict
    load names the cause on every rank (instead of DCP's "Missing key ... fused_optimizer")
    and strict=False loads the weights. recpipe's own checkpoint of that model loads into
    the plain torchrec model with DCP alone."""
    src = run_gloo(2, _torchrec_save_body, str(tmp_path))
    out = run_gloo(2, _torchrec_load_body, str(tmp_path))
    source = _assemble([s["view"] for s in src])
    weights = {k: v for k, v in source.items() if not k.startswith("optim/")}
    assert {"torchrec/a0", "torchrec/a1", "torchrec/a2", "head"} <= set(weights)
    assert out[0]["strict_error"] == out[1]["strict_error"]
    msg = out[0]["strict_error"]
    assert "holds no fused optimizer state" in msg and "strict=False" in msg and "(ranks 0, 1)" in msg, msg
    fresh = _assemble([r["fresh"] for r in out])
    _assert_same_tables(fresh, _assemble([r["unchanged"] for r in out]), "refused load changed the model")
    loaded = _assemble([r["weights_only"] for r in out])
    _assert_same_tables(weights, {k: v for k, v in loaded.items() if not k.startswith("optim/")}, "strict=False")
    for key in (k for k in loaded if k.startswith("optim/")):  # the model kept its own (fresh) optimizer state
        np.testing.assert_array_equal(loaded[key], fresh[key], err_msg=key)
    _assert_same_tables(source, _assemble([r["with_optimizer"] for r in out]), "with fused_optimizer")
    _assert_same_tables(source, _assemble([r["reverse"] for r in out]), "recpipe -> plain torchrec")
    for rank in range(2):
        for kind in ("with_optimizer_next", "reverse_next"):
            for key in ("emb", "pred"):
                np.testing.assert_array_equal(
                    out[rank][kind][key], src[rank]["next"][key], err_msg=f"rank {rank} {kind} {key}"
                )


def _digests_fail_body(rank: int, world: int, root: str, failing_rank: int) -> Dict[str, Any]:
    """DCP's write succeeds, then the digests record fails on ``failing_rank``: rank 0's
    write of the record through its storage (a full disk), or another rank's hashing (an I/O error)."""
    import errno

    from recpipe.pipeline import checkpoint as recpipe_dcp
    from recpipe.pipeline.checkpoint import integrity

    class FullDisk(recpipe_dcp.FileSystemStorage):
        def write_atomic(self, path: Path, data: bytes) -> None:
            raise OSError(errno.ENOSPC, "injected")

    def unreadable(path: Path) -> Any:
        raise OSError(errno.EIO, "injected")

    model = torch.nn.Linear(3, 2)
    if rank == failing_rank and rank != 0:
        setattr(integrity, "file_entry", unreadable)  # this rank hashes its share of the files
    storage = FullDisk() if rank == failing_rank == 0 else None
    try:
        recpipe_dcp.save(model, root, storage=storage)
    except recpipe_dcp.CheckpointSaveError as e:
        error = str(e)
    except BaseException as e:  # noqa: BLE001 - reported: the contract is CheckpointSaveError
        error = f"not a CheckpointSaveError: {type(e).__name__}: {e}"
    else:
        error = "saved"
    with pytest.raises(recpipe_dcp.CheckpointIntegrityError, match="missing"):
        recpipe_dcp.load(model, root)  # no record: the directory is not taken for a checkpoint
    return {"error": error}


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_dcp_save_whose_digests_record_fails_is_a_save_error_on_every_rank(tmp_path: Path, failing_rank: int) -> None:
    """The digests record is part of the save: when it fails (after DCP's write) every rank
    raises CheckpointSaveError naming the failing rank and the OS error."""
    from recpipe.pipeline import checkpoint as recpipe_dcp

    root = tmp_path / "ckpt"
    out = run_gloo(2, _digests_fail_body, str(root), failing_rank)
    assert out[0]["error"] == out[1]["error"], out
    msg = out[0]["error"]
    assert msg.startswith(f"checkpoint {root} was not saved:"), msg
    what = (
        f"writing {root / recpipe_dcp.DIGESTS_NAME} failed (OSError: [Errno 28] injected) (rank 0)"
        if failing_rank == 0
        else f"hashing the files of {root} failed (OSError: [Errno 5] injected) (rank 1)"
    )
    assert what in msg and "free space" in msg, msg
    assert not (root / recpipe_dcp.DIGESTS_NAME).exists()


def _partial_write_body(rank: int, world: int, root: str) -> Dict[str, Any]:
    """DCP writes this rank's data file, then the disk is full (on rank 1 only)."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    from recpipe.pipeline import checkpoint as recpipe_dcp

    write_data = FileSystemWriter.write_data

    def fills_the_disk(self: Any, *args: Any, **kwargs: Any) -> Any:
        written = write_data(self, *args, **kwargs)
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return written

    setattr(FileSystemWriter, "write_data", fills_the_disk)
    with pytest.raises(recpipe_dcp.CheckpointSaveError) as err:
        recpipe_dcp.save(torch.nn.Linear(3, 2), root)
    return {"error": str(err.value)}


def test_dcp_save_that_fills_the_disk_removes_its_partial_files(tmp_path: Path) -> None:
    """A failed save is not a checkpoint (no digests record, and the previous save's was
    removed first): the data files it did write are removed, not left to keep the disk full."""
    root = tmp_path / "ckpt"
    out = run_gloo(2, _partial_write_body, str(root))
    assert "No space left on device (rank 1)" in out[0]["error"], out
    assert sorted(p.name for p in root.iterdir()) == [], sorted(p.name for p in root.iterdir())
