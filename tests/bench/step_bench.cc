// The optimizer step of one job under every strategy (sc, layerwise,
// start_anchored, alpha, cost) in one run: two in-process daemons (Engines
// sharing a control plane, real Gloo on loopback, real shm), trainer ranks as
// threads. Reports, per strategy, the median over steps of the slowest
// rank's time per phase (and outside the named phases), and each total's
// speed-up over sc.
//
//   canzona_step_bench [--model=qwen3-0.6b] [--layers=2] [--vocab=4096]
//                      [--layout=megatron] [--dp=2] [--tp=2] [--steps=6]
//                      [--optimizer=muon] [--bucket-size=N]
//                      [--batching=on|off|compare] [--experts=N]
//
// --batching=compare runs the cost strategy twice instead: one update per
// matrix, then same-shape Muon matrices batched (EngineOptions::
// batch_updates), e.g. on qwen3-30b-a3b's experts. Megatron layouts carry
// their qkv / fc1 blocks (each block its own matrix).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/ctl/model_shapes.h"
#include "kernels/cpu/cpu_backend.h"
#include "proto/names/step_phases.h"
#include "server/plan/model_config.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona {
namespace {

struct Flags {
  std::string model = "qwen3-0.6b";
  int layers = 2;
  int vocab = 4096;
  std::string layout = "megatron";
  int dp = 2;
  int tp = 2;
  int steps = 6;
  std::string optimizer = "muon";
  int64_t bucket_size = 4000000;
  std::string batching = "on";
  int experts = 0;  // > 0: cut an MoE model to this many experts
};

bool Parse(int argc, char** argv, Flags& f) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string prefix = absl::StrCat("--", name, "=");
      return a.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (const char* v = value("model"))
      f.model = v;
    else if (const char* v = value("layers"))
      f.layers = std::atoi(v);
    else if (const char* v = value("vocab"))
      f.vocab = std::atoi(v);
    else if (const char* v = value("layout"))
      f.layout = v;
    else if (const char* v = value("dp"))
      f.dp = std::atoi(v);
    else if (const char* v = value("tp"))
      f.tp = std::atoi(v);
    else if (const char* v = value("steps"))
      f.steps = std::atoi(v);
    else if (const char* v = value("optimizer"))
      f.optimizer = v;
    else if (const char* v = value("bucket-size"))
      f.bucket_size = std::atoll(v);
    else if (const char* v = value("batching"))
      f.batching = v;
    else if (const char* v = value("experts"))
      f.experts = std::atoi(v);
    else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return false;
    }
  }
  return f.layers > 0 && f.vocab > 0 && f.dp > 0 && f.tp > 0 && f.steps > 1 &&
         (f.batching == "on" || f.batching == "off" || f.batching == "compare");
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The named phases (kStepPhases) with, before the total, the step's time
// outside them (handoffs, the average, clipping: the service's fixed cost).
// kStepPhases ends with the total.
constexpr size_t kNamed = kStepPhases.size() - 1;

std::vector<std::string> PhaseNames() {
  std::vector<std::string> names;
  for (size_t i = 0; i < kNamed; ++i) names.push_back(kStepPhases[i].name);
  names.push_back("other");
  names.push_back(kStepPhases.back().name);
  return names;
}

std::vector<double> PhaseValues(const canzona::v1::StepResponse& r) {
  const auto& s = r.seconds();
  std::vector<double> values;
  double named = 0;
  for (size_t i = 0; i < kNamed; ++i) {
    values.push_back((s.*kStepPhases[i].seconds)());
    named += values.back();
  }
  const double total = (s.*kStepPhases.back().seconds)();
  values.push_back(total - named);
  values.push_back(total);
  return values;
}

}  // namespace
}  // namespace canzona

