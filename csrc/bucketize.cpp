// recpipe: CPU kernels of the routing ops (schemas: library.cpp).
//
// block_bucketize_sparse_features splits every bag of a KJT's flat
// lengths/indices by owner rank. Output layout is fbgemm's: new_lengths is
// [W * F * B] ordered (rank, feature, sample); indices follow the same order;
// order inside a bag is preserved.
//
// CPU algorithm (two passes over the ids, no [W*F*B] offsets array):
//   1. owners: per chunk of bags (one chunk per thread), per block of bags and
//      per run of one feature, compute each id's owner rank (stored as
//      uint8/uint16/uint32 by W) in a tight loop (AVX-512 or AVX2 for
//      continuous / roundrobin ids below 2^32; hash_roundrobin always
//      vectorized, see below), then count new_lengths and per-(chunk, rank)
//      totals from the owners. hash_roundrobin keeps its local ids in a
//      scratch buffer (uint32 when every hashed table has <= 2^32 rows) so
//      the hash runs once.
//   2. scatter: rank-major output means an id's position is
//      base[rank] + (ids of that rank in earlier bags) + (earlier ids of that
//      rank in its bag); walking the ids in order with one cursor per rank,
//      started at base[rank] + totals of earlier chunks, yields it directly.
//      So each rank's output of a chunk is one contiguous stream and the pass
//      is a stable W-way partition of the chunk's ids.
// With W <= 8 the counts are popcounts per bag: of byte compares (AVX-512)
// or of the owner bytes' three bit planes (AVX2); with AVX-512 and W <= 8
// the scatter is vpcompress + masked store per rank (see "Small W" below).
// With AVX2, W = 2 and int64 ids both passes have their own path (see "W = 2
// on AVX2"): continuous / roundrobin owners are recomputed from the ids
// instead of stored, counts come from rank-1 bitmaps, and the scatter stores
// permute-packed whole vectors. Otherwise the scatter is scalar: for W <= 8
// one loop with the cursors' per-block offsets packed in a 64-bit register
// (see kPackedCursorMaxW), above that in blocks: every position of a block
// first, then its stores (see kScatterBlock).
// new_lengths is written with non-temporal stores.
//
// hash_roundrobin (H = HashPermutation, bucketize_math.h) runs in 32-bit
// lanes for tables of 2 to 2^32 rows: ids are range-checked, both window
// steps of H run on every lane (each kept where the lane lies in its window:
// no cycle-walking, no divergent lanes), then owner = h % W / local = h / W
// (shift or FastDivU32). Outputs are bit-identical on every path.
//
// SIMD paths and RECPIPE_SIMD: the hot loops exist as `scalar` (baseline
// x86-64, any CPU), `avx2` (target("avx2"): AVX2 intrinsics for the hash
// block, the int64 owners, the counts and the W = 2 path, the compiler's
// vectorization elsewhere) and `avx512` (AVX-512F/BW/DQ/VL intrinsics, 4
// independent vectors per step to hide vpmulld latency, owner/local split
// from the registers). The best one
// the CPU supports (__builtin_cpu_supports) is used; setting the
// environment variable RECPIPE_SIMD=scalar|avx2|avx512 (read on every call;
// `auto` or unset = best) forces one, e.g. for tests. Forcing a path the CPU
// lacks raises an error naming the best supported one. No global -m flags:
// the extension runs on any x86-64 (and non-x86 builds use `scalar`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "bucketize_math.h"
#include "checks.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace recpipe {
namespace {

using at::Tensor;

template <typename T>
struct Tag {
  using type = T;
};

// Instantiates fn(Tag<index_t>, Tag<offset_t>, Tag<owner_t>, Tag<wbits_t>):
// owner_t is the narrowest type that holds a rank < W; weights are moved as raw
// bits of their element size (2, 4 or 8 bytes), so fp16/bf16/fp32/fp64 share code.
template <typename Fn>
void template_dispatch(
    Fn&& fn,
    at::ScalarType index_type,
    at::ScalarType length_type,
    int64_t W,
    const std::optional<at::Tensor>& weights) {
  auto with_weights = [&](auto i, auto o, auto ow) {
    if (!weights.has_value()) {
      fn(i, o, ow, Tag<void>{});
      return;
    }
    switch (weights->element_size()) {
      case 2:
        fn(i, o, ow, Tag<uint16_t>{});
        break;
      case 4:
        fn(i, o, ow, Tag<uint32_t>{});
        break;
      default:
        fn(i, o, ow, Tag<uint64_t>{});
        break;
    }
  };
  auto with_owner = [&](auto i, auto o) {
    if (W <= 256) {
      with_weights(i, o, Tag<uint8_t>{});
    } else if (W <= 65536) {
      with_weights(i, o, Tag<uint16_t>{});
    } else {
      with_weights(i, o, Tag<uint32_t>{});
    }
  };
  auto with_offset = [&](auto i) {
    if (length_type == at::kInt) {
      with_owner(i, Tag<int32_t>{});
    } else {
      with_owner(i, Tag<int64_t>{});
    }
  };
  if (index_type == at::kInt) {
    with_offset(Tag<int32_t>{});
  } else {
    with_offset(Tag<int64_t>{});
  }
}

struct BadId {
  int64_t position = -1;  // flat index into `indices`, -1 if none
  int64_t feature = -1;
  int64_t value = 0;
};

// Runs fn(c) for every chunk c in [0, chunks) on `workers` threads that take
// chunks dynamically (one atomic counter), any order. Chunks write disjoint
// outputs, so the order does not change results.
template <typename Fn>
void for_each_chunk(int64_t workers, int64_t chunks, Fn&& fn) {
  if (workers <= 1 || chunks <= 1) {
    for (int64_t c = 0; c < chunks; ++c) {
      fn(c);
    }
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      fn(c);
    }
  });
}

// Splits [0, FB) into `chunks` contiguous ranges of bags with about equal id
// counts; returns chunks + 1 boundaries.
std::vector<int64_t> chunk_bags(
    const std::vector<int64_t>& offsets,
    int64_t FB,
    int64_t chunks) {
  std::vector<int64_t> bounds(chunks + 1, FB);
  bounds[0] = 0;
  const int64_t total = offsets[FB];
  for (int64_t c = 1; c < chunks; ++c) {
    const int64_t target = total * c / chunks;
    bounds[c] = std::lower_bound(offsets.begin(), offsets.begin() + FB + 1, target) -
        offsets.begin();
    bounds[c] = std::min(std::max(bounds[c], bounds[c - 1]), FB);
  }
  return bounds;
}

// ---------------------------------------------------------------------------
// SIMD dispatch. The hash_roundrobin hot path has three builds of one
// algorithm: `scalar` (baseline x86-64 / any CPU; the compiler may still use
// SSE2), `avx2` and `avx512` (hand-written intrinsics). The best one the CPU
// supports is used; the environment variable RECPIPE_SIMD=scalar|avx2|avx512
// (read on every call) forces one, so tests can check each path against the
// reference. Forcing a path the CPU lacks is an error, never a silent fallback.
enum class Simd : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RECPIPE_X86_SIMD 1
#define RECPIPE_TARGET_AVX2 __attribute__((target("avx2")))
#define RECPIPE_TARGET_AVX512 \
  __attribute__((target("avx2,avx512f,avx512bw,avx512dq,avx512vl")))
#else
#define RECPIPE_X86_SIMD 0
#endif

Simd best_simd() {
#if RECPIPE_X86_SIMD
  static const Simd best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
      return Simd::kAvx512;
    }
    return __builtin_cpu_supports("avx2") ? Simd::kAvx2 : Simd::kScalar;
  }();
  return best;
#else
  return Simd::kScalar;
#endif
}

// The path this call uses: RECPIPE_SIMD if set (checked against the CPU), else
// the best supported one.
Simd simd_for_call() {
  const Simd best = best_simd();
  const char* env = std::getenv("RECPIPE_SIMD");
  if (env == nullptr || env[0] == '\0' || std::strcmp(env, "auto") == 0) {
    return best;
  }
  Simd want;
  if (std::strcmp(env, "scalar") == 0) {
    want = Simd::kScalar;
  } else if (std::strcmp(env, "avx2") == 0) {
    want = Simd::kAvx2;
  } else if (std::strcmp(env, "avx512") == 0) {
    want = Simd::kAvx512;
  } else {
    TORCH_CHECK(
        false, "recpipe: environment variable RECPIPE_SIMD is '", env,
        "'; it must be one of auto, scalar, avx2, avx512 (or unset).");
  }
  static const char* kNames[] = {"scalar", "avx2", "avx512"};
  TORCH_CHECK(
      static_cast<int>(want) <= static_cast<int>(best), "recpipe: RECPIPE_SIMD=", env,
      " but this CPU lacks it (best supported: ", kNames[static_cast<int>(best)],
      "); unset RECPIPE_SIMD or choose a supported path.");
  return want;
}

// hash_roundrobin of one feature in 32-bit lanes, usable when the table has
// 2 <= n <= 2^32 rows and W < 2^32: the window rounds are then bit-identical
// to HashPermutation::perm_fwd (the low c bits of sums and products depend
// only on the low c bits of their operands), h = H(id) < 2^32 and h / W is a
// FastDivU32. (n == 1 has a 0-bit window; it takes the wide path.)
struct Hash32 {
  uint64_t n;     // table rows
  uint32_t mask;  // window size - 1
  uint32_t hi;    // start of the second window (0: one window)
  uint32_t s;
  uint32_t world;
  uint32_t add[HashPermutation::kWindows][HashPermutation::kRounds];
  uint32_t mul[HashPermutation::kWindows][HashPermutation::kRounds];
  FastDivU32 div;  // / W

  static bool fits(const HashPermutation& p, uint64_t world) {
    return p.n >= 2 && p.n <= (1ULL << 32) && world <= 0xFFFFFFFFULL;
  }

  Hash32(const HashPermutation& p, uint64_t w)
      : n(p.n),
        mask(static_cast<uint32_t>(p.mask)),
        hi(static_cast<uint32_t>(p.hi)),
        s(static_cast<uint32_t>(p.s)),
        world(static_cast<uint32_t>(w)),
        div(static_cast<uint32_t>(w)) {
    for (int k = 0; k < HashPermutation::kWindows; ++k) {
      for (int r = 0; r < HashPermutation::kRounds; ++r) {
        add[k][r] = static_cast<uint32_t>(p.add[k][r]);
        mul[k][r] = static_cast<uint32_t>(p.mul[k][r]);
      }
    }
  }

  // The window permutation P_k (all rounds); any input, the result is < 2^c.
  inline uint32_t apply(int k, uint32_t x) const {
    for (int r = 0; r < HashPermutation::kRounds; ++r) {
      x = (x + add[k][r]) & mask;
      x ^= x >> s;
      x = (x * mul[k][r]) & mask;
      x ^= x >> s;
    }
    return x;
  }

  // H(x) branch-free: both window steps are computed for every lane and kept
  // where x lies in the window, so the compiler vectorizes the loop around it.
  inline uint32_t forward(uint32_t x) const {
    const uint32_t y0 = apply(0, x);
    x = x <= mask ? y0 : x;
    const uint32_t y1 = hi + apply(1, x - hi);
    return (hi != 0 && x >= hi) ? y1 : x;
  }
};

// Ids per hash block (every build): the scalar build's staging array (2 KiB)
// stays in L1.
constexpr int64_t kHashBlock = 512;

// Ids the AVX-512 hash loop prefetches ahead of the one it hashes (4 KiB of
// int64 ids: far enough to cover DRAM latency at ~1 id/ns, near enough to stay in L1).
constexpr int64_t kPrefetchAhead = 512;

struct HashScratch {
  alignas(64) uint32_t a32[kHashBlock];
};

// One block of m <= kHashBlock ids: range check (out-of-range ids hash as 0;
// returns whether there was one), h = H(id), then the split owner = h % W,
// local = h / W. Both loops are plain maps (the compiler may use SSE2).
template <typename index_t, typename uindex_t, typename owner_t>
bool hash_block_scalar(
    const Hash32& c, const index_t* ids, int64_t m, HashScratch& scratch, uindex_t* local,
    owner_t* owner) {
  uint32_t* a32 = scratch.a32;
  uint32_t any_bad = 0;
  for (int64_t j = 0; j < m; ++j) {
    const uint64_t u = static_cast<uint64_t>(static_cast<int64_t>(ids[j]));
    const uint32_t oob = u >= c.n;  // negative ids are huge as unsigned
    any_bad |= oob;
    a32[j] = c.forward(oob ? 0u : static_cast<uint32_t>(u));
  }
  if (c.div.pow2) {
    const uint32_t sh = static_cast<uint32_t>(c.div.shift);
    const uint32_t wm = c.world - 1;
    for (int64_t j = 0; j < m; ++j) {
      const uint32_t h = a32[j];
      owner[j] = static_cast<owner_t>(h & wm);
      local[j] = static_cast<uindex_t>(h >> sh);
    }
  } else {
    const uint32_t magic = c.div.magic;
    const uint32_t sh = static_cast<uint32_t>(c.div.shift);
    for (int64_t j = 0; j < m; ++j) {
      const uint32_t h = a32[j];
      const uint32_t t = static_cast<uint32_t>((static_cast<uint64_t>(magic) * h) >> 32);
      const uint32_t q = (t + ((h - t) >> 1)) >> sh;
      owner[j] = static_cast<owner_t>(h - q * c.world);
      local[j] = static_cast<uindex_t>(q);
    }
  }
  return any_bad != 0;
}

#if RECPIPE_X86_SIMD
// n / d for 8 u32 lanes (FastDivU32: mulhi32 from two pmuludq).
RECPIPE_TARGET_AVX2 inline __m256i div32_avx2(__m256i n, const FastDivU32& d) {
  const __m128i shift = _mm_cvtsi32_si128(d.shift);
  if (d.pow2) {
    return _mm256_srl_epi32(n, shift);
  }
  const __m256i magic = _mm256_set1_epi32(static_cast<int>(d.magic));
  const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(n, magic), 32);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(n, 32), magic);
  const __m256i t = _mm256_blend_epi32(even, odd, 0xAA);
  return _mm256_srl_epi32(_mm256_add_epi32(t, _mm256_srli_epi32(_mm256_sub_epi32(n, t), 1)), shift);
}

