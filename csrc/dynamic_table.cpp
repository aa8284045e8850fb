// recpipe: the dynamic table's key index kernels (CPU).
//
// A dynamic shard maps raw int64 keys to slots [0, T), T = B * S, in B buckets
// of S slots (the dynamic table spec). Index state: keys [T], scores [T],
// sizes [B]; bucket b's used slots are [b*S, b*S + sizes[b]).
//
//   dynamic_hash_plan  pure (mutates nothing): for ascending unique keys
//                      `uniq`, the slot holding each key (found, -1: absent)
//                      and, for the absent keys that want a slot, the slot
//                      they would take (slot, -1: none): per bucket, the
//                      missing keys in ascending order take its free slots in
//                      order, then its victims = the used slots no key of the
//                      call holds, by (score asc, slot asc); the rest get -1.
//
// Cost: O(n * S) probing, parallel over keys, plus O(m) for the m keys that
// want a slot (a hash map of their buckets, in key order so several misses of
// one bucket are ranked deterministically). Victims are computed only for the
// buckets whose free slots run out, with the hits' slots in a hash set of
// O(hits) entries: no temporary scales with T.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "dynamic_hash.h"

namespace recpipe {
namespace {

// Raw views of a plan call's arguments.
struct PlanArgs {
  const int64_t* uniq;
  const bool* want;  // nullptr: no key wants a slot
  const int64_t* keys;
  const int64_t* scores;
  const int64_t* sizes;
  int64_t n;
  int64_t S;
  DynamicBuckets buckets;
};

void check_index_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), "recpipe::dynamic_hash_plan: `", name, "` is on ", t.device(),
              "; the CPU kernel takes CPU tensors (move every argument to one device).");
  TORCH_CHECK(t.dim() == 1, "recpipe::dynamic_hash_plan: `", name, "` must be 1-D, got shape ", t.sizes(),
              "; flatten it with `.view(-1)`.");
  TORCH_CHECK(t.scalar_type() == dtype, "recpipe::dynamic_hash_plan: `", name, "` must be ", dtype, ", got ",
              t.scalar_type(), "; convert it with `.to(torch.", dtype == at::kBool ? "bool" : "int64", ")`.");
  TORCH_CHECK(t.is_contiguous(), "recpipe::dynamic_hash_plan: `", name,
              "` must be contiguous; pass `.contiguous()` (the index state is read in place, never copied).");
}

void check_plan_args(const at::Tensor& uniq, const std::optional<at::Tensor>& want_insert, const at::Tensor& keys,
                     const at::Tensor& scores, const at::Tensor& sizes, int64_t bucket_slots) {
  check_index_tensor(uniq, "uniq", at::kLong);
  if (want_insert.has_value()) {
    check_index_tensor(*want_insert, "want_insert", at::kBool);
    TORCH_CHECK(want_insert->numel() == uniq.numel(), "recpipe::dynamic_hash_plan: `want_insert` has ",
                want_insert->numel(), " entries but `uniq` has ", uniq.numel(),
                "; pass one flag per unique key (or None: no key wants a slot).");
  }
  check_index_tensor(keys, "keys", at::kLong);
  check_index_tensor(scores, "scores", at::kLong);
  check_index_tensor(sizes, "sizes", at::kLong);
  TORCH_CHECK(bucket_slots >= 1, "recpipe::dynamic_hash_plan: `bucket_slots` must be >= 1, got ", bucket_slots,
              "; pass the slots per bucket of the index (BUCKET_SLOTS).");
  const int64_t B = sizes.numel();
  TORCH_CHECK(B >= 1, "recpipe::dynamic_hash_plan: `sizes` is empty; an index has at least one bucket.");
  TORCH_CHECK(keys.numel() % bucket_slots == 0 && keys.numel() / bucket_slots == B,
              "recpipe::dynamic_hash_plan: `keys` has ", keys.numel(), " slots but `sizes` has ", B,
              " buckets of `bucket_slots` = ", bucket_slots, "; pass keys of B * bucket_slots entries.");
  TORCH_CHECK(scores.numel() == keys.numel(), "recpipe::dynamic_hash_plan: `scores` has ", scores.numel(),
              " entries but `keys` has ", keys.numel(), "; pass one score per slot.");
}

// Lowers `target` to `value` if smaller (records the first bad index of a parallel pass).
void atomic_min(std::atomic<int64_t>& target, int64_t value) {
  int64_t cur = target.load(std::memory_order_relaxed);
  while (value < cur && !target.compare_exchange_weak(cur, value, std::memory_order_relaxed)) {
  }
}

