"""Models: torchrec's DLRM and the micro-DLRM-DRAM configuration.

Both are :class:`DLRMTrain` (BCE loss) and differ only in table sizes (see
:func:`~recpipe.recipes.data.base.table_rows`). Tables are created on the meta device;
DMP materialises only each rank's shards.
"""

from __future__ import annotations

import torch
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data.base import DatasetSpec, table_rows

# Module path of the EBC inside DLRMTrain (the key of the sharding plan).
EBC_PATH: str = "model.sparse_arch.embedding_bag_collection"


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