int main(int argc, char** argv) {
  using namespace canzona;
  Flags f;
  if (!Parse(argc, argv, f)) return 2;
  SetCpuBlasThreads(1);
  auto config = plan::LoadModelConfig(ResolveModelsDir(""), f.model);
  auto layout = plan::ParseModelLayout(f.layout);
  auto matrix = plan::ParseOptimizerKind(f.optimizer);
  if (!config.ok() || !layout.ok() || !matrix.ok()) {
    std::fprintf(stderr, "bad --model/--layout/--optimizer\n");
    return 2;
  }
  // A few layers and a small vocabulary of the real model's shapes: the
  // whole step fits a small CPU machine.
  config->num_hidden_layers = f.layers;
  config->vocab_size = f.vocab;
  if (f.experts > 0 && config->is_moe()) config->num_experts = f.experts;
  auto params = plan::BuildModelParameters(
      *config, *layout, *matrix, {1, f.dp, f.tp}, plan::DType::kFloat32);
  if (!params.ok()) {
    std::fprintf(stderr, "%s\n",
                 std::string(params.status().message()).c_str());
    return 2;
  }
  std::vector<engine_test::ModelParam> model;
  int64_t numel = 0;
  for (const plan::ParamSpec& p : *params) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    numel += n;
    model.push_back(
        {p.name, p.shape, p.tp_split_dim,
         p.optimizer == plan::OptimizerKind::kAdamW ? "adamw" : f.optimizer});
    // Megatron's fused matrices as the planner counts them: q, k, v of
    // every query group; gate and up.
    if (p.block_shapes.size() == 3) {
      const int64_t groups = config->num_key_value_heads;
      model.back().blocks = {.sizes = {p.block_shapes[0][0] / groups,
                                       p.block_shapes[1][0] / groups,
                                       p.block_shapes[2][0] / groups},
                             .repeat = groups,
                             .merge_repeats = true};
    } else if (p.block_shapes.size() == 2) {
      model.back().blocks = {
          .sizes = {p.block_shapes[0][0], p.block_shapes[1][0]}};
    }
  }
  std::printf(
      "%s (%d layers, vocab %d, %s layout): %zu parameters, %.1f M elements; "
      "DP%d x TP%d, %s, %d steps (median of steps 2..%d, slowest rank)\n",
      f.model.c_str(), f.layers, f.vocab, f.layout.c_str(), model.size(),
      numel / 1e6, f.dp, f.tp, f.optimizer.c_str(), f.steps, f.steps);
  std::printf("%-15s", f.batching == "compare" ? "updates" : "strategy");
  for (const std::string& name : PhaseNames()) {
    std::printf(" %11s", name.c_str());
  }
  std::printf(" %9s\n", f.batching == "compare" ? "speed-up" : "vs sc");
  struct Run {
    std::string label;
    std::string strategy;
    bool batch;
  };
  std::vector<Run> runs;
  if (f.batching == "compare") {
    runs = {{"per-matrix", "cost", false}, {"batched", "cost", true}};
  } else {
    for (const char* strategy :
         {"sc", "layerwise", "start_anchored", "alpha", "cost"}) {
      runs.push_back({strategy, strategy, f.batching == "on"});
    }
  }
  double first_total = 0;
  for (const Run& r : runs) {
    const char* strategy = r.strategy.c_str();
    engine_test::Cluster cluster(absl::Seconds(600), absl::Seconds(600), "cpu",
                                 nullptr, nullptr, r.batch);
    engine_test::JobConfig job;
    job.job_id = engine_test::UniqueJobId(absl::StrCat("bench-", strategy));
    job.dp = f.dp;
    job.tp = f.tp;
    job.strategy = strategy;
    job.params = model;
    job.bucket_size = f.bucket_size;
    // Trainer buffers in bucket order, as Megatron and canzona.torch lay
    // them out: the collectives work on them in place.
    job.bucket_order = true;
    engine_test::JobRun run(job);
    absl::Status status = run.Init();
    if (status.ok()) status = run.RunAll(cluster, f.steps);
    if (!status.ok()) {
      std::fprintf(stderr, "%s: %s\n", strategy,
                   std::string(status.message()).c_str());
      return 1;
    }
    // Per step, the slowest rank's time per phase; then the median over steps
    // (step 1 warms caches and allocators, so it is left out).
    const int phases = static_cast<int>(PhaseNames().size());
    std::vector<double> medians(phases);
    for (int phase = 0; phase < phases; ++phase) {
      std::vector<double> per_step;
      for (int s = 1; s < f.steps; ++s) {
        double slowest = 0;
        for (const auto& rank : run.responses) {
          slowest = std::max(slowest, PhaseValues(rank[s])[phase]);
        }
        per_step.push_back(slowest);
      }
      medians[phase] = Median(per_step);
    }
    if (first_total == 0) first_total = medians.back();
    std::printf("%-15s", r.label.c_str());
    for (double m : medians) std::printf(" %9.2fms", 1e3 * m);
    std::printf(" %8.2fx\n", first_total / medians.back());
    (void)run.Deregister(cluster);
  }
  return 0;
}