// n % d given q = n / d (w = d in every lane): a mask for powers of two, else
// n - q * d (vpmulld: 3 cycles, and one of the few multiplies per id).
RECPIPE_TARGET_AVX2 inline __m256i rem32_from_div_avx2(__m256i n, __m256i q, const FastDivU32& d, __m256i w) {
  if (d.pow2) {
    return _mm256_and_si256(n, _mm256_sub_epi32(w, _mm256_set1_epi32(1)));
  }
  return _mm256_sub_epi32(n, _mm256_mullo_epi32(q, w));
}

// n % d for d = world (w = d in every lane).
RECPIPE_TARGET_AVX2 inline __m256i rem32_avx2(__m256i n, const FastDivU32& d, __m256i w) {
  return rem32_from_div_avx2(n, d.pow2 ? n : div32_avx2(n, d), d, w);
}

// ---- AVX2: 8 ids per vector, written out ------------------------------------
// The compiler's vectorization of hash_block_scalar (a target("avx2") clone
// until this one) measured 3.4 cycles per id on the AVX2 EPYC (Zen 3; 1M
// int64 ids, two windows), this loop ~2.8: kAvx2HashVecs vectors are hashed
// together and split from the registers, with no staging array. One vector's
// 4 rounds are a ~40-cycle chain (8 ops a round, vpmulld 3 cycles); with 2
// vectors the loop was still partly bound by it: 4 cut the op's time at
// W = 2 and 8 (hash_roundrobin, 1M int64 ids, 1 thread, cold caches) by ~8%,
// 8 spilled and gained nothing over 4 (both A/B runs of alternating builds).
struct Hash32Avx2 {
  __m256i mask;  // window size - 1
  __m256i hi;    // start of the second window
  __m256i add[HashPermutation::kWindows][HashPermutation::kRounds];
  __m256i mul[HashPermutation::kWindows][HashPermutation::kRounds];
  __m128i s;     // xorshift distance
};
constexpr int kAvx2HashVecs = 4;

// P_k (Hash32::apply) on kLanes independent vectors, round by round.
template <int kLanes>
RECPIPE_TARGET_AVX2 inline void perm_apply_n_avx2(const Hash32Avx2& v, int k, __m256i* x) {
  for (int r = 0; r < HashPermutation::kRounds; ++r) {
    for (int l = 0; l < kLanes; ++l) {
      x[l] = _mm256_and_si256(_mm256_add_epi32(x[l], v.add[k][r]), v.mask);
    }
    for (int l = 0; l < kLanes; ++l) {
      x[l] = _mm256_xor_si256(x[l], _mm256_srl_epi32(x[l], v.s));
    }
    for (int l = 0; l < kLanes; ++l) {
      x[l] = _mm256_and_si256(_mm256_mullo_epi32(x[l], v.mul[k][r]), v.mask);
    }
    for (int l = 0; l < kLanes; ++l) {
      x[l] = _mm256_xor_si256(x[l], _mm256_srl_epi32(x[l], v.s));
    }
  }
}

// One block of m ids, as hash_block_scalar (the same outputs bit for bit for
// in-range ids): per kAvx2HashVecs x 8 ids, load (range check: see below),
// both window steps of H on whole vectors, owner = h % W and local = h / W
// stored from the registers. The last m % (8 * kAvx2HashVecs) ids take one
// more step over a zero-padded copy (0 is in range), of which only their
// outputs are copied back: in the op a feature's run of bags ends in such a
// tail every ~2k ids, and hash_block_scalar there took ~7% of the hash time
// (W = 2, 1M ids).
// kSigned (n <= 2^31): every in-range x < 2^31, so the window tests are
// signed compares: x > mask and x < hi are one vpcmpgtd each (instead of an
// unsigned min/max + vpcmpeqd).
template <bool kSigned, typename index_t, typename uindex_t, typename owner_t>
RECPIPE_TARGET_AVX2 bool hash_block_avx2_impl(
    const Hash32& c, const index_t* ids, int64_t m, uindex_t* local, owner_t* owner) {
  Hash32Avx2 v;
  v.mask = _mm256_set1_epi32(static_cast<int>(c.mask));
  v.hi = _mm256_set1_epi32(static_cast<int>(c.hi));
  for (int k = 0; k < HashPermutation::kWindows; ++k) {
    for (int r = 0; r < HashPermutation::kRounds; ++r) {
      v.add[k][r] = _mm256_set1_epi32(static_cast<int>(c.add[k][r]));
      v.mul[k][r] = _mm256_set1_epi32(static_cast<int>(c.mul[k][r]));
    }
  }
  v.s = _mm_cvtsi32_si128(static_cast<int>(c.s));
  const bool two_windows = c.hi != 0;
  const __m256i world = _mm256_set1_epi32(static_cast<int>(c.world));
  // Range check, once per block: int64 ids are in range iff every high dword
  // is 0 (OR-ed over the block) and the largest low dword is < n; int32 ids iff
  // the largest (as unsigned) is < min(n, 2^31) (negative ids are >= 2^31).
  // Out-of-range lanes are hashed like the others from their low 32 bits (their
  // owner h % W is still < W, whatever h is); the call fails after the pass
  // (hash_ids finds the id), so their outputs are never used.
  const uint32_t low_limit = static_cast<uint32_t>(
      std::min<uint64_t>(c.n, sizeof(index_t) == 8 ? (1ULL << 32) : 0x80000000ULL) - 1);
  __m256i high_or = _mm256_setzero_si256();
  __m256i low_max = _mm256_setzero_si256();
  constexpr int64_t kStep = 8 * kAvx2HashVecs;
  alignas(32) index_t tail_ids[kStep];
  alignas(32) uindex_t tail_local[kStep];
  alignas(32) owner_t tail_owner[kStep];
  for (int64_t j0 = 0; j0 < m; j0 += kStep) {
    const int64_t live = std::min<int64_t>(kStep, m - j0);
    const index_t* in = ids + j0;
    uindex_t* local_out = local + j0;
    owner_t* owner_out = owner + j0;
    if (live < kStep) {
      std::fill(std::copy(in, in + live, tail_ids), tail_ids + kStep, index_t{0});
      in = tail_ids;
      local_out = tail_local;
      owner_out = tail_owner;
    }
    __m256i x[kAvx2HashVecs];  // ids as u32 (low dwords)
    for (int l = 0; l < kAvx2HashVecs; ++l) {
      const index_t* p = in + 8 * l;
      if constexpr (sizeof(index_t) == 8) {
        const __m256 a = _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        const __m256 b = _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 4)));
        high_or = _mm256_or_si256(high_or, _mm256_castps_si256(_mm256_shuffle_ps(a, b, 0xDD)));
        // low dwords of the 8 ids in order: [a0 a1 b0 b1 | a2 a3 b2 b3] -> [a0..a3 b0..b3]
        x[l] = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(a, b, 0x88)), 0xD8);
      } else {
        x[l] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      }
      low_max = _mm256_max_epu32(low_max, x[l]);
    }
    // Window 0: [0, h), P_0.
    __m256i y[kAvx2HashVecs];
    for (int l = 0; l < kAvx2HashVecs; ++l) {
      y[l] = x[l];
    }
    perm_apply_n_avx2<kAvx2HashVecs>(v, 0, y);
    for (int l = 0; l < kAvx2HashVecs; ++l) {  // y where x <= mask (x in window 0)
      x[l] = kSigned ? _mm256_blendv_epi8(y[l], x[l], _mm256_cmpgt_epi32(x[l], v.mask))
                     : _mm256_blendv_epi8(x[l], y[l], _mm256_cmpeq_epi32(_mm256_min_epu32(x[l], v.mask), x[l]));
    }
    // Window 1: [n - h, n), P_1 (not there when n is a power of two).
    if (two_windows) {
      for (int l = 0; l < kAvx2HashVecs; ++l) {
        y[l] = _mm256_sub_epi32(x[l], v.hi);
      }
      perm_apply_n_avx2<kAvx2HashVecs>(v, 1, y);
      for (int l = 0; l < kAvx2HashVecs; ++l) {  // hi + y where x >= hi (x in window 1)
        const __m256i h1 = _mm256_add_epi32(v.hi, y[l]);
        x[l] = kSigned ? _mm256_blendv_epi8(h1, x[l], _mm256_cmpgt_epi32(v.hi, x[l]))
                       : _mm256_blendv_epi8(x[l], h1, _mm256_cmpeq_epi32(_mm256_max_epu32(x[l], v.hi), x[l]));
      }
    }
    // owner = h % W, local = h / W.
    for (int l = 0; l < kAvx2HashVecs; ++l) {
      owner_t* own = owner_out + 8 * l;
      uindex_t* loc = local_out + 8 * l;
      const __m256i q = div32_avx2(x[l], c.div);
      const __m256i o = rem32_from_div_avx2(x[l], q, c.div, world);
      const __m128i o16 = _mm_packus_epi32(_mm256_castsi256_si128(o), _mm256_extracti128_si256(o, 1));
      if constexpr (sizeof(owner_t) == 1) {
        _mm_storel_epi64(reinterpret_cast<__m128i*>(own), _mm_packus_epi16(o16, o16));
      } else if constexpr (sizeof(owner_t) == 2) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(own), o16);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(own), o);
      }
      if constexpr (sizeof(uindex_t) == 8) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(loc), _mm256_cvtepu32_epi64(_mm256_castsi256_si128(q)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(loc + 4), _mm256_cvtepu32_epi64(_mm256_extracti128_si256(q, 1)));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(loc), q);
      }
    }
    if (live < kStep) {
      std::copy(tail_local, tail_local + live, local + j0);
      std::copy(tail_owner, tail_owner + live, owner + j0);
    }
  }
  // in range iff max(low_max, low_limit) == low_limit (unsigned) in every lane
  const __m256i limit = _mm256_set1_epi32(static_cast<int>(low_limit));
  const __m256i in_range = _mm256_cmpeq_epi32(_mm256_max_epu32(low_max, limit), limit);
  return !_mm256_testz_si256(high_or, high_or) || !_mm256_testc_si256(in_range, _mm256_set1_epi32(-1));
}

template <typename index_t, typename uindex_t, typename owner_t>
RECPIPE_TARGET_AVX2 bool hash_block_avx2(
    const Hash32& c, const index_t* ids, int64_t m, uindex_t* local, owner_t* owner) {
  return c.n <= (1ULL << 31) ? hash_block_avx2_impl<true, index_t, uindex_t, owner_t>(c, ids, m, local, owner)
                             : hash_block_avx2_impl<false, index_t, uindex_t, owner_t>(c, ids, m, local, owner);
}

// ---- AVX-512: 16 ids per vector -------------------------------------------
// GCC 12's intrinsic headers trip -Wmaybe-uninitialized (and, for
// _mm512_srl_epi32 inlined into perm_apply_n_avx512, -Wuninitialized) on their
// own _mm512_undefined_* placeholders (a known false positive); silence them
// here only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// The AVX-512 rounds work on c-bit values held in the TOP c bits of each lane
// (X = x << (32 - c)): sums and products mod 2^32 are then the c-bit sums and
// products with no mask, and the xorshift x ^ (x >> s) becomes
// X ^ ((X >> s) & top), one vpternlogd. 6 instructions a round instead of 8,
// bit-identical to HashPermutation::perm_fwd.
struct Hash32Vec {
  __m512i top;   // mask << (32 - c): the c value bits
  __m512i mask;  // window size - 1 (x <= mask: x in the first window)
  __m512i hi;    // start of the second window
  __m512i world;
  __m512i add[HashPermutation::kWindows][HashPermutation::kRounds];
  __m512i mul[HashPermutation::kWindows][HashPermutation::kRounds];
  __m128i s;     // xorshift distance
  __m128i up;    // 32 - c
};

// X ^ ((X >> s) & top): vpternlogd truth table A ^ (B & C) = 0xF0 ^ (0xCC & 0xAA).
constexpr int kXorAnd = 0x78;

// n / d for 16 u32 lanes (FastDivU32: mulhi32 from two pmuludq).
RECPIPE_TARGET_AVX512 inline __m512i div32_avx512(__m512i n, const FastDivU32& d) {
  if (d.pow2) {
    return _mm512_srli_epi32(n, static_cast<unsigned>(d.shift));
  }
  const __m512i magic = _mm512_set1_epi32(static_cast<int>(d.magic));
  const __m512i even = _mm512_srli_epi64(_mm512_mul_epu32(n, magic), 32);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(n, 32), magic);
  const __m512i t = _mm512_mask_blend_epi32(static_cast<__mmask16>(0xAAAA), even, odd);
  return _mm512_srli_epi32(
      _mm512_add_epi32(t, _mm512_srli_epi32(_mm512_sub_epi32(n, t), 1)),
      static_cast<unsigned>(d.shift));
}

RECPIPE_TARGET_AVX512 inline __mmask16 tail16(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF)
                    : left <= 0 ? static_cast<__mmask16>(0)
                                : static_cast<__mmask16>((1u << left) - 1u);
}

// P_k on kLanes independent vectors, round by round: one vector's rounds form
// a ~40-cycle dependency chain (vpmulld is 3 cycles), so hashing one vector at
// a time is latency-bound; interleaving kLanes chains keeps the vector pipes busy.
template <int kLanes>
RECPIPE_TARGET_AVX512 inline void perm_apply_n_avx512(const Hash32Vec& v, int k, __m512i* x) {
  for (int r = 0; r < HashPermutation::kRounds; ++r) {
    for (int l = 0; l < kLanes; ++l) {
      x[l] = _mm512_add_epi32(x[l], v.add[k][r]);
    }
    for (int l = 0; l < kLanes; ++l) {
      x[l] = _mm512_ternarylogic_epi32(x[l], _mm512_srl_epi32(x[l], v.s), v.top, kXorAnd);
    }
    for (int l = 0; l < kLanes; ++l) {
      x[l] = _mm512_mullo_epi32(x[l], v.mul[k][r]);
    }
    for (int l = 0; l < kLanes; ++l) {
      x[l] = _mm512_ternarylogic_epi32(x[l], _mm512_srl_epi32(x[l], v.s), v.top, kXorAnd);
    }
  }
}

