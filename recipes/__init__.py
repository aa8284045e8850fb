"""recpipe.recipes: DLRM training entry points, data, models, torchx components, TensorBoard.

* ``python -m recpipe.recipes.train`` - the train entry point (:mod:`.train`, :mod:`.config`)
* ``python -m recpipe.recipes.launch`` - ``make run``: the default recipe via torchx
* :mod:`.components` - torchx components (entry point ``recpipe``)
* :mod:`.build` - sharding and pipeline selection (the one place placements are decided)
* :mod:`.data` - MovieLens-100k, synthetic Criteo-like stream, Criteo TSV
"""
