"""Models: torchrec's DLRM and the micro-DLRM-DRAM configuration.

Both are :class:`DLRMTrain` (BCE loss) and differ only in table sizes (see
:func:`~recpipe.recipes.data.base.table_rows`). Tables are created on the meta device;
DMP materialises only each rank's shards.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data.base import DatasetSpec, table_rows

# Module path of the EBC inside DLRMTrain (the key of the sharding plan).
EBC_PATH: str = "model.sparse_arch.embedding_bag_collection"


def embedding_bag_collection(model: nn.Module) -> EmbeddingBagCollection:
    """The ``EmbeddingBagCollection`` at :data:`EBC_PATH` of a :func:`build_model` model.

    Args:
        model: unsharded ``DLRMTrain``.

    Returns:
        Its tables' ``EmbeddingBagCollection``.

    Raises:
        AttributeError: ``model`` has no submodule at ``EBC_PATH``.
        TypeError: the submodule at ``EBC_PATH`` is not an ``EmbeddingBagCollection``.
    """
    ebc = model.get_submodule(EBC_PATH)
    if not isinstance(ebc, EmbeddingBagCollection):
        raise TypeError(
            f"model: {EBC_PATH} is a {type(ebc).__name__}, expected a torchrec EmbeddingBagCollection; "
            "pass the DLRMTrain that build_model() returns."
        )
    return ebc


def table_configs(config: TrainConfig, spec: DatasetSpec) -> list[EmbeddingBagConfig]:
    """One sum-pooled table per sparse feature, named ``t_<feature>``."""
    return [
        EmbeddingBagConfig(
            name=f"t_{feat}",
            embedding_dim=config.embedding_dim,
            num_embeddings=rows,
            feature_names=[feat],
            pooling=PoolingType.SUM,
        )
        for feat, rows in zip(spec.feature_names, table_rows(config, spec))
    ]


def build_model(config: TrainConfig, spec: DatasetSpec, dense_device: torch.device) -> DLRMTrain:
    """The unsharded ``DLRMTrain``: tables on meta, dense layers on ``dense_device`` (caller seeds)."""
    ebc = EmbeddingBagCollection(tables=table_configs(config, spec), device=torch.device("meta"))
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=spec.dense_in_features,
        dense_arch_layer_sizes=list(config.dense_arch),
        over_arch_layer_sizes=list(config.over_arch),
        dense_device=dense_device,
    )
    return DLRMTrain(dlrm)