// One block of m ids (any m): per kVecs x 16 ids, load + range check
// (out-of-range lanes hash as 0), the two window steps of H on whole vectors
// (a lane keeps a step's result where it lies in that window), then
// owner = h % W, local = h / W stored straight from the registers.
template <typename index_t, typename uindex_t, typename owner_t>
RECPIPE_TARGET_AVX512 bool hash_block_avx512(
    const Hash32& c, const index_t* ids, int64_t m, uindex_t* local, owner_t* owner) {
  Hash32Vec v;
  const int up = __builtin_clz(c.mask);  // 32 - c (mask != 0: n >= 2)
  v.top = _mm512_set1_epi32(static_cast<int>(c.mask << up));
  v.mask = _mm512_set1_epi32(static_cast<int>(c.mask));
  v.hi = _mm512_set1_epi32(static_cast<int>(c.hi));
  v.world = _mm512_set1_epi32(static_cast<int>(c.world));
  for (int k = 0; k < HashPermutation::kWindows; ++k) {
    for (int r = 0; r < HashPermutation::kRounds; ++r) {
      v.add[k][r] = _mm512_set1_epi32(static_cast<int>(c.add[k][r] << up));
      v.mul[k][r] = _mm512_set1_epi32(static_cast<int>(c.mul[k][r]));
    }
  }
  v.s = _mm_cvtsi32_si128(static_cast<int>(c.s));
  v.up = _mm_cvtsi32_si128(up);
  const bool two_windows = c.hi != 0;

  uint32_t bad = 0;
  const __m512i vn = _mm512_set1_epi64(static_cast<long long>(c.n));
  // int32 ids: in range iff (uint32)id < min(n, 2^31) (negative ids are >= 2^31).
  const __m512i vl32 = _mm512_set1_epi32(
      static_cast<int>(static_cast<uint32_t>(std::min<uint64_t>(c.n, 0x80000000ULL))));
  constexpr int kVecs = 4;  // independent vectors hashed together (64 ids)
  for (int64_t j0 = 0; j0 < m; j0 += 16 * kVecs) {
    // The ids stream from L3/DRAM: ask for the ones a block ahead now (a
    // prefetch past the end of `indices` is harmless, prefetches never fault).
    for (int64_t off = 0; off < 16 * kVecs; off += 64 / static_cast<int64_t>(sizeof(index_t))) {
      _mm_prefetch(reinterpret_cast<const char*>(ids + j0 + kPrefetchAhead + off), _MM_HINT_T0);
    }
    __m512i x[kVecs];  // ids as u32
    __mmask16 tms[kVecs];
    for (int l = 0; l < kVecs; ++l) {
      const int64_t j = j0 + 16 * l;
      const __mmask16 tm = tail16(m - j);
      tms[l] = tm;
      if constexpr (sizeof(index_t) == 8) {
        const __mmask8 t0 = static_cast<__mmask8>(tm & 0xFF);
        const __mmask8 t1 = static_cast<__mmask8>(tm >> 8);
        const __m512i u0 = _mm512_maskz_loadu_epi64(t0, ids + j);
        const __m512i u1 = _mm512_maskz_loadu_epi64(t1, ids + j + 8);
        const __mmask8 ok0 = _mm512_mask_cmplt_epu64_mask(t0, u0, vn);
        const __mmask8 ok1 = _mm512_mask_cmplt_epu64_mask(t1, u1, vn);
        bad |= static_cast<uint32_t>((t0 & ~ok0) | (t1 & ~ok1));
        x[l] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm512_maskz_cvtepi64_epi32(ok0, u0)),
            _mm512_maskz_cvtepi64_epi32(ok1, u1), 1);
      } else {
        const __m512i u = _mm512_maskz_loadu_epi32(tm, ids + j);
        const __mmask16 ok = _mm512_mask_cmplt_epu32_mask(tm, u, vl32);
        bad |= static_cast<uint32_t>(tm & ~ok);
        x[l] = _mm512_maskz_mov_epi32(ok, u);
      }
    }
    // Window 0: [0, h), P_0.
    __m512i y[kVecs];
    for (int l = 0; l < kVecs; ++l) {
      y[l] = _mm512_sll_epi32(x[l], v.up);
    }
    perm_apply_n_avx512<kVecs>(v, 0, y);
    for (int l = 0; l < kVecs; ++l) {
      x[l] = _mm512_mask_blend_epi32(
          _mm512_cmple_epu32_mask(x[l], v.mask), x[l], _mm512_srl_epi32(y[l], v.up));
    }
    // Window 1: [n - h, n), P_1 (not there when n is a power of two).
    if (two_windows) {
      for (int l = 0; l < kVecs; ++l) {
        y[l] = _mm512_sll_epi32(_mm512_sub_epi32(x[l], v.hi), v.up);
      }
      perm_apply_n_avx512<kVecs>(v, 1, y);
      for (int l = 0; l < kVecs; ++l) {
        x[l] = _mm512_mask_blend_epi32(
            _mm512_cmpge_epu32_mask(x[l], v.hi), x[l],
            _mm512_add_epi32(v.hi, _mm512_srl_epi32(y[l], v.up)));
      }
    }
    // owner = h % W, local = h / W.
    for (int l = 0; l < kVecs; ++l) {
      const int64_t j = j0 + 16 * l;
      const __mmask16 tm = tms[l];
      if (tm == 0) {
        break;
      }
      const __m512i q = div32_avx512(x[l], c.div);
      const __m512i o = _mm512_sub_epi32(x[l], _mm512_mullo_epi32(q, v.world));
      if constexpr (sizeof(owner_t) == 1) {
        _mm_mask_storeu_epi8(owner + j, tm, _mm512_cvtepi32_epi8(o));
      } else if constexpr (sizeof(owner_t) == 2) {
        _mm256_mask_storeu_epi16(owner + j, tm, _mm512_cvtepi32_epi16(o));
      } else {
        _mm512_mask_storeu_epi32(owner + j, tm, o);
      }
      if constexpr (sizeof(uindex_t) == 8) {
        _mm512_mask_storeu_epi64(
            local + j, static_cast<__mmask8>(tm & 0xFF),
            _mm512_cvtepu32_epi64(_mm512_castsi512_si256(q)));
        _mm512_mask_storeu_epi64(
            local + j + 8, static_cast<__mmask8>(tm >> 8),
            _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(q, 1)));
      } else {
        _mm512_mask_storeu_epi32(local + j, tm, q);
      }
    }
  }
  return bad != 0;
}
#pragma GCC diagnostic pop
#endif  // RECPIPE_X86_SIMD

// Tables of more than 2^32 rows, of one row, or W >= 2^32: 64-bit window
// rounds, one id at a time (HashPermutation::forward).
template <typename index_t, typename uindex_t, typename owner_t>
bool hash_block_wide(
    const HashPermutation& perm, const FastDivU64& div_world, uint64_t world,
    const index_t* ids, int64_t m, uindex_t* local, owner_t* owner) {
  uint32_t any_bad = 0;
  for (int64_t j = 0; j < m; ++j) {
    const uint64_t u = static_cast<uint64_t>(static_cast<int64_t>(ids[j]));
    const bool oob = u >= perm.n;
    any_bad |= oob;
    const uint64_t h = perm.forward(oob ? 0 : u);
    const uint64_t q = div_world.div(h);
    owner[j] = static_cast<owner_t>(h - q * world);
    local[j] = static_cast<uindex_t>(q);
  }
  return any_bad != 0;
}

// owner[i], local[i] for i in [s, e) of one hash_roundrobin feature: h = H(id),
// owner = h % W, local = h / W, by blocks of kHashBlock ids. The first
// out-of-range id is recorded in `bad` (its lanes hash as 0, or on AVX2 from
// their low 32 bits: either way to an owner < W); the call fails after the
// pass, so those outputs are never used.
template <typename index_t, typename local_t, typename owner_t>
void hash_ids(
    const FeatureRoute& route,
    const Hash32* c32,  // nullptr: wide table, 64-bit path
    Simd simd,
    const FastDivU64& div_world,
    uint64_t world,
    const index_t* ids,
    int64_t s,
    int64_t e,
    int64_t feature,
    local_t* local,  // uint32 when every hash feature takes the 32-bit path
    owner_t* owner,
    BadId& bad) {
  // 64-bit tables need local ids of the index width.
  TORCH_INTERNAL_ASSERT(c32 != nullptr || sizeof(local_t) >= sizeof(index_t));
  HashScratch scratch;
  for (int64_t b0 = s; b0 < e; b0 += kHashBlock) {
    const int64_t m = std::min<int64_t>(kHashBlock, e - b0);
    bool any_bad;
    if (c32 == nullptr) {
      any_bad = hash_block_wide<index_t, local_t, owner_t>(
          route.perm, div_world, world, ids + b0, m, local + b0, owner + b0);
    }
#if RECPIPE_X86_SIMD
    else if (simd == Simd::kAvx512) {
      any_bad = hash_block_avx512<index_t, local_t, owner_t>(*c32, ids + b0, m, local + b0, owner + b0);
    } else if (simd == Simd::kAvx2) {
      any_bad = hash_block_avx2<index_t, local_t, owner_t>(*c32, ids + b0, m, local + b0, owner + b0);
    }
#endif
    else {
      any_bad = hash_block_scalar<index_t, local_t, owner_t>(
          *c32, ids + b0, m, scratch, local + b0, owner + b0);
    }
    if (any_bad && bad.position < 0) {
      for (int64_t j = 0; j < m; ++j) {
        const index_t raw = ids[b0 + j];
        if (raw < 0 || static_cast<uint64_t>(raw) >= route.table_size) {
          bad = BadId{b0 + j, feature, static_cast<int64_t>(raw)};
          break;
        }
      }
    }
  }
}
// ---------------------------------------------------------------------------
// Owners of a run of continuous / roundrobin ids (one feature): owner[i] for
// i in [s, e). Local ids are recomputed in the scatter pass (cheaper than
// storing them). continuous: u < ub ? u / block : u % W; roundrobin: u % W
// (ub = 0), u the id as unsigned of the index width.
struct PlainRoute {
  uint64_t ub;  // block * W in the index width (0 for roundrobin)
  uint64_t block;  // rows per rank (continuous)
  FastDivU64 div_block;
  FastDivU64 div_world;
  uint64_t world;
  // 32-bit forms for the SIMD path (valid when block, W < 2^32).
  bool fits32;
  FastDivU32 div_block32;
  FastDivU32 div_world32;
};

template <typename uindex_t>
PlainRoute make_plain_route(const FeatureRoute& r, uint64_t world) {
  PlainRoute pr;
  pr.ub = r.dist == kContinuous ? static_cast<uint64_t>(static_cast<uindex_t>(r.block * world)) : 0;
  pr.block = r.block;
  pr.div_block = r.div_block;
  pr.div_world = FastDivU64(world);
  pr.world = world;
  pr.fits32 = r.block <= 0xFFFFFFFFULL && world <= 0xFFFFFFFFULL;
  if (pr.fits32) {
    pr.div_block32 = FastDivU32(static_cast<uint32_t>(r.block));
    pr.div_world32 = FastDivU32(static_cast<uint32_t>(world));
  }
  return pr;
}

// Local id of a continuous id u owned by rank p: u - p * block below
// ub = block * W (in the index width), else u / W (fbgemm's rule).
template <typename uindex_t>
inline uindex_t continuous_local(uindex_t uid, uint64_t p, uindex_t ub, uint64_t block, const FastDivU64& dw) {
  return uid < ub ? static_cast<uindex_t>(static_cast<uint64_t>(uid) - p * block)
                  : static_cast<uindex_t>(dw.div(static_cast<uint64_t>(uid)));
}

template <typename index_t, typename owner_t>
inline void plain_owners_scalar(const PlainRoute& pr, const index_t* idx, int64_t s, int64_t e, owner_t* owner) {
  using uindex_t = std::make_unsigned_t<index_t>;
  const FastDivU64 db = pr.div_block;
  const FastDivU64 dw = pr.div_world;
  const uint64_t ub = pr.ub;
  const uint64_t world = pr.world;
  for (int64_t i = s; i < e; ++i) {
    const uint64_t u = static_cast<uint64_t>(static_cast<uindex_t>(idx[i]));
    owner[i] = static_cast<owner_t>(u < ub ? db.div(u) : u - dw.div(u) * world);
  }
}

#if RECPIPE_X86_SIMD
// AVX2 owners: blocks of kBlock ids that are all below 2^32 take the 32-bit
// divisions in a plain map the compiler vectorizes (target("avx2")); a block
// with any other id (raw ids >= 2^32, negative raw ids) and the tail go
// through the scalar code. Requires pr.fits32.
template <typename index_t, typename owner_t>
RECPIPE_TARGET_AVX2 void plain_owners_avx2(
    const PlainRoute& pr, const index_t* idx, int64_t s, int64_t e, owner_t* owner) {
  using uindex_t = std::make_unsigned_t<index_t>;
  constexpr int64_t kBlock = 64;
  const FastDivU32 db = pr.div_block32;
  const FastDivU32 dw = pr.div_world32;
  const uint64_t ub = pr.ub;
  const uint32_t world = static_cast<uint32_t>(pr.world);
  int64_t i = s;
  for (; i + kBlock <= e; i += kBlock) {
    uint64_t high = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      high |= static_cast<uint64_t>(static_cast<uindex_t>(idx[i + j])) >> 32;
    }
    if (high != 0) {
      plain_owners_scalar<index_t, owner_t>(pr, idx, i, i + kBlock, owner);
      continue;
    }
    for (int64_t j = 0; j < kBlock; ++j) {
      const uint32_t u = static_cast<uint32_t>(idx[i + j]);
      owner[i + j] = static_cast<owner_t>(u < ub ? db.div(u) : u - dw.div(u) * world);
    }
  }
  plain_owners_scalar<index_t, owner_t>(pr, idx, i, e, owner);
}

