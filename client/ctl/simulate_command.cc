// canzonactl simulate: a job's optimizer step on paper. Plans the model
// with every strategy (as `canzonactl plan --compare`, the daemons' own
// planner) and runs each plan through the step simulator
// (server/plan/sim/step_simulator.h) on a hardware profile: the phases per
// GPU and of the slowest, per-root vs padded per bucket, the TP pipeline,
// and with --overlap what the trainer still waits for.
//
//   canzonactl simulate --model qwen3-32b --dp 32 --tp 8 --profile h100-node
//       [--strategy cost] [--dtype bf16] [--forward-ms F --backward-ms B]
//       [--overlap] [--layers N --vocab V] [--rates rates.json] [--json]
//       [--html FILE]
// --rates (a `bench kernels --rates-out` file) plans in seconds, as
// `plan --rates` does, and times the updates at those rates instead of the
// profile's.
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/ctl/atomic_file.h"
#include "client/ctl/commands.h"
#include "client/ctl/format_units.h"
#include "client/ctl/model_shapes.h"
#include "client/ctl/plan_report.h"
#include "client/ctl/plan_request.h"
#include "nlohmann/json.hpp"
#include "server/plan/plan_json.h"
#include "server/plan/sim/hardware_profile.h"
#include "server/plan/sim/simulation_json.h"
#include "server/plan/sim/step_simulator.h"

