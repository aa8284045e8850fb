// recpipe: CPU kernels of the routing ops (schemas: library.cpp).
//
// block_bucketize_sparse_features splits every bag of a KJT's flat
// lengths/indices by owner rank. Output layout is fbgemm's: new_lengths is
// [W * F * B] ordered (rank, feature, sample); indices follow the same order;
// order inside a bag is preserved.
//
// CPU algorithm (two passes over the ids, no [W*F*B] offsets array):
//   1. owners: per chunk of bags (one chunk per thread), compute each id's
//      owner rank (stored as uint8/uint16/uint32 by W), count new_lengths and
//      per-(chunk, rank) totals; hash_roundrobin keeps its local ids in a
//      scratch buffer so the hash runs once.
//   2. scatter: rank-major output means an id's position is
//      base[rank] + (ids of that rank in earlier bags) + (earlier ids of that
//      rank in its bag); walking the ids in order with one cursor per rank,
//      started at base[rank] + totals of earlier chunks, yields it directly.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "bucketize_math.h"
#include "checks.h"

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

// The permutation rounds in 32-bit lanes: bit-identical to
// HashPermutation::round_fwd whenever mask < 2^32 (b <= 32: tables up to 4G
// rows), since the low b bits of sums and products depend only on the low b
// bits of their operands. Written branch-free over a block so the compiler
// vectorizes it (8 lanes with AVX2: vpmulld).
struct Perm32 {
  uint32_t mask;
  uint32_t s;
  uint32_t add[HashPermutation::kRounds];
  uint32_t mul[HashPermutation::kRounds];

  explicit Perm32(const HashPermutation& p)
      : mask(static_cast<uint32_t>(p.mask)), s(static_cast<uint32_t>(p.s)) {
    for (int r = 0; r < HashPermutation::kRounds; ++r) {
      add[r] = static_cast<uint32_t>(p.add[r]);
      mul[r] = static_cast<uint32_t>(p.mul[r]);
    }
  }
};

// out[j] = y1 = P(in[j]) if y1 < n else P(y1): the first two cycle-walking
// steps, branch-free (the ternary becomes a blend), for n <= 2^32 (last = n - 1).
#define RECPIPE_PERM32_WALK2_BODY                                    \
  for (int64_t j = 0; j < m; ++j) {                                  \
    uint32_t x = in[j];                                              \
    for (int r = 0; r < HashPermutation::kRounds; ++r) {             \
      x = (x + p.add[r]) & p.mask;                                   \
      x ^= x >> p.s;                                                 \
      x = (x * p.mul[r]) & p.mask;                                   \
      x ^= x >> p.s;                                                 \
    }                                                                \
    uint32_t y = x;                                                  \
    for (int r = 0; r < HashPermutation::kRounds; ++r) {             \
      y = (y + p.add[r]) & p.mask;                                   \
      y ^= y >> p.s;                                                 \
      y = (y * p.mul[r]) & p.mask;                                   \
      y ^= y >> p.s;                                                 \
    }                                                                \
    out[j] = static_cast<uindex_t>(x > last ? y : x);                \
  }

