// recpipe: argument checks shared by the CPU and CUDA entry points.
//
// In the spirit of FBGEMM's TENSOR_ON_CPU / TENSORS_ON_SAME_DEVICE macros, every
// message names the argument, what was expected, what was received and how to
// fix it.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <vector>

#include "bucketize_math.h"

#define RECPIPE_CHECK_INDEX_DTYPE(t, name)                                    \
  TORCH_CHECK(                                                                \
      (t).scalar_type() == at::kInt || (t).scalar_type() == at::kLong,        \
      "recpipe: `" name "` must be int32 or int64, got ", (t).scalar_type(),  \
      "; convert it with `.to(torch.int64)`.")

#define RECPIPE_CHECK_1D(t, name)                                             \
  TORCH_CHECK(                                                                \
      (t).dim() == 1, "recpipe: `" name "` must be 1-D, got shape ",          \
      (t).sizes(), "; flatten it with `.view(-1)`.")

#define RECPIPE_CHECK_SAME_DEVICE(t, ref, name, ref_name)                     \
  TORCH_CHECK(                                                                \
      (t).device() == (ref).device(), "recpipe: `" name "` is on ",           \
      (t).device(), " but `" ref_name "` is on ", (ref).device(),             \
      "; move all tensor arguments to one device.")

namespace recpipe {

// Largest world size the ops accept: ranks are 32-bit in the kernels' owner
// buffers (and no process group comes near it).
constexpr int64_t kMaxWorldSize = (int64_t{1} << 31) - 1;

// Static (shape / dtype / device) checks for block_bucketize_sparse_features.
// Value checks (negative lengths, ids out of range, dist_types values) are made
// by the kernels, which read the data anyway.
inline void check_bucketize_args(
    const at::Tensor& lengths,
    const at::Tensor& indices,
    const at::Tensor& block_sizes,
    const at::Tensor& dist_types,
    int64_t my_size,
    const std::optional<at::Tensor>& weights,
    const std::optional<at::Tensor>& table_sizes) {
  RECPIPE_CHECK_1D(lengths, "lengths");
  RECPIPE_CHECK_1D(indices, "indices");
  RECPIPE_CHECK_1D(block_sizes, "block_sizes");
  RECPIPE_CHECK_1D(dist_types, "dist_types");
  RECPIPE_CHECK_INDEX_DTYPE(lengths, "lengths");
  RECPIPE_CHECK_INDEX_DTYPE(indices, "indices");
  RECPIPE_CHECK_INDEX_DTYPE(block_sizes, "block_sizes");
  RECPIPE_CHECK_INDEX_DTYPE(dist_types, "dist_types");
  TORCH_CHECK(
      my_size > 0, "recpipe: `my_size` (the world size W) must be >= 1, got ",
      my_size, "; pass the number of ranks the keys are routed to.");
  TORCH_CHECK(
      my_size <= kMaxWorldSize, "recpipe: `my_size` (the world size W) must be at most ", kMaxWorldSize,
      ", got ", my_size, "; pass the number of ranks the keys are routed to.");
  TORCH_CHECK(
      lengths.numel() == 0 || my_size <= INT64_MAX / 8 / lengths.numel(), "recpipe: `my_size` = ", my_size,
      " times ", lengths.numel(), " bags does not fit the [W * F * B] output lengths; pass the real world size.");
  const int64_t F = dist_types.numel();
  TORCH_CHECK(
      block_sizes.numel() == F, "recpipe: `block_sizes` has ",
      block_sizes.numel(), " entries but `dist_types` has ", F,
      "; pass one block size and one dist type per feature.");
  if (F == 0) {
    TORCH_CHECK(
        lengths.numel() == 0, "recpipe: `dist_types` is empty (0 features) ",
        "but `lengths` has ", lengths.numel(),
        " entries; pass one dist type per feature.");
  } else {
    TORCH_CHECK(
        lengths.numel() % F == 0, "recpipe: `lengths` has ", lengths.numel(),
        " entries, not a multiple of the ", F,
        " features in `dist_types`; lengths must be [F * B] (feature-major).");
  }
  RECPIPE_CHECK_SAME_DEVICE(indices, lengths, "indices", "lengths");
  // block_sizes / dist_types / table_sizes are per-feature metadata: they may
  // live on the CPU even when lengths/indices are on an accelerator.
  if (!block_sizes.is_cpu()) {
    RECPIPE_CHECK_SAME_DEVICE(block_sizes, lengths, "block_sizes", "lengths");
  }
  if (!dist_types.is_cpu()) {
    RECPIPE_CHECK_SAME_DEVICE(dist_types, lengths, "dist_types", "lengths");
  }
  if (weights.has_value()) {
    const auto& w = weights.value();
    RECPIPE_CHECK_1D(w, "weights");
    RECPIPE_CHECK_SAME_DEVICE(w, lengths, "weights", "lengths");
    TORCH_CHECK(
        w.scalar_type() == at::kFloat || w.scalar_type() == at::kDouble ||
            w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16,
        "recpipe: `weights` must be float16, bfloat16, float32 or float64, got ",
        w.scalar_type(), ".");
    TORCH_CHECK(
        w.numel() == indices.numel(), "recpipe: `weights` has ", w.numel(),
        " entries but `indices` has ", indices.numel(),
        "; pass one weight per id (or weights=None).");
  }
  if (table_sizes.has_value()) {
    const auto& ts = table_sizes.value();
    RECPIPE_CHECK_1D(ts, "table_sizes");
    RECPIPE_CHECK_INDEX_DTYPE(ts, "table_sizes");
    TORCH_CHECK(
        ts.numel() == F, "recpipe: `table_sizes` has ", ts.numel(),
        " entries but `dist_types` has ", F,
        "; pass one table size (rows) per feature.");
    if (!ts.is_cpu()) {
      RECPIPE_CHECK_SAME_DEVICE(ts, lengths, "table_sizes", "lengths");
    }
  }
}

// Per-feature routing parameters, built on the host from the [F] metadata
// tensors and validated value by value. Trivially copyable: the CUDA entry
// point copies the array to the device as bytes.
struct FeatureRoute {
  int64_t dist;             // DistType
  uint64_t block;           // rows per rank (continuous)
  uint64_t table_size;      // rows of the table (hash_roundrobin; roundrobin when given), else 0
  FastDivU64 div_block;     // / block
  HashPermutation perm;     // hash_roundrobin bijection of [0, table_size)
};

inline std::vector<FeatureRoute> build_feature_routes(
    const at::Tensor& block_sizes,
    const at::Tensor& dist_types,
    const std::optional<at::Tensor>& table_sizes,
    int64_t seed) {
  const int64_t F = dist_types.numel();
  const auto dt = dist_types.to(at::kCPU, at::kLong).contiguous();
  const auto bs = block_sizes.to(at::kCPU, at::kLong).contiguous();
  at::Tensor ts;
  if (table_sizes.has_value()) {
    ts = table_sizes.value().to(at::kCPU, at::kLong).contiguous();
  }
  const int64_t* dtp = dt.const_data_ptr<int64_t>();
  const int64_t* bsp = bs.const_data_ptr<int64_t>();
  std::vector<FeatureRoute> routes(F);
  for (int64_t f = 0; f < F; ++f) {
    FeatureRoute& r = routes[f];
    r.dist = dtp[f];
    TORCH_CHECK(
        r.dist == kContinuous || r.dist == kRoundRobin ||
            r.dist == kHashRoundRobin,
        "recpipe: `dist_types[", f, "]` is ", r.dist,
        "; it must be 0 (continuous), 1 (roundrobin) or 2 (hash_roundrobin).");
    r.block = 1;
    r.table_size = 0;
    if (r.dist == kContinuous) {
      TORCH_CHECK(
          bsp[f] > 0, "recpipe: `block_sizes[", f, "]` is ", bsp[f],
          " but feature ", f, " is continuous, which needs rows-per-rank >= 1; ",
          "pass ceil(table_rows / world_size).");
      r.block = static_cast<uint64_t>(bsp[f]);
      r.div_block = FastDivU64(r.block);
    } else if (r.dist == kHashRoundRobin) {
      TORCH_CHECK(
          ts.defined(), "recpipe: feature ", f,
          " is hash_roundrobin (dist_types[", f, "] == 2), which needs ",
          "`table_sizes`; pass a tensor with the row count of each feature's table.");
      const int64_t n = ts.const_data_ptr<int64_t>()[f];
      TORCH_CHECK(
          n > 0, "recpipe: `table_sizes[", f, "]` is ", n,
          " but feature ", f, " is hash_roundrobin, which needs the table's ",
          "row count (>= 1).");
      r.table_size = static_cast<uint64_t>(n);
      r.perm = HashPermutation(r.table_size, static_cast<uint64_t>(seed));
    } else if (ts.defined()) {
      // roundrobin with the table's size given (> 0): the kernels check its ids
      // against it; 0 leaves the feature's raw ids unchecked (id % W).
      const int64_t n = ts.const_data_ptr<int64_t>()[f];
      TORCH_CHECK(
          n >= 0, "recpipe: `table_sizes[", f, "]` is ", n, "; pass the table's row count (or 0 for ",
          "a roundrobin feature of raw, unchecked ids).");
      r.table_size = static_cast<uint64_t>(n);
    }
  }
  return routes;
}

inline void check_global_ids_args(
    const at::Tensor& ranks,
    const at::Tensor& local_ids,
    int64_t table_size,
    int64_t world_size) {
  RECPIPE_CHECK_1D(ranks, "ranks");
  RECPIPE_CHECK_1D(local_ids, "local_ids");
  RECPIPE_CHECK_INDEX_DTYPE(ranks, "ranks");
  RECPIPE_CHECK_INDEX_DTYPE(local_ids, "local_ids");
  RECPIPE_CHECK_SAME_DEVICE(local_ids, ranks, "local_ids", "ranks");
  TORCH_CHECK(
      ranks.numel() == local_ids.numel(), "recpipe: `ranks` has ", ranks.numel(),
      " entries but `local_ids` has ", local_ids.numel(), "; pass one rank per local id.");
  TORCH_CHECK(
      table_size > 0, "recpipe: `table_size` must be >= 1 (the table's row count), got ",
      table_size, ".");
  TORCH_CHECK(
      world_size > 0, "recpipe: `world_size` must be >= 1, got ", world_size, "; pass the world size the ids were routed with.");
  TORCH_CHECK(
      world_size <= kMaxWorldSize, "recpipe: `world_size` must be at most ", kMaxWorldSize, ", got ", world_size,
      "; pass the world size the ids were routed with.");
}

inline void check_route_ids_args(const at::Tensor& ids, int64_t table_size, int64_t world_size, int64_t dist_type) {
  RECPIPE_CHECK_INDEX_DTYPE(ids, "ids");
  TORCH_CHECK(
      table_size > 0, "recpipe: `table_size` must be >= 1 (the table's row count), got ", table_size, ".");
  TORCH_CHECK(
      world_size > 0, "recpipe: `world_size` must be >= 1, got ", world_size, "; pass the number of ranks the table is sharded over.");
  TORCH_CHECK(
      world_size <= kMaxWorldSize, "recpipe: `world_size` must be at most ", kMaxWorldSize, ", got ", world_size,
      "; pass the number of ranks the table is sharded over.");
  TORCH_CHECK(
      dist_type == kContinuous || dist_type == kRoundRobin || dist_type == kHashRoundRobin,
      "recpipe: `dist_type` is ", dist_type,
      "; it must be 0 (continuous), 1 (roundrobin) or 2 (hash_roundrobin).");
}

}  // namespace recpipe
