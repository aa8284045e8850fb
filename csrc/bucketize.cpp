// recpipe: block_bucketize_sparse_features and hash_roundrobin_global_ids (CPU).
//
// One algorithm, fbgemm's layout. Every id's owner rank and local id come from
// FeatureRoute::route (bucketize_math.h), the function the CUDA kernel calls.
// The bags are split into chunks of about equal id counts; chunks own disjoint
// bags, so every stage runs them in parallel without atomics:
//
//   1. count:   every id routed and counted in new_lengths[rank][bag]; the
//               chunk's total per rank (hash_roundrobin keeps its keys H(id))
//   2. cursors: a chunk's ids of one rank land contiguously (its bags are
//               consecutive): cursor[chunk][rank] = ids of lower ranks + ids of
//               this rank in earlier chunks
//   3. scatter: in input order, each id routed again goes to cursor[chunk][owner]++
//               (new_indices, new_pos, unbucketize_permute, bucket_mapping)
//   4. weights: new_weights[dest[i]] = weights[i] (dest = the positions of 3)
//
// Order inside a bag is kept, as fbgemm keeps it. Variable batch per feature
// (VBE) only changes which bags belong to which feature (feature_bags).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "bucketize_math.h"
#include "checks.h"
#include "cpu_dispatch.h"

namespace recpipe {
namespace {

using at::Tensor;

constexpr int64_t kIdsPerChunk = 1 << 15;  // ids per parallel chunk (enough to amortize a task)
// Output entries ahead of a rank's cursor whose cache line the scatter prefetches
// for writing: 4 lines of int64 ids (measured on the bench's 1M ids, W = 2..64).
constexpr int64_t kPrefetchAhead = 32;

// Bag offsets into `indices` (FB + 1 entries), checking lengths >= 0 and their sum.
template <typename offset_t>
std::vector<int64_t> bag_offsets(const Tensor& lengths, int64_t n) {
  const int64_t FB = lengths.numel();
  const offset_t* l = lengths.const_data_ptr<offset_t>();
  std::vector<int64_t> off(FB + 1, 0);
  for (int64_t k = 0; k < FB; ++k) {
    TORCH_CHECK(l[k] >= 0, "recpipe: `lengths[", k, "]` is ", static_cast<int64_t>(l[k]),
                "; bag lengths must be >= 0.");
    TORCH_CHECK(static_cast<int64_t>(l[k]) <= n - off[k], "recpipe: `lengths` sums past the ", n,
                " entries of `indices` at bag ", k, " (lengths[", k, "] = ", static_cast<int64_t>(l[k]),
                "); lengths and indices must describe the same KJT.");
    off[k + 1] = off[k] + l[k];
  }
  TORCH_CHECK(off[FB] == n, "recpipe: `lengths` sums to ", off[FB], " but `indices` has ", n,
              " entries; lengths and indices must describe the same KJT.");
  return off;
}

// Chunk boundaries over the bags (chunks + 1 entries), about equal id counts.
std::vector<int64_t> chunk_bags(const std::vector<int64_t>& off) {
  const int64_t FB = static_cast<int64_t>(off.size()) - 1;
  const int64_t n = off.back();
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(FB, n / kIdsPerChunk));
  std::vector<int64_t> bounds(chunks + 1, FB);
  bounds[0] = 0;
  for (int64_t c = 1; c < chunks; ++c) {
    const int64_t b = std::upper_bound(off.begin(), off.end(), n / chunks * c) - off.begin() - 1;
    bounds[c] = std::max(bounds[c - 1], std::min(b, FB));
  }
  return bounds;
}

// Calls fn(f, bag_begin, bag_end) for the runs of bags of one feature in [b0, b1).
template <typename Fn>
void for_each_feature_run(const std::vector<int64_t>& fbag, int64_t b0, int64_t b1, Fn&& fn) {
  int64_t f = std::upper_bound(fbag.begin(), fbag.end(), b0) - fbag.begin() - 1;
  for (int64_t b = b0; b < b1; ++f) {
    const int64_t e = std::min(b1, fbag[f + 1]);
    if (e > b) {
      fn(f, b, e);
    }
    b = std::max(b, e);
  }
}

// Calls fn(dist, has_bounds, key) with the feature's rule fixed at compile time:
// its dist type and whether it has shard bounds (std::integral_constant), and
// the word of its hash_roundrobin keys (std::type_identity: uint32_t when the
// table's ids fit in 32 bits, HashPermutation::fits_u32; else uint64_t).
template <typename Fn>
void with_dist(const FeatureRoute& r, Fn&& fn) {
  using std::integral_constant;
  using std::type_identity;
  if (r.dist == kContinuous && r.bounds_count > 0) {
    fn(integral_constant<int, kContinuous>(), integral_constant<int, 1>(), type_identity<uint64_t>());
  } else if (r.dist == kContinuous) {
    fn(integral_constant<int, kContinuous>(), integral_constant<int, 0>(), type_identity<uint64_t>());
  } else if (r.dist == kRoundRobin) {
    fn(integral_constant<int, kRoundRobin>(), integral_constant<int, 0>(), type_identity<uint64_t>());
  } else if (r.perm.fits_u32()) {
    fn(integral_constant<int, kHashRoundRobin>(), integral_constant<int, 0>(), type_identity<uint32_t>());
  } else {
    fn(integral_constant<int, kHashRoundRobin>(), integral_constant<int, 0>(), type_identity<uint64_t>());
  }
}

// The keys H(id) of hash_roundrobin ids, kept from stage 1 for stage 3 in 32-bit
// words for tables whose ids fit (half the memory traffic), else in 64-bit words.
// Uninitialized: stage 1 writes the keys of the ids it routes by hash.
struct HashKeys {
  std::unique_ptr<uint32_t[]> narrow;
  std::unique_ptr<uint64_t[]> wide;

