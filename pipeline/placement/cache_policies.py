"""Cache policies of CACHING tables, as an extension point: the :class:`CachePolicy` enum and its
:data:`CACHE_POLICIES` registry. Imports only ``recpipe.pipeline.placement.values``."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Dict, Union

from recpipe.pipeline.placement.values import parse_enum


class CachePolicy(enum.StrEnum):
    """Eviction policy of a CACHING table. LFU is the default (closest to the frequency oracle on skewed
    ids); LRU suits drifting traffic."""

    LFU = "lfu"
    LRU = "lru"

    @classmethod
    def parse(cls, value: Union["CachePolicy", str], argument: str = "cache_policy") -> "CachePolicy":
        """A policy from a ``CachePolicy`` or its case-insensitive name."""
        return parse_enum(cls, value, argument)


#: Fast-tier bytes per cache slot of a native CACHING table: int64 slot -> row plus
#: int64 eviction score (LFU count / LRU timestamp).
CACHE_SLOT_BYTES: int = 16


@dataclass(frozen=True)
class CachePolicySpec:
    """What the kernels, the byte formulas and the cost model know of one cache policy.

    Adding a policy: a :class:`CachePolicy` member, its :data:`CACHE_POLICIES` entry and its eviction in
    the native kernel (csrc and ``tiered.backends.reference``); everything else reads the spec.

    Args:
        kernel_code: the ``policy`` argument of ``torch.ops.recpipe.tiered_*``.
        fbgemm_algorithm: fbgemm's ``CacheAlgorithm`` member name.
        slot_bytes: native fast-tier metadata bytes per cache slot.
        fbgemm_state_bytes: (local rows, cache slots) -> bytes of fbgemm's ``lxu_state``; numpy arrays too.
        hit_rate: (load factor ``x``, access mass of the ``x * N`` hottest rows) -> expected hit rate; numpy
            arrays too (the cost model prices many tables and options at once).
    """

    policy: CachePolicy
    kernel_code: int
    fbgemm_algorithm: str
    slot_bytes: int
    fbgemm_state_bytes: Callable[[Any, Any], Any]
    hit_rate: Callable[[Any, Any], Any] = lambda x, top_mass: top_mass


#: Every cache policy's spec (the cost model prices LRU as LFU: top-``x * N`` access mass).
CACHE_POLICIES: Dict[CachePolicy, CachePolicySpec] = {
    CachePolicy.LFU: CachePolicySpec(
        policy=CachePolicy.LFU,
        kernel_code=0,
        fbgemm_algorithm="LFU",
        slot_bytes=CACHE_SLOT_BYTES,
        fbgemm_state_bytes=lambda rows, slots: (rows + 1) * 8,  # int64 access count per row
    ),
    CachePolicy.LRU: CachePolicySpec(
        policy=CachePolicy.LRU,
        kernel_code=1,
        fbgemm_algorithm="LRU",
        slot_bytes=CACHE_SLOT_BYTES,
        fbgemm_state_bytes=lambda rows, slots: slots * 8,  # int64 timestamp per slot
    ),
}
if set(CACHE_POLICIES) != set(CachePolicy):  # pragma: no cover - guards the registry
    raise ImportError(f"CACHE_POLICIES {sorted(CACHE_POLICIES)} disagrees with CachePolicy.")


def cache_policy_spec(policy: Union[CachePolicy, str]) -> CachePolicySpec:
    """The :class:`CachePolicySpec` of a policy (any case) or of an fbgemm ``CacheAlgorithm`` name."""
    for spec in CACHE_POLICIES.values():
        if policy == spec.fbgemm_algorithm:
            return spec
    return CACHE_POLICIES[CachePolicy.parse(policy)]
