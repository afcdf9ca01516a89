// Which Newton-Schulz iteration runs, and the shape rule that `kAuto`
// resolves by. Header-only and dependency-free so that the backends
// (kernels/cpu, kernels/cuda), the Muon rule (server/optim) and the planner
// (server/plan, which links no backend) share one rule and cannot disagree
// about which algorithm a matrix gets.
//
// Both iterations compute the same polynomial of X (s x l, s <= l, the wide
// orientation) in exact arithmetic; they differ in where the flops go.
//   standard, per step (a, b, c):   A = X X^T; X <- (a I + b A + c A^2) X
//     = 2 s^2 l + 2 s^3 + 2 s^2 l per step.
//   gram (Dao-AILab gram-newton-schulz; DeepSpeed's Muon):
//     R = X X^T once; per step P = a I + b R + c R^2, Q <- P Q,
//     R <- P R P (all s x s); finally X <- Q X.
//     = 2 s^2 l (R) + 2 s^2 l (Q X) + (8 T - 6) s^3 for T steps without a
//     restart: each step has R^2, Z Q, R Z and Z (R Z), less Q's product
//     in the first step (Q = P) and R's update in the last. With the
//     restarts below (segments of 2, then 3 steps) T = 5 costs
//     8 s^2 l + 28 s^3.
// So gram pays off when l / s is large: for T = 5, 8 s^2 l + 28 s^3 against
// the standard 20 s^2 l + 10 s^3, i.e. fewer flops once l > 1.5 s. (Nominal
// flops, X X^T counted as a GEMM, as server/DESIGN.md 4.3 counts them.)
//
// Thread-safety: pure functions.
#ifndef CANZONA_KERNELS_NS_ALGORITHM_H_
#define CANZONA_KERNELS_NS_ALGORITHM_H_

#include <algorithm>
#include <cstdint>

namespace canzona {

// kAuto resolves per matrix shape (ResolveNsAlgorithm); the backends only
// ever run kStandard or kGram.
enum class NsAlgorithm { kStandard, kGram, kAuto };

// Nominal flops of `steps` standard Newton-Schulz steps on rows x cols.
inline double StandardNsFlops(int64_t rows, int64_t cols, int64_t steps) {
  const double s = static_cast<double>(std::min(rows, cols));
  const double l = static_cast<double>(std::max(rows, cols));
  return static_cast<double>(steps) * (4 * s * s * l + 2 * s * s * s);
}

// Restarts, as Dao-AILab's gram-newton-schulz does: the Gram iteration runs
// in segments, each starting from R = X X^T of the current X and ending
// with X <- Q X. A rounding error in R is carried through every later step
// of its segment, multiplied by the polynomial's slope; a fresh R caps it.
// Measured on the cpu (float64 references, tests/unit/kernels/
// backend_conformance_gram.cc): without a restart Gram's error reached
// 1.3e-3 on low-rank and 4-decade inputs where the standard iteration's
// was 4.5e-5; segments of 2 then 3 steps bring it to 3.8e-5, while one
// step then 4 left 2.5e-4. So: restart after step 2, then every 3 steps.
inline constexpr int64_t kGramFirstSegmentSteps = 2;
inline constexpr int64_t kGramSegmentSteps = 3;

// The end (exclusive) of the segment that starts at step `first`.
inline int64_t GramSegmentEnd(int64_t first, int64_t steps) {
  const int64_t length =
      first == 0 ? kGramFirstSegmentSteps : kGramSegmentSteps;
  return std::min(steps, first + length);
}

// Cost of `steps` Gram steps on rows x cols in the same units.
// `small_product_weight` is the cost of one s x s product flop relative to
// one flop of the iteration's X products: 1 when both run at the same rate
// (fp32 everywhere), 2 for cuda bf16, whose s x s products run in TF32 on
// float32 operands (about half the bf16 tensor-core rate) so that R, which
// squares X's conditioning, is never rounded to bf16.
// Each segment of c steps costs 4 s^2 l + (8 c - 6) s^3.
inline double GramNsCost(int64_t rows, int64_t cols, int64_t steps,
                         double small_product_weight = 1.0) {
  const double s = static_cast<double>(std::min(rows, cols));
  const double l = static_cast<double>(std::max(rows, cols));
  double cost = 0;
  for (int64_t first = 0; first < steps;) {
    const int64_t end = GramSegmentEnd(first, steps);
    cost += 4 * s * s * l + small_product_weight *
                                static_cast<double>(8 * (end - first) - 6) * s *
                                s * s;
    first = end;
  }
  return cost;
}

// Gram's s x s products are small GEMMs: on an H200 in torch the Gram
// iteration lost (0.72-0.86x of NS5) on square and 1024-row shapes even
// where it saves flops, and symmetric-GEMM kernels lose below ~2048 rows
// (issue 31). So kAuto never picks gram for a smaller side.
inline constexpr int64_t kGramMinSide = 2048;
// Gram squares the conditioning in R; take that risk only for a real win:
// its cost must be at most this fraction of the standard iteration's.
inline constexpr double kGramMaxCostRatio = 0.9;

// The algorithm `requested` runs as on a rows x cols matrix: kAuto is kGram
// when min(rows, cols) >= kGramMinSide and GramNsCost <= kGramMaxCostRatio *
// StandardNsFlops, else kStandard. (Issue 31's H200 measurements of an
// unrestarted Gram iteration in torch follow its flop ratio: 2.04x
// predicted / 2.16x measured on 25600x5120, 1.52x / 1.59x on 12288x4096,
// 1.04x / 1.05x on 8192x5120. With the restarts the flop ratios are 1.62x,
// 1.35x and 1.03x; no GPU figure of this code exists yet.)
inline NsAlgorithm ResolveNsAlgorithm(NsAlgorithm requested, int64_t rows,
                                      int64_t cols, int64_t steps,
                                      double small_product_weight = 1.0) {
  if (requested != NsAlgorithm::kAuto) return requested;
  if (std::min(rows, cols) < kGramMinSide || steps <= 0) {
    return NsAlgorithm::kStandard;
  }
  return GramNsCost(rows, cols, steps, small_product_weight) <=
                 kGramMaxCostRatio * StandardNsFlops(rows, cols, steps)
             ? NsAlgorithm::kGram
             : NsAlgorithm::kStandard;
}

// "standard" / "gram" / "auto".
inline const char* NsAlgorithmName(NsAlgorithm algorithm) {
  switch (algorithm) {
    case NsAlgorithm::kStandard:
      return "standard";
    case NsAlgorithm::kGram:
      return "gram";
    case NsAlgorithm::kAuto:
      return "auto";
  }
  return "unknown";
}

}  // namespace canzona

#endif  // CANZONA_KERNELS_NS_ALGORITHM_H_
