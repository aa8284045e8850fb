// recpipe: the tiered embedding kernel (CPU).
//
// One row-wise shard of a table whose rows live in a fast tier (HBM on a GPU
// host; a separate host buffer on CPU) and a slow tier (host DDR). The Python
// module recpipe.pipeline.tiered.TieredEmbeddingShard owns the buffers and
// describes the placements; this file runs the per-step work of a training
// step in compiled code:
//
//   tiered_lookup    unique ids -> CACHING admission / eviction (LFU or LRU,
//                    dirty rows written back) -> pooled lookup from both tiers
//   tiered_backward  gradient summed per unique row (in id order) -> fused
//                    optimizer (SGD, row-wise Adagrad, Adam) applied in place
//                    in whichever tier each row lives -> CACHING dirty bits
//
// Placement of local row r (R rows, F fast rows, S cache slots):
//   ALL_FAST  r lives at fast[r].
//   HYBRID    h = H(r) with H = HashPermutation(R, split_seed) (the
//             hash_roundrobin bijection of bucketize_math.h, W = 1): fast[h]
//             when h < F, else slow[h - F].
//   CACHING   row_map[r] >= 0: fast slot row_map[r]; else slow[r] (the slow
//             tier holds every row).
//
// Why not fbgemm: fbgemm's CPU TBE has one host location per table and no
// cache (EmbeddingLocation.MANAGED_CACHING and UVM exist only in the CUDA
// build), so neither the hashed HYBRID split nor a CACHING cache can be
// expressed with it on CPU.
//
// Statistics are counters in an int64 tensor the kernel updates in place
// (layout: kStat* below), read by Python only when they are logged.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "bucketize_math.h"
#include "checks.h"

namespace recpipe {
namespace {

// `mode` argument.
constexpr int64_t kAllFast = 0;
constexpr int64_t kHybrid = 1;
constexpr int64_t kCaching = 2;
// `policy` argument (CACHING).
constexpr int64_t kLfu = 0;
constexpr int64_t kLru = 1;
// `pooling` argument.
constexpr int64_t kSum = 0;
constexpr int64_t kMean = 1;
// `optimizer` argument.
constexpr int64_t kSgd = 0;
constexpr int64_t kRowwiseAdagrad = 1;
constexpr int64_t kAdam = 2;

// Statistics tensor: the last lookup's counters at [0, kStatCount), running
// totals of the same counters at [kStatCount, 2 * kStatCount).
constexpr int64_t kStatLookups = 0;
constexpr int64_t kStatUniqueRows = 1;
constexpr int64_t kStatHits = 2;
constexpr int64_t kStatFastLookups = 3;
constexpr int64_t kStatRowsLoaded = 4;
constexpr int64_t kStatRowsEvicted = 5;
constexpr int64_t kStatRowsWrittenBack = 6;
constexpr int64_t kStatCount = 7;

// The shard's tier buffers and placement, as passed to both ops.
struct Tiers {
  float* fast_w;
  float* fast_s;
  float* slow_w;
  float* slow_s;
  int64_t dim;
  int64_t cols;  // optimizer state columns
  int64_t mode;
  int64_t fast_rows;
  int64_t* row_map;  // CACHING only
  HashPermutation split;  // HYBRID only

