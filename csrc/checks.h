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
#include <tuple>
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

// Every argument of block_bucketize_sparse_features, as the kernels receive it
// (but max_B: accepted for fbgemm compatibility and unused, feature_bags maps
// bags to features without it).
struct BucketizeArgs {
  at::Tensor lengths;
  at::Tensor indices;
  at::Tensor block_sizes;
  at::Tensor dist_types;
  int64_t my_size;
  bool sequence;
  bool bucketize_pos;
  std::optional<at::Tensor> weights;
  std::optional<at::Tensor> table_sizes;
  int64_t seed;
  bool keep_orig_idx;
  std::optional<at::Tensor> batch_size_per_feature;
  std::optional<std::vector<at::Tensor>> block_bucketize_pos;
  std::optional<at::Tensor> total_num_blocks;
  std::optional<at::Tensor> keep_orig_idx_per_feature;
  bool return_bucket_mapping;
  bool route_bad_ids;  // recpipe's: route ids outside a routed table instead of refusing them

  bool has_bounds() const { return block_bucketize_pos.has_value() && !block_bucketize_pos->empty(); }
  // Entries of one weight: 1 for [n] weights, D for [n, D].
  int64_t weights_dim() const { return weights.has_value() && weights->dim() == 2 ? weights->size(1) : 1; }
};

// A per-feature [F] metadata tensor: 1-D, integer (or bool), F entries; it may
// stay on the CPU when lengths / indices live on an accelerator.
inline void check_feature_tensor(const at::Tensor& t, const char* name, int64_t F, const at::Tensor& lengths,
                                 bool boolean = false) {
  TORCH_CHECK(t.dim() == 1, "recpipe: `", name, "` must be 1-D with one entry per feature, got shape ", t.sizes(),
              ".");
  if (boolean) {
    TORCH_CHECK(t.scalar_type() == at::kBool, "recpipe: `", name, "` must be a bool tensor, got ", t.scalar_type(),
                "; build it with `torch.tensor([...], dtype=torch.bool)`.");
  } else {
    TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "recpipe: `", name,
                "` must be int32 or int64, got ", t.scalar_type(), "; convert it with `.to(torch.int64)`.");
  }
  TORCH_CHECK(t.numel() == F, "recpipe: `", name, "` has ", t.numel(), " entries but `dist_types` has ", F,
              "; pass one entry per feature.");
  TORCH_CHECK(t.is_cpu() || t.device() == lengths.device(), "recpipe: `", name, "` is on ", t.device(),
              " but `lengths` is on ", lengths.device(), "; keep per-feature metadata on the CPU or on that device.");
}

