// canzonactl bench kernels: Newton-Schulz throughput on a model's matrix
// shapes next to the same backend's plain GEMM rate, plus the eigensolver
// and AdamW rates; optionally writes the planner's calibrated rates file.
// (canzonactl bench step, overlap and hierarchical sharding against running
// daemons, lives in step_bench_command.cc.)
//
//   canzonactl bench kernels --model qwen3-0.6b [--backend auto|cpu|cuda]
//       [--precision auto|fp32|bf16] [--min-time 1] [--max-shapes N]
//       [--rates-out rates.json] [--json]
#include <algorithm>
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/ctl/commands.h"
#include "client/ctl/model_shapes.h"
#include "kernels/backend.h"
#include "kernels/base/status_macros.h"
#include "kernels/workload.h"
#include "nlohmann/json.hpp"
#include "server/optim/optimizer_config.h"
#include "server/optim/update_rule.h"
#include "server/plan/cost_model.h"

namespace canzona::ctl {
namespace {

struct BenchOptions {
  std::string model = "qwen3-0.6b";
  std::string models_dir;
  std::string backend = "auto";
  std::string precision = "auto";
  double min_time = 1.0;
  int max_shapes = 0;  // 0: all distinct shapes
  int ns_steps = 5;
  std::string rates_out;
  bool json = false;
};

struct ShapeResult {
  int64_t rows, cols;
  double ns_seconds, ns_gflops, gemm_gflops;
};

absl::StatusOr<NsPrecision> ResolvePrecision(const std::string& name,
                                             const Backend& backend) {
  if (name == "fp32") return NsPrecision::kFloat32;
  if (name == "bf16") return NsPrecision::kBfloat16;
  if (name == "auto") {
    return backend.kind() == BackendKind::kCuda ? NsPrecision::kBfloat16
                                                : NsPrecision::kFloat32;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--precision: unknown value \"", name, "\" (expected auto, fp32, bf16)"));
}

absl::Status RunKernelBench(const BenchOptions& options) {
  CANZONA_ASSIGN_OR_RETURN(
      std::vector<MatrixShape> shapes,
      DistinctMatrixShapes(options.model, options.models_dir));
  if (options.max_shapes > 0 &&
      static_cast<int>(shapes.size()) > options.max_shapes) {
    shapes.resize(static_cast<size_t>(options.max_shapes));
  }
  CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                           CreateBackendByName(options.backend));
  CANZONA_ASSIGN_OR_RETURN(NsPrecision precision,
                           ResolvePrecision(options.precision, *backend));
  // The spec Muon's default (simple coefficients) resolves to.
  CANZONA_ASSIGN_OR_RETURN(OptimizerConfig muon,
                           MakeOptimizerConfig(OptimizerKind::kMuon, {}));
  muon.muon.ns_steps = options.ns_steps;
  CANZONA_ASSIGN_OR_RETURN(NewtonSchulzSpec spec,
                           NewtonSchulzSpecFor(muon.muon, backend->kind()));
  spec.precision = precision;

  std::vector<ShapeResult> results;
  for (const MatrixShape& shape : shapes) {
    CANZONA_ASSIGN_OR_RETURN(
        auto ns, KernelWorkload::NewtonSchulz(backend.get(), spec, 1,
                                              shape.rows, shape.cols));
    CANZONA_ASSIGN_OR_RETURN(WorkloadTiming ns_time,
                             TimeWorkload(*ns, options.min_time));
    // The GEMM NS spends most of its time in: (s x s) times (s x l).
    const int64_t s = std::min(shape.rows, shape.cols);
    const int64_t l = std::max(shape.rows, shape.cols);
    CANZONA_ASSIGN_OR_RETURN(auto gemm,
                             KernelWorkload::Gemm(backend.get(), s, l, s));
    CANZONA_ASSIGN_OR_RETURN(WorkloadTiming gemm_time,
                             TimeWorkload(*gemm, options.min_time));
    results.push_back({shape.rows, shape.cols, ns_time.median_seconds,
                       ns->flops() / ns_time.median_seconds / 1e9,
                       gemm->flops() / gemm_time.median_seconds / 1e9});
  }
  // Eigensolver and AdamW rates for the planner's cost model.
  const int64_t eig_n =
      std::min<int64_t>(1024, std::max<int64_t>(256, shapes.front().rows / 4));
  CANZONA_ASSIGN_OR_RETURN(
      auto eig, KernelWorkload::SymmetricEigen(backend.get(), eig_n));
  CANZONA_ASSIGN_OR_RETURN(WorkloadTiming eig_time,
                           TimeWorkload(*eig, options.min_time));
  CANZONA_ASSIGN_OR_RETURN(auto adamw,
                           KernelWorkload::AdamW(backend.get(), 1 << 24));
  CANZONA_ASSIGN_OR_RETURN(WorkloadTiming adamw_time,
                           TimeWorkload(*adamw, options.min_time));

