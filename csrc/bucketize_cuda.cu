// recpipe: CUDA kernels of the three routing ops (schemas in library.cpp).
//
// block_bucketize_sparse_features: the CPU kernel's semantics, bit for bit
// (bucketize.cpp is the reference). Owner rank and local id of every id come from
// FeatureRoute::route only; build_feature_routes (checks.h) makes the routes.
//   host: routes [F], first bag of each feature fbag [F + 1] (VBE: prefix sum of
//         batch_size_per_feature), uneven-shard bounds: one pinned buffer, one
//         non_blocking copy to the device
//   ends = cumsum(lengths) on the device: bag b holds ids [ends[b - 1], ends[b])
//   1. count_kernel  : one thread per bag (feature: binary search in fbag) routes
//                      its ids, new_lengths[owner * FB + b] += 1 (column b is that
//                      thread's: no atomics)
//   2. cursor = exclusive prefix sum of new_lengths (rank-major: output order)
//   3. scatter_kernel: one thread per bag routes its ids again, in order, each to
//                      cursor[owner * FB + b]++: new_indices, new_pos, dest
//                      (= unbucketize_permute), bucket_mapping
//   4. rows_kernel   : new_weights[dest[i]] = weights[i], rows of D entries
// No host sync with per-feature metadata on the CPU: output sizes come from input
// shapes (new_lengths W * FB, the others n). Values only the device sees fail by a
// device assert (CUDA_KERNEL_ASSERT_PRINTF: message, then the CUDA context is lost):
// a negative length, lengths not summing to n, an id outside its table (route()
// returns false). Every access stays in bounds even then. Only c10/cuda headers
// are included (ATen/cuda/CUDAContext.h pulls in cusparse.h).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "bucketize_math.h"
#include "checks.h"

namespace recpipe {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  return static_cast<int>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 65535 * 8));
}

#define RECPIPE_GRID_LOOP(i, n)                                                              \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// The per-feature metadata on the device (one buffer, see pack_metadata).
struct DeviceMeta {
  const FeatureRoute* routes;  // [F]
  const int64_t* fbag;         // [F + 1] first bag of each feature
  const int64_t* bounds;       // flat uneven-shard bounds (build_feature_routes)
  int64_t F;

  // Feature of bag b: the last f with fbag[f] <= b (skips empty features).
  __device__ int64_t feature_of(int64_t b) const {
    int64_t lo = 0;
    int64_t hi = F;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      (fbag[mid] <= b ? lo : hi) = mid;
    }
    return lo;
  }

  // Calls fn(f, i, i0, routed, owner, local) for the ids i of bag b (feature f,
  // first id i0) in order, the feature's rule fixed at compile time as in the CPU
  // kernel. [i0, i1) is clamped to [0, n]: invalid lengths (count_kernel's
  // asserts) never index outside `indices`.
  template <typename index_t, typename Fn>
  __device__ void walk_bag(const int64_t* ends, const index_t* ids, int64_t n, int64_t b, Fn&& fn) const {
    const int64_t s = b == 0 ? 0 : ends[b - 1];
    const int64_t i0 = s < 0 ? 0 : (s > n ? n : s);
    const int64_t i1 = ends[b] < i0 ? i0 : (ends[b] > n ? n : ends[b]);
    const int64_t f = feature_of(b);
    const FeatureRoute& r = routes[f];
    auto run = [&](auto dist) {
      for (int64_t i = i0; i < i1; ++i) {
        uint64_t p = 0, l = 0;
        const auto uid = static_cast<std::make_unsigned_t<index_t>>(ids[i]);
        const bool ok = r.template route<decltype(dist)::value>(uid, bounds, &p, &l);
        fn(f, i, i0, ok, p, l);
      }
    };
    if (r.dist == kContinuous) {
      run(std::integral_constant<int, kContinuous>());
    } else if (r.dist == kRoundRobin) {
      run(std::integral_constant<int, kRoundRobin>());
    } else {
      run(std::integral_constant<int, kHashRoundRobin>());
    }
  }
};