// AVX2 owners of int64 ids as bytes (W <= 256), 8 ids per step: steps whose
// ids are all below 2^32 narrow them to u32 lanes and take the 32-bit
// divisions; any other step (raw ids >= 2^32, negative raw ids) and the tail
// go through the scalar code. Requires pr.fits32.
RECPIPE_TARGET_AVX2 void plain_owners_i64_u8_avx2(
    const PlainRoute& pr, const int64_t* idx, int64_t s, int64_t e, uint8_t* owner) {
  const __m256i high = _mm256_set1_epi64x(static_cast<long long>(0xFFFFFFFF00000000ULL));
  const __m256i low_dwords = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const bool continuous = pr.ub != 0;
  const bool all_below_ub = pr.ub > 0xFFFFFFFFULL;  // every u32 id is below block * W
  const __m256i ub = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(pr.ub)));
  const __m256i w = _mm256_set1_epi32(static_cast<int>(pr.world));
  int64_t i = s;
  for (; i + 8 <= e; i += 8) {
    _mm_prefetch(reinterpret_cast<const char*>(idx + i + kPrefetchAhead), _MM_HINT_T0);
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + i + 4));
    if (!_mm256_testz_si256(_mm256_or_si256(a, b), high)) {
      plain_owners_scalar<int64_t, uint8_t>(pr, idx, i, i + 8, owner);
      continue;
    }
    const __m256i u = _mm256_permute2x128_si256(  // the 8 ids as u32, in order
        _mm256_permutevar8x32_epi32(a, low_dwords), _mm256_permutevar8x32_epi32(b, low_dwords), 0x20);
    __m256i o;
    if (continuous) {
      o = div32_avx2(u, pr.div_block32);
      if (!all_below_ub) {
        // u >= ub iff max(u, ub) == u (unsigned); such lanes (fbgemm's rule)
        // are rare, so u % W is computed only for a step that has one.
        const __m256i over = _mm256_cmpeq_epi32(_mm256_max_epu32(u, ub), u);
        if (!_mm256_testz_si256(over, over)) {
          o = _mm256_blendv_epi8(o, rem32_avx2(u, pr.div_world32, w), over);
        }
      }
    } else {
      o = rem32_avx2(u, pr.div_world32, w);
    }
    const __m128i o16 = _mm_packus_epi32(_mm256_castsi256_si128(o), _mm256_extracti128_si256(o, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(owner + i), _mm_packus_epi16(o16, o16));
  }
  plain_owners_scalar<int64_t, uint8_t>(pr, idx, i, e, owner);
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// n / d for n < 2^32 held in 64-bit lanes (FastDivU32: one pmuludq).
RECPIPE_TARGET_AVX512 inline __m512i div32_in_u64_avx512(__m512i n, const FastDivU32& d) {
  if (d.pow2) {
    return _mm512_srli_epi64(n, static_cast<unsigned>(d.shift));
  }
  const __m512i t = _mm512_srli_epi64(_mm512_mul_epu32(n, _mm512_set1_epi64(d.magic)), 32);
  return _mm512_srli_epi64(
      _mm512_add_epi64(t, _mm512_srli_epi64(_mm512_sub_epi64(n, t), 1)),
      static_cast<unsigned>(d.shift));
}

template <typename owner_t>
RECPIPE_TARGET_AVX512 inline void store_owner8_avx512(owner_t* dst, __m512i o64) {
  if constexpr (sizeof(owner_t) == 1) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi64_epi8(o64));
  } else if constexpr (sizeof(owner_t) == 2) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi64_epi16(o64));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi64_epi32(o64));
  }
}

template <typename owner_t>
RECPIPE_TARGET_AVX512 inline void store_owner16_avx512(owner_t* dst, __m512i o32) {
  if constexpr (sizeof(owner_t) == 1) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(o32));
  } else if constexpr (sizeof(owner_t) == 2) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(o32));
  } else {
    _mm512_storeu_si512(dst, o32);
  }
}

// AVX-512 owners: vectors whose ids are all below 2^32 take the 32-bit
// divisions; any other vector (raw ids >= 2^32, negative raw ids) and the tail
// go through the scalar code. Requires pr.fits32.
template <typename index_t, typename owner_t>
RECPIPE_TARGET_AVX512 void plain_owners_avx512(
    const PlainRoute& pr, const index_t* idx, int64_t s, int64_t e, owner_t* owner) {
  int64_t i = s;
  if constexpr (sizeof(index_t) == 8) {
    const __m512i lim = _mm512_set1_epi64(0xFFFFFFFFLL);
    const __m512i ub = _mm512_set1_epi64(static_cast<long long>(pr.ub));
    const __m512i w = _mm512_set1_epi64(static_cast<long long>(pr.world));
    for (; i + 8 <= e; i += 8) {
      _mm_prefetch(reinterpret_cast<const char*>(idx + i + kPrefetchAhead), _MM_HINT_T0);
      const __m512i u = _mm512_loadu_si512(idx + i);
      if (_mm512_cmpgt_epu64_mask(u, lim) != 0) {
        plain_owners_scalar<index_t, owner_t>(pr, idx, i, i + 8, owner);
        continue;
      }
      const __m512i qw = div32_in_u64_avx512(u, pr.div_world32);
      const __m512i rr = _mm512_sub_epi64(u, _mm512_mul_epu32(qw, w));
      const __mmask8 lo = _mm512_cmplt_epu64_mask(u, ub);
      const __m512i o = lo == 0 ? rr : _mm512_mask_blend_epi64(lo, rr, div32_in_u64_avx512(u, pr.div_block32));
      store_owner8_avx512<owner_t>(owner + i, o);
    }
  } else {
    const __m512i ub = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(pr.ub)));
    const __m512i w = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(pr.world)));
    for (; i + 16 <= e; i += 16) {
      const __m512i u = _mm512_loadu_si512(idx + i);
      const __m512i qw = div32_avx512(u, pr.div_world32);
      const __m512i rr = _mm512_sub_epi32(u, _mm512_mullo_epi32(qw, w));
      const __mmask16 lo = _mm512_cmplt_epu32_mask(u, ub);
      const __m512i o = lo == 0 ? rr : _mm512_mask_blend_epi32(lo, rr, div32_avx512(u, pr.div_block32));
      store_owner16_avx512<owner_t>(owner + i, o);
    }
  }
  plain_owners_scalar<index_t, owner_t>(pr, idx, i, e, owner);
}
#pragma GCC diagnostic pop
#endif  // RECPIPE_X86_SIMD

template <typename index_t, typename owner_t>
void plain_owners(
    const PlainRoute& pr, Simd simd, const index_t* idx, int64_t s, int64_t e, owner_t* owner) {
#if RECPIPE_X86_SIMD
  if (simd == Simd::kAvx512 && pr.fits32) {
    plain_owners_avx512<index_t, owner_t>(pr, idx, s, e, owner);
    return;
  }
  if (simd == Simd::kAvx2 && pr.fits32) {
    if constexpr (sizeof(index_t) == 8 && sizeof(owner_t) == 1) {
      plain_owners_i64_u8_avx2(
          pr, reinterpret_cast<const int64_t*>(idx), s, e, reinterpret_cast<uint8_t*>(owner));
    } else {
      plain_owners_avx2<index_t, owner_t>(pr, idx, s, e, owner);
    }
    return;
  }
#endif
  (void)simd;
  plain_owners_scalar<index_t, owner_t>(pr, idx, s, e, owner);
}

// new_lengths is W * F * B entries, written once and read by the caller
// later (for W = 64 it outweighs the indices 2:1): non-temporal stores skip the
// read-for-ownership of every line (x86 movnti; plain stores elsewhere).
// store_fence() orders them before the chunk's work is published.
template <typename T>
inline void store_streaming(T* dst, T v) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if constexpr (sizeof(T) == 8) {
    _mm_stream_si64(reinterpret_cast<long long*>(dst), static_cast<long long>(v));
  } else {
    _mm_stream_si32(reinterpret_cast<int*>(dst), static_cast<int>(v));
  }
#else
  *dst = v;
#endif
}

inline void store_fence() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  _mm_sfence();
#else
  std::atomic_thread_fence(std::memory_order_release);
#endif
}

// dst[j] = row[j] for j < n (streamed), returns the row's sum. AVX-512: whole
// 64-byte lines by one vmovntdq each (int32 -> offset_t in registers), the
// unaligned head and the tail by movnti.
template <typename offset_t>
int64_t stream_row_scalar(offset_t* dst, const int32_t* row, int64_t j, int64_t n) {
  int64_t sum = 0;
  for (; j < n; ++j) {
    store_streaming(dst + j, static_cast<offset_t>(row[j]));
    sum += row[j];
  }
  return sum;
}

// The unaligned head of a streamed row: dst[j] = row[j] by movnti until
// dst + j is `align`-byte aligned (or the row ends); returns that j and adds
// the values to `sum`.
template <typename offset_t>
int64_t stream_head(offset_t* dst, const int32_t* row, int64_t n, uintptr_t align, int64_t& sum) {
  int64_t j = 0;
  while (j < n && (reinterpret_cast<uintptr_t>(dst + j) & (align - 1)) != 0) {
    store_streaming(dst + j, static_cast<offset_t>(row[j]));
    sum += row[j];
    ++j;
  }
  return j;
}

#if RECPIPE_X86_SIMD
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <typename offset_t>
RECPIPE_TARGET_AVX512 int64_t stream_row_avx512(offset_t* dst, const int32_t* row, int64_t n) {
  constexpr int64_t kL = 64 / sizeof(offset_t);
  int64_t sum = 0;
  int64_t j = stream_head(dst, row, n, 64, sum);
  __m512i acc = _mm512_setzero_si512();  // int64 lanes
  for (; j + kL <= n; j += kL) {
    if constexpr (sizeof(offset_t) == 8) {
      const __m512i v = _mm512_cvtepi32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j)));
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + j), v);
      acc = _mm512_add_epi64(acc, v);
    } else {
      const __m512i v = _mm512_loadu_si512(row + j);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + j), v);
      acc = _mm512_add_epi64(acc, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)));
      acc = _mm512_add_epi64(acc, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1)));
    }
  }
  return sum + _mm512_reduce_add_epi64(acc) + stream_row_scalar(dst, row, j, n);
}
#pragma GCC diagnostic pop
#endif

#if RECPIPE_X86_SIMD
// The AVX2 twin: 32-byte lines by one vmovntdq each, head and tail by movnti.
template <typename offset_t>
RECPIPE_TARGET_AVX2 int64_t stream_row_avx2(offset_t* dst, const int32_t* row, int64_t n) {
  constexpr int64_t kL = 32 / sizeof(offset_t);
  int64_t sum = 0;
  int64_t j = stream_head(dst, row, n, 32, sum);
  __m256i acc = _mm256_setzero_si256();  // int64 lanes
  for (; j + kL <= n; j += kL) {
    if constexpr (sizeof(offset_t) == 8) {
      const __m256i v = _mm256_cvtepi32_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j)));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + j), v);
      acc = _mm256_add_epi64(acc, v);
    } else {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + j), v);
      acc = _mm256_add_epi64(acc, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)));
      acc = _mm256_add_epi64(acc, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
    }
  }
  alignas(32) int64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  return sum + lanes[0] + lanes[1] + lanes[2] + lanes[3] + stream_row_scalar(dst, row, j, n);
}
#endif

template <typename offset_t>
int64_t stream_row(Simd simd, offset_t* dst, const int32_t* row, int64_t n) {
#if RECPIPE_X86_SIMD
  if (simd == Simd::kAvx512) {
    return stream_row_avx512(dst, row, n);
  }
  if (simd == Simd::kAvx2) {
    return stream_row_avx2(dst, row, n);
  }
#endif
  (void)simd;
  return stream_row_scalar(dst, row, 0, n);
}

// Scalar scatter for W > kPackedCursorMaxW (below), in blocks of
// kScatterBlock ids: first every id's position (pos = cur[owner]++) into an
// L1 buffer, then the stores. In one loop,
// `out[cur[owner[i]]++] = x` costs ~3 ms per 1M int64 ids at every W on an
// AVX2 EPYC (a standalone loop, W = 2, 8, 64), while the counter updates alone
// take 0.4-1.1 ms and the stores to known positions 0.55-0.8 ms: each store's
// address hangs on a counter load, and the next counter loads, which may
// alias counter stores, wait behind it. Split, the two loops take 1.25-1.85 ms.
// The one-loop form needed a software prefetch of the output (Zen 4: W = 64
// 3.2 -> 1.8 ms); the split loop measured slower with one on Zen 4, but
// faster at W = 64 on the AVX2 EPYC (kScatterPrefetchMinW).
//
// Software write-combining was measured and lost. The idea: stage each rank's
// next ids in a ring of a few lines in L1, and send whole lines out with
// non-temporal stores, which skips the read for ownership of new_indices. In
// the op (1M int64 ids, one thread, continuous; ranges over two ring designs
// and repeats) it took W = 2 from 1.1-1.6 to 2.1-4.5 ms and W = 64 from
// 3.5-5.2 to 6.2-10.2 ms. That held even with the output stores removed. A
// standalone C loop (W = 64, random owners) shows the same: storing straight
// to the output took 1.25-1.55 ms, ring + streamed lines 2.75-3.3 ms. The
// loop with only the ring stores and the "line full?" test took 1.1 ms in one
// build and 3.4 ms in another. That test is taken once per line of a rank, at
// random times, so the likely cost is one branch mispredict per output line.
// That costs more than the read for ownership it saves.
constexpr int64_t kScatterBlock = 256;
// For W <= kPackedCursorMaxW the scatter is one loop again, without the
// memory-carried counter that made the one-loop form slow: the W cursors stay
// put for a block of kPackedCursorBlock ids, and each id's offset from its
// rank's cursor is a byte of one packed 64-bit counter (a register: shift,
// mask, add), added to the cursors after the block (255 ids: a byte cannot
// overflow). A store's address then hangs on no memory-carried chain.
// Measured on the AVX2 EPYC (1M ids, continuous unless stated, one thread,
// min of 150 calls, A/B against the split loops, builds alternated): W = 8
// 2.25-2.29 -> 1.98-2.12 ms (2 threads 1.24 -> 1.07; hash_roundrobin with
// sequence 2.92 -> 2.47); W = 2 with int32 ids (no AVX2 W = 2 path) 2.90 ->
// 2.21 (the split loop kept W = 2's two cursors in registers, which this
// replaces); W = 64 (split loops either way) unchanged. An earlier form of
// this loop also took W = 4 2.45-2.53 -> 2.11-2.23 and W = 8 with float32
// weights 3.24-3.39 -> 2.88-2.98. A standalone W = 8 loop: 1.46-1.58 ->
// 1.17-1.19 ms warm. Lost (standalone loops): at W = 64, the one loop with
// cursors in memory (split 1.67-1.70 ms, one loop 2.74-3.26 ms) or with
// 16-bit packed counters in 16 words (4.27-4.39 ms); at W = 12 and 16, two
// packed registers (split 1.48-1.61 ms, two registers 1.80-1.83 ms).
constexpr int64_t kPackedCursorMaxW = 8;
constexpr int64_t kPackedCursorBlock = 255;

