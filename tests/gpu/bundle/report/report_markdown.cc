// RenderMarkdown (report.h): report.json as report.md, the part a person
// reads first: the summary, the machine and GPU, the CUDA libraries found,
// every check, then the figures (Newton-Schulz vs torch and GEMM, the step
// benchmarks, the PyTorch check, the optimizer step vs torch's with its
// goals).
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "tests/gpu/bundle/report/kernel_comparison.h"
#include "tests/gpu/bundle/report/report.h"
#include "tests/gpu/bundle/report/torch_step_comparison.h"

namespace canzona::bundle {
namespace {

using nlohmann::json;

// A table cell: pipes and newlines would break the row.
std::string Cell(const std::string& text) {
  return absl::StrReplaceAll(text, {{"|", "\\|"}, {"\n", " "}});
}

std::string Cell(const json& value, int digits = 2) {
  if (value.is_null()) return "–";
  if (value.is_boolean()) return value.get<bool>() ? "yes" : "no";
  if (value.is_number_integer()) return absl::StrCat(value.get<int64_t>());
  if (value.is_number())
    return absl::StrFormat("%.*f", digits, value.get<double>());
  if (value.is_string()) return Cell(value.get<std::string>());
  return Cell(value.dump());
}

std::string Get(const json& object, const char* key) {
  if (!object.is_object() || !object.contains(key)) return "–";
  return Cell(object[key]);
}

std::string Goal(const json& met) {
  if (met.is_null()) return "";
  return met.get<bool>() ? " (met)" : " (not met)";
}

void Section(std::string& md, absl::string_view title) {
  absl::StrAppend(&md, "\n## ", title, "\n\n");
}

void KeyValueTable(std::string& md, const json& object) {
  md += "| | |\n|---|---|\n";
  for (const auto& [key, value] : object.items()) {
    absl::StrAppend(&md, "| ", key, " | ", Cell(value), " |\n");
  }
}

void RenderGpu(std::string& md, const json& report) {
  const json& gpu = report["gpu"];
  Section(md, "GPU");
  if (!gpu.value("present", false)) {
    absl::StrAppend(&md, "No GPU: ", Get(gpu, "reason"),
                    ". GPU checks are marked skipped; no GPU figure is "
                    "claimed from this run.\n");
    return;
  }
  KeyValueTable(md, gpu);
}

void RenderLibraries(std::string& md, const json& report) {
  Section(md, "CUDA libraries");
  const json& libraries = report["cuda_libraries"];
  if (libraries.empty()) {
    md += "None recorded.\n";
    return;
  }
  md += "| library | found at | version | how |\n|---|---|---|---|\n";
  for (const json& lib : libraries) {
    absl::StrAppend(&md, "| ", Get(lib, "soname"), " | ", Get(lib, "path"),
                    " | ", Get(lib, "version"), " | ", Get(lib, "source"),
                    " |\n");
  }
}

void RenderChecks(std::string& md, const json& report) {
  Section(md, "Checks");
  md += "| # | check | status | s | detail |\n|---|---|---|---|---|\n";
  int index = 0;
  for (const json& check : report["checks"]) {
    absl::StrAppend(&md, "| ", ++index, " | ", Get(check, "name"), " | **",
                    Get(check, "status"), "** | ", Cell(check["duration_s"], 1),
                    " | ", Get(check, "reason"), " |\n");
  }
}

void RenderNewtonSchulz(std::string& md, const json& report) {
  const json& rows = report["newton_schulz"];
  if (rows.empty()) return;
  Section(md, "Newton-Schulz (5 steps) vs torch NS5 and the GEMM rate");
  absl::StrAppend(
      &md, "Goals: speedup >= ", absl::StrFormat("%.1f", kSpeedupGoal),
      "x over the faster torch form (default or addmm), and >= ",
      static_cast<int>(kGemmFractionGoal * 100),
      "% of the GEMM rate of the same GPU and shape (s x l x s). Times are "
      "medians. \"full\" is ours with full GEMMs for the symmetric products "
      "X X^T and A A (one triangle each otherwise), in the same run.\n\n");
  md +=
      "| precision | shape | ours ms | full ms | full/ours | torch ms | "
      "torch addmm ms | speedup | ours GFLOP/s | GEMM GFLOP/s (reference) | "
      "of GEMM |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const json& r : rows) {
    const json full = r.value("full_products_ms", json());
    const json saving = r.value("symmetric_speedup", json());
    absl::StrAppend(
        &md, "| ", Get(r, "precision"), " | ", Cell(r["rows"]), "x",
        Cell(r["cols"]), " | ", Cell(r["ours_ms"], 3), " | ", Cell(full, 3),
        " | ", saving.is_null() ? "–" : Cell(saving) + "x", " | ",
        Cell(r["torch_ms"], 3), " | ", Cell(r["torch_addmm_ms"], 3), " | ",
        r["speedup"].is_null() ? "–" : Cell(r["speedup"]) + "x",
        Goal(r["speedup_goal_met"]), " | ", Cell(r["ours_gflops"], 0), " | ",
        Cell(r["gemm_gflops"], 0), " (", Get(r, "gemm_reference"), ") | ",
        r["fraction_of_gemm"].is_null()
            ? "–"
            : absl::StrFormat("%.0f%%",
                              100 * r["fraction_of_gemm"].get<double>()),
        Goal(r["gemm_goal_met"]), " |\n");
  }
}

void RenderSteps(std::string& md, const json& report) {
  std::string table;
  for (const json& check : report["checks"]) {
    if (check.value("kind", "") != "step" ||
        check.value("status", "") != "passed") {
      continue;
    }
    const json& f = check["figures"];
    for (const json& mode : f.value("modes", json::array())) {
      absl::StrAppend(&table, "| ", Get(check, "name"), " | DP", Cell(f["dp"]),
                      " x TP", Cell(f["tp"]), " | ", Get(mode, "mode"), " | ",
                      Cell(mode["median_iteration_ms"]), " | ",
                      Cell(mode["median_step_ms"]), " | ",
                      Cell(mode["dp_comm_ms_per_step"]), " | ",
                      Cell(mode["exposed_over_total_comm"]), " | ",
                      Get(mode, "median_host_waits"), " | ",
                      Get(mode, "pageable_copies"), " |\n");
    }
  }
  if (table.empty()) return;
  Section(md, "Step benchmarks (canzonactl bench step)");
  md +=
      "| check | layout | mode | iteration ms | step ms | DP comm ms | "
      "exposed / total | host round trips | pageable copies |\n"
      "|---|---|---|---|---|---|---|---|---|\n";
  md += table;
}

void RenderTorchCheck(std::string& md, const json& report) {
  for (const json& check : report["checks"]) {
    if (check.value("kind", "") != "torch_check") continue;
    const json& f = check["figures"];
    if (!f.contains("variants")) continue;
    Section(md, "PyTorch check: canzona.torch vs torch.optim.Muon + AdamW");
    if (f.contains("settings")) {
      absl::StrAppend(&md, "Settings (both sides): `",
                      Cell(f["settings"].dump()), "`\n\n");
    }
    md +=
        "| variant | steps | status | matrix update rel. err (tol) | "
        "vector update rel. err (tol) | loss first -> last | canzona step "
        "ms | torch step ms |\n|---|---|---|---|---|---|---|---|\n";
    for (const json& v : f["variants"]) {
      absl::StrAppend(&md, "| ", Get(v, "name"), " | ", Get(v, "steps"), " | ",
                      Get(v, "status"), " | ", Cell(v["matrix_max_rel_err"], 5),
                      " (", Cell(v["matrix_tolerance"], 5), ") | ",
                      Cell(v["vector_max_rel_err"], 7), " (",
                      Cell(v["vector_tolerance"], 7), ") | ",
                      Cell(v["loss_first"], 4), " -> ", Cell(v["loss_last"], 4),
                      " | ", Cell(v["canzona_step_ms"], 3), " | ",
                      Cell(v["torch_step_ms"], 3), " |\n");
    }
    for (const json& v : f["variants"]) {
      if (Get(v, "name") != "bf16params") continue;
      md +=
          "\nbf16params: bf16 parameters (fp32 masters in the daemon); its "
          "errors are the parameters' against torch's own fp32 masters "
          "rounded to bf16, not the updates'.\n";
      break;
    }
  }
}

std::string Ratio(const json& ratio) {
  return ratio.is_null() ? "–" : Cell(ratio) + "x";
}

// Where our step went as the daemon saw it: per row, the phases over
// 0.05 ms and the host round trips (StepResponse, medians).
void RenderDaemonBreakdown(std::string& md, const json& rows) {
  bool any = false;
  for (const json& r : rows) {
    if (!r.contains("canzona_daemon")) continue;
    const json& d = r["canzona_daemon"];
    if (!any) md += "Our step inside the daemon (median ms per phase):\n\n";
    any = true;
    absl::StrAppend(&md, "- ", Get(r, "size"), " ", Get(r, "dtype"), ":");
    if (d.contains("phases_ms") && d["phases_ms"].is_object()) {
      for (const auto& [phase, ms] : d["phases_ms"].items()) {
        if (!ms.is_number() || ms.get<double>() < 0.05) continue;
        absl::StrAppend(&md, " ", phase, " ",
                        absl::StrFormat("%.2f", ms.get<double>()));
      }
    }
    if (d.contains("host_waits") && d["host_waits"].is_number()) {
      absl::StrAppend(&md, "; host round trips ",
                      absl::StrFormat("%.0f", d["host_waits"].get<double>()));
    }
    if (d.contains("pageable_copies") && d["pageable_copies"].is_number()) {
      absl::StrAppend(
          &md, "; pageable copies ",
          absl::StrFormat("%.0f", d["pageable_copies"].get<double>()));
    }
    md += "\n";
  }
  if (any) md += "\n";
}

void RenderTorchStepBench(std::string& md, const json& report,
                          const char* key) {
  if (!report.contains(key)) return;
  const json& bench = report[key];
  if (bench.is_null()) return;
  Section(md, absl::StrCat("Optimizer step (", Get(bench, "plane"),
                           "): canzona.torch vs torch.optim.Muon + AdamW"));
  const std::string device = bench.value("device", "");
  absl::StrAppend(
      &md, "On **", device.empty() ? "–" : Cell(device), "** (torch ",
      Get(bench, "torch"), "; ", Get(bench, "reference"),
      "), one side after the other on the same model. Medians over the "
      "timed iterations, the device synchronized; ratio = torch's time over "
      "ours (> 1: ours faster). fp32 master weights on both sides for bf16 "
      "models. Sizes: 100m (8 layers, hidden 1024), 0.6b and 8b (Qwen3-0.6B "
      "and Qwen3-8B shapes, untied embeddings).\n\n");
  if (bench["rows"].empty()) {
    absl::StrAppend(&md, "Nothing measured: ", Get(bench, "status"), " (",
                    Get(bench, "reason"), ").\n\n");
  } else {
    md +=
        "| size | dtype | params | ours step ms | torch step ms | step ratio "
        "| ours iteration ms | torch iteration ms | iteration ratio | status "
        "|\n|---|---|---|---|---|---|---|---|---|---|\n";
    for (const json& r : bench["rows"]) {
      const std::string params =
          r["params"].is_number()
              ? absl::StrFormat("%.1f M", r["params"].get<double>() / 1e6)
              : "–";
      std::string status = Get(r, "status");
      if (r["shapes_overridden"].get<bool>()) status += " (shapes overridden)";
      if (!r.value("reason", "").empty()) {
        absl::StrAppend(&status, ": ", Get(r, "reason"));
      }
      absl::StrAppend(&md, "| ", Get(r, "size"), " | ", Get(r, "dtype"), " | ",
                      params, " | ", Cell(r["canzona_step_ms"], 3), " | ",
                      Cell(r["torch_step_ms"], 3), " | ",
                      Ratio(r["step_ratio"]), " | ",
                      Cell(r["canzona_iteration_ms"], 3), " | ",
                      Cell(r["torch_iteration_ms"], 3), " | ",
                      Ratio(r["iteration_ratio"]), " | ", status, " |\n");
    }
    md += "\n";
    RenderDaemonBreakdown(md, bench["rows"]);
  }
  md += "Goals (issue 30):\n\n";
  for (const json& g : bench["goals"]) {
    const double target = g["target"].get<double>();
    const std::string wanted =
        target >= 1 ? absl::StrFormat(" >= %.1fx faster than torch", target)
                    : absl::StrFormat(" within %.1fx of torch", 1 / target);
    absl::StrAppend(&md, "- ", Get(g, "measure"), wanted, " at ",
                    Get(g, "size"), ", ", Get(g, "dtype"), ": **",
                    Get(g, "status"), "**");
    if (!g["ratio"].is_null()) {
      absl::StrAppend(&md, " (", Ratio(g["ratio"]),
                      g.value("reason", "").empty() ? "" : "; ",
                      g.value("reason", ""), ")");
    } else if (!g.value("reason", "").empty()) {
      absl::StrAppend(&md, " (", Get(g, "reason"), ")");
    }
    md += "\n";
  }
}

// One line under the summary, since a cut output shows the top: how the
// goals stand (each section below has them one by one).
void RenderGoalsLine(std::string& md, const json& report) {
  int met = 0, not_met = 0, not_measured = 0, unverified = 0;
  for (const TorchStepBench& bench :
       {kNcclTorchStepBench, kGlooTorchStepBench}) {
    if (!report.contains(bench.key) || report[bench.key].is_null()) continue;
    for (const json& g : report[bench.key]["goals"]) {
      const std::string status = g.value("status", "");
      if (status == "met") {
        ++met;
      } else if (status == "not met") {
        ++not_met;
      } else if (status == "met, unverified") {
        ++unverified;
      } else {
        ++not_measured;
      }
    }
  }
  int ns_met = 0, ns_judged = 0;
  if (report.contains("newton_schulz") && report["newton_schulz"].is_array()) {
    for (const json& r : report["newton_schulz"]) {
      for (const char* key : {"speedup_goal_met", "gemm_goal_met"}) {
        if (!r.contains(key) || r[key].is_null()) continue;
        ++ns_judged;
        if (r[key].get<bool>()) ++ns_met;
      }
    }
  }
  const int step_goals = met + not_met + not_measured + unverified;
  if (step_goals + ns_judged == 0) return;
  md += "\n**Goals:**";
  if (step_goals > 0) {
    absl::StrAppend(&md, " optimizer step ", met, " met, ", not_met,
                    " not met, ", not_measured, " not measured");
    if (unverified > 0) {
      absl::StrAppend(&md, ", ", unverified,
                      " met but unverified (torch-check failed)");
    }
  }
  if (ns_judged > 0) {
    absl::StrAppend(&md, step_goals > 0 ? ";" : "", " Newton-Schulz ", ns_met,
                    " of ", ns_judged, " shape goals met");
  }
  md += ".\n";
}

}  // namespace

