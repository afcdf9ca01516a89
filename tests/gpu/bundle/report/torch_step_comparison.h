// canzona.torch's opt.step() and whole training iteration against
// torch.optim.Muon + AdamW on the same GPU and model (the torch-step-bench
// check, tests/gpu/torch_step_bench.py): its rows with the ratios, and the
// goals of issue 30 judged on them (tests/gpu/bundle/README.md).
//
//   nlohmann::json bench = CompareTorchSteps(results);
//   if (!bench.is_null()) ... bench["rows"], bench["goals"] ...
//
// Thread-safety: a function of its arguments.
#ifndef CANZONA_TESTS_GPU_BUNDLE_REPORT_TORCH_STEP_COMPARISON_H_
#define CANZONA_TESTS_GPU_BUNDLE_REPORT_TORCH_STEP_COMPARISON_H_

#include <vector>

#include "nlohmann/json.hpp"
#include "tests/gpu/bundle/report/check_result.h"

namespace canzona::bundle {

// One goal: torch's time over ours for `measure` ("step" or "iteration")
// at `size`, at least `ratio`; judged for each model dtype.
struct TorchStepGoal {
  const char* measure;
  const char* size;
  double ratio;
};

inline constexpr TorchStepGoal kTorchStepGoals[] = {
    {"step", "0.6b", 3.0},
    {"step", "8b", 1.5},
    {"iteration", "0.6b", 1.5},
};
inline constexpr const char* kTorchStepDtypes[] = {"fp32", "bf16"};

// Null when no torch_step_bench check is among the results; otherwise
//   {check, status, reason, device, torch, reference, settings,
//    rows[{size, dtype, params, canzona_step_ms, torch_step_ms, step_ratio,
//          canzona_iteration_ms, torch_iteration_ms, iteration_ratio,
//          shapes_overridden, status (measured / skipped / failed),
//          reason}],
//    goals[{measure, size, dtype, target, ratio, status (met / not met /
//           not measured), reason}]}
// with each ratio torch's median over ours (> 1: ours faster), computed
// here from the medians (null unless both are positive). A goal is not
// measured when its row is missing, skipped or failed, or ran with the
// shapes overridden (a smoke run).
nlohmann::json CompareTorchSteps(const std::vector<CheckResult>& results);

}  // namespace canzona::bundle

#endif  // CANZONA_TESTS_GPU_BUNDLE_REPORT_TORCH_STEP_COMPARISON_H_
