"""Pure-Python reference of recpipe's routing (the spec the kernels must meet).

Written from the documented math, not from the C++: plain Python integers,
one id at a time, no tensors on the hot path. Used by the op tests and by the
tiered-storage tests as the independent oracle.
"""

from __future__ import annotations

from typing import Optional, Sequence

M64 = (1 << 64) - 1
ROUTING_SALT = 0x7265637069706531  # "recpipe1", csrc/bucketize_math.h kRoutingSalt
ROUNDS = 2  # rounds of each window permutation
WINDOWS = 2  # P_0 on [0, h), P_1 on [n - h, n)
ROUTING_VERSION = 2  # the version of H this reference implements (RefPermutation)
DIST_CODES = {"continuous": 0, "roundrobin": 1, "hash_roundrobin": 2}  # route_one's dist_type
RAW_KEYS = 1 << 64  # the ids of a hash_roundrobin table of size 0 (raw keys): all of [0, 2^64)


def _splitmix64(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


class RefPermutation:
    """Seeded bijection of [0, n) (routing version 2): with h = 2^floor(log2 n),
    a keyed c-bit xorshift-multiply permutation P_0 of the window [0, h), then an
    independently keyed P_1 of the window [n - h, n) (skipped when n == h).

    n runs from 1 to 2^64 (``RAW_KEYS``, the raw-key space of table size 0: c = 64,
    one window, shift 32); Python ints, so no width special case."""

    def __init__(self, n: int, seed: int) -> None:
        assert n <= RAW_KEYS
        self.n = max(1, n)
        c = self.n.bit_length() - 1  # floor(log2 n)
        self.h = 1 << c
        self.hi = self.n - self.h
        self.mask = self.h - 1
        self.bits = c
        self.s = max(1, (c + 1) // 2)
        state = (seed & M64) ^ ROUTING_SALT
        self.add: list[list[int]] = []
        self.mul: list[list[int]] = []
        for _ in range(WINDOWS):
            adds, muls = [], []
            for _ in range(ROUNDS):
                state, a = _splitmix64(state)
                state, m = _splitmix64(state)
                adds.append(a & self.mask)
                muls.append(m | 1)
            self.add.append(adds)
            self.mul.append(muls)

    def _p(self, k: int, x: int) -> int:
        for r in range(ROUNDS):
            x = (x + self.add[k][r]) % self.h
            x ^= x >> self.s
            x = (x * self.mul[k][r]) % self.h
            x ^= x >> self.s
        return x

    def _p_inv(self, k: int, y: int) -> int:
        for r in reversed(range(ROUNDS)):
            y = self._unshift(y)
            y = (y * pow(self.mul[k][r], -1, 1 << 64)) % self.h
            y = self._unshift(y)
            y = (y - self.add[k][r]) % self.h
        return y

    def _unshift(self, y: int) -> int:
        # invert y = x ^ (x >> s) bit by bit from the top
        x = 0
        for bit in reversed(range(self.bits)):
            above = (x >> (bit + self.s)) & 1 if bit + self.s < self.bits else 0
            x |= (((y >> bit) & 1) ^ above) << bit
        return x

    def forward(self, x: int) -> int:
        assert 0 <= x < self.n
        if x < self.h:
            x = self._p(0, x)
        if self.hi > 0 and x >= self.hi:
            x = self.hi + self._p(1, x - self.hi)
        return x

    def inverse(self, y: int) -> int:
        assert 0 <= y < self.n
        if self.hi > 0 and y >= self.hi:
            y = self.hi + self._p_inv(1, y - self.hi)
        if y < self.h:
            y = self._p_inv(0, y)
        return y


def route_one(
    raw_id: int, dist_type: int, world: int, block: int, table_size: int, seed: int, index_bits: int
) -> tuple[int, int]:
    """(owner, local) of one id; ``index_bits`` is 32 or 64 (the ids' dtype)."""
    umask = (1 << index_bits) - 1
    uid = raw_id & umask  # fbgemm's unsigned reinterpretation of raw ids
    if dist_type == 0:
        ub = (block * world) & umask
        if uid < ub:
            return uid // block, uid % block
        return uid % world, uid // world
    if dist_type == 1:
        return uid % world, uid // world
    if dist_type == 2:
        if table_size == 0:  # raw keys: H of [0, 2^64), every id valid
            h = RefPermutation(RAW_KEYS, seed).forward(uid)
            return h % world, h // world
        if raw_id < 0 or raw_id >= table_size:
            raise ValueError(f"id {raw_id} outside [0, {table_size})")
        h = RefPermutation(table_size, seed).forward(raw_id)
        return h % world, h // world
    raise ValueError(f"dist_type {dist_type}")


def route_bad_one(raw_id: int, world: int, table_size: int, index_bits: int) -> tuple[int, int]:
    """(owner, local) of an id outside its roundrobin / hash_roundrobin table of
    ``table_size`` rows, with ``route_bad_ids``: as torchrec's row-wise routing sends an
    id past a table (rank ``u % W``, local ``u // W``, ``u`` the id read unsigned), to a
    rank that holds rows of the table and a local id at least its number of rows."""
    uid = raw_id & ((1 << index_bits) - 1)

    def rows_of(rank: int) -> int:  # rows of the table on `rank`: #{l >= 0 : l * W + rank < n}
        return max(0, -(-(table_size - rank) // world))

    owner = uid % world
    if rows_of(owner) == 0:  # table_size < W: ranks >= table_size hold no rows
        owner %= table_size
    assert rows_of(owner) > 0
    return owner, max(uid // world, rows_of(owner))


def ref_bucketize(
    lengths: Sequence[int],
    indices: Sequence[int],
    block_sizes: Sequence[int],
    dist_types: Sequence[int],
    world: int,
    *,
    sequence: bool = False,
    bucketize_pos: bool = False,
    weights: Optional[Sequence[float]] = None,
    table_sizes: Optional[Sequence[int]] = None,
    seed: int = 0,
    keep_orig_idx: bool = False,
    index_bits: int = 64,
    batch_size_per_feature: Optional[Sequence[int]] = None,
    keep_orig_idx_per_feature: Optional[Sequence[bool]] = None,
    return_bucket_mapping: bool = False,
    route_bad_ids: bool = False,
) -> dict[str, Optional[list]]:
    """Reference outputs as Python lists, fbgemm's layout (rank, feature, sample).

    ``weights`` may be per-id values or per-id rows (lists); ``batch_size_per_feature``
    gives each feature's number of bags (variable batch), else all features have
    ``len(lengths) // F``.
    """
    F = len(dist_types)
    FB = len(lengths)
    batch = list(batch_size_per_feature) if batch_size_per_feature is not None else [FB // F if F else 0] * F
    feature_of_bag = [f for f in range(F) for _ in range(batch[f])]
    assert len(feature_of_bag) == FB
    perms: dict[int, RefPermutation] = {}
    # buckets[rank][bag] = list of (local, weight, pos, input_index)
    buckets: list[list[list[tuple[int, Optional[float], int, int]]]] = [[[] for _ in range(FB)] for _ in range(world)]
    mapping: list[int] = []
    i = 0
    for bt in range(FB):
        f = feature_of_bag[bt]
        keep = keep_orig_idx_per_feature[f] if keep_orig_idx_per_feature is not None else keep_orig_idx
        for j in range(lengths[bt]):
            raw = indices[i]
            ts = table_sizes[f] if table_sizes is not None else 0
            if dist_types[f] != 0 and ts > 0 and not 0 <= raw < ts:
                if not route_bad_ids:
                    raise ValueError(f"id {raw} outside [0, {ts})")
                owner, local = route_bad_one(raw, world, ts, index_bits)
            elif dist_types[f] == 2:
                perm = perms.setdefault(f, RefPermutation(ts or RAW_KEYS, seed))  # 0: raw keys
                if ts > 0 and (raw < 0 or raw >= ts):
                    raise ValueError(f"id {raw} outside [0, {ts})")
                h = perm.forward(raw & ((1 << index_bits) - 1))
                owner, local = h % world, h // world
            else:
                owner, local = route_one(raw, dist_types[f], world, block_sizes[f], ts, seed, index_bits)
            if keep:
                local = raw
            else:
                # back to the signed index dtype, as the kernel stores it
                if local >= 1 << (index_bits - 1):
                    local -= 1 << index_bits
            w = weights[i] if weights is not None else None
            buckets[owner][bt].append((local, w, j, i))
            mapping.append(owner)
            i += 1
    new_lengths: list[int] = []
    new_indices: list[int] = []
    new_weights: list[float] = []
    new_pos: list[int] = []
    permute = [0] * len(indices)
    for r in range(world):
        for bt in range(FB):
            new_lengths.append(len(buckets[r][bt]))
            for local, w, j, src in buckets[r][bt]:
                permute[src] = len(new_indices)
                new_indices.append(local)
                new_weights.append(w)  # type: ignore[arg-type]
                new_pos.append(j)
    return {
        "new_lengths": new_lengths,
        "new_indices": new_indices,
        "new_weights": new_weights if weights is not None else None,
        "new_pos": new_pos if bucketize_pos else None,
        "unbucketize_permute": permute if sequence else None,
        "bucket_mapping": mapping if return_bucket_mapping else None,
    }