template <typename index_t, typename offset_t>
__global__ void count_kernel(const offset_t* __restrict__ lengths, const int64_t* __restrict__ ends,
                             const index_t* __restrict__ ids, int64_t n, int64_t FB, DeviceMeta meta,
                             offset_t* __restrict__ new_lengths) {
  RECPIPE_GRID_LOOP(b, FB) {
    const long long len = static_cast<long long>(lengths[b]);
    CUDA_KERNEL_ASSERT_PRINTF(len >= 0, "recpipe: `lengths[%lld]` is %lld; bag lengths must be >= 0.",
                              static_cast<long long>(b), len);
    // lengths are >= 0, so a prefix sum that wraps int64 first passes n here
    CUDA_KERNEL_ASSERT_PRINTF(ends[b] <= n,
                              "recpipe: `lengths` sums past the %lld entries of `indices` at bag %lld; lengths "
                              "and indices must describe the same KJT.",
                              static_cast<long long>(n), static_cast<long long>(b));
    if (b == FB - 1) {
      CUDA_KERNEL_ASSERT_PRINTF(ends[b] == n,
                                "recpipe: `lengths` sums to %lld but `indices` has %lld entries; lengths and "
                                "indices must describe the same KJT.",
                                static_cast<long long>(ends[b]), static_cast<long long>(n));
    }
    meta.walk_bag(ends, ids, n, b, [&](int64_t f, int64_t i, int64_t, bool ok, uint64_t p, uint64_t) {
      const FeatureRoute& r = meta.routes[f];
      CUDA_KERNEL_ASSERT_PRINTF(ok,
                                "recpipe: `indices[%lld]` = %lld (feature %lld, %s) is outside [0, table_sizes[%lld] "
                                "= %llu); ids must lie in the table's range: hash or clamp raw ids upstream (a "
                                "roundrobin or hash_roundrobin feature of raw ids takes table_sizes 0; "
                                "route_bad_ids=True routes them).",
                                static_cast<long long>(i), static_cast<long long>(ids[i]),
                                static_cast<long long>(f), r.dist == kRoundRobin ? "roundrobin" : "hash_roundrobin",
                                static_cast<long long>(f), static_cast<unsigned long long>(r.table_size));
      new_lengths[p * FB + b] += 1;  // p < W for every id, routed or not (p = 0)
    });
  }
}

template <typename index_t>
__global__ void scatter_kernel(const int64_t* __restrict__ ends, const index_t* __restrict__ ids, int64_t n,
                               int64_t FB, DeviceMeta meta, int64_t* __restrict__ cursor,
                               index_t* __restrict__ new_indices, index_t* __restrict__ dest,
                               index_t* __restrict__ new_pos, index_t* __restrict__ mapping) {
  RECPIPE_GRID_LOOP(b, FB) {
    meta.walk_bag(ends, ids, n, b, [&](int64_t, int64_t i, int64_t i0, bool, uint64_t p, uint64_t l) {
      const int64_t at = cursor[p * FB + b]++;
      if (at >= n) {
        return;  // only with invalid lengths, after count_kernel's assert
      }
      store_routed(at, i, i0, p, l, new_indices, dest, new_pos, mapping);
    });
  }
}

// out[dest[i] * D + j] = src[i * D + j]: weight rows follow their ids (moved as bits).
template <typename bits_t, typename index_t>
__global__ void rows_kernel(const bits_t* __restrict__ src, const index_t* __restrict__ dest, int64_t total,
                            int64_t D, bits_t* __restrict__ out) {
  RECPIPE_GRID_LOOP(k, total) {
    const int64_t i = k / D;
    out[static_cast<int64_t>(dest[i]) * D + (k - i * D)] = src[k];
  }
}

