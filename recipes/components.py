"""torchx components for recpipe (registered as the ``recpipe`` entry point).

``torchx run -s local_cwd recpipe.train -j 1x2 -- --config default --tb-dir runs/x``

Each component validates the training arguments before returning the AppDef, so a bad
value fails in the launching process and no worker starts; pass ``--check_paths False``
when the paths exist only on the cluster (each worker checks them at start). Workers run
``python -m recpipe.recipes.train`` through :func:`torchx.components.dist.ddp`.
"""

# No ``from __future__ import annotations``: torchx reads the parameters' annotations
# as types to decode CLI values (string annotations break ``torchx run recpipe.train``).
import re
import socket
import time
from typing import Dict, Optional

import torchx.specs as specs
from torchx.components.dist import ddp

from recpipe.recipes.cli import parse_config
from recpipe.recipes.config import ConfigError, ConfigMachineError, ConfigPathError

TRAIN_MODULE: str = "recpipe.recipes.train"
# Image of container schedulers unless ``image`` is given (no public one: build it with recpipe).
DEFAULT_IMAGE: str = "recpipe:latest"


def _check_j(j: str) -> str:
    """``j`` stripped, refused unless torchrun can start it (every number >= 1, min <= max)."""
    m = re.fullmatch(r"(?:(\d+)(?::(\d+))?x)?(\d+)", j.strip()) if isinstance(j, str) else None
    numbers = [int(g) for g in m.groups() if g is not None] if m else []
    if not m or min(numbers) < 1 or (m.group(2) is not None and int(m.group(1)) > int(m.group(2))):
        raise ConfigError(
            f"invalid component argument -j {j!r}: it must be {{nnodes}}x{{nproc_per_node}} (or "
            "{min_nnodes}:{max_nnodes}x{nproc_per_node}) with every number >= 1. Fix: e.g. -j 1x2 for 2 "
            "processes on one machine, -j 2x4 for 2 machines of 4"
        )
    return j.strip()


def _check_resources(*, cpu: int, memMB: int, max_retries: int, rdzv_port: int, tee: int) -> None:
    """Refuses the integer arguments torchx passes on unchecked (``cpu=0`` even becomes 2)."""
    rules = (  # flag, value, lowest, highest (None: no bound), a valid value
        ("--cpu", cpu, 1, None, "--cpu 2 (CPUs per replica)"),
        ("--memMB", memMB, 1, None, "--memMB 8192 (MB per replica)"),
        ("--max_retries", max_retries, 0, None, "--max_retries 0 (no scheduler retry)"),
        ("--rdzv_port", rdzv_port, 1, 65535, "--rdzv_port 29500 (a free TCP port on node 0)"),
        ("--tee", tee, 0, 3, "--tee 3 (0: none, 1: stdout, 2: stderr, 3: both)"),
    )
    for flag, value, low, high, example in rules:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ConfigError(
                f"invalid component argument {flag} {value!r}: it must be an integer {bound}. Fix: e.g. {example}"
            )