  HashKeys(const std::vector<FeatureRoute>& routes, int64_t n) {
    for (const FeatureRoute& r : routes) {
      if (r.dist == kHashRoundRobin && r.perm.fits_u32() && !narrow) {
        narrow.reset(new uint32_t[n]);
      } else if (r.dist == kHashRoundRobin && !r.perm.fits_u32() && !wide) {
        wide.reset(new uint64_t[n]);
      }
    }
  }
  template <typename key_t>
  key_t* get() const {
    if constexpr (std::is_same_v<key_t, uint32_t>) {
      return narrow.get();
    } else {
      return wide.get();
    }
  }
};

// ---------------------------------------------------------------------------
// hash_roundrobin keys of a run of ids, H(id), in one loop the compiler
// vectorizes. With the x86 dispatch (cpu_dispatch.h) the same source is compiled
// for AVX-512, AVX2 and baseline x86-64 and RECPIPE_ISA=auto|avx512|avx2|baseline
// picks one per call (tests force each); the portable build compiles the
// baseline loop only. The build only changes speed: every id gets the same
// H(id) (header math).

// The run is cut into kHashStreams equal parts hashed in one loop, so their
// independent multiply chains overlap (H is a chain of 4 multiplies per id: one
// stream leaves the AVX2 and baseline builds waiting on multiply latency).
constexpr int kHashStreams = 4;

template <typename index_t, typename key_t>
__attribute__((always_inline)) inline void hash_keys_body(const HashPermutation& perm, const index_t* __restrict__ ids,
                                                          int64_t m, key_t* __restrict__ keys) {
  using uindex_t = std::make_unsigned_t<index_t>;
  const HashPermutation h = perm;
  const int64_t part = m / kHashStreams;
  for (int64_t j = 0; j < part; ++j) {
    for (int k = 0; k < kHashStreams; ++k) {
      keys[k * part + j] = h.forward<key_t>(static_cast<key_t>(static_cast<uindex_t>(ids[k * part + j])));
    }
  }
  for (int64_t j = kHashStreams * part; j < m; ++j) {
    keys[j] = h.forward<key_t>(static_cast<key_t>(static_cast<uindex_t>(ids[j])));
  }
}

#if defined(RECPIPE_X86_DISPATCH)
template <typename index_t, typename key_t>
__attribute__((target("avx512f,avx512dq,avx512vl,avx512bw"))) void hash_keys_avx512(
    const HashPermutation& perm, const index_t* ids, int64_t m, key_t* keys) {
  hash_keys_body(perm, ids, m, keys);
}

template <typename index_t, typename key_t>
__attribute__((target("avx2,bmi2,fma"))) void hash_keys_avx2(const HashPermutation& perm, const index_t* ids,
                                                              int64_t m, key_t* keys) {
  hash_keys_body(perm, ids, m, keys);
}
#endif

template <typename index_t, typename key_t>
void hash_keys_baseline(const HashPermutation& perm, const index_t* ids, int64_t m, key_t* keys) {
  hash_keys_body(perm, ids, m, keys);
}

enum class Isa { kBaseline, kAvx2, kAvx512 };

// The ISA of this call: RECPIPE_ISA if set (an error when this CPU or this build
// lacks it), else the widest this CPU has (baseline in the portable build).
Isa call_isa() {
  const char* env = std::getenv("RECPIPE_ISA");
  const std::string want = env == nullptr ? "auto" : env;
  const bool named = want == "auto" || want.empty() || want == "avx512" || want == "avx2" || want == "baseline";
  TORCH_CHECK(named, "recpipe: RECPIPE_ISA is '", want, "'; it must be one of auto, avx512, avx2, baseline.");
#if defined(RECPIPE_X86_DISPATCH)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
  if (want == "auto" || want.empty()) {
    return avx512 ? Isa::kAvx512 : avx2 ? Isa::kAvx2 : Isa::kBaseline;
  }
  TORCH_CHECK(want != "avx512" || avx512, "recpipe: RECPIPE_ISA=avx512 but this CPU lacks it; unset RECPIPE_ISA "
              "or pick avx2 / baseline.");
  TORCH_CHECK(want != "avx2" || avx2, "recpipe: RECPIPE_ISA=avx2 but this CPU lacks it; unset RECPIPE_ISA or "
              "pick baseline.");
  return want == "avx512" ? Isa::kAvx512 : want == "avx2" ? Isa::kAvx2 : Isa::kBaseline;
#else
  TORCH_CHECK(want == "auto" || want.empty() || want == "baseline", "recpipe: RECPIPE_ISA=", want,
              " but this build is portable (built for a non-x86 CPU or with RECPIPE_PORTABLE=1) and compiles the "
              "baseline loop only; unset RECPIPE_ISA or pick baseline.");
  return Isa::kBaseline;
#endif
}

template <typename index_t, typename key_t>
void hash_keys(Isa isa, const HashPermutation& perm, const index_t* ids, int64_t m, key_t* keys) {
#if defined(RECPIPE_X86_DISPATCH)
  if (isa == Isa::kAvx512) {
    hash_keys_avx512(perm, ids, m, keys);
    return;
  }
  if (isa == Isa::kAvx2) {
    hash_keys_avx2(perm, ids, m, keys);
    return;
  }
#endif
  (void)isa;  // the portable build has the baseline loop only
  hash_keys_baseline(perm, ids, m, keys);
}

struct BadId {
  int64_t position = -1;  // first id of the chunk outside its table, -1 if none
  int64_t feature = -1;
};

// Stage 1 for the bags [b0, b1) of one feature routed by rule kDist: each id
// counted in new_lengths[owner][b] (zeroed by the caller); hash_roundrobin keeps
// its keys H(id) in keys[i] for stage 3. Returns the first id outside its table, or -1.
template <int kDist, int kBounds, typename key_t, typename index_t, typename offset_t>
int64_t count_bags(Isa isa, const FeatureRoute& route, const int64_t* bounds, const index_t* __restrict__ ids,
                   const int64_t* __restrict__ off, int64_t b0, int64_t b1, int64_t FB, key_t* __restrict__ keys,
                   offset_t* __restrict__ nl) {
  using uindex_t = std::make_unsigned_t<index_t>;
  const FeatureRoute r = route;  // a local copy: its fields stay in registers
  if constexpr (kDist == kHashRoundRobin) {
    hash_keys(isa, r.perm, ids + off[b0], off[b1] - off[b0], keys + off[b0]);
  }
  int64_t bad = -1;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t e = off[b + 1];
    for (int64_t i = off[b]; i < e; ++i) {
      const uint64_t uid = static_cast<uindex_t>(ids[i]);
      uint64_t p = 0;
      uint64_t l = 0;
      if (!r.template place<kDist, kBounds>(uid, kDist == kHashRoundRobin ? keys[i] : uid, bounds, &p, &l) && bad < 0) {
        bad = i;
      }
      ++nl[static_cast<int64_t>(p) * FB + b];
    }
  }
  return bad;
}

