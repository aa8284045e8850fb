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
//   * HashPermutation   : a seeded bijection of [0, N) built from b-bit
//                         xorshift-multiply rounds (b = ceil(log2 N)) with
//                         cycle-walking, and its inverse.
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

// A seeded bijection H of [0, n), n >= 1.
//
// On the b-bit space [0, 2^b), b = max(1, ceil(log2 n)), one round is
//   x = (x + k_r) & mask; x ^= x >> s; x = (x * m_r) & mask; x ^= x >> s
// (every step is invertible mod 2^b, m_r odd, 1 <= s). kRounds rounds form a
// permutation P of [0, 2^b); cycle-walking (apply P until the value is < n)
// restricts it to a permutation of [0, n). Since 2^b < 2n, the expected walk
// is below 2 applications of P. Two rounds (two multiplies, as in murmur3's
// fmix64) already spread aliased ids evenly (tests: max/mean <= 1.05).
struct HashPermutation {
  static constexpr int kRounds = 2;
  uint64_t n;
  uint64_t mask;
  int s;
  uint64_t add[kRounds];
  uint64_t mul[kRounds];
  uint64_t mul_inv[kRounds];

  RECPIPE_HD HashPermutation() : n(1), mask(1), s(1) {
    for (int r = 0; r < kRounds; ++r) {
      add[r] = 0;
      mul[r] = 1;
      mul_inv[r] = 1;
    }
  }

  RECPIPE_HD HashPermutation(uint64_t table_size, uint64_t seed) {
    n = table_size == 0 ? 1 : table_size;
    int b = bit_width_u64(n - 1);
    if (b < 1) {
      b = 1;
    }
    mask = b >= 64 ? ~0ULL : ((1ULL << b) - 1);
    s = (b + 1) / 2;
    if (s < 1) {
      s = 1;
    }
    uint64_t state = seed ^ kRoutingSalt;
    for (int r = 0; r < kRounds; ++r) {
      add[r] = splitmix64(state) & mask;
      mul[r] = splitmix64(state) | 1ULL;
      mul_inv[r] = inverse_odd_u64(mul[r]);
    }
  }

  RECPIPE_HD uint64_t unshift(uint64_t y) const {
    // Inverse of y = x ^ (x >> s) on b bits: x = y ^ (y >> s) ^ (y >> 2s) ...
    uint64_t x = y;
    for (int k = s; k < 64; k += s) {
      x ^= y >> k;
    }
    return x & mask;
  }

  RECPIPE_HD uint64_t round_fwd(uint64_t x) const {
RECPIPE_UNROLL
    for (int r = 0; r < kRounds; ++r) {
      x = (x + add[r]) & mask;
      x ^= x >> s;
      x = (x * mul[r]) & mask;
      x ^= x >> s;
    }
    return x;
  }

  RECPIPE_HD uint64_t round_inv(uint64_t x) const {
RECPIPE_UNROLL
    for (int r = kRounds - 1; r >= 0; --r) {
      x = unshift(x);
      x = (x * mul_inv[r]) & mask;
      x = unshift(x);
      x = (x - add[r]) & mask;
    }
    return x;
  }

  // H(x) for x in [0, n).
  RECPIPE_HD uint64_t forward(uint64_t x) const {
    do {
      x = round_fwd(x);
    } while (x >= n);
    return x;
  }

  // H^-1(y) for y in [0, n).
  RECPIPE_HD uint64_t inverse(uint64_t y) const {
    do {
      y = round_inv(y);
    } while (y >= n);
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

}  // namespace recpipe