constexpr int64_t kNone = INT64_MAX;
constexpr int64_t kGroup = 8;  // keys whose bucket lines are prefetched together

// Phase 1 (parallel over keys): found[i], and slot[i] = bucket of key i when it
// is missing and wants a slot (-1 otherwise), for phase 2 to rank. Checks that
// uniq ascends strictly and that the sizes of the buckets it touches are in [0, S].
void find_keys(const PlanArgs& a, int64_t* found, int64_t* slot) {
  std::atomic<int64_t> bad_order{kNone};
  std::atomic<int64_t> bad_size{kNone};
  at::parallel_for(0, a.n, 2048, [&](int64_t begin, int64_t end) {
    int64_t bkt[kGroup];
    for (int64_t g0 = begin; g0 < end; g0 += kGroup) {
      const int64_t g1 = std::min(end, g0 + kGroup);
      for (int64_t i = g0; i < g1; ++i) {
        const int64_t b = a.buckets.bucket(a.uniq[i]);
        bkt[i - g0] = b;
        __builtin_prefetch(a.sizes + b);
        __builtin_prefetch(a.keys + b * a.S);
      }
      for (int64_t i = g0; i < g1; ++i) {
        const int64_t key = a.uniq[i];
        if (i > 0 && a.uniq[i - 1] >= key) {
          atomic_min(bad_order, i);
        }
        const int64_t b = bkt[i - g0];
        const int64_t sz = a.sizes[b];
        int64_t pos = -1;
        if (sz < 0 || sz > a.S) {
          atomic_min(bad_size, b);
        } else {
          const int64_t* kb = a.keys + b * a.S;
          for (int64_t j = 0; j < sz; ++j) {
            if (kb[j] == key) {
              pos = b * a.S + j;
              break;
            }
          }
        }
        found[i] = pos;
        slot[i] = pos < 0 && a.want != nullptr && a.want[i] ? b : -1;
      }
    }
  });
  const int64_t i = bad_order.load();
  TORCH_CHECK(i == kNone, "recpipe::dynamic_hash_plan: `uniq` must ascend strictly, but uniq[", i - 1, "] = ",
              a.uniq[i - 1], " >= uniq[", i, "] = ", a.uniq[i], "; pass torch.unique(keys) (sorted, unique).");
  const int64_t b = bad_size.load();
  TORCH_CHECK(b == kNone, "recpipe::dynamic_hash_plan: `sizes[", b, "]` = ", a.sizes[b], " is outside [0, ", a.S,
              "]; the index state is corrupt (sizes counts the used slots of each bucket).");
}

// Phase 2 state of one bucket that missing keys want slots in (32 bytes).
struct BucketPlan {
  int64_t bucket = -1;   // -1: an empty cell of BucketTable
  int32_t count = 0;     // missing keys of the bucket that want a slot (ranked so far)
  int32_t taken = 0;     // victims handed out so far
  int64_t aux = -1;      // offset of the protected-slot bitmask words (bit j: slot b*S + j held by
                         // the call), then, once victim_len >= 0, of the victims in the pool
  int32_t victim_len = -1;  // victims computed (-1: not yet)
  int32_t pad = 0;
};

// Open-addressing map bucket -> BucketPlan (linear probing, power-of-two capacity
// at least twice the entries): O(missing keys) memory.
class BucketTable {
 public:
  explicit BucketTable(int64_t entries) {
    int64_t cap = 16;
    while (cap < 2 * entries) {
      cap *= 2;
    }
    mask_ = static_cast<uint64_t>(cap - 1);
    cells_.resize(static_cast<size_t>(cap));
  }

  void prefetch(int64_t b) const { __builtin_prefetch(cells_.data() + home(b)); }

  // The plan of bucket b (>= 0), inserted when absent.
  BucketPlan& get(int64_t b) {
    uint64_t h = home(b);
    while (cells_[h].bucket != b) {
      if (cells_[h].bucket < 0) {
        cells_[h].bucket = b;
        break;
      }
      h = (h + 1) & mask_;
    }
    return cells_[h];
  }

  // The plan of bucket b, nullptr when absent.
  BucketPlan* find(int64_t b) {
    for (uint64_t h = home(b);; h = (h + 1) & mask_) {
      if (cells_[h].bucket == b) {
        return &cells_[h];
      }
      if (cells_[h].bucket < 0) {
        return nullptr;
      }
    }
  }

 private:
  uint64_t home(int64_t b) const { return mix64(static_cast<uint64_t>(b)) & mask_; }