// Static (shape / dtype / device) checks of block_bucketize_sparse_features.
// Values (lengths, ids, metadata) are checked by build_feature_routes and the
// kernels, which read them anyway.
inline void check_bucketize_args(const BucketizeArgs& a) {
  RECPIPE_CHECK_1D(a.lengths, "lengths");
  RECPIPE_CHECK_1D(a.indices, "indices");
  RECPIPE_CHECK_INDEX_DTYPE(a.lengths, "lengths");
  RECPIPE_CHECK_INDEX_DTYPE(a.indices, "indices");
  RECPIPE_CHECK_SAME_DEVICE(a.indices, a.lengths, "indices", "lengths");
  TORCH_CHECK(a.my_size > 0, "recpipe: `my_size` (the world size W) must be >= 1, got ", a.my_size,
              "; pass the number of ranks the keys are routed to.");
  TORCH_CHECK(a.my_size <= kMaxWorldSize, "recpipe: `my_size` (the world size W) must be at most ", kMaxWorldSize,
              ", got ", a.my_size, "; pass the number of ranks the keys are routed to.");
  TORCH_CHECK(a.lengths.numel() == 0 || a.my_size <= INT64_MAX / 8 / a.lengths.numel(), "recpipe: `my_size` = ",
              a.my_size, " times ", a.lengths.numel(),
              " bags does not fit the [W * F * B] output lengths; pass the real world size.");
  const int64_t F = a.dist_types.numel();
  check_feature_tensor(a.dist_types, "dist_types", F, a.lengths);
  check_feature_tensor(a.block_sizes, "block_sizes", F, a.lengths);
  if (a.table_sizes.has_value()) {
    check_feature_tensor(*a.table_sizes, "table_sizes", F, a.lengths);
  }
  if (a.total_num_blocks.has_value()) {
    check_feature_tensor(*a.total_num_blocks, "total_num_blocks", F, a.lengths);
  }
  if (a.keep_orig_idx_per_feature.has_value()) {
    check_feature_tensor(*a.keep_orig_idx_per_feature, "keep_orig_idx_per_feature", F, a.lengths, true);
  }
  if (a.batch_size_per_feature.has_value()) {
    check_feature_tensor(*a.batch_size_per_feature, "batch_size_per_feature", F, a.lengths);
  } else if (F == 0) {
    TORCH_CHECK(a.lengths.numel() == 0, "recpipe: `dist_types` is empty (0 features) but `lengths` has ",
                a.lengths.numel(), " entries; pass one dist type per feature.");
  } else {
    TORCH_CHECK(a.lengths.numel() % F == 0, "recpipe: `lengths` has ", a.lengths.numel(), " entries, not a multiple of the ",
                F, " features in `dist_types`; lengths must be [F * B] (feature-major), or pass "
                "`batch_size_per_feature` for a variable batch per feature.");
  }
  if (a.has_bounds()) {
    TORCH_CHECK(static_cast<int64_t>(a.block_bucketize_pos->size()) == F, "recpipe: `block_bucketize_pos` has ",
                a.block_bucketize_pos->size(), " tensors but `dist_types` has ", F,
                "; pass one tensor of shard bounds per feature.");
    for (int64_t f = 0; f < F; ++f) {
      const at::Tensor& b = (*a.block_bucketize_pos)[f];
      TORCH_CHECK(b.dim() == 1 && (b.scalar_type() == at::kInt || b.scalar_type() == at::kLong),
                  "recpipe: `block_bucketize_pos[", f, "]` must be a 1-D int32/int64 tensor, got ",
                  b.scalar_type(), " of shape ", b.sizes(), ".");
    }
  }
  if (a.weights.has_value()) {
    const at::Tensor& w = *a.weights;
    TORCH_CHECK(w.dim() == 1 || w.dim() == 2, "recpipe: `weights` must be [n] or [n, D] (one row per id), got shape ",
                w.sizes(), ".");
    RECPIPE_CHECK_SAME_DEVICE(w, a.lengths, "weights", "lengths");
    TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kDouble || w.scalar_type() == at::kHalf ||
                    w.scalar_type() == at::kBFloat16,
                "recpipe: `weights` must be float16, bfloat16, float32 or float64, got ", w.scalar_type(), ".");
    TORCH_CHECK(w.size(0) == a.indices.numel(), "recpipe: `weights` has ", w.size(0), " entries but `indices` has ",
                a.indices.numel(), "; pass one weight per id (or weights=None).");
  }
}

