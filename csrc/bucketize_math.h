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
//   * HashPermutation   : a seeded bijection of [0, N): two keyed c-bit
//                         xorshift-multiply permutations (c = floor(log2 N))
//                         on two overlapping windows that cover [0, N), no
//                         cycle-walking; and its inverse. N = 2^64 (table
//                         size 0: raw keys) is the one-window case c = 64.
//   * FeatureRoute      : owner rank and local id of one id of one feature for
//                         the three distribution types (continuous, with
//                         fbgemm's total_num_blocks and block_bucketize_pos;
//                         roundrobin; hash_roundrobin) and keep_orig_idx. The
//                         CPU kernel, the CUDA kernel and route_ids call
//                         FeatureRoute::route and nothing else.
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
// [0, n); the windows cover [0, n) because n - h <= h. Table size 0 stands for
// n = 2^64 (raw keys: every 64-bit value is an id): c = 64, h = n, so H = P_0 on
// the whole 64-bit space (mask = ~0, hi = 0, s = 32), the same rounds on 64-bit
// words; ROUTING_VERSION covers both forms. Every id passes
// through at least one full permutation (two rounds, two multiplies, as in
// murmur3's fmix64: aliased ids spread evenly, tests check max/mean <= 1.05),
// and every id costs the same two window steps: no data-dependent walk, so
// SIMD lanes and GPU threads never diverge. The inverse undoes the steps in
// reverse order.
struct HashPermutation {
  static constexpr int kRounds = 2;   // rounds of each window permutation
  static constexpr int kWindows = 2;  // P_0 on [0, h), P_1 on [n - h, n)
  uint64_t n;     // ids [0, n); 0 stands for 2^64 (raw keys)
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

