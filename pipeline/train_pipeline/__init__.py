"""recpipe.pipeline.train_pipeline: ``TrainPipelineFusedSparseDist`` (``fused_pipeline``),
``TrainPipelineSemiSync`` (``semi_sync_pipeline``) and the lookup machinery they share.

May import ``recpipe.pipeline.placement``, ``types``, ``routing`` and ``tiered``; nothing
imports it but the package root and recipes.
"""