// The routes of every feature, built on the host from the [F] metadata and
// checked value by value; `bounds` receives the uneven-shard bounds of every
// feature, flattened (int64, CPU), each FeatureRoute pointing at its own.
// Trivially copyable: the CUDA op passes them to the device as bytes.
inline std::vector<FeatureRoute> build_feature_routes(const BucketizeArgs& a, at::Tensor* bounds) {
  const int64_t F = a.dist_types.numel();
  const uint64_t W = static_cast<uint64_t>(a.my_size);
  const int index_bits = a.indices.scalar_type() == at::kInt ? 32 : 64;
  auto host = [](const at::Tensor& t) { return t.to(at::kCPU, at::kLong).contiguous(); };
  const at::Tensor dt = host(a.dist_types);
  const at::Tensor bs = host(a.block_sizes);
  const at::Tensor ts = a.table_sizes.has_value() ? host(*a.table_sizes) : at::Tensor();
  const at::Tensor tnb = a.total_num_blocks.has_value() ? host(*a.total_num_blocks) : at::Tensor();
  const at::Tensor keep = a.keep_orig_idx_per_feature.has_value()
                              ? a.keep_orig_idx_per_feature->to(at::kCPU).contiguous()
                              : at::Tensor();
  std::vector<at::Tensor> parts;
  std::vector<FeatureRoute> routes(F);
  int64_t bounds_at = 0;
  for (int64_t f = 0; f < F; ++f) {
    const int64_t dist = dt.const_data_ptr<int64_t>()[f];
    const int64_t block = bs.const_data_ptr<int64_t>()[f];
    const char* name = dist == kContinuous ? "continuous" : dist == kRoundRobin ? "roundrobin" : "hash_roundrobin";
    TORCH_CHECK(dist == kContinuous || dist == kRoundRobin || dist == kHashRoundRobin, "recpipe: `dist_types[", f,
                "]` is ", dist, "; it must be 0 (continuous), 1 (roundrobin) or 2 (hash_roundrobin).");
    const int64_t count = a.has_bounds() ? (*a.block_bucketize_pos)[f].numel() : 0;
    TORCH_CHECK(dist == kContinuous || count == 0, "recpipe: `block_bucketize_pos` (uneven row-wise shards) "
                "applies to continuous features only, but feature ", f, " is ", name,
                " and `block_bucketize_pos[", f, "]` has ", count, " bounds; pass an empty tensor for it.");
    TORCH_CHECK(dist != kContinuous || !a.has_bounds() || count >= 1, "recpipe: `block_bucketize_pos[", f,
                "]` is empty but feature ", f, " is continuous; pass its shard bounds (0, then the first row of "
                "each next rank).");
    TORCH_CHECK(dist == kContinuous || !a.total_num_blocks.has_value(), "recpipe: `total_num_blocks` applies to "
                "continuous features only, but feature ", f, " is ", name,
                "; drop total_num_blocks or route the feature with dist_types 0 (continuous).");
    uint64_t num_blocks = W;
    if (tnb.defined()) {
      const int64_t g = tnb.const_data_ptr<int64_t>()[f];
      TORCH_CHECK(g >= 1 && (a.has_bounds() || g % a.my_size == 0), "recpipe: `total_num_blocks[", f, "]` is ", g,
                  "; it must be a positive multiple of `my_size` = ", a.my_size,
                  " (each rank holds total_num_blocks / W blocks).");
      num_blocks = static_cast<uint64_t>(g);
    }
    if (count > 0) {
      const at::Tensor b = host((*a.block_bucketize_pos)[f]);
      const int64_t* v = b.const_data_ptr<int64_t>();
      TORCH_CHECK(v[0] == 0, "recpipe: `block_bucketize_pos[", f, "][0]` is ", v[0],
                  "; shard bounds start at row 0 (then the first row of each next rank).");
      for (int64_t i = 1; i < count; ++i) {
        TORCH_CHECK(v[i] >= v[i - 1], "recpipe: `block_bucketize_pos[", f, "]` decreases at entry ", i, " (",
                    v[i - 1], " then ", v[i], "); shard bounds must be non-decreasing row offsets.");
      }
      // block == 0 keys an id by (id % G) * b[k-1] / G, a product fbgemm forms in the
      // signed index width: refused where it would wrap (fbgemm routes to wrong ranks there).
      const int64_t width_max = index_bits == 32 ? INT32_MAX : INT64_MAX;
      const int64_t last = v[count - 1];
      TORCH_CHECK(block != 0 || num_blocks <= 1 || last <= width_max / static_cast<int64_t>(num_blocks - 1),
                  "recpipe: feature ", f, " has `block_sizes[", f, "]` = 0 with shard bounds, so its ids are keyed "
                  "(id % G) * `block_bucketize_pos[", f, "][-1]` / G with G = ", num_blocks,
                  " blocks, but (G - 1) * ", last, " exceeds ", width_max, ", the largest int", index_bits,
                  " index (the product would wrap and route ids to wrong ranks); ",
                  index_bits == 32 ? "pass int64 `indices` (`.to(torch.int64)`) or fewer `total_num_blocks`."
                                   : "pass fewer `total_num_blocks` or smaller shard bounds.");
      parts.push_back(b);
    } else if (dist == kContinuous && !a.has_bounds()) {
      // block 0 (fbgemm's raw-id rule): no id falls in a block, every id goes to
      // rank (id % G) / (G / W) with local id id / G.
      TORCH_CHECK(block >= 0, "recpipe: `block_sizes[", f, "]` is ", block, " but feature ", f,
                  " is continuous, which needs rows-per-rank >= 0; pass ceil(table_rows / world_size) "
                  "(or 0 to route every id by id % total_num_blocks).");
    }
    const bool keep_f = keep.defined() ? keep.const_data_ptr<bool>()[f] : a.keep_orig_idx;
    uint64_t table_size = 0;
    if (dist == kHashRoundRobin) {
      TORCH_CHECK(ts.defined(), "recpipe: feature ", f, " is hash_roundrobin (dist_types[", f,
                  "] == 2), which needs `table_sizes`; pass a tensor with the row count of each feature's table.");
      // 0: raw keys, every id valid, routed by H of the whole 64-bit range
      const int64_t n = ts.const_data_ptr<int64_t>()[f];
      TORCH_CHECK(n >= 0, "recpipe: `table_sizes[", f, "]` is ", n, " but feature ", f,
                  " is hash_roundrobin, which needs the table's row count (>= 1), or 0 for raw int64 keys "
                  "(any value, routed over the whole 64-bit range).");
      table_size = static_cast<uint64_t>(n);
      TORCH_CHECK(n > 0 || index_bits == 64 || keep_f, "recpipe: feature ", f,
                  " is hash_roundrobin over raw keys (`table_sizes[", f, "]` = 0) and ", a.my_size,
                  " ranks, so its local ids H(key) / W reach ", ~0ULL / W,
                  ", which int32 `indices` cannot hold; pass int64 indices (`.to(torch.int64)`), or keep the keys "
                  "as local ids (keep_orig_idx / keep_orig_idx_per_feature).");
      TORCH_CHECK(n == 0 || index_bits == 64 || keep_f || (n - 1) / a.my_size <= INT32_MAX, "recpipe: feature ", f,
                  " is hash_roundrobin over `table_sizes[", f, "]` = ", n, " rows and ", a.my_size,
                  " ranks, so its local ids reach ", (n - 1) / a.my_size,
                  ", which int32 `indices` cannot hold; pass int64 indices (`.to(torch.int64)`).");
    } else if (dist == kRoundRobin && ts.defined()) {
      // roundrobin with the table's size given (> 0) checks its ids against it;
      // 0 leaves the feature's raw ids unchecked (id % W).
      const int64_t n = ts.const_data_ptr<int64_t>()[f];
      TORCH_CHECK(n >= 0, "recpipe: `table_sizes[", f, "]` is ", n,
                  "; pass the table's row count (or 0 for a roundrobin feature of raw, unchecked ids).");
      table_size = static_cast<uint64_t>(n);
    }
    // Uneven shards test only block == 0 (fbgemm's rule: a negative block there reads as
    // nonzero, ids keyed by themselves); elsewhere a negative block of a routed feature is unused.
    const uint64_t route_block = count > 0 ? static_cast<uint64_t>(block) : static_cast<uint64_t>(block < 0 ? 0 : block);
    routes[f] = FeatureRoute::make(dist, keep_f, index_bits, W, route_block, num_blocks, bounds_at, count,
                                   table_size, static_cast<uint64_t>(a.seed), a.route_bad_ids);
    bounds_at += count;
  }
  *bounds = parts.empty() ? at::zeros({1}, at::kLong) : at::cat(parts);
  return routes;
}