  // Whether local row r is in the fast tier, and its index in that tier.
  std::pair<bool, int64_t> locate(int64_t r) const {
    if (mode == kAllFast) {
      return {true, r};
    }
    if (mode == kCaching) {
      const int64_t slot = row_map[r];
      return slot >= 0 ? std::make_pair(true, slot) : std::make_pair(false, r);
    }
    const int64_t h = static_cast<int64_t>(split.forward(static_cast<uint64_t>(r)));
    return h < fast_rows ? std::make_pair(true, h) : std::make_pair(false, h - fast_rows);
  }
  float* weights(std::pair<bool, int64_t> at) const {
    return (at.first ? fast_w : slow_w) + at.second * dim;
  }
  float* state(std::pair<bool, int64_t> at) const {
    return (at.first ? fast_s : slow_s) + at.second * cols;
  }
};

void check_tier(const at::Tensor& t, const char* name, int64_t cols) {
  TORCH_CHECK(t.device().is_cpu(), "recpipe: tiered `", name, "` must be on CPU, got ", t.device(),
              "; the tiered kernel's CPU op takes host buffers.");
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(1) == cols && t.is_contiguous(),
              "recpipe: tiered `", name, "` must be a contiguous float32 [rows, ", cols, "] tensor, got ",
              t.scalar_type(), " ", t.sizes(), ".");
}

Tiers make_tiers(
    at::Tensor& fast_weights,
    at::Tensor& fast_state,
    at::Tensor& slow_weights,
    at::Tensor& slow_state,
    const at::Tensor& row_map,
    int64_t num_rows,
    int64_t fast_rows,
    int64_t split_seed,
    int64_t mode) {
  TORCH_CHECK(mode == kAllFast || mode == kHybrid || mode == kCaching,
              "recpipe: tiered `mode` must be 0 (all fast), 1 (HYBRID) or 2 (CACHING), got ", mode, ".");
  const int64_t dim = fast_weights.size(1);
  const int64_t cols = fast_state.size(1);
  check_tier(fast_weights, "fast_weights", dim);
  check_tier(fast_state, "fast_state", cols);
  check_tier(slow_weights, "slow_weights", dim);
  check_tier(slow_state, "slow_state", cols);
  TORCH_CHECK(num_rows >= 0 && fast_rows >= 0, "recpipe: tiered `num_rows` and `fast_rows` must be >= 0.");
  Tiers t{};
  t.fast_w = fast_weights.data_ptr<float>();
  t.fast_s = fast_state.data_ptr<float>();
  t.slow_w = slow_weights.data_ptr<float>();
  t.slow_s = slow_state.data_ptr<float>();
  t.dim = dim;
  t.cols = cols;
  t.mode = mode;
  t.fast_rows = fast_rows;
  t.row_map = nullptr;
  if (mode == kCaching) {
    TORCH_CHECK(row_map.scalar_type() == at::kLong && row_map.dim() == 1 && row_map.numel() == num_rows &&
                    row_map.is_contiguous() && row_map.device().is_cpu(),
                "recpipe: tiered `row_map` must be a contiguous int64 CPU tensor of num_rows=", num_rows,
                " entries, got ", row_map.scalar_type(), " ", row_map.sizes(), ".");
    TORCH_CHECK(slow_weights.size(0) == num_rows, "recpipe: CACHING `slow_weights` must hold all num_rows=",
                num_rows, " rows, got ", slow_weights.size(0), ".");
    t.row_map = const_cast<int64_t*>(row_map.data_ptr<int64_t>());
  } else if (mode == kHybrid) {
    TORCH_CHECK(fast_weights.size(0) == fast_rows && slow_weights.size(0) == num_rows - fast_rows,
                "recpipe: HYBRID tiers must hold fast_rows=", fast_rows, " and num_rows - fast_rows=",
                num_rows - fast_rows, " rows, got ", fast_weights.size(0), " and ", slow_weights.size(0), ".");
    t.split = HashPermutation(static_cast<uint64_t>(std::max<int64_t>(num_rows, 1)),
                              static_cast<uint64_t>(split_seed));
  } else {
    TORCH_CHECK(fast_weights.size(0) == num_rows, "recpipe: an all-fast shard's `fast_weights` must hold num_rows=",
                num_rows, " rows, got ", fast_weights.size(0), ".");
  }
  TORCH_CHECK(fast_state.size(0) == fast_weights.size(0) && slow_state.size(0) == slow_weights.size(0),
              "recpipe: tiered state buffers must have one row per weight row.");
  return t;
}

// Bag offsets as int64 with their checks (B + 1 entries, 0 .. n, non-decreasing).
std::vector<int64_t> read_offsets(const at::Tensor& offsets, int64_t n) {
  TORCH_CHECK_VALUE(
      offsets.dim() == 1 && (offsets.scalar_type() == at::kInt || offsets.scalar_type() == at::kLong) &&
          offsets.numel() >= 1,
      "offsets must be a 1-D int32/int64 tensor of B + 1 bag offsets (include_last_offset), got ",
      offsets.scalar_type(), " with shape ", offsets.sizes(), ".");
  const at::Tensor o = offsets.to(at::kLong).contiguous();
  const int64_t* p = o.data_ptr<int64_t>();
  std::vector<int64_t> out(p, p + o.numel());
  bool ok = out.front() == 0 && out.back() == n;
  for (size_t b = 1; ok && b < out.size(); ++b) {
    ok = out[b] >= out[b - 1];
  }
  TORCH_CHECK_VALUE(ok, "offsets must start at 0, be non-decreasing and end at len(ids)=", n, "; got first ",
                    out.front(), ", last ", out.back(), ".");
  return out;
}

// Local row ids as a contiguous int64 tensor (no copy when they already are one),
// checked against [0, num_rows).
at::Tensor read_ids(const at::Tensor& ids, int64_t num_rows) {
  TORCH_CHECK_VALUE(ids.dim() == 1 && (ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong),
                    "ids must be a 1-D int32/int64 tensor of local row ids, got ", ids.scalar_type(),
                    " with shape ", ids.sizes(), ".");
  at::Tensor v = ids.to(at::kLong).contiguous();
  const int64_t* p = v.data_ptr<int64_t>();
  const int64_t n = v.numel();
  if (n > 0) {
    const auto [lo, hi] = std::minmax_element(p, p + n);
    TORCH_CHECK_INDEX(*lo >= 0 && *hi < num_rows, "ids out of range: got ids in [", *lo, ", ", *hi,
                      "] but the shard has ", num_rows,
                      " local rows; route global ids with recpipe.pipeline.ops.route_ids / bucketize_kjt first.");
  }
  return v;
}

// Brings the `bytes` bytes at p into the cache ahead of their use (rows of the
// tiers and row_map entries are scattered: their loads miss the cache).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t k = 0; k < bytes; k += 64) {
    __builtin_prefetch(c + k);
  }
}

