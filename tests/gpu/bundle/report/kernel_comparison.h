// Our Newton-Schulz (canzonactl bench kernels) against PyTorch's NS5 on the
// same shapes and GPU (tests/gpu/torch_ns_bench.py), and against the GEMM
// rate measured on that GPU: the two goals of the GPU data plane, >= 1.5x
// torch's time and >= 60% of the GEMM rate (tests/gpu/bundle/README.md).
//
//   nlohmann::json rows = CompareKernels(results);
//
// Thread-safety: a function of its arguments.
#ifndef CANZONA_TESTS_GPU_BUNDLE_REPORT_KERNEL_COMPARISON_H_
#define CANZONA_TESTS_GPU_BUNDLE_REPORT_KERNEL_COMPARISON_H_

#include <vector>

#include "nlohmann/json.hpp"
#include "tests/gpu/bundle/report/check_result.h"

namespace canzona::bundle {

inline constexpr double kSpeedupGoal = 1.5;
inline constexpr double kGemmFractionGoal = 0.6;

// One row per (precision, shape) that bench kernels measured:
//   precision, rows, cols, ours_ms, ours_gflops, full_products_ms and
//   symmetric_speedup (ours with full GEMMs for X X^T and A A, and its time
//   over ours; null when not measured),
//   torch_ms, torch_addmm_ms (null without torch), speedup (the faster torch
//   form's time over ours), speedup_goal_met,
//   gemm_gflops + gemm_reference: fp32 rows use our fp32 GEMM (same backend,
//   the s x l x s product NS spends its time in); bf16 rows use torch's bf16
//   GEMM of that shape (bench kernels times fp32 GEMMs only); null when not
//   measured. fraction_of_gemm, gemm_goal_met; our_fp32_gemm_gflops.
nlohmann::json CompareKernels(const std::vector<CheckResult>& results);

}  // namespace canzona::bundle

#endif  // CANZONA_TESTS_GPU_BUNDLE_REPORT_KERNEL_COMPARISON_H_
