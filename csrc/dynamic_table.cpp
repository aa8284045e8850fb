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
//   dynamic_init_uniform  float32 initial rows [n, dim] of keys under the
//                      uniform initializer (the spec's "Init of key's row").
//
// Cost (n keys, m of them missing and wanting a slot; no temporary scales with T):
//   phase 1  parallel over keys: hash, then probe the key's bucket (O(n * S)),
//            the bucket lines prefetched kAhead keys ahead.
//   phase 2  the buckets of the m keys in a hash map (O(m)), split into
//            partitions run in parallel when m is large; within a partition
//            the keys go in ascending order, so the plan does not depend on
//            the thread count. Pass A ranks each key in its bucket and hands
//            out free slots; only if some bucket runs out, pass B marks the
//            slots found by the call in those buckets (a bitmask each) and
//            pass C computes their victims, once per bucket, and hands them out.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
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
constexpr int64_t kAhead = 16;  // keys prefetched ahead of the one being processed (a power of two)

// Phase 1 (parallel over keys): found[i], and want_bucket[i] = bucket of key i
// when it is missing and wants a slot (-1 otherwise), for phase 2 to rank.
// Checks that uniq ascends strictly and that the sizes of the buckets it touches
// are in [0, S].
void find_keys(const PlanArgs& a, int64_t* found, int64_t* want_bucket) {
  std::atomic<int64_t> bad_order{kNone};
  std::atomic<int64_t> bad_size{kNone};
  at::parallel_for(0, a.n, 2048, [&](int64_t begin, int64_t end) {
    int64_t ring[kAhead];  // buckets of keys i .. i + kAhead - 1, their lines prefetched
    auto issue = [&](int64_t i) {
      const int64_t b = a.buckets.bucket(a.uniq[i]);
      ring[i & (kAhead - 1)] = b;
      __builtin_prefetch(a.sizes + b);
      __builtin_prefetch(a.keys + b * a.S);
      if (a.S > 8) {
        __builtin_prefetch(a.keys + b * a.S + 8);
      }
    };
    for (int64_t i = begin; i < std::min(end, begin + kAhead); ++i) {
      issue(i);
    }
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = ring[i & (kAhead - 1)];
      if (i + kAhead < end) {
        issue(i + kAhead);
      }
      const int64_t key = a.uniq[i];
      if (i > 0 && a.uniq[i - 1] >= key) {
        atomic_min(bad_order, i);
      }
      const int64_t sz = a.sizes[b];
      int64_t pos = -1;
      if (sz < 0 || sz > a.S) {
        atomic_min(bad_size, b);
      } else {
        const int64_t* kb = a.keys + b * a.S;
        for (int64_t j = 0; j < sz; ++j) {
          if (kb[j] == key) {
            pos = b * a.S + j;
            // a training lookup rewrites a found key's score right after the plan: fetch its line now
            // (an eval lookup does not; the prefetch then costs one instruction)
            __builtin_prefetch(a.scores + pos, 1);
            break;
          }
        }
      }
      found[i] = pos;
      want_bucket[i] = pos < 0 && a.want != nullptr && a.want[i] ? b : -1;
    }
  });
  const int64_t i = bad_order.load();
  TORCH_CHECK(i == kNone, "recpipe::dynamic_hash_plan: `uniq` must ascend strictly, but uniq[", i - 1, "] = ",
              a.uniq[i - 1], " >= uniq[", i, "] = ", a.uniq[i], "; pass torch.unique(keys) (sorted, unique).");
  const int64_t b = bad_size.load();
  TORCH_CHECK(b == kNone, "recpipe::dynamic_hash_plan: `sizes[", b, "]` = ", a.sizes[b], " is outside [0, ", a.S,
              "]; the index state is corrupt (sizes counts the used slots of each bucket).");
}

// Phase 2 state of one bucket that missing keys want slots in.
struct BucketPlan {
  int32_t count = 0;        // missing keys of the bucket that want a slot (ranked so far)
  int32_t taken = 0;        // victims handed out so far
  int32_t victim_len = -1;  // victims computed (-1: not yet)
  int64_t aux = -1;         // offset of the protected-slot bitmask words (bit j: slot b*S + j is held
                            // by the call), then, once victim_len >= 0, of the victims in the pool
};

// Open-addressing map bucket -> BucketPlan (linear probing, power-of-two capacity
// at least twice the entries; the buckets in their own array so that probes for
// absent buckets stay in cache): O(missing keys) memory. Buckets are already
// uniform hashes of keys, so a Fibonacci hash (one multiply) spreads them.
class BucketTable {
 public:
  explicit BucketTable(int64_t entries) {
    int bits = 4;
    while ((int64_t{1} << bits) < 2 * entries) {
      ++bits;
    }
    shift_ = 64 - bits;
    mask_ = (uint64_t{1} << bits) - 1;
    buckets_.assign(mask_ + 1, -1);
    plans_.resize(mask_ + 1);
  }