// How far ahead (in rows) the loops over scattered rows prefetch.
constexpr int64_t kPrefetchAhead = 8;

// The sorted distinct ids, each position's index into them (inverse) and each
// distinct id's count, as torch.unique(sorted=True, return_inverse=True,
// return_counts=True). Ids are packed with their position into one key (id in
// the high bits) and radix-sorted (LSD, 8-bit digits, skipping digits all keys
// share), so one pass over the sorted keys yields all three without a search;
// a key that does not fit 64 bits falls back to a comparison sort of the pairs.
void unique_ids(const int64_t* id, int64_t n, int64_t num_rows, std::vector<int64_t>& uniq, int64_t* inverse,
                std::vector<int64_t>& counts) {
  uniq.clear();
  counts.clear();
  if (n == 0) {
    return;
  }
  const int pos_bits = bit_width_u64(static_cast<uint64_t>(n - 1));
  const int id_bits = bit_width_u64(static_cast<uint64_t>(std::max<int64_t>(num_rows - 1, 0)));
  std::vector<uint64_t> keys(static_cast<size_t>(n));
  if (pos_bits + id_bits <= 64) {
    for (int64_t i = 0; i < n; ++i) {
      keys[i] = (static_cast<uint64_t>(id[i]) << pos_bits) | static_cast<uint64_t>(i);
    }
    std::vector<uint64_t> tmp(static_cast<size_t>(n));
    const int bits = pos_bits + id_bits;
    for (int shift = 0; shift < bits; shift += 8) {
      size_t hist[257] = {0};
      for (int64_t i = 0; i < n; ++i) {
        ++hist[((keys[i] >> shift) & 0xFF) + 1];
      }
      if (hist[((keys[0] >> shift) & 0xFF) + 1] == static_cast<size_t>(n)) {
        continue;  // every key has this digit: the pass would not move anything
      }
      for (int d = 0; d < 256; ++d) {
        hist[d + 1] += hist[d];
      }
      for (int64_t i = 0; i < n; ++i) {
        tmp[hist[(keys[i] >> shift) & 0xFF]++] = keys[i];
      }
      keys.swap(tmp);
    }
    const uint64_t pos_mask = pos_bits == 0 ? 0 : (~0ULL >> (64 - pos_bits));
    for (int64_t k = 0; k < n; ++k) {
      const int64_t row = static_cast<int64_t>(keys[k] >> pos_bits);
      if (uniq.empty() || uniq.back() != row) {
        uniq.push_back(row);
        counts.push_back(0);
      }
      ++counts.back();
      inverse[keys[k] & pos_mask] = static_cast<int64_t>(uniq.size()) - 1;
    }
    return;
  }
  std::vector<std::pair<int64_t, int64_t>> pairs(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    pairs[i] = {id[i], i};
  }
  std::sort(pairs.begin(), pairs.end());
  for (const auto& [row, i] : pairs) {
    if (uniq.empty() || uniq.back() != row) {
      uniq.push_back(row);
      counts.push_back(0);
    }
    ++counts.back();
    inverse[i] = static_cast<int64_t>(uniq.size()) - 1;
  }
}