// The scalar scatter for W <= kPackedCursorMaxW (owners are bytes): ids [s, e)
// to their ranks' cursors cur[0..W), which it advances. Not inlined: inlined
// into bucketize_cpu_impl's scatter it slowed the split loops there (W = 64,
// continuous, 1 thread, A/B: 3.59-3.60 -> 3.86-3.88 ms) and gained nothing
// at W = 8.
template <bool kPos, bool kPerm, typename index_t, typename wbits_t, typename LocalOf>
__attribute__((noinline)) void scatter_packed(
    const uint8_t* owner,
    int64_t s,
    int64_t e,
    int64_t W,
    int64_t* cur,
    LocalOf local_of,
    index_t* out_idx,
    const wbits_t* w_in,
    wbits_t* w_out,
    index_t* pos_out,
    index_t* perm_out) {
  // byte p of `packed` counts rank p's ids since the block's start
  int64_t base[kPackedCursorMaxW];
  std::copy(cur, cur + W, base);
  for (int64_t i0 = s; i0 < e; i0 += kPackedCursorBlock) {
    const int64_t i1 = std::min<int64_t>(i0 + kPackedCursorBlock, e);
    uint64_t packed = 0;
    for (int64_t i = i0; i < i1; ++i) {
      const uint64_t p = owner[i];
      const unsigned shift = static_cast<unsigned>(p) * 8;
      const int64_t pos = base[p] + static_cast<int64_t>((packed >> shift) & 0xFF);
      packed += 1ULL << shift;
      out_idx[pos] = static_cast<index_t>(local_of(i, p));
      if constexpr (!std::is_same_v<wbits_t, void>) {
        w_out[pos] = w_in[i];
      }
      if constexpr (kPos) {
        pos_out[pos] = static_cast<index_t>(i - s);
      }
      if constexpr (kPerm) {
        perm_out[i] = static_cast<index_t>(pos);
      }
    }
    for (int64_t p = 0; p < W; ++p) {
      base[p] += static_cast<int64_t>((packed >> (8 * p)) & 0xFF);
    }
  }
  std::copy(base, base + W, cur);
}

// From W = kScatterPrefetchMinW on, the stores of the split loop prefetch
// (for write) their rank's output kScatterPrefetchBytes ahead of the store:
// W = 64 has more output streams than the hardware prefetchers follow and
// missed on every new output line. On the AVX2 EPYC (1M int64 ids,
// continuous, one thread, best of 300, A/B against the build without it, runs
// alternated) the op took 5.3-5.5 -> 4.4-4.5 ms at W = 64 (sequence on:
// 5.7-6.0 -> 4.7-4.8); at W = 8 it was neutral to 0.1 ms slower, so W <= 8
// goes without. 128 and 512 bytes ahead measured the same as 256; 64 bytes,
// 0.15 ms slower at W = 64.
constexpr int64_t kScatterPrefetchMinW = 16;
constexpr int64_t kScatterPrefetchBytes = 256;

// ---------------------------------------------------------------------------
// Small W (AVX-512, owners as bytes): both per-id loops without a per-id
// read-modify-write. The scalar `cnt[owner]++` / `cur[owner]++` loops cost
// about the same at every W measured (~1.6 ms per 1M ids for the scatter at
// W = 2..16, table below, before the scatter was split per kScatterBlock): a
// load, increment and store of a counter per id.
//   * counts: per bag and rank p > 0, the popcount of the owner bytes equal to
//     p (64 bytes per compare); rank 0 takes the rest of the bag.
//   * scatter: per vector of ids and per rank p, the lanes owned by p are
//     compressed (vpcompress, register form) and written at cur[p] by a masked
//     store: each rank's output of a chunk is one contiguous stream (the output
//     is rank-major), so the pass is a stable W-way partition of the ids.
//     unbucketize_permute gets each lane's position by expanding
//     cur[p] + 0, 1, ... into the lanes of p.
// The cost per vector grows with W (one compare + compress + store per rank),
// the scalar loops' does not, hence the bounds. Measured on Zen 4 (1M int64
// ids, F = 8, one thread; ms per pass, vector vs scalar): scatter W = 2 0.64 vs
// 1.62, W = 8 1.49 vs 1.64, W = 16 2.87 vs 1.80; counts W = 2 0.12 vs 0.87,
// W = 8 0.59 vs 0.85, W = 16 1.30 vs 1.14.
constexpr int64_t kSimdCountMaxW = 8;
constexpr int64_t kCompressMaxW = 8;
// Owner-buffer padding: count_bags_u8_avx2 reads 64 bytes from a bag's start.
constexpr int64_t kOwnerPad = 64;

// Local id of a compressed lane: continuous / roundrobin recompute it from the
// id, hash_roundrobin reads the local id pass 1 stored (uint32),
// keep_orig_idx copies the id.
enum class LocalMode : int { kContinuous = 0, kRoundRobin = 1, kHashed = 2, kRaw = 3 };

#if RECPIPE_X86_SIMD
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
RECPIPE_TARGET_AVX512 inline __mmask64 tail64(int64_t left) {
  return left >= 64 ? ~0ULL : left <= 0 ? 0ULL : ((1ULL << left) - 1ULL);
}

// Counts of bags [g0, g1) into counts[p * stride + (bt - g0)].
RECPIPE_TARGET_AVX512 void count_bags_u8_avx512(
    const uint8_t* own, const int64_t* offsets, int64_t g0, int64_t g1, int64_t W,
    int32_t* counts, int64_t stride) {
  for (int64_t bt = g0; bt < g1; ++bt) {
    const int64_t s = offsets[bt];
    const int64_t e = offsets[bt + 1];
    int32_t* col = counts + (bt - g0);
    int64_t rest = e - s;
    for (int64_t p = 1; p < W; ++p) {
      const __m512i vp = _mm512_set1_epi8(static_cast<char>(p));
      int64_t n = 0;
      for (int64_t i = s; i < e; i += 64) {
        const __mmask64 m = tail64(e - i);
        n += __builtin_popcountll(
            _mm512_mask_cmpeq_epi8_mask(m, _mm512_maskz_loadu_epi8(m, own + i), vp));
      }
      col[p * stride] = static_cast<int32_t>(n);
      rest -= n;
    }
    col[0] = static_cast<int32_t>(rest);
  }
}

// Bit k of each of the 64 bytes a (low 32) and b (high 32), as one mask.
template <int k>
RECPIPE_TARGET_AVX2 inline uint64_t bit_plane64_avx2(__m256i a, __m256i b) {
  const auto lo = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(a, 7 - k)));
  const auto hi = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(b, 7 - k)));
  return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32);
}

// The AVX2 twin of count_bags_u8_avx512, by bit planes: owners are below
// kSimdCountMaxW = 8, so three bits. Per 64 owner bytes of a bag, plane k is
// the movemask of the bytes shifted left by 7 - k (bit k of each byte lands in
// its sign bit), as one 64-bit mask with the bytes past the bag cleared; the
// lanes of rank p are the AND of each plane or its complement (a tree of 14
// ANDs), counted with popcnt. Rank 0 takes the rest of the bag. A bag of up to
// 64 ids is one pass of the loop, so its exit is predicted; the compare per
// rank (32 bytes a step, a loop per bag of 1-2 steps) took 0.54 ms per 1M
// ids at W = 8 (bag lengths uniform in [0, 64], standalone loop on the AVX2
// EPYC), the planes 0.29-0.33 ms. It reads up to 63 bytes past a bag's end:
// the owner buffer carries kOwnerPad bytes of padding.
RECPIPE_TARGET_AVX2 void count_bags_u8_avx2(
    const uint8_t* own, const int64_t* offsets, int64_t g0, int64_t g1, int64_t W,
    int32_t* counts, int64_t stride) {
  static_assert(kSimdCountMaxW <= 8, "count_bags_u8_avx2 counts three bit planes");
  for (int64_t bt = g0; bt < g1; ++bt) {
    const int64_t s = offsets[bt];
    const int64_t e = offsets[bt + 1];
    int32_t n[8] = {0};
    int64_t i = s;
    do {
      const int64_t left = e - i;  // 0 for an empty bag
      const uint64_t live = left >= 64 ? ~0ULL : (1ULL << left) - 1ULL;
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(own + i));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(own + i + 32));
      const uint64_t b0 = bit_plane64_avx2<0>(a, b);
      const uint64_t b1 = bit_plane64_avx2<1>(a, b);
      const uint64_t b2 = bit_plane64_avx2<2>(a, b);
      const uint64_t h0 = live & ~b2;  // ranks 0-3
      const uint64_t h1 = live & b2;   // ranks 4-7
      const uint64_t q0 = h0 & ~b1;    // 0, 1
      const uint64_t q1 = h0 & b1;     // 2, 3
      const uint64_t q2 = h1 & ~b1;    // 4, 5
      const uint64_t q3 = h1 & b1;     // 6, 7
      n[1] += __builtin_popcountll(q0 & b0);
      n[2] += __builtin_popcountll(q1 & ~b0);
      n[3] += __builtin_popcountll(q1 & b0);
      n[4] += __builtin_popcountll(q2 & ~b0);
      n[5] += __builtin_popcountll(q2 & b0);
      n[6] += __builtin_popcountll(q3 & ~b0);
      n[7] += __builtin_popcountll(q3 & b0);
      i += 64;
    } while (i < e);
    int32_t* col = counts + (bt - g0);
    int32_t rest = static_cast<int32_t>(e - s);
    for (int64_t p = 1; p < W; ++p) {
      col[p * stride] = n[p];
      rest -= n[p];
    }
    col[0] = rest;
  }
}

// Scalar twin of one lane: the scatter of id j (ids outside the 32-bit lanes).
template <typename index_t, LocalMode kMode, bool kPerm>
inline void scatter_one(
    const PlainRoute& pr, const index_t* idx, const uint8_t* own, int64_t j, int64_t* cur,
    index_t* out, index_t* perm) {
  using uindex_t = std::make_unsigned_t<index_t>;
  const uint64_t p = own[j];
  const uindex_t uid = static_cast<uindex_t>(idx[j]);
  uindex_t local = uid;
  if constexpr (kMode == LocalMode::kContinuous) {
    local = continuous_local<uindex_t>(uid, p, static_cast<uindex_t>(pr.ub), pr.block, pr.div_world);
  } else if constexpr (kMode == LocalMode::kRoundRobin) {
    local = static_cast<uindex_t>(pr.div_world.div(static_cast<uint64_t>(uid)));
  }
  const int64_t pos = cur[p]++;
  out[pos] = static_cast<index_t>(local);
  if constexpr (kPerm) {
    perm[j] = static_cast<index_t>(pos);
  }
}

// Pass 2 of the ids [s, e) of one feature, W <= kCompressMaxW (see above).
// Continuous / roundrobin need pr.fits32; kHashed needs hl32.
template <typename index_t, LocalMode kMode, bool kPerm>
RECPIPE_TARGET_AVX512 void compress_scatter_avx512(
    const PlainRoute& pr, const index_t* idx, const uint8_t* own, const uint32_t* hl32,
    int64_t s, int64_t e, int64_t W, int64_t* cur, index_t* out, index_t* perm) {
  constexpr int kL = 64 / sizeof(index_t);  // lanes per vector
  for (int64_t i = s; i < e; i += kL) {
    _mm_prefetch(reinterpret_cast<const char*>(idx + i + kPrefetchAhead), _MM_HINT_T0);
    const int64_t left = e - i;
    __m512i local;
    __m512i o;
    if constexpr (sizeof(index_t) == 8) {
      const __mmask8 tm = left >= 8 ? static_cast<__mmask8>(0xFF)
                                    : static_cast<__mmask8>((1u << left) - 1u);
      o = _mm512_cvtepu8_epi64(_mm_maskz_loadu_epi8(tm, own + i));
      if constexpr (kMode == LocalMode::kHashed) {
        local = _mm512_cvtepu32_epi64(_mm256_maskz_loadu_epi32(tm, hl32 + i));
      } else {
        const __m512i u = _mm512_maskz_loadu_epi64(tm, idx + i);
        if constexpr (kMode == LocalMode::kRaw) {
          local = u;
        } else {
          if (_mm512_cmpgt_epu64_mask(u, _mm512_set1_epi64(0xFFFFFFFFLL)) != 0) {
            for (int64_t j = i; j < i + std::min<int64_t>(left, kL); ++j) {
              scatter_one<index_t, kMode, kPerm>(pr, idx, own, j, cur, out, perm);
            }
            continue;
          }
          local = div32_in_u64_avx512(u, pr.div_world32);
          if constexpr (kMode == LocalMode::kContinuous) {
            const __mmask8 lo = _mm512_cmplt_epu64_mask(u, _mm512_set1_epi64(static_cast<long long>(pr.ub)));
            const __m512i base = _mm512_mul_epu32(o, _mm512_set1_epi64(static_cast<long long>(pr.block)));
            local = _mm512_mask_sub_epi64(local, lo, u, base);
          }
        }
      }
      __m512i pos = _mm512_setzero_si512();
      const __m512i iota = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
      for (int64_t p = 0; p < W; ++p) {
        const __mmask8 k = _mm512_mask_cmpeq_epi64_mask(tm, o, _mm512_set1_epi64(p));
        const int n = __builtin_popcount(k);
        const int64_t c = cur[p];
        _mm512_mask_storeu_epi64(out + c, static_cast<__mmask8>((1u << n) - 1u),
                                 _mm512_maskz_compress_epi64(k, local));
        if constexpr (kPerm) {
          pos = _mm512_mask_expand_epi64(pos, k, _mm512_add_epi64(_mm512_set1_epi64(c), iota));
        }
        cur[p] = c + n;
      }
      if constexpr (kPerm) {
        _mm512_mask_storeu_epi64(perm + i, tm, pos);
      }
    } else {
      const __mmask16 tm = tail16(left);
      o = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(tm, own + i));
      if constexpr (kMode == LocalMode::kHashed) {
        local = _mm512_maskz_loadu_epi32(tm, hl32 + i);
      } else {
        const __m512i u = _mm512_maskz_loadu_epi32(tm, idx + i);
        if constexpr (kMode == LocalMode::kRaw) {
          local = u;
        } else {
          local = div32_avx512(u, pr.div_world32);
          if constexpr (kMode == LocalMode::kContinuous) {
            const __mmask16 lo = _mm512_cmplt_epu32_mask(
                u, _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(pr.ub))));
            const __m512i base = _mm512_mullo_epi32(
                o, _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(pr.block))));
            local = _mm512_mask_sub_epi32(local, lo, u, base);
          }
        }
      }
      __m512i pos = _mm512_setzero_si512();
      const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (int64_t p = 0; p < W; ++p) {
        const __mmask16 k = _mm512_mask_cmpeq_epi32_mask(tm, o, _mm512_set1_epi32(static_cast<int>(p)));
        const int n = __builtin_popcount(k);
        const int64_t c = cur[p];
        _mm512_mask_storeu_epi32(out + c, static_cast<__mmask16>((1u << n) - 1u),
                                 _mm512_maskz_compress_epi32(k, local));
        if constexpr (kPerm) {
          pos = _mm512_mask_expand_epi32(
              pos, k, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(c)), iota));
        }
        cur[p] = c + n;
      }
      if constexpr (kPerm) {
        _mm512_mask_storeu_epi32(perm + i, tm, pos);
      }
    }
  }
}
#pragma GCC diagnostic pop

