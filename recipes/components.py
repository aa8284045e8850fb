"""torchx components for recpipe (registered as the ``recpipe`` entry point).

``torchx run -s local_cwd recpipe.train -j 1x2 -- --config default --tb-dir runs/x``

Each component validates the training arguments *before* returning the AppDef, so a
bad value (an unknown flag, a NaN / inf / out-of-range number, an output path that
cannot be written — checked on the launching machine, which for ``local_cwd`` is the
workers' machine) fails in the launching process with the config's message and no
worker starts. Workers run ``python -m recpipe.recipes.train`` through
:func:`torchx.components.dist.ddp` (``m=``, so any working directory works); every
training flag, e.g. ``--timeout-s 300`` (how long a collective may wait for a dead or
frozen rank before the job fails), reaches them unchanged.
"""

# No ``from __future__ import annotations``: torchx reads the parameters' annotations
# as types to decode CLI values (string annotations break ``torchx run recpipe.train``).
from typing import Dict, Optional

import torchx.specs as specs
from torchx.components.dist import ddp

from recpipe.recipes.config import parse_config

TRAIN_MODULE: str = "recpipe.recipes.train"


def train(
    *script_args: str,
    j: str = "1x2",
    name: str = "recpipe-train",
    cpu: int = 2,
    memMB: int = 8192,
    env: Optional[Dict[str, str]] = None,
    max_retries: int = 0,
    rdzv_port: int = 29500,
    tee: int = 3,
) -> specs.AppDef:
    """Trains a recpipe recipe on ``j`` = ``{nnodes}x{nproc_per_node}`` processes.

    Args:
        script_args: arguments of ``python -m recpipe.recipes.train`` (e.g.
            ``--config default --tb-dir runs/x``); validated here first.
        j: ``{nnodes}x{nproc_per_node}``, e.g. ``1x2`` for 2 local processes.
        name: job name.
        cpu: CPUs per replica.
        memMB: memory per replica in MB.
        env: extra environment variables for the workers.
        max_retries: scheduler retries.
        rdzv_port: rendezvous port (multi-node only).
        tee: which worker streams torchrun tees to the console (3: both).

    Returns:
        The torchx AppDef.

    Raises:
        ConfigError: a training argument is invalid (before any process starts).
    """
    parse_config(list(script_args))
    return ddp(
        *script_args,
        m=TRAIN_MODULE,
        name=name,
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
    tb_dir: str = "runs/recpipe",
    name: str = "recpipe-default",
    env: Optional[Dict[str, str]] = None,
) -> specs.AppDef:
    """The default recipe: MovieLens-100k, micro-DLRM-DRAM, fused pipeline, 2 CPU processes.

    Args:
        script_args: extra training flags, applied after the packaged ``default`` config.
        j: ``{nnodes}x{nproc_per_node}``.
        tb_dir: TensorBoard directory (resolved by the workers in the launch directory).
        name: job name.
        env: extra environment variables for the workers.

    Returns:
        The torchx AppDef.
    """
    return train(
        "--config", "default", "--tb-dir", tb_dir, *script_args, j=j, name=name, env=env
    )