// Stage 3 for the bags [b0, b1): each id routed again (from its key for
// hash_roundrobin) to its rank's next slot, cur[owner]++. kExtra: whether any of
// dst / pos / map is written (when false they are null at compile time, so the
// common call's loop carries no tests for them).
template <int kDist, int kBounds, bool kExtra, typename key_t, typename index_t>
void scatter_bags(const FeatureRoute& route, const int64_t* bounds, const index_t* __restrict__ ids,
                  const int64_t* __restrict__ off, int64_t b0, int64_t b1, const key_t* __restrict__ keys,
                  int64_t* __restrict__ cur, index_t* __restrict__ out, index_t* __restrict__ dst,
                  index_t* __restrict__ pos, index_t* __restrict__ map) {
  using uindex_t = std::make_unsigned_t<index_t>;
  // r by value and inlined at both calls: its fields stay in registers (a reference could
  // alias the output stores), and the copy with table_size 0 loses the check
  auto run = [&](const FeatureRoute r) __attribute__((always_inline)) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t s = off[b];
      const int64_t e = off[b + 1];
      for (int64_t i = s; i < e; ++i) {
        const uint64_t uid = static_cast<uindex_t>(ids[i]);
        uint64_t p = 0;
        uint64_t l = 0;
        r.template place<kDist, kBounds>(uid, kDist == kHashRoundRobin ? keys[i] : uid, bounds, &p, &l);
        const int64_t at = cur[p]++;
        __builtin_prefetch(out + at + kPrefetchAhead, 1, 1);  // the rank's output line 4 ahead (speed only)
        constexpr index_t* kNone = nullptr;
        store_routed(at, i, s, p, l, out, kExtra ? dst : kNone, kExtra ? pos : kNone, kExtra ? map : kNone);
      }
    }
  };
  if (route.route_bad) {
    run(route);  // ids outside the table were counted at their routed owner: route them again
  } else {
    // stage 1 refused every id outside the table: the same loop without the check (the
    // compiler drops it for table_size 0: speed only, the routing is the same)
    FeatureRoute r = route;
    r.table_size = 0;
    run(r);
  }
}

