// recpipe: the dynamic key index's deduplication of a batch's raw keys (CPU).
//
//   dynamic_unique  (uniq, inverse, counts) of 1-D int64 keys, equal to
//                   torch.unique(keys, sorted=True, return_inverse=True,
//                   return_counts=True): uniq ascending, inverse[i] the
//                   position of keys[i] in uniq, counts[j] its repeats.
//
// First a hash set of the keys (open addressing, linear probing on mix64 of the
// key, at most half full; the home cells of the keys kAhead positions on are
// prefetched, since the set outgrows the L1 cache) gives each distinct key an id
// in order of first sight; then only the distinct keys are sorted, by a
// least-significant-digit radix sort of (key, id) pairs over the key's
// order-preserving unsigned image (sign bit flipped; 11-bit digits, six passes
// at most, a digit every key shares skipped); a last pass maps ids to sorted
// positions. O(n) time, O(n) scratch, one thread: a batch's keys are few (one
// step's lookups), and the result never depends on the thread count.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "dynamic_hash.h"

namespace recpipe {
namespace {

constexpr int kDigitBits = 11;
constexpr int kDigits = (64 + kDigitBits - 1) / kDigitBits;
constexpr int kRadix = 1 << kDigitBits;
constexpr uint64_t kSignBit = uint64_t{1} << 63;
constexpr int64_t kAhead = 16;  // keys whose hash-set cells are prefetched ahead of the probe (a power of two)

struct KeyAt {
  uint64_t key;  // order-preserving image of the int64 key
  int64_t at;    // its first-sight id
};

// Sorts `a` (n pairs) by key, stable; `b` is scratch of n pairs. Returns the buffer holding the result.
KeyAt* radix_sort(KeyAt* a, KeyAt* b, int64_t n) {
  std::vector<std::array<int32_t, kRadix>> hist(kDigits);  // n < 2^31 (checked by the caller)
  for (auto& h : hist) h.fill(0);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t k = a[i].key;
    for (int d = 0; d < kDigits; ++d) ++hist[d][(k >> (d * kDigitBits)) & (kRadix - 1)];
  }
  for (int d = 0; d < kDigits; ++d) {
    auto& h = hist[d];
    const uint64_t digit0 = (a[0].key >> (d * kDigitBits)) & (kRadix - 1);
    if (h[digit0] == n) continue;  // every key has this digit: the pass would not move anything
    int32_t pos = 0;
    for (int v = 0; v < kRadix; ++v) {
      const int32_t c = h[v];
      h[v] = pos;
      pos += c;
    }
    for (int64_t i = 0; i < n; ++i) {
      const KeyAt p = a[i];
      b[h[(p.key >> (d * kDigitBits)) & (kRadix - 1)]++] = p;
    }
    std::swap(a, b);
  }
  return a;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dynamic_unique_cpu(const at::Tensor& keys) {
  TORCH_CHECK(keys.device().is_cpu(), "recpipe::dynamic_unique: `keys` is on ", keys.device(),
              "; the CPU kernel takes a CPU tensor (use torch.unique on other devices).");
  TORCH_CHECK(keys.dim() == 1, "recpipe::dynamic_unique: `keys` must be 1-D, got shape ", keys.sizes(),
              "; flatten it with `.view(-1)`.");
  TORCH_CHECK(keys.scalar_type() == at::kLong, "recpipe::dynamic_unique: `keys` must be int64, got ",
              keys.scalar_type(), "; convert it with `.to(torch.int64)`.");
  const at::Tensor k = keys.contiguous();
  const int64_t n = k.numel();
  at::Tensor inverse = at::empty({n}, k.options());
  if (n == 0) {
    return {at::empty({0}, k.options()), inverse, at::empty({0}, k.options())};
  }
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max(), "recpipe::dynamic_unique: `keys` has ", n,
              " entries, more than 2^31 - 1; deduplicate it in parts.");
  const int64_t* kp = k.const_data_ptr<int64_t>();
  int64_t* inv = inverse.mutable_data_ptr<int64_t>();
  // distinct keys in order of first sight; inv holds each position's first-sight id for now
  uint64_t cap = 16;
  while (cap < 2 * static_cast<uint64_t>(n)) cap <<= 1;
  const uint64_t mask = cap - 1;
  std::vector<int32_t> table(cap, -1);  // first-sight id of the key in each cell, -1: empty
  std::vector<KeyAt> distinct;
  std::vector<int64_t> seen_counts;
  distinct.reserve(static_cast<size_t>(n));
  seen_counts.reserve(static_cast<size_t>(n));
  uint64_t home[kAhead];  // home cells of keys i .. i + kAhead - 1
  auto issue = [&](int64_t i) {
    const uint64_t cell = mix64(static_cast<uint64_t>(kp[i])) & mask;
    home[i & (kAhead - 1)] = cell;
    __builtin_prefetch(table.data() + cell);
  };
  for (int64_t i = 0; i < std::min(n, kAhead); ++i) issue(i);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t key = kp[i];
    uint64_t cell = home[i & (kAhead - 1)];
    if (i + kAhead < n) issue(i + kAhead);
    while (true) {
      const int32_t id = table[cell];
      if (id < 0) {
        const int32_t fresh = static_cast<int32_t>(distinct.size());
        table[cell] = fresh;
        distinct.push_back({static_cast<uint64_t>(key) ^ kSignBit, fresh});
        seen_counts.push_back(1);
        inv[i] = fresh;
        break;
      }
      if (static_cast<int64_t>(distinct[id].key ^ kSignBit) == key) {
        ++seen_counts[id];
        inv[i] = id;
        break;
      }
      cell = (cell + 1) & mask;
    }
  }
  const int64_t u = static_cast<int64_t>(distinct.size());
  std::vector<KeyAt> scratch(static_cast<size_t>(u));
  const KeyAt* sorted = radix_sort(distinct.data(), scratch.data(), u);
  at::Tensor uniq = at::empty({u}, k.options());
  at::Tensor counts = at::empty({u}, k.options());
  int64_t* up = uniq.mutable_data_ptr<int64_t>();
  int64_t* cp = counts.mutable_data_ptr<int64_t>();
  std::vector<int64_t> rank(static_cast<size_t>(u));  // first-sight id -> ascending position
  for (int64_t j = 0; j < u; ++j) {
    up[j] = static_cast<int64_t>(sorted[j].key ^ kSignBit);
    cp[j] = seen_counts[sorted[j].at];
    rank[sorted[j].at] = j;
  }
  for (int64_t i = 0; i < n; ++i) inv[i] = rank[inv[i]];
  return {uniq, inverse, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(recpipe, CPU, m) { m.impl("dynamic_unique", &dynamic_unique_cpu); }

}  // namespace recpipe
