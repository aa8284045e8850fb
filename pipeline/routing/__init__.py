"""recpipe.pipeline.routing: which rank owns which row, and moving ids there.

Modules, lowest first: ``ops`` (routing op wrappers and fakes), ``rows`` (row math),
``kjt`` (KJT bucketization), ``features`` (per-table / per-feature routing), ``row_order``
(row-order record of routed FUSED tables), ``dists``, ``shardings``, ``sharded``,
``sharders`` (row-wise torchrec components with routed input).

May import ``recpipe.pipeline.placement``, ``recpipe.pipeline.interfaces`` and ``recpipe._C`` only.
"""