  uint64_t mask_ = 0;
  std::vector<BucketPlan> cells_;
};

constexpr int64_t kAhead = 16;  // phase 2 prefetches the cells of the key this far ahead

// Phase 2 scratch shared by its passes.
struct InsertPlan {
  BucketTable table;
  int64_t words;                         // bitmask words per bucket: ceil(S / 64)
  std::vector<uint64_t> protected_bits;  // `words` per bucket that needs victims
  std::vector<int64_t> pool;             // victims of those buckets, concatenated
  std::vector<std::pair<int64_t, int64_t>> scratch;  // (score, slot) of one bucket
};

// Pass A (ascending keys): rank each missing key that wants a slot in its
// bucket; free slots are assigned here, the rest are left pending as -2 - b.
// Returns whether any key is pending (some bucket needs victims).
bool rank_misses(const PlanArgs& a, InsertPlan& p, int64_t* slot) {
  bool pending = false;
  for (int64_t i = 0; i < a.n; ++i) {
    if (i + kAhead < a.n && slot[i + kAhead] >= 0) {
      p.table.prefetch(slot[i + kAhead]);
      __builtin_prefetch(a.sizes + slot[i + kAhead]);
    }
    const int64_t b = slot[i];
    if (b < 0) {
      continue;
    }
    BucketPlan& e = p.table.get(b);
    const int64_t r = e.count++;
    const int64_t used = a.sizes[b];
    if (r < a.S - used) {
      slot[i] = b * a.S + used + r;
      continue;
    }
    if (e.aux < 0) {
      e.aux = static_cast<int64_t>(p.protected_bits.size());
      p.protected_bits.resize(p.protected_bits.size() + static_cast<size_t>(p.words), 0);
    }
    slot[i] = -2 - b;
    pending = true;
  }
  return pending;
}

// Pass B: marks the slots found by this call in the buckets that need victims.
void protect_hits(const PlanArgs& a, InsertPlan& p, const int64_t* found) {
  const FastDivU64 per_bucket(static_cast<uint64_t>(a.S));
  auto bucket_of = [&](int64_t s) { return static_cast<int64_t>(per_bucket.div(static_cast<uint64_t>(s))); };
  for (int64_t i = 0; i < a.n; ++i) {
    if (i + kAhead < a.n && found[i + kAhead] >= 0) {
      p.table.prefetch(bucket_of(found[i + kAhead]));
    }
    const int64_t s = found[i];
    if (s < 0) {
      continue;
    }
    const int64_t b = bucket_of(s);
    const BucketPlan* e = p.table.find(b);
    if (e != nullptr && e->aux >= 0) {
      const int64_t j = s - b * a.S;
      p.protected_bits[static_cast<size_t>(e->aux + j / 64)] |= uint64_t{1} << (j % 64);
    }
  }
}

// The victims bucket b's pending keys take (its unprotected used slots by
// (score, slot), as many as it has pending keys), appended to the pool.
void bucket_victims(const PlanArgs& a, InsertPlan& p, int64_t b, BucketPlan& e) {
  const int64_t used = a.sizes[b];
  const int64_t k = e.count - (a.S - used);
  const uint64_t* bits = p.protected_bits.data() + e.aux;
  p.scratch.clear();
  for (int64_t j = 0; j < used; ++j) {
    if (((bits[j / 64] >> (j % 64)) & 1) == 0) {
      const int64_t s = b * a.S + j;
      p.scratch.emplace_back(a.scores[s], s);
    }
  }
  const auto take = static_cast<std::ptrdiff_t>(std::min<int64_t>(k, static_cast<int64_t>(p.scratch.size())));
  std::partial_sort(p.scratch.begin(), p.scratch.begin() + take, p.scratch.end());
  e.aux = static_cast<int64_t>(p.pool.size());
  e.victim_len = static_cast<int32_t>(take);
  for (std::ptrdiff_t v = 0; v < take; ++v) {
    p.pool.push_back(p.scratch[static_cast<size_t>(v)].second);
  }
}

// Pass C (ascending keys): each pending key takes its bucket's next victim, or -1.
void take_victims(const PlanArgs& a, InsertPlan& p, int64_t* slot) {
  for (int64_t i = 0; i < a.n; ++i) {
    if (i + kAhead < a.n && slot[i + kAhead] <= -2) {
      const int64_t ahead = -2 - slot[i + kAhead];
      p.table.prefetch(ahead);
      __builtin_prefetch(a.scores + ahead * a.S);
      __builtin_prefetch(a.scores + ahead * a.S + 8);
    }
    if (slot[i] > -2) {
      continue;
    }
    const int64_t b = -2 - slot[i];
    BucketPlan& e = p.table.get(b);
    if (e.victim_len < 0) {
      bucket_victims(a, p, b, e);
    }
    const int64_t v = e.taken++;
    slot[i] = v < e.victim_len ? p.pool[static_cast<size_t>(e.aux + v)] : -1;
  }
}