  // Whether probes stay in the L2 cache (prefetching them costs more than it saves).
  bool small() const { return mask_ < (uint64_t{1} << 15); }

  // Prefetches the home cell of bucket b (for writing: get() may claim it).
  void prefetch(int64_t b) const {
    const uint64_t h = home(b);
    __builtin_prefetch(buckets_.data() + h, 1);
    __builtin_prefetch(plans_.data() + h, 1);
  }

  // The plan of bucket b (>= 0), inserted when absent.
  BucketPlan& get(int64_t b) {
    uint64_t h = home(b);
    while (buckets_[h] != b) {
      if (buckets_[h] < 0) {
        buckets_[h] = b;
        break;
      }
      h = (h + 1) & mask_;
    }
    return plans_[h];
  }

  // The plan of bucket b, nullptr when absent.
  BucketPlan* find(int64_t b) {
    for (uint64_t h = home(b);; h = (h + 1) & mask_) {
      if (buckets_[h] == b) {
        return &plans_[h];
      }
      if (buckets_[h] < 0) {
        return nullptr;
      }
    }
  }

 private:
  uint64_t home(int64_t b) const { return (static_cast<uint64_t>(b) * 0x9E3779B97F4A7C15ULL) >> shift_; }

  int shift_ = 60;
  uint64_t mask_ = 0;
  std::vector<int64_t> buckets_;
  std::vector<BucketPlan> plans_;
};

constexpr int64_t kPending = -2;  // slot[i] of a key that waits for a victim (pass A -> pass C)

// Phase 2 of one partition of the buckets: the buckets b with owner(b) == part
// (a multiplicative hash of b onto [0, parts)). Partitions share nothing but
// read-only inputs (want_bucket among them) and write disjoint entries of `slot`.
struct InsertPlan {
  const PlanArgs& a;
  const int64_t* want_bucket;
  int64_t part;
  int64_t parts;
  int64_t words;  // bitmask words per bucket: ceil(S / 64)
  BucketTable table;
  std::vector<uint64_t> protected_bits;  // `words` per bucket that needs victims
  std::vector<int64_t> pool;             // victims of those buckets, concatenated
  std::vector<std::pair<int64_t, int64_t>> scratch;  // (score, slot) of one bucket

  InsertPlan(const PlanArgs& args, const int64_t* wb, int64_t p, int64_t np, int64_t entries)
      : a(args), want_bucket(wb), part(p), parts(np), words((args.S + 63) / 64), table(entries) {
    scratch.reserve(static_cast<size_t>(args.S));
  }

  static int64_t owner(int64_t b, int64_t parts) {
    const uint64_t h = (static_cast<uint64_t>(b) * 0x9E3779B97F4A7C15ULL) >> 32;
    return static_cast<int64_t>((h * static_cast<uint64_t>(parts)) >> 32);
  }
  bool mine(int64_t b) const { return parts == 1 || owner(b, parts) == part; }
};