const float* read_psw(const std::optional<at::Tensor>& psw, int64_t n, int64_t pooling, at::Tensor& keep) {
  if (!psw.has_value()) {
    return nullptr;
  }
  TORCH_CHECK_VALUE(pooling == kSum, "per_sample_weights need pooling='sum' (as in torch.nn.EmbeddingBag).");
  TORCH_CHECK_VALUE(psw->dim() == 1 && psw->numel() == n, "per_sample_weights must have the shape of ids [", n,
                    "], got ", psw->sizes(), ".");
  keep = psw->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// CACHING: counts hits, then admits the batch's missing rows into the cache,
// evicting slots the batch does not use (free slots first, then the coldest;
// ties by slot index), writing dirty victims back. LFU admits a miss only when
// its access count beats the victim's (row_map keeps the access count of
// uncached rows as -(count + 1)); LRU always admits. Returns the hits.
int64_t prefetch(
    const Tiers& t,
    const std::vector<int64_t>& uniq,
    const std::vector<int64_t>& counts,
    int64_t* slot_row,
    int64_t* slot_score,
    int64_t slots,
    int64_t policy,
    int64_t clock,
    int64_t* stats) {
  const bool lfu = policy == kLfu;
  int64_t hits = 0;
  std::vector<int64_t> hit_slot;  // the batch's cached slots: not eviction candidates
  std::vector<int64_t> miss_row;
  std::vector<int64_t> miss_key;
  hit_slot.reserve(uniq.size());
  const size_t U = uniq.size();
  for (size_t u = 0; u < U; ++u) {
    if (u + kPrefetchAhead < U) {
      __builtin_prefetch(t.row_map + uniq[u + kPrefetchAhead]);
    }
    const int64_t rm = t.row_map[uniq[u]];
    if (rm >= 0) {
      hits += counts[u];
      hit_slot.push_back(rm);
      slot_score[rm] = lfu ? slot_score[rm] + (counts[u] << 1) : (clock << 1) | (slot_score[rm] & 1);
    } else {
      miss_row.push_back(uniq[u]);
      miss_key.push_back(lfu ? (-rm - 1) + counts[u] : clock);
    }
  }
  const size_t misses = miss_row.size();
  if (misses == 0) {
    return hits;
  }
  if (lfu) {  // misses that stay in the slow tier keep their access count
    for (size_t m = 0; m < misses; ++m) {
      t.row_map[miss_row[m]] = -(miss_key[m] + 1);
    }
  }
  if (slots == 0) {
    return hits;
  }
  std::vector<uint8_t> used(static_cast<size_t>(slots), 0);
  for (const int64_t slot : hit_slot) {
    used[slot] = 1;
  }
  // Misses hottest first (ties by row); victims coldest first (free = -1, ties by slot).
  std::vector<size_t> m_order(misses);
  for (size_t m = 0; m < misses; ++m) {
    m_order[m] = m;
  }
  std::stable_sort(m_order.begin(), m_order.end(),
                   [&](size_t a, size_t b) { return miss_key[a] > miss_key[b]; });
  // The `misses` coldest unused slots as (key, slot), kept in a bounded max-heap.
  // LFU never admits a miss against a victim at least as hot as the hottest
  // miss, so only colder victims are candidates. Free slots (key -1) beat every
  // occupied one and tie by slot index, so the scan ends once `misses` of them are found.
  const int64_t key_bound = lfu ? miss_key[m_order[0]] : INT64_MAX;
  std::vector<std::pair<int64_t, int64_t>> victims;
  victims.reserve(misses);
  size_t free_found = 0;
  for (int64_t s = 0; s < slots && free_found < misses; ++s) {
    if (used[s]) {
      continue;
    }
    const int64_t key = slot_row[s] >= 0 ? slot_score[s] >> 1 : -1;
    if (key >= key_bound) {
      continue;
    }
    free_found += key < 0;
    const std::pair<int64_t, int64_t> cand(key, s);
    if (victims.size() < misses) {
      victims.push_back(cand);
      std::push_heap(victims.begin(), victims.end());
    } else if (cand < victims.front()) {
      std::pop_heap(victims.begin(), victims.end());
      victims.back() = cand;
      std::push_heap(victims.begin(), victims.end());
    }
  }
  std::sort_heap(victims.begin(), victims.end());  // coldest first
  const size_t n = victims.size();
  int64_t loaded = 0, evicted = 0, written_back = 0;
  for (size_t j = 0; j < n; ++j) {
    const size_t m = m_order[j];
    const int64_t slot = victims[j].second;
    if (lfu && miss_key[m] <= victims[j].first) {
      break;  // keys of misses descend and of victims ascend: the rest lose too
    }
    const int64_t old_row = slot_row[slot];
    const int64_t old_score = slot_score[slot];
    if (old_row >= 0) {
      if (old_score & 1) {  // write back the dirty victim with its optimizer state
        std::copy_n(t.fast_w + slot * t.dim, t.dim, t.slow_w + old_row * t.dim);
        std::copy_n(t.fast_s + slot * t.cols, t.cols, t.slow_s + old_row * t.cols);
        ++written_back;
      }
      t.row_map[old_row] = lfu ? -((old_score >> 1) + 1) : -1;
      ++evicted;
    }
    const int64_t row = miss_row[m];
    std::copy_n(t.slow_w + row * t.dim, t.dim, t.fast_w + slot * t.dim);
    std::copy_n(t.slow_s + row * t.cols, t.cols, t.fast_s + slot * t.cols);
    t.row_map[row] = slot;
    slot_row[slot] = row;
    slot_score[slot] = miss_key[m] << 1;
    ++loaded;
  }
  stats[kStatRowsLoaded] = loaded;
  stats[kStatRowsEvicted] = evicted;
  stats[kStatRowsWrittenBack] = written_back;
  return hits;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tiered_lookup_cpu(
    const at::Tensor& ids,
    const at::Tensor& offsets,
    const std::optional<at::Tensor>& per_sample_weights,
    at::Tensor& fast_weights,
    at::Tensor& fast_state,
    at::Tensor& slow_weights,
    at::Tensor& slow_state,
    at::Tensor& row_map,
    at::Tensor& slot_row,
    at::Tensor& slot_score,
    at::Tensor& stats,
    int64_t num_rows,
    int64_t fast_rows,
    int64_t split_seed,
    int64_t mode,
    int64_t policy,
    int64_t clock,
    int64_t pooling) {
  const at::Tensor id_t = read_ids(ids, num_rows);
  const int64_t* id = id_t.data_ptr<int64_t>();
  const int64_t n = id_t.numel();
  const std::vector<int64_t> off = read_offsets(offsets, n);
  TORCH_CHECK(pooling == kSum || pooling == kMean, "recpipe: tiered `pooling` must be 0 (sum) or 1 (mean), got ",
              pooling, ".");
  TORCH_CHECK(policy == kLfu || policy == kLru, "recpipe: tiered `policy` must be 0 (LFU) or 1 (LRU), got ",
              policy, ".");
  at::Tensor psw_keep;
  const float* psw = read_psw(per_sample_weights, n, pooling, psw_keep);
  TORCH_CHECK(stats.scalar_type() == at::kLong && stats.numel() == 2 * kStatCount && stats.is_contiguous(),
              "recpipe: tiered `stats` must be a contiguous int64 tensor of ", 2 * kStatCount, " counters.");
  const Tiers t = make_tiers(fast_weights, fast_state, slow_weights, slow_state, row_map, num_rows, fast_rows,
                             split_seed, mode);
  int64_t* st = stats.data_ptr<int64_t>();
  std::fill_n(st, kStatCount, 0);

  // unique rows (sorted, as torch.unique), the inverse and the counts
  at::Tensor inverse_t = at::empty({n}, ids.options().dtype(at::kLong));
  int64_t* inv = inverse_t.data_ptr<int64_t>();
  std::vector<int64_t> uniq;
  std::vector<int64_t> counts;
  unique_ids(id, n, num_rows, uniq, inv, counts);
  const int64_t U = static_cast<int64_t>(uniq.size());
  at::Tensor uniq_t = at::empty({U}, ids.options().dtype(at::kLong));
  std::copy(uniq.begin(), uniq.end(), uniq_t.data_ptr<int64_t>());

  int64_t hits = -1;
  if (mode == kCaching) {
    TORCH_CHECK(slot_row.scalar_type() == at::kLong && slot_score.scalar_type() == at::kLong &&
                    slot_row.numel() == slot_score.numel() && slot_row.numel() == fast_weights.size(0) &&
                    slot_row.is_contiguous() && slot_score.is_contiguous(),
                "recpipe: CACHING `slot_row` / `slot_score` must be contiguous int64 tensors of one entry per "
                "cache slot (", fast_weights.size(0), ").");
    hits = prefetch(t, uniq, counts, slot_row.data_ptr<int64_t>(), slot_score.data_ptr<int64_t>(),
                    slot_row.numel(), policy, clock, st);
  }
  // where each unique row lives after the cache loads
  std::vector<const float*> row_ptr(static_cast<size_t>(U));
  int64_t fast_lookups = 0;
  for (int64_t u = 0; u < U; ++u) {
    if (mode == kCaching && u + kPrefetchAhead < U) {
      __builtin_prefetch(t.row_map + uniq[u + kPrefetchAhead]);
    }
    const auto at = t.locate(uniq[u]);
    row_ptr[u] = t.weights(at);
    fast_lookups += at.first ? counts[u] : 0;
  }
  st[kStatLookups] = n;
  st[kStatUniqueRows] = U;
  st[kStatHits] = hits >= 0 ? hits : fast_lookups;
  st[kStatFastLookups] = fast_lookups;
  for (int64_t k = 0; k < kStatCount; ++k) {
    st[kStatCount + k] += st[k];
  }

  const int64_t B = static_cast<int64_t>(off.size()) - 1;
  const int64_t D = t.dim;
  // Every output element is written below (0 + the first row, or 0 for an empty
  // bag), in the same float operations as zero-filling and accumulating.
  at::Tensor out = at::empty({B, D}, fast_weights.options());
  float* o = out.data_ptr<float>();
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(float));
  at::parallel_for(0, B, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* ob = o + b * D;
      const int64_t i0 = off[b];
      const int64_t i1 = off[b + 1];
      if (i1 + kPrefetchAhead <= n) {
        // the rows of the bags ahead (positions are contiguous across bags)
        for (int64_t i = i0; i < i1; ++i) {
          prefetch_bytes(row_ptr[inv[i + kPrefetchAhead]], row_bytes);
        }
      }
      if (i0 == i1) {
        std::fill_n(ob, D, 0.0f);
        continue;
      }
      {
        const float* r = row_ptr[inv[i0]];
        const float w = psw != nullptr ? psw[i0] : 1.0f;
        for (int64_t d = 0; d < D; ++d) {
          ob[d] = 0.0f + w * r[d];
        }
      }
      for (int64_t i = i0 + 1; i < i1; ++i) {
        const float* r = row_ptr[inv[i]];
        const float w = psw != nullptr ? psw[i] : 1.0f;
        for (int64_t d = 0; d < D; ++d) {
          ob[d] += w * r[d];
        }
      }
      const int64_t len = i1 - i0;
      if (pooling == kMean && len > 0) {
        for (int64_t d = 0; d < D; ++d) {
          ob[d] /= static_cast<float>(len);
        }
      }
    }
  });
  return {out, uniq_t, inverse_t};
}

