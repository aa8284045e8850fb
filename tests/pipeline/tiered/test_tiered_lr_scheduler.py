"""A torch LR scheduler over ``model.fused_optimizer`` gives tiered tables torchrec's learning rates.

torch's StepLR over the fused optimizer of the tiered model (t0 tiered CACHING, t1 FUSED,
row-wise Adagrad) against torchrec's own TABLE_WISE FUSED EBC (the reference): every param
group's lr bit for bit at every step, and the outputs.
"""

from __future__ import annotations

from typing import Any, Dict

import harness.tiered_ebc_models as pooled
import numpy as np
import torch
from harness.gloo import run_gloo
from harness.tiered_fused_row_wise import row_wise_model

GAMMA = 0.3  # StepLR's factor: 0.05 * 0.3 rounds to another float32 than float32(0.05) * 0.3


def _scheduler_body(rank: int, world: int) -> Dict[str, Any]:
    """torch's StepLR over ``model.fused_optimizer`` (``step()`` then the scheduler's ``step()``
    after each backward) on the tiered model (t0 tiered CACHING, t1 FUSED, row-wise) and on
    torchrec's own TABLE_WISE FUSED EBC; per step every param group's lr and the output."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    out: Dict[str, Any] = {}
    for kind in ("tiered", "ref"):
        if kind == "tiered":
            model = row_wise_model(world, tiered=True)
        else:
            weights = {
                f"embedding_bags.{n}.weight": pooled.make_ebc().embedding_bags[n].weight.detach().clone()
                for n, *_ in pooled.TABLES
            }
            ebc = pooled.make_ebc()
            apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": pooled.LR})
            sharder = EmbeddingBagCollectionSharder()
            plan = pooled.table_wise_plan(ebc, sharder, world)
            model = DistributedModelParallel(
                ebc,
                plan=ShardingPlan({"": plan}),
                sharders=[sharder],  # type: ignore[list-item]
                device=torch.device("cpu"),
            )
            pooled.copy_global_weights(model.module.state_dict(), weights)
        scheduler = torch.optim.lr_scheduler.StepLR(model.fused_optimizer, step_size=1, gamma=GAMMA)
        lrs, outs = [], []
        for step in range(4):
            lrs.append([float(g["lr"]) for g in model.fused_optimizer.param_groups])
            kjt, grad = pooled.kjt_and_grad(step, rank)
            result = model(kjt).values()
            outs.append(result.detach().numpy().copy())
            result.backward(grad)
            model.fused_optimizer.step()
            scheduler.step()
        out[kind] = (lrs, outs)
    return out


def test_torch_lr_scheduler_over_fused_optimizer_gives_tiered_tables_torchrecs_lrs() -> None:
    """A torch LR scheduler over ``model.fused_optimizer`` starts from each param group's
    ``lr``: torchrec's FUSED groups hold fbgemm's float32 learning rate (``get_learning_rate``),
    so the tiered groups hold it too (not the float64 fused param), and the schedule gives
    every tiered table torchrec's learning rates bit for bit; outputs equal torchrec's."""
    for rank, res in enumerate(run_gloo(2, _scheduler_body)):
        (lrs, outs), (ref_lrs, ref_outs) = res["tiered"], res["ref"]
        for step, (got, want) in enumerate(zip(lrs, ref_lrs)):
            assert len(want) == 1 and len(got) == 2, (got, want)  # one FUSED TBE; tiered t0 + FUSED t1
            assert got == [want[0]] * 2, f"rank {rank} step {step}: {got} != {want}"
        for step, (got, want) in enumerate(zip(outs, ref_outs)):
            np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5, err_msg=f"rank {rank} step {step}")