// ---------------------------------------------------------------------------
// W = 2 on AVX2 (int64 ids; local ids from the rule, or raw for keep_orig_idx;
// no weights, no new_pos). Continuous and roundrobin features work from the
// ids, 4 per vector, and write no owner buffer: a lane's owner is one compare,
// continuous u >= block (valid below ub = 2 * block; the rule for ids >= ub is
// fbgemm's u % W), roundrobin u & 1. hash_roundrobin features (32-bit local
// ids) read the owner bytes and local ids pass 1 stored (W2Src). Then
//   * counts: per bag, the popcount of the rank-1 lanes; rank 0 takes the rest;
//   * scatter: per vector and rank, a permute from a 16-entry table packs the
//     rank's lanes to the front (AVX2 has no vpcompress) and the whole vector
//     is stored at the rank's cursor; the lanes past its ids are overwritten
//     by the rank's next store. A chunk's last stores of a rank would spill
//     into the next rank's (or chunk's) output, so a vector is stored whole
//     only while both cursors are >= 4 ids from their ends; the last ids, and
//     vectors holding a continuous id >= ub, take the scalar rule.
// Measured on the AVX2 EPYC (Zen 3; 1M int64 ids, F = 8, one thread,
// continuous): owners + counts 0.85 ms -> ~0.25 ms (a per-bag vector loop
// instead of the bitmap took 0.6 ms), scatter ~2 ms -> ~0.55 ms; the op
// 2.8 -> ~0.85 ms. hash_roundrobin 2.9 -> 1.8 ms (the hash itself is ~1.1).
enum class W2Src : int { kContinuous = 0, kRoundRobin = 1, kHashed = 2 };

// Owner (0/1) and local id of one id at W = 2, the scalar rule (the route
// of a continuous feature has ub = 2 * block, of a roundrobin one ub = 0).
inline uint64_t w2_owner(const PlainRoute& r, uint64_t u) {
  return u < r.ub ? static_cast<uint64_t>(u >= r.block) : (u & 1);
}
inline uint64_t w2_local(const PlainRoute& r, uint64_t u) {
  return u < r.ub ? u - (u >= r.block ? r.block : 0) : (u >> 1);
}

// kW2Pack[m]: dword indices that move the 64-bit lanes set in m (in order) to
// the front of a vector (_mm256_permutevar8x32_epi32); kW2Rank[m][j]: the
// number of lanes of m below lane j (a lane's offset from its rank's cursor).
struct W2Tables {
  alignas(32) int32_t pack[16][8];
  alignas(32) int64_t rank[16][4];
  constexpr W2Tables() : pack(), rank() {
    for (int m = 0; m < 16; ++m) {
      int n = 0;
      for (int j = 0; j < 4; ++j) {
        rank[m][j] = n;
        if ((m >> j) & 1) {
          pack[m][2 * n] = 2 * j;
          pack[m][2 * n + 1] = 2 * j + 1;
          ++n;
        }
      }
    }
  }
};
constexpr W2Tables kW2Tables{};

// Rank-1 lanes of 4 ids (continuous / roundrobin) as a lane mask (only the
// sign bit is set for roundrobin: enough for movemask / blendv), and in
// *above_ub the lanes of continuous ids >= ub (those take the scalar rule).
template <W2Src kSrc>
RECPIPE_TARGET_AVX2 inline __m256i w2_rank1(
    __m256i u, __m256i block_m1, __m256i ub_m1, __m256i* above_ub) {
  static_assert(kSrc != W2Src::kHashed, "hashed owners are read, not computed");
  if constexpr (kSrc == W2Src::kContinuous) {
    // unsigned u > x as signed (u ^ 2^63) > (x ^ 2^63); the constants carry the flip
    const __m256i ux = _mm256_xor_si256(u, _mm256_set1_epi64x(std::numeric_limits<int64_t>::min()));
    *above_ub = _mm256_cmpgt_epi64(ux, ub_m1);
    return _mm256_cmpgt_epi64(ux, block_m1);
  } else {
    *above_ub = _mm256_setzero_si256();
    return _mm256_slli_epi64(u, 63);
  }
}

RECPIPE_TARGET_AVX2 inline __m256i w2_flipped(uint64_t x) {
  return _mm256_set1_epi64x(static_cast<long long>(x ^ (1ULL << 63)));
}

// new_lengths counts of bags [g0, g1) of one feature at W = 2, from the ids
// (kHashed: from the owner bytes `own`):
// counts[bt - g0] (rank 0) and counts[stride + bt - g0] (rank 1). A bag loop
// over vectors exits at a data-dependent trip count (bags are ~32 ids) and
// measured 1.5 cycles per id on the AVX2 EPYC, mostly those branches. So the
// rank-1 bits of all the ids come first, 16 per step in one branch-free loop
// (`bits`: bit k of word w is id offsets[g0] + 64 w + k), then prefix counts
// per word, then each bag is two lookups: ones below its end minus ones below
// its start. If a continuous id is >= ub the range is counted by the scalar rule.
template <W2Src kSrc>
RECPIPE_TARGET_AVX2 void count_bags_w2_avx2(
    const PlainRoute& r, const int64_t* idx, const uint8_t* own, const int64_t* offsets, int64_t g0,
    int64_t g1, int32_t* counts, int64_t stride, std::vector<uint64_t>& bits) {
  const int64_t s0 = offsets[g0];
  const int64_t n = offsets[g1] - s0;
  const int64_t words = n / 64 + 1;  // one past the last id's word: a bag ending at n reads it
  if (static_cast<int64_t>(bits.size()) < 2 * words) {
    bits.resize(2 * words);
  }
  uint64_t* word = bits.data();
  uint64_t* ones_before = bits.data() + words;  // ones in the words before w
  const int64_t* ids = idx + s0;
  const uint8_t* ow = own + s0;
  const __m256i block_m1 = w2_flipped(r.block - 1);
  const __m256i ub_m1 = w2_flipped(r.ub - 1);
  __m256i above = _mm256_setzero_si256();  // lanes >= ub seen (continuous)
  int64_t k = 0;
  for (; k + 64 <= n; k += 64) {
    uint64_t w = 0;
    if constexpr (kSrc == W2Src::kHashed) {
      const __m256i one = _mm256_set1_epi8(1);
      for (int q = 0; q < 2; ++q) {
        const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ow + k + 32 * q));
        w |= static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(o, one))))
            << (32 * q);
      }
    } else {
      for (int q = 0; q < 16; ++q) {
        __m256i a;
        const __m256i r1 = w2_rank1<kSrc>(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ids + k + 4 * q)), block_m1, ub_m1, &a);
        above = _mm256_or_si256(above, a);
        w |= static_cast<uint64_t>(_mm256_movemask_pd(_mm256_castsi256_pd(r1))) << (4 * q);
      }
    }
    word[k / 64] = w;
  }
  auto owner_of = [&](int64_t j) -> uint64_t {
    return kSrc == W2Src::kHashed ? ow[j] : w2_owner(r, static_cast<uint64_t>(ids[j]));
  };
  uint64_t w = 0;  // the last, partial word (always written: words = n / 64 + 1)
  for (int64_t j = k; j < n; ++j) {
    w |= owner_of(j) << (j - k);
  }
  word[k / 64] = w;
  if (!_mm256_testz_si256(above, above)) {  // a continuous id >= ub: redo the whole-word bits by the scalar rule
    for (int64_t j = 0; j < k; ++j) {
      const uint64_t b = uint64_t{1} << (j % 64);
      word[j / 64] = (word[j / 64] & ~b) | (owner_of(j) ? b : 0);
    }
  }
  uint64_t run = 0;
  for (int64_t q = 0; q < words; ++q) {
    ones_before[q] = run;
    run += static_cast<uint64_t>(__builtin_popcountll(word[q]));
  }
  int64_t below_s = 0;  // rank-1 ids among the first x: ones_before[x / 64] + ones of word[x / 64] below x % 64
  for (int64_t bt = g0; bt < g1; ++bt) {
    const int64_t e = offsets[bt + 1] - s0;
    const int64_t below_e = static_cast<int64_t>(ones_before[e / 64]) +
        __builtin_popcountll(word[e / 64] & ((uint64_t{1} << (e % 64)) - 1));
    const int64_t n1 = below_e - below_s;
    counts[bt - g0] = static_cast<int32_t>(e - (offsets[bt] - s0) - n1);
    counts[stride + bt - g0] = static_cast<int32_t>(n1);
    below_s = below_e;
  }
}

// Scatter of the ids [s, e) of one feature at W = 2: cur[0..1] are the
// chunk's cursors, end[0..1] the ends of its output of each rank. kHashed
// reads owners from `own` and local ids from `hl32`.
template <W2Src kSrc, bool kRaw, bool kPerm>
RECPIPE_TARGET_AVX2 void scatter_w2_avx2(
    const PlainRoute& r, const int64_t* idx, const uint8_t* own, const uint32_t* hl32, int64_t s,
    int64_t e, int64_t* cur, const int64_t* end, int64_t* out, int64_t* perm) {
  constexpr bool kHashed = kSrc == W2Src::kHashed;
  const __m256i block_m1 = w2_flipped(r.block - 1);
  const __m256i ub_m1 = w2_flipped(r.ub - 1);
  const __m256i block = _mm256_set1_epi64x(static_cast<long long>(r.block));
  int64_t c0 = cur[0];
  int64_t c1 = cur[1];
  const int64_t last0 = end[0] - 4;  // a whole-vector store at c needs c <= last
  const int64_t last1 = end[1] - 4;
  auto one = [&](int64_t j) {
    const uint64_t u = static_cast<uint64_t>(idx[j]);
    const uint64_t p = kHashed ? own[j] : w2_owner(r, u);
    const int64_t pos = p != 0 ? c1++ : c0++;
    out[pos] = static_cast<int64_t>(kRaw ? u : kHashed ? hl32[j] : w2_local(r, u));
    if constexpr (kPerm) {
      perm[j] = pos;
    }
  };
  int64_t i = s;
  for (; i + 4 <= e; i += 4) {
    int above = 0;
    __m256i u = _mm256_setzero_si256();
    __m256i r1;
    __m256i above_v;
    if constexpr (kHashed) {
      uint32_t o4;
      std::memcpy(&o4, own + i, 4);
      r1 = _mm256_cmpeq_epi64(
          _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(static_cast<int>(o4))), _mm256_set1_epi64x(1));
      if constexpr (kRaw) {
        u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + i));
      }
    } else {
      u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + i));
      r1 = w2_rank1<kSrc>(u, block_m1, ub_m1, &above_v);
      above = _mm256_movemask_pd(_mm256_castsi256_pd(above_v));
    }
    if (above != 0 || c0 > last0 || c1 > last1) {
      for (int64_t j = i; j < i + 4; ++j) {
        one(j);
      }
      continue;
    }
    const int m1 = _mm256_movemask_pd(_mm256_castsi256_pd(r1));
    const int m0 = m1 ^ 15;
    __m256i local;
    if constexpr (kRaw) {
      local = u;
    } else if constexpr (kHashed) {
      local = _mm256_cvtepu32_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hl32 + i)));
    } else if constexpr (kSrc == W2Src::kContinuous) {
      local = _mm256_sub_epi64(u, _mm256_and_si256(r1, block));
    } else {
      local = _mm256_srli_epi64(u, 1);
    }
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(out + c0),
        _mm256_permutevar8x32_epi32(local, _mm256_load_si256(reinterpret_cast<const __m256i*>(kW2Tables.pack[m0]))));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(out + c1),
        _mm256_permutevar8x32_epi32(local, _mm256_load_si256(reinterpret_cast<const __m256i*>(kW2Tables.pack[m1]))));
    if constexpr (kPerm) {
      const __m256i p0 = _mm256_add_epi64(
          _mm256_set1_epi64x(c0), _mm256_load_si256(reinterpret_cast<const __m256i*>(kW2Tables.rank[m0])));
      const __m256i p1 = _mm256_add_epi64(
          _mm256_set1_epi64x(c1), _mm256_load_si256(reinterpret_cast<const __m256i*>(kW2Tables.rank[m1])));
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(perm + i),
          _mm256_castpd_si256(_mm256_blendv_pd(
              _mm256_castsi256_pd(p0), _mm256_castsi256_pd(p1), _mm256_castsi256_pd(r1))));
    }
    c0 += __builtin_popcount(m0);
    c1 += __builtin_popcount(m1);
  }
  for (; i < e; ++i) {
    one(i);
  }
  cur[0] = c0;
  cur[1] = c1;
}
#endif  // RECPIPE_X86_SIMD

// count_bags_u8_avx512 / _avx2 when `simd` is one of those, W <= kSimdCountMaxW
// and the owners are bytes; false: the caller counts (scalar).
template <typename owner_t>
bool count_bags_simd(
    Simd simd, const owner_t* own, const int64_t* offsets, int64_t g0, int64_t g1, int64_t W,
    int32_t* counts, int64_t stride) {
#if RECPIPE_X86_SIMD
  if constexpr (sizeof(owner_t) == 1) {
    if (W <= kSimdCountMaxW && simd != Simd::kScalar) {
      const auto* own8 = reinterpret_cast<const uint8_t*>(own);
      if (simd == Simd::kAvx512) {
        count_bags_u8_avx512(own8, offsets, g0, g1, W, counts, stride);
      } else {
        count_bags_u8_avx2(own8, offsets, g0, g1, W, counts, stride);
      }
      return true;
    }
  }
#endif
  (void)simd, (void)own, (void)offsets, (void)g0, (void)g1, (void)W, (void)counts, (void)stride;
  return false;
}

