// Measuring the planner's kernel rates (server/plan/cost_model.h, Rates) on
// a backend: Newton-Schulz and GEMM on a model's distinct matrix shapes,
// the eigensolver and AdamW. `canzonactl bench kernels` prints and writes
// them (--rates-out); `canzonactl calibrate` puts them in a hardware
// profile for the step simulator.
//
// Thread-safety: single-threaded command-line code.
#ifndef CANZONA_CLIENT_CTL_KERNEL_RATES_H_
#define CANZONA_CLIENT_CTL_KERNEL_RATES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/plan/cost_model.h"

namespace canzona::ctl {

struct KernelBenchOptions {
  std::string model = "qwen3-0.6b";
  std::string models_dir;
  std::string backend = "auto";
  std::string precision = "auto";
  double min_time = 1.0;
  int max_shapes = 0;  // 0: all distinct shapes
  int ns_steps = 5;
  // Rates from each kernel's fastest run instead of its median: what the
  // machine can do without interference (calibrate, on a shared machine,
  // leaves other work to the simulator's background threads).
  bool fastest = false;
  // Also time the Gram iteration on each shape and name the one
  // ns_algorithm=auto picks (bench kernels; calibrate skips it).
  bool compare_algorithms = false;
  // > 0: also time `batch` same-shape matrices one call each against one
  // batched call (StepMuonBatch's path), both algorithms, on each shape.
  int batch = 0;
};

// ns_* figures are the standard iteration's: the planner's ns_gflops is
// its rate, and converts the Gram iteration's cost the same way.
struct ShapeRate {
  int64_t rows = 0, cols = 0;
  double ns_seconds = 0, ns_gflops = 0, gemm_gflops = 0;
  // compare_algorithms: the Gram iteration's time and auto's choice, and
  // the standard iteration's with full GEMMs for its symmetric products
  // (NewtonSchulzSpec::symmetric_products false: what ns_seconds saves).
  double gram_seconds = 0;
  double full_products_seconds = 0;
  std::string auto_algorithm;
  // batch > 0: seconds for `batch` matrices, per-matrix calls and one
  // batched call, standard and gram.
  double standard_single_seconds = 0, standard_batched_seconds = 0;
  double gram_single_seconds = 0, gram_batched_seconds = 0;
};

struct KernelRates {
  plan::Rates rates;  // backend and device filled in
  bool bf16 = false;  // Newton-Schulz precision
  std::vector<ShapeRate> shapes;
  int64_t eig_n = 0;
};

// Errors: INVALID_ARGUMENT / NOT_FOUND for bad options (unknown model,
// backend or precision), others for a failing backend.
absl::StatusOr<KernelRates> MeasureKernelRates(
    const KernelBenchOptions& options);

}  // namespace canzona::ctl

#endif  // CANZONA_CLIENT_CTL_KERNEL_RATES_H_
