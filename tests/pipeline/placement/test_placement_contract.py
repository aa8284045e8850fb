"""The placement contract (recpipe.pipeline.placement): ``PlacementParams`` and its fused-param keys.

* ``PlacementParams``: normalization, every validation error, the round trip
  through torchrec fused params (and torchrec's own ``add_params_from_parameter_sharding``),
  every ``from_fused_params`` error naming the table and the key, ``check_runtime``.
* Keys and enums defined once: the fused-param key strings appear as literals only
  in the contract's params module; every re-export is the one definition.

The planner's side (sizing each table with its fused optimizer, recording it in the plan)
is pinned in tests/planner/test_planner_fused_optimizer_sizing.py.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.utils import add_params_from_parameter_sharding

from recpipe.pipeline import placement
from recpipe.pipeline.placement import (
    FUSED_PARAM_CACHE_LOAD_FACTOR,
    FUSED_PARAM_DIST_TYPE,
    FUSED_PARAM_KEYS,
    FUSED_PARAM_MODE,
    FUSED_PARAM_OPTIMIZER,
    FUSED_PARAM_SEED,
    CachePolicy,
    DistType,
    FusedOptimizerKind,
    Mode,
    PlacementContractError,
    PlacementMismatchError,
    PlacementParams,
    row_bytes,
)
from recpipe.pipeline.routing import ops
from recpipe.planner import PlacementParameterSharding

REPO = Path(__file__).resolve().parents[3]


def _params(**kw: Any) -> PlacementParams:
    base: Dict[str, Any] = dict(
        mode=Mode.CACHING,
        cache_load_factor=0.2,
        dist_type=DistType.HASH_ROUNDROBIN,
        seed=7,
        cache_policy=CachePolicy.LRU,
        optimizer=FusedOptimizerKind.ADAM,
        dtype=torch.float32,
    )
    base.update(kw)
    return PlacementParams(**base)


def test_round_trip_through_fused_params_and_torchrec() -> None:
    for p in (
        _params(),
        _params(
            mode=Mode.HYBRID,
            cache_load_factor=1.0,
            dist_type=DistType.ROUNDROBIN,
            seed=-3,
            cache_policy=CachePolicy.LFU,
            optimizer=FusedOptimizerKind.ROWWISE_ADAGRAD,
            dtype=torch.float16,
        ),
        _params(dist_type=DistType.CONTINUOUS, seed=2**63 - 1, optimizer=FusedOptimizerKind.SGD, dtype=torch.bfloat16),
    ):
        fused = p.to_fused_params()
        assert list(fused) == list(FUSED_PARAM_KEYS)
        # plain values only: torchrec deep-copies and compares fused params
        assert {type(v) for v in fused.values()} <= {str, float, int}
        assert all(
            type(fused[k]) is str
            for k in FUSED_PARAM_KEYS
            if k not in (FUSED_PARAM_CACHE_LOAD_FACTOR, FUSED_PARAM_SEED)
        )
        assert PlacementParams.from_fused_params(fused, "t") == p
        # through a ParameterSharding and torchrec's own merge, next to torchrec's keys
        ps = PlacementParameterSharding.from_params(p, sharding_type="row_wise", compute_kernel="customized_kernel")
        assert ps.params == p
        merged = add_params_from_parameter_sharding({"optimizer": EmbOptimType.ADAM, "learning_rate": 0.1}, ps)
        assert PlacementParams.from_fused_params(merged, "t") == p
    assert _params().to_fused_params() == {
        "recpipe_mode": "CACHING",
        "recpipe_cache_load_factor": 0.2,
        "recpipe_dist_type": "hash_roundrobin",
        "recpipe_seed": 7,
        "recpipe_cache_policy": "lru",
        "recpipe_optimizer": "adam",
        "recpipe_dtype": "float32",
    }


def test_strings_and_fbgemm_spellings_are_normalized() -> None:
    p = PlacementParams(
        mode="caching",
        cache_load_factor=0.2,
        dist_type="HASH_ROUNDROBIN",
        seed=7,
        cache_policy="LRU",
        optimizer=EmbOptimType.ADAM,
        dtype="torch.float32",
    )
    assert p == _params()
    assert isinstance(p.mode, Mode) and isinstance(p.dist_type, DistType) and p.dtype is torch.float32
    assert _params(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD).optimizer is FusedOptimizerKind.ROWWISE_ADAGRAD
    assert _params(optimizer=EmbOptimType.EXACT_SGD).optimizer is FusedOptimizerKind.SGD
    assert _params(dtype="fp16").dtype is torch.float16
    assert (
        PlacementParams(
            mode="HYBRID", cache_load_factor=1, dist_type="roundrobin", optimizer="sgd", dtype=torch.float32
        ).cache_policy
        is CachePolicy.LFU
    )  # defaults: lfu, seed 0
    # str enums: members equal their values (code passing strings keeps working)
    assert DistType.HASH_ROUNDROBIN == "hash_roundrobin" and f"{Mode.CACHING}" == "CACHING"


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("mode", "hot", r"PlacementParams\.mode must be one of \['HYBRID', 'CACHING'\], got 'hot'"),
        ("cache_load_factor", 0.0, r"PlacementParams\.cache_load_factor must be in \(0, 1\], got 0\.0"),
        ("cache_load_factor", 1.5, r"PlacementParams\.cache_load_factor must be in \(0, 1\].*1\.0 = every row"),
        ("cache_load_factor", True, r"PlacementParams\.cache_load_factor must be in \(0, 1\], got True"),
        ("cache_load_factor", "0.5", r"PlacementParams\.cache_load_factor must be in \(0, 1\], got '0\.5'"),
        ("dist_type", "hash", r"unknown PlacementParams\.dist_type 'hash'; choose one of \['continuous'"),
        ("seed", 1.5, r"PlacementParams\.seed must be an int64 .*got 1\.5"),
        ("seed", True, r"PlacementParams\.seed must be an int64"),
        ("seed", 2**63, r"PlacementParams\.seed must be an int64"),
        ("cache_policy", "fifo", r"PlacementParams\.cache_policy must be one of \['lfu', 'lru'\], got 'fifo'"),
        (
            "optimizer",
            "lamb",
            r"PlacementParams\.optimizer must be one of \['sgd', 'rowwise_adagrad', "
            r"'adagrad', 'adam'\], got 'lamb'",
        ),
        ("optimizer", EmbOptimType.LAMB, r"PlacementParams\.optimizer must be one of"),
        ("dtype", "float33", r"PlacementParams\.dtype 'float33' is not a torch dtype: use e\.g\. 'float32'"),
        ("dtype", 4, r"PlacementParams\.dtype 4 is not a torch dtype"),
    ],
)
def test_each_field_is_validated_naming_the_field_and_the_fix(field: str, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _params(**{field: value})


@pytest.mark.parametrize("key", FUSED_PARAM_KEYS)
def test_from_fused_params_missing_key_names_table_and_key(key: str) -> None:
    fused = _params().to_fused_params()
    del fused[key]
    with pytest.raises(PlacementContractError) as e:
        PlacementParams.from_fused_params(fused, "user_table")
    msg = str(e.value)
    assert "table 'user_table'" in msg and repr(key) in msg and "Possible solutions" in msg
    assert "PlacementPlanner" in msg and "PlacementParameterSharding" in msg


def test_from_fused_params_without_any_placement_lists_every_key() -> None:
    with pytest.raises(PlacementContractError, match=r"table 't9'.*lack the placement key\(s\)") as e:
        PlacementParams.from_fused_params({"optimizer": EmbOptimType.ADAM}, "t9")
    assert all(repr(k) in str(e.value) for k in FUSED_PARAM_KEYS)
    with pytest.raises(PlacementContractError, match="table 't9'"):
        PlacementParams.from_fused_params(None, "t9")


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("recpipe_mode", "HOT", r"recpipe_mode must be one of \['HYBRID', 'CACHING'\], got 'HOT'"),
        ("recpipe_cache_load_factor", 2.0, r"recpipe_cache_load_factor must be in \(0, 1\]"),
        ("recpipe_dist_type", "hash", r"unknown recpipe_dist_type 'hash'"),
        ("recpipe_seed", "7", r"recpipe_seed must be an int64"),
        ("recpipe_cache_policy", "mru", r"recpipe_cache_policy must be one of"),
        ("recpipe_optimizer", "lion", r"recpipe_optimizer must be one of"),
        ("recpipe_dtype", "float64x", r"recpipe_dtype 'float64x' is not a torch dtype"),
    ],
)
def test_from_fused_params_bad_value_names_table_and_key(key: str, value: Any, match: str) -> None:
    fused = _params().to_fused_params()
    fused[key] = value
    with pytest.raises(PlacementContractError, match=match) as e:
        PlacementParams.from_fused_params(fused, "item_table")
    msg = str(e.value)
    assert f"table 'item_table': fused param {key!r} holds an invalid value" in msg
    assert "Possible solutions" in msg and "1)" in msg and "2)" in msg


def test_from_fused_params_refuses_unknown_recpipe_keys() -> None:
    fused = {**_params().to_fused_params(), "recpipe_seeed": 3, "learning_rate": 0.1}
    with pytest.raises(
        PlacementContractError, match=r"table 't0': unknown placement fused param\(s\) \['recpipe_seeed'\]"
    ):
        PlacementParams.from_fused_params(fused, "t0")


def test_check_runtime_names_table_planned_and_actual_and_the_fix() -> None:
    p = _params(optimizer=FusedOptimizerKind.SGD)
    p.check_runtime("t0", optimizer=EmbOptimType.EXACT_SGD, dtype=torch.float32, dim=16)  # agrees: no error
    with pytest.raises(PlacementMismatchError) as e:
        p.check_runtime("t0", optimizer=EmbOptimType.ADAM, dtype=torch.float32, dim=16)
    msg = str(e.value)
    assert "table 't0' was planned for fused optimizer sgd, but the model trains it with adam" in msg
    assert (
        f"allocate {row_bytes(16, torch.float32, 'adam')} bytes per row where the plan budgeted "
        f"{row_bytes(16, torch.float32, 'sgd')}" in msg
    )
    assert "1) re-plan with the model" in msg and "2) train the table with the planned sgd instead" in msg
    assert "apply_optimizer_in_backward" in msg
    with pytest.raises(
        PlacementMismatchError,
        match=r"(?s)row dtype float32, but the table's data_type is float16.*"
        r"set the table config's data_type to the planned float32",
    ):
        p.check_runtime("t0", optimizer="sgd", dtype=torch.float16)
    assert issubclass(PlacementMismatchError, PlacementContractError) and issubclass(PlacementContractError, ValueError)


def test_parameter_sharding_without_optimizer_leaves_it_to_the_model() -> None:
    ps = PlacementParameterSharding(
        sharding_type="row_wise",
        compute_kernel="customized_kernel",
        mode="CACHING",
        cache_load_factor=0.3,
        dist_type="roundrobin",
        seed=2,
    )
    fused = ps.get_additional_fused_params()
    assert FUSED_PARAM_OPTIMIZER not in fused and "recpipe_dtype" not in fused
    assert fused[FUSED_PARAM_MODE] == "CACHING" and fused[FUSED_PARAM_DIST_TYPE] == "roundrobin"
    assert ps.mode is Mode.CACHING and ps.dist_type is DistType.ROUNDROBIN
    with pytest.raises(ValueError, match=r"PlacementParameterSharding\.optimizer and dtype is not set.*from_params"):
        ps.params
    with pytest.raises(ValueError, match=r"PlacementParams\.cache_load_factor must be in \(0, 1\]"):
        PlacementParameterSharding(sharding_type="row_wise", compute_kernel="customized_kernel", cache_load_factor=0)


def test_dist_type_codes_are_the_routing_ops() -> None:
    assert {d.value: d.code for d in DistType} == ops.DIST_TYPES
    assert [ops.dist_type_code(d) for d in DistType] == [d.code for d in DistType]


def test_reexports_are_the_one_definition() -> None:
    import recpipe.pipeline.routing.features as rt_sharding
    import recpipe.pipeline.tiered.optim as tiered_optim
    import recpipe.pipeline.tiered.shard as tiered
    import recpipe.planner as planner_pkg
    import recpipe.planner.torchrec_plan as pl_sharding
    from recpipe.pipeline.placement import values

    assert rt_sharding.DIST_TYPE_KEY is placement.FUSED_PARAM_DIST_TYPE
    assert rt_sharding.SEED_KEY is placement.FUSED_PARAM_SEED
    for name in ("FUSED_PARAM_OPTIMIZER", "FUSED_PARAM_DTYPE"):
        assert getattr(pl_sharding, name) is getattr(placement, name)
    assert planner_pkg.Mode is placement.Mode and values.parse_enum is placement.parse_enum
    assert tiered.CachePolicy is placement.CachePolicy and tiered.Mode is placement.Mode
    assert tiered.FusedOptimizerKind is tiered_optim.FusedOptimizerKind is placement.FusedOptimizerKind
    shared = set(planner_pkg.__all__) & set(placement.__all__)
    assert {"ShardStorage", "shard_storage", "machine_storage", "tier_rows", "row_bytes"} <= shared
    for name in shared:
        assert getattr(planner_pkg, name) is getattr(placement, name), name


def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


#: The module of the placement contract that spells the fused-param keys.
CONTRACT_KEYS_MODULE = REPO / "pipeline" / "placement" / "params.py"


def test_fused_param_keys_are_spelled_only_in_the_contract() -> None:
    keys = set(FUSED_PARAM_KEYS)
    offenders = {}
    for folder in ("pipeline", "planner", "recipes"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == CONTRACT_KEYS_MODULE:
                continue
            found = keys & _string_constants(path)
            if found:
                offenders[str(path.relative_to(REPO))] = sorted(found)
    assert offenders == {}, f"fused-param keys spelled outside pipeline/placement/params.py: {offenders}"
    assert keys <= _string_constants(CONTRACT_KEYS_MODULE)
