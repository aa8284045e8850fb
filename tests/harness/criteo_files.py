"""Criteo TSV inputs shared by the recipe tests (no tests here).

Provides ``CRITEO`` (the keyword arguments of a small ``criteo_tsv`` DLRM
``TrainConfig``: 6 steps of 16 samples, without a data path) and
``write_criteo`` (writes a deterministic Criteo TSV of valid rows: a label, 13
integer and 26 hex categorical columns).
"""

from __future__ import annotations

import csv
import random
from pathlib import Path
from typing import Any

CRITEO: dict[str, Any] = dict(
    dataset="criteo_tsv",
    model="dlrm",
    num_embeddings=500,
    embedding_dim=8,
    dense_arch=(16, 8),
    over_arch=(16, 1),
    batch_size=16,
    eval_batches=2,
    progress_bar=False,
    max_steps=6,
)


def write_criteo(path: Path, rows: int) -> None:
    """A Criteo TSV of ``rows`` valid rows."""
    rng = random.Random(0)
    data = []
    for _ in range(rows):
        row = [str(rng.randint(0, 1))] + [str(rng.randint(0, 1000)) for _ in range(13)]
        row += ["%08x" % rng.randrange(2**32) for _ in range(26)]
        data.append(row)
    with open(path, "w", newline="") as f:
        csv.writer(f, delimiter="\t").writerows(data)
