// recpipe: CUDA kernels for torch.ops.recpipe.* (schemas live in library.cpp).
//
// block_bucketize_sparse_features in three steps, as fbgemm does:
//   1. count  : one thread per bag computes every id's owner and local id
//               (bucketize_math.h, shared with the CPU kernel), stores them in
//               scratch buffers and counts new_lengths[rank * F*B + bag] (the
//               column of a bag belongs to one thread: no atomics);
//   2. scan   : exclusive prefix sum of the counts -> output offsets;
//   3. scatter: one thread per bag walks its ids in order and writes each to
//               offsets[rank * F*B + bag]++, preserving order inside a bag.
// Invalid ids (hash_roundrobin out of range) are reported through a device
// flag holding the smallest bad position, read once after step 1.
//
// Only c10/cuda headers are included (not ATen/cuda/CUDAContext.h, which pulls
// in cusparse.h).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>
#include <type_traits>
#include <vector>

#include "bucketize_math.h"
#include "checks.h"

namespace recpipe {
namespace {

using at::Tensor;

constexpr int kThreads = 256;

inline int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(b, 65535 * 8)));
}

template <typename index_t>
__global__ void count_kernel(
    const int64_t* __restrict__ offsets,
    const index_t* __restrict__ indices,
    const FeatureRoute* __restrict__ routes,
    int64_t FB,
    int64_t B,
    uint64_t W,
    FastDivU64 div_world,
    bool keep_orig_idx,
    int32_t* __restrict__ owner,
    index_t* __restrict__ local,
    int64_t* __restrict__ counts,
    unsigned long long* __restrict__ first_bad) {
  using uindex_t = std::make_unsigned_t<index_t>;
  for (int64_t bt = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; bt < FB;
       bt += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const FeatureRoute& r = routes[bt / B];
    for (int64_t i = offsets[bt]; i < offsets[bt + 1]; ++i) {
      const index_t raw = indices[i];
      const uindex_t uid = static_cast<uindex_t>(raw);
      uint64_t p = 0;
      uindex_t loc = 0;
      if (r.dist == kContinuous) {
        route_continuous<uindex_t>(uid, r.block, W, r.div_block, div_world, &p, &loc);
      } else if (r.dist == kRoundRobin) {
        if (r.table_size != 0 && (raw < 0 || static_cast<uint64_t>(raw) >= r.table_size)) {
          atomicMin(first_bad, static_cast<unsigned long long>(i));  // table_sizes given: ids must fit
        }
        route_roundrobin<uindex_t>(uid, W, div_world, &p, &loc);
      } else if (raw < 0 || static_cast<uint64_t>(raw) >= r.table_size) {
        atomicMin(first_bad, static_cast<unsigned long long>(i));
      } else {
        route_hash_roundrobin<uindex_t>(uid, W, div_world, r.perm, &p, &loc);
      }
      owner[i] = static_cast<int32_t>(p);
      local[i] = static_cast<index_t>(keep_orig_idx ? uid : loc);
      counts[p * FB + bt] += 1;
    }
  }
}

template <typename index_t, typename wbits_t>
__global__ void scatter_kernel(
    const int64_t* __restrict__ offsets,
    const int32_t* __restrict__ owner,
    const index_t* __restrict__ local,
    const wbits_t* __restrict__ weights,
    int64_t FB,
    int64_t* __restrict__ cursor,
    index_t* __restrict__ new_indices,
    wbits_t* __restrict__ new_weights,
    index_t* __restrict__ new_pos,
    index_t* __restrict__ unbucketize_permute) {
  for (int64_t bt = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; bt < FB;
       bt += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = offsets[bt];
    for (int64_t i = s; i < offsets[bt + 1]; ++i) {
      const int64_t slot = static_cast<int64_t>(owner[i]) * FB + bt;
      const int64_t pos = cursor[slot]++;
      new_indices[pos] = local[i];
      if (new_weights != nullptr) {
        new_weights[pos] = weights[i];
      }
      if (new_pos != nullptr) {
        new_pos[pos] = static_cast<index_t>(i - s);
      }
      if (unbucketize_permute != nullptr) {
        unbucketize_permute[i] = static_cast<index_t>(pos);
      }
    }
  }
}

