#include "tests/gpu/bundle/report/torch_step_comparison.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace canzona::bundle {
namespace {

using nlohmann::json;

// torch's median over ours, or null.
json Ratio(const json& row, const char* ours_key, const char* torch_key) {
  const double ours = PositiveFigure(row, ours_key);
  const double torch = PositiveFigure(row, torch_key);
  if (ours == 0 || torch == 0) return nullptr;
  return torch / ours;
}

json Row(const json& in) {
  json row = {{"size", in.value("size", "")},
              {"dtype", in.value("dtype", "")},
              {"params", nullptr},
              {"canzona_step_ms", nullptr},
              {"torch_step_ms", nullptr},
              {"step_ratio", Ratio(in, "canzona_step_ms", "torch_step_ms")},
              {"canzona_iteration_ms", nullptr},
              {"torch_iteration_ms", nullptr},
              {"iteration_ratio",
               Ratio(in, "canzona_iteration_ms", "torch_iteration_ms")},
              {"shapes_overridden", in.value("shapes_overridden", false)},
              {"status", in.value("status", "failed")},
              {"reason", in.value("reason", "")}};
  if (in.contains("params") && in["params"].is_number_integer()) {
    row["params"] = in["params"];
  }
  // The daemon's own view of our step (StepResponse: ms per phase, host
  // round trips), where the bench recorded it.
  if (in.contains("canzona_daemon") && in["canzona_daemon"].is_object()) {
    row["canzona_daemon"] = in["canzona_daemon"];
  }
  // Milliseconds as doubles, whatever the JSON spelled (3 or 3.0).
  for (const char* key : {"canzona_step_ms", "torch_step_ms",
                          "canzona_iteration_ms", "torch_iteration_ms"}) {
    if (in.contains(key) && in[key].is_number()) {
      row[key] = in[key].get<double>();
    }
  }
  return row;
}

// Why a goal met stays unverified: the torch-check (the same updates
// compared with torch's on the GPU) failed; "" otherwise.
std::string UnverifiedReason(const std::vector<CheckResult>& results) {
  for (const CheckResult& r : results) {
    if (r.record.kind == "torch_check" && r.outcome == Outcome::kFailed) {
      return absl::StrCat(r.record.name, " failed: ", r.reason);
    }
  }
  return "";
}

json JudgeGoal(const TorchStepGoal& goal, const char* dtype, const json& rows,
               const std::string& check_reason, const std::string& unverified) {
  json out = {{"measure", goal.measure},
              {"size", goal.size},
              {"dtype", dtype},
              {"target", goal.ratio},
              {"ratio", nullptr},
              {"status", "not measured"},
              {"reason", ""}};
  const std::string ratio_key = absl::StrCat(goal.measure, "_ratio");
  for (const json& row : rows) {
    if (row["size"] != goal.size || row["dtype"] != dtype) continue;
    if (row["shapes_overridden"].get<bool>()) {
      out["reason"] = "shapes overridden (--tiny / --layers): not the size's";
      return out;
    }
    if (row["status"] != "measured" || row[ratio_key].is_null()) {
      out["reason"] = absl::StrCat(row["status"].get<std::string>(), ": ",
                                   row["reason"].get<std::string>());
      return out;
    }
    const double ratio = row[ratio_key].get<double>();
    out["ratio"] = ratio;
    out["status"] = ratio >= goal.ratio ? "met" : "not met";
    if (ratio >= goal.ratio && !unverified.empty()) {
      // Fast and wrong is no goal met.
      out["status"] = "met, unverified";
      out["reason"] = unverified;
    }
    return out;
  }
  out["reason"] =
      check_reason.empty() ? std::string("no row for this size") : check_reason;
  return out;
}

}  // namespace

json CompareTorchSteps(const std::vector<CheckResult>& results,
                       const TorchStepBench& which) {
  for (const CheckResult& r : results) {
    if (r.record.kind != "torch_step_bench" || r.record.name != which.check) {
      continue;
    }
    const json& f = r.figures;
    json bench = {{"check", r.record.name},
                  {"plane", which.plane},
                  {"status", OutcomeName(r.outcome)},
                  {"reason", r.reason},
                  {"device", f.value("device", "")},
                  {"torch", f.value("torch", "")},
                  {"reference", f.value("reference", "")},
                  {"settings", f.value("settings", json::object())},
                  {"rows", json::array()},
                  {"goals", json::array()}};
    for (const json& row : f.value("rows", json::array())) {
      if (row.is_object()) bench["rows"].push_back(Row(row));
    }
    // Without rows the check's own reason says why nothing was measured.
    const std::string check_reason =
        bench["rows"].empty()
            ? absl::StrCat("check ", OutcomeName(r.outcome), ": ", r.reason)
            : "";
    const std::string unverified = UnverifiedReason(results);
    for (const TorchStepGoal& goal : which.goals) {
      for (const char* dtype : kTorchStepDtypes) {
        bench["goals"].push_back(
            JudgeGoal(goal, dtype, bench["rows"], check_reason, unverified));
      }
    }
    return bench;
  }
  return nullptr;
}

}  // namespace canzona::bundle
