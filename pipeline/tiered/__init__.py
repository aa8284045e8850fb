"""recpipe.pipeline.tiered: embedding tables split over a fast and a slow tier.

Modules: ``shard`` (TieredEmbeddingShard), ``state`` (export / load), ``routing``
(shard routings), ``optim`` (fused optimizers), ``fbgemm`` (TBE plans), ``ops`` (kernel
constants), ``backends`` (tier backends), ``kernels`` / ``sharders`` / ``sharded``
(torchrec integration), ``fused_params``, ``fused_optimizer`` and ``migration``.
May import ``recpipe.pipeline.placement``, ``recpipe.pipeline.interfaces`` and
``recpipe.pipeline.routing``.
"""
