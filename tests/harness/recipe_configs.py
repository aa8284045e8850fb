"""Recipe run configurations and output-file helpers shared by the recipe tests (no tests here).

Provides ``SMALL_SYNTHETIC`` (the keyword arguments of a small synthetic DLRM
``TrainConfig``, without steps or checkpoint settings; ``SMALL`` is the same
dict), ``SYNTHETIC`` (a smaller one, without log or eval settings either),
``step_dir`` (the directory of one step's checkpoint under a checkpoint root),
``flip_bytes`` (corrupts a file by inverting bytes in its second half) and
``scalars`` (a TensorBoard directory's scalar events). Importable by module name
inside gloo ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SMALL_SYNTHETIC: dict[str, Any] = dict(
    dataset="synthetic",
    model="dlrm",
    num_embeddings=2000,
    synthetic_id_space=50_000,
    embedding_dim=8,
    dense_arch=(16, 8),
    over_arch=(16, 1),
    batch_size=128,
    eval_batches=2,
    log_every=4,
    progress_bar=False,
    embedding_lr=0.1,
    dense_lr=0.05,
)

# the small synthetic DLRM run of the recipe tests
SMALL: dict[str, Any] = SMALL_SYNTHETIC

# a smaller synthetic DLRM run: the metrics and progress tests
SYNTHETIC: dict[str, Any] = dict(
    dataset="synthetic",
    model="dlrm",
    num_embeddings=500,
    synthetic_id_space=5000,
    embedding_dim=8,
    dense_arch=(16, 8),
    over_arch=(16, 1),
    batch_size=32,
    eval_batches=2,
    progress_bar=False,
)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def flip_bytes(path: Path, count: int = 64) -> None:
    """Inverts ``count`` bytes spread over the file's second half (tensor data)."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    stride = max(1, (len(data) - start) // (count + 1))
    for i in range(count):
        data[start + (i + 1) * stride - 1] ^= 0xFF
    path.write_bytes(bytes(data))


def scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag's ``(step, value)`` events as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
