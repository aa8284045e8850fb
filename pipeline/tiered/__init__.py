"""recpipe.pipeline.tiered: embedding tables split over a fast and a slow tier.

Owns the tiered shard (one class over a tier-backend interface), its backends
(native CPU op, fbgemm TBE, torch reference), the kernel modules and sharders that
put tiered tables behind torchrec's shardings, fused-parameter parsing, the fused
optimizer, and migration of table state to and from torchrec tables. May import
``recpipe.pipeline.placement`` and ``recpipe.pipeline.routing``.
"""
