#include "server/plan/cost_model.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/plan/parameter.h"

namespace canzona::plan {
namespace {

// Rows and cols of the matrix view: first dim x product of the rest, as
// every matrix optimizer flattens conv-like tensors.
std::pair<double, double> MatrixDims(const std::vector<int64_t>& shape) {
  if (shape.empty()) return {1, 1};
  double rows = static_cast<double>(shape[0]);
  double cols = 1;
  for (size_t i = 1; i < shape.size(); ++i) cols *= shape[i];
  return {rows, cols};
}

// Gram's s x s products relative to its X products (GramNsCost): the same
// rate on cpu (fp32 everywhere), half on cuda (TF32 against bf16), which
// nominal rates describe.
double SmallProductWeight(const Rates& rates) {
  return rates.backend == "cpu" ? 1.0 : 2.0;
}

// Sizes of the blocks a dimension of length `n` splits into under a
// maximum block length `b`: (count of full blocks, remainder).
std::vector<std::pair<double, double>> Blocks(double n, double b) {
  std::vector<std::pair<double, double>> out;  // (size, multiplicity)
  if (b <= 0 || n <= b) {
    out.push_back({n, 1});
    return out;
  }
  double full = static_cast<double>(static_cast<int64_t>(n / b));
  double rem = n - full * b;
  out.push_back({b, full});
  if (rem > 0) out.push_back({rem, 1});
  return out;
}

absl::StatusOr<double> PositiveRate(const nlohmann::json& json,
                                    const char* key) {
  auto it = json.find(key);
  if (it == json.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rates: missing key '", key, "'"));
  }
  if (!it->is_number()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rates: '", key, "' must be a number"));
  }
  double value = it->get<double>();
  if (!(value > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rates: '", key, "' must be positive"));
  }
  return value;
}

}  // namespace

absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name) {
  if (name == "muon") return OptimizerKind::kMuon;
  if (name == "shampoo") return OptimizerKind::kShampoo;
  if (name == "soap") return OptimizerKind::kSoap;
  if (name == "adamw") return OptimizerKind::kAdamW;
  return absl::InvalidArgumentError(
      absl::StrCat("optimizer: unknown optimizer '", name,
                   "' (muon, shampoo, soap, adamw)"));
}

const char* OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kMuon:
      return "muon";
    case OptimizerKind::kShampoo:
      return "shampoo";
    case OptimizerKind::kSoap:
      return "soap";
    case OptimizerKind::kAdamW:
      return "adamw";
  }
  return "unknown";
}

Rates Rates::Nominal() {
  Rates rates;
  rates.backend = "nominal";
  rates.gemm_gflops = 400000;
  rates.ns_gflops = 300000;
  rates.eigh_gflops = 2000;
  rates.adamw_gbps = 2000;
  return rates;
}

absl::StatusOr<Rates> ParseRates(const nlohmann::json& json) {
  if (!json.is_object()) {
    return absl::InvalidArgumentError("rates: expected a JSON object");
  }
  Rates rates;
  if (auto it = json.find("backend"); it != json.end() && it->is_string()) {
    rates.backend = it->get<std::string>();
  } else {
    rates.backend = "unknown";
  }
  if (auto it = json.find("device"); it != json.end() && it->is_string()) {
    rates.device = it->get<std::string>();
  }
  auto gemm = PositiveRate(json, "gemm_gflops");
  if (!gemm.ok()) return gemm.status();
  auto ns = PositiveRate(json, "ns_gflops");
  if (!ns.ok()) return ns.status();
  auto eigh = PositiveRate(json, "eigh_gflops");
  if (!eigh.ok()) return eigh.status();
  auto adamw = PositiveRate(json, "adamw_gbps");
  if (!adamw.ok()) return adamw.status();
  rates.gemm_gflops = *gemm;
  rates.ns_gflops = *ns;
  rates.eigh_gflops = *eigh;
  rates.adamw_gbps = *adamw;
  return rates;
}

