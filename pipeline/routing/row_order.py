"""Row order of routed FUSED tables: the state_dict record, its description, the refusal of a mismatch.

May import ``recpipe.pipeline.placement`` and routing modules only.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, NamedTuple

import torch

from recpipe.pipeline.placement import local_rows
from recpipe.pipeline.routing.ops import ROUTING_VERSION
from recpipe.pipeline.routing.rows import global_row_ids

__all__ = ["ROW_ORDER_KEY", "RowOrder", "RowOrderMismatchError", "describe_row_order", "row_order_refusal"]


#: state_dict key suffix of a :class:`RowOrder` record, beside ``<collection>.<table>.weight``.
ROW_ORDER_KEY: str = "row_order"


class RowOrderMismatchError(ValueError):
    """A sharded weight saved in another row order than the routed table it is loaded into."""


class RowOrder(NamedTuple):
    """Which global rows a roundrobin / hash_roundrobin FUSED table's shards hold. Such a table keeps rank ``r``'s rows
    in local-id order while its ShardedTensor offsets name contiguous rows, so its ``state_dict()`` records this and a
    load checks it. ``routing_seed`` is 0 for roundrobin."""

    dist_type: str
    world_size: int
    routing_seed: int
    num_embeddings: int

    def record(self) -> Dict[str, Any]:
        """The state_dict record: these fields and ``routing_version`` (plain Python values)."""
        return {**self._asdict(), "routing_version": ROUTING_VERSION}

    def global_ids(self, rank: int) -> torch.Tensor:
        """int64 global ids of rank ``rank``'s rows, in local-id order."""
        local = torch.arange(local_rows(self.num_embeddings, self.world_size, rank), dtype=torch.int64)
        return global_row_ids(local, self.num_embeddings, self.world_size, rank, self.dist_type, self.routing_seed)


def describe_row_order(record: Any) -> str:
    """A :meth:`RowOrder.record` (or None: contiguous rows) in words, for errors."""
    if record is None:
        return "contiguous row blocks (torchrec's row-wise layout, a continuous table, or an older recpipe)"
    if not isinstance(record, Mapping):
        return f"an unreadable row-order record {record!r}"
    fields = ", ".join(f"{k}={record.get(k)!r}" for k in (*RowOrder._fields, "routing_version"))
    return f"rows routed with {fields}"


def row_order_refusal(where: str, problems: List[str], after: str = "") -> RowOrderMismatchError:
    """The refusal of sharded weights saved in another row order (``problems``: one line per table)."""
    return RowOrderMismatchError(
        f"{where}: the rows of a roundrobin / hash_roundrobin table are kept in routed order, so a sharded "
        "weight loads only into the same routing: " + "; ".join(problems) + ". Loading it would put rows "
        "on other ids. Possible solutions:\n"
        "  1. shard these tables as the state was saved (the same table_dist_types= / placement plan, world "
        "size and seed);\n"
        "  2. move the rows as full tables: in a job sharded as the state was saved, load it and call "
        "full = recpipe.pipeline.tiered.migration.gather_full_weights(model) on every rank (torch.save(full) there), "
        "then model.load_state_dict(full, strict=False) here: full tables load by global row id into any "
        "routing, world size or kernel (the tables' optimizer state is not moved)." + after
    )
