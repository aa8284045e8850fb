"""recpipe.pipeline.routing: which rank owns which row, and moving ids there.

Owns the ``torch.ops.recpipe`` routing op wrappers and their fake kernels, KJT
bucketization, row order records, and the row-wise input/output dists, shardings,
sharded modules and sharders of routed (roundrobin / hash_roundrobin) tables. May
import ``recpipe.pipeline.placement`` and ``recpipe._C`` only.
"""