// Phase 2: the slot of each missing key that wants one. slot[i] holds its bucket
// on entry (phase 1), -1 otherwise. Free slots go in pass A; then pending keys
// take their bucket's victims, which exclude the slots found by the call.
void plan_inserts(const PlanArgs& a, const int64_t* found, int64_t* slot) {
  int64_t m = 0;
  for (int64_t i = 0; i < a.n; ++i) {
    m += slot[i] >= 0;
  }
  if (m == 0) {
    return;
  }
  TORCH_CHECK(m <= INT32_MAX, "recpipe::dynamic_hash_plan: ", m,
              " keys want a slot in one call; split the call into chunks of at most 2**31 - 1 keys.");
  InsertPlan p{BucketTable(m), (a.S + 63) / 64, {}, {}, {}};
  p.scratch.reserve(static_cast<size_t>(a.S));
  if (rank_misses(a, p, slot)) {
    protect_hits(a, p, found);
    take_victims(a, p, slot);
  }
}

std::tuple<at::Tensor, at::Tensor> dynamic_hash_plan_cpu(const at::Tensor& uniq,
                                                         const std::optional<at::Tensor>& want_insert,
                                                         const at::Tensor& keys, const at::Tensor& scores,
                                                         const at::Tensor& sizes, int64_t bucket_slots,
                                                         int64_t salt) {
  check_plan_args(uniq, want_insert, keys, scores, sizes, bucket_slots);
  const int64_t n = uniq.numel();
  at::Tensor found = at::empty({n}, uniq.options());
  at::Tensor slot = at::empty({n}, uniq.options());
  if (n == 0) {
    return {found, slot};
  }
  const PlanArgs a{uniq.const_data_ptr<int64_t>(),
                   want_insert.has_value() ? want_insert->const_data_ptr<bool>() : nullptr,
                   keys.const_data_ptr<int64_t>(),
                   scores.const_data_ptr<int64_t>(),
                   sizes.const_data_ptr<int64_t>(),
                   n,
                   bucket_slots,
                   DynamicBuckets(static_cast<uint64_t>(salt), static_cast<uint64_t>(sizes.numel()))};
  int64_t* found_p = found.mutable_data_ptr<int64_t>();
  int64_t* slot_p = slot.mutable_data_ptr<int64_t>();
  find_keys(a, found_p, slot_p);
  plan_inserts(a, found_p, slot_p);
  return {found, slot};
}

}  // namespace

// Initial rows of `keys` under the uniform initializer: lower + (upper - lower) * u(c)
// in double, cast to float32 ([n, dim]); the torch implementation computes the same
// doubles (recpipe.pipeline.tiered.dynamic.key_hashing.init_rows).
at::Tensor dynamic_init_uniform_cpu(const at::Tensor& keys, int64_t dim, int64_t init_salt, double lower,
                                    double upper) {
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kLong && keys.device().is_cpu(),
              "recpipe: `keys` must be a 1-D int64 CPU tensor, got ", keys.scalar_type(), " of shape ",
              keys.sizes());
  TORCH_CHECK(dim >= 1, "recpipe: `dim` must be >= 1, got ", dim);
  const at::Tensor k = keys.contiguous();
  const int64_t n = k.numel();
  at::Tensor out = at::empty({n, dim}, keys.options().dtype(at::kFloat));
  const int64_t* kp = k.const_data_ptr<int64_t>();
  float* op = out.mutable_data_ptr<float>();
  const uint64_t salt = static_cast<uint64_t>(init_salt);
  const double span = upper - lower;
  at::parallel_for(0, n, 1024, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const uint64_t base = mix64(static_cast<uint64_t>(kp[i]) ^ salt);
      float* row = op + i * dim;
      for (int64_t c = 0; c < dim; ++c) {
        row[c] = static_cast<float>(lower + span * init_uniform(base, c));
      }
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(recpipe, CPU, m) {
  m.impl("dynamic_hash_plan", &dynamic_hash_plan_cpu);
  m.impl("dynamic_init_uniform", &dynamic_init_uniform_cpu);
}

}  // namespace recpipe