// compress_scatter_avx512 over the ids [s, e) of one feature, dispatched on
// the local-id mode and on unbucketize_permute.
template <typename index_t>
void compress_scatter(
    LocalMode mode, const PlainRoute& pr, const index_t* idx, const uint8_t* own,
    const uint32_t* hl32, int64_t s, int64_t e, int64_t W, int64_t* cur, index_t* out,
    index_t* perm) {
#if RECPIPE_X86_SIMD
  auto run = [&](auto mode_tag, auto perm_tag) {
    compress_scatter_avx512<index_t, decltype(mode_tag)::value, decltype(perm_tag)::value>(
        pr, idx, own, hl32, s, e, W, cur, out, perm);
  };
  auto with_perm = [&](auto mode_tag) {
    if (perm != nullptr) {
      run(mode_tag, std::true_type{});
    } else {
      run(mode_tag, std::false_type{});
    }
  };
  switch (mode) {
    case LocalMode::kContinuous:
      with_perm(std::integral_constant<LocalMode, LocalMode::kContinuous>{});
      break;
    case LocalMode::kRoundRobin:
      with_perm(std::integral_constant<LocalMode, LocalMode::kRoundRobin>{});
      break;
    case LocalMode::kHashed:
      with_perm(std::integral_constant<LocalMode, LocalMode::kHashed>{});
      break;
    case LocalMode::kRaw:
      with_perm(std::integral_constant<LocalMode, LocalMode::kRaw>{});
      break;
  }
#else
  (void)mode, (void)pr, (void)idx, (void)own, (void)hl32, (void)s, (void)e, (void)W, (void)cur,
      (void)out, (void)perm;
  TORCH_INTERNAL_ASSERT(false, "recpipe: compress_scatter needs the AVX-512 build");
#endif
}

template <typename index_t, typename offset_t, typename owner_t, typename wbits_t>
void bucketize_cpu_impl(
    const Tensor& lengths,
    const Tensor& indices,
    const std::vector<FeatureRoute>& routes,
    int64_t W,
    bool sequence,
    bool bucketize_pos,
    const std::optional<Tensor>& weights,
    bool keep_orig_idx,
    Simd simd,
    const std::vector<int64_t>& offsets,
    Tensor& new_lengths,
    Tensor& new_indices,
    std::optional<Tensor>& new_weights,
    std::optional<Tensor>& new_pos,
    std::optional<Tensor>& unbucketize_permute) {
  using uindex_t = std::make_unsigned_t<index_t>;
  const int64_t F = static_cast<int64_t>(routes.size());
  const int64_t FB = lengths.numel();
  const int64_t B = F == 0 ? 0 : FB / F;
  const int64_t N = indices.numel();

  const index_t* idx = indices.const_data_ptr<index_t>();
  offset_t* nl = new_lengths.mutable_data_ptr<offset_t>();
  index_t* out_idx = new_indices.mutable_data_ptr<index_t>();
  const wbits_t* w_in = nullptr;
  wbits_t* w_out = nullptr;
  if constexpr (!std::is_same_v<wbits_t, void>) {
    w_in = static_cast<const wbits_t*>(weights.value().const_data_ptr());
    w_out = static_cast<wbits_t*>(new_weights.value().mutable_data_ptr());
  }
  index_t* pos_out = bucketize_pos ? new_pos.value().mutable_data_ptr<index_t>() : nullptr;
  index_t* perm_out =
      sequence ? unbucketize_permute.value().mutable_data_ptr<index_t>() : nullptr;

  // Scratch: owner per id (padded for count_bags_u8_avx2's whole-vector
  // reads; the pad is zeroed and masked off), and (hash features only) local
  // id per id.
  std::unique_ptr<owner_t[]> owner(new owner_t[N + kOwnerPad]);
  std::fill(owner.get() + N, owner.get() + N + kOwnerPad, owner_t{0});
  bool any_hash = false;
  for (const auto& r : routes) {
    any_hash |= (r.dist == kHashRoundRobin);
  }
  // hash_roundrobin local ids, computed once in pass 1: uint32 when every hash
  // feature takes the 32-bit path (half the scratch traffic), else the index width.
  std::unique_ptr<uindex_t[]> hashed_local;
  std::unique_ptr<uint32_t[]> hashed_local32;
  std::vector<std::unique_ptr<Hash32>> hash32(F);
  std::vector<PlainRoute> plain(F);
  for (int64_t f = 0; f < F; ++f) {
    if (routes[f].dist != kHashRoundRobin) {
      plain[f] = make_plain_route<uindex_t>(routes[f], static_cast<uint64_t>(W));
    }
  }
  if (any_hash) {
    bool all32 = true;
    for (int64_t f = 0; f < F; ++f) {
      const FeatureRoute& r = routes[f];
      if (r.dist == kHashRoundRobin) {
        if (Hash32::fits(r.perm, static_cast<uint64_t>(W))) {
          hash32[f] = std::make_unique<Hash32>(r.perm, static_cast<uint64_t>(W));
        } else {
          all32 = false;
        }
      }
    }
    if (all32) {
      hashed_local32.reset(new uint32_t[std::max<int64_t>(N, 1)]);
    } else {
      hashed_local.reset(new uindex_t[std::max<int64_t>(N, 1)]);
    }
  }

  // W = 2 on AVX2 (count_bags_w2_avx2, scatter_w2_avx2): continuous /
  // roundrobin features skip the owner buffer, hash_roundrobin features with
  // 32-bit local ids count and scatter from it; both passes test w2_run.
  const bool w2 = W == 2 && simd == Simd::kAvx2 && sizeof(index_t) == 8 &&
      std::is_same_v<wbits_t, void> && !bucketize_pos;
  auto w2_run = [&](int64_t f) {
    return w2 && (routes[f].dist != kHashRoundRobin || hashed_local32 != nullptr);
  };
  auto w2_counts = [&](int64_t f, int64_t r0, int64_t r1, int32_t* counts, int64_t stride,
                       std::vector<uint64_t>& w2_bits) {
#if RECPIPE_X86_SIMD
    if constexpr (sizeof(index_t) == 8) {
      const PlainRoute& r = plain[f];  // hash features: unused
      const auto* ids = reinterpret_cast<const int64_t*>(idx);
      const auto* own = reinterpret_cast<const uint8_t*>(owner.get());
      const int64_t* o = offsets.data();
      if (routes[f].dist == kHashRoundRobin) {
        count_bags_w2_avx2<W2Src::kHashed>(r, ids, own, o, r0, r1, counts, stride, w2_bits);
      } else if (routes[f].dist == kContinuous) {
        count_bags_w2_avx2<W2Src::kContinuous>(r, ids, own, o, r0, r1, counts, stride, w2_bits);
      } else {
        count_bags_w2_avx2<W2Src::kRoundRobin>(r, ids, own, o, r0, r1, counts, stride, w2_bits);
      }
      return;
    }
#endif
    (void)f, (void)r0, (void)r1, (void)counts, (void)stride, (void)w2_bits;
    TORCH_INTERNAL_ASSERT(false, "recpipe: the W = 2 path needs the AVX2 build and int64 ids");
  };

  // Below ~64k ids a second thread costs more than it saves. With several
  // threads the bags are cut into kChunksPerWorker chunks per thread, taken
  // dynamically (for_each_chunk), so a thread that shares its core with
  // another job leaves its chunks to the others instead of stalling the pass.
  constexpr int64_t kChunksPerWorker = 8;
  const int64_t workers =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N / 65536));
  const int64_t chunks = workers == 1
      ? 1
      : std::min<int64_t>(kChunksPerWorker * workers, std::max<int64_t>(workers, N / 16384));
  const std::vector<int64_t> bounds = chunk_bags(offsets, FB, chunks);
  std::vector<int64_t> chunk_count(chunks * W, 0);
  std::vector<BadId> bad(chunks);
  const FastDivU64 div_world(static_cast<uint64_t>(W));
  const uint64_t uW = static_cast<uint64_t>(W);

  // ---- pass 1: owners and counts --------------------------------------
  // Counts go to a small [W x kBags] block in L1 first and are then written
  // to new_lengths row by row (contiguous runs of kBags entries): incrementing
  // new_lengths[p * FB + bag] directly strides W rows FB entries apart and
  // missed cache on almost every id at W = 64.
  const int64_t kBags = std::max<int64_t>(1, std::min<int64_t>(64, 4096 / W));
  for_each_chunk(workers, chunks, [&](int64_t c) {
    std::vector<int32_t> block_counts(W * kBags);
    // The chunk's totals are summed in a buffer of its own and published once:
    // neighbouring chunks' slices of chunk_count share cache lines, and the
    // threads work on neighbouring chunks at the same time.
    std::vector<int64_t> cnt(W, 0);
    std::vector<uint64_t> w2_bits;  // count_bags_w2_avx2's scratch
    {
      for (int64_t g0 = bounds[c]; g0 < bounds[c + 1]; g0 += kBags) {
        const int64_t g1 = std::min<int64_t>(g0 + kBags, bounds[c + 1]);
        std::fill(block_counts.begin(), block_counts.end(), 0);
        // Owners of the bag block, per run of one feature (hash_roundrobin also
        // writes its local ids to hashed_local), then the counts from them.
        for (int64_t r0 = g0; r0 < g1;) {
          const int64_t f = r0 / B;
          const int64_t r1 = std::min<int64_t>(g1, (f + 1) * B);
          if (w2_run(f) && routes[f].dist != kHashRoundRobin) {
            // no owners: pass 2 recomputes them (see scatter_w2_avx2)
            w2_counts(f, r0, r1, block_counts.data() + (r0 - g0), kBags, w2_bits);
            r0 = r1;
            continue;
          }
          if (routes[f].dist == kHashRoundRobin) {
            if (hashed_local32) {
              hash_ids<index_t, uint32_t, owner_t>(
                  routes[f], hash32[f].get(), simd, div_world, uW, idx, offsets[r0],
                  offsets[r1], f, hashed_local32.get(), owner.get(), bad[c]);
            } else {
              hash_ids<index_t, uindex_t, owner_t>(
                  routes[f], hash32[f].get(), simd, div_world, uW, idx, offsets[r0],
                  offsets[r1], f, hashed_local.get(), owner.get(), bad[c]);
            }
          } else {
            plain_owners<index_t, owner_t>(plain[f], simd, idx, offsets[r0], offsets[r1], owner.get());
          }
          const owner_t* own = owner.get();
          int32_t* run_counts = block_counts.data() + (r0 - g0);
          if (w2_run(f)) {  // hash_roundrobin at W = 2
            w2_counts(f, r0, r1, run_counts, kBags, w2_bits);
          } else if (!count_bags_simd(simd, own, offsets.data(), r0, r1, W, run_counts, kBags)) {
            for (int64_t bt = r0; bt < r1; ++bt) {
              int32_t* lc = run_counts + (bt - r0);  // lc[p * kBags]
              const int64_t e = offsets[bt + 1];
              for (int64_t i = offsets[bt]; i < e; ++i) {
                lc[static_cast<uint64_t>(own[i]) * kBags]++;
              }
            }
          }
          r0 = r1;
        }
        const int64_t nb = g1 - g0;
        for (int64_t p = 0; p < W; ++p) {
          cnt[p] += stream_row(simd, nl + p * FB + g0, block_counts.data() + p * kBags, nb);
        }
      }
    }
    std::copy(cnt.begin(), cnt.end(), chunk_count.begin() + c * W);
    store_fence();  // the streaming stores of this chunk's new_lengths
  });
  for (const auto& b : bad) {
    if (b.position >= 0) {
      TORCH_CHECK(
          false, "recpipe: `indices[", b.position, "]` = ", b.value, " (feature ", b.feature,
          ", hash_roundrobin) is outside [0, table_sizes[", b.feature, "] = ",
          routes[b.feature].table_size,
          "); hash routing needs ids in the table's range: hash or clamp raw ids upstream, "
          "or route this feature with roundrobin.");
    }
  }

  // ---- cursors: base[rank] + totals of earlier chunks ----------------------
  std::vector<int64_t> cursor(chunks * W);
  {
    int64_t run = 0;
    for (int64_t p = 0; p < W; ++p) {
      for (int64_t c = 0; c < chunks; ++c) {
        cursor[c * W + p] = run;
        run += chunk_count[c * W + p];
      }
    }
  }

  // ---- pass 2: scatter ------------------------------------------------------
  // One tight loop per (dist type, optional outputs): the per-feature constants
  // are hoisted into locals (the output stores could otherwise alias them and
  // force a reload per id), the local-id functors (local_of) capture them by
  // value (captured by reference, the W <= 8 loop ran ~10% slower and the W = 64
  // split loops up to ~15% slower: 1M int64 ids, 1 thread, A/B), and the
  // optional outputs are compile-time flags.
  const bool compress = simd == Simd::kAvx512 && W <= kCompressMaxW;
  auto scatter = [&](auto has_pos, auto has_perm, int64_t* cur, int64_t s, int64_t e,
                     auto local_of) {
    if constexpr (sizeof(owner_t) == 1) {
      if (W <= kPackedCursorMaxW) {
        scatter_packed<decltype(has_pos)::value, decltype(has_perm)::value>(
            owner.get(), s, e, W, cur, local_of, out_idx, w_in, w_out, pos_out, perm_out);
        return;
      }
    }
    int64_t pos_block[kScatterBlock];
    constexpr int64_t kScatterPrefetch = kScatterPrefetchBytes / sizeof(index_t);
    const bool prefetch_out = W >= kScatterPrefetchMinW;
    for (int64_t i0 = s; i0 < e; i0 += kScatterBlock) {
      const int64_t m = std::min<int64_t>(kScatterBlock, e - i0);
      // positions first (see kScatterBlock)
      for (int64_t j = 0; j < m; ++j) {
        pos_block[j] = cur[owner[i0 + j]]++;
      }
      // The stores, with (W >= kScatterPrefetchMinW) or without the output
      // prefetch as two compiled loops: one loop with a run-time test
      // measured 0.3 ms slower at W = 8, and a prefetch loop of its own
      // before the stores gained half as much at W = 64.
      auto stores = [&](auto prefetch) {
        for (int64_t j = 0; j < m; ++j) {
          const int64_t i = i0 + j;
          const int64_t pos = pos_block[j];
          if constexpr (decltype(prefetch)::value) {
            __builtin_prefetch(out_idx + pos + kScatterPrefetch, 1, 3);
          }
          out_idx[pos] = static_cast<index_t>(local_of(i, owner[i]));
          if constexpr (!std::is_same_v<wbits_t, void>) {
            w_out[pos] = w_in[i];
          }
          if constexpr (decltype(has_pos)::value) {
            pos_out[pos] = static_cast<index_t>(i - s);
          }
          if constexpr (decltype(has_perm)::value) {
            perm_out[i] = static_cast<index_t>(pos);
          }
        }
      };
      if (prefetch_out) {
        stores(std::true_type{});
      } else {
        stores(std::false_type{});
      }
    }
  };
  auto w2_scatter = [&](auto has_perm, int64_t f, bool raw, int64_t s, int64_t e, int64_t* cur,
                        const int64_t* end) {
#if RECPIPE_X86_SIMD
    if constexpr (sizeof(index_t) == 8) {
      constexpr bool kPerm = decltype(has_perm)::value;
      const PlainRoute& r = plain[f];  // hash features: unused
      const auto* ids = reinterpret_cast<const int64_t*>(idx);
      const auto* own = reinterpret_cast<const uint8_t*>(owner.get());
      const uint32_t* hl = hashed_local32.get();
      auto* out = reinterpret_cast<int64_t*>(out_idx);
      auto* perm = reinterpret_cast<int64_t*>(perm_out);
      auto run = [&](auto src) {
        constexpr W2Src kSrc = decltype(src)::value;
        (raw ? scatter_w2_avx2<kSrc, true, kPerm> : scatter_w2_avx2<kSrc, false, kPerm>)(
            r, ids, own, hl, s, e, cur, end, out, perm);
      };
      if (routes[f].dist == kHashRoundRobin) {
        run(std::integral_constant<W2Src, W2Src::kHashed>{});
      } else if (routes[f].dist == kContinuous) {
        run(std::integral_constant<W2Src, W2Src::kContinuous>{});
      } else {
        run(std::integral_constant<W2Src, W2Src::kRoundRobin>{});
      }
      return;
    }
#endif
    (void)f, (void)raw, (void)s, (void)e, (void)cur, (void)end;
    TORCH_INTERNAL_ASSERT(false, "recpipe: the W = 2 path needs the AVX2 build and int64 ids");
  };
  auto scatter_chunk = [&](auto has_pos, auto has_perm, int64_t c) {
    // Cursors move once per id (or vector): a private copy, as the shared
    // array would bounce cache lines between threads on neighbouring chunks
    // (measured: pass 2 did not scale from 1 to 2 threads at W <= 8).
    std::vector<int64_t> cur_own(cursor.begin() + c * W, cursor.begin() + (c + 1) * W);
    int64_t* cur = cur_own.data();
    std::vector<int64_t> end_own(W);  // the ends of this chunk's output of each rank
    for (int64_t p = 0; p < W; ++p) {
      end_own[p] = cur_own[p] + chunk_count[c * W + p];
    }
    const uindex_t* hl = hashed_local.get();
    const uint32_t* hl32 = hashed_local32.get();
    for (int64_t bt = bounds[c]; bt < bounds[c + 1];) {
      // a run of bags of one feature
      const int64_t f = bt / B;
      const int64_t run_end = std::min<int64_t>(bounds[c + 1], (f + 1) * B);
      const FeatureRoute& r = routes[f];
      const int64_t dist = keep_orig_idx ? -1 : r.dist;
      const uint64_t block = r.block;
      const uindex_t ub = static_cast<uindex_t>(r.block * uW);
      const FastDivU64 dw = div_world;
      if (w2_run(f)) {
        w2_scatter(has_perm, f, dist < 0, offsets[bt], offsets[run_end], cur, end_own.data());
        bt = run_end;
        continue;
      }
      if constexpr (sizeof(owner_t) == 1 && std::is_same_v<wbits_t, void> &&
                    !decltype(has_pos)::value) {
        // Small W on AVX-512: the run's ids at once, as a W-way partition.
        const bool locals_ok = dist < 0 || (dist == kHashRoundRobin ? hl32 != nullptr : plain[f].fits32);
        if (compress && locals_ok) {
          const LocalMode mode = dist < 0 ? LocalMode::kRaw
              : dist == kContinuous       ? LocalMode::kContinuous
              : dist == kRoundRobin       ? LocalMode::kRoundRobin
                                          : LocalMode::kHashed;
          compress_scatter<index_t>(
              mode, plain[f], idx, reinterpret_cast<const uint8_t*>(owner.get()), hl32,
              offsets[bt], offsets[run_end], W, cur, out_idx,
              decltype(has_perm)::value ? perm_out : nullptr);
          bt = run_end;
          continue;
        }
      }
      auto scatter_range = [&](int64_t s, int64_t e) {
        if (dist == kContinuous) {
          scatter(has_pos, has_perm, cur, s, e, [=](int64_t i, uint64_t p) {
            return continuous_local<uindex_t>(static_cast<uindex_t>(idx[i]), p, ub, block, dw);
          });
        } else if (dist == kRoundRobin) {
          scatter(has_pos, has_perm, cur, s, e, [=](int64_t i, uint64_t) {
            return static_cast<uindex_t>(dw.div(static_cast<uint64_t>(static_cast<uindex_t>(idx[i]))));
          });
        } else if (dist == kHashRoundRobin) {
          if (hl32 != nullptr) {
            scatter(has_pos, has_perm, cur, s, e,
                    [=](int64_t i, uint64_t) { return static_cast<uindex_t>(hl32[i]); });
          } else {
            scatter(has_pos, has_perm, cur, s, e, [=](int64_t i, uint64_t) { return hl[i]; });
          }
        } else {  // keep_orig_idx
          scatter(has_pos, has_perm, cur, s, e,
                  [=](int64_t i, uint64_t) { return static_cast<uindex_t>(idx[i]); });
        }
      };
      if constexpr (decltype(has_pos)::value) {
        for (; bt < run_end; ++bt) {  // new_pos counts from each bag's start
          scatter_range(offsets[bt], offsets[bt + 1]);
        }
      } else {
        // Without new_pos the bag boundaries do not matter to the scatter: the
        // run is one loop (no loop exit, often mispredicted, every ~32 ids).
        scatter_range(offsets[bt], offsets[run_end]);
        bt = run_end;
      }
    }
  };
  for_each_chunk(workers, chunks, [&](int64_t c) {
    {
      using T = std::true_type;
      using Fl = std::false_type;
      if (pos_out != nullptr) {
        if (perm_out != nullptr) {
          scatter_chunk(T{}, T{}, c);
        } else {
          scatter_chunk(T{}, Fl{}, c);
        }
      } else if (perm_out != nullptr) {
        scatter_chunk(Fl{}, T{}, c);
      } else {
        scatter_chunk(Fl{}, Fl{}, c);
      }
    }
  });
}

