"""recpipe.pipeline.train_pipeline: ``TrainPipelineFusedSparseDist`` (``pipeline``) and what only it uses.

May import ``recpipe.pipeline.placement``, ``types``, ``routing`` and ``tiered``; nothing
imports it but the package root and recipes.
"""
