// canzona.torch's opt.step() and whole training iteration against
// torch.optim.Muon + AdamW on the same GPU and model (the torch-step-bench
// checks, tests/gpu/torch_step_bench.py, one per data plane): their rows
// with the ratios, and the goals of issue 30 judged on them
// (tests/gpu/bundle/README.md).
//
//   nlohmann::json bench =
//       CompareTorchSteps(results, kNcclTorchStepBench);
//   if (!bench.is_null()) ... bench["rows"], bench["goals"] ...
//
// Thread-safety: a function of its arguments.
#ifndef CANZONA_TESTS_GPU_BUNDLE_REPORT_TORCH_STEP_COMPARISON_H_
#define CANZONA_TESTS_GPU_BUNDLE_REPORT_TORCH_STEP_COMPARISON_H_

#include <vector>

#include "absl/types/span.h"
#include "nlohmann/json.hpp"
#include "tests/gpu/bundle/report/check_result.h"

namespace canzona::bundle {

// One goal: torch's time over ours for `measure` ("step" or "iteration")
// at `size`, at least `ratio` (below 1: ours within 1 / ratio of torch's);
// judged for each model dtype.
struct TorchStepGoal {
  const char* measure;
  const char* size;
  double ratio;
};

// One torch-step-bench check: its name in run.sh, its key in report.json,
// what it runs on, and its goals.
struct TorchStepBench {
  const char* check;
  const char* key;
  const char* plane;
  absl::Span<const TorchStepGoal> goals;
};

// The NCCL plane at DP1 (the daemon's step resident on the GPU).
inline constexpr TorchStepGoal kNcclTorchStepGoals[] = {
    {"step", "0.6b", 3.0},
    {"step", "8b", 1.5},
    {"iteration", "0.6b", 1.5},
};
// The Gloo plane with CUDA tensors (host staging; how several ranks share
// a GPU): the step within 3x of torch's at ~100 M parameters.
inline constexpr TorchStepGoal kGlooTorchStepGoals[] = {
    {"step", "100m", 1.0 / 3.0},
};
inline constexpr TorchStepBench kNcclTorchStepBench = {
    "torch-step-bench", "torch_step_bench", "--comm nccl, DP1",
    kNcclTorchStepGoals};
inline constexpr TorchStepBench kGlooTorchStepBench = {
    "torch-step-bench-gloo", "torch_step_bench_gloo",
    "--backend cuda --comm gloo, DP1", kGlooTorchStepGoals};
inline constexpr const char* kTorchStepDtypes[] = {"fp32", "bf16"};

// Null when `bench`'s check is not among the results; otherwise
//   {check, plane, status, reason, device, torch, reference, settings,
//    rows[{size, dtype, params, canzona_step_ms, torch_step_ms, step_ratio,
//          canzona_iteration_ms, torch_iteration_ms, iteration_ratio,
//          shapes_overridden, status (measured / skipped / failed),
//          reason}],
//    goals[{measure, size, dtype, target, ratio, status (met / not met /
//           not measured / met, unverified), reason}]}
// with each ratio torch's median over ours (> 1: ours faster), computed
// here from the medians (null unless both are positive). A goal is not
// measured when its row is missing, skipped or failed, or ran with the
// shapes overridden (a smoke run); one met is unverified where a
// torch_check check (the updates against torch's) failed.
nlohmann::json CompareTorchSteps(const std::vector<CheckResult>& results,
                                 const TorchStepBench& bench);

}  // namespace canzona::bundle

#endif  // CANZONA_TESTS_GPU_BUNDLE_REPORT_TORCH_STEP_COMPARISON_H_