// roundrobin features whose table size is given: every id must lie in
// [0, table_sizes[f]) (one max-reduction pass over those features' ids; a
// negative id is a huge unsigned value).
void check_roundrobin_ranges(
    const Tensor& indices,
    const std::vector<FeatureRoute>& routes,
    const std::vector<int64_t>& offsets,
    int64_t FB) {
  const int64_t F = static_cast<int64_t>(routes.size());
  const int64_t B = F > 0 ? FB / F : 0;
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "recpipe_roundrobin_ranges", [&] {
    const index_t* idx = indices.const_data_ptr<index_t>();
    for (int64_t f = 0; f < F; ++f) {
      const uint64_t n = routes[f].table_size;
      if (routes[f].dist != kRoundRobin || n == 0) {
        continue;
      }
      const int64_t lo = offsets[f * B];
      const int64_t hi = offsets[(f + 1) * B];
      const uint64_t top = at::parallel_reduce(
          lo, hi, int64_t{1} << 16, uint64_t{0},
          [&](int64_t s, int64_t e, uint64_t m) {
            for (int64_t i = s; i < e; ++i) {
              m = std::max(m, static_cast<uint64_t>(static_cast<int64_t>(idx[i])));
            }
            return m;
          },
          [](uint64_t a, uint64_t b) { return std::max(a, b); });
      if (top < n) {
        continue;
      }
      int64_t i = lo;
      while (static_cast<uint64_t>(static_cast<int64_t>(idx[i])) < n) {
        ++i;
      }
      TORCH_CHECK_INDEX(
          false, "recpipe: `indices[", i, "]` = ", static_cast<int64_t>(idx[i]), " (feature ", f,
          ", roundrobin) is outside [0, table_sizes[", f, "] = ", n,
          "); ids must lie in the table's range: hash or clamp raw ids upstream, or omit "
          "table_sizes for raw ids.");
    }
  });
}

std::tuple<Tensor, Tensor, std::optional<Tensor>, std::optional<Tensor>, std::optional<Tensor>>
block_bucketize_sparse_features_cpu(
    const Tensor& lengths_in,
    const Tensor& indices_in,
    const Tensor& block_sizes,
    const Tensor& dist_types,
    int64_t my_size,
    bool sequence,
    bool bucketize_pos,
    const std::optional<Tensor>& weights_in,
    const std::optional<Tensor>& table_sizes,
    int64_t seed,
    bool keep_orig_idx) {
  check_bucketize_args(
      lengths_in, indices_in, block_sizes, dist_types, my_size, weights_in, table_sizes);
  TORCH_CHECK(
      lengths_in.is_cpu(), "recpipe: `lengths` is on ", lengths_in.device(),
      " but the CPU kernel was dispatched; move all tensor arguments to one device.");
  const auto routes = build_feature_routes(block_sizes, dist_types, table_sizes, seed);
  const Simd simd = simd_for_call();
  const Tensor lengths = lengths_in.contiguous();
  const Tensor indices = indices_in.contiguous();
  std::optional<Tensor> weights;
  if (weights_in.has_value()) {
    weights = weights_in.value().contiguous();
  }
  const int64_t FB = lengths.numel();
  const int64_t N = indices.numel();
  const int64_t W = my_size;

  // Bag offsets, checking lengths on the way.
  std::vector<int64_t> offsets(FB + 1);
  AT_DISPATCH_INDEX_TYPES(lengths.scalar_type(), "recpipe_bucketize_offsets", [&] {
    const index_t* l = lengths.const_data_ptr<index_t>();
    int64_t run = 0;
    offsets[0] = 0;
    for (int64_t k = 0; k < FB; ++k) {
      TORCH_CHECK(
          l[k] >= 0, "recpipe: `lengths[", k, "]` is ", static_cast<int64_t>(l[k]),
          "; bag lengths must be >= 0.");
      run += l[k];
      offsets[k + 1] = run;
    }
  });
  TORCH_CHECK(
      offsets[FB] == N, "recpipe: `lengths` sums to ", offsets[FB], " but `indices` has ", N,
      " entries; lengths and indices must describe the same KJT.");

  check_roundrobin_ranges(indices, routes, offsets, FB);

  // Every entry is written by pass 1 (or zeroed below for an empty input).
  Tensor new_lengths = at::empty({W * FB}, lengths.options());
  Tensor new_indices = at::empty({N}, indices.options());
  std::optional<Tensor> new_weights;
  std::optional<Tensor> new_pos;
  std::optional<Tensor> unbucketize_permute;
  if (weights.has_value()) {
    new_weights = at::empty({N}, weights->options());
  }
  if (bucketize_pos) {
    new_pos = at::empty({N}, indices.options());
  }
  if (sequence) {
    unbucketize_permute = at::empty({N}, indices.options());
  }
  if (N == 0) {
    new_lengths.zero_();
    return {new_lengths, new_indices, new_weights, new_pos, unbucketize_permute};
  }

  auto run = [&](auto index_tag, auto offset_tag, auto owner_tag, auto wbits_tag) {
    using index_t = typename decltype(index_tag)::type;
    using offset_t = typename decltype(offset_tag)::type;
    using owner_t = typename decltype(owner_tag)::type;
    using wbits_t = typename decltype(wbits_tag)::type;
    bucketize_cpu_impl<index_t, offset_t, owner_t, wbits_t>(
        lengths, indices, routes, W, sequence, bucketize_pos, weights, keep_orig_idx, simd, offsets,
        new_lengths, new_indices, new_weights, new_pos, unbucketize_permute);
  };
  template_dispatch(run, indices.scalar_type(), lengths.scalar_type(), W, weights);
  return {new_lengths, new_indices, new_weights, new_pos, unbucketize_permute};
}

Tensor hash_roundrobin_global_ids_cpu(
    const Tensor& ranks_in,
    const Tensor& local_ids_in,
    int64_t table_size,
    int64_t world_size,
    int64_t seed) {
  check_global_ids_args(ranks_in, local_ids_in, table_size, world_size);
  const Tensor ranks = ranks_in.to(at::kLong).contiguous();
  const Tensor local_ids = local_ids_in.to(at::kLong).contiguous();
  Tensor out = at::empty_like(local_ids);
  const int64_t n = local_ids.numel();
  const int64_t* rk = ranks.const_data_ptr<int64_t>();
  const int64_t* li = local_ids.const_data_ptr<int64_t>();
  int64_t* o = out.mutable_data_ptr<int64_t>();
  const HashPermutation perm(static_cast<uint64_t>(table_size), static_cast<uint64_t>(seed));
  std::vector<int64_t> bad_at(std::max<int64_t>(1, at::get_num_threads()), -1);
  at::parallel_for(0, n, 16384, [&](int64_t s, int64_t e) {
    const int tid = at::get_thread_num();
    for (int64_t i = s; i < e; ++i) {
      if (!is_roundrobin_slot(rk[i], li[i], table_size, world_size)) {
        if (bad_at[tid] < 0) {
          bad_at[tid] = i;
        }
        o[i] = -1;
        continue;
      }
      o[i] = static_cast<int64_t>(perm.inverse(static_cast<uint64_t>(li[i] * world_size + rk[i])));
    }
  });
  for (const int64_t i : bad_at) {
    TORCH_CHECK(
        i < 0, "recpipe: (`ranks[", i, "]`, `local_ids[", i, "]`) = (", rk[i], ", ", li[i],
        ") is not a slot of a table of ", table_size, " rows over ", world_size,
        " ranks under hash_roundrobin (needs 0 <= rank < world_size and "
        "local_id * world_size + rank < table_size); check the checkpoint's world size.");
  }
  return out.to(local_ids_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(recpipe, CPU, m) {
  m.impl("block_bucketize_sparse_features", &block_bucketize_sparse_features_cpu);
  m.impl("hash_roundrobin_global_ids", &hash_roundrobin_global_ids_cpu);
}

}  // namespace recpipe
