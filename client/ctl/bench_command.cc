// canzonactl bench kernels: Newton-Schulz throughput on a model's matrix
// shapes next to the same backend's plain GEMM rate, the Gram iteration's
// time beside the standard one's (and which one ns_algorithm=auto runs),
// optionally N same-shape matrices per-matrix vs batched (--batch N), plus
// the eigensolver and AdamW rates; optionally writes the planner's
// calibrated rates file.
// (canzonactl bench step, overlap and hierarchical sharding against running
// daemons, lives in step_bench_command.cc.)
//
//   canzonactl bench kernels --model qwen3-0.6b [--backend auto|cpu|cuda]
//       [--precision auto|fp32|bf16] [--min-time 1] [--max-shapes N]
//       [--batch N]
//       [--rates-out rates.json] [--json]
#include <cstdio>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/ctl/commands.h"
#include "client/ctl/kernel_rates.h"
#include "client/ctl/model_shapes.h"
#include "kernels/base/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/plan/cost_model.h"

namespace canzona::ctl {
namespace {

struct BenchOptions {
  KernelBenchOptions kernels;
  std::string rates_out;
  bool json = false;
};

absl::Status RunKernelBench(const BenchOptions& options) {
  CANZONA_ASSIGN_OR_RETURN(KernelRates measured,
                           MeasureKernelRates(options.kernels));
  // The planner's rates file (server/plan/cost_model.h documents it).
  nlohmann::json rates = plan::RatesToJson(measured.rates);
  const char* precision = measured.bf16 ? "bf16" : "fp32";
  if (options.json) {
    nlohmann::json out = rates;
    out["model"] = options.kernels.model;
    out["ns_precision"] = precision;
    out["shapes"] = nlohmann::json::array();
    for (const ShapeRate& r : measured.shapes) {
      out["shapes"].push_back(
          {{"rows", r.rows},
           {"cols", r.cols},
           {"ns_seconds", r.ns_seconds},
           {"ns_gflops", r.ns_gflops},
           {"gemm_gflops", r.gemm_gflops},
           {"ns_over_gemm", r.ns_gflops / r.gemm_gflops},
           {"full_products_seconds", r.full_products_seconds},
           {"symmetric_speedup", r.full_products_seconds / r.ns_seconds},
           {"gram_seconds", r.gram_seconds},
           {"gram_speedup", r.ns_seconds / r.gram_seconds},
           {"auto", r.auto_algorithm}});
      if (options.kernels.batch > 0) {
        out["shapes"].back()["batch"] = {
            {"matrices", options.kernels.batch},
            {"standard_single_seconds", r.standard_single_seconds},
            {"standard_batched_seconds", r.standard_batched_seconds},
            {"gram_single_seconds", r.gram_single_seconds},
            {"gram_batched_seconds", r.gram_batched_seconds}};
      }
    }
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("backend: %s   model: %s   Newton-Schulz: %d steps, %s\n",
                measured.rates.device.c_str(), options.kernels.model.c_str(),
                options.kernels.ns_steps, precision);
    // NS is the standard iteration (its symmetric products one triangle
    // each, GFLOP/s counting them as full GEMMs); full ms times it with full
    // GEMMs, full/NS the saving; gram ms and std/gram time the Gram
    // iteration; all on the same shape, same run; auto names what
    // ns_algorithm=auto runs there (kernels/ns_algorithm.h).
    std::printf("%-14s %12s %12s %12s %10s %10s %8s %10s %9s %9s\n", "shape",
                "NS ms", "NS GFLOP/s", "GEMM GFLOP/s", "NS/GEMM", "full ms",
                "full/NS", "gram ms", "std/gram", "auto");
    for (const ShapeRate& r : measured.shapes) {
      std::printf(
          "%-14s %12.2f %12.1f %12.1f %10.2f %10.2f %8.2f %10.2f %9.2f %9s\n",
          absl::StrCat(r.rows, "x", r.cols).c_str(), r.ns_seconds * 1e3,
          r.ns_gflops, r.gemm_gflops, r.ns_gflops / r.gemm_gflops,
          r.full_products_seconds * 1e3, r.full_products_seconds / r.ns_seconds,
          r.gram_seconds * 1e3, r.ns_seconds / r.gram_seconds,
          r.auto_algorithm.c_str());
    }
    if (options.kernels.batch > 0) {
      std::printf(
          "%d same-shape matrices: %d calls of one vs one batched call (ms)\n",
          options.kernels.batch, options.kernels.batch);
      std::printf("%-14s %12s %12s %9s %12s %12s %9s\n", "shape", "std single",
                  "std batched", "speedup", "gram single", "gram batched",
                  "speedup");
      for (const ShapeRate& r : measured.shapes) {
        std::printf("%-14s %12.2f %12.2f %9.2f %12.2f %12.2f %9.2f\n",
                    absl::StrCat(r.rows, "x", r.cols).c_str(),
                    r.standard_single_seconds * 1e3,
                    r.standard_batched_seconds * 1e3,
                    r.standard_single_seconds / r.standard_batched_seconds,
                    r.gram_single_seconds * 1e3, r.gram_batched_seconds * 1e3,
                    r.gram_single_seconds / r.gram_batched_seconds);
      }
    }
    std::printf("eigh %lldx%lld: %.1f GFLOP/s (9 n^3)   adamw: %.1f GB/s\n",
                static_cast<long long>(measured.eig_n),
                static_cast<long long>(measured.eig_n),
                measured.rates.eigh_gflops, measured.rates.adamw_gbps);
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
  // bench kernels shows the Gram iteration beside the standard one.
  options->kernels.compare_algorithms = true;
  CLI::App* kernels = bench->add_subcommand(
      "kernels", "Newton-Schulz vs GEMM rates on a model's matrix shapes");
  kernels
      ->add_option("--model", options->kernels.model,
                   "model name in the models directory, or a .json path")
      ->capture_default_str();
  kernels->add_option("--models-dir", options->kernels.models_dir,
                      kModelsDirHelp);
  kernels
      ->add_option("--backend", options->kernels.backend, "auto | cpu | cuda")
      ->capture_default_str();
  kernels
      ->add_option("--precision", options->kernels.precision,
                   "Newton-Schulz precision: auto | fp32 | bf16")
      ->capture_default_str();
  kernels
      ->add_option("--min-time", options->kernels.min_time,
                   "seconds to time each kernel")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  kernels
      ->add_option("--batch", options->kernels.batch,
                   "also time N same-shape matrices: N calls vs one batched "
                   "call, standard and gram (0: off)")
      ->check(CLI::NonNegativeNumber);
  kernels
      ->add_option("--max-shapes", options->kernels.max_shapes,
                   "time only the N largest distinct shapes (0: all)")
      ->check(CLI::NonNegativeNumber);
  kernels
      ->add_option("--ns-steps", options->kernels.ns_steps,
                   "Newton-Schulz steps")
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
