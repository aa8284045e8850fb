"""Dynamic tables: raw int64 keys in a scored hash index in front of tiered storage (``docs/dynamic.md``).

``key_index`` (find / insert / evict / admit, with undo), ``plan`` (the index's plan in torch ops) and
``native_plan`` (the compiled CPU kernel of the same plan), ``key_hashing`` (bucket hash and initial values),
``dynamic_shard`` (``DynamicEmbeddingShard``), ``dynamic_state`` (a shard's rows keyed by raw key, as
``state_dict()`` and checkpoints save and load them), ``dynamic_gather`` (``gather_dynamic_table``). May import
``recpipe.pipeline.placement``, ``recpipe.pipeline.interfaces``, ``recpipe.pipeline.routing`` and
``recpipe.pipeline.tiered`` (below the kernels and sharders).
"""
