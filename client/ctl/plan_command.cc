// canzonactl plan: plans a model (a name in the models directory, see
// ResolveModelsDir, or a .json path) at any PP x DP x TP without running it,
// with any strategy; --compare puts all strategies side by side, --grid
// prints the planner's goal table (server/DESIGN.md section 5);
// --shard-group-size S < dp plans hierarchical sharding and compares it with
// the flat plan.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/ctl/atomic_file.h"
#include "client/ctl/commands.h"
#include "client/ctl/format_units.h"
#include "client/ctl/model_shapes.h"
#include "client/ctl/plan_report.h"
#include "client/ctl/plan_request.h"
#include "nlohmann/json.hpp"
#include "server/plan/cost_model.h"
#include "server/plan/model_config.h"
#include "server/plan/plan_json.h"
#include "server/plan/planner.h"

namespace canzona::ctl {
namespace {

using plan::Plan;
using plan::PlanRequest;
using plan::Strategy;

struct PlanOptions {
  PlanFlags plan;  // shared with simulate (plan_request.h)
  bool json = false;
  bool compare = false;
  bool grid = false;
  bool assignment = false;
  std::string html;    // --html FILE: the plan report (plan_report.h)
  std::string target;  // a daemon: show its live job `job`'s plan
  std::string job;
};

[[noreturn]] void Fail(const std::string& message) {
  throw CanzonactlExit(2, "plan: " + message);
}

template <typename T>
T OrFail(absl::StatusOr<T> value) {
  if (!value.ok()) Fail(std::string(value.status().message()));
  return *std::move(value);
}

// The request of `model` at `layout_name` and pp x dp x tp.
PlanRequest MakeRequest(const PlanOptions& o, const std::string& model,
                        const std::string& layout_name, int pp, int dp,
                        int tp) {
  return OrFail(MakePlanRequest(o.plan, model, layout_name, pp, dp, tp));
}

struct Timed {
  Plan plan;
  double ms = 0;
};

Timed RunPlan(PlanRequest req, Strategy strategy) {
  req.strategy = strategy;
  const auto start = std::chrono::steady_clock::now();
  Plan plan = OrFail(plan::BuildPlan(req));
  const auto end = std::chrono::steady_clock::now();
  return {std::move(plan),
          std::chrono::duration<double, std::milli>(end - start).count()};
}

// Prints a plan from its JSON form (plan_json.h), so a plan computed here
// and a live job's plan fetched from a daemon print the same way.
void PrintPlan(const nlohmann::json& p, const std::string& title) {
  const bool calibrated = p.value("calibrated", false);
  const char* unit = calibrated ? "s" : "flop";
  const nlohmann::json& layout = p["layout"];
  const int dp = layout["dp"].get<int>();
  const int shard_group = p.value("shard_group_size", dp);
  const bool hierarchical = shard_group > 0 && shard_group != dp;
  std::cout << title << "\n";
  if (hierarchical) {
    std::cout << absl::StrFormat(
        "  strategy %s  gpus %d per shard group (pp %d x S %d x tp %d; dp %d)"
        "  objective %s",
        p["strategy"].get<std::string>(), p["gpus"].get<int>(),
        layout["pp"].get<int>(), shard_group, layout["tp"].get<int>(), dp,
        calibrated ? "seconds (calibrated)" : "flops");
  } else {
    std::cout << absl::StrFormat(
        "  strategy %s  gpus %d (pp %d x dp %d x tp %d)  objective %s",
        p["strategy"].get<std::string>(), p["gpus"].get<int>(),
        layout["pp"].get<int>(), dp, layout["tp"].get<int>(),
        calibrated ? "seconds (calibrated)" : "flops");
  }
  if (p.contains("planning_ms")) {
    std::cout << absl::StrFormat("  planned in %.1f ms",
                                 p["planning_ms"].get<double>());
  }
  std::cout << "\n";
  if (hierarchical) {
    std::cout << absl::StrFormat(
        "  hierarchical sharding: %d shard groups of %d DP ranks (state "
        "replicated across groups); figures are per GPU of one group, dp = "
        "position in the group\n",
        dp / shard_group, shard_group);
  }
  if (p["strategy"] == "alpha") {
    std::cout << absl::StrFormat(
        "  alpha %.3g: greedy plan %s\n", p["alpha"].get<double>(),
        p["alpha_accepted"].get<bool>() ? "accepted"
                                        : "rejected (start_anchored kept)");
  }
  std::cout << absl::StrFormat("  makespan      %s %s (%.4g s)   mean %s %s\n",
                               FormatSi(p["makespan"].get<double>()), unit,
                               p["makespan_seconds"].get<double>(),
                               FormatSi(p["mean"].get<double>()), unit);
  std::cout << absl::StrFormat(
      "  LB            %s %s (binding: %s)   lower_bound %s %s (proven)\n",
      FormatSi(p["lb"].get<double>()), unit, p["lb_binding"].get<std::string>(),
      FormatSi(p["lower_bound"].get<double>()), unit);
  std::cout << absl::StrFormat(
      "  makespan/LB   %.4f   makespan/lower_bound %.4f   lower_bound/LB "
      "%.4f   max/mean %.4f\n",
      p["makespan_over_lb"].get<double>(),
      p["makespan_over_lower_bound"].get<double>(),
      p["lower_bound_over_lb"].get<double>(), p["max_over_mean"].get<double>());
  std::cout << absl::StrFormat(
      "  state memory  max %s  mean %s per GPU\n",
      FormatBytes(p["memory"]["max_bytes"].get<double>()),
      FormatBytes(p["memory"]["mean_bytes"].get<double>()));
  std::cout << "  comm per GPU per step (busiest GPU):\n";
  const nlohmann::json& comm = p["comm"];
  for (const auto& [kind, c] : comm.items()) {
    if (!c.is_object() || !c.contains("calls") ||
        c["calls"].get<int64_t>() == 0) {
      continue;
    }
    std::cout << absl::StrFormat("    %-15s %6d calls  %s", kind,
                                 c["calls"].get<int64_t>(),
                                 FormatBytes(c["bytes"].get<double>()));
    if (c["padded_bytes"].get<double>() != c["bytes"].get<double>()) {
      std::cout << absl::StrFormat(
          "  (padded %s)", FormatBytes(c["padded_bytes"].get<double>()));
    }
    std::cout << "\n";
  }
  if (hierarchical && p.contains("dp_traffic")) {
    std::cout << absl::StrFormat(
        "  DP traffic per GPU per step: intra-group %s  inter-group %s\n",
        FormatBytes(p["dp_traffic"]["intra_group_bytes"].get<double>()),
        FormatBytes(p["dp_traffic"]["inter_group_bytes"].get<double>()));
  }
  std::cout << absl::StrFormat(
      "  buckets %d   max slice imbalance (max/mean) %.4f\n",
      comm["buckets"].get<int>(),
      comm["max_bucket_slice_imbalance"].get<double>());
  const nlohmann::json& groups = p["micro_groups"];
  std::cout << absl::StrFormat(
      "  micro-groups %d (max %d per TP group)   largest group per-host load "
      "%s %s   TP pipeline %s %s\n",
      groups["count"].get<int>(), groups["max_per_tp_group"].get<int>(),
      FormatSi(groups["largest_host_load"].get<double>()), unit,
      FormatSi(groups["tp_pipeline_makespan"].get<double>()), unit);
  std::cout << "  digest " << p["digest"].get<std::string>() << "\n";
  // Per-GPU table: all of them when small, else the busiest.
  const nlohmann::json& per_gpu = p["per_gpu"];
  const char* objective = calibrated ? "seconds" : "flops";
  std::vector<size_t> order(per_gpu.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const bool all = order.size() <= 64;
  if (!all) {
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return per_gpu[a][objective].get<double>() >
             per_gpu[b][objective].get<double>();
    });
    order.resize(8);
  }
  std::cout << (all ? "  per GPU:\n" : "  busiest GPUs:\n");
  std::cout << "    stage   dp   tp        flops     seconds   state\n";
  for (size_t i : order) {
    const nlohmann::json& g = per_gpu[i];
    std::cout << absl::StrFormat(
        "    %5d %4d %4d %12s %11.4g %9s\n", g["stage"].get<int>(),
        g["dp"].get<int>(), g["tp"].get<int>(),
        FormatSi(g["flops"].get<double>()), g["seconds"].get<double>(),
        FormatBytes(g["state_bytes"].get<double>()));
  }
}

void PrintCompare(const std::vector<Timed>& plans) {
  std::cout << absl::StrFormat(
      "%-15s %12s %10s %12s %10s %12s %10s %8s %10s  %s\n", "strategy",
      "makespan", "ms/LB", "ms/lower_bd", "max/mean", "mem max", "slice imb",
      "groups", "plan ms", "digest");
  for (const Timed& t : plans) {
    const Plan& p = t.plan;
    std::cout << absl::StrFormat(
        "%-15s %12s %10.4f %12.4f %10.4f %12s %10.4f %8d %10.1f  %s\n",
        plan::StrategyName(p.strategy), FormatSi(p.makespan),
        p.makespan_over_lb(), p.makespan_over_lower_bound(), p.max_over_mean(),
        FormatBytes(p.memory_max_bytes), p.max_bucket_slice_imbalance,
        p.micro_groups.size(), t.ms, p.digest);
  }
  if (!plans.empty()) {
    const Plan& p = plans.front().plan;
    std::cout << absl::StrFormat(
        "LB %s (binding: %s), proven lower_bound %s (lower_bound/LB %.4f)\n",
        FormatSi(p.lb), p.lb_binding, FormatSi(p.lower_bound),
        p.lower_bound_over_lb());
  }
}

// Which Newton-Schulz iteration each Muon matrix gets (the cost model's
// choice, kernels/ns_algorithm.h), one line per distinct shape; a fused
// matrix's blocks count as their own matrices.
void PrintNsAlgorithms(const PlanRequest& req) {
  std::map<std::pair<std::vector<int64_t>, std::string>, int> counts;
  for (const plan::ParamSpec& p : req.parameters) {
    if (p.optimizer != plan::OptimizerKind::kMuon) continue;
    const std::vector<std::vector<int64_t>> shapes =
        p.block_shapes.empty() ? std::vector<std::vector<int64_t>>{p.shape}
                               : p.block_shapes;
    for (const std::vector<int64_t>& shape : shapes) {
      ++counts[{shape, NsAlgorithmName(req.cost_model.MuonNsAlgorithm(shape))}];
    }
  }
  if (counts.empty()) return;
  std::cout << "  Newton-Schulz per Muon matrix (ns_algorithm=auto):\n";
  for (const auto& [key, count] : counts) {
    std::cout << absl::StrFormat("    %-16s x%-5d %s\n",
                                 absl::StrJoin(key.first, "x"), count,
                                 key.second);
  }
}

// Flat vs hierarchical: the flat plan's tiers use link groups of S ranks,
// so both count the same links as fast.
nlohmann::json Comparison(const Plan& flat, const Plan& hier) {
  auto row = [](double f, double h) {
    return nlohmann::json{{"flat", f}, {"hierarchical", h}};
  };
  return {{"shard_group_size", hier.shard_group_size},
          {"state_bytes_per_gpu_max",
           row(flat.memory_max_bytes, hier.memory_max_bytes)},
          {"intra_group_bytes_per_gpu_step",
           row(flat.dp_traffic.intra_group_bytes,
               hier.dp_traffic.intra_group_bytes)},
          {"inter_group_bytes_per_gpu_step",
           row(flat.dp_traffic.inter_group_bytes,
               hier.dp_traffic.inter_group_bytes)},
          {"makespan", row(flat.makespan, hier.makespan)},
          {"max_over_mean", row(flat.max_over_mean(), hier.max_over_mean())}};
}

void PrintComparison(const Plan& flat, const Plan& hier) {
  const int S = hier.shard_group_size;
  const char* unit = hier.calibrated ? "s" : "flop";
  auto ratio = [](double f, double h) {
    return f > 0 ? absl::StrFormat("%9.3f", h / f) : std::string("        -");
  };
  std::cout << absl::StrFormat(
      "\nflat vs hierarchical (S=%d): %d groups of %d DP ranks; flat tiers "
      "use link groups of %d\n",
      S, hier.layout.dp / S, S, S);
  std::cout << absl::StrFormat("  %-38s %14s %14s %9s\n", "", "flat",
                               absl::StrCat("hier (S=", S, ")"), "hier/flat");
  auto bytes_row = [&](const char* name, double f, double h) {
    std::cout << absl::StrFormat("  %-38s %14s %14s %s\n", name, FormatBytes(f),
                                 FormatBytes(h), ratio(f, h));
  };
  bytes_row("optimizer state bytes per GPU (max)", flat.memory_max_bytes,
            hier.memory_max_bytes);
  bytes_row("intra-group bytes/GPU/step", flat.dp_traffic.intra_group_bytes,
            hier.dp_traffic.intra_group_bytes);
  bytes_row("inter-group bytes/GPU/step", flat.dp_traffic.inter_group_bytes,
            hier.dp_traffic.inter_group_bytes);
  std::cout << absl::StrFormat("  %-38s %14s %14s %s\n",
                               absl::StrCat("makespan (", unit, ")"),
                               FormatSi(flat.makespan), FormatSi(hier.makespan),
                               ratio(flat.makespan, hier.makespan));
  std::cout << absl::StrFormat(
      "  %-38s %14.4f %14.4f %s\n", "max/mean", flat.max_over_mean(),
      hier.max_over_mean(), ratio(flat.max_over_mean(), hier.max_over_mean()));
}

void RunGrid(const PlanOptions& o) {
  const std::vector<std::string> models = {"qwen3-8b", "qwen3-14b", "qwen3-32b",
                                           "qwen3-30b-a3b"};
  const std::vector<std::string> layouts = {"megatron", "hf"};
  const std::vector<std::pair<int, int>> sizes = {
      {8, 8}, {16, 4}, {32, 8}, {64, 4}, {128, 2}};
  const auto strategies = plan::AllStrategies();
  nlohmann::json rows = nlohmann::json::array();
  if (!o.json) {
    std::cout << "makespan/LB | makespan/lower_bound | max/mean per strategy\n";
    std::cout << absl::StrFormat("%-14s %-8s %4s %3s %7s", "model", "layout",
                                 "dp", "tp", "lb/LB");
    for (Strategy s : strategies) {
      std::cout << absl::StrFormat(" | %-22s", plan::StrategyName(s));
    }
    std::cout << " | cost ms\n";
  }
  for (const auto& model : models) {
    for (const auto& layout : layouts) {
      for (auto [dp, tp] : sizes) {
        PlanRequest req = MakeRequest(o, model, layout, o.plan.pp, dp, tp);
        nlohmann::json row = {{"model", model},
                              {"layout", layout},
                              {"pp", o.plan.pp},
                              {"dp", dp},
                              {"tp", tp}};
        std::string line;
        double cost_ms = 0;
        for (Strategy s : strategies) {
          Timed t = RunPlan(req, s);
          const Plan& p = t.plan;
          if (s == Strategy::kCost) cost_ms = t.ms;
          if (line.empty()) {
            line = absl::StrFormat("%-14s %-8s %4d %3d %7.4f", model, layout,
                                   dp, tp, p.lower_bound_over_lb());
            row["lower_bound_over_lb"] = p.lower_bound_over_lb();
            row["lb_binding"] = p.lb_binding;
          }
          absl::StrAppend(&line, absl::StrFormat(" | %6.3f %6.3f %7.3f",
                                                 p.makespan_over_lb(),
                                                 p.makespan_over_lower_bound(),
                                                 p.max_over_mean()));
          row[plan::StrategyName(s)] = {
              {"makespan_over_lb", p.makespan_over_lb()},
              {"makespan_over_lower_bound", p.makespan_over_lower_bound()},
              {"max_over_mean", p.max_over_mean()},
              {"digest", p.digest},
              {"planning_ms", t.ms}};
        }
        if (o.json) {
          rows.push_back(std::move(row));
        } else {
          std::cout << line << absl::StrFormat(" | %7.1f", cost_ms)
                    << std::endl;
        }
      }
    }
  }
  if (o.json) std::cout << rows.dump(2) << "\n";
}

// A live job's plan, fetched from its daemon (the same JSON the planner
// emits, computed there from the job's registration).
void RunLive(const PlanOptions& o) {
  if (o.job.empty()) Fail("--job is required with --target");
  std::unique_ptr<Client> client = ConnectOrExit(o.target);
  absl::StatusOr<canzona::v1::GetPlanResponse> response =
      client->GetPlan(o.job);
  if (!response.ok()) {
    throw CanzonactlExit(
        response.status().code() == absl::StatusCode::kNotFound ? 2 : 1,
        absl::StrCat("plan: ", response.status().message()));
  }
  nlohmann::json j = nlohmann::json::parse(response->plan_json(), nullptr,
                                           /*allow_exceptions=*/false);
  if (j.is_discarded())
    throw CanzonactlExit(1, "plan: the daemon sent bad JSON");
  if (o.json) {
    std::cout << j.dump(2) << "\n";
  } else {
    PrintPlan(j, absl::StrCat("job ", o.job, " at ", client->target()));
  }
}

// --html: the plan report (plan_report.h) of every strategy, `strategy`
// in detail; written last, so a failed command writes nothing.
void WriteReport(const PlanOptions& o, const PlanRequest& req,
                 const std::vector<Timed>& plans, Strategy strategy) {
  if (o.html.empty()) return;
  ReportInput in;
  in.title = absl::StrCat("canzonactl plan: ", o.plan.model);
  const plan::ParallelLayout& l = req.layout;
  in.context = {absl::StrFormat(
      "%s layout, pp %d x dp %d x tp %d%s, %s, %s, bucket %g elements, "
      "objective %s",
      o.plan.layout, l.pp, l.dp, l.tp,
      req.shard_group_size != 0 && req.shard_group_size != l.dp
          ? absl::StrFormat(", shard groups of %d", req.shard_group_size)
          : std::string(),
      o.plan.optimizer, o.plan.dtype, static_cast<double>(req.bucket_size),
      req.cost_model.calibrated() ? "seconds (calibrated)" : "flops")};
  in.request = &req;
  for (size_t i = 0; i < plans.size(); ++i) {
    in.strategies.push_back({&plans[i].plan, nullptr});
    if (plans[i].plan.strategy == strategy) in.detail = i;
  }
  absl::Status written = WriteFileAtomically(o.html, RenderPlanReport(in));
  if (!written.ok()) Fail(absl::StrCat("--html: ", written.message()));
}

void Run(const PlanOptions& o) {
  if (!o.target.empty() || !o.job.empty()) {
    if (o.plan.shard_group_size != 0) {
      Fail("--shard-group-size does not apply to a live job's plan");
    }
    if (!o.html.empty()) Fail("--html does not apply to a live job's plan");
    RunLive(o);
    return;
  }
  if (o.grid) {
    if (o.plan.shard_group_size != 0)
      Fail("--shard-group-size does not apply to --grid");
    if (!o.html.empty()) Fail("--html does not apply to --grid");
    RunGrid(o);
    return;
  }
  if (o.plan.model.empty())
    Fail("--model is required (a name or a .json path)");
  PlanRequest req = MakeRequest(o, o.plan.model, o.plan.layout, o.plan.pp,
                                o.plan.dp, o.plan.tp);
  const Strategy strategy = req.strategy;
  // Every strategy, for --compare and for the report's side-by-side loads.
  std::vector<Timed> plans;
  if (o.compare || !o.html.empty()) {
    const bool hierarchical =
        o.plan.shard_group_size != 0 && o.plan.shard_group_size != o.plan.dp;
    for (Strategy s : plan::AllStrategies()) {
      // sc and layerwise do not slice buckets: no hierarchical form.
      if (hierarchical && (s == Strategy::kSc || s == Strategy::kLayerwise)) {
        continue;
      }
      plans.push_back(RunPlan(req, s));
    }
  }
  if (o.compare) {
    if (o.json) {
      nlohmann::json out = nlohmann::json::array();
      for (const Timed& t : plans) {
        nlohmann::json j = plan::PlanToJson(t.plan, o.assignment);
        j["model"] = o.plan.model;
        j["layout_name"] = o.plan.layout;
        j["planning_ms"] = t.ms;
        out.push_back(std::move(j));
      }
      std::cout << out.dump(2) << "\n";
    } else {
      std::cout << absl::StrFormat("%s, layout %s, pp %d dp %d tp %d, %s\n",
                                   o.plan.model, o.plan.layout, o.plan.pp,
                                   o.plan.dp, o.plan.tp, o.plan.optimizer);
      PrintCompare(plans);
    }
    WriteReport(o, req, plans, strategy);
    return;
  }
  // The report already planned every strategy; else plan this one.
  auto planned = std::find_if(plans.begin(), plans.end(), [&](const Timed& p) {
    return p.plan.strategy == strategy;
  });
  Timed t = planned != plans.end() ? *planned : RunPlan(req, strategy);
  nlohmann::json j = plan::PlanToJson(t.plan, o.assignment);
  j["model"] = o.plan.model;
  j["layout_name"] = o.plan.layout;
  j["planning_ms"] = t.ms;
  // Hierarchical: also the flat plan, with link groups of S for its tiers.
  std::optional<Timed> flat;
  if (t.plan.hierarchical()) {
    PlanRequest flat_req = req;
    flat_req.shard_group_size = 0;
    flat_req.link_group_size = t.plan.shard_group_size;
    flat = RunPlan(flat_req, strategy);
    nlohmann::json f = plan::PlanToJson(flat->plan, o.assignment);
    f["planning_ms"] = flat->ms;
    j["flat"] = std::move(f);
    j["comparison"] = Comparison(flat->plan, t.plan);
  }
  if (o.json) {
    std::cout << j.dump(2) << "\n";
  } else {
    PrintPlan(j, absl::StrFormat("%s, layout %s, %s", o.plan.model,
                                 o.plan.layout, o.plan.optimizer));
    PrintNsAlgorithms(req);
    if (flat) PrintComparison(flat->plan, t.plan);
  }
  WriteReport(o, req, plans, strategy);
}

}  // namespace

void AddPlanCommand(CLI::App& app) {
  auto opts = std::make_shared<PlanOptions>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "Plan a model's optimizer work over PP x DP x TP GPUs");
  AddPlanFlags(cmd, &opts->plan);
  cmd->add_flag("--json", opts->json, "one JSON object (array with --compare)");
  cmd->add_flag("--compare", opts->compare, "all strategies side by side");
  cmd->add_flag("--grid", opts->grid,
                "the planner's goal table: qwen3 8b/14b/32b/30b-a3b x "
                "layouts x (dp,tp) grid, all strategies");
  cmd->add_flag("--assignment", opts->assignment,
                "with --json: include each parameter's (dp, tp)");
  cmd->add_option("--html", opts->html,
                  "also write the plan report: one self-contained HTML file "
                  "(every strategy's per-GPU loads, the bucket cuts, the "
                  "micro-groups, memory per GPU)");
  AddConnectFlags(cmd);
  cmd->add_option("--target", opts->target,
                  "a daemon's address: show the live plan of --job there");
  cmd->add_option("--job", opts->job, "the live job (with --target)");
  cmd->callback([opts] { Run(*opts); });
}

}  // namespace canzona::ctl