void tiered_backward_cpu(
    const at::Tensor& grad_out,
    const at::Tensor& uniq,
    const at::Tensor& inverse,
    const at::Tensor& offsets,
    const std::optional<at::Tensor>& per_sample_weights,
    at::Tensor& fast_weights,
    at::Tensor& fast_state,
    at::Tensor& slow_weights,
    at::Tensor& slow_state,
    const at::Tensor& row_map,
    at::Tensor& slot_score,
    int64_t num_rows,
    int64_t fast_rows,
    int64_t split_seed,
    int64_t mode,
    int64_t pooling,
    int64_t optimizer,
    double lr,
    double eps,
    double beta1,
    double beta2,
    double weight_decay,
    int64_t step) {
  TORCH_CHECK(optimizer == kSgd || optimizer == kRowwiseAdagrad || optimizer == kAdam,
              "recpipe: tiered `optimizer` must be 0 (sgd), 1 (rowwise_adagrad) or 2 (adam), got ", optimizer, ".");
  TORCH_CHECK(step >= 1, "recpipe: tiered `step` must be >= 1 (1-based, Adam bias correction), got ", step, ".");
  const Tiers t = make_tiers(fast_weights, fast_state, slow_weights, slow_state, row_map, num_rows, fast_rows,
                             split_seed, mode);
  const int64_t D = t.dim;
  const at::Tensor u_t = uniq.to(at::kLong).contiguous();
  const at::Tensor inv_t = inverse.to(at::kLong).contiguous();
  const int64_t U = u_t.numel();
  const int64_t n = inv_t.numel();
  const std::vector<int64_t> off = read_offsets(offsets, n);
  const int64_t B = static_cast<int64_t>(off.size()) - 1;
  const at::Tensor g_t = grad_out.to(at::kFloat).contiguous();
  TORCH_CHECK(g_t.dim() == 2 && g_t.size(0) == B && g_t.size(1) == D, "recpipe: tiered `grad_out` must be [B=", B,
              ", dim=", D, "], got ", g_t.sizes(), ".");
  at::Tensor psw_keep;
  const float* psw = read_psw(per_sample_weights, n, pooling, psw_keep);
  const int64_t* ur = u_t.data_ptr<int64_t>();
  const int64_t* inv = inv_t.data_ptr<int64_t>();
  const float* g = g_t.data_ptr<float>();
  if (mode == kCaching) {
    TORCH_CHECK(slot_score.scalar_type() == at::kLong && slot_score.numel() == fast_weights.size(0) &&
                    slot_score.is_contiguous(),
                "recpipe: CACHING `slot_score` must be a contiguous int64 tensor of one entry per cache slot.");
  }
  int64_t* score = mode == kCaching ? slot_score.data_ptr<int64_t>() : nullptr;

  // Positions grouped by unique row, in id order (a stable counting sort), so
  // each row's gradient is summed in the order of its ids and rows update in parallel.
  std::vector<int64_t> start(static_cast<size_t>(U) + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_INDEX(inv[i] >= 0 && inv[i] < U, "recpipe: tiered `inverse` entry ", inv[i], " is outside [0, ", U,
                      ").");
    ++start[inv[i] + 1];
  }
  for (int64_t u = 0; u < U; ++u) {
    start[u + 1] += start[u];
  }
  std::vector<int64_t> pos(static_cast<size_t>(n));
  std::vector<int64_t> bag(static_cast<size_t>(n));
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = off[b]; i < off[b + 1]; ++i) {
        bag[i] = b;
        pos[fill[inv[i]]++] = i;
      }
    }
  }
  const float flr = static_cast<float>(lr);
  const float feps = static_cast<float>(eps);
  const float b1 = static_cast<float>(beta1);
  const float b2 = static_cast<float>(beta2);
  const float bc1 = static_cast<float>(1.0 - std::pow(beta1, static_cast<double>(step)));
  const float bc2 = static_cast<float>(1.0 - std::pow(beta2, static_cast<double>(step)));
  const float wd = static_cast<float>(weight_decay);
  // Where each row lives (rows do not move during this call), its range checked;
  // the row_map entries of CACHING are scattered, so they are prefetched.
  std::vector<float*> w_ptr(static_cast<size_t>(U));
  std::vector<float*> s_ptr(static_cast<size_t>(U));
  std::vector<int64_t> dirty_slot(score != nullptr ? static_cast<size_t>(U) : 0);
  for (int64_t u = 0; u < U; ++u) {
    const int64_t r = ur[u];
    TORCH_CHECK_INDEX(r >= 0 && r < num_rows, "recpipe: tiered `uniq` row ", r, " is outside [0, ", num_rows, ").");
    if (mode == kCaching && u + kPrefetchAhead < U) {
      const int64_t ahead = ur[u + kPrefetchAhead];
      if (ahead >= 0 && ahead < num_rows) {
        __builtin_prefetch(t.row_map + ahead);
      }
    }
    // re-resolve: a later lookup may have moved the row since this batch's forward
    const auto at = t.locate(r);
    w_ptr[u] = t.weights(at);
    s_ptr[u] = t.state(at);
    if (score != nullptr) {
      dirty_slot[u] = at.first ? at.second : -1;
    }
  }
  const int64_t cols = t.cols;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(float));
  const int64_t state_bytes = cols * static_cast<int64_t>(sizeof(float));
  // Rows are updated in groups of kGroup: each row's gradient is summed, and its
  // row-wise Adagrad square sum taken, in exactly the order of a row at a time
  // (d = 0 .. D-1); the group only interleaves independent rows' dependency chains.
  constexpr int64_t kGroup = 8;
  at::parallel_for(0, U, 16, [&](int64_t u0, int64_t u1) {
    std::vector<float> grads(static_cast<size_t>(kGroup * D));
    for (int64_t g0 = u0; g0 < u1; g0 += kGroup) {
      const int64_t gn = std::min(kGroup, u1 - g0);
      for (int64_t j = 0; j < gn; ++j) {
        const int64_t ahead = g0 + kGroup + j;
        if (ahead < U) {
          prefetch_bytes(w_ptr[ahead], row_bytes);
          prefetch_bytes(s_ptr[ahead], state_bytes);
        }
      }
      for (int64_t j = 0; j < gn; ++j) {
        const int64_t u = g0 + j;
        float* grad = grads.data() + j * D;
        std::fill_n(grad, D, 0.0f);
        for (int64_t k = start[u]; k < start[u + 1]; ++k) {
          const int64_t i = pos[k];
          const int64_t b = bag[i];
          const float* gb = g + b * D;
          if (psw != nullptr) {
            for (int64_t d = 0; d < D; ++d) {
              grad[d] += gb[d] * psw[i];
            }
          } else if (pooling == kMean) {
            const float len = static_cast<float>(off[b + 1] - off[b]);
            for (int64_t d = 0; d < D; ++d) {
              grad[d] += gb[d] / len;
            }
          } else {
            for (int64_t d = 0; d < D; ++d) {
              grad[d] += gb[d];
            }
          }
        }
      }
      if (optimizer == kSgd) {
        for (int64_t j = 0; j < gn; ++j) {
          const float* grad = grads.data() + j * D;
          float* w = w_ptr[g0 + j];
          for (int64_t d = 0; d < D; ++d) {
            w[d] -= flr * grad[d];
          }
        }
      } else if (optimizer == kRowwiseAdagrad) {
        float sq[kGroup] = {0.0f};
        if (gn == kGroup) {
          for (int64_t d = 0; d < D; ++d) {
            for (int64_t j = 0; j < kGroup; ++j) {
              const float x = grads[j * D + d];
              sq[j] += x * x;
            }
          }
        } else {
          for (int64_t j = 0; j < gn; ++j) {
            const float* grad = grads.data() + j * D;
            for (int64_t d = 0; d < D; ++d) {
              sq[j] += grad[d] * grad[d];
            }
          }
        }
        for (int64_t j = 0; j < gn; ++j) {
          const float* grad = grads.data() + j * D;
          float* w = w_ptr[g0 + j];
          float* s = s_ptr[g0 + j];
          s[0] += sq[j] / static_cast<float>(D);
          const float mult = flr / (std::sqrt(s[0]) + feps);
          for (int64_t d = 0; d < D; ++d) {
            w[d] -= grad[d] * mult;
          }
        }
      } else {
        for (int64_t j = 0; j < gn; ++j) {
          const float* grad = grads.data() + j * D;
          float* w = w_ptr[g0 + j];
          float* m1 = s_ptr[g0 + j];
          float* m2 = m1 + D;
          for (int64_t d = 0; d < D; ++d) {
            m1[d] = b1 * m1[d] + (1.0f - b1) * grad[d];
            m2[d] = b2 * m2[d] + (1.0f - b2) * grad[d] * grad[d];
            float upd = (m1[d] / bc1) / (std::sqrt(m2[d] / bc2) + feps);
            upd += wd * w[d];
            w[d] -= flr * upd;
          }
        }
      }
      if (score != nullptr) {
        for (int64_t j = 0; j < gn; ++j) {
          if (dirty_slot[g0 + j] >= 0) {
            score[dirty_slot[g0 + j]] |= 1;  // dirty: written back on eviction / flush
          }
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(recpipe, CPU, m) {
  m.impl("tiered_lookup", &tiered_lookup_cpu);
  m.impl("tiered_backward", &tiered_backward_cpu);
}

}  // namespace recpipe
