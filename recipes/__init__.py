"""recpipe.recipes: DLRM training entry points, data, torchx components."""