__global__ void global_ids_kernel(
    const int64_t* __restrict__ ranks,
    const int64_t* __restrict__ local_ids,
    int64_t n,
    int64_t table_size,
    int64_t world_size,
    HashPermutation perm,
    int64_t* __restrict__ out,
    unsigned long long* __restrict__ first_bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t rk = ranks[i];
    const int64_t li = local_ids[i];
    if (!is_roundrobin_slot(rk, li, table_size, world_size)) {
      atomicMin(first_bad, static_cast<unsigned long long>(i));
      out[i] = -1;
    } else {
      out[i] = static_cast<int64_t>(perm.inverse(static_cast<uint64_t>(li * world_size + rk)));
    }
  }
}

__global__ void route_ids_kernel(
    const int64_t* __restrict__ ids,
    int64_t n,
    int64_t table_size,
    TableRoute route,
    int64_t* __restrict__ owner,
    int64_t* __restrict__ local,
    unsigned long long* __restrict__ first_bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (ids[i] < 0 || ids[i] >= table_size) {
      atomicMin(first_bad, static_cast<unsigned long long>(i));
      owner[i] = local[i] = -1;
      continue;
    }
    uint64_t p = 0, l = 0;
    route.route(static_cast<uint64_t>(ids[i]), &p, &l);
    owner[i] = static_cast<int64_t>(p);
    local[i] = static_cast<int64_t>(l);
  }
}

template <typename wbits_t>
const wbits_t* opt_ptr(const std::optional<Tensor>& t) {
  return t.has_value() ? static_cast<const wbits_t*>(t->const_data_ptr()) : nullptr;
}

template <typename wbits_t>
wbits_t* opt_mut_ptr(std::optional<Tensor>& t) {
  return t.has_value() ? static_cast<wbits_t*>(t->mutable_data_ptr()) : nullptr;
}

