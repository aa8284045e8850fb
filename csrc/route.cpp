// recpipe: route_ids (CPU), the per-id routing primitive: owner rank and local
// id of each id of one table, O(n) memory. Checkpoint resharding, the tiered
// storage's HYBRID split and recpipe.pipeline.ops.route_ids call it; the math is
// FeatureRoute in bucketize_math.h, which the CUDA kernel calls too. table_size 0
// (hash_roundrobin only): raw int64 keys, each read as uint64, none refused.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "bucketize_math.h"
#include "checks.h"

namespace recpipe {
namespace {

std::tuple<at::Tensor, at::Tensor> route_ids_cpu(
    const at::Tensor& ids_in,
    int64_t table_size,
    int64_t world_size,
    int64_t dist_type,
    int64_t seed) {
  check_route_ids_args(ids_in, table_size, world_size, dist_type);
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel();
  at::Tensor owner = at::empty(ids.sizes(), ids.options());
  at::Tensor local = at::empty(ids.sizes(), ids.options());
  const int64_t* id = ids.const_data_ptr<int64_t>();
  int64_t* own = owner.mutable_data_ptr<int64_t>();
  int64_t* loc = local.mutable_data_ptr<int64_t>();
  const FeatureRoute route = FeatureRoute::for_table(dist_type, static_cast<uint64_t>(table_size),
                                                     static_cast<uint64_t>(world_size), static_cast<uint64_t>(seed));
  std::vector<int64_t> bad_at(std::max<int64_t>(1, at::get_num_threads()), -1);
  at::parallel_for(0, n, 16384, [&](int64_t s, int64_t e) {
    const int tid = at::get_thread_num();
    for (int64_t i = s; i < e; ++i) {
      if (table_size != 0 && (id[i] < 0 || id[i] >= table_size)) {
        if (bad_at[tid] < 0) {
          bad_at[tid] = i;
        }
        own[i] = loc[i] = -1;
        continue;
      }
      uint64_t p = 0, l = 0;
      route.route(static_cast<uint64_t>(id[i]), nullptr, &p, &l);
      own[i] = static_cast<int64_t>(p);
      loc[i] = static_cast<int64_t>(l);
    }
  });
  int64_t first = -1;
  for (const int64_t i : bad_at) {
    first = i >= 0 && (first < 0 || i < first) ? i : first;
  }
  if (first >= 0) {
    fail_route_id_outside(first, id[first], table_size);
  }
  return {owner, local.to(ids_in.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(recpipe, CPU, m) {
  m.impl("route_ids", &route_ids_cpu);
}

}  // namespace recpipe