template <typename index_t, typename offset_t>
void bucketize(const BucketizeCall& call, Tensor& new_lengths, Tensor& new_indices, Tensor* dest, Tensor* new_pos,
               Tensor* mapping) {
  const BucketizeArgs& a = call.args;
  const std::vector<FeatureRoute>& routes = call.routes;
  const std::vector<int64_t>& fbag = call.fbag;
  const int64_t n = a.indices.numel();
  const int64_t FB = a.lengths.numel();
  const int64_t W = a.my_size;
  const std::vector<int64_t> off = bag_offsets<offset_t>(a.lengths, n);
  const std::vector<int64_t> chunk = chunk_bags(off);
  const int64_t chunks = static_cast<int64_t>(chunk.size()) - 1;
  const index_t* ids = a.indices.const_data_ptr<index_t>();
  const int64_t* bnd = call.bounds.const_data_ptr<int64_t>();
  const Isa isa = call_isa();
  const HashKeys keys(routes, n);
  offset_t* nl = new_lengths.mutable_data_ptr<offset_t>();

  // 1. count every id in its (rank, bag); the chunk's total per rank.
  std::vector<int64_t> total(chunks * W, 0);
  std::vector<BadId> bad(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b0 = chunk[c];
      const int64_t nb = chunk[c + 1] - b0;
      for (int64_t p = 0; p < W; ++p) {
        std::memset(nl + p * FB + b0, 0, sizeof(offset_t) * nb);
      }
      for_each_feature_run(fbag, b0, b0 + nb, [&](int64_t f, int64_t r0, int64_t r1) {
        with_dist(routes[f], [&](auto dist, auto has_bounds, auto key) {
          using key_t = typename decltype(key)::type;
          const int64_t i = count_bags<decltype(dist)::value, decltype(has_bounds)::value, key_t>(
              isa, routes[f], bnd, ids, off.data(), r0, r1, FB, keys.get<key_t>(), nl);
          if (i >= 0 && bad[c].position < 0) {
            bad[c] = BadId{i, f};
          }
        });
      });
      for (int64_t p = 0; p < W; ++p) {
        const offset_t* row = nl + p * FB + b0;
        total[c * W + p] = std::accumulate(row, row + nb, int64_t{0});
      }
    }
  });
  for (const BadId& e : bad) {
    if (e.position >= 0) {
      const FeatureRoute& r = routes[e.feature];
      TORCH_CHECK_INDEX(false, "recpipe: `indices[", e.position, "]` = ", static_cast<int64_t>(ids[e.position]),
                        " (feature ", e.feature, ", ", r.dist == kRoundRobin ? "roundrobin" : "hash_roundrobin",
                        ") is outside [0, table_sizes[", e.feature, "] = ", r.table_size,
                        "); ids must lie in the table's range: hash or clamp raw ids upstream",
                        r.dist == kRoundRobin ? ", or pass table_sizes 0 for raw ids"
                                              : ", or pass table_sizes 0 for raw int64 keys (a dynamic table)",
                        ", or pass route_bad_ids=True to send them past their owner's rows "
                        "(its embedding kernel's bounds check then applies, as for torchrec's row-wise tables).");
    }
  }

  // 2. cursors: a chunk's ids of rank p land contiguously (its bags are
  // consecutive), after rank p's ids of earlier chunks and all lower ranks' ids.
  int64_t start = 0;
  for (int64_t p = 0; p < W; ++p) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t t = total[c * W + p];
      total[c * W + p] = start;
      start += t;
    }
  }

  // 3. scatter every id to its rank's next slot, bags in order.
  index_t* out = new_indices.mutable_data_ptr<index_t>();
  index_t* dst = dest != nullptr ? dest->mutable_data_ptr<index_t>() : nullptr;
  index_t* pos = new_pos != nullptr ? new_pos->mutable_data_ptr<index_t>() : nullptr;
  index_t* map = mapping != nullptr ? mapping->mutable_data_ptr<index_t>() : nullptr;
  const bool extra = dst != nullptr || pos != nullptr || map != nullptr;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* cur = total.data() + c * W;
      for_each_feature_run(fbag, chunk[c], chunk[c + 1], [&](int64_t f, int64_t r0, int64_t r1) {
        with_dist(routes[f], [&](auto dist, auto has_bounds, auto key) {
          constexpr int kDist = decltype(dist)::value;
          constexpr int kBounds = decltype(has_bounds)::value;
          using key_t = typename decltype(key)::type;
          const key_t* k = keys.get<key_t>();
          if (extra) {
            scatter_bags<kDist, kBounds, true>(routes[f], bnd, ids, off.data(), r0, r1, k, cur, out, dst, pos, map);
          } else {
            scatter_bags<kDist, kBounds, false>(routes[f], bnd, ids, off.data(), r0, r1, k, cur, out, dst, pos, map);
          }
        });
      });
    }
  });
}

