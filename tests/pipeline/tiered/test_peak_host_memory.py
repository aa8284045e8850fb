"""Peak host memory of the routing helpers and tiered loads, probed in a fresh process.

Each probe runs in its own interpreter and reports how far the process's peak RSS
(``ru_maxrss``) rose during the call under test, over the peak reached while its
inputs were built. Routing is O(n) and a tiered load O(N / W) per rank: the bounds
below sit far under what a W x n / O(N) implementation needs (quoted per test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

MIB = 2**20

_PRELUDE = """
import json, resource, torch
torch.set_num_threads(1)
def peak_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
"""


def _probe(body: str) -> dict:
    code = _PRELUDE + textwrap.dedent(body)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_route_ids_memory_is_linear_in_ids() -> None:
    """4M ids at W = 128: owner + local are 64 MiB; a W x n length matrix would be 4 GiB."""
    res = _probe("""
        from recpipe.pipeline.routing import ops
        ids = torch.randint(0, 10**9, (4_000_000,))
        ops.route_ids(ids[:10], 10**9, 128, "hash_roundrobin", 3)  # load the op
        before = peak_bytes()
        owner, local = ops.route_ids(ids, 10**9, 128, "hash_roundrobin", 3)
        print(json.dumps({"rise": peak_bytes() - before, "max_owner": int(owner.max())}))
    """)
    assert res["max_owner"] == 127
    assert res["rise"] < 160 * MIB, f"route_ids of 4M ids raised peak RSS by {res['rise'] / MIB:.0f} MiB"


def test_tiered_load_memory_is_per_shard() -> None:
    """Rank 0 of 64 loads its rows of a 4M-row, dim-8 table from one W = 1 export
    (128 MiB of rows): it keeps ~62k rows; concatenating every export would add 128 MiB,
    routing through a W x N length matrix 2 GiB."""
    res = _probe("""
        from recpipe.pipeline.tiered.shard import TieredEmbeddingShard
        from recpipe.pipeline.tiered.state import TieredShardState
        N, D, W = 4_000_000, 8, 64
        shard = TieredEmbeddingShard(num_embeddings=N, embedding_dim=D, mode="HYBRID", cache_load_factor=0.5,
                                     rank=0, world_size=W, dist_type="roundrobin")
        md = dict(shard.metadata(), world_size=1, rank=0, num_rows=N)
        gids = torch.arange(N)
        state = TieredShardState(global_ids=gids, weights=gids.to(torch.float32).unsqueeze(1).expand(N, D).contiguous(),
                                 optimizer_state=torch.empty(N, 0), step=3, metadata=md)
        before = peak_bytes()
        shard.load_states([state])
        rise = peak_bytes() - before
        exported = shard.export_state()
        ok = bool(torch.equal(exported.weights[:, 0], exported.global_ids.to(torch.float32)))
        print(json.dumps({"rise": rise, "rows": shard.num_rows, "ok": ok, "step": shard.step}))
    """)
    assert res["ok"] and res["rows"] == 62_500 and res["step"] == 3
    assert res["rise"] < 96 * MIB, f"loading one shard of 64 raised peak RSS by {res['rise'] / MIB:.0f} MiB"