  // table_size 0: n = 2^64 (raw keys), built apart since 1 << 64 is undefined.
  RECPIPE_HD HashPermutation(uint64_t table_size, uint64_t seed) {
    n = table_size;
    if (table_size == 0) {  // c = 64: h = 2^64 = n
      mask = ~0ULL;
      hi = 0;
      s = 32;
    } else {
      const int c = bit_width_u64(n) - 1;  // floor(log2 n), 0..63
      mask = (1ULL << c) - 1;
      hi = n - (1ULL << c);
      s = (c + 1) / 2;
      if (s < 1) {
        s = 1;
      }
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

  // P_w(x) for x in [0, h), computed in the unsigned type word_t. Every step
  // keeps the low c bits, and the low c bits of a sum or product depend only on
  // the low c bits of its operands, so every word_t of at least c bits gives the
  // same P_w (32-bit words: 16 SIMD lanes instead of 8, and a native multiply on
  // AVX2 and GPUs).
  template <typename word_t = uint64_t>
  RECPIPE_HD word_t perm_fwd(int w, word_t x) const {
    const word_t m = static_cast<word_t>(mask);
RECPIPE_UNROLL
    for (int r = 0; r < kRounds; ++r) {
      x = (x + static_cast<word_t>(add[w][r])) & m;
      x ^= x >> s;
      x = (x * static_cast<word_t>(mul[w][r])) & m;
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

  // Whether n - 1 fits in 32 bits: forward<uint32_t> is then H (and c <= 32).
  // False for raw keys (n = 0 stands for 2^64: n - 1 wraps to ~0).
  RECPIPE_HD bool fits_u32() const { return n - 1 <= 0xFFFFFFFFULL; }

  // H(x) for x in [0, n), in words of word_t, which must hold n - 1 (uint64_t
  // always does; uint32_t when fits_u32()). Both window steps are computed and
  // selected (no data-dependent branch: SIMD lanes, GPU threads and branch
  // predictors see the same work for every id).
  template <typename word_t = uint64_t>
  RECPIPE_HD word_t forward(word_t x) const {
    const word_t m = static_cast<word_t>(mask);
    const word_t top = static_cast<word_t>(hi);
    const word_t a = perm_fwd<word_t>(0, x & m);
    x = x <= m ? a : x;
    const word_t b = top + perm_fwd<word_t>(1, (x - top) & m);
    return top != 0 && x >= top ? b : x;
  }

  // H(x) in the narrowest word that holds n - 1 (the same value either way).
  RECPIPE_HD uint64_t forward_any(uint64_t x) const {
    return fits_u32() ? forward<uint32_t>(static_cast<uint32_t>(x)) : forward<uint64_t>(x);
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
// Routing of one id of one feature: the rules every kernel calls.
//
// An id is read as an unsigned value of the index width (fbgemm's convention: a
// raw negative id becomes a large unsigned value), widened to 64 bits; `mask`
// is the width's all-ones, for the products fbgemm forms in that width.
//
// continuous, G = num_blocks blocks of `block` rows (fbgemm's total_num_blocks;
// G = W by default) and L = G / W blocks per rank:
//   uid <  block * G :  owner = uid / (block * L),  local = uid % (block * L)
//   uid >= block * G :  owner = (uid % G) / L,       local = uid / G   (raw ids)
// continuous, uneven shards (fbgemm's block_bucketize_pos: bounds b[0..k) of the
// feature, b[0] = 0, non-decreasing): key = uid, or (uid % G) * b[k-1] / G when
// block == 0, and j = the last i with b[i] <= key;
//   j < W :  owner = j,        local = uid - b[j]
//   else  :  owner = uid % W,  local = uid / W
//   (block == 0: local = uid / G)
// roundrobin:       owner = uid % W,      local = uid / W  (uid < table_size if given)
// hash_roundrobin:  h = H(uid): owner = h % W, local = h / W  (uid < table_size;
//                   table_size 0: raw keys, H of the whole 64-bit range, every uid valid)
// A roundrobin / hash_roundrobin id outside [0, table_size) is refused, or with
// route_bad routed as fbgemm routes an id past a continuous table's blocks, so the
// owner's TBE applies its bounds_check_mode (torchrec's row-wise behaviour):
//   owner = uid % W, local = uid / W  (>= the owner's rows, as uid >= table_size);
//   an owner without rows (table_size < W) becomes owner % table_size, local >= 1.
// keep_orig: local = uid, whatever the rule.
struct FeatureRoute {
  int64_t dist;                    // DistType
  bool keep_orig;                  // local id = the id itself
  uint64_t mask;                   // all-ones of the index width
  uint64_t world;                  // W
  FastDivU64 div_world;
  uint64_t block;                  // rows per block (continuous)
  uint64_t in_blocks;              // block * G in the index width
  FastDivU64 div_rank_rows;        // / (block * L), in the index width
  FastDivU64 div_num_blocks;       // / G
  FastDivU64 div_blocks_per_rank;  // / L
  int64_t bounds_begin;            // this feature's bounds in the flat bounds array
  int64_t bounds_count;            // 0: uniform blocks
  uint64_t table_size;             // ids must be below it (0: unchecked; hash_roundrobin: raw keys)
  bool route_bad;                  // route ids >= table_size (see above) instead of refusing them
  HashPermutation perm;            // H of [0, table_size), of [0, 2^64) for 0 (hash_roundrobin)

  // Host-only construction from validated parameters (FastDivU64 divides 128-bit).
  static FeatureRoute make(int64_t dist, bool keep_orig, int index_bits, uint64_t world, uint64_t block,
                           uint64_t num_blocks, int64_t bounds_begin, int64_t bounds_count,
                           uint64_t table_size, uint64_t seed, bool route_bad = false) {
    FeatureRoute r;
    r.dist = dist;
    r.keep_orig = keep_orig;
    r.mask = index_bits >= 64 ? ~0ULL : (1ULL << index_bits) - 1;
    r.world = world;
    r.div_world = FastDivU64(world);
    r.block = block;
    r.in_blocks = (block * num_blocks) & r.mask;
    r.div_rank_rows = FastDivU64((block * (num_blocks / world)) & r.mask);
    r.div_num_blocks = FastDivU64(num_blocks);
    r.div_blocks_per_rank = FastDivU64(num_blocks / world);
    r.bounds_begin = bounds_begin;
    r.bounds_count = bounds_count;
    r.table_size = table_size;
    r.route_bad = route_bad;
    r.perm = dist == kHashRoundRobin ? HashPermutation(table_size, seed) : HashPermutation();
    return r;
  }

  // One table of n rows over w ranks, routed by `dist` (continuous: blocks of
  // ceil(n / w) rows): the routing of route_ids, checkpoints and tiered storage.
  static FeatureRoute for_table(int64_t dist, uint64_t n, uint64_t w, uint64_t seed) {
    const uint64_t block = (n + w - 1) / w > 0 ? (n + w - 1) / w : 1;
    return make(dist, false, 64, w, block, w, 0, 0, n, seed);
  }

  // Owner rank and local id of `uid`; false when the feature checks its ids
  // (table_size > 0, roundrobin / hash_roundrobin), uid is not below it and the
  // feature does not route such ids (route_bad).
  // kDist >= 0 fixes the rule at compile time (it must equal `dist`).
  template <int kDist = -1>
  RECPIPE_HD bool route(uint64_t uid, const int64_t* bounds, uint64_t* owner, uint64_t* local) const {
    const int64_t d = kDist >= 0 ? kDist : dist;
    return place<kDist>(uid, d == kHashRoundRobin ? perm.forward_any(uid) : uid, bounds, owner, local);
  }

  // route() given the value roundrobin splits, key = H(uid) for hash_roundrobin
  // (else uid), for callers that compute the keys of many ids at once (the CPU
  // kernel hashes a run of ids in one vectorizable loop).
  // kBounds >= 0 fixes at compile time whether a continuous feature has shard
  // bounds (it must equal bounds_count > 0).
  template <int kDist = -1, int kBounds = -1>
  RECPIPE_HD bool place(uint64_t uid, uint64_t key, const int64_t* bounds, uint64_t* owner, uint64_t* local) const {
    const int64_t d = kDist >= 0 ? kDist : dist;
    const bool has_bounds = kBounds >= 0 ? kBounds == 1 : bounds_count > 0;
    uint64_t p = 0;
    uint64_t l = 0;
    if (d == kContinuous) {
      if (has_bounds) {
        const int64_t* b = bounds + bounds_begin;
        const uint64_t last = static_cast<uint64_t>(b[bounds_count - 1]);
        const uint64_t q = block == 0 ? div_num_blocks.div(uid) : 0;  // uid / G, for block == 0
        const uint64_t at = block == 0 ? div_num_blocks.div(((uid - q * div_num_blocks.d) * last) & mask) : uid;
        // lo = upper_bound(b, b + count, at) - 1 (b[0] = 0 <= at): the answer stays in
        // [lo, lo + len); a select, not a branch, per halving.
        int64_t lo = 0;
        for (int64_t len = bounds_count; len > 1; len -= len / 2) {
          lo = static_cast<uint64_t>(b[lo + len / 2]) <= at ? lo + len / 2 : lo;
        }
        if (static_cast<uint64_t>(lo) < world) {
          p = static_cast<uint64_t>(lo);
          l = uid - static_cast<uint64_t>(b[lo]);
        } else {
          l = div_world.div(uid);
          p = uid - l * world;
        }
        if (block == 0) {
          l = q;
        }
      } else if (uid < in_blocks) {
        p = div_rank_rows.div(uid);
        l = uid - p * div_rank_rows.d;
      } else {
        l = div_num_blocks.div(uid);
        p = div_blocks_per_rank.div(uid - l * div_num_blocks.d);
      }
    } else {
      if (table_size != 0 && uid >= table_size) [[unlikely]] {
        if (!route_bad) {
          return false;
        }
        l = div_world.div(uid);
        p = uid - l * world;
        if (p >= table_size) {  // an owner without rows: one that holds some
          p %= table_size;
          l = l > 1 ? l : 1;
        }
      } else {
        l = div_world.div(key);
        p = key - l * world;
      }
    }
    *owner = p;
    *local = keep_orig ? uid : l;
    return true;
  }
};

// The outputs of one id i (its bag starts at input position i0) routed to rank p
// with local id l and placed at output slot `at`: stage 3 of the CPU and CUDA
// kernels. dest, pos and mapping are written when given.
template <typename index_t>
RECPIPE_HD void store_routed(int64_t at, int64_t i, int64_t i0, uint64_t p, uint64_t l, index_t* out,
                             index_t* dest, index_t* pos, index_t* mapping) {
  out[at] = static_cast<index_t>(l);
  if (dest != nullptr) {
    dest[i] = static_cast<index_t>(at);
  }
  if (pos != nullptr) {
    pos[at] = static_cast<index_t>(i - i0);
  }
  if (mapping != nullptr) {
    mapping[i] = static_cast<index_t>(p);
  }
}

// Whether (rank, local) is a slot of a table of n >= 1 rows routed by
// roundrobin / hash_roundrobin over w >= 1 ranks, i.e. local * w + rank < n,
// decided without forming local * w (which overflows for huge local ids).
// n == 0 is the raw-key space of 2^64 ids: local is read as unsigned (a local id
// of W = 1 past 2^63 - 1 is stored negative) and local * w + rank < 2^64.
RECPIPE_HD bool is_roundrobin_slot(int64_t rank, int64_t local, int64_t n, int64_t w) {
  if (n == 0) {
    return rank >= 0 && rank < w &&
           static_cast<uint64_t>(local) <= (~0ULL - static_cast<uint64_t>(rank)) / static_cast<uint64_t>(w);
  }
  return rank >= 0 && rank < w && rank < n && local >= 0 && local <= (n - 1 - rank) / w;
}

}  // namespace recpipe
