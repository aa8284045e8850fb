"""Fused (in-backward) row optimizers of the tiered embedding shard.

The math follows fbgemm_gpu's TBE optimizers (``EmbOptimType`` / ``OptimType``),
applied to the rows of one batch after their gradients were summed per unique
row ("exact" optimizers in fbgemm's naming):

* ``sgd`` (fbgemm ``EXACT_SGD``): ``w -= lr * g``.
* ``rowwise_adagrad`` (fbgemm ``EXACT_ROWWISE_ADAGRAD``, weight decay NONE):
  ``m += mean(g * g)``; ``w -= lr / (sqrt(m) + eps) * g``. One fp32 state per row.
* ``adam`` (fbgemm ``ADAM``): with the step counter ``t`` (1 on the first step),
  ``m1 = b1 * m1 + (1 - b1) * g``; ``m2 = b2 * m2 + (1 - b2) * g * g``;
  ``w -= lr * (m1 / (1 - b1**t) / (sqrt(m2 / (1 - b2**t)) + eps) + wd * w)``.
  Two fp32 states per element (``exp_avg`` then ``exp_avg_sq``). Only rows looked
  up in the step are updated (fbgemm semantics, not dense ``torch.optim.Adam``).

The optimizer state of a row is stored in a ``[rows, state_cols]`` fp32 tensor
next to the row's values, in the same tier, and moves with the row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import FrozenSet, Union

import torch

from recpipe.pipeline.routing.ops import check_int
from recpipe.pipeline.placement import FusedOptimizer

__all__ = ["FusedOptimizer", "SUPPORTED_OPTIMIZERS", "TieredOptimizerConfig"]

#: The fused optimizers the tiered kernel runs (the placement contract also names
#: ADAGRAD, which the planner can size but the kernel does not implement).
SUPPORTED_OPTIMIZERS: FrozenSet[FusedOptimizer] = frozenset(
    {FusedOptimizer.SGD, FusedOptimizer.ROWWISE_ADAGRAD, FusedOptimizer.ADAM}
)


@dataclass(kw_only=True)
class TieredOptimizerConfig:
    """Fused optimizer of a tiered table (torchrec ``fused_params`` style).

    Example::

        TieredOptimizerConfig(optimizer="rowwise_adagrad", learning_rate=0.05)
    """

    optimizer: Union[FusedOptimizer, str] = FusedOptimizer.SGD
    """``sgd``, ``rowwise_adagrad`` or ``adam``."""
    learning_rate: float = 0.01
    """Learning rate (fbgemm default 0.01)."""
    eps: float = 1.0e-8
    """Denominator epsilon of Adagrad / Adam (fbgemm default 1e-8)."""
    beta1: float = 0.9
    """Adam first-moment decay (fbgemm default 0.9)."""
    beta2: float = 0.999
    """Adam second-moment decay (fbgemm default 0.999)."""
    weight_decay: float = 0.0
    """Adam decoupled-in-update weight decay (fbgemm ``ADAM`` ``weight_decay``); must be 0 otherwise."""

    def __post_init__(self) -> None:
        self.optimizer = FusedOptimizer.parse(self.optimizer)
        if self.optimizer not in SUPPORTED_OPTIMIZERS:
            raise ValueError(
                f"optimizer {self.optimizer.value} is not supported by tiered tables: use one of "
                f"{sorted(o.value for o in SUPPORTED_OPTIMIZERS)} (apply_optimizer_in_backward with SGD, "
                "RowWiseAdagrad or Adam)."
            )
        for name in ("learning_rate", "eps", "weight_decay"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"TieredOptimizerConfig.{name} must be a finite number >= 0, got {value!r}."
                )
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
                raise ValueError(f"TieredOptimizerConfig.{name} must be in [0, 1), got {value!r}.")
        if self.weight_decay and self.optimizer is not FusedOptimizer.ADAM:
            raise ValueError(
                f"TieredOptimizerConfig.weight_decay={self.weight_decay} is only supported by adam; "
                f"set weight_decay=0.0 for {self.optimizer.value}."
            )

    @property
    def name(self) -> str:
        """Optimizer name as the byte formulas (``recpipe.pipeline.placement``) spell it."""
        assert isinstance(self.optimizer, FusedOptimizer)
        return self.optimizer.value

    def state_cols(self, dim: int) -> int:
        """fp32 state columns per row: sgd 0, rowwise_adagrad 1, adam ``2 * dim``.

        Args:
            dim (int): embedding dimension.

        Returns:
            int: columns of the ``[rows, cols]`` fp32 state tensor.
        """
        dim = check_int(dim, "dim", 1)
        if self.optimizer is FusedOptimizer.SGD:
            return 0
        if self.optimizer is FusedOptimizer.ROWWISE_ADAGRAD:
            return 1
        return 2 * dim

    def update(self, weights: torch.Tensor, state: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        """Applies one update in place to gathered rows.

        Args:
            weights (torch.Tensor): ``[n, dim]`` fp32 rows (updated in place).
            state (torch.Tensor): ``[n, state_cols]`` fp32 optimizer state (in place).
            grad (torch.Tensor): ``[n, dim]`` gradient summed per unique row.
            step (int): 1-based step counter (Adam bias correction).
        """
        opt = self.optimizer
        step = check_int(step, "step", 1)
        for name, t in (("weights", weights), ("state", state), ("grad", grad)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
                got = f"{t.dtype} of shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"TieredOptimizerConfig.update: `{name}` must be a 2-D float tensor, got {got}.")
        n, dim = weights.shape
        cols = self.state_cols(dim)
        for name, t, want in (("grad", grad, [n, dim]), ("state", state, [n, cols])):
            if list(t.shape) != want:
                raise ValueError(f"TieredOptimizerConfig.update: `{name}` must have shape {want} (`weights` is "
                                 f"[{n}, {dim}], {opt.value} keeps {cols} state columns), got {list(t.shape)}.")
        lr = float(self.learning_rate)
        if opt is FusedOptimizer.SGD:
            weights.sub_(grad, alpha=lr)
            return
        if opt is FusedOptimizer.ROWWISE_ADAGRAD:
            mom = state[:, 0]
            mom.add_(grad.square().mean(dim=1))
            multiplier = lr / (mom.sqrt() + self.eps)
            weights.sub_(grad * multiplier.unsqueeze(1))
            return
        dim = weights.shape[1]
        m1 = state[:, :dim]
        m2 = state[:, dim:]
        m1.mul_(self.beta1).add_(grad, alpha=1.0 - self.beta1)
        m2.mul_(self.beta2).addcmul_(grad, grad, value=1.0 - self.beta2)
        bc1 = 1.0 - self.beta1**step
        bc2 = 1.0 - self.beta2**step
        upd = (m1 / bc1) / ((m2 / bc2).sqrt() + self.eps)
        if self.weight_decay:
            upd.add_(weights, alpha=self.weight_decay)
        weights.sub_(upd, alpha=lr)
