// A check's outcome (passed / failed / skipped, with the reason) and its
// figures, read from what it left in the report directory: its JSON output
// (gtest's --gtest_output=json, canzonactl's --json, the torch scripts') and
// its log.
//
//   CheckResult result = EvaluateCheck(record, report_dir);
//   if (result.outcome == Outcome::kFailed) ... result.reason ...
//
// Thread-safety: functions of their arguments (they read files).
#ifndef CANZONA_TESTS_GPU_BUNDLE_REPORT_CHECK_RESULT_H_
#define CANZONA_TESTS_GPU_BUNDLE_REPORT_CHECK_RESULT_H_

#include <filesystem>
#include <string>

#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "tests/gpu/bundle/report/check_record.h"

namespace canzona::bundle {

enum class Outcome { kPassed, kFailed, kSkipped };

// "passed", "failed", "skipped".
absl::string_view OutcomeName(Outcome outcome);

struct CheckResult {
  CheckRecord record;
  Outcome outcome = Outcome::kFailed;
  // Failed or skipped: why. Passed: a note ("3 skipped") or empty.
  std::string reason;
  // Per kind: gtest {tests, passed, failed, skipped, failed_tests,
  // skip_reasons}; kernels, step, torch_ns, torch_check, torch_step_bench:
  // their JSON output
  // (step: the modes' medians); trainer {first_loss, last_loss, steps}.
  nlohmann::json figures = nlohmann::json::object();
};

CheckResult EvaluateCheck(const CheckRecord& record,
                          const std::filesystem::path& report_dir);

// A figure row's number under `key` when it is positive, else 0 (absent,
// not a number, or not measured): the comparisons' ratios skip zeros.
double PositiveFigure(const nlohmann::json& row, const char* key);

}  // namespace canzona::bundle

#endif  // CANZONA_TESTS_GPU_BUNDLE_REPORT_CHECK_RESULT_H_