namespace canzona::ctl {
namespace {

namespace sim = plan::sim;

struct SimulateOptions {
  PlanFlags plan;
  std::string profile;
  std::string profiles_dir;
  double forward_ms = 0;
  double backward_ms = 0;
  bool overlap = false;
  bool json = false;
  bool per_gpu = false;
  std::string html;
};

[[noreturn]] void Fail(const std::string& message) {
  throw CanzonactlExit(2, "simulate: " + message);
}

template <typename T>
T OrFail(absl::StatusOr<T> value) {
  if (!value.ok()) Fail(std::string(value.status().message()));
  return *std::move(value);
}

struct Simulated {
  plan::Plan plan;
  sim::StepSimulation sim;
};

void PrintPhasesHeader() {
  std::printf("%-15s", "strategy");
  for (const sim::PhaseField& f : sim::PhaseFields()) {
    std::printf(" %14s", f.name);
  }
  std::printf(" %8s\n", "vs sc");
}

void PrintPhases(const std::string& name, const sim::PhaseSeconds& p,
                 double sc_total) {
  std::printf("%-15s", name.c_str());
  for (const sim::PhaseField& f : sim::PhaseFields()) {
    std::printf(" %14s", FormatSeconds(p.*f.member).c_str());
  }
  if (sc_total > 0) {
    std::printf(" %7.2fx\n", sc_total / p.total);
  } else {
    std::printf(" %8s\n", "-");
  }
}

void PrintDetail(const Simulated& s, const SimulateOptions& o) {
  const sim::StepSimulation& r = s.sim;
  const sim::GpuSimulation& slow = r.per_gpu[r.slowest];
  std::printf(
      "\n%s in detail: slowest GPU stage %d dp %d tp %d (node %d), step %s\n",
      plan::StrategyName(r.strategy), slow.stage, slow.dp, slow.tp, slow.node,
      FormatSeconds(r.step_s).c_str());
  const bool all = o.per_gpu || r.per_gpu.size() <= 16;
  std::printf("  %s:\n",
              all ? "per GPU" : "the 8 slowest GPUs (--per-gpu: all)");
  std::vector<size_t> order(r.per_gpu.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (!all) {
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return r.per_gpu[a].phases.total > r.per_gpu[b].phases.total;
    });
    order.resize(std::min<size_t>(8, order.size()));
  }
  std::printf("  %5s %4s %4s %5s", "stage", "dp", "tp", "node");
  for (const sim::PhaseField& f : sim::PhaseFields()) {
    std::printf(" %14s", f.name);
  }
  std::printf(" %12s\n", "memory");
  for (size_t i : order) {
    const sim::GpuSimulation& g = r.per_gpu[i];
    std::printf("  %5d %4d %4d %5d", g.stage, g.dp, g.tp, g.node);
    for (const sim::PhaseField& f : sim::PhaseFields()) {
      std::printf(" %14s", FormatSeconds(g.phases.*f.member).c_str());
    }
    std::printf(" %12s\n", FormatBytes(g.memory_bytes).c_str());
  }
  std::printf(
      "  buckets (DP collectives of the busiest position; NCCL: per-root / "
      "padded, the first step's cost-model pick -> the measured pick):\n");
  for (size_t b = 0; b < r.buckets.size(); ++b) {
    const sim::BucketSimulation& k = r.buckets[b];
    std::printf(
        "    %3zu stage %d %10s elements  slices %.3fx  %-26s reduce %s"
        "  gather %s",
        b, k.stage, FormatSi(k.elements).c_str(), k.slice_imbalance,
        k.algorithm.c_str(), FormatSeconds(k.reduce_s).c_str(),
        FormatSeconds(k.gather_s).c_str());
    if (k.cross_s > 0) {
      std::printf("  cross %s", FormatSeconds(k.cross_s).c_str());
    }
    if (k.reduce.per_root_s > 0) {
      std::printf("  (%s / %s, %s -> %s)",
                  FormatSeconds(k.reduce.per_root_s).c_str(),
                  FormatSeconds(k.reduce.padded_s).c_str(),
                  NcclUnevenName(k.reduce.cost_model_choice),
                  NcclUnevenName(k.reduce.measured_choice));
    }
    std::printf("\n");
  }
  const sim::SimOverlap& v = r.overlap;
  if (v.forward_s > 0 || v.backward_s > 0 || o.overlap) {
    std::printf(
        "  iteration with backward %s + forward %s: plain %s (DP "
        "communication %s, all exposed)",
        FormatSeconds(v.backward_s).c_str(), FormatSeconds(v.forward_s).c_str(),
        FormatSeconds(v.plain_iteration_s).c_str(),
        FormatSeconds(v.dp_comm_s).c_str());
    if (o.overlap) {
      std::printf("; overlapped %s (exposed %s, of which WaitParams %s)",
                  FormatSeconds(v.overlap_iteration_s).c_str(),
                  FormatSeconds(v.overlap_exposed_s).c_str(),
                  FormatSeconds(v.overlap_wait_params_s).c_str());
    }
    std::printf("\n");
  }
}

void Run(const SimulateOptions& o) {
  if (o.profile.empty()) Fail("--profile is required (a name or a .json path)");
  if (!(o.forward_ms >= 0)) Fail("--forward-ms must be >= 0");
  if (!(o.backward_ms >= 0)) Fail("--backward-ms must be >= 0");
  const plan::PlanRequest request = OrFail(MakePlanRequest(o.plan));
  sim::HardwareProfile profile = OrFail(
      sim::LoadHardwareProfile(ResolveProfilesDir(o.profiles_dir), o.profile));
  // Measured kernel rates (bench kernels --rates-out) replace the
  // profile's: the plan balances seconds at them, the step is timed at them.
  if (request.cost_model.calibrated()) {
    profile.rates = request.cost_model.rates();
  }
  const sim::StepSimulator simulator =
      OrFail(sim::StepSimulator::Create(request, profile));
  sim::SimOptions options;
  options.forward_s = o.forward_ms / 1e3;
  options.backward_s = o.backward_ms / 1e3;
  options.overlap = o.overlap;

  // Every strategy side by side (sc and layerwise have no hierarchical
  // form), the requested one in detail.
  const bool hierarchical =
      request.shard_group_size != 0 && request.shard_group_size != o.plan.dp;
  std::vector<Simulated> runs;
  size_t detail = 0;
  for (plan::Strategy s : plan::AllStrategies()) {
    if (hierarchical &&
        (s == plan::Strategy::kSc || s == plan::Strategy::kLayerwise)) {
      continue;
    }
    plan::PlanRequest r = request;
    r.strategy = s;
    plan::Plan p = OrFail(plan::BuildPlan(r));
    sim::StepSimulation result = OrFail(simulator.Simulate(p, options));
    if (s == request.strategy) detail = runs.size();
    runs.push_back({std::move(p), std::move(result)});
  }
  double sc_total = 0;
  for (const Simulated& s : runs) {
    if (s.plan.strategy == plan::Strategy::kSc) sc_total = s.sim.step_s;
  }
  const plan::ParallelLayout& l = request.layout;
  const std::string context = absl::StrFormat(
      "%s (%s layout%s), pp %d x dp %d x tp %d = %d GPUs on %d node(s)%s, "
      "%s, %s, bucket %s elements",
      o.plan.model, o.plan.layout,
      o.plan.layers > 0 || o.plan.vocab > 0
          ? absl::StrFormat(", %d layers, vocab %d", o.plan.layers,
                            o.plan.vocab)
          : std::string(),
      l.pp, l.dp, l.tp, l.pp * l.dp * l.tp, runs.front().sim.nodes,
      hierarchical
          ? absl::StrFormat(", shard groups of %d", request.shard_group_size)
          : std::string(),
      o.plan.optimizer, o.plan.dtype, FormatSi(request.bucket_size));
  const std::string machine =
      absl::StrFormat("profile %s (%s): %s", profile.name,
                      sim::CommPlaneName(profile.comm), profile.description);

  std::string html;
  if (!o.html.empty()) {
    ReportInput in;
    in.title = absl::StrCat("canzonactl simulate: ", o.plan.model, " on ",
                            profile.name);
    in.context = {context, machine};
    in.request = &request;
    for (const Simulated& s : runs) in.strategies.push_back({&s.plan, &s.sim});
    in.detail = detail;
    html = RenderPlanReport(in);
  }
  if (o.json) {
    int64_t elements = 0;
    for (const plan::ParamSpec& p : request.parameters) {
      elements += plan::Numel(p.shape);
    }
    nlohmann::json out = {{"model", o.plan.model},
                          {"parameters", request.parameters.size()},
                          {"elements", elements},
                          {"layout_name", o.plan.layout},
                          {"layers", o.plan.layers},
                          {"vocab", o.plan.vocab},
                          {"optimizer", o.plan.optimizer},
                          {"dtype", o.plan.dtype},
                          {"bucket_size", request.bucket_size},
                          {"shard_group_size", request.shard_group_size},
                          {"profile", sim::HardwareProfileToJson(profile)},
                          {"detail", plan::StrategyName(request.strategy)},
                          {"strategies", nlohmann::json::array()}};
    for (const Simulated& s : runs) {
      const bool is_detail = &s == &runs[detail];
      nlohmann::json j = sim::SimulationToJson(s.sim, is_detail);
      j["plan"] = plan::PlanToJson(s.plan);
      j["vs_sc"] = sc_total > 0 ? sc_total / s.sim.step_s : 0;
      out["strategies"].push_back(std::move(j));
    }
    std::cout << out.dump(2) << "\n";
  } else {
    std::printf("%s\n%s\n", context.c_str(), machine.c_str());
    std::printf(
        "simulated optimizer step, the slowest GPU per phase "
        "(world: the norm and RMS reductions, in the engine's total only):\n");
    PrintPhasesHeader();
    for (const Simulated& s : runs) {
      PrintPhases(plan::StrategyName(s.plan.strategy), s.sim.slowest_per_phase,
                  sc_total);
    }
    PrintDetail(runs[detail], o);
  }
  if (!o.html.empty()) {
    absl::Status written = WriteFileAtomically(o.html, html);
    if (!written.ok()) Fail(absl::StrCat("--html: ", written.message()));
  }
}

}  // namespace