// First bag of every feature (F + 1 entries): f * B, or the prefix sum of
// batch_size_per_feature (VBE), whose total must be the number of bags.
inline std::vector<int64_t> feature_bags(const BucketizeArgs& a) {
  const int64_t F = a.dist_types.numel();
  const int64_t FB = a.lengths.numel();
  std::vector<int64_t> begin(F + 1, 0);
  if (!a.batch_size_per_feature.has_value()) {
    for (int64_t f = 0; f <= F; ++f) {
      begin[f] = F == 0 ? 0 : f * (FB / F);
    }
    return begin;
  }
  // read on the host: a device-to-host copy (a sync) when it lives on the GPU
  const at::Tensor bpf = a.batch_size_per_feature->to(at::kCPU, at::kLong).contiguous();
  for (int64_t f = 0; f < F; ++f) {
    const int64_t b = bpf.const_data_ptr<int64_t>()[f];
    TORCH_CHECK(b >= 0, "recpipe: `batch_size_per_feature[", f, "]` is ", b, "; batch sizes must be >= 0.");
    TORCH_CHECK(b <= FB - begin[f], "recpipe: `batch_size_per_feature` sums past the ", FB,
                " bags of `lengths` at feature ", f, " (batch_size_per_feature[", f, "] = ", b,
                "); pass the batch size of each feature (the KJT's stride per key).");
    begin[f + 1] = begin[f] + b;
  }
  TORCH_CHECK(begin[F] == FB, "recpipe: `batch_size_per_feature` sums to ", begin[F], " but `lengths` has ", FB,
              " bags; pass the batch size of each feature (the KJT's stride per key).");
  return begin;
}

