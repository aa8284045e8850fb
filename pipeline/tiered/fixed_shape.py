"""Fixed-shape selections and deduplication: output shapes follow the inputs' shapes, never their values.

An accelerator learns a data-dependent size (``nonzero``, ``unique``, a boolean index, ``.item()``) only by
a host read that waits for the device. The torch implementations of the dynamic key index and of the
all-fast ``torch`` tier backend use these instead, so their steps queue without a host read:

- :func:`fixed_unique` pads the distinct values to the input's length (the padding repeats the last one);
- :func:`select` lists the entries a mask holds, in order, then repeats the last one, so a write through
  the selection writes each held target its value and the repeats rewrite that same value; when the mask
  holds nothing, the writes rewrite what their targets hold.

``select(mask, fixed=False)`` gives the exact (compact) selection instead, for the CPU kernels, where a
host read costs nothing. Imports nothing of recpipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = ["Selection", "device_counts", "fixed_unique", "last_valid", "select"]


def device_counts(counts: Sequence[Union[int, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """int64 ``[len(counts)]`` on ``device`` of host ints and 0-d tensors, without a host-to-device copy
    (a host value fills its entry; CUDA waits for a pageable copy of host data)."""
    return torch.stack(
        [
            c.to(device, torch.int64)
            if isinstance(c, torch.Tensor)
            else torch.full((), c, dtype=torch.int64, device=device)
            for c in counts
        ]
    )


def fixed_unique(values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(uniq, inverse, counts, valid)`` of 1-D ``values``, each of their length ``n``.

    ``uniq[:U]``, ``inverse`` and ``counts[:U]`` are ``torch.unique(values, sorted=True, return_inverse=True,
    return_counts=True)`` for the ``U`` distinct values; past ``U``, ``uniq`` repeats ``uniq[U - 1]``, ``counts``
    is 0 and ``valid`` (``position < U``) is False.
    """
    n = values.numel()
    if n == 0:
        empty = values.new_empty(0, dtype=torch.int64)
        return values.clone(), empty, empty.clone(), empty.to(torch.bool)
    ordered, order = torch.sort(values, stable=True)
    first = torch.ones(n, dtype=torch.bool, device=values.device)
    first[1:] = ordered[1:] != ordered[:-1]
    group = first.to(torch.int64).cumsum(0) - 1  # distinct value of each sorted position
    inverse = torch.empty_like(group).index_copy_(0, order, group)
    # a group's positions all carry its value: the repeated writes are identical
    uniq = torch.empty_like(values).index_copy_(0, group, ordered)
    counts = torch.zeros(n, dtype=torch.int64, device=values.device).index_add_(0, group, torch.ones_like(group))
    valid = torch.arange(n, device=values.device) <= group[-1]
    return last_valid(uniq, valid), inverse, counts, valid


def last_valid(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x`` with the rows past the valid prefix (``valid``: a prefix mask) replaced by its last valid row
    (row 0 when none is valid)."""
    n = valid.numel()
    pos = torch.arange(n, device=valid.device)
    return x.index_select(0, torch.minimum(pos, (valid.sum() - 1).clamp(min=0)))


@dataclass(frozen=True)
class Selection:
    """The entries of per-entry vectors that a mask holds.

    Attributes:
        at (torch.Tensor): positions of the held entries in order; fixed: then the last held one repeated
            (or 0 when none is held), ``n`` positions in all.
        live (Optional[torch.Tensor]): None: exact (every position is held); else a 0-d bool, whether any
            entry is held.
        held (Optional[torch.Tensor]): None: exact; else which positions of ``at`` are held entries (each
            once), for counting.
        count (Union[int, torch.Tensor]): entries held (a host int when exact, else a 0-d tensor).
    """

    at: torch.Tensor
    live: Optional[torch.Tensor]
    held: Optional[torch.Tensor]
    count: Union[int, torch.Tensor]

    @staticmethod
    def every(n: int, device: torch.device) -> "Selection":
        """The exact selection of all ``n`` entries."""
        return Selection(torch.arange(n, device=device), None, None, n)

    def take(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` at the selection's positions."""
        return values.index_select(0, self.at)

    def targets(self, index: torch.Tensor) -> torch.Tensor:
        """``index`` (int64 positions into a tensor, -1 where none) at the selection's positions, as write
        targets: a fixed selection holding nothing writes at ``max(index[at], 0)``."""
        taken = self.take(index)
        return taken if self.live is None else taken.clamp(min=0)

    def keep(self, values: torch.Tensor, otherwise: Union[torch.Tensor, int]) -> torch.Tensor:
        """``values`` (taken) where the selection holds something, else ``otherwise``."""
        if self.live is None:
            return values
        live = self.live.reshape((1,) * values.dim())
        return torch.where(live, values, otherwise)

    def copy_(self, tensor: torch.Tensor, targets: torch.Tensor, values: torch.Tensor) -> None:
        """``tensor[targets[i]] = values[i]`` (``targets``: :meth:`targets`, distinct over held entries)."""
        tensor.index_copy_(0, targets, self.keep(values, tensor.index_select(0, targets)))

    def count_of(self, flags: torch.Tensor) -> Union[int, torch.Tensor]:
        """How many held entries ``flags`` (taken) mark."""
        return flags.sum() if self.held is None else (flags & self.held).sum()


def select(mask: torch.Tensor, fixed: bool) -> Selection:
    """The entries ``mask`` (bool ``[n]``) holds: exact (``nonzero``) or ``fixed`` (``n`` positions, no host
    read), as the module says."""
    n = mask.numel()
    if n == 0:
        return Selection(torch.empty(0, dtype=torch.int64, device=mask.device), None, None, 0)
    if not fixed:
        at = mask.nonzero().squeeze(1)
        return Selection(at, None, None, at.numel())
    order = torch.argsort((~mask).to(torch.int8), stable=True)  # held entries first, in order
    count = mask.sum()
    pos = torch.arange(n, device=mask.device)
    at = order.index_select(0, torch.minimum(pos, (count - 1).clamp(min=0)))
    return Selection(at, count > 0, pos < count, count)