  double ns_flops = 0, ns_seconds = 0, gemm_best = 0;
  for (const ShapeResult& r : results) {
    ns_flops += r.ns_gflops * r.ns_seconds;
    ns_seconds += r.ns_seconds;
    gemm_best = std::max(gemm_best, r.gemm_gflops);
  }
  // The planner's rates file (server/plan/cost_model.h documents it).
  plan::Rates measured;
  measured.backend = std::string(BackendKindName(backend->kind()));
  measured.device = backend->description();
  measured.gemm_gflops = gemm_best;
  measured.ns_gflops = ns_flops / ns_seconds;
  measured.eigh_gflops = eig->flops() / eig_time.median_seconds / 1e9;
  measured.adamw_gbps = adamw->bytes() / adamw_time.median_seconds / 1e9;
  nlohmann::json rates = plan::RatesToJson(measured);

  if (options.json) {
    nlohmann::json out = rates;
    out["model"] = options.model;
    out["ns_precision"] = precision == NsPrecision::kBfloat16 ? "bf16" : "fp32";
    out["shapes"] = nlohmann::json::array();
    for (const ShapeResult& r : results) {
      out["shapes"].push_back({{"rows", r.rows},
                               {"cols", r.cols},
                               {"ns_seconds", r.ns_seconds},
                               {"ns_gflops", r.ns_gflops},
                               {"gemm_gflops", r.gemm_gflops},
                               {"ns_over_gemm", r.ns_gflops / r.gemm_gflops}});
    }
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("backend: %s   model: %s   Newton-Schulz: %d steps, %s\n",
                backend->description().c_str(), options.model.c_str(),
                options.ns_steps,
                precision == NsPrecision::kBfloat16 ? "bf16" : "fp32");
    std::printf("%-14s %12s %12s %12s %10s\n", "shape", "NS ms", "NS GFLOP/s",
                "GEMM GFLOP/s", "NS/GEMM");
    for (const ShapeResult& r : results) {
      std::printf("%-14s %12.2f %12.1f %12.1f %10.2f\n",
                  absl::StrCat(r.rows, "x", r.cols).c_str(), r.ns_seconds * 1e3,
                  r.ns_gflops, r.gemm_gflops, r.ns_gflops / r.gemm_gflops);
    }
    std::printf("eigh %lldx%lld: %.1f GFLOP/s (9 n^3)   adamw: %.1f GB/s\n",
                static_cast<long long>(eig_n), static_cast<long long>(eig_n),
                measured.eigh_gflops, measured.adamw_gbps);
  }
  if (!options.rates_out.empty()) {
    FILE* f = std::fopen(options.rates_out.c_str(), "w");
    if (f == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--rates-out: cannot write ", options.rates_out));
    }
    std::fprintf(f, "%s\n", rates.dump(2).c_str());
    std::fclose(f);
  }
  return absl::OkStatus();
}

}  // namespace

void AddBenchCommand(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  auto options = std::make_shared<BenchOptions>();
  CLI::App* kernels = bench->add_subcommand(
      "kernels", "Newton-Schulz vs GEMM rates on a model's matrix shapes");
  kernels
      ->add_option("--model", options->model,
                   "model name in the models directory, or a .json path")
      ->capture_default_str();
  kernels->add_option("--models-dir", options->models_dir, kModelsDirHelp);
  kernels->add_option("--backend", options->backend, "auto | cpu | cuda")
      ->capture_default_str();
  kernels
      ->add_option("--precision", options->precision,
                   "Newton-Schulz precision: auto | fp32 | bf16")
      ->capture_default_str();
  kernels
      ->add_option("--min-time", options->min_time,
                   "seconds to time each kernel")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  kernels
      ->add_option("--max-shapes", options->max_shapes,
                   "time only the N largest distinct shapes (0: all)")
      ->check(CLI::NonNegativeNumber);
  kernels->add_option("--ns-steps", options->ns_steps, "Newton-Schulz steps")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  kernels->add_option("--rates-out", options->rates_out,
                      "write the planner's calibrated rates file (JSON)");
  kernels->add_flag("--json", options->json, "JSON output");
  kernels->callback([options] {
    absl::Status status = RunKernelBench(*options);
    if (!status.ok()) {
      throw CanzonactlExit(
          status.code() == absl::StatusCode::kInvalidArgument ||
                  status.code() == absl::StatusCode::kNotFound
              ? 2
              : 1,
          absl::StrCat("bench kernels: ", status.message()));
    }
  });
  AddBenchStepCommand(bench);
}

}  // namespace canzona::ctl
