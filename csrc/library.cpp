// recpipe: every operator schema (the one TORCH_LIBRARY block) and the Python
// module init of recpipe._C. Kernels register per backend beside their code:
//   bucketize.cpp        CPU   block_bucketize_sparse_features, hash_roundrobin_global_ids
//   route.cpp            CPU   route_ids
//   bucketize_cuda.cu    CUDA  the three routing ops
//   placement_dp.cpp     CPU   placement_dp, placement_budget_prices, placement_prune_dominated (planner)
//   tiered.cpp           CPU   tiered_lookup, tiered_backward (tiered embedding storage)
//   dynamic_table.cpp    CPU   dynamic_hash_plan, dynamic_init_uniform (dynamic tables' key index, new rows)
#include <torch/library.h>

TORCH_LIBRARY(recpipe, m) {
  // Routing: split a KJT's flat lengths/indices by owner rank (fbgemm's layout and
  // every argument of fbgemm's block_bucketize_sparse_features, its _inference
  // variant (return_bucket_mapping) and its 2-D weights variant ([n, D] weights));
  // recpipe's own: per-feature dist_types, table_sizes, seed, route_bad_ids.
  // Returns (new_lengths, new_indices, new_weights?, new_pos?, unbucketize_permute?,
  // bucket_mapping?).
  m.def(
      "block_bucketize_sparse_features(Tensor lengths, Tensor indices, Tensor block_sizes, "
      "Tensor dist_types, SymInt my_size, bool sequence=False, bool bucketize_pos=False, "
      "Tensor? weights=None, Tensor? table_sizes=None, int seed=0, bool keep_orig_idx=False, "
      "Tensor? batch_size_per_feature=None, SymInt max_B=-1, Tensor[]? block_bucketize_pos=None, "
      "Tensor? total_num_blocks=None, Tensor? keep_orig_idx_per_feature=None, "
      "bool return_bucket_mapping=False, bool route_bad_ids=False) -> (Tensor, Tensor, Tensor?, Tensor?, Tensor?, "
      "Tensor?)");
  // Inverse of hash_roundrobin routing: (owner rank, local row) -> global id.
  m.def(
      "hash_roundrobin_global_ids(Tensor ranks, Tensor local_ids, int table_size, "
      "SymInt world_size, int seed=0) -> Tensor");
  // Routing primitive: (owner rank [n] int64, local id [n], dtype of ids) of each id
  // of one table of table_size rows over world_size ranks; O(n) memory.
  m.def("route_ids(Tensor ids, int table_size, SymInt world_size, int dist_type, int seed=0) -> (Tensor, Tensor)");
  // Planner: one pass of the 2-D (HBM bins x DDR bins) placement DP, pruning
  // partial plans whose Lagrangian bound (prices per byte) exceeds `incumbent`;
  // returns (choice [M] int64, or [0] when no plan fits or beats the
  // incumbent; total cost, 0-dim float64).
  m.def(
      "placement_dp(Tensor hbm, Tensor ddr, Tensor cost, Tensor priced, Tensor keep, "
      "int hbm_budget, int ddr_budget, int hbm_bins, int ddr_bins, float incumbent, "
      "float price_hbm, float price_ddr) -> (Tensor, Tensor)");
  // Planner: Lagrange prices of the two budgets by projected subgradient ascent;
  // returns a [2] float64 tensor (l_hbm, l_ddr) in cost units per whole budget.
  m.def(
      "placement_budget_prices(Tensor hbm, Tensor ddr, Tensor cost, int hbm_budget, "
      "int ddr_budget, int iters=200) -> Tensor");
  // Planner: mask of the usable options no other usable option of the same
  // table beats on HBM, DDR and cost ([M, K] bool).
  m.def(
      "placement_prune_dominated(Tensor hbm, Tensor ddr, Tensor cost, Tensor usable) -> Tensor");
  // Tiered storage: one step's lookup of a shard's local ids. CACHING admits the
  // batch's missing rows (LFU / LRU, write-back of dirty victims) first; the
  // stats counters (last lookup, then running totals) are updated in place.
  // Returns (pooled [B, dim], unique rows [U] int64, inverse [n] int64).
  m.def(
      "tiered_lookup(Tensor ids, Tensor offsets, Tensor? per_sample_weights, Tensor(a!) fast_weights, "
      "Tensor(b!) fast_state, Tensor(c!) slow_weights, Tensor(d!) slow_state, Tensor(e!) row_map, "
      "Tensor(f!) slot_row, Tensor(g!) slot_score, Tensor(h!) stats, int num_rows, int fast_rows, "
      "int split_seed, int mode, int policy, int clock, int pooling) -> (Tensor, Tensor, Tensor)");
  // Tiered storage: the fused optimizer step of one lookup's rows, in place in
  // whichever tier each row lives (CACHING marks updated slots dirty).
  m.def(
      "tiered_backward(Tensor grad_out, Tensor uniq, Tensor inverse, Tensor offsets, "
      "Tensor? per_sample_weights, Tensor(a!) fast_weights, Tensor(b!) fast_state, Tensor(c!) slow_weights, "
      "Tensor(d!) slow_state, Tensor row_map, Tensor(e!) slot_score, int num_rows, int fast_rows, "
      "int split_seed, int mode, int pooling, int optimizer, float lr, float eps, float beta1, float beta2, "
      "float weight_decay, int step) -> ()");
  // Dynamic tables: the key index's plan (pure, mutates nothing). For ascending
  // unique int64 keys `uniq` [n], the slot of keys [B * bucket_slots] holding
  // each (found, -1: absent) and, where want_insert (None: nowhere), the slot an
  // absent key would take (slot, -1: none): per bucket, free slots in key order,
  // then the used slots no key of the call holds by (score, slot). `salt` is the
  // uint64 bucket salt's bit pattern. Returns (found [n], slot [n]) int64.
  m.def(
      "dynamic_hash_plan(Tensor uniq, Tensor? want_insert, Tensor keys, Tensor scores, Tensor sizes, "
      "int bucket_slots, int salt) -> (Tensor, Tensor)");
  // Dynamic tables: float32 initial rows [n, dim] of int64 keys under the uniform
  // initializer, lower + (upper - lower) * u(c) in double (docs/dynamic.md); `init_salt`
  // is the uint64 salt's bit pattern.
  m.def("dynamic_init_uniform(Tensor keys, int dim, int init_salt, float lower, float upper) -> Tensor");
  // Dynamic tables: a batch's keys deduplicated, as torch.unique(keys, sorted=True,
  // return_inverse=True, return_counts=True): (uniq ascending, inverse, counts), int64.
  m.def("dynamic_unique(Tensor keys) -> (Tensor, Tensor, Tensor)");
}

