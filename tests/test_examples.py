"""Every script of examples/ runs as ``python examples/<name>.py`` and prints what only a correct run
prints: the routing op's id split equals a pure-Python routing of the same ids, the planner keeps a
table too large for HBM out of torchrec's FUSED storage within the budget, and the planned model trains
to finite losses and reloads from its checkpoint to the same predictions."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

from harness.routing_reference import RefPermutation

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 300  # each finishes in well under a minute on 2 idle cores


def run_example(name: str, *args: str) -> str:
    """stdout of ``python examples/<name> ARGS`` run from the repo root, asserting exit status 0."""
    env = dict(os.environ)
    # the recpipe under test (a relative PYTHONPATH, e.g. ../build/dev, would break in the root)
    env["PYTHONPATH"] = os.pathsep.join(
        str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p
    )
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_every_example_is_tested() -> None:
    tested = {"planned_ebc_training.py", "routing_op_on_kjt.py", "planner_cli.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def test_routing_example_splits_ids_as_pure_python_routing() -> None:
    out = run_example("routing_op_on_kjt.py")
    world, rows, seed = 2, 10, 0
    block = -(-rows // world)
    perm = RefPermutation(rows, seed)
    owner_local = {  # the documented rule of each dist type: id -> (owner rank, row on the owner)
        "continuous": lambda i: (i // block, i % block),
        "roundrobin": lambda i: (i % world, i // world),
        "hash_roundrobin": lambda i: (perm.forward(i) % world, perm.forward(i) // world),
    }
    found = {
        (m[1], int(m[2])): (_ints(m[3]), _ints(m[4]))
        for m in re.finditer(r"(?m)^\s*(\w+) rank (\d+): ids \[(.*)\] -> rows \[(.*)\]$", out)
    }
    assert len(found) == len(owner_local) * world, out
    for dist_type, rule in owner_local.items():
        for rank in range(world):
            ids = [i for i in range(rows) if rule(i)[0] == rank]  # the bags' order: ids ascending
            assert found[dist_type, rank] == (ids, [rule(i)[1] for i in ids]), (dist_type, rank, out)
    hashed = [i for rank in range(world) for i in found["hash_roundrobin", rank][0]]
    assert f"hash_roundrobin (rank, row) -> id: {hashed}" in out


def test_planner_cli_example_keeps_the_large_table_partly_out_of_hbm_within_budget() -> None:
    out = run_example("planner_cli.py")
    budget = int(4 * 2**30 * (1 - 0.15))  # --hbm 4GiB less the default 15% reservation
    assert f"HBM budget per rank after the reservation: {budget} B" in out
    plan = {
        m[1]: (m[2], m[3], m[4], int(m[5]))
        for m in re.finditer(
            r"(?m)^  (\w+): (\w+) on (every rank|rank [\d,]+), (FUSED|\w+ x=[\d.]+), HBM/rank (\d+) B$", out
        )
    }
    assert set(plan) == {"user_id", "item_id", "country"}, out
    row_bytes = 64 * 4 + 4  # float32 row and its row-wise Adagrad state
    assert 50_000_000 * row_bytes > budget  # user_id does not fit whole ...
    sharding, _, storage, hbm = plan["user_id"]
    mode, x = storage.split(" x=")
    assert mode in ("HYBRID", "CACHING") and 0 < float(x) < 1, out  # ... so part of it lives in DDR
    assert hbm >= float(x) * 50_000_000 * row_bytes / (2 if sharding == "row_wise" else 1)
    assert plan["item_id"][2] == plan["country"][2] == "FUSED", out  # the small ones fit whole
    per_rank = [0, 0]
    for sharding, where, _, hbm in plan.values():
        for rank in range(2) if where == "every rank" else _ints(where.removeprefix("rank ")):
            per_rank[rank] += hbm
    assert max(per_rank) <= budget, (per_rank, out)
    assert "recpipe placement plan: world_size=2 local_world_size=2" in out  # the planner's own table


def test_planned_training_example_trains_and_reloads_its_checkpoint(tmp_path: Path) -> None:
    from recpipe.pipeline.checkpoint import DIGESTS_NAME, verify_checkpoint

    checkpoint_dir = tmp_path / "checkpoint"
    out = run_example("planned_ebc_training.py", str(checkpoint_dir))
    assert re.search(r"(?m)^ebc\.big\s+\| row_wise\s+\| all\s+\| CACHING \| 0\.50 ", out), out  # the pinned table
    for rank in range(2):
        (losses,) = re.findall(rf"(?m)^rank {rank}: losses (.*)$", out)
        values = [float(x) for x in losses.split()]
        assert len(values) == 8 and all(math.isfinite(v) and 0 < v < 5 for v in values), losses
        assert f"rank {rank}: fresh model predicts as the trained one before the load: False, after: True" in out
    assert f"checkpoint saved to {checkpoint_dir}" in out
    assert (checkpoint_dir / DIGESTS_NAME).is_file()
    verify_checkpoint(str(checkpoint_dir))  # every file matches its digest
