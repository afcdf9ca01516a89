// Per-matrix optimizer cost model (server/DESIGN.md section 4.3) and its
// calibration.
//
// Every parameter's per-step optimizer work is split into three classes so
// that measured kernel rates can convert it to seconds:
//   - gemm flops    (Muon Newton-Schulz; Shampoo/SOAP factor updates,
//                    preconditioning and projections),
//   - eigen flops   (Shampoo eigendecompositions, SOAP QR/eigen refresh),
//                    amortized over the preconditioning frequency,
//   - memory bytes  (AdamW and every other element-wise pass).
// Flop counts follow server/DESIGN.md section 4.3 (X X^T counted as
// 2 s^2 l even though the kernel uses SYRK: the SYRK saving is a
// kernel-rate matter and calibrated rates absorb it). A Muon matrix costs
// the Newton-Schulz algorithm its backend runs (kernels/ns_algorithm.h:
// the `auto` rule picks gram for long matrices with a side >= 2048, which
// roughly halves a 25600 x 5120 matrix's work). AdamW counts as
// `10 * numel` flop-equivalents when planning in flops.
//
// Rates file (JSON, written by `canzonactl bench kernels`, read by
// `canzonactl plan --rates FILE` and by the daemon):
//
//   {
//     "backend": "cuda",          // informational: "cpu" or "cuda"
//     "device": "NVIDIA H100",    // informational, optional
//     "gemm_gflops": 600000.0,    // dense GEMM rate (fp32 on cpu, bf16/tf32
//                                 // on cuda), GFLOP/s
//     "ns_gflops": 450000.0,      // Muon Newton-Schulz effective rate,
//                                 // nominal flops of section 4.3 /
//                                 // measured seconds
//     "eigh_gflops": 3000.0,      // symmetric eigendecomposition / QR rate
//     "adamw_gbps": 2500.0        // AdamW (element-wise) bytes moved, GB/s
//   }
//
// All four rates are required and must be positive; unknown keys are
// ignored so the bench may add fields. With a rates file the planner
// balances seconds; without one it balances flops and reports seconds with
// the nominal rates of `Rates::Nominal()`.
//
// Thread-safety: CostModel is immutable after construction; concurrent const
// calls are safe.
#ifndef CANZONA_SERVER_PLAN_COST_MODEL_H_
#define CANZONA_SERVER_PLAN_COST_MODEL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/base/dtype.h"
#include "kernels/ns_algorithm.h"
#include "nlohmann/json.hpp"

namespace canzona::plan {

// The planner's own optimizer tag (independent of server/optim).
enum class OptimizerKind { kMuon, kShampoo, kSoap, kAdamW };

absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name);
const char* OptimizerKindName(OptimizerKind kind);
inline bool IsMatrixOptimizer(OptimizerKind kind) {
  return kind != OptimizerKind::kAdamW;
}

// Element type of a parameter (gradients and parameters travel in it):
// the one the kernels convert (kernels/base/dtype.h).
using ::canzona::DType;
using ::canzona::DTypeBytes;
using ::canzona::DTypeName;
using ::canzona::ParseDType;

// Calibrated (or nominal) kernel rates.
struct Rates {
  std::string backend = "nominal";
  std::string device;
  double gemm_gflops = 0;
  double ns_gflops = 0;
  double eigh_gflops = 0;
  double adamw_gbps = 0;

  // Nominal H100-class rates used to print seconds when no file is given.
  static Rates Nominal();
};

absl::StatusOr<Rates> ParseRates(const nlohmann::json& json);
absl::StatusOr<Rates> LoadRatesFile(const std::string& path);
nlohmann::json RatesToJson(const Rates& rates);

// Knobs of the flop model (defaults: canonical public implementations).
struct CostModelOptions {
  int muon_ns_steps = 5;
  // Muon's ns_algorithm (its default, auto: resolved per shape).
  NsAlgorithm muon_ns_algorithm = NsAlgorithm::kAuto;
  int shampoo_max_preconditioner_dim = 1024;  // Distributed Shampoo default
  int shampoo_precondition_frequency = 1;     // Distributed Shampoo default
  int soap_max_precond_dim = 10000;           // nikhilvyas/SOAP default
  int soap_precondition_frequency = 10;       // nikhilvyas/SOAP default
};

// Work of one whole parameter's update per step.
struct ParamWork {
  double gemm_flops = 0;   // Muon NS flops are reported here too
  double eigen_flops = 0;  // amortized per step
  double mem_bytes = 0;    // element-wise traffic
  double flops = 0;        // planning flops: gemm + eigen + 10 numel (AdamW)
  double seconds = 0;      // with the model's rates
  // Muon: the Newton-Schulz iteration the matrix gets (never kAuto).
  NsAlgorithm ns_algorithm = NsAlgorithm::kStandard;
};

// Per-matrix cost and optimizer-state size.
class CostModel {
 public:
  // Flop objective, nominal rates for the seconds column.
  CostModel() : CostModel(CostModelOptions{}, std::nullopt) {}
  CostModel(CostModelOptions options, std::optional<Rates> calibrated);

  // Work of updating the whole parameter of global `shape`.
  ParamWork Work(OptimizerKind kind, const std::vector<int64_t>& shape) const;
  // Optimizer state bytes (fp32) of the whole parameter, plus an fp32 master
  // copy when the parameter itself is not fp32.
  double StateBytes(OptimizerKind kind, const std::vector<int64_t>& shape,
                    DType dtype) const;

  // The planning objective: seconds when calibrated, flops otherwise.
  bool calibrated() const { return calibrated_; }
  double Objective(const ParamWork& work) const {
    return calibrated_ ? work.seconds : work.flops;
  }
  const Rates& rates() const { return rates_; }
  // The Newton-Schulz algorithm a Muon matrix of `shape` runs with these
  // options and rates: on a cpu backend (rates.backend "cpu") Gram's s x s
  // products run at its X products' rate; elsewhere (cuda, nominal) in
  // TF32 at about half the bf16 rate (kernels/backend.cc,
  // ResolvedNsAlgorithm).
  NsAlgorithm MuonNsAlgorithm(const std::vector<int64_t>& shape) const;
  const CostModelOptions& options() const { return options_; }

 private:
  CostModelOptions options_;
  Rates rates_;
  bool calibrated_;
};

}  // namespace canzona::plan

#endif  // CANZONA_SERVER_PLAN_COST_MODEL_H_
