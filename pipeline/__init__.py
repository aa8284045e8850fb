"""recpipe.pipeline: TrainPipelineFusedSparseDist, sharders, tiered storage and op wrappers."""
