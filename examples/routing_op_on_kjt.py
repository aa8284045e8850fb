"""Route the ids of a KeyedJaggedTensor to their owner ranks with recpipe's routing op.

A table of 10 rows is sharded row-wise over 2 ranks. Three features look up ids 0..9 (two bags
of five) and differ only in their dist type, the rule that assigns each id an owner rank:
continuous (blocks of ceil(rows / W) rows, fbgemm's rule), roundrobin (owner ``id % W``) and
hash_roundrobin (roundrobin over a seeded bijection of the table's ids, so that aliased id
patterns still spread evenly). Prints, per dist type and rank, the ids that rank receives and
the rows of its shard they address; the hash_roundrobin ids are recovered from their ranks and
rows by the inverse, ``hash_roundrobin_global_ids``.

Run: python examples/routing_op_on_kjt.py
"""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.pipeline import bucketize_kjt, hash_roundrobin_global_ids

WORLD_SIZE, ROWS, SEED = 2, 10, 0
FEATURES = ("continuous", "roundrobin", "hash_roundrobin")  # each feature is named after its dist type


def main() -> None:
    ids = torch.arange(ROWS)
    lengths = torch.tensor([5, 5] * len(FEATURES))  # two bags per feature: ids 0..4 and 5..9
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(FEATURES), values=ids.repeat(len(FEATURES)), lengths=lengths)
    dist_types, table_sizes = {f: f for f in FEATURES}, {f: ROWS for f in FEATURES}
    # keys of the result: FEATURES once per rank (rank-major); values: each id's row on its owner
    by_rank, _ = bucketize_kjt(kjt, WORLD_SIZE, dist_types, table_sizes, seed=SEED)
    # the same routing, keeping the ids as they came (what each rank is sent)
    sent, _ = bucketize_kjt(kjt, WORLD_SIZE, dist_types, table_sizes, seed=SEED, keep_orig_idx=True)
    rows_of = by_rank.values().split(by_rank.length_per_key())
    ids_of = sent.values().split(sent.length_per_key())
    for f, name in enumerate(FEATURES):
        for rank in range(WORLD_SIZE):
            slot = rank * len(FEATURES) + f
            print(f"{name:>15} rank {rank}: ids {ids_of[slot].tolist()} -> rows {rows_of[slot].tolist()}")
    hashed = [len(FEATURES) * r + FEATURES.index("hash_roundrobin") for r in range(WORLD_SIZE)]
    ranks = torch.cat([torch.full_like(rows_of[s], r) for r, s in enumerate(hashed)])
    global_ids = hash_roundrobin_global_ids(ranks, torch.cat([rows_of[s] for s in hashed]), ROWS, WORLD_SIZE, SEED)
    print(f"hash_roundrobin (rank, row) -> id: {global_ids.tolist()}")


if __name__ == "__main__":
    main()