def _free_port() -> int:
    """A TCP port free on this machine now (for the fix of a busy ``rdzv_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _check_rdzv_port(j: str, rdzv_port: int) -> None:
    """Refuses a multi-node ``-j`` whose ``rdzv_port`` is already listened on here: with ``local_cwd`` node 0
    is this machine, and the agents would connect to the other process as store clients and wait forever
    (TCPStore ignores its timeout there)."""
    max_nnodes = int(j.split("x")[0].split(":")[-1]) if "x" in j else 1
    if max_nnodes <= 1:
        return  # one node: torchrun picks a free port itself (localhost:0)
    try:  # bound as torchrun's c10d store binds it
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", rdzv_port))
    except OSError as e:
        raise ConfigError(
            f"invalid component argument --rdzv_port {rdzv_port}: the port is already in use on this machine "
            f"({type(e).__name__}: {e.strerror or e}); node 0 of a local_cwd job is this machine, and torchrun's "
            "rendezvous would wait forever on that port. Fix: pass a free port, e.g. --rdzv_port "
            f"{_free_port()}, or stop the process listening on it; if node 0 is another machine (kubernetes, "
            "slurm), pass --check_paths False"
        ) from None


def train(
    *script_args: str,
    j: str = "1x2",
    name: str = "recpipe-train",
    image: str = DEFAULT_IMAGE,
    cpu: int = 2,
    memMB: int = 8192,
    env: Optional[Dict[str, str]] = None,
    max_retries: int = 0,
    rdzv_port: int = 29500,
    tee: int = 3,
    check_paths: bool = True,
) -> specs.AppDef:
    """Trains a recpipe recipe on ``j`` = ``{nnodes}x{nproc_per_node}`` processes.

    Args:
        script_args: arguments of ``python -m recpipe.recipes.train`` (e.g.
            ``--config default --tb-dir runs/x``); validated here first.
        j: ``{nnodes}x{nproc_per_node}``, e.g. ``1x2`` for 2 local processes,
            ``2x4`` for 2 nodes of 4 ranks (one replica per node).
        name: job name.
        image: container image of container schedulers (kubernetes): set to an image
            with recpipe installed. ``local_cwd`` and ``slurm`` ignore it.
        cpu: CPUs per replica (node).
        memMB: memory per replica (node) in MB.
        env: extra environment variables for the workers.
        max_retries: scheduler retries.
        rdzv_port: rendezvous port on node 0 (multi-node only; with ``check_paths`` refused if busy here).
        tee: which worker streams torchrun tees to the console (3: both).
        check_paths: check on this machine that the input files exist and the output
            paths can be written (False when they exist only on the cluster).

    Raises:
        ConfigError: a training or component argument is invalid.
        ConfigPathError: with ``check_paths``, a path (or, ``ConfigMachineError``, a value)
            this machine cannot use.
    """
    j = _check_j(j)
    _check_resources(cpu=cpu, memMB=memMB, max_retries=max_retries, rdzv_port=rdzv_port, tee=tee)
    if check_paths:
        _check_rdzv_port(j, rdzv_port)
    try:
        parse_config(list(script_args), check_paths=check_paths)
    except ConfigPathError as e:  # ConfigMachineError included
        cluster = (
            "the cluster's machines have more CPUs"
            if isinstance(e, ConfigMachineError)
            else "this path exists only on the cluster's machines"
        )
        raise type(e)(
            f"{e} (checked on the launching machine); if {cluster}, pass --check_paths False to the "
            "component: the workers check it at start"
        ) from None
    return ddp(
        *script_args,
        m=TRAIN_MODULE,
        name=name,
        image=image,
        j=j,
        cpu=cpu,
        memMB=memMB,
        env={"OMP_NUM_THREADS": "1", **(env or {})},
        max_retries=max_retries,
        rdzv_port=rdzv_port,
        tee=tee,
    )


def default_recipe(
    *script_args: str,
    j: str = "1x2",
    tb_dir: Optional[str] = None,
    name: str = "recpipe-default",
    env: Optional[Dict[str, str]] = None,
    check_paths: bool = True,
) -> specs.AppDef:
    """The default recipe: MovieLens-100k, micro-DLRM-DRAM, fused pipeline, 2 CPU processes.

    Args:
        script_args: extra training flags, applied after the packaged ``default`` config.
        j: ``{nnodes}x{nproc_per_node}``.
        tb_dir: TensorBoard directory; default ``runs/recpipe/<launch time>``.
        name: job name.
        env: extra environment variables for the workers.
        check_paths: check the output paths on this machine (see :func:`train`).
    """
    if tb_dir is None:
        tb_dir = f"runs/recpipe/{time.strftime('%Y%m%d-%H%M%S')}"
    return train(
        "--config", "default", "--tb-dir", tb_dir, *script_args, j=j, name=name, env=env, check_paths=check_paths
    )