// 4. new_weights[dest[i]] = weights[i], rows of `row_bytes` bytes.
template <typename index_t>
void scatter_rows(const Tensor& src, const Tensor& dest, Tensor& out) {
  const int64_t n = dest.numel();
  const int64_t row = src.numel() == 0 ? 0 : src.nbytes() / n;
  const char* s = static_cast<const char*>(src.const_data_ptr());
  char* o = static_cast<char*>(out.mutable_data_ptr());
  const index_t* d = dest.const_data_ptr<index_t>();
  at::parallel_for(0, n, kIdsPerChunk, [&](int64_t i0, int64_t i1) {
    auto copy = [&](auto width) {  // fixed-size copies for the common rows
      constexpr size_t kBytes = decltype(width)::value;
      for (int64_t i = i0; i < i1; ++i) {
        std::memcpy(o + static_cast<int64_t>(d[i]) * kBytes, s + i * kBytes, kBytes);
      }
    };
    if (row == 2) {
      copy(std::integral_constant<size_t, 2>());
    } else if (row == 4) {
      copy(std::integral_constant<size_t, 4>());
    } else if (row == 8) {
      copy(std::integral_constant<size_t, 8>());
    } else {
      for (int64_t i = i0; i < i1; ++i) {
        std::memcpy(o + static_cast<int64_t>(d[i]) * row, s + i * row, row);
      }
    }
  });
}

