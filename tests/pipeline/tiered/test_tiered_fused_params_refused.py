"""Fused params whose fbgemm update the tiered kernel does not run are refused, naming the fix.

* fbgemm's deprecated non-exact ``EmbOptimType.SGD`` / ``ROWWISE_ADAGRAD``: torchrec's FUSED
  tables fail on them (the reference), tiered tables refuse them naming the exact optimizer;
* Adam's ``use_rowwise_bias_correction`` (fbgemm's ``extra_optimizer_config``) is refused;
  the knob off is accepted and changes nothing.
"""

from __future__ import annotations

from typing import Any, Dict

import harness.tiered_ebc_models as pooled
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.tbe.config.optimizer_config import UserEnabledConfigDefinition
from harness.gloo import run_gloo
from harness.tiered_fused_row_wise import PLACEMENT

from recpipe.pipeline.tiered.fused_params import tiered_optimizer_from_fused_params


def _deprecated_body(rank: int, world: int, name: str) -> Dict[str, str]:
    """The EBC sharded with fused params ``optimizer=EmbOptimType.<name>`` (the sharder's, no
    in-backward optimizer): every table tiered by the tiered sharder, and torchrec's own
    TABLE_WISE FUSED."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    from recpipe.pipeline.tiered.tiered_sharders import TieredEmbeddingBagCollectionSharder

    fused_params = {"optimizer": EmbOptimType[name], "learning_rate": 0.05}
    out: Dict[str, str] = {}
    for kind in ("tiered", "ref"):
        ebc = pooled.make_ebc()
        if kind == "tiered":
            sharder: Any = TieredEmbeddingBagCollectionSharder(fused_params=dict(fused_params))
            plan = pooled.tiered_plan(
                ebc, sharder, world, {**PLACEMENT, "t1": dict(mode="HYBRID", cache_load_factor=0.5, seed=3)}
            )
        else:
            sharder = EmbeddingBagCollectionSharder(fused_params=dict(fused_params))
            plan = construct_module_sharding_plan(
                ebc,
                {"t0": table_wise(rank=0, compute_kernel="fused"), "t1": table_wise(rank=1, compute_kernel="fused")},
                sharder=sharder,
                local_size=world,
                world_size=world,
                device_type="cpu",
            )
        try:
            DistributedModelParallel(
                ebc,
                plan=ShardingPlan({"": plan}),
                sharders=[sharder],  # type: ignore[list-item]
                device=torch.device("cpu"),
            )
            out[kind] = "accepted"
        except (AssertionError, ValueError) as e:
            out[kind] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.parametrize("name, exact", [("SGD", "EXACT_SGD"), ("ROWWISE_ADAGRAD", "EXACT_ROWWISE_ADAGRAD")])
def test_deprecated_non_exact_fbgemm_optimizers_refused_as_by_torchrec(name: str, exact: str) -> None:
    """fbgemm's TBE refuses ``EmbOptimType.SGD`` / ``ROWWISE_ADAGRAD`` (deprecated), so torchrec's
    FUSED tables fail on them; tiered tables refuse them too (rather than train the exact
    optimizer), naming the table and the exact optimizer to use."""
    for rank, res in enumerate(run_gloo(2, _deprecated_body, name)):
        assert res["ref"].startswith("AssertionError") and "deprecated" in res["ref"], res["ref"]
        assert res["tiered"].startswith(
            f"ValueError: tiered table 't0': fused optimizer EmbOptimType.{name} is deprecated in fbgemm"
        ), f"rank {rank}: {res['tiered']}"
        assert f"use EmbOptimType.{exact} in the fused params" in res["tiered"], res["tiered"]


def test_adam_rowwise_bias_correction_refused_for_tiered_tables() -> None:
    """fbgemm's ``extra_optimizer_config`` with ``use_rowwise_bias_correction`` makes its Adam
    correct each row's moments by that row's own update count (fbgemm's TBE takes the knob and
    keeps it: the reference below); the tiered kernel corrects by the table's step, so the
    config is refused, naming it; the knob off is accepted and changes nothing."""
    on = UserEnabledConfigDefinition(use_rowwise_bias_correction=True)
    assert on.use_rowwise_bias_correction  # fbgemm's own definition of the knob
    with pytest.raises(
        ValueError,
        match=r"fused params \{'extra_optimizer_config': .*use_rowwise_bias_correction=True"
        r".*change fbgemm's adam update",
    ):
        tiered_optimizer_from_fused_params({"optimizer": EmbOptimType.ADAM, "extra_optimizer_config": on})
    off = UserEnabledConfigDefinition(use_rowwise_bias_correction=False)
    assert tiered_optimizer_from_fused_params(
        {"optimizer": EmbOptimType.ADAM, "extra_optimizer_config": off}
    ) == tiered_optimizer_from_fused_params({"optimizer": EmbOptimType.ADAM})
