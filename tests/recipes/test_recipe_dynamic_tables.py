"""The recipe with ``--dynamic-tables``: every table planned dynamic, trained and evaluated end to end.

Checked against the data itself (the keys of the training batches, read from the data source): the tables hold
exactly the raw keys training saw (negatives and keys past 2^32 included), on one rank and row-wise over two
(each rank only the keys its raw-key routing owns); evaluation inserts no key and changes no row; the recipe
trains and evaluates on ``synthetic_raw_keys``, Criteo TSV and MovieLens with the default model
(``micro_dlrm_dram``, ``hash_k`` keys per id), logging ``dynamic/<table>/<counter>`` to TensorBoard; the
planner's pins (capacity, lru, on_full, seed) and the default fast tier that holds the hash indexes.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from harness.criteo_files import CRITEO, write_criteo
from harness.gloo import run_gloo
from harness.recipe_configs import scalars
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from recpipe.pipeline import gather_dynamic_table
from recpipe.pipeline.placement import dynamic_index_bytes, dynamic_local_slots, row_bytes
from recpipe.pipeline.tiered.dynamic.key_hashing import mix64_int, salt_of, to_int64_bits
from recpipe.recipes.build import default_fast_bytes, dynamic_constraints, make_optimizer, make_pipeline, shard_model
from recpipe.recipes.checkpoint_policy import load_checkpoint
from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data.base import IdTransform
from recpipe.recipes.data.hashing import VIRTUAL_KEY_TAG, VirtualKeyProjector, mix_seed
from recpipe.recipes.data.registry import make_data_source
from recpipe.recipes.models import EBC_PATH, build_model, embedding_bag_collection
from recpipe.recipes.tb_logging import DYNAMIC_COUNTERS
from recpipe.recipes.train import run

SMALL_NET: dict[str, Any] = dict(
    embedding_dim=8, dense_arch=(16, 8), over_arch=(16, 1), eval_batches=2, log_every=2, progress_bar=False
)
# 4 steps of 32 samples see at most 128 keys per feature: capacity 4000 evicts none
RAW: dict[str, Any] = dict(
    SMALL_NET,
    dataset="synthetic_raw_keys",
    model="dlrm",
    num_embeddings=4000,
    synthetic_id_space=20_000,
    batch_size=32,
    max_steps=4,
    dynamic_tables=True,
)


@contextlib.contextmanager
def _one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _build(config: TrainConfig) -> tuple[Any, Any, Any]:
    """The recipe's sharded model, pipeline and data source on the initialised process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    source = make_data_source(config, rank, world)
    torch.manual_seed(config.seed)
    model = build_model(config, source.spec, dense_device=torch.device("cpu"))
    sharded = shard_model(config, model, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    optimizer = make_optimizer(config, sharded.model)
    return sharded.model, make_pipeline(config, sharded.model, optimizer, torch.device("cpu")), source


def _train(pipeline: Any, source: Any, steps: int) -> int:
    batches, done = source.train_batches(0, steps), 0
    while True:
        try:
            pipeline.progress(batches)
        except StopIteration:
            return done
        done += 1


def _batch_keys(batches: Iterator[Any]) -> dict[str, set[int]]:
    """Feature -> the distinct ids the batches' KJTs carry (what the tables are looked up by)."""
    out: dict[str, set[int]] = {}
    for batch in batches:
        for feature, jt in batch.sparse_features.to_dict().items():
            out.setdefault(feature, set()).update(jt.values().tolist())
    return out


def _dumps(model: Any, features: tuple[str, ...]) -> dict[str, Any]:
    return {f: gather_dynamic_table(model, f"t_{f}") for f in features}


def test_the_planner_pins_every_table_dynamic_with_its_rows_as_capacity() -> None:
    config = TrainConfig(**RAW, seed=7)
    source = make_data_source(config, 0, 1)
    model = build_model(config, source.spec, dense_device=torch.device("cpu"))
    pins = dynamic_constraints(config, model)
    assert sorted(pins) == sorted(f"t_{f}" for f in source.spec.feature_names)
    for pin in pins.values():
        options = pin.dynamic
        assert options is not None and pin.sharding_type is None and pin.fused is None
        assert (options.capacity, options.eviction, options.on_full, options.admit_after, options.seed) == (
            4000,
            "lru",
            "warning",
            1,
            7,
        )
    static = TrainConfig(**{**RAW, "dynamic_tables": False})
    assert dynamic_constraints(static, model) == {}
    # --fast-tier-mb 0: half of every table's slot rows (row-wise Adagrad: dim + 1 floats) plus its whole index
    apply_optimizer_in_backward(RowWiseAdagrad, embedding_bag_collection(model).parameters(), {"lr": 0.1})
    slots = dynamic_local_slots(4000, 2)
    per_table = slots * row_bytes(8, torch.float32, "rowwise_adagrad") // 2 + dynamic_index_bytes(slots)
    assert default_fast_bytes(model, 2, pins) == 26 * per_table


def test_tables_hold_the_raw_keys_training_saw() -> None:
    config = TrainConfig(**RAW)
    with _one_rank():
        model, pipeline, source = _build(config)
        assert _train(pipeline, source, 4) == 4
        features = source.spec.feature_names
        dumps = _dumps(model, features)
    trained = _batch_keys(make_data_source(config, 0, 1).train_batches(0, 4))
    for f in features:
        keys = dumps[f].keys.tolist()
        assert len(keys) == len(set(keys)) and set(keys) == trained[f], f
        assert dumps[f].weights.shape == (len(keys), 8) and bool(dumps[f].weights.isfinite().all()), f
    every = [k for f in features for k in dumps[f].keys.tolist()]
    assert min(every) < 0 and max(abs(k) for k in every) >= 2**32  # raw keys, not rows of key mod rows


def _two_rank_body(rank: int, world_size: int) -> dict[str, Any]:
    config = TrainConfig(**RAW, sharding_types="row_wise")
    model, pipeline, source = _build(config)
    _train(pipeline, source, 4)
    shards = model.module.get_submodule(EBC_PATH).tiered_tables()
    features = source.spec.feature_names
    dumps = _dumps(model, features)
    mine = {f: shards[f"t_{f}"].dynamic_rows()[0] for f in features}
    return {
        "table": {f: dumps[f].keys.tolist() for f in features},
        "mine": {f: keys.tolist() for f, keys in mine.items()},
        "owned": all(bool(shards[f"t_{f}"].owned(keys).all()) for f, keys in mine.items()),
    }


def test_two_ranks_row_wise_each_hold_the_keys_their_routing_owns() -> None:
    outs = run_gloo(2, _two_rank_body, timeout_s=300)
    config = TrainConfig(**RAW, sharding_types="row_wise")
    trained: dict[str, set[int]] = {}
    for rank in range(2):
        for f, keys in _batch_keys(make_data_source(config, rank, 2).train_batches(0, 4)).items():
            trained.setdefault(f, set()).update(keys)
    for f, keys in trained.items():
        assert set(outs[0]["table"][f]) == keys == set(outs[1]["table"][f]), f
        held = [outs[0]["mine"][f], outs[1]["mine"][f]]
        assert held[0] and held[1] and not set(held[0]) & set(held[1]), f  # each key on one rank, both used
        assert sorted(held[0] + held[1]) == sorted(keys), f
    assert outs[0]["owned"] and outs[1]["owned"]


def _dataset_config(name: str, tmp_path: Path) -> TrainConfig:
    """A 4-step ``--dynamic-tables`` run on ``name`` that evaluates at step 2 and 4, logging into ``tmp_path/tb``."""
    run_args: dict[str, Any] = dict(
        SMALL_NET, max_steps=4, eval_every=2, dynamic_tables=True, tb_dir=str(tmp_path / "tb")
    )
    if name == "criteo_tsv":  # evaluated on other rows than it trains on
        write_criteo(tmp_path / "all.tsv", 256)
        lines = (tmp_path / "all.tsv").read_text().splitlines(keepends=True)
        (tmp_path / "train.tsv").write_text("".join(lines[:128]))
        (tmp_path / "eval.tsv").write_text("".join(lines[128:]))
        paths = dict(data_path=str(tmp_path / "train.tsv"), eval_data_path=str(tmp_path / "eval.tsv"))
        return TrainConfig(**{**CRITEO, **run_args, **paths})
    if name == "movielens100k":  # the default model: micro_dlrm_dram, hash_k keys per id
        return TrainConfig(**run_args, virtual_rows=4096, hash_k=2, batch_size=64)
    return TrainConfig(**{**RAW, **run_args})


@pytest.mark.parametrize("dataset", ["synthetic_raw_keys", "criteo_tsv", "movielens100k"])
def test_recipe_trains_and_evaluates_and_logs_the_key_index_counters(dataset: str, tmp_path: Path) -> None:
    config = _dataset_config(dataset, tmp_path)
    assert config.tb_dir is not None
    result = run(config)
    assert config.dataset == dataset and result.steps == 4 == len(result.losses)
    assert all(0.0 < loss < 10.0 for loss in result.losses)
    assert [step for step, _ in result.evals] == [2, 4] and all(0.0 <= auc <= 1.0 for _, auc in result.evals)
    source = make_data_source(config, 0, 1)
    trained = _batch_keys(source.train_batches(0, 4))
    evaluated = _batch_keys(source.eval_batches())
    assert all(evaluated[f] - trained[f] for f in trained)  # the evaluation at step 2 looked up unseen keys ...
    assert result.plan_text.count("(dynamic)") == len(source.spec.feature_names)
    events = scalars(Path(config.tb_dir))
    for f in source.spec.feature_names:
        last = {c: events[f"dynamic/t_{f}/{c}"][-1] for c in DYNAMIC_COUNTERS}
        assert all(step == 4 for step, _ in last.values()), f
        # ... and gave none a row: every key training saw holds one (capacity to spare), no other key does
        expected = {"occupancy": len(trained[f]), "inserted": len(trained[f]), "evicted": 0}
        assert {c: last[c][1] for c in expected} == expected, f
        assert last["not_admitted"][1] == 0 == last["failed"][1], f
        assert f"tier/t_{f}/occupancy" not in events, f
    if dataset == "movielens100k":  # hash_k = 2 keys of every id: twice the distinct raw ids
        ids = _batch_keys(make_data_source(TrainConfig(model="dlrm", batch_size=64), 0, 1).train_batches(0, 4))
        assert {f: len(keys) for f, keys in trained.items()} == {f: 2 * len(v) for f, v in ids.items()}


def _projected(ids: list[int], feature: int, k: int, seed: int) -> list[list[int]]:
    """:class:`VirtualKeyProjector`'s keys of one feature's ids in Python ints (uint64 arithmetic)."""
    salts = [salt_of(mix_seed(seed, feature, j), VIRTUAL_KEY_TAG) for j in range(k)]
    return [[to_int64_bits(mix64_int((i & (2**64 - 1)) ^ s)) for s in salts] for i in ids]


def test_micro_dlrm_takes_hash_k_distinct_int64_keys_per_id() -> None:
    ids = torch.tensor([[0, 1, -1, 2**40 + 3, 7, 7], [5, 6, 2**62, -(2**63), 0, 1]], dtype=torch.int64)
    projector = VirtualKeyProjector(3, seed=11)
    keys = projector.project(ids)
    assert keys.shape == (2, 6, 3)
    for f in range(2):
        assert keys[f].tolist() == _projected(ids[f].tolist(), f, 3, 11)
    assert torch.equal(keys[0, 4], keys[0, 5])  # an id's keys are a function of the id
    assert len(set(keys.flatten().tolist())) == (5 + 6) * 3  # distinct (feature, id, slot): distinct keys
    config = TrainConfig(hash_k=3, seed=11, dynamic_tables=True)
    transform = IdTransform(config, make_data_source(config, 0, 1).spec)
    kjt = transform.to_kjt(("user_id", "item_id"), ids)
    assert kjt.lengths().tolist() == [3] * 12 and torch.equal(kjt.values(), keys.reshape(-1))


# RAW without its step count; with 160 slots per table (CKPT), 8 steps of 32 samples see more keys than
# that, so keys are evicted
STEPLESS: dict[str, Any] = {k: v for k, v in RAW.items() if k != "max_steps"}
CKPT: dict[str, Any] = {**STEPLESS, "num_embeddings": 160}


def test_resume_with_dynamic_tables_is_exact_evictions_included(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    whole = run(TrainConfig(**CKPT, max_steps=8, tb_dir=str(tmp_path / "tb")))
    run(TrainConfig(**CKPT, max_steps=4, checkpoint_dir=root, checkpoint_every=2))  # evaluates at 4, then saves
    resumed = run(TrainConfig(**CKPT, max_steps=8, checkpoint_dir=root, checkpoint_every=2, resume=True))
    assert resumed.start_step == 4 and resumed.losses == whole.losses[4:]  # bit-identical
    assert resumed.evals == whole.evals == [(8, whole.final_auroc)]
    evicted = [
        v for tag, events in scalars(tmp_path / "tb").items() if tag.endswith("/evicted") for _, v in events[-1:]
    ]
    assert len(evicted) == 26 and sum(evicted) > 0


def _keyed_rows(model: Any, features: tuple[str, ...]) -> dict[str, dict[int, list[float]]]:
    """Table -> key -> its row and optimizer state, over every rank (``gather_dynamic_table``)."""
    out: dict[str, dict[int, list[float]]] = {}
    for f, dump in _dumps(model, features).items():
        rows = torch.cat([dump.weights, dump.optimizer_state], dim=1).tolist()
        out[f] = dict(zip(dump.keys.tolist(), rows))
    return out


def _two_rank_resume_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    # capacity to spare: one rank's table (one shard, other buckets) holds every key the two shards hold
    base = dict(STEPLESS, sharding_types="row_wise")
    whole = run(TrainConfig(**base, max_steps=8))
    run(TrainConfig(**base, max_steps=4, checkpoint_dir=root, checkpoint_every=4))
    resumed = run(TrainConfig(**base, max_steps=8, checkpoint_dir=root, checkpoint_every=4, resume=True))
    config = TrainConfig(**base, max_steps=8)
    model, _, source = _build(config)
    optimizer = make_optimizer(config, model)
    assert load_checkpoint(root, model, optimizer, config, step=8) == 8
    rows = _keyed_rows(model, source.spec.feature_names[:4])  # a collective
    return {"whole": whole.losses, "resumed": resumed.losses, "rows": rows if rank == 0 else None}


def test_two_rank_resume_is_exact_and_one_rank_loads_every_key(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    outs = run_gloo(2, _two_rank_resume_body, root, timeout_s=600)
    for out in outs:
        assert out["resumed"] == out["whole"][4:]
    saved = outs[0]["rows"]
    config = TrainConfig(**STEPLESS, max_steps=8)
    with _one_rank():  # every key of the two row-wise shards, in one rank's tables
        model, _, source = _build(config)
        assert load_checkpoint(root, model, make_optimizer(config, model), config, step=8) == 8
        loaded = _keyed_rows(model, source.spec.feature_names[:4])
    assert loaded == saved and all(len(rows) > 0 for rows in saved.values())
