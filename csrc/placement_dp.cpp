// recpipe: CPU kernels of the placement planner (recpipe.planner.proposers).
//
// placement_dp: one pass of the 2-D knapsack DP over (HBM bins, DDR bins).
//   Tables are added one at a time. The state is a sparse list of occupied grid
//   cells; each carries the cheapest partial plan (ranked by `priced`) whose
//   exact cumulative usage (U, V) rounds UP to the cell,
//     a = min(ceil(U * hbm_bins / H), hbm_bins),  b = min(ceil(V * ddr_bins / D), ddr_bins),
//   with its exact bytes and true cost. Recurrence for table i, option j:
//     state'(cell(U + hbm[i, j], V + ddr[i, j])) = min over (state, j) of P + priced[i, j]
//   keeping only candidates whose exact bytes still leave room for the cheapest
//   option of every later table (U' <= H - sum_{l > i} min_j hbm[l, j], same for
//   DDR) and whose Lagrangian lower bound
//     T + cost[i, j] + sum_{l > i} min_j (c + p_h h + p_d d) - p_h (H - U') - p_d (D - V')
//   does not exceed `incumbent` (the cost of a known plan; a candidate above it
//   cannot lead to a cheaper plan); the pass returns a plan cheaper than the
//   incumbent or none. With one bin per byte every pruning here is exact (the
//   pass returns the optimum when it beats the incumbent); with coarser bins,
//   as plans sharing a cell already do, pruning changes which plan holds a
//   cell. After each table a state is dropped when another occupied state lies
//   in a cell strictly below it on both axes with a true cost no higher (it uses
//   strictly fewer bytes of both budgets, so it dominates exactly). Back-pointers
//   (option, source state) per table give the plan of the cheapest final state.
//   The Python twin (DynamicProgrammingProposer._dp_numpy) computes the same
//   floating-point operations in the same order, so both return the same plan.
//   Each table's relaxation runs option by option in two loops: candidates
//   (vectorized: target cell, price, feasibility) and scatter_min (branch-free).
//
// placement_budget_prices: Lagrange prices of both budgets by projected
//   subgradient ascent on g(l) = sum_i min_j (c_ij + l_h h_ij / H + l_d d_ij / D) - l_h - l_d.
//
// placement_prune_dominated: the usable options no other usable option of the
//   same table beats on HBM, DDR and cost (twin: proposers.prune_dominated).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu_dispatch.h"

#if defined(RECPIPE_X86_DISPATCH)
#include <immintrin.h>
#endif