std::tuple<Tensor, Tensor, std::optional<Tensor>, std::optional<Tensor>, std::optional<Tensor>>
block_bucketize_sparse_features_cuda(
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
      lengths_in.is_cuda(), "recpipe: `lengths` is on ", lengths_in.device(),
      " but the CUDA kernel was dispatched; move all tensor arguments to one device.");
  c10::cuda::CUDAGuard guard(lengths_in.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const std::vector<FeatureRoute> routes_h =
      build_feature_routes(block_sizes, dist_types, table_sizes, seed);
  bool any_hash = false;
  for (const auto& r : routes_h) {
    any_hash |= r.dist == kHashRoundRobin || (r.dist == kRoundRobin && r.table_size != 0);  // ids checked
  }
  const Tensor lengths = lengths_in.contiguous();
  const Tensor indices = indices_in.contiguous();
  std::optional<Tensor> weights;
  if (weights_in.has_value()) {
    weights = weights_in->contiguous();
  }
  const int64_t F = dist_types.numel();
  const int64_t FB = lengths.numel();
  const int64_t B = F == 0 ? 0 : FB / F;
  const int64_t N = indices.numel();
  const int64_t W = my_size;

  TORCH_CHECK(
      !(lengths < 0).any().item<bool>(),
      "recpipe: `lengths` has negative entries; bag lengths must be >= 0.");
  Tensor offsets = at::zeros({FB + 1}, lengths.options().dtype(at::kLong));
  if (FB > 0) {
    offsets.narrow(0, 1, FB).copy_(at::cumsum(lengths, 0, at::kLong));
  }
  const int64_t total = offsets[FB].item<int64_t>();
  TORCH_CHECK(
      total == N, "recpipe: `lengths` sums to ", total, " but `indices` has ", N,
      " entries; lengths and indices must describe the same KJT.");

  Tensor counts = at::zeros({W * FB}, lengths.options().dtype(at::kLong));
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
    return {counts.to(lengths.scalar_type()), new_indices, new_weights, new_pos, unbucketize_permute};
  }

  // Per-feature routes to the device as raw bytes (FeatureRoute is trivially copyable).
  static_assert(std::is_trivially_copyable_v<FeatureRoute>);
  Tensor routes_bytes = at::empty(
      {static_cast<int64_t>(routes_h.size() * sizeof(FeatureRoute))},
      at::TensorOptions().dtype(at::kByte));
  std::memcpy(routes_bytes.data_ptr(), routes_h.data(), routes_h.size() * sizeof(FeatureRoute));
  routes_bytes = routes_bytes.to(lengths.device());
  const auto* routes_d = reinterpret_cast<const FeatureRoute*>(routes_bytes.const_data_ptr());

  Tensor owner = at::empty({N}, indices.options().dtype(at::kInt));
  Tensor local = at::empty({N}, indices.options());
  Tensor first_bad = at::full({1}, N, lengths.options().dtype(at::kLong));
  const FastDivU64 div_world(static_cast<uint64_t>(W));

  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "recpipe_bucketize_cuda", [&] {
    count_kernel<index_t><<<blocks_for(FB), kThreads, 0, stream>>>(
        offsets.const_data_ptr<int64_t>(), indices.const_data_ptr<index_t>(), routes_d, FB, B,
        static_cast<uint64_t>(W), div_world, keep_orig_idx, owner.mutable_data_ptr<int32_t>(),
        local.mutable_data_ptr<index_t>(), counts.mutable_data_ptr<int64_t>(),
        reinterpret_cast<unsigned long long*>(first_bad.mutable_data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (any_hash) {
    const int64_t bad = first_bad.item<int64_t>();
    if (bad < N) {
      // Locate the feature of the bad id on the host for the message.
      const auto off_h = offsets.cpu();
      const int64_t* o = off_h.const_data_ptr<int64_t>();
      const int64_t bt = std::upper_bound(o, o + FB + 1, bad) - o - 1;
      const int64_t f = bt / B;
      TORCH_CHECK(
          false, "recpipe: `indices[", bad, "]` = ", indices[bad].item<int64_t>(), " (feature ", f,
          routes_h[f].dist == kRoundRobin ? ", roundrobin" : ", hash_roundrobin",
          ") is outside [0, table_sizes[", f, "] = ", routes_h[f].table_size,
          "); ids must lie in the table's range: hash or clamp raw ids upstream, ",
          routes_h[f].dist == kRoundRobin ? "or omit table_sizes for raw ids." : "or route this feature with roundrobin.");
    }
  }
  Tensor cursor = at::cumsum(counts, 0) - counts;  // exclusive scan

  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "recpipe_bucketize_scatter_cuda", [&] {
    auto launch = [&](auto wtag) {
      using wbits_t = typename decltype(wtag)::type;
      scatter_kernel<index_t, wbits_t><<<blocks_for(FB), kThreads, 0, stream>>>(
          offsets.const_data_ptr<int64_t>(), owner.const_data_ptr<int32_t>(),
          local.const_data_ptr<index_t>(), opt_ptr<wbits_t>(weights), FB,
          cursor.mutable_data_ptr<int64_t>(), new_indices.mutable_data_ptr<index_t>(),
          opt_mut_ptr<wbits_t>(new_weights),
          bucketize_pos ? new_pos->mutable_data_ptr<index_t>() : nullptr,
          sequence ? unbucketize_permute->mutable_data_ptr<index_t>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    struct W2 { using type = uint16_t; };
    struct W4 { using type = uint32_t; };
    struct W8 { using type = uint64_t; };
    const int64_t esize = weights.has_value() ? weights->element_size() : 4;
    if (esize == 2) {
      launch(W2{});
    } else if (esize == 8) {
      launch(W8{});
    } else {
      launch(W4{});
    }
  });
  return {counts.to(lengths.scalar_type()), new_indices, new_weights, new_pos, unbucketize_permute};
}

Tensor hash_roundrobin_global_ids_cuda(
    const Tensor& ranks_in,
    const Tensor& local_ids_in,
    int64_t table_size,
    int64_t world_size,
    int64_t seed) {
  check_global_ids_args(ranks_in, local_ids_in, table_size, world_size);
  c10::cuda::CUDAGuard guard(local_ids_in.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const Tensor ranks = ranks_in.to(at::kLong).contiguous();
  const Tensor local_ids = local_ids_in.to(at::kLong).contiguous();
  Tensor out = at::empty_like(local_ids);
  const int64_t n = local_ids.numel();
  if (n == 0) {
    return out.to(local_ids_in.scalar_type());
  }
  Tensor first_bad = at::full({1}, n, local_ids.options());
  const HashPermutation perm(static_cast<uint64_t>(table_size), static_cast<uint64_t>(seed));
  global_ids_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
      ranks.const_data_ptr<int64_t>(), local_ids.const_data_ptr<int64_t>(), n, table_size,
      world_size, perm, out.mutable_data_ptr<int64_t>(),
      reinterpret_cast<unsigned long long*>(first_bad.mutable_data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t bad = first_bad.item<int64_t>();
  TORCH_CHECK(
      bad >= n, "recpipe: (`ranks[", bad, "]`, `local_ids[", bad, "]`) is not a slot of a table of ",
      table_size, " rows over ", world_size,
      " ranks under hash_roundrobin (needs 0 <= rank < world_size and "
      "local_id * world_size + rank < table_size); check the checkpoint's world size.");
  return out.to(local_ids_in.scalar_type());
}

// route_ids is not a training-step op (checkpoint resharding, tier placement):
// it reads one flag back to report the first id outside the table.
std::tuple<Tensor, Tensor> route_ids_cuda(
    const Tensor& ids_in,
    int64_t table_size,
    int64_t world_size,
    int64_t dist_type,
    int64_t seed) {
  check_route_ids_args(ids_in, table_size, world_size, dist_type);
  c10::cuda::CUDAGuard guard(ids_in.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const Tensor ids = ids_in.to(at::kLong).contiguous();
  Tensor owner = at::empty(ids.sizes(), ids.options());
  Tensor local = at::empty(ids.sizes(), ids.options());
  const int64_t n = ids.numel();
  if (n == 0) {
    return {owner, local.to(ids_in.scalar_type())};
  }
  Tensor first_bad = at::full({1}, n, ids.options());
  const TableRoute route(dist_type, static_cast<uint64_t>(table_size), static_cast<uint64_t>(world_size),
                         static_cast<uint64_t>(seed));
  route_ids_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
      ids.const_data_ptr<int64_t>(), n, table_size, route, owner.mutable_data_ptr<int64_t>(),
      local.mutable_data_ptr<int64_t>(), reinterpret_cast<unsigned long long*>(first_bad.mutable_data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t bad = first_bad.item<int64_t>();
  TORCH_CHECK_INDEX(bad >= n, "recpipe: `ids[", bad, "]` is outside [0, table_size = ", table_size,
                    "); route_ids takes ids of the table's rows (hash or clamp raw ids upstream).");
  return {owner, local.to(ids_in.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(recpipe, CUDA, m) {
  m.impl("route_ids", &route_ids_cuda);
  m.impl("block_bucketize_sparse_features", &block_bucketize_sparse_features_cuda);
  m.impl("hash_roundrobin_global_ids", &hash_roundrobin_global_ids_cuda);
}

}  // namespace recpipe
