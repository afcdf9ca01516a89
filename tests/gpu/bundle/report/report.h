// The bundle's report: everything the runner left in a report directory
// (env.txt, checks/*.rec, the checks' logs and JSON) folded into one JSON
// document, and that document as Markdown (report.json, report.md).
//
//   CANZONA_ASSIGN_OR_RETURN(nlohmann::json report, BuildReport(dir));
//   std::string markdown = RenderMarkdown(report);
//
// report.json: {schema, bundle{}, machine{}, gpu{}, run{}, cuda_libraries[],
// checks[{name, group, kind, status, reason, duration_s, limit_s, command,
// log, data, figures}], summary{passed, failed, skipped, total},
// newton_schulz[] (kernel_comparison.h), torch_step_bench{} (null without
// that check; torch_step_comparison.h)}. env.txt keys bundle_*, machine_*,
// gpu_*, run_* land in the object of that prefix; cudalib.<soname>.<field>
// in cuda_libraries.
//
// Thread-safety: functions of their arguments (BuildReport reads files).
#ifndef CANZONA_TESTS_GPU_BUNDLE_REPORT_REPORT_H_
#define CANZONA_TESTS_GPU_BUNDLE_REPORT_REPORT_H_

#include <filesystem>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace canzona::bundle {

absl::StatusOr<nlohmann::json> BuildReport(
    const std::filesystem::path& report_dir);

std::string RenderMarkdown(const nlohmann::json& report);

}  // namespace canzona::bundle

#endif  // CANZONA_TESTS_GPU_BUNDLE_REPORT_REPORT_H_
