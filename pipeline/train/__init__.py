"""recpipe.pipeline.train: ``TrainPipelineFusedSparseDist`` and what only it uses.

Owns the pipeline's schedule (lookup of batch i+1 after batch i's fused backward),
its runtime forwards, exactness validation and stage statistics. May import
``recpipe.pipeline.placement``, ``recpipe.pipeline.routing`` and
``recpipe.pipeline.tiered``; nothing imports it but the package root and recipes.
"""