// routes | fbag | bounds in one pinned host buffer, copied to `device` non_blocking
// on the current stream: no sync (copy_ records the stream on the pinned block, so
// the caching host allocator reuses it only after the copy). Returns the device copy.
Tensor pack_metadata(const std::vector<FeatureRoute>& routes, const std::vector<int64_t>& fbag,
                     const Tensor& bounds, c10::Device device, DeviceMeta* meta) {
  static_assert(std::is_trivially_copyable_v<FeatureRoute>, "FeatureRoute is copied to the device as bytes");
  static_assert(sizeof(FeatureRoute) % alignof(int64_t) == 0 && alignof(FeatureRoute) <= 16);
  const size_t nr = routes.size() * sizeof(FeatureRoute);
  const size_t nf = fbag.size() * sizeof(int64_t);
  const size_t nb = static_cast<size_t>(bounds.numel()) * sizeof(int64_t);
  Tensor host = at::empty({static_cast<int64_t>(nr + nf + nb)}, at::TensorOptions(at::kByte).pinned_memory(true));
  char* h = static_cast<char*>(host.mutable_data_ptr());
  std::memcpy(h, routes.data(), nr);
  std::memcpy(h + nr, fbag.data(), nf);
  std::memcpy(h + nr + nf, bounds.const_data_ptr<int64_t>(), nb);
  Tensor dev = host.to(device, at::kByte, /*non_blocking=*/true);
  const char* d = static_cast<const char*>(dev.const_data_ptr());
  *meta = DeviceMeta{reinterpret_cast<const FeatureRoute*>(d), reinterpret_cast<const int64_t*>(d + nr),
                     reinterpret_cast<const int64_t*>(d + nr + nf), static_cast<int64_t>(routes.size())};
  return dev;
}

