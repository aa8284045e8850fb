"""Fused (in-backward) row optimizers of the tiered shard, with fbgemm TBE's math.

Applied to a batch's rows after their gradients were summed per unique row ("exact"):
``sgd`` (``w -= lr * g``), ``rowwise_adagrad`` (one fp32 state per row) and ``adam``
(``exp_avg`` then ``exp_avg_sq`` per element; only looked-up rows are updated). A row's
state lives next to its values, in the same tier. :class:`OptimizerControlMixin` gives a
shard fbgemm TBE's controls. May import ``recpipe.pipeline.placement`` and ``recpipe.pipeline.interfaces``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import numpy as np
import torch

from recpipe.pipeline.interfaces import RowOptimizer, TierBackend
from recpipe.pipeline.placement import SUPPORTED_OPTIMIZERS, FusedOptimizerKind, check_int

__all__ = [
    "HYPER_PARAMETERS",
    "FusedOptimizerKind",
    "OptimizerControlMixin",
    "TieredOptimizerConfig",
    "check_row_optimizer",
    "check_step",
]

#: The optimizer hyper-parameters of :class:`TieredOptimizerConfig` (fbgemm's TBE takes them by these names).
HYPER_PARAMETERS: Tuple[str, ...] = ("learning_rate", "eps", "beta1", "beta2", "weight_decay")


@dataclass(kw_only=True)
class TieredOptimizerConfig:
    """Fused optimizer of a tiered table (torchrec ``fused_params`` style; fbgemm's defaults)."""

    optimizer: Union[FusedOptimizerKind, str] = FusedOptimizerKind.SGD
    """``sgd``, ``rowwise_adagrad`` or ``adam``."""
    learning_rate: float = 0.01
    eps: float = 1.0e-8
    """Denominator epsilon of Adagrad / Adam."""
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    """Adam's in-update weight decay (fbgemm ``ADAM``); must be 0 otherwise."""

    def __post_init__(self) -> None:
        self.optimizer = FusedOptimizerKind.parse(self.optimizer)
        if self.optimizer not in SUPPORTED_OPTIMIZERS:
            raise ValueError(
                f"optimizer {self.optimizer.value} is not supported by tiered tables: use one of "
                f"{sorted(o.value for o in SUPPORTED_OPTIMIZERS)} (apply_optimizer_in_backward with SGD, "
                "RowWiseAdagrad or Adam)."
            )
        for name in ("learning_rate", "eps", "weight_decay"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"TieredOptimizerConfig.{name} must be a finite number >= 0, got {value!r}.")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
                raise ValueError(f"TieredOptimizerConfig.{name} must be in [0, 1), got {value!r}.")
        if self.weight_decay and self.optimizer is not FusedOptimizerKind.ADAM:
            raise ValueError(
                f"TieredOptimizerConfig.weight_decay={self.weight_decay} is only supported by adam; "
                f"set weight_decay=0.0 for {self.optimizer.value}."
            )

    @property
    def name(self) -> str:
        """Optimizer name as the byte formulas (``recpipe.pipeline.placement``) spell it."""
        assert isinstance(self.optimizer, FusedOptimizerKind)
        return self.optimizer.value

    def state_cols(self, dim: int) -> int:
        """fp32 state columns per row of width ``dim``: sgd 0, rowwise_adagrad 1, adam ``2 * dim``."""
        dim = check_int(dim, "dim", 1)
        # str keys: FusedOptimizerKind is a StrEnum, so a kind and its value find the same entry
        cols: Dict[str, int] = {FusedOptimizerKind.SGD: 0, FusedOptimizerKind.ROWWISE_ADAGRAD: 1}
        return cols.get(self.optimizer, 2 * dim)

    def update(self, weights: torch.Tensor, state: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        """Applies one update in place to gathered ``[n, dim]`` rows and their state; ``grad`` is
        summed per unique row, ``step`` is 1-based."""
        opt = self.optimizer
        assert isinstance(opt, FusedOptimizerKind)  # __post_init__ parsed it
        step = check_int(step, "step", 1)
        for name, t in (("weights", weights), ("state", state), ("grad", grad)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
                got = f"{t.dtype} of shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"TieredOptimizerConfig.update: `{name}` must be a 2-D float tensor, got {got}.")
        n, dim = weights.shape
        cols = self.state_cols(dim)
        for name, t, want in (("grad", grad, [n, dim]), ("state", state, [n, cols])):
            if list(t.shape) != want:
                raise ValueError(
                    f"TieredOptimizerConfig.update: `{name}` must have shape {want} (`weights` is "
                    f"[{n}, {dim}], {opt.value} keeps {cols} state columns), got {list(t.shape)}."
                )
        lr = float(self.learning_rate)
        if opt is FusedOptimizerKind.SGD:
            weights.sub_(grad, alpha=lr)
            return
        if opt is FusedOptimizerKind.ROWWISE_ADAGRAD:
            mom = state[:, 0]
            mom.add_(grad.square().mean(dim=1))
            multiplier = lr / (mom.sqrt() + self.eps)
            weights.sub_(grad * multiplier.unsqueeze(1))
            return
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


def check_row_optimizer(
    table_name: str, optimizer: Any, embedding_dim: int, backend: str, calls_optimizer_update: bool
) -> RowOptimizer:
    """A shard's row optimizer: ``optimizer``, or SGD lr 0.01 for None.

    A ``RowOptimizer`` other than the built-in ``TieredOptimizerConfig`` (or one overriding its
    ``update``) must be of a supported kind, keep that kind's state layout, and run on a backend
    that applies its ``update`` (``calls_optimizer_update``).

    Raises:
        ValueError: naming the table, the argument and the fix.
    """
    if optimizer is None:
        return TieredOptimizerConfig()
    if not isinstance(optimizer, RowOptimizer):
        raise ValueError(
            f"tiered table {table_name!r}: optimizer must be a RowOptimizer (recpipe.pipeline.interfaces) or "
            f"None, got {type(optimizer).__name__} {optimizer!r}; pass e.g. "
            "TieredOptimizerConfig(optimizer='adam', learning_rate=0.01)."
        )
    if isinstance(optimizer, TieredOptimizerConfig) and type(optimizer).update is TieredOptimizerConfig.update:
        return optimizer  # the built-in math every backend implements
    cls = type(optimizer).__name__
    kind = next((o for o in SUPPORTED_OPTIMIZERS if o.value == optimizer.name), None)
    if kind is None:
        raise ValueError(
            f"tiered table {table_name!r}: {cls}.name must be one of {sorted(o.value for o in SUPPORTED_OPTIMIZERS)}, "
            f"got {optimizer.name!r}: the name is the built-in kind whose row state layout the optimizer keeps "
            "(exports, checkpoints and the byte formulas read it)."
        )
    want, got = TieredOptimizerConfig(optimizer=kind).state_cols(embedding_dim), optimizer.state_cols(embedding_dim)
    if got != want:
        raise ValueError(
            f"tiered table {table_name!r}: {cls}.state_cols({embedding_dim}) is {got}, but {kind.value} keeps "
            f"{want} fp32 state columns per row; keep the layout of the kind, or declare the kind whose layout "
            "it keeps."
        )
    if not calls_optimizer_update:
        raise ValueError(
            f"tiered table {table_name!r}: backend {backend!r} runs its own {kind.value} kernel and would "
            f"ignore {cls}.update; pass backend='torch', which applies RowOptimizer.update, or a "
            "TieredOptimizerConfig."
        )
    return optimizer


def check_step(table_name: str, step: Any, what: str) -> None:
    """Refuses an optimizer ``step`` that is not an int >= 0, naming the table and ``what`` to pass."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"tiered table {table_name!r}: optimizer step must be an int >= 0, got {step!r}: pass {what}.")


class OptimizerControlMixin:
    """Fused-optimizer controls of a tiered shard, as fbgemm's TBE offers them."""

    table_name: str
    optimizer: RowOptimizer
    tiers: TierBackend

    @property
    def step(self) -> int:
        """The optimizer step the table records (and exports)."""
        return self.tiers.step

    def set_learning_rate(self, lr: Union[float, torch.Tensor]) -> None:
        """Sets the learning rate of the following lookups, as fbgemm TBE's ``set_learning_rate``: ``lr`` is a
        finite number >= 0, or a 0-dim real tensor holding one (read once here: on CUDA a device sync)."""
        self.optimizer.learning_rate = self._check_lr(lr)
        self.tiers.set_learning_rate(self.optimizer.learning_rate)

    def _check_lr(self, lr: Any) -> float:
        """``lr`` as a float, or a ValueError naming the table."""
        value: Optional[float] = None
        if isinstance(lr, torch.Tensor):
            if lr.dim() == 0 and not lr.is_complex() and lr.dtype is not torch.bool:
                value = float(lr.detach().item())
        elif isinstance(lr, numbers.Real) and not isinstance(lr, (bool, np.bool_)):
            value = float(lr)
        if value is None or not math.isfinite(value) or value < 0:
            what = (
                f"a tensor of shape {list(lr.shape)} and dtype {lr.dtype}" if isinstance(lr, torch.Tensor) else repr(lr)
            )
            raise ValueError(
                f"tiered table {self.table_name!r}: learning rate must be a finite real number >= 0 or a 0-dim "
                f"real tensor holding one (as fbgemm's TBE takes), got {what}: pass e.g. 0.01 or "
                "torch.tensor(0.01) (a 1-element tensor: lr.reshape(()))."
            )
        return value

    def set_optimizer_step(self, step: int) -> None:
        """Sets the recorded step, as fbgemm TBE's ``set_optimizer_step``.

        As fbgemm's ``iter_cpu``, Adam's bias-correction counter takes the step only while it
        is 0: on a fresh or just loaded table the next update is step ``step + 1``; a running
        table keeps its bias correction and records ``step``.
        """
        check_step(self.table_name, step, "the number of optimizer steps taken (e.g. the checkpoint's step)")
        self.tiers.set_optimizer_step(int(step))

    def update_hyper_parameters(self, params_dict: Dict[str, float]) -> None:
        """Sets ``lr``, ``eps``, ``beta1``, ``beta2``, ``weight_decay`` for the following lookups,
        as fbgemm TBE's ``update_hyper_parameters`` (``weight_decay`` is ignored except for Adam). Raises
        NotImplementedError for another name, as fbgemm, and ValueError for a value out of range (nothing is set).
        """
        names = ("lr", "eps", "beta1", "beta2", "weight_decay")
        if not isinstance(params_dict, Mapping):
            raise ValueError(
                f"tiered table {self.table_name!r}: params_dict must be a dict of hyper-parameter "
                f"name -> value, got {type(params_dict).__name__}; pass e.g. {{'lr': 0.01}}."
            )
        for name in params_dict:
            if name not in names:
                raise NotImplementedError(
                    f"tiered table {self.table_name!r}: setting hyper-parameter {name!r} is "
                    f"not supported (supported: {list(names)})."
                )
        adam = self.optimizer.name == FusedOptimizerKind.ADAM.value
        fields = ("eps", "beta1", "beta2") + (("weight_decay",) if adam else ())
        updates = {k: float(v) for k, v in params_dict.items() if k in fields}
        try:  # validated on a copy: nothing is set when a value is refused
            current = {k: getattr(self.optimizer, k) for k in HYPER_PARAMETERS}
            TieredOptimizerConfig(optimizer=self.optimizer.name, **{**current, **updates})
        except ValueError as e:
            raise ValueError(f"tiered table {self.table_name!r}: {e}") from None
        if "lr" in params_dict:
            self.set_learning_rate(params_dict["lr"])
        for key, value in updates.items():
            setattr(self.optimizer, key, value)
        self.tiers.update_hyper_parameters(
            {k: float(v) for k, v in params_dict.items() if k != "weight_decay" or "weight_decay" in fields}
        )

    def lookup_counters(self) -> Optional[Any]:
        """Opaque host snapshot of the counters a lookup advances (fbgemm counts steps in the
        lookup), for :meth:`undo_lookup`; None when a lookup advances none."""
        return self.tiers.lookup_counters()

    def undo_lookup(self, before: Optional[Any], after: Optional[Any]) -> None:
        """Takes back one discarded lookup's counter increments (:meth:`lookup_counters` ``before`` /
        ``after`` it), keeping those of later lookups."""
        self.tiers.undo_lookup(before, after)