void AddSimulateCommand(CLI::App& app) {
  auto o = std::make_shared<SimulateOptions>();
  o->plan.dtype = "fp32";  // the daemon's data plane today
  CLI::App* cmd = app.add_subcommand(
      "simulate",
      "Simulate a job's optimizer step phase by phase on a hardware profile, "
      "every strategy side by side");
  AddPlanFlags(cmd, &o->plan);
  cmd->add_option("--profile", o->profile,
                  "hardware profile: a name in the profiles directory "
                  "(h100-node, h200-node) or a .json path (canzonactl "
                  "calibrate writes this machine's)");
  cmd->add_option("--profiles-dir", o->profiles_dir, kProfilesDirHelp);
  cmd->add_option("--forward-ms", o->forward_ms,
                  "the trainer's forward per iteration (for the iteration "
                  "time and --overlap)")
      ->capture_default_str();
  cmd->add_option("--backward-ms", o->backward_ms,
                  "the trainer's backward per iteration")
      ->capture_default_str();
  cmd->add_flag("--overlap", o->overlap,
                "also model GradReady / async Step / WaitParams: what the "
                "trainer still waits for");
  cmd->add_flag("--per-gpu", o->per_gpu, "print every GPU of the detail");
  cmd->add_flag("--json", o->json, "one JSON object");
  cmd->add_option("--html", o->html,
                  "also write the plan report with the simulated timeline: "
                  "one self-contained HTML file");
  cmd->callback([o] { Run(*o); });
}

}  // namespace canzona::ctl