namespace recpipe {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Largest grid the DP accepts: (hbm_bins + 1) x (ddr_bins + 1) cells, 8 + 8 bytes
// of scratch each (128 MiB at the cap). Cells.
constexpr int64_t kMaxCells = int64_t{1} << 23;

void check_planner_inputs(
    const at::Tensor& hbm, const at::Tensor& ddr, const at::Tensor& cost, const char* op) {
  TORCH_CHECK(
      hbm.dim() == 2, "recpipe.", op, ": `hbm` must be 2-D (tables, options), got ", hbm.dim(),
      "-D; pass the (M, K) option matrix.");
  TORCH_CHECK(
      ddr.sizes() == hbm.sizes() && cost.sizes() == hbm.sizes(), "recpipe.", op, ": `hbm` ",
      hbm.sizes(), ", `ddr` ", ddr.sizes(), " and `cost` ", cost.sizes(),
      " must share one (tables, options) shape.");
  TORCH_CHECK(
      hbm.scalar_type() == at::kLong && ddr.scalar_type() == at::kLong, "recpipe.", op,
      ": `hbm` and `ddr` must be int64 bytes, got ", hbm.scalar_type(), " and ", ddr.scalar_type(),
      "; convert with .long().");
  TORCH_CHECK(
      cost.scalar_type() == at::kDouble, "recpipe.", op, ": `cost` must be float64, got ",
      cost.scalar_type(), "; convert with .double().");
  TORCH_CHECK(
      hbm.device().is_cpu() && ddr.device().is_cpu() && cost.device().is_cpu(), "recpipe.", op,
      ": inputs must be CPU tensors (`hbm` on ", hbm.device(), ", `ddr` on ", ddr.device(),
      ", `cost` on ", cost.device(), "); the planner runs on the host.");
}

// Prefix minimum over [0, i] of a Fenwick (binary indexed) tree, for the
// dominance sweep: rows are inserted in ascending HBM bin, queries ask for the
// cheapest state in a strictly lower DDR bin.
struct MinFenwick {
  std::vector<double> t;
  explicit MinFenwick(int64_t n) : t(static_cast<size_t>(n) + 1, kInf) {}
  void reset() { std::fill(t.begin(), t.end(), kInf); }
  void insert(int64_t i, double v) {  // position i in [0, n)
    for (int64_t k = i + 1; k < static_cast<int64_t>(t.size()); k += k & -k) {
      t[k] = std::min(t[k], v);
    }
  }
  double prefix_min(int64_t i) const {  // min over positions [0, i), i in [0, n]
    double m = kInf;
    for (int64_t k = i; k > 0; k -= k & -k) {
      m = std::min(m, t[k]);
    }
    return m;
  }
};

// Byte counts are carried as doubles inside the DP: exact below 2^53 bytes
// (8 PiB), which the op checks, so sums and comparisons stay exact and the
// product with the bins-per-byte factor equals the NumPy twin's int64 * float64.
constexpr double kExactBytes = 9007199254740992.0;  // 2^53
// Adding then subtracting 2^52 rounds a double in [0, 2^52) to an integer.
constexpr double kRoundMagic = 4503599627370496.0;  // 2^52
// Relative slack of the incumbent bound (float error of a sum of ~1e3 terms is
// far below it). Fraction.
constexpr double kBoundSlack = 1e-9;

// What step 1 needs besides the states: one option (bytes, priced and true
// cost), the room left for this table, the bound, and the grid's scale.
struct OptionStep {
  double hj, dj, pj, cj;  // option bytes (HBM, DDR), priced cost, true cost
  double Hl, Dl;          // HBM / DDR bytes a state may reach after this table
  double Hd, Dd;          // the budgets
  double ph, pd;          // prices per byte of the Lagrangian bound
  double rest_lag;        // Lagrangian bound of the later tables
  double bound;           // incumbent cost plus slack
  double fh, fd;          // bins per byte
  double nhf, ndf, sf;    // last bin of each axis, cells per HBM bin
  int32_t dump;           // spare cell of the candidates over budget / bound
};

// Step 1 of the relaxation for one option: target cell and priced cost of every
// state, written to scratch arrays (a loop the compiler vectorizes). A state
// over budget, or whose lower bound exceeds `bound`, gets the spare cell `dump`
// and an infinite price.
inline void candidates_scalar(
    int64_t S,
    const double* __restrict U,
    const double* __restrict V,
    const double* __restrict P,
    const double* __restrict T,
    const OptionStep& o,
    double* __restrict cell_out,
    double* __restrict p_out) {
  const double dumpd = static_cast<double>(o.dump);
  for (int64_t s = 0; s < S; ++s) {
    const double u = U[s] + o.hj, v = V[s] + o.dj;
    // Lagrangian lower bound of the cheapest completion; above `o.bound` the
    // candidate cannot beat the incumbent plan.
    const double lb = (((T[s] + o.cj) + o.rest_lag) - o.ph * (o.Hd - u)) - o.pd * (o.Dd - v);
    const double xa = u * o.fh, xb = v * o.fd;
    // ceil for 0 <= x < 2^52 (larger x only occurs over budget): round to
    // nearest by adding 2^52, then step up if that fell below x.
    double ra = (xa + kRoundMagic) - kRoundMagic;
    double rb = (xb + kRoundMagic) - kRoundMagic;
    ra += ra < xa ? 1.0 : 0.0;
    rb += rb < xb ? 1.0 : 0.0;
    const double a = ra < o.nhf ? ra : o.nhf;
    const double b = rb < o.ndf ? rb : o.ndf;
    const bool ok = (u <= o.Hl) & (v <= o.Dl) & (lb <= o.bound);
    cell_out[s] = ok ? a * o.sf + b : dumpd;
    p_out[s] = ok ? P[s] + o.pj : kInf;
  }
}

#if defined(RECPIPE_X86_DISPATCH)
// candidates_scalar in AVX2 lanes, four states at a time: the same IEEE
// operations in the same order (no FMA), so results are bit-identical.
__attribute__((target("avx2"))) void candidates_avx2(
    int64_t S,
    const double* __restrict U,
    const double* __restrict V,
    const double* __restrict P,
    const double* __restrict T,
    const OptionStep& o,
    double* __restrict cell_out,
    double* __restrict p_out) {
  const __m256d vhj = _mm256_set1_pd(o.hj), vdj = _mm256_set1_pd(o.dj), vpj = _mm256_set1_pd(o.pj);
  const __m256d vcj = _mm256_set1_pd(o.cj), vHl = _mm256_set1_pd(o.Hl), vDl = _mm256_set1_pd(o.Dl);
  const __m256d vHd = _mm256_set1_pd(o.Hd), vDd = _mm256_set1_pd(o.Dd), vph = _mm256_set1_pd(o.ph);
  const __m256d vpd = _mm256_set1_pd(o.pd), vrest = _mm256_set1_pd(o.rest_lag), vbound = _mm256_set1_pd(o.bound);
  const __m256d vfh = _mm256_set1_pd(o.fh), vfd = _mm256_set1_pd(o.fd), vnh = _mm256_set1_pd(o.nhf);
  const __m256d vnd = _mm256_set1_pd(o.ndf), vsf = _mm256_set1_pd(o.sf), vmagic = _mm256_set1_pd(kRoundMagic);
  const __m256d vone = _mm256_set1_pd(1.0), vdump = _mm256_set1_pd(static_cast<double>(o.dump));
  const __m256d vinf = _mm256_set1_pd(kInf);
  int64_t s = 0;
  for (; s + 4 <= S; s += 4) {
    const __m256d u = _mm256_add_pd(_mm256_loadu_pd(U + s), vhj);
    const __m256d v = _mm256_add_pd(_mm256_loadu_pd(V + s), vdj);
    const __m256d t = _mm256_add_pd(_mm256_add_pd(_mm256_loadu_pd(T + s), vcj), vrest);
    const __m256d lb = _mm256_sub_pd(
        _mm256_sub_pd(t, _mm256_mul_pd(vph, _mm256_sub_pd(vHd, u))), _mm256_mul_pd(vpd, _mm256_sub_pd(vDd, v)));
    const __m256d xa = _mm256_mul_pd(u, vfh), xb = _mm256_mul_pd(v, vfd);
    __m256d ra = _mm256_sub_pd(_mm256_add_pd(xa, vmagic), vmagic);
    __m256d rb = _mm256_sub_pd(_mm256_add_pd(xb, vmagic), vmagic);
    ra = _mm256_add_pd(ra, _mm256_and_pd(_mm256_cmp_pd(ra, xa, _CMP_LT_OQ), vone));
    rb = _mm256_add_pd(rb, _mm256_and_pd(_mm256_cmp_pd(rb, xb, _CMP_LT_OQ), vone));
    // std::min(r, n) = n < r ? n : r
    const __m256d a = _mm256_blendv_pd(ra, vnh, _mm256_cmp_pd(vnh, ra, _CMP_LT_OQ));
    const __m256d b = _mm256_blendv_pd(rb, vnd, _mm256_cmp_pd(vnd, rb, _CMP_LT_OQ));
    const __m256d ok = _mm256_and_pd(
        _mm256_and_pd(_mm256_cmp_pd(u, vHl, _CMP_LE_OQ), _mm256_cmp_pd(v, vDl, _CMP_LE_OQ)),
        _mm256_cmp_pd(lb, vbound, _CMP_LE_OQ));
    const __m256d cell = _mm256_add_pd(_mm256_mul_pd(a, vsf), b);
    const __m256d p = _mm256_add_pd(_mm256_loadu_pd(P + s), vpj);
    _mm256_storeu_pd(cell_out + s, _mm256_blendv_pd(vdump, cell, ok));
    _mm256_storeu_pd(p_out + s, _mm256_blendv_pd(vinf, p, ok));
  }
  candidates_scalar(S - s, U + s, V + s, P + s, T + s, o, cell_out + s, p_out + s);
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

// Vector lanes for step 1: AVX2 on CPUs that have it in a build with the x86
// dispatch (cpu_dispatch.h), unless the environment sets
// RECPIPE_PLANNER_SIMD=scalar (tests compare both paths). Read per call.
bool use_simd() {
  const char* env = std::getenv("RECPIPE_PLANNER_SIMD");
  if (env != nullptr && std::string(env) == "scalar") {
    return false;
  }
#if defined(RECPIPE_X86_DISPATCH)
  return cpu_has_avx2();
#else
  return false;
#endif
}

// Step 1 dispatch: AVX2 lanes when use_simd() says so, else the scalar loop
// (the only one of the portable build); both give bit-identical results.
void candidates(
    bool simd,
    int64_t S,
    const double* U,
    const double* V,
    const double* P,
    const double* T,
    const OptionStep& o,
    double* cell_out,
    double* p_out) {
#if defined(RECPIPE_X86_DISPATCH)
  if (simd) {
    candidates_avx2(S, U, V, P, T, o, cell_out, p_out);
    return;
  }
#else
  (void)simd;  // use_simd() is false in the portable build
#endif
  candidates_scalar(S, U, V, P, T, o, cell_out, p_out);
}

// Step 2: scatter-min of one option's candidates into the grid. Per cell the
// cheapest priced candidate wins; of equals the one with the largest index
// s * k + jj (the NumPy twin's scatter keeps the last). Each newly touched cell
// is listed once. Branch-free.
int64_t scatter_min(
    int64_t S,
    int64_t k,
    int64_t jj,
    int32_t dump,
    const double* __restrict cell_in,
    const double* __restrict p_in,
    double* __restrict best,
    int64_t* __restrict winner,
    int64_t* __restrict touched,
    int64_t nt) {
  for (int64_t s = 0; s < S; ++s) {
    const int64_t cell = static_cast<int64_t>(cell_in[s]);
    const double p = p_in[s];
    const int64_t idx = s * k + jj;
    const int64_t w = winner[cell];
    const double bc = best[cell];
    touched[nt] = cell;
    nt += static_cast<int64_t>((w < 0) & (cell != dump));
    const bool take = (p < bc) | ((p == bc) & (idx > w));
    best[cell] = take ? p : bc;
    winner[cell] = take ? idx : w;
  }
  return nt;
}

std::tuple<at::Tensor, at::Tensor> placement_dp_cpu(
    const at::Tensor& hbm_in,
    const at::Tensor& ddr_in,
    const at::Tensor& cost_in,
    const at::Tensor& priced_in,
    const at::Tensor& keep_in,
    int64_t H,
    int64_t D,
    int64_t nh,
    int64_t nd,
    double incumbent,
    double price_hbm,
    double price_ddr) {
  check_planner_inputs(hbm_in, ddr_in, cost_in, "placement_dp");
  TORCH_CHECK(
      priced_in.sizes() == hbm_in.sizes() && priced_in.scalar_type() == at::kDouble &&
          priced_in.device().is_cpu(),
      "recpipe.placement_dp: `priced` must be a CPU float64 tensor shaped like `cost` ",
      cost_in.sizes(), ", got ", priced_in.scalar_type(), " ", priced_in.sizes(), " on ",
      priced_in.device(), ".");
  TORCH_CHECK(
      keep_in.sizes() == hbm_in.sizes() && keep_in.scalar_type() == at::kBool && keep_in.device().is_cpu(),
      "recpipe.placement_dp: `keep` must be a CPU bool tensor shaped like `cost` ", cost_in.sizes(),
      ", got ", keep_in.scalar_type(), " ", keep_in.sizes(), " on ", keep_in.device(), ".");
  TORCH_CHECK(
      H >= 0 && D >= 0, "recpipe.placement_dp: budgets must be >= 0 bytes, got hbm_budget=", H,
      ", ddr_budget=", D, ".");
  TORCH_CHECK(
      nh >= 0 && nd >= 0, "recpipe.placement_dp: `hbm_bins` and `ddr_bins` must be >= 0 (0 = the axis ",
      "cannot bind and is not tracked), got ", nh, " and ", nd, ".");
  TORCH_CHECK(
      (nh + 1) <= kMaxCells / (nd + 1), "recpipe.placement_dp: grid of (", nh, " + 1) x (", nd,
      " + 1) cells exceeds ", kMaxCells, " cells; pass fewer bins.");
  const at::Tensor hbm = hbm_in.contiguous(), ddr = ddr_in.contiguous(), cost = cost_in.contiguous();
  const at::Tensor priced = priced_in.contiguous(), keep = keep_in.contiguous();
  const int64_t M = hbm.size(0), K = hbm.size(1);
  const int64_t* hp = hbm.const_data_ptr<int64_t>();
  const int64_t* dp = ddr.const_data_ptr<int64_t>();
  const double* cp = cost.const_data_ptr<double>();
  const double* pp = priced.const_data_ptr<double>();
  const bool* kp = keep.const_data_ptr<bool>();
  auto none = [] {
    return std::make_tuple(at::empty({0}, at::kLong), at::full({}, kInf, at::kDouble));
  };
  if (M == 0) {
    return std::make_tuple(at::empty({0}, at::kLong), at::zeros({}, at::kDouble));
  }

  TORCH_CHECK(
      price_hbm >= 0.0 && price_ddr >= 0.0 && std::isfinite(price_hbm) && std::isfinite(price_ddr),
      "recpipe.placement_dp: `price_hbm` and `price_ddr` must be finite and >= 0 (cost per byte), got ", price_hbm,
      " and ", price_ddr, ".");
  TORCH_CHECK(
      !std::isnan(incumbent), "recpipe.placement_dp: `incumbent` is NaN; pass inf for no incumbent plan.");
  TORCH_CHECK(
      static_cast<double>(H) < kExactBytes && static_cast<double>(D) < kExactBytes,
      "recpipe.placement_dp: budgets must be < 2^53 bytes, got hbm_budget=", H, ", ddr_budget=", D, ".");
  // Cheapest bytes of every later table: a state must leave room for them.
  std::vector<int64_t> rest_h(M + 1, 0), rest_d(M + 1, 0);
  for (int64_t i = M - 1; i >= 0; --i) {
    int64_t mh = std::numeric_limits<int64_t>::max(), md = mh;
    for (int64_t j = 0; j < K; ++j) {
      if (kp[i * K + j]) {
        TORCH_CHECK(
            hp[i * K + j] >= 0 && dp[i * K + j] >= 0 && static_cast<double>(hp[i * K + j]) < kExactBytes &&
                static_cast<double>(dp[i * K + j]) < kExactBytes,
            "recpipe.placement_dp: option (", i, ", ", j, ") needs hbm=", hp[i * K + j], ", ddr=", dp[i * K + j],
            " bytes; `hbm` and `ddr` must be in [0, 2^53).");
        mh = std::min(mh, hp[i * K + j]);
        md = std::min(md, dp[i * K + j]);
      }
    }
    if (mh == std::numeric_limits<int64_t>::max()) {
      return none();  // a table with no option
    }
    rest_h[i] = rest_h[i + 1] + mh;
    rest_d[i] = rest_d[i + 1] + md;
  }
  // Lagrangian bound of the later tables: sum_{l > i} min_j (c + p_h h + p_d d).
  std::vector<double> rest_lag(M + 1, 0.0);
  for (int64_t i = M - 1; i >= 0; --i) {
    double ml = kInf;
    for (int64_t j = 0; j < K; ++j) {
      if (kp[i * K + j]) {
        const double l = (cp[i * K + j] + price_hbm * static_cast<double>(hp[i * K + j])) +
            price_ddr * static_cast<double>(dp[i * K + j]);
        ml = std::min(ml, l);
      }
    }
    rest_lag[i] = rest_lag[i + 1] + ml;
  }
  // Relative slack so float error in the bound never drops a plan that ties.
  const double bound = incumbent + kBoundSlack * std::max(1.0, std::abs(incumbent));
  const double Hd = static_cast<double>(H), Dd = static_cast<double>(D);

  const int64_t stride = nd + 1;
  const int64_t ncell = (nh + 1) * stride;
  // Bins per byte (0 for an untracked axis), as the Python twin computes them.
  // A zero budget holds only zero-byte plans: one bin.
  const double fh = (nh && H) ? static_cast<double>(nh) / static_cast<double>(H) : 0.0;
  const double fd = (nd && D) ? static_cast<double>(nd) / static_cast<double>(D) : 0.0;
  const double nhf = static_cast<double>(nh), ndf = static_cast<double>(nd);

  std::vector<double> P{0.0}, T{0.0}, P2, T2;
  std::vector<double> U{0.0}, V{0.0}, U2, V2;  // exact bytes (< 2^53)
  std::vector<double> cand_cell;  // cell index as a double (exact)
  std::vector<double> cand_p;
  const double sf = static_cast<double>(stride);
  const int32_t dump = static_cast<int32_t>(ncell);
  const bool simd = use_simd();
  std::vector<std::vector<int64_t>> back_opt(M), back_src(M);
  // One spare cell past the grid takes the candidates over budget.
  std::vector<double> best(ncell + 1, kInf);
  std::vector<int64_t> winner(ncell + 1, -1);
  std::vector<int64_t> touched(ncell + 1), opts;
  std::vector<double> oh, od;
  std::vector<double> op, oc;
  std::vector<uint8_t> alive;
  MinFenwick fen(std::max<int64_t>(nd, 1));

  for (int64_t i = 0; i < M; ++i) {
    opts.clear();
    oh.clear();
    od.clear();
    op.clear();
    oc.clear();
    for (int64_t j = 0; j < K; ++j) {
      if (kp[i * K + j]) {
        opts.push_back(j);
        oh.push_back(static_cast<double>(hp[i * K + j]));
        od.push_back(static_cast<double>(dp[i * K + j]));
        op.push_back(pp[i * K + j]);
        oc.push_back(cp[i * K + j]);
      }
    }
    const int64_t k = static_cast<int64_t>(opts.size());
    const double Hl = static_cast<double>(H - rest_h[i + 1]), Dl = static_cast<double>(D - rest_d[i + 1]);
    const int64_t S = static_cast<int64_t>(P.size());
    cand_cell.resize(S);
    cand_p.resize(S);
    int64_t nt = 0;
    // Option-major: for one option consecutive states land in distinct cells,
    // so the scatter rarely re-reads a cell it stored the iteration before.
    for (int64_t jj = 0; jj < k; ++jj) {
      const OptionStep o{
          oh[jj], od[jj], op[jj], oc[jj], Hl, Dl, Hd, Dd, price_hbm, price_ddr, rest_lag[i + 1], bound,
          fh, fd, nhf, ndf, sf, dump};
      candidates(simd, S, U.data(), V.data(), P.data(), T.data(), o, cand_cell.data(), cand_p.data());
      nt = scatter_min(S, k, jj, dump, cand_cell.data(), cand_p.data(), best.data(), winner.data(), touched.data(), nt);
    }
    if (nt == 0) {
      return none();
    }
    // Occupied cells in ascending order: a scan of the grid when it is dense
    // enough, a sort of the touched list otherwise.
    if (nt * 16 >= ncell) {
      int64_t q = 0;
      for (int64_t cell = 0; cell < ncell; ++cell) {
        if (winner[cell] >= 0) {
          touched[q++] = cell;
        }
      }
    } else {
      std::sort(touched.begin(), touched.begin() + nt);
    }
    const int64_t S2 = nt;
    P2.resize(S2);
    T2.resize(S2);
    U2.resize(S2);
    V2.resize(S2);
    auto& bo = back_opt[i];
    auto& bs = back_src[i];
    bo.resize(S2);
    bs.resize(S2);
    for (int64_t q = 0; q < S2; ++q) {
      const int64_t cell = touched[q];
      const int64_t w = winner[cell];
      const int64_t src = w / k, jj = w % k;
      P2[q] = best[cell];
      T2[q] = T[src] + cp[i * K + opts[jj]];
      U2[q] = U[src] + oh[jj];
      V2[q] = V[src] + od[jj];
      bo[q] = opts[jj];
      bs[q] = src;
      best[cell] = kInf;
      winner[cell] = -1;
    }
    // Dominance: drop a state when a state in a cell strictly lower on both axes
    // costs no more. Cells are sorted by (a, b); sweep rows of a, querying the
    // rows already inserted (a' < a) for b' < b before inserting row a.
    int64_t kept = S2;
    if (nh > 0 && nd > 0 && S2 > 1) {
      alive.assign(S2, 1);
      fen.reset();
      int64_t q = 0;
      while (q < S2) {
        const int64_t row = touched[q] / stride;
        int64_t r = q;
        for (; r < S2 && touched[r] / stride == row; ++r) {
          if (fen.prefix_min(touched[r] % stride) <= T2[r]) {
            alive[r] = 0;
          }
        }
        for (int64_t x = q; x < r; ++x) {
          fen.insert(touched[x] % stride, T2[x]);
        }
        q = r;
      }
      kept = 0;
      for (int64_t x = 0; x < S2; ++x) {
        if (alive[x]) {
          P2[kept] = P2[x];
          T2[kept] = T2[x];
          U2[kept] = U2[x];
          V2[kept] = V2[x];
          bo[kept] = bo[x];
          bs[kept] = bs[x];
          ++kept;
        }
      }
      P2.resize(kept);
      T2.resize(kept);
      U2.resize(kept);
      V2.resize(kept);
      bo.resize(kept);
      bs.resize(kept);
    }
    std::swap(P, P2);
    std::swap(T, T2);
    std::swap(U, U2);
    std::swap(V, V2);
  }

  int64_t pos = 0;
  for (int64_t q = 1; q < static_cast<int64_t>(T.size()); ++q) {
    if (T[q] < T[pos]) {
      pos = q;
    }
  }
  const double total = T[pos];
  if (total > bound) {
    return none();  // the bound is a lower bound: the cheapest final plan can still lose to the incumbent
  }
  at::Tensor choice = at::empty({M}, at::kLong);
  int64_t* ch = choice.mutable_data_ptr<int64_t>();
  for (int64_t i = M - 1; i >= 0; --i) {
    ch[i] = back_opt[i][pos];
    pos = back_src[i][pos];
  }
  return std::make_tuple(choice, at::full({}, total, at::kDouble));
}

at::Tensor placement_budget_prices_cpu(
    const at::Tensor& hbm_in,
    const at::Tensor& ddr_in,
    const at::Tensor& cost_in,
    int64_t H,
    int64_t D,
    int64_t iters) {
  check_planner_inputs(hbm_in, ddr_in, cost_in, "placement_budget_prices");
  TORCH_CHECK(
      iters >= 1, "recpipe.placement_budget_prices: `iters` must be >= 1 subgradient steps, got ", iters, ".");
  const at::Tensor hbm = hbm_in.contiguous(), ddr = ddr_in.contiguous(), cost = cost_in.contiguous();
  const int64_t M = hbm.size(0), K = hbm.size(1);
  const int64_t* hp = hbm.const_data_ptr<int64_t>();
  const int64_t* dp = ddr.const_data_ptr<int64_t>();
  const double* cp = cost.const_data_ptr<double>();
  at::Tensor out = at::zeros({2}, at::kDouble);
  // Options of each row (finite cost), as budget shares.
  std::vector<double> a, b, c;
  std::vector<int64_t> row_start(M + 1, 0);
  const double Hs = static_cast<double>(std::max<int64_t>(H, 1));
  const double Ds = static_cast<double>(std::max<int64_t>(D, 1));
  double spread = 0.0;
  for (int64_t i = 0; i < M; ++i) {
    double lo = kInf, hi = -kInf;
    for (int64_t j = 0; j < K; ++j) {
      const double cv = cp[i * K + j];
      if (std::isfinite(cv)) {
        a.push_back(static_cast<double>(hp[i * K + j]) / Hs);
        b.push_back(static_cast<double>(dp[i * K + j]) / Ds);
        c.push_back(cv);
        lo = std::min(lo, cv);
        hi = std::max(hi, cv);
      }
    }
    row_start[i + 1] = static_cast<int64_t>(c.size());
    if (hi >= lo) {
      spread += hi - lo;
    }
  }
  if (c.empty()) {
    return out;
  }
  const double scale = std::max(spread, 1e-12);
  double lh = 0.0, ld = 0.0;
  double best_g = -kInf, best_lh = 0.0, best_ld = 0.0;
  for (int64_t it = 0; it < iters; ++it) {
    double sa = 0.0, sb = 0.0, sz = 0.0;
    for (int64_t i = 0; i < M; ++i) {
      int64_t arg = -1;
      double zmin = kInf;
      for (int64_t q = row_start[i]; q < row_start[i + 1]; ++q) {
        const double z = (a[q] * lh + c[q]) + ld * b[q];
        if (z < zmin) {
          zmin = z;
          arg = q;
        }
      }
      if (arg >= 0) {
        sa += a[arg];
        sb += b[arg];
        sz += zmin;
      }
    }
    const double ga = sa - 1.0, gb = sb - 1.0, g = sz - lh - ld;
    if (g > best_g) {
      best_g = g;
      best_lh = lh;
      best_ld = ld;
    }
    if (it == 0 && ga <= 0.0 && gb <= 0.0) {
      break;  // the cheapest option of every table fits: no budget is priced
    }
    const double step = scale / static_cast<double>(it + 1);
    lh = std::max(0.0, lh + step * ga);
    ld = std::max(0.0, ld + step * gb);
  }
  double* o = out.mutable_data_ptr<double>();
  o[0] = best_lh;
  o[1] = best_ld;
  return out;
}

at::Tensor placement_prune_dominated_cpu(
    const at::Tensor& hbm_in,
    const at::Tensor& ddr_in,
    const at::Tensor& cost_in,
    const at::Tensor& usable_in) {
  check_planner_inputs(hbm_in, ddr_in, cost_in, "placement_prune_dominated");
  TORCH_CHECK(
      usable_in.sizes() == hbm_in.sizes() && usable_in.scalar_type() == at::kBool && usable_in.device().is_cpu(),
      "recpipe.placement_prune_dominated: `usable` must be a CPU bool tensor shaped like `cost` ", cost_in.sizes(),
      ", got ", usable_in.scalar_type(), " ", usable_in.sizes(), " on ", usable_in.device(), ".");
  const at::Tensor hbm = hbm_in.contiguous(), ddr = ddr_in.contiguous(), cost = cost_in.contiguous();
  const at::Tensor usable = usable_in.contiguous();
  const int64_t M = hbm.size(0), K = hbm.size(1);
  const int64_t* hp = hbm.const_data_ptr<int64_t>();
  const int64_t* dp = ddr.const_data_ptr<int64_t>();
  const double* cp = cost.const_data_ptr<double>();
  const bool* up = usable.const_data_ptr<bool>();
  at::Tensor keep = at::empty({M, K}, at::kBool);
  bool* kp = keep.mutable_data_ptr<bool>();
  for (int64_t i = 0; i < M; ++i) {
    const int64_t o = i * K;
    for (int64_t j = 0; j < K; ++j) {
      bool dominated = false;
      if (up[o + j]) {
        const int64_t hj = hp[o + j], dj = dp[o + j];
        const double cj = cp[o + j];
        for (int64_t l = 0; l < K && !dominated; ++l) {
          if (l == j || !up[o + l]) {
            continue;
          }
          const int64_t hl = hp[o + l], dl = dp[o + l];
          const double cl = cp[o + l];
          // l dominates j: no worse on all three, and better on one or equal with a lower index.
          dominated = hl <= hj && dl <= dj && cl <= cj && (hl < hj || dl < dj || cl < cj || l < j);
        }
      }
      kp[o + j] = up[o + j] && !dominated;
    }
  }
  return keep;
}

}  // namespace

TORCH_LIBRARY_IMPL(recpipe, CPU, m) {
  m.impl("placement_dp", &placement_dp_cpu);
  m.impl("placement_budget_prices", &placement_budget_prices_cpu);
  m.impl("placement_prune_dominated", &placement_prune_dominated_cpu);
}

}  // namespace recpipe