absl::StatusOr<Rates> LoadRatesFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("rates: cannot open rates file '", path, "'"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  nlohmann::json json =
      nlohmann::json::parse(buffer.str(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rates: '", path, "' is not valid JSON"));
  }
  return ParseRates(json);
}

nlohmann::json RatesToJson(const Rates& rates) {
  nlohmann::json json = {{"backend", rates.backend},
                         {"gemm_gflops", rates.gemm_gflops},
                         {"ns_gflops", rates.ns_gflops},
                         {"eigh_gflops", rates.eigh_gflops},
                         {"adamw_gbps", rates.adamw_gbps}};
  if (!rates.device.empty()) json["device"] = rates.device;
  return json;
}

CostModel::CostModel(CostModelOptions options, std::optional<Rates> calibrated)
    : options_(options),
      rates_(calibrated.has_value() ? *calibrated : Rates::Nominal()),
      calibrated_(calibrated.has_value()) {}

ParamWork CostModel::Work(OptimizerKind kind,
                          const std::vector<int64_t>& shape) const {
  ParamWork work;
  const double numel = static_cast<double>(Numel(shape));
  auto [m, n] = MatrixDims(shape);
  double ns_flops = 0;  // the part of gemm_flops that runs at ns_gflops
  switch (kind) {
    case OptimizerKind::kAdamW:
      // Memory bound: read param, grad, m, v; write param, m, v (fp32).
      work.mem_bytes = 28 * numel;
      work.flops = 10 * numel;
      break;
    case OptimizerKind::kMuon: {
      // The flops of the algorithm the backend runs; Gram's s x s products
      // count twice where they run at half the rate (GramNsCost's weight),
      // so ns_gflops converts either to seconds.
      const int64_t rows = static_cast<int64_t>(m);
      const int64_t cols = static_cast<int64_t>(n);
      work.ns_algorithm = MuonNsAlgorithm(shape);
      ns_flops = work.ns_algorithm == NsAlgorithm::kGram
                     ? GramNsCost(rows, cols, options_.muon_ns_steps,
                                  SmallProductWeight(rates_))
                     : StandardNsFlops(rows, cols, options_.muon_ns_steps);
      work.gemm_flops = ns_flops;
      // Momentum, Nesterov lerp and the parameter update.
      work.mem_bytes = 24 * numel;
      break;
    }
    case OptimizerKind::kShampoo: {
      const double b = options_.shampoo_max_preconditioner_dim;
      const double f = std::max(1, options_.shampoo_precondition_frequency);
      for (auto [bm, cm] : Blocks(m, b)) {
        for (auto [bn, cn] : Blocks(n, b)) {
          const double count = cm * cn;
          work.gemm_flops += count * (2 * bm * bm * bn + 2 * bn * bn * bm +
                                      2 * bm * bm * bn + 2 * bm * bn * bn);
          work.eigen_flops += count * 9 * (bm * bm * bm + bn * bn * bn) / f;
        }
      }
      // Momentum, Adam grafting state, update.
      work.mem_bytes = 40 * numel;
      break;
    }
    case OptimizerKind::kSoap: {
      const double d = options_.soap_max_precond_dim;
      const double f = std::max(1, options_.soap_precondition_frequency);
      // Projections and back-projections (4) plus factor updates (2), per
      // preconditioned side; QR power iteration + re-sort every f steps.
      if (m <= d) {
        work.gemm_flops += 6 * m * m * n;
        work.eigen_flops += (6.0 + 4.0 / 3.0) * m * m * m / f;
      }
      if (n <= d) {
        work.gemm_flops += 6 * m * n * n;
        work.eigen_flops += (6.0 + 4.0 / 3.0) * n * n * n / f;
      }
      work.mem_bytes = 32 * numel;
      break;
    }
  }
  if (kind != OptimizerKind::kAdamW) {
    work.flops = work.gemm_flops + work.eigen_flops;
  }
  const double other_gemm = work.gemm_flops - ns_flops;
  work.seconds = ns_flops / (rates_.ns_gflops * 1e9) +
                 other_gemm / (rates_.gemm_gflops * 1e9) +
                 work.eigen_flops / (rates_.eigh_gflops * 1e9) +
                 work.mem_bytes / (rates_.adamw_gbps * 1e9);
  return work;
}

NsAlgorithm CostModel::MuonNsAlgorithm(
    const std::vector<int64_t>& shape) const {
  auto [m, n] = MatrixDims(shape);
  return ResolveNsAlgorithm(options_.muon_ns_algorithm, static_cast<int64_t>(m),
                            static_cast<int64_t>(n), options_.muon_ns_steps,
                            SmallProductWeight(rates_));
}

double CostModel::StateBytes(OptimizerKind kind,
                             const std::vector<int64_t>& shape,
                             DType dtype) const {
  const double numel = static_cast<double>(Numel(shape));
  auto [m, n] = MatrixDims(shape);
  double floats = 0;
  switch (kind) {
    case OptimizerKind::kAdamW:
      floats = 2 * numel;
      break;
    case OptimizerKind::kMuon:
      floats = numel;
      break;
    case OptimizerKind::kShampoo: {
      const double b = options_.shampoo_max_preconditioner_dim;
      double factors = 0;
      for (auto [bm, cm] : Blocks(m, b)) {
        for (auto [bn, cn] : Blocks(n, b)) {
          factors += cm * cn * (bm * bm + bn * bn);
        }
      }
      // Factors and their inverse roots, momentum and the grafting state.
      floats = 2 * factors + 2 * numel;
      break;
    }
    case OptimizerKind::kSoap: {
      const double d = options_.soap_max_precond_dim;
      floats = 2 * numel;
      if (m <= d) floats += 2 * m * m;
      if (n <= d) floats += 2 * n * n;
      break;
    }
  }
  if (dtype != DType::kFloat32) floats += numel;  // fp32 master copy
  return 4 * floats;
}

ParamWork WorkOf(const CostModel& model, const ParamSpec& p) {
  if (p.block_shapes.empty()) return model.Work(p.optimizer, p.shape);
  ParamWork sum;
  for (const std::vector<int64_t>& shape : p.block_shapes) {
    const ParamWork w = model.Work(p.optimizer, shape);
    sum.gemm_flops += w.gemm_flops;
    sum.eigen_flops += w.eigen_flops;
    sum.mem_bytes += w.mem_bytes;
    sum.flops += w.flops;
    sum.seconds += w.seconds;
  }
  return sum;
}

double StateBytesOf(const CostModel& model, const ParamSpec& p) {
  if (p.block_shapes.empty()) {
    return model.StateBytes(p.optimizer, p.shape, p.dtype);
  }
  double bytes = 0;
  for (const std::vector<int64_t>& shape : p.block_shapes) {
    bytes += model.StateBytes(p.optimizer, shape, DType::kFloat32);
  }
  if (p.dtype != DType::kFloat32) bytes += 4.0 * Numel(p.shape);
  return bytes;
}

}  // namespace canzona::plan
