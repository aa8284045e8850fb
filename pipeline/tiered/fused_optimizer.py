"""The fused optimizer of a tiered kernel group: a ``KeyedOptimizer`` carrying the tables' learning rates.

May import ``recpipe.pipeline.placement``, ``recpipe.pipeline.routing`` and other
``recpipe.pipeline.tiered`` modules.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

import torch
from torchrec.optim.fused import FusedOptimizer as TorchrecFusedOptimizer

from recpipe.pipeline.tiered.shard import TieredEmbeddingShard


class TieredFusedOptimizer(TorchrecFusedOptimizer):
    """The tiered counterpart of torchrec's ``EmbeddingFusedOptimizer``: the update runs in the backward.

    One param group per table (key ``<table>.weight``); :meth:`step` and :meth:`zero_grad` push each
    group's ``lr`` into its shard, as torchrec's do into fbgemm's TBE, so LR schedulers reach tiered
    and FUSED tables alike. ``state`` is empty: the rows' optimizer state moves with the rows.
    ``shards``: table name -> this rank's shard.
    """

    def __init__(self, shards: Dict[str, TieredEmbeddingShard]) -> None:
        if not isinstance(shards, Mapping) or not all(isinstance(s, TieredEmbeddingShard) for s in shards.values()):
            got = (
                f"a dict of {sorted({type(s).__name__ for s in shards.values()})}"
                if isinstance(shards, Mapping)
                else type(shards).__name__
            )
            raise ValueError(
                f"TieredFusedOptimizer: `shards` must be a dict of table name -> TieredEmbeddingShard, got {got}."
            )
        #: The tables' shards, in the order of :attr:`param_groups`.
        self.shards: List[TieredEmbeddingShard] = list(shards.values())
        # a key tensor per table: torchrec keys optimizer params (and their groups) by tensor
        keys = {f"{name}.weight": torch.empty(0) for name in shards}
        # fbgemm's float32 learning rate, as torchrec's FUSED groups start from: LR schedulers scale both alike
        lrs = {
            name: float(torch.tensor(shard.optimizer.learning_rate, dtype=torch.float32))
            for name, shard in shards.items()
        }
        groups = [{"params": [keys[f"{name}.weight"]], "lr": lr} for name, lr in lrs.items()]
        super().__init__(params=keys, state={}, param_groups=groups)

    def _push_learning_rates(self) -> None:
        for group, shard in zip(self.param_groups, self.shards):
            shard.set_learning_rate(group["lr"])

    def step(self, closure: Any = None) -> None:
        """Sets each table's learning rate from its param group (the update ran in backward)."""
        self._push_learning_rates()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Sets each table's learning rate from its param group (no gradients to zero)."""
        self._push_learning_rates()

    def set_optimizer_step(self, step: int) -> None:
        """Sets every table's optimizer step, with fbgemm's semantics (the next update is ``step + 1``)."""
        for shard in self.shards:
            shard.set_optimizer_step(step)

    def update_hyper_parameters(self, params_dict: Dict[str, float]) -> None:
        """Sets every table's hyper-parameters (``lr``, ``eps``, ``beta1``, ``beta2``, ``weight_decay``).

        As in torchrec, ``lr`` is not written into the param groups (the next :meth:`step` resets it).
        """
        for shard in self.shards:
            shard.update_hyper_parameters(params_dict)