// Checks every argument, makes lengths / indices / weights contiguous and builds
// the host routing: what the CPU and CUDA kernels of block_bucketize_sparse_features
// start from.
struct BucketizeCall {
  BucketizeArgs args;
  std::vector<FeatureRoute> routes;
  at::Tensor bounds;               // flat uneven-shard bounds (build_feature_routes)
  std::vector<int64_t> fbag;       // first bag of each feature (feature_bags)
};

inline BucketizeCall prepare_bucketize(BucketizeArgs a) {
  check_bucketize_args(a);
  a.lengths = a.lengths.contiguous();
  a.indices = a.indices.contiguous();
  if (a.weights.has_value()) {
    a.weights = a.weights->contiguous();
  }
  BucketizeCall call{a, {}, {}, {}};
  call.routes = build_feature_routes(call.args, &call.bounds);
  call.fbag = feature_bags(call.args);
  return call;
}

// What block_bucketize_sparse_features returns: new_lengths, new_indices,
// new_weights, new_pos, unbucketize_permute, bucket_mapping.
using BucketizeResult = std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>,
                                   std::optional<at::Tensor>, std::optional<at::Tensor>>;

// The outputs of block_bucketize_sparse_features, as the CPU and CUDA kernels
// fill them (n ids, FB bags, W ranks).
struct BucketizeOutputs {
  at::Tensor new_lengths;                 // [W * FB], rank-major
  at::Tensor new_indices;                 // [n]
  std::optional<at::Tensor> new_weights;  // weights' shape and dtype, if weights are given
  std::optional<at::Tensor> new_pos;      // [n], if bucketize_pos
  std::optional<at::Tensor> dest;         // [n] output position of each id, if sequence or weights
                                          // (returned as unbucketize_permute if sequence)
  std::optional<at::Tensor> mapping;      // [n] owner rank of each id, if return_bucket_mapping

  // The returned tuple: dest only if sequence (else it served the weights only).
  BucketizeResult result(const BucketizeArgs& a) const {
    return {new_lengths, new_indices, new_weights, new_pos, a.sequence ? dest : std::nullopt, mapping};
  }
};

// Allocates the outputs of `call` from its shapes and flags. zero_lengths: new_lengths
// starts at 0 (the CUDA count kernel adds to it; the CPU kernel clears its own rows).
inline BucketizeOutputs allocate_bucketize_outputs(const BucketizeCall& call, bool zero_lengths) {
  const BucketizeArgs& a = call.args;
  const int64_t n = a.indices.numel();
  const auto like_ids = a.indices.options();
  const int64_t WFB = a.my_size * a.lengths.numel();
  auto make_if = [&](bool want) { return want ? std::optional<at::Tensor>(at::empty({n}, like_ids)) : std::nullopt; };
  BucketizeOutputs out;
  out.new_lengths = zero_lengths ? at::zeros({WFB}, a.lengths.options()) : at::empty({WFB}, a.lengths.options());
  out.new_indices = at::empty({n}, like_ids);
  out.new_pos = make_if(a.bucketize_pos);
  out.dest = make_if(a.sequence || a.weights.has_value());
  out.mapping = make_if(a.return_bucket_mapping);
  if (a.weights.has_value()) {
    out.new_weights = at::empty(a.weights->sizes(), a.weights->options());
  }
  return out;
}

// The errors of the per-id routing ops, raised by their CPU and CUDA kernels alike.
[[noreturn]] inline void fail_route_id_outside(int64_t at, int64_t value, int64_t table_size) {
  TORCH_CHECK_INDEX(false, "recpipe: `ids[", at, "]` = ", value, " is outside [0, table_size = ", table_size,
                    "); route_ids takes ids of the table's rows (hash or clamp raw ids upstream).");
}