template <typename uindex_t>
void perm32_walk2_generic(const Perm32& p, uint32_t last, const uint32_t* in, uindex_t* out, int64_t m) {
  RECPIPE_PERM32_WALK2_BODY
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
template <typename uindex_t>
__attribute__((target("avx2"))) void perm32_walk2_avx2(
    const Perm32& p,
    uint32_t last,
    const uint32_t* in,
    uindex_t* out,
    int64_t m) {
  RECPIPE_PERM32_WALK2_BODY
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif
#undef RECPIPE_PERM32_WALK2_BODY

template <typename uindex_t>
inline void perm32_walk2(const Perm32& p, uint32_t last, const uint32_t* in, uindex_t* out, int64_t m) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (cpu_has_avx2()) {
    perm32_walk2_avx2<uindex_t>(p, last, in, out, m);
    return;
  }
#endif
  perm32_walk2_generic<uindex_t>(p, last, in, out, m);
}

// h[i] = H(ids[i]) for i in [s, e) of one hash_roundrobin feature.
// The permutation runs on blocks of ids unconditionally (branch-free,
// independent iterations the CPU overlaps; for tables below 2^32 rows two
// applications run vectorized in 32-bit lanes); only the ids still outside
// [0, n) are cycle-walked further, compacted into a pending list: a per-id
// do/while would mispredict on ~(2^b - n) / 2^b of the ids. Out-of-range ids
// are recorded in `bad` (first one) and hashed as 0; the call fails after the pass.
template <typename index_t, typename uindex_t, typename owner_t>
void hash_ids(
    const HashPermutation& perm,
    uint64_t n,
    const index_t* ids,
    int64_t s,
    int64_t e,
    int64_t feature,
    const FastDivU64& div_world,
    uint64_t world,
    uindex_t* out,
    owner_t* owner,
    BadId& bad) {
  constexpr int64_t kBlock = 512;
  int32_t pending[kBlock];
  const bool narrow = perm.mask <= 0xFFFFFFFFULL;
  const Perm32 p32(perm);
  uint32_t a32[kBlock];
  const uint32_t last = narrow ? static_cast<uint32_t>(n - 1) : 0u;
  for (int64_t b0 = s; b0 < e; b0 += kBlock) {
    const int64_t m = std::min<int64_t>(kBlock, e - b0);
    uindex_t* h = out + b0;  // hashed in place: no staging copy
    // Range check as a reduction (vectorizes); the first bad id is located only
    // when there is one.
    uint32_t any_bad = 0;
    for (int64_t j = 0; j < m; ++j) {
      const uint64_t u = static_cast<uint64_t>(static_cast<int64_t>(ids[b0 + j]));
      const uint32_t out_of_range = u >= n;  // negative ids are huge as unsigned
      any_bad |= out_of_range;
      a32[j] = out_of_range ? 0u : static_cast<uint32_t>(u);
    }
    if (any_bad && bad.position < 0) {
      for (int64_t j = 0; j < m; ++j) {
        const index_t raw = ids[b0 + j];
        if (raw < 0 || static_cast<uint64_t>(raw) >= n) {
          bad = BadId{b0 + j, feature, static_cast<int64_t>(raw)};
          break;
        }
      }
    }
    int32_t np = 0;
    if (narrow) {
      perm32_walk2<uindex_t>(p32, last, a32, h, m);  // P(x), or P(P(x)) where P(x) >= n
    } else {
      for (int64_t j = 0; j < m; ++j) {
        const index_t raw = ids[b0 + j];
        const bool ok = raw >= 0 && static_cast<uint64_t>(raw) < n;
        h[j] = static_cast<uindex_t>(perm.round_fwd(ok ? static_cast<uint64_t>(raw) : 0));
      }
    }
    // Split each h into owner rank and local id while the block is in cache;
    // ids whose h is still outside [0, n) are queued (with h) for more walking
    // and split again when they land. Writes are unconditional (branch-free).
    uint64_t pending_h[kBlock];
    for (int32_t j = 0; j < m; ++j) {
      const uint64_t hv = static_cast<uint64_t>(h[j]);
      const uint64_t q = div_world.div(hv);
      owner[b0 + j] = static_cast<owner_t>(hv - q * world);
      h[j] = static_cast<uindex_t>(q);
      pending[np] = j;
      pending_h[np] = hv;
      np += hv >= n;
    }
    while (np > 0) {
      int32_t next = 0;
      for (int32_t k = 0; k < np; ++k) {
        const int32_t j = pending[k];
        const uint64_t y = perm.round_fwd(pending_h[k]);
        const uint64_t q = div_world.div(y);
        owner[b0 + j] = static_cast<owner_t>(y - q * world);
        h[j] = static_cast<uindex_t>(q);
        pending[next] = j;
        pending_h[next] = y;
        next += y >= n;
      }
      np = next;
    }
  }
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

  // Scratch: owner per id, and (hash features only) local id per id.
  std::unique_ptr<owner_t[]> owner(new owner_t[std::max<int64_t>(N, 1)]);
  bool any_hash = false;
  for (const auto& r : routes) {
    any_hash |= (r.dist == kHashRoundRobin);
  }
  std::unique_ptr<uindex_t[]> hashed_local;
  if (any_hash) {
    hashed_local.reset(new uindex_t[std::max<int64_t>(N, 1)]);
  }

  const int64_t max_chunks = std::max<int64_t>(1, at::get_num_threads());
  // Below ~64k ids a second thread costs more than it saves.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(max_chunks, N / 65536));
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
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<int32_t> block_counts(W * kBags);
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* cnt = chunk_count.data() + c * W;
      for (int64_t g0 = bounds[c]; g0 < bounds[c + 1]; g0 += kBags) {
        const int64_t g1 = std::min<int64_t>(g0 + kBags, bounds[c + 1]);
        std::fill(block_counts.begin(), block_counts.end(), 0);
        if (any_hash) {
          // hash_roundrobin ids of this bag block, per run of one feature:
          // h = H(id) into hashed_local (split into rank / local id below).
          for (int64_t r0 = g0; r0 < g1;) {
            const int64_t f = r0 / B;
            const int64_t r1 = std::min<int64_t>(g1, (f + 1) * B);
            if (routes[f].dist == kHashRoundRobin) {
              hash_ids<index_t, uindex_t, owner_t>(
                  routes[f].perm, routes[f].table_size, idx, offsets[r0], offsets[r1], f,
                  div_world, uW, hashed_local.get(), owner.get(), bad[c]);
            }
            r0 = r1;
          }
        }
        for (int64_t bt = g0; bt < g1; ++bt) {
          int32_t* lc = block_counts.data() + (bt - g0);  // lc[p * kBags]
          const int64_t f = bt / B;
          const FeatureRoute& r = routes[f];
          const int64_t s = offsets[bt];
          const int64_t e = offsets[bt + 1];
          if (r.dist == kContinuous) {
            for (int64_t i = s; i < e; ++i) {
              uint64_t p;
              uindex_t loc;
              route_continuous<uindex_t>(
                  static_cast<uindex_t>(idx[i]), r.block, uW, r.div_block, div_world, &p, &loc);
              owner[i] = static_cast<owner_t>(p);
              lc[p * kBags]++;
            }
          } else if (r.dist == kRoundRobin) {
            for (int64_t i = s; i < e; ++i) {
              uint64_t p;
              uindex_t loc;
              route_roundrobin<uindex_t>(static_cast<uindex_t>(idx[i]), uW, div_world, &p, &loc);
              owner[i] = static_cast<owner_t>(p);
              lc[p * kBags]++;
            }
          } else {
            // owners and local ids were computed for the whole bag block above.
            for (int64_t i = s; i < e; ++i) {
              lc[static_cast<uint64_t>(owner[i]) * kBags]++;
            }
          }
        }
        const int64_t nb = g1 - g0;
        for (int64_t p = 0; p < W; ++p) {
          const int32_t* row = block_counts.data() + p * kBags;
          offset_t* dst = nl + p * FB + g0;
          int64_t sum = 0;
          for (int64_t j = 0; j < nb; ++j) {
            dst[j] = static_cast<offset_t>(row[j]);
            sum += row[j];
          }
          cnt[p] += sum;
        }
      }
    }
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
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* cur = cursor.data() + c * W;
      for (int64_t bt = bounds[c]; bt < bounds[c + 1]; ++bt) {
        const int64_t f = bt / B;
        const FeatureRoute& r = routes[f];
        const int64_t s = offsets[bt];
        const int64_t e = offsets[bt + 1];
        for (int64_t i = s; i < e; ++i) {
          const uint64_t p = owner[i];
          const int64_t pos = cur[p]++;
          const uindex_t uid = static_cast<uindex_t>(idx[i]);
          uindex_t loc;
          if (keep_orig_idx) {
            loc = uid;
          } else if (r.dist == kContinuous) {
            const uindex_t ub = static_cast<uindex_t>(r.block * uW);
            loc = uid < ub ? static_cast<uindex_t>(static_cast<uint64_t>(uid) - p * r.block)
                           : static_cast<uindex_t>(div_world.div(static_cast<uint64_t>(uid)));
          } else if (r.dist == kRoundRobin) {
            loc = static_cast<uindex_t>(div_world.div(static_cast<uint64_t>(uid)));
          } else {
            loc = hashed_local[i];
          }
          out_idx[pos] = static_cast<index_t>(loc);
          if constexpr (!std::is_same_v<wbits_t, void>) {
            w_out[pos] = w_in[i];
          }
          if (pos_out != nullptr) {
            pos_out[pos] = static_cast<index_t>(i - s);
          }
          if (perm_out != nullptr) {
            perm_out[i] = static_cast<index_t>(pos);
          }
        }
      }
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
        lengths, indices, routes, W, sequence, bucketize_pos, weights, keep_orig_idx, offsets,
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
      const int64_t h = li[i] * world_size + rk[i];
      if (rk[i] < 0 || rk[i] >= world_size || li[i] < 0 || h < 0 || h >= table_size) {
        if (bad_at[tid] < 0) {
          bad_at[tid] = i;
        }
        o[i] = -1;
        continue;
      }
      o[i] = static_cast<int64_t>(perm.inverse(static_cast<uint64_t>(h)));
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
