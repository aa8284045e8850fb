// recpipe: the dynamic table's hashing, shared by the CPU (.cpp) and CUDA (.cu)
// kernels of its key index (docs: the dynamic table spec, "Hashing").
//
// A dynamic shard maps raw int64 keys (any value, negatives included) to
// buckets of `bucket_slots` slots. Everything that decides which bucket a key
// lives in is here, once, as host/device inline functions, so every kernel and
// the pure-Python reference agree bit for bit:
//
//   * mix64        : splitmix64's finalizer on a uint64 (wrap-around arithmetic)
//   * DynamicBuckets: bucket(key) = (mix64(uint64(key) ^ salt) >> 1) mod B;
//                    ">> 1" keeps the hash in int63, so a torch implementation
//                    can compute it in int64. The mod is FastDivU64's multiply
//                    (exact for every uint64), not a hardware divide.
#pragma once

#include <cstdint>

#include "bucketize_math.h"  // RECPIPE_HD, FastDivU64

namespace recpipe {

// splitmix64's finalizer: x ^= x >> 30; x *= C1; x ^= x >> 27; x *= C2; x ^= x >> 31.
RECPIPE_HD uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// The bucket function of one table: `num_buckets` (>= 1) buckets under `salt`
// (the uint64 bucket salt; the ops receive it as the int64 with the same bits).
struct DynamicBuckets {
  uint64_t salt;
  uint64_t num_buckets;
  FastDivU64 div;

  RECPIPE_HD DynamicBuckets() : salt(0), num_buckets(1), div() {}

  // Host-only construction (FastDivU64's magic uses a 128-bit division).
  DynamicBuckets(uint64_t bucket_salt, uint64_t buckets)
      : salt(bucket_salt), num_buckets(buckets == 0 ? 1 : buckets), div(buckets == 0 ? 1 : buckets) {}

  // (mix64(uint64(key) ^ salt) >> 1) mod num_buckets.
  RECPIPE_HD int64_t bucket(int64_t key) const {
    const uint64_t h = mix64(static_cast<uint64_t>(key) ^ salt) >> 1;
    return static_cast<int64_t>(h - div.div(h) * num_buckets);
  }
};

// u(j) in [0, 1) of a key's initial row (docs/dynamic.md "New rows"): base =
// mix64(uint64(key) ^ init_salt); u(j) = (mix64(base + (j + 1) * golden) >> 11) * 2^-53.
RECPIPE_HD double init_uniform(uint64_t base, int64_t j) {
  constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
  return static_cast<double>(mix64(base + static_cast<uint64_t>(j + 1) * kGolden) >> 11) * 0x1.0p-53;
}

}  // namespace recpipe