BucketizeResult block_bucketize_sparse_features_cuda(
    const Tensor& lengths, const Tensor& indices, const Tensor& block_sizes, const Tensor& dist_types,
    int64_t my_size, bool sequence, bool bucketize_pos, const OptTensor& weights, const OptTensor& table_sizes,
    int64_t seed, bool keep_orig_idx, const OptTensor& batch_size_per_feature, int64_t max_B,
    const std::optional<std::vector<Tensor>>& block_bucketize_pos, const OptTensor& total_num_blocks,
    const OptTensor& keep_orig_idx_per_feature, bool return_bucket_mapping, bool route_bad_ids) {
  // max_B is accepted for fbgemm compatibility and unused: the bag -> feature
  // mapping is a binary search in fbag, which needs no largest batch size.
  // Host metadata: no sync while every per-feature tensor (block_sizes, dist_types,
  // table_sizes, total_num_blocks, keep_orig_idx_per_feature, batch_size_per_feature,
  // block_bucketize_pos) is on the CPU; one on the GPU is read back (a D2H copy, a
  // sync) by build_feature_routes or feature_bags.
  const BucketizeCall call = prepare_bucketize({lengths, indices, block_sizes, dist_types, my_size, sequence,
                                                 bucketize_pos, weights, table_sizes, seed, keep_orig_idx,
                                                 batch_size_per_feature, block_bucketize_pos, total_num_blocks,
                                                 keep_orig_idx_per_feature, return_bucket_mapping, route_bad_ids});
  const BucketizeArgs& a = call.args;
  TORCH_CHECK(lengths.is_cuda(), "recpipe: `lengths` is on ", lengths.device(),
              " but the CUDA kernel was dispatched (another tensor argument is on a CUDA device); move lengths, "
              "indices and weights to one CUDA device (per-feature metadata may stay on the CPU).");
  c10::cuda::CUDAGuard guard(lengths.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const std::vector<FeatureRoute>& routes = call.routes;
  const Tensor& bounds = call.bounds;
  const std::vector<int64_t>& fbag = call.fbag;
  const int64_t FB = a.lengths.numel();
  const int64_t n = a.indices.numel();
  TORCH_CHECK(FB > 0 || n == 0, "recpipe: `lengths` sums to 0 but `indices` has ", n,
              " entries; lengths and indices must describe the same KJT.");
  BucketizeOutputs out = allocate_bucketize_outputs(call, /*zero_lengths=*/true);  // count_kernel adds to it
  const Tensor w = a.weights.has_value() ? *a.weights : Tensor();  // contiguous (prepare_bucketize)
  if (FB > 0) {
    DeviceMeta meta{};
    const Tensor meta_buf = pack_metadata(routes, fbag, bounds, a.lengths.device(), &meta);
    const Tensor ends = at::cumsum(a.lengths, 0, at::kLong);
    AT_DISPATCH_INDEX_TYPES(a.indices.scalar_type(), "recpipe_bucketize_cuda", [&] {
      using ids_t = index_t;
      AT_DISPATCH_INDEX_TYPES(a.lengths.scalar_type(), "recpipe_bucketize_cuda_lengths", [&] {
        count_kernel<ids_t, index_t><<<blocks_for(FB), kThreads, 0, stream>>>(
            a.lengths.const_data_ptr<index_t>(), ends.const_data_ptr<int64_t>(), a.indices.const_data_ptr<ids_t>(),
            n, FB, meta, out.new_lengths.mutable_data_ptr<index_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      Tensor cursor = at::cumsum(out.new_lengths, 0, at::kLong);
      cursor.sub_(out.new_lengths);  // exclusive prefix sum
      auto ptr = [](OptTensor& t) { return t.has_value() ? t->mutable_data_ptr<ids_t>() : nullptr; };
      scatter_kernel<ids_t><<<blocks_for(FB), kThreads, 0, stream>>>(
          ends.const_data_ptr<int64_t>(), a.indices.const_data_ptr<ids_t>(), n, FB, meta,
          cursor.mutable_data_ptr<int64_t>(), out.new_indices.mutable_data_ptr<ids_t>(), ptr(out.dest),
          ptr(out.new_pos), ptr(out.mapping));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (w.defined() && w.numel() > 0) {
        auto rows = [&](auto bits) {
          using bits_t = decltype(bits);
          rows_kernel<bits_t, ids_t><<<blocks_for(w.numel()), kThreads, 0, stream>>>(
              static_cast<const bits_t*>(w.const_data_ptr()), out.dest->const_data_ptr<ids_t>(), w.numel(),
              a.weights_dim(), static_cast<bits_t*>(out.new_weights->mutable_data_ptr()));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        w.element_size() == 2 ? rows(uint16_t{}) : w.element_size() == 4 ? rows(uint32_t{}) : rows(uint64_t{});
      }
    });
  }
  return out.result(a);
}

__global__ void global_ids_kernel(const int64_t* __restrict__ ranks, const int64_t* __restrict__ local_ids,
                                  int64_t n, int64_t table_size, int64_t world_size, HashPermutation perm,
                                  int64_t* __restrict__ out, unsigned long long* __restrict__ first_bad) {
  RECPIPE_GRID_LOOP(i, n) {
    const int64_t rk = ranks[i];
    const int64_t li = local_ids[i];
    if (!is_roundrobin_slot(rk, li, table_size, world_size)) {
      atomicMin(first_bad, static_cast<unsigned long long>(i));
      out[i] = -1;
    } else {
      // unsigned: raw keys' slots reach 2^64 - 1 (is_roundrobin_slot keeps it from wrapping)
      const uint64_t slot = static_cast<uint64_t>(li) * static_cast<uint64_t>(world_size) + static_cast<uint64_t>(rk);
      out[i] = static_cast<int64_t>(perm.inverse(slot));
    }
  }
}

__global__ void route_ids_kernel(const int64_t* __restrict__ ids, int64_t n, int64_t table_size, FeatureRoute route,
                                 int64_t* __restrict__ owner, int64_t* __restrict__ local,
                                 unsigned long long* __restrict__ first_bad) {
  RECPIPE_GRID_LOOP(i, n) {
    if (table_size != 0 && (ids[i] < 0 || ids[i] >= table_size)) {  // 0: raw keys, every id valid
      atomicMin(first_bad, static_cast<unsigned long long>(i));
      owner[i] = local[i] = -1;
      continue;
    }
    uint64_t p = 0, l = 0;
    route.route(static_cast<uint64_t>(ids[i]), nullptr, &p, &l);  // true: the id is in the table
    owner[i] = static_cast<int64_t>(p);
    local[i] = static_cast<int64_t>(l);
  }
}

// hash_roundrobin_global_ids and route_ids are not training-step ops (checkpoint
// resharding, tier placement): each reads one flag back (one sync) to raise a
// recoverable error naming the first bad entry. first_flagged launches its kernel
// with the flag and returns the smallest flagged index, n if none.
template <typename Launch>
int64_t first_flagged(int64_t n, c10::Device device, Launch&& launch) {
  Tensor flag = at::full({1}, n, at::TensorOptions(at::kLong).device(device));
  launch(reinterpret_cast<unsigned long long*>(flag.mutable_data_ptr<int64_t>()), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return flag.item<int64_t>();  // the one sync
}

Tensor hash_roundrobin_global_ids_cuda(const Tensor& ranks_in, const Tensor& local_ids_in, int64_t table_size,
                                       int64_t world_size, int64_t seed) {
  check_global_ids_args(ranks_in, local_ids_in, table_size, world_size);
  TORCH_CHECK(local_ids_in.is_cuda(), "recpipe: `local_ids` is on ", local_ids_in.device(),
              " but the CUDA kernel was dispatched; move ranks and local_ids to one CUDA device.");
  c10::cuda::CUDAGuard guard(local_ids_in.device());
  const Tensor ranks = ranks_in.to(at::kLong).contiguous();
  const Tensor local_ids = local_ids_in.to(at::kLong).contiguous();
  Tensor out = at::empty_like(local_ids);
  const int64_t n = local_ids.numel();
  if (n == 0) {
    return out.to(local_ids_in.scalar_type());
  }
  const HashPermutation perm(static_cast<uint64_t>(table_size), static_cast<uint64_t>(seed));
  const int64_t bad = first_flagged(n, out.device(), [&](unsigned long long* flag, cudaStream_t stream) {
    global_ids_kernel<<<blocks_for(n), kThreads, 0, stream>>>(ranks.const_data_ptr<int64_t>(),
                                                              local_ids.const_data_ptr<int64_t>(), n, table_size,
                                                              world_size, perm, out.mutable_data_ptr<int64_t>(), flag);
  });
  if (bad < n) {  // the error path reads the offending pair back
    fail_not_a_slot(bad, ranks[bad].item<int64_t>(), local_ids[bad].item<int64_t>(), table_size, world_size);
  }
  return out.to(local_ids_in.scalar_type());
}

std::tuple<Tensor, Tensor> route_ids_cuda(const Tensor& ids_in, int64_t table_size, int64_t world_size,
                                          int64_t dist_type, int64_t seed) {
  check_route_ids_args(ids_in, table_size, world_size, dist_type);
  TORCH_CHECK(ids_in.is_cuda(), "recpipe: `ids` is on ", ids_in.device(),
              " but the CUDA kernel was dispatched; move ids to a CUDA device.");
  c10::cuda::CUDAGuard guard(ids_in.device());
  const Tensor ids = ids_in.to(at::kLong).contiguous();
  Tensor owner = at::empty(ids.sizes(), ids.options());
  Tensor local = at::empty(ids.sizes(), ids.options());
  const int64_t n = ids.numel();
  if (n == 0) {
    return {owner, local.to(ids_in.scalar_type())};
  }
  const FeatureRoute route = FeatureRoute::for_table(dist_type, static_cast<uint64_t>(table_size),
                                                     static_cast<uint64_t>(world_size), static_cast<uint64_t>(seed));
  const int64_t bad = first_flagged(n, ids.device(), [&](unsigned long long* flag, cudaStream_t stream) {
    route_ids_kernel<<<blocks_for(n), kThreads, 0, stream>>>(ids.const_data_ptr<int64_t>(), n, table_size, route,
                                                             owner.mutable_data_ptr<int64_t>(),
                                                             local.mutable_data_ptr<int64_t>(), flag);
  });
  if (bad < n) {  // the error path reads the offending id back
    fail_route_id_outside(bad, ids[bad].item<int64_t>(), table_size);
  }
  return {owner, local.to(ids_in.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(recpipe, CUDA, m) {
  m.impl("block_bucketize_sparse_features", &block_bucketize_sparse_features_cuda);
  m.impl("hash_roundrobin_global_ids", &hash_roundrobin_global_ids_cuda);
  m.impl("route_ids", &route_ids_cuda);
}

}  // namespace recpipe
