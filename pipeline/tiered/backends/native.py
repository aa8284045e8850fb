"""The ``native`` tier backend: recpipe's compiled CPU kernel (``csrc/tiered.cpp``).

The ``torch`` backend is its bit-for-bit reference. May import ``recpipe.pipeline.placement``,
``recpipe.pipeline.interfaces``, ``recpipe.pipeline.tiered.native_ops`` and ``recpipe.pipeline.tiered.optim``.
"""

from __future__ import annotations

from typing import ClassVar, FrozenSet, Optional

import torch

from recpipe.pipeline.interfaces import InputCheck, RowOptimizer, TierSpec
from recpipe.pipeline.placement import cache_policy_spec
from recpipe.pipeline.tiered.backends.buffers import BufferedTier, Lookup
from recpipe.pipeline.tiered.native_ops import TIERED_MODES, TIERED_OPTIMIZERS, TIERED_POOLINGS
from recpipe.pipeline.tiered.optim import HYPER_PARAMETERS

__all__ = ["NativeBackend"]


class NativeBackend(BufferedTier):
    """Tiers in host buffers, stepped by the compiled CPU kernel."""

    name: ClassVar[str] = "native"
    default_devices: ClassVar[FrozenSet[str]] = frozenset({"cpu"})

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(
                f"backend 'native' (the compiled CPU kernel) cannot run on {device}: use backend=None "
                "('fbgemm' on CUDA) or 'torch'."
            )

    def __init__(self, spec: TierSpec) -> None:
        super().__init__(spec)
        self._op_row_map, self._op_slot_row, self._op_slot_score = (
            t if t is not None else self.no_cache for t in (self.row_map, self.slot_row, self.slot_score)
        )
        self._op_mode: int = TIERED_MODES["ALL_FAST" if self.all_fast else ("CACHING" if self.caching else "HYBRID")]
        tiers = (self.fast_weights, self.fast_state, self.slow_weights, self.slow_state)
        geometry = (spec.num_rows, self.fast_rows, spec.split_seed, self._op_mode)
        # the kernels' arguments after the batch's: tier tensors, cache maps, geometry (as csrc/tiered.cpp)
        self._lookup_args = (*tiers, self._op_row_map, self._op_slot_row, self._op_slot_score, self.stats, *geometry)
        self._backward_args = (*tiers, self._op_row_map, self._op_slot_score, *geometry)
        self._op_policy: int = cache_policy_spec(spec.cache_policy).kernel_code
        self._op_pooling: int = TIERED_POOLINGS[spec.pooling]

    def forward_lookup(
        self, ids: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor], check: InputCheck
    ) -> Lookup:
        self.flushed_rows = 0
        self._clock += 1
        try:
            return torch.ops.recpipe.tiered_lookup(
                ids, offsets, psw, *self._lookup_args, self._op_policy, self._clock, self._op_pooling
            )
        except (IndexError, ValueError):
            # the kernel's checks cannot name the table: the host checks say the same, naming it
            check(ids, offsets, psw)
            raise

    @torch.no_grad()
    def backward_update(
        self,
        grad_out: torch.Tensor,
        uniq: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        psw: Optional[torch.Tensor],
        opt: RowOptimizer,
    ) -> None:
        step = self.next_optimizer_step()
        optim = (TIERED_OPTIMIZERS[opt.name], *(float(getattr(opt, k)) for k in HYPER_PARAMETERS))
        torch.ops.recpipe.tiered_backward(
            grad_out, uniq, inverse, offsets, psw, *self._backward_args, self._op_pooling, *optim, step
        )
