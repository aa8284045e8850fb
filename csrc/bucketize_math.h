// recpipe: routing math shared by the CPU (.cpp) and CUDA (.cu) kernels.
//
// Everything that decides *where a key goes* lives here, once, as
// host/device inline functions, so the CPU kernel (the reference that runs in
// CI) and the CUDA kernel (compiled in CI, run only where a GPU exists) cannot
// drift apart:
//
//   * FastDivU64        : unsigned 64-bit division by a runtime constant
//                         (Granlund-Montgomery / Hacker's Delight 10-8 "round
//                         up" method with a 65-bit magic), used for id / block
//                         and h / W on the hot path.
//   * FastDivU32        : the same method for 32-bit dividends (33-bit magic),
//                         the form SIMD lanes use for h / W when h < 2^32.
//   * HashPermutation   : a seeded bijection of [0, N): two keyed c-bit
//                         xorshift-multiply permutations (c = floor(log2 N))
//                         on two overlapping windows that cover [0, N), no
//                         cycle-walking; and its inverse.
//   * route_*           : owner rank and local id for the three distribution
//                         types (continuous, roundrobin, hash_roundrobin).
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define RECPIPE_HD __host__ __device__ __forceinline__
#define RECPIPE_UNROLL _Pragma("unroll")
#else
#define RECPIPE_HD inline
#define RECPIPE_UNROLL
#endif

namespace recpipe {

// Distribution types, as stored in the `dist_types` tensor.
enum DistType : int64_t {
  kContinuous = 0,
  kRoundRobin = 1,
  kHashRoundRobin = 2,
};

RECPIPE_HD uint64_t mulhi_u64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return static_cast<uint64_t>(
      (static_cast<unsigned __int128>(a) * static_cast<unsigned __int128>(b)) >>
      64);
#endif
}

// Number of bits needed to represent x (0 for x == 0).
RECPIPE_HD int bit_width_u64(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return x == 0 ? 0 : 64 - __clzll(static_cast<long long>(x));
#else
  return x == 0 ? 0 : 64 - __builtin_clzll(x);
#endif
}

// Unsigned division n / d for a divisor d >= 1 fixed at construction.
// q = (t + ((n - t) >> 1)) >> (l - 1), t = mulhi(m, n),
// l = ceil(log2 d), m = floor(2^64 * (2^l - d) / d) + 1 (Hacker's Delight 10-8).
// Exact for every 64-bit n; d == 1 is special-cased (l == 0).
struct FastDivU64 {
  uint64_t d;
  uint64_t magic;
  int shift;  // l - 1, or -1 for d == 1

  RECPIPE_HD FastDivU64() : d(1), magic(0), shift(-1) {}

  // Host-only construction (uses 128-bit division).
  explicit FastDivU64(uint64_t divisor) : d(divisor), magic(0), shift(-1) {
    if (divisor <= 1) {
      d = 1;
      return;
    }
    const int l = bit_width_u64(divisor - 1);  // ceil(log2 d), 1..64
    const unsigned __int128 two_l = static_cast<unsigned __int128>(1) << l;
    const unsigned __int128 num = (two_l - divisor) << 64;
    magic = static_cast<uint64_t>(num / divisor) + 1;
    shift = l - 1;
  }

  RECPIPE_HD uint64_t div(uint64_t n) const {
    if (shift < 0) {
      return n;
    }
    const uint64_t t = mulhi_u64(magic, n);
    return (t + ((n - t) >> 1)) >> shift;
  }
};

// Unsigned division n / d of 32-bit n by a 32-bit divisor d >= 1 fixed at
// construction: the same Hacker's Delight 10-8 method as FastDivU64 with a
// 33-bit magic, so every step stays within 32 bits (t = mulhi32(magic, n)) and
// maps onto SIMD 32x32->64 multiplies (x86 pmuludq, CUDA __umulhi). Exact for
// every 32-bit n. Powers of two (d == 1 included) are a shift.
struct FastDivU32 {
  uint32_t d;
  uint32_t magic;  // 0 for powers of two
  int shift;       // log2(d) for powers of two, else ceil(log2 d) - 1
  bool pow2;

  RECPIPE_HD FastDivU32() : d(1), magic(0), shift(0), pow2(true) {}

  RECPIPE_HD explicit FastDivU32(uint32_t divisor) : d(divisor), magic(0), shift(0), pow2(true) {
    if (divisor <= 1) {
      d = 1;
      return;
    }
    const int l = bit_width_u64(divisor - 1);  // ceil(log2 d), 1..32
    if ((divisor & (divisor - 1)) == 0) {
      shift = l;
      return;
    }
    pow2 = false;
    // (2^l - d) < d <= 2^32, so the numerator fits in 64 bits.
    magic = static_cast<uint32_t>(((((1ULL << l) - divisor)) << 32) / divisor + 1);
    shift = l - 1;
  }

