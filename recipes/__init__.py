"""recpipe.recipes: DLRM training entry points, data, models, torchx components, TensorBoard.

* :mod:`.train` (``python -m``), :mod:`.loop`, :mod:`.faults` - a run, its loop, what stops it
* :mod:`.config`, :mod:`.cli` - :class:`~.config.TrainConfig`, its command line and YAML
* :mod:`.checkpoint` - the recipe's checkpoints; :mod:`.build` - sharding and pipeline
* :mod:`.launch` (``make run``), :mod:`.components` - torchx
* :mod:`.data` - MovieLens-100k, synthetic Criteo-like stream, Criteo TSV
"""