std::string RenderMarkdown(const json& report) {
  std::string md = "# Canzona GPU bundle report\n\n";
  const json& bundle = report["bundle"];
  const json& run = report["run"];
  absl::StrAppend(&md, "Bundle ", Get(bundle, "version"), " (commit ",
                  Get(bundle, "commit"), ", built ", Get(bundle, "built"),
                  "); run started ", Get(run, "started_at"), ", took ",
                  Get(run, "elapsed_s"), " s of a ", Get(run, "budget_s"),
                  " s budget.\n\n");
  const json& s = report["summary"];
  absl::StrAppend(&md, "**", Cell(s["passed"]), " passed, ", Cell(s["failed"]),
                  " failed, ", Cell(s["skipped"]), " skipped** of ",
                  Cell(s["total"]), " checks.\n");
  RenderGoalsLine(md, report);
  if (run.contains("warning")) {
    absl::StrAppend(&md, "\n**Warning:** ", Get(run, "warning"), "\n");
  }
  if (run.contains("cuda_missing")) {
    absl::StrAppend(&md,
                    "\nCUDA libraries not found here (the bundle's "
                    "stand-ins were used): ",
                    Get(run, "cuda_missing"), "\n");
  }
  Section(md, "Machine");
  KeyValueTable(md, report["machine"]);
  RenderGpu(md, report);
  RenderLibraries(md, report);
  RenderChecks(md, report);
  RenderNewtonSchulz(md, report);
  RenderSteps(md, report);
  RenderTorchCheck(md, report);
  for (const TorchStepBench& bench :
       {kNcclTorchStepBench, kGlooTorchStepBench}) {
    RenderTorchStepBench(md, report, bench.key);
  }
  md +=
      "\nLogs: `logs/`; each check's JSON output: `data/`; the runner's "
      "own log: `runner.log`.\n";
  return md;
}

}  // namespace canzona::bundle
