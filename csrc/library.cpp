// recpipe: every operator schema (the one TORCH_LIBRARY block) and the Python
// module init of recpipe._C. Kernels register per backend beside their code:
//   bucketize.cpp        CPU   block_bucketize_sparse_features, hash_roundrobin_global_ids
//   bucketize_cuda.cu    CUDA  the same two routing ops
//   placement_dp.cpp     CPU   placement_dp, placement_budget_prices, placement_prune_dominated (planner)
#include <torch/library.h>

TORCH_LIBRARY(recpipe, m) {
  // Routing: split a KJT's flat lengths/indices by owner rank (fbgemm's layout).
  m.def(
      "block_bucketize_sparse_features(Tensor lengths, Tensor indices, Tensor block_sizes, "
      "Tensor dist_types, SymInt my_size, bool sequence=False, bool bucketize_pos=False, "
      "Tensor? weights=None, Tensor? table_sizes=None, int seed=0, bool keep_orig_idx=False) "
      "-> (Tensor, Tensor, Tensor?, Tensor?, Tensor?)");
  // Inverse of hash_roundrobin routing: (owner rank, local row) -> global id.
  m.def(
      "hash_roundrobin_global_ids(Tensor ranks, Tensor local_ids, int table_size, "
      "SymInt world_size, int seed=0) -> Tensor");
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
}

// Importing recpipe._C registers the ops. The module holds the constants
// Python must agree with the kernels on, read from the kernels' own header
// (recpipe.pipeline.ops re-exports them): ROUTING_VERSION (the
// hash_roundrobin bijection checkpoints record) and the dist_types codes.
#include <Python.h>

#include "bucketize_math.h"

static struct PyModuleDef recpipe_c_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&recpipe_c_module);
  if (m == nullptr) {
    return nullptr;
  }
  if (PyModule_AddIntConstant(m, "ROUTING_VERSION", recpipe::kRoutingVersion) < 0 ||
      PyModule_AddIntConstant(m, "DIST_CONTINUOUS", recpipe::kContinuous) < 0 ||
      PyModule_AddIntConstant(m, "DIST_ROUNDROBIN", recpipe::kRoundRobin) < 0 ||
      PyModule_AddIntConstant(m, "DIST_HASH_ROUNDROBIN", recpipe::kHashRoundRobin) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