  RECPIPE_HD uint32_t div(uint32_t n) const {
    if (pow2) {
      return n >> shift;
    }
    const uint32_t t = static_cast<uint32_t>((static_cast<uint64_t>(magic) * n) >> 32);
    return (t + ((n - t) >> 1)) >> shift;
  }
};

// splitmix64 step: derives round keys from the user seed.
RECPIPE_HD uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Salt that separates the routing hash from any storage hash that uses the same
// user seed (the tiered storage derives its own keys with a different salt).
constexpr uint64_t kRoutingSalt = 0x7265637069706531ULL;  // "recpipe1"

// Inverse of an odd a modulo 2^64 (Newton iteration, 6 steps double the bits).
RECPIPE_HD uint64_t inverse_odd_u64(uint64_t a) {
  uint64_t x = a;  // correct to 3 bits for odd a
  for (int i = 0; i < 6; ++i) {
    x *= 2 - a * x;
  }
  return x;
}

// Version of the hash_roundrobin routing H below, recorded in checkpoints
// (exported as recpipe._C.ROUTING_VERSION). 1: one permutation of [0, 2^ceil(log2 n))
// with cycle-walking (until 2026-11); 2: the two-window form below.
constexpr int kRoutingVersion = 2;

// A seeded bijection H of [0, n), n >= 1, with no cycle-walking.
//
// Let c = floor(log2 n) and h = 2^c, so n / 2 < h <= n. P_0 and P_1 are two
// independently keyed permutations of the c-bit space [0, h), each kRounds
// xorshift-multiply rounds (every step invertible mod 2^c, m_r odd, s >= 1):
//   x = (x + k_r) & mask; x ^= x >> s; x = (x * m_r) & mask; x ^= x >> s
// H permutes the window [0, h) by P_0, then the window [n - h, n) by P_1:
//   y    = x < h      ? P_0(x)                        : x
//   H(x) = y >= n - h ? (n - h) + P_1(y - (n - h))    : y   (n == h: H = P_0)
// Each step permutes its window and fixes the rest, so H is a bijection of
// [0, n); the windows cover [0, n) because n - h <= h. Every id passes
// through at least one full permutation (two rounds, two multiplies, as in
// murmur3's fmix64: aliased ids spread evenly, tests check max/mean <= 1.05),
// and every id costs the same two window steps: no data-dependent walk, so
// SIMD lanes and GPU threads never diverge. The inverse undoes the steps in
// reverse order.
struct HashPermutation {
  static constexpr int kRounds = 2;   // rounds of each window permutation
  static constexpr int kWindows = 2;  // P_0 on [0, h), P_1 on [n - h, n)
  uint64_t n;
  uint64_t mask;  // h - 1 (c bits)
  uint64_t hi;    // n - h: start of P_1's window; 0 when n is a power of two
  int s;          // xorshift distance, ceil(c / 2) (at least 1)
  uint64_t add[kWindows][kRounds];
  uint64_t mul[kWindows][kRounds];
  uint64_t mul_inv[kWindows][kRounds];

  RECPIPE_HD HashPermutation() : n(1), mask(0), hi(0), s(1) {
    for (int w = 0; w < kWindows; ++w) {
      for (int r = 0; r < kRounds; ++r) {
        add[w][r] = 0;
        mul[w][r] = 1;
        mul_inv[w][r] = 1;
      }
    }
  }

  RECPIPE_HD HashPermutation(uint64_t table_size, uint64_t seed) {
    n = table_size == 0 ? 1 : table_size;
    const int c = bit_width_u64(n) - 1;  // floor(log2 n), 0..63
    mask = (1ULL << c) - 1;
    hi = n - (1ULL << c);
    s = (c + 1) / 2;
    if (s < 1) {
      s = 1;
    }
    uint64_t state = seed ^ kRoutingSalt;
    for (int w = 0; w < kWindows; ++w) {
      for (int r = 0; r < kRounds; ++r) {
        add[w][r] = splitmix64(state) & mask;
        mul[w][r] = splitmix64(state) | 1ULL;
        mul_inv[w][r] = inverse_odd_u64(mul[w][r]);
      }
    }
  }

  RECPIPE_HD uint64_t unshift(uint64_t y) const {
    // Inverse of y = x ^ (x >> s) on c bits: x = y ^ (y >> s) ^ (y >> 2s) ...
    uint64_t x = y;
    for (int k = s; k < 64; k += s) {
      x ^= y >> k;
    }
    return x & mask;
  }

  // P_w(x) for x in [0, h).
  RECPIPE_HD uint64_t perm_fwd(int w, uint64_t x) const {
RECPIPE_UNROLL
    for (int r = 0; r < kRounds; ++r) {
      x = (x + add[w][r]) & mask;
      x ^= x >> s;
      x = (x * mul[w][r]) & mask;
      x ^= x >> s;
    }
    return x;
  }

