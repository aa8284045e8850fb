"""Multi-node through torchx: ``-j 2x1`` on one host, per-machine planner budgets, and
the kubernetes / slurm dryruns of ``recpipe.train``."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import socket
import sys
from pathlib import Path

import pytest
from torchx.runner import get_runner
from torchx.specs import AppState

from recpipe.pipeline.checkpoint import DIGESTS_NAME, read_extra_state
from recpipe.planner import PlacementPlanner
from recpipe.recipes import components, launch
from recpipe.recipes.build import local_world_size_from_env, planner_topology
from recpipe.recipes.config import ConfigError, TrainConfig

MiB = 2**20

# A small model that trains in a few seconds (synthetic data, planned tiered placements).
SMALL = [
    "--dataset", "synthetic", "--model", "dlrm", "--pipeline", "sparse",
    "--num-embeddings", "5000", "--synthetic-id-space", "100000",
    "--embedding-dim", "16", "--dense-arch", "32,16", "--over-arch", "32,1",
    "--batch-size", "128", "--max-steps", "10", "--log-every", "5",
    "--eval-every", "10", "--eval-batches", "2", "--no-progress-bar",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# ---- planner topology from the job's shape ------------------------------------------


def test_local_world_size_comes_from_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_world_size_from_env(4) == 4  # not under torchrun: one machine
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert local_world_size_from_env(2) == 1  # -j 2x1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_world_size_from_env(8) == 4  # -j 2x4
    for bad in ("3", "0", "-2", "two"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ValueError, match=rf"LOCAL_WORLD_SIZE='{re.escape(bad)}'.*Fix"):
            local_world_size_from_env(8)


@pytest.mark.parametrize("world, local, machines", [(2, 2, 1), (2, 1, 2), (8, 4, 2), (8, 1, 8), (1, 1, 1)])
def test_slow_tier_budget_is_per_machine(world: int, local: int, machines: int) -> None:
    config = TrainConfig(slow_tier_mb=1024.0)
    topology = planner_topology(config, world_size=world, local_world_size=local, fast_bytes=MiB)
    assert topology.world_size == world and topology.local_world_size == local
    assert len(topology.devices) == world
    # each rank gets its share of its machine's DDR ...
    assert {d.storage.ddr for d in topology.devices} == {1024 * MiB // local}
    assert {d.storage.hbm for d in topology.devices} == {MiB}
    # ... so every one of the `machines` machines has slow_tier_mb, whatever the shape
    per_machine = [sum(d.storage.ddr for d in topology.devices[m * local : (m + 1) * local]) for m in range(machines)]
    assert per_machine == [1024 * MiB] * machines
    planner = PlacementPlanner(topology, batch_size=128, hbm_reservation=0.0)
    assert planner.ddr_budget == int(1024 * MiB * (1.0 - planner.ddr_reservation))


def test_one_machine_topology_unchanged() -> None:
    """1 node: each rank's DDR budget is ``slow_tier_mb // world``."""
    config = TrainConfig(slow_tier_mb=16384.0)
    topology = planner_topology(config, world_size=2, local_world_size=2, fast_bytes=7)
    assert {d.storage.ddr for d in topology.devices} == {int(16384.0 * MiB) // 2}
    assert topology.compute_device == "cuda"


# ---- -j 2x1 on this host ------------------------------------------------------------


def test_two_nodes_of_one_rank_train_on_one_host(tmp_path: Path) -> None:
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    metrics_file = tmp_path / "metrics.json"
    app = components.train(
        *SMALL,
        "--slow-tier-mb", "64",
        "--tb-dir", str(tmp_path / "tb"), "--metrics-file", str(metrics_file),
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "10",
        j="2x1",
        rdzv_port=_free_port(),
    )  # fmt: skip
    role = app.roles[0]
    assert role.num_replicas == 2
    assert "--nnodes 2 --nproc_per_node 1" in role.args[-1]
    result = launch.run_app(app, log_dir=str(tmp_path / "torchx"))
    assert result.state == AppState.SUCCEEDED, "\n".join(result.log_lines[-40:])

    metrics = json.loads(metrics_file.read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 10
    assert len(metrics["losses"]) == 10 and all(math.isfinite(v) for v in metrics["losses"])
    # both "nodes" trained all 10 steps: each wrote its own shard of the step-10 checkpoint
    step_dir = tmp_path / "ckpt" / "step_00000010"
    record = json.loads((step_dir / DIGESTS_NAME).read_text())
    assert set(record["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert all((step_dir / name).stat().st_size > 0 for name in record["files"])
    for rank in (0, 1):
        meta = read_extra_state(step_dir, rank).value["meta"]  # type: ignore[union-attr]
        assert (meta["world_size"], meta["step"], meta["rank"]) == (2, 10, rank)

    # the planner saw 2 machines of 1 rank, each with the whole 64 MiB slow tier
    plan = metrics["plan_text"]
    assert "world_size=2 local_world_size=1" in plan, plan
    assert re.search(r"DDR per machine: .* of 64\.00 MiB", plan), plan
    rows = [line.split("|") for line in plan.splitlines() if "embedding_bag_collection" in line]
    assert rows
    header = [c.strip() for c in plan.splitlines()[1].split("|")]
    ddr_rank, ddr_machine = header.index("DDR/rank"), header.index("DDR/machine")
    # one rank per machine: a machine's DDR is its one rank's
    assert all(r[ddr_rank].strip() == r[ddr_machine].strip() for r in rows), plan
    assert any(r[ddr_rank].strip() != "0 B" for r in rows), plan  # tiered tables exist


def test_busy_rdzv_port_is_refused_before_any_process() -> None:
    """A port another process listens on made every local torchrun agent a c10d store
    client of that process, waiting for its reply forever (a hung job): refused here."""
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(
            ConfigError, match=rf"--rdzv_port {port}: the port is already in use.*Fix: pass a free port"
        ):
            components.train(*SMALL, j="2x1", rdzv_port=port)
        # node 0 elsewhere (kubernetes, slurm): the local port does not matter
        app = components.train(*SMALL, j="2x1", rdzv_port=port, check_paths=False)
        assert f"localhost}}:{port}" in app.roles[0].args[-1]
        # one node: torchrun picks its own port (localhost:0)
        components.train(*SMALL, j="1x2", rdzv_port=port)


# ---- kubernetes / slurm dryruns -----------------------------------------------------

TRAIN_FLAGS = [*SMALL, "--tb-dir", "runs/mn"]


def _check_torchrun_command(cmd: str, rank0_env: str) -> None:
    argv = shlex.split(cmd.replace(f"${{{rank0_env}:=localhost}}", "HOST"))
    assert argv[0] == "torchrun"
    opts = dict(zip(argv[1:], argv[2:]))
    assert opts["--nnodes"] == "2" and opts["--nproc_per_node"] == "4"
    assert opts["--rdzv_backend"] == "c10d" and opts["--rdzv_endpoint"] == "HOST:29500"
    m = argv.index("-m")
    assert argv[m + 1] == "recpipe.recipes.train"
    assert argv[m + 2 :] == TRAIN_FLAGS


def test_kubernetes_dryrun_two_nodes_of_four() -> None:
    # as `torchx run --workspace "" --dryrun -s kubernetes recpipe.train -j 2x4 --image ...`
    with get_runner() as runner:
        info = runner.dryrun_component(
            "recpipe.train",
            ["-j", "2x4", "--image", "registry.example/recpipe:1", "--cpu", "8", "--", *TRAIN_FLAGS],
            scheduler="kubernetes",
            cfg={"queue": "default"},
        )
    job = info.request.resource
    assert job["kind"] == "Job" and job["spec"]["queue"] == "default"
    tasks = job["spec"]["tasks"]
    # one Volcano task (pod) per node
    assert [t["name"] for t in tasks] == ["train-0", "train-1"]
    assert [t["replicas"] for t in tasks] == [1, 1]
    for i, task in enumerate(tasks):
        (container,) = task["template"].spec.containers
        assert container.image == "registry.example/recpipe:1"
        assert container.resources.limits["cpu"] == "8000m"
        assert container.command[:2] == ["bash", "-c"]
        # replica 0 hosts the rendezvous (localhost); the others find it by Volcano's env
        _check_torchrun_command(container.command[2], "TORCHX_RANK0_HOST" if i == 0 else "VC_TRAIN_0_HOSTS")
        env = {e.name: e.value for e in container.env}
        assert env["OMP_NUM_THREADS"] == "1" and env["LOGLEVEL"] == "WARNING"
        assert [p.container_port for p in container.ports] == [29500]


def test_slurm_dryrun_two_nodes_of_four() -> None:
    app = components.train(*TRAIN_FLAGS, j="2x4", env={"RECPIPE_X": "1"})
    (role,) = app.roles
    assert role.name == "train" and role.num_replicas == 2
    with get_runner() as runner:
        info = runner.dryrun(app, "slurm", cfg={})
    request = info.request
    # one heterogeneous-job component (one node) per replica
    assert list(request.replicas) == ["train-0", "train-1"]
    for replica in request.replicas.values():
        assert replica.entrypoint == "bash" and replica.args[0] == "-c"
        _check_torchrun_command(replica.args[1], "SLURM_JOB_NODELIST_HET_GROUP_0")
        assert replica.env["OMP_NUM_THREADS"] == "1" and replica.env["RECPIPE_X"] == "1"
        assert replica.sbatch_opts["ntasks-per-node"] == "1"
        assert replica.sbatch_opts["cpus-per-task"] == "2"
    script = request.materialize()
    assert script.count("#SBATCH --job-name=train-") == 2 and "#SBATCH hetjob" in script
    assert "--export=ALL,OMP_NUM_THREADS=1" in script