BucketizeResult block_bucketize_sparse_features_cpu(
    const Tensor& lengths_in, const Tensor& indices_in, const Tensor& block_sizes, const Tensor& dist_types,
    int64_t my_size, bool sequence, bool bucketize_pos, const std::optional<Tensor>& weights_in,
    const std::optional<Tensor>& table_sizes, int64_t seed, bool keep_orig_idx,
    const std::optional<Tensor>& batch_size_per_feature, int64_t /*max_B: unused, see BucketizeArgs*/,
    const std::optional<std::vector<Tensor>>& block_bucketize_pos, const std::optional<Tensor>& total_num_blocks,
    const std::optional<Tensor>& keep_orig_idx_per_feature, bool return_bucket_mapping, bool route_bad_ids) {
  const BucketizeCall call = prepare_bucketize({lengths_in, indices_in, block_sizes, dist_types, my_size, sequence,
                                                 bucketize_pos, weights_in, table_sizes, seed, keep_orig_idx,
                                                 batch_size_per_feature, block_bucketize_pos, total_num_blocks,
                                                 keep_orig_idx_per_feature, return_bucket_mapping, route_bad_ids});
  const BucketizeArgs& a = call.args;
  BucketizeOutputs out = allocate_bucketize_outputs(call, /*zero_lengths=*/false);  // bucketize clears its rows
  auto ptr = [](std::optional<Tensor>& t) { return t.has_value() ? &*t : nullptr; };
  AT_DISPATCH_INDEX_TYPES(a.indices.scalar_type(), "recpipe_bucketize", [&] {
    using ids_t = index_t;
    AT_DISPATCH_INDEX_TYPES(a.lengths.scalar_type(), "recpipe_bucketize_lengths", [&] {
      bucketize<ids_t, index_t>(call, out.new_lengths, out.new_indices, ptr(out.dest), ptr(out.new_pos),
                                ptr(out.mapping));
    });
    if (a.weights.has_value()) {
      scatter_rows<ids_t>(*a.weights, *out.dest, *out.new_weights);
    }
  });
  return out.result(a);
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
      // unsigned: raw keys' slots reach 2^64 - 1 (is_roundrobin_slot keeps it from wrapping)
      const uint64_t slot = static_cast<uint64_t>(li[i]) * static_cast<uint64_t>(world_size) + static_cast<uint64_t>(rk[i]);
      o[i] = static_cast<int64_t>(perm.inverse(slot));
    }
  });
  for (const int64_t i : bad_at) {
    if (i >= 0) {
      fail_not_a_slot(i, rk[i], li[i], table_size, world_size);
    }
  }
  return out.to(local_ids_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(recpipe, CPU, m) {
  m.impl("block_bucketize_sparse_features", &block_bucketize_sparse_features_cpu);
  m.impl("hash_roundrobin_global_ids", &hash_roundrobin_global_ids_cpu);
}

}  // namespace recpipe