  // P_w^-1(y) for y in [0, h).
  RECPIPE_HD uint64_t perm_inv(int w, uint64_t x) const {
RECPIPE_UNROLL
    for (int r = kRounds - 1; r >= 0; --r) {
      x = unshift(x);
      x = (x * mul_inv[w][r]) & mask;
      x = unshift(x);
      x = (x - add[w][r]) & mask;
    }
    return x;
  }

  // H(x) for x in [0, n).
  RECPIPE_HD uint64_t forward(uint64_t x) const {
    if (x <= mask) {
      x = perm_fwd(0, x);
    }
    if (hi != 0 && x >= hi) {
      x = hi + perm_fwd(1, x - hi);
    }
    return x;
  }

  // H^-1(y) for y in [0, n).
  RECPIPE_HD uint64_t inverse(uint64_t y) const {
    if (hi != 0 && y >= hi) {
      y = hi + perm_inv(1, y - hi);
    }
    if (y <= mask) {
      y = perm_inv(0, y);
    }
    return y;
  }
};

// ---------------------------------------------------------------------------
// Routing of one id. `uid` is the id reinterpreted as unsigned of the index
// width (fbgemm's convention: raw negative ids become large unsigned values).

// continuous (fbgemm-compatible): ids below block * W go to id / block with
// local id % block; others to id % W with local id / W.
template <typename uindex_t>
RECPIPE_HD void route_continuous(
    uindex_t uid,
    uint64_t block,
    uint64_t world,
    const FastDivU64& div_block,
    const FastDivU64& div_world,
    uint64_t* owner,
    uindex_t* local) {
  const uint64_t id = static_cast<uint64_t>(uid);
  // block * world computed in the index width, as fbgemm does.
  const uindex_t ub = static_cast<uindex_t>(block * world);
  if (uid < ub) {
    const uint64_t q = div_block.div(id);
    *owner = q;
    *local = static_cast<uindex_t>(id - q * block);
  } else {
    const uint64_t q = div_world.div(id);
    *owner = id - q * world;
    *local = static_cast<uindex_t>(q);
  }
}

// roundrobin: owner = id % W, local = id / W.
template <typename uindex_t>
RECPIPE_HD void route_roundrobin(
    uindex_t uid,
    uint64_t world,
    const FastDivU64& div_world,
    uint64_t* owner,
    uindex_t* local) {
  const uint64_t id = static_cast<uint64_t>(uid);
  const uint64_t q = div_world.div(id);
  *owner = id - q * world;
  *local = static_cast<uindex_t>(q);
}

// hash_roundrobin: h = H(id), owner = h % W, local = h / W. Caller checks
// 0 <= id < n.
template <typename uindex_t>
RECPIPE_HD void route_hash_roundrobin(
    uindex_t uid,
    uint64_t world,
    const FastDivU64& div_world,
    const HashPermutation& perm,
    uint64_t* owner,
    uindex_t* local) {
  const uint64_t h = perm.forward(static_cast<uint64_t>(uid));
  const uint64_t q = div_world.div(h);
  *owner = h - q * world;
  *local = static_cast<uindex_t>(q);
}

// Whether (rank, local) is a slot of a table of n >= 1 rows routed by
// roundrobin / hash_roundrobin over w >= 1 ranks, i.e. local * w + rank < n,
// decided without forming local * w (which overflows for huge local ids).
RECPIPE_HD bool is_roundrobin_slot(int64_t rank, int64_t local, int64_t n, int64_t w) {
  return rank >= 0 && rank < w && rank < n && local >= 0 && local <= (n - 1 - rank) / w;
}

// Owner rank and local id of one id of a table of n rows over w ranks, for the
// three distribution types (continuous blocks of ceil(n / w) rows). The caller
// checks 0 <= id < n. One function for the route_ids op (CPU and CUDA) and the
// tiered storage's split (hash_roundrobin with w = 1).
struct TableRoute {
  int64_t dist;
  uint64_t world;
  uint64_t block;
  FastDivU64 div_block;
  FastDivU64 div_world;
  HashPermutation perm;

  TableRoute(int64_t dist_type, uint64_t n, uint64_t w, uint64_t seed)
      : dist(dist_type),
        world(w),
        block((n + w - 1) / w > 0 ? (n + w - 1) / w : 1),
        div_block(FastDivU64((n + w - 1) / w > 0 ? (n + w - 1) / w : 1)),
        div_world(FastDivU64(w)),
        perm(n, seed) {}

  RECPIPE_HD void route(uint64_t id, uint64_t* owner, uint64_t* local) const {
    if (dist == kContinuous) {
      route_continuous<uint64_t>(id, block, world, div_block, div_world, owner, local);
    } else if (dist == kRoundRobin) {
      route_roundrobin<uint64_t>(id, world, div_world, owner, local);
    } else {
      route_hash_roundrobin<uint64_t>(id, world, div_world, perm, owner, local);
    }
  }
};

}  // namespace recpipe
