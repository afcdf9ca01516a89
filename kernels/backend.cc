#include "kernels/backend.h"

#include "absl/strings/str_cat.h"

namespace canzona {

absl::string_view BackendKindName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kCpu:
      return "cpu";
    case BackendKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view name) {
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "cuda") return BackendKind::kCuda;
  return absl::InvalidArgumentError(absl::StrCat(
      "backend: unknown value \"", name, "\" (expected cpu or cuda)"));
}

NsAlgorithm ResolvedNsAlgorithm(const NewtonSchulzSpec& spec, BackendKind kind,
                                int64_t rows, int64_t cols) {
  const auto steps = static_cast<int64_t>(spec.coefficients.size());
  if (kind == BackendKind::kCpu && spec.algorithm == NsAlgorithm::kAuto) {
    // BLAS runs small GEMMs near its large-GEMM rate: on cpu Gram's measured
    // speed-up follows its flop ratio down to 256 x 512
    // (tests/bench/RESULTS.md), so the cpu takes it wherever the flops say
    // it wins. ResolveNsAlgorithm's minimum side is the GPU's small-GEMM
    // penalty; the cost test is the same.
    if (steps <= 0) return NsAlgorithm::kStandard;
    return GramNsCost(rows, cols, steps) <=
                   kGramMaxCostRatio * StandardNsFlops(rows, cols, steps)
               ? NsAlgorithm::kGram
               : NsAlgorithm::kStandard;
  }
  // cuda bf16 runs Gram's s x s products in TF32 on float32 operands, about
  // half its bf16 rate; everything else runs them at the X products' rate.
  const double weight =
      kind == BackendKind::kCuda && spec.precision == NsPrecision::kBfloat16
          ? 2.0
          : 1.0;
  return ResolveNsAlgorithm(spec.algorithm, rows, cols, steps, weight);
}

}  // namespace canzona