[[noreturn]] inline void fail_not_a_slot(int64_t at, int64_t rank, int64_t local, int64_t table_size,
                                         int64_t world_size) {
  TORCH_CHECK(false, "recpipe: (`ranks[", at, "]`, `local_ids[", at, "]`) = (", rank, ", ", local,
              ") is not a slot of a table of ", table_size, " rows over ", world_size,
              " ranks under hash_roundrobin (needs 0 <= rank < world_size and "
              "local_id * world_size + rank < table_size); check the checkpoint's world size.");
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
      table_size >= 0, "recpipe: `table_size` must be >= 1 (the table's row count), or 0 for raw int64 keys, got ",
      table_size, ".");
  TORCH_CHECK(
      world_size > 0, "recpipe: `world_size` must be >= 1, got ", world_size, "; pass the world size the ids were routed with.");
  TORCH_CHECK(
      world_size <= kMaxWorldSize, "recpipe: `world_size` must be at most ", kMaxWorldSize, ", got ", world_size,
      "; pass the world size the ids were routed with.");
  TORCH_CHECK(
      local_ids.scalar_type() == at::kLong || table_size > 0, "recpipe: `local_ids` are int32 but raw keys "
      "(`table_size` = 0) are int64 global ids (returned in the dtype of local_ids); pass int64 local_ids "
      "(`.to(torch.int64)`).");
  TORCH_CHECK(
      local_ids.scalar_type() == at::kLong || table_size - 1 <= INT32_MAX, "recpipe: `local_ids` are int32 but a "
      "table of `table_size` = ", table_size, " rows has global ids above the int32 range (returned in the dtype of "
      "local_ids); pass int64 local_ids (`.to(torch.int64)`).");
}

// table_size 0 (raw keys: every int64 id valid, H of the whole 64-bit range) is
// hash_roundrobin's only; continuous and roundrobin tables need their row count.
inline void check_route_ids_args(const at::Tensor& ids, int64_t table_size, int64_t world_size, int64_t dist_type) {
  RECPIPE_CHECK_INDEX_DTYPE(ids, "ids");
  TORCH_CHECK(
      dist_type == kContinuous || dist_type == kRoundRobin || dist_type == kHashRoundRobin,
      "recpipe: `dist_type` is ", dist_type,
      "; it must be 0 (continuous), 1 (roundrobin) or 2 (hash_roundrobin).");
  TORCH_CHECK(
      table_size > 0 || (table_size == 0 && dist_type == kHashRoundRobin),
      "recpipe: `table_size` must be >= 1 (the table's row count), got ", table_size,
      table_size == 0 ? (dist_type == kContinuous ? " for a continuous table" : " for a roundrobin table") : "",
      "; 0 (raw int64 keys, any value) is accepted by hash_roundrobin (dist_type 2) only.");
  TORCH_CHECK(
      world_size > 0, "recpipe: `world_size` must be >= 1, got ", world_size, "; pass the number of ranks the table is sharded over.");
  TORCH_CHECK(
      world_size <= kMaxWorldSize, "recpipe: `world_size` must be at most ", kMaxWorldSize, ", got ", world_size,
      "; pass the number of ranks the table is sharded over.");
  TORCH_CHECK(
      ids.scalar_type() == at::kLong || dist_type != kHashRoundRobin || table_size > 0,
      "recpipe: `ids` are int32 but hash_roundrobin over raw keys (`table_size` = 0) and ", world_size,
      " ranks gives local ids up to ", world_size > 0 ? ~0ULL / static_cast<uint64_t>(world_size) : 0ULL,
      " (returned in the dtype of ids), beyond int32; pass int64 ids (`.to(torch.int64)`).");
  TORCH_CHECK(
      ids.scalar_type() == at::kLong || dist_type != kHashRoundRobin || (table_size - 1) / world_size <= INT32_MAX,
      "recpipe: `ids` are int32 but hash_roundrobin over `table_size` = ", table_size, " rows and ", world_size,
      " ranks gives local ids up to ", (table_size - 1) / world_size,
      " (returned in the dtype of ids), beyond int32; pass int64 ids (`.to(torch.int64)`).");
}

}  // namespace recpipe