// Importing recpipe._C registers the ops. The module holds the constants
// Python must agree with the kernels on, read from the kernels' own header
// (recpipe.pipeline.ops re-exports them): ROUTING_VERSION (the
// hash_roundrobin bijection checkpoints record) and the dist_types codes; and
// CPU_DISPATCH, the CPU dispatch compiled in (cpu_dispatch.h): "x86" or
// "portable" (a non-x86 CPU, or a build with RECPIPE_PORTABLE=1).
#include <Python.h>

#include "bucketize_math.h"
#include "cpu_dispatch.h"

static struct PyModuleDef recpipe_c_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&recpipe_c_module);
  if (m == nullptr) {
    return nullptr;
  }
  if (PyModule_AddIntConstant(m, "ROUTING_VERSION", recpipe::kRoutingVersion) < 0 ||
      PyModule_AddIntConstant(m, "DIST_CONTINUOUS", recpipe::kContinuous) < 0 ||
      PyModule_AddIntConstant(m, "DIST_ROUNDROBIN", recpipe::kRoundRobin) < 0 ||
      PyModule_AddIntConstant(m, "DIST_HASH_ROUNDROBIN", recpipe::kHashRoundRobin) < 0 ||
      PyModule_AddStringConstant(m, "CPU_DISPATCH", recpipe::kCpuDispatch) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
