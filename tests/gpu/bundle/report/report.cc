#include "tests/gpu/bundle/report/report.h"

#include <map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "kernels/base/status_macros.h"
#include "tests/gpu/bundle/report/check_record.h"
#include "tests/gpu/bundle/report/check_result.h"
#include "tests/gpu/bundle/report/kernel_comparison.h"
#include "tests/gpu/bundle/report/torch_step_comparison.h"

namespace canzona::bundle {
namespace {

constexpr const char* kSections[] = {"bundle", "machine", "gpu", "run"};

// env.txt's flat keys, grouped by prefix.
nlohmann::json GroupEnvironment(const KeyValues& env) {
  nlohmann::json out = nlohmann::json::object();
  for (const char* section : kSections) out[section] = nlohmann::json::object();
  std::map<std::string, nlohmann::json> libraries;
  for (const auto& [key, value] : env) {
    if (absl::StartsWith(key, "cudalib.")) {
      // cudalib.<soname>.<field>; sonames contain dots, fields do not.
      const size_t dot = key.rfind('.');
      if (dot <= 8) continue;
      const std::string soname = key.substr(8, dot - 8);
      libraries[soname]["soname"] = soname;
      libraries[soname][key.substr(dot + 1)] = value;
      continue;
    }
    for (const char* section : kSections) {
      const std::string prefix = std::string(section) + "_";
      if (absl::StartsWith(key, prefix) && key.size() > prefix.size()) {
        out[section][key.substr(prefix.size())] = value;
      }
    }
  }
  out["cuda_libraries"] = nlohmann::json::array();
  for (auto& [soname, library] : libraries) {
    out["cuda_libraries"].push_back(std::move(library));
  }
  // "1" / "0" from the shell, a boolean in the report.
  out["gpu"]["present"] = out["gpu"].value("present", "0") == "1";
  return out;
}

}  // namespace

absl::StatusOr<nlohmann::json> BuildReport(
    const std::filesystem::path& report_dir) {
  KeyValues env;
  if (std::filesystem::exists(report_dir / "env.txt")) {
    CANZONA_ASSIGN_OR_RETURN(env, ReadKeyValues(report_dir / "env.txt"));
  }
  CANZONA_ASSIGN_OR_RETURN(std::vector<CheckRecord> records,
                           ReadCheckRecords(report_dir));
  nlohmann::json report = GroupEnvironment(env);
  report["schema"] = 1;
  std::vector<CheckResult> results;
  int passed = 0, failed = 0, skipped = 0;
  report["checks"] = nlohmann::json::array();
  for (const CheckRecord& record : records) {
    CheckResult result = EvaluateCheck(record, report_dir);
    switch (result.outcome) {
      case Outcome::kPassed:
        ++passed;
        break;
      case Outcome::kFailed:
        ++failed;
        break;
      case Outcome::kSkipped:
        ++skipped;
        break;
    }
    report["checks"].push_back({{"name", record.name},
                                {"group", record.group},
                                {"kind", record.kind},
                                {"status", OutcomeName(result.outcome)},
                                {"reason", result.reason},
                                {"duration_s", record.duration_s},
                                {"limit_s", record.limit_s},
                                {"command", record.command},
                                {"log", record.log},
                                {"data", record.data},
                                {"figures", result.figures}});
    results.push_back(std::move(result));
  }
  report["summary"] = {{"passed", passed},
                       {"failed", failed},
                       {"skipped", skipped},
                       {"total", passed + failed + skipped}};
  report["newton_schulz"] = CompareKernels(results);
  for (const TorchStepBench& bench :
       {kNcclTorchStepBench, kGlooTorchStepBench}) {
    report[bench.key] = CompareTorchSteps(results, bench);
  }
  return report;
}

}  // namespace canzona::bundle