// Pass A (ascending keys): rank each missing key that wants a slot in its
// bucket; free slots are assigned here, the rest are left kPending.
// Returns whether any key is pending (some bucket needs victims).
bool rank_misses(InsertPlan& p, int64_t* slot) {
  const PlanArgs& a = p.a;
  const int64_t* wb = p.want_bucket;
  bool pending = false;
  for (int64_t i = 0; i < a.n; ++i) {
    if (i + kAhead < a.n && wb[i + kAhead] >= 0 && p.mine(wb[i + kAhead])) {
      p.table.prefetch(wb[i + kAhead]);
      __builtin_prefetch(a.sizes + wb[i + kAhead]);
    }
    const int64_t b = wb[i];
    if (b < 0 || !p.mine(b)) {
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
    slot[i] = kPending;
    pending = true;
  }
  return pending;
}

// Pass B: marks the slots found by this call in the buckets that need victims.
void protect_hits(InsertPlan& p, const int64_t* found) {
  const PlanArgs& a = p.a;
  const FastDivU64 per_bucket(static_cast<uint64_t>(a.S));
  const bool pow2 = (a.S & (a.S - 1)) == 0;
  const int log2_s = bit_width_u64(static_cast<uint64_t>(a.S)) - 1;
  auto bucket_of = [&](int64_t s) {
    return pow2 ? s >> log2_s : static_cast<int64_t>(per_bucket.div(static_cast<uint64_t>(s)));
  };
  const bool ahead = !p.table.small();
  for (int64_t i = 0; i < a.n; ++i) {
    if (ahead && i + kAhead < a.n && found[i + kAhead] >= 0) {
      p.table.prefetch(bucket_of(found[i + kAhead]));
    }
    const int64_t s = found[i];
    if (s < 0) {
      continue;
    }
    const int64_t b = bucket_of(s);
    const BucketPlan* e = p.mine(b) ? p.table.find(b) : nullptr;
    if (e != nullptr && e->aux >= 0) {
      const int64_t j = s - b * a.S;
      p.protected_bits[static_cast<size_t>(e->aux + j / 64)] |= uint64_t{1} << (j % 64);
    }
  }
}

// The victims bucket b's pending keys take (its unprotected used slots by
// (score, slot), as many as it has pending keys), appended to the pool.
void bucket_victims(InsertPlan& p, int64_t b, BucketPlan& e) {
  const PlanArgs& a = p.a;
  const int64_t used = a.sizes[b];
  const int64_t k = e.count - (a.S - used);
  const uint64_t* bits = p.protected_bits.data() + e.aux;
  if (k == 1) {  // the common case: one pending key, the least (score, slot)
    int64_t best = -1;
    for (int64_t j = 0; j < used; ++j) {
      const int64_t s = b * a.S + j;
      const bool held = (bits[j / 64] >> (j % 64)) & 1;
      if (!held && (best < 0 || a.scores[s] < a.scores[best])) {
        best = s;
      }
    }
    e.aux = static_cast<int64_t>(p.pool.size());
    e.victim_len = best >= 0 ? 1 : 0;
    if (best >= 0) {
      p.pool.push_back(best);
    }
    return;
  }
  p.scratch.clear();
  for (int64_t j = 0; j < used; ++j) {
    if (((bits[j / 64] >> (j % 64)) & 1) == 0) {
      const int64_t s = b * a.S + j;
      p.scratch.emplace_back(a.scores[s], s);
    }
  }
  const auto take = static_cast<std::ptrdiff_t>(std::min<int64_t>(k, static_cast<int64_t>(p.scratch.size())));
  std::sort(p.scratch.begin(), p.scratch.end());  // at most S entries
  e.aux = static_cast<int64_t>(p.pool.size());
  e.victim_len = static_cast<int32_t>(take);
  for (std::ptrdiff_t v = 0; v < take; ++v) {
    p.pool.push_back(p.scratch[static_cast<size_t>(v)].second);
  }
}

// Pass C (ascending keys): each pending key takes its bucket's next victim, or -1.
void take_victims(InsertPlan& p, int64_t* slot) {
  const PlanArgs& a = p.a;
  const int64_t* wb = p.want_bucket;
  for (int64_t i = 0; i < a.n; ++i) {
    if (i + kAhead < a.n && wb[i + kAhead] >= 0 && p.mine(wb[i + kAhead])) {
      const int64_t ahead = wb[i + kAhead];
      p.table.prefetch(ahead);
      __builtin_prefetch(a.sizes + ahead);
      __builtin_prefetch(a.scores + ahead * a.S);
      if (a.S > 8) {
        __builtin_prefetch(a.scores + ahead * a.S + 8);
      }
    }
    const int64_t b = wb[i];
    if (b < 0 || !p.mine(b) || slot[i] != kPending) {
      continue;
    }
    BucketPlan& e = p.table.get(b);
    if (e.victim_len < 0) {
      bucket_victims(p, b, e);
    }
    const int64_t v = e.taken++;
    slot[i] = v < e.victim_len ? p.pool[static_cast<size_t>(e.aux + v)] : -1;
  }
}

constexpr int64_t kKeysPerPartition = 4096;  // missing keys that justify one more partition

// Phase 2: the slot of each missing key that wants one (want_bucket[i] >= 0, its
// bucket, from phase 1); slot[i] is -1 on entry. Free slots go in pass A; then
// pending keys take their bucket's victims, which exclude the slots found by the
// call. The buckets are split into partitions run in parallel, each bucket's keys
// in ascending order within one partition: the result does not depend on threads.
void plan_inserts(const PlanArgs& a, const int64_t* found, const int64_t* want_bucket, int64_t* slot) {
  int64_t m = 0;
  for (int64_t i = 0; i < a.n; ++i) {
    m += want_bucket[i] >= 0;
  }
  if (m == 0) {
    return;
  }
  TORCH_CHECK(m <= INT32_MAX, "recpipe::dynamic_hash_plan: ", m,
              " keys want a slot in one call; split the call into chunks of at most 2**31 - 1 keys.");
  const int64_t parts =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), m / kKeysPerPartition));
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t part = p0; part < p1; ++part) {
      int64_t mine = m;  // the partition's keys: at least its distinct buckets, the table's size
      if (parts > 1) {
        mine = 0;
        for (int64_t i = 0; i < a.n; ++i) {
          mine += want_bucket[i] >= 0 && InsertPlan::owner(want_bucket[i], parts) == part;
        }
      }
      InsertPlan p(a, want_bucket, part, parts, mine);
      if (rank_misses(p, slot)) {
        protect_hits(p, found);
        take_victims(p, slot);
      }
    }
  });
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
  if (a.want == nullptr) {
    find_keys(a, found_p, slot_p);  // no key wants a slot: want_bucket is all -1, the slots
    return {found, slot};
  }
  slot.fill_(-1);
  const std::unique_ptr<int64_t[]> want_bucket(new int64_t[static_cast<size_t>(n)]);
  find_keys(a, found_p, want_bucket.get());
  plan_inserts(a, found_p, want_bucket.get(), slot_p);
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
