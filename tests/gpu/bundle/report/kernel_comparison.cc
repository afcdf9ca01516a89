#include "tests/gpu/bundle/report/kernel_comparison.h"

#include <algorithm>
#include <string>

namespace canzona::bundle {
namespace {

bool SameShape(const nlohmann::json& a, const nlohmann::json& b) {
  return a.value("rows", -1) == b.value("rows", -2) &&
         a.value("cols", -1) == b.value("cols", -2);
}

// Torch's row for this precision and shape, or null. A run cut at the
// runner's limit (failed) counts with the rows it wrote: torch_ns_bench.py
// writes each once it is measured.
nlohmann::json TorchRow(const std::vector<CheckResult>& results,
                        const std::string& precision,
                        const nlohmann::json& shape) {
  for (const CheckResult& r : results) {
    if (r.record.kind != "torch_ns" || r.outcome == Outcome::kSkipped) continue;
    for (const auto& row : r.figures.value("shapes", nlohmann::json::array())) {
      if (row.value("precision", "") == precision && SameShape(row, shape)) {
        return row;
      }
    }
  }
  return nullptr;
}

}  // namespace

nlohmann::json CompareKernels(const std::vector<CheckResult>& results) {
  nlohmann::json rows = nlohmann::json::array();
  for (const CheckResult& r : results) {
    if (r.record.kind != "kernels" || r.outcome != Outcome::kPassed) continue;
    const std::string precision = r.figures.value("ns_precision", "");
    for (const auto& shape :
         r.figures.value("shapes", nlohmann::json::array())) {
      const double ours_ms = 1e3 * PositiveFigure(shape, "ns_seconds");
      const double ours_gflops = PositiveFigure(shape, "ns_gflops");
      const double our_gemm = PositiveFigure(shape, "gemm_gflops");
      nlohmann::json row = {{"precision", precision},
                            {"rows", shape.value("rows", 0)},
                            {"cols", shape.value("cols", 0)},
                            {"ours_ms", ours_ms},
                            {"ours_gflops", ours_gflops},
                            {"full_products_ms", nullptr},
                            {"symmetric_speedup", nullptr},
                            {"our_fp32_gemm_gflops", our_gemm},
                            {"torch_ms", nullptr},
                            {"torch_addmm_ms", nullptr},
                            {"speedup", nullptr},
                            {"speedup_goal_met", nullptr},
                            {"gemm_gflops", nullptr},
                            {"gemm_reference", "not measured"},
                            {"fraction_of_gemm", nullptr},
                            {"gemm_goal_met", nullptr}};
      // Ours with full GEMMs for the symmetric products: what computing
      // one triangle of X X^T and A A saves (older bundles lack it).
      const double full_ms =
          1e3 * PositiveFigure(shape, "full_products_seconds");
      if (full_ms > 0 && ours_ms > 0) {
        row["full_products_ms"] = full_ms;
        row["symmetric_speedup"] = full_ms / ours_ms;
      }
      const nlohmann::json torch = TorchRow(results, precision, shape);
      const double torch_ms = PositiveFigure(torch, "ns_ms");
      const double addmm_ms = PositiveFigure(torch, "ns_addmm_ms");
      if (torch_ms > 0) row["torch_ms"] = torch_ms;
      if (addmm_ms > 0) row["torch_addmm_ms"] = addmm_ms;
      double best_torch = torch_ms;
      if (addmm_ms > 0 && (best_torch == 0 || addmm_ms < best_torch)) {
        best_torch = addmm_ms;
      }
      if (best_torch > 0 && ours_ms > 0) {
        const double speedup = best_torch / ours_ms;
        row["speedup"] = speedup;
        row["speedup_goal_met"] = speedup >= kSpeedupGoal;
      }
      double gemm = 0;
      if (precision == "fp32" && our_gemm > 0) {
        gemm = our_gemm;
        row["gemm_reference"] = "our fp32 GEMM";
      } else if (precision == "bf16" &&
                 PositiveFigure(torch, "gemm_gflops") > 0) {
        gemm = PositiveFigure(torch, "gemm_gflops");
        row["gemm_reference"] = "torch bf16 GEMM";
      }
      if (gemm > 0 && ours_gflops > 0) {
        row["gemm_gflops"] = gemm;
        row["fraction_of_gemm"] = ours_gflops / gemm;
        row["gemm_goal_met"] = ours_gflops / gemm >= kGemmFractionGoal;
      }
      rows.push_back(std::move(row));
    }
  }
  return rows;
}

}  // namespace canzona::bundle
