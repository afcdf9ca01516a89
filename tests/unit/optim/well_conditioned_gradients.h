// The gradients and cases of the GPU rule test (tests/gpu/
// update_rule_gpu_test.cc), shared with its cpu counterpart
// (tests/unit/optim/rounding_sensitivity_test.cc), which checks on the cpu
// backend alone that each case's result is a well-defined function of the
// data: unchanged, to the GPU test's tolerance, by what two correct
// backends may differ in (summation order, eigen solver precision,
// eigenvector signs).
//
// G_t = U diag(s_t) V^T + noise * N_t: fixed random orthogonal U, V,
// singular values spread over [1, 2] (eigenvalue gaps of the Shampoo / SOAP
// factors about 1.5% of their norm) and a small dense N_t (standard normal
// entries). The noise matters for SOAP: without it every gradient is
// exactly diagonal in the factors' eigenbases, so the 992 off-diagonal
// entries of QL^T G QR are pure rounding noise (1e-12..1e-6), above SOAP's
// eps (1e-8), and Adam's elementwise m / sqrt(v) (sign(x) on the first
// step) turns that noise into +-lr updates: two backends, or a backend and
// the float64 reference, then differ by O(lr) (0.039 on an H200, 0.03 cpu
// against float64).
#ifndef CANZONA_TESTS_UNIT_OPTIM_WELL_CONDITIONED_GRADIENTS_H_
#define CANZONA_TESTS_UNIT_OPTIM_WELL_CONDITIONED_GRADIENTS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "server/optim/optimizer_config.h"

namespace canzona::optim_test {

inline constexpr int kWellConditionedSteps = 4;
// Keeps every entry of the projected gradient well above fp32 rounding
// (the smallest is ~1e-5 for the seeds tried) while the factors' eigenvalue
// gaps stay wide enough for fp32 bases.
inline constexpr double kWellConditionedNoise = 0.05;

// A random n x n orthogonal matrix (modified Gram-Schmidt in double).
inline std::vector<double> RandomOrthogonal(int n, std::mt19937_64& rng) {
  std::normal_distribution<double> normal;
  std::vector<double> q(static_cast<size_t>(n) * n);
  for (double& x : q) x = normal(rng);
  for (int j = 0; j < n; ++j) {  // columns
    for (int k = 0; k < j; ++k) {
      double dot = 0;
      for (int i = 0; i < n; ++i) dot += q[i * n + j] * q[i * n + k];
      for (int i = 0; i < n; ++i) q[i * n + j] -= dot * q[i * n + k];
    }
    double norm = 0;
    for (int i = 0; i < n; ++i) norm += q[i * n + j] * q[i * n + j];
    norm = std::sqrt(norm);
    for (int i = 0; i < n; ++i) q[i * n + j] /= norm;
  }
  return q;
}

// kWellConditionedSteps rows x cols gradients U diag(s_t) V^T + noise N_t
// (U: rows x r, V: cols x r, r = min(rows, cols)). noise = 0 gives the
// GPU test's original, SOAP-degenerate gradients.
inline std::vector<std::vector<float>> WellConditionedGradients(
    int rows, int cols, uint64_t seed, double noise = kWellConditionedNoise) {
  std::mt19937_64 rng(seed);
  const std::vector<double> u = RandomOrthogonal(rows, rng);
  const std::vector<double> v = RandomOrthogonal(cols, rng);
  const int r = std::min(rows, cols);
  std::uniform_real_distribution<double> jitter(-0.01, 0.01);
  // Its own stream, so noise = 0 reproduces the original gradients.
  std::mt19937_64 noise_rng(seed ^ 0x6e6f697365ULL);
  std::normal_distribution<double> normal;
  std::vector<std::vector<float>> out;
  for (int t = 0; t < kWellConditionedSteps; ++t) {
    std::vector<double> g(static_cast<size_t>(rows) * cols, 0.0);
    for (int k = 0; k < r; ++k) {
      const double s = 1.0 + static_cast<double>(k) / r + jitter(rng);
      for (int i = 0; i < rows; ++i) {
        for (int j = 0; j < cols; ++j) {
          g[i * cols + j] += s * u[i * rows + k] * v[j * cols + k];
        }
      }
    }
    std::vector<float> f(g.size());
    for (size_t i = 0; i < g.size(); ++i) {
      f[i] = static_cast<float>(noise > 0 ? g[i] + noise * normal(noise_rng)
                                          : g[i]);
    }
    out.push_back(std::move(f));
  }
  return out;
}

// The parameters' initial values.
inline float WellConditionedInitial(int64_t i) {
  return std::sin(0.37f * static_cast<float>(i));
}

struct RuleCase {
  std::string name;
  OptimizerKind kind;
  std::vector<std::pair<std::string, std::string>> settings;
  int rows, cols;
};

inline void PrintTo(const RuleCase& c, std::ostream* os) { *os << c.name; }

// The GPU rule test's cases.
inline std::vector<RuleCase> GpuRuleCases() {
  return {
      {"muon_fp32", OptimizerKind::kMuon, {{"ns_precision", "fp32"}}, 48, 32},
      {"adamw", OptimizerKind::kAdamW, {}, 48, 32},
      {"shampoo",
       OptimizerKind::kShampoo,
       {{"precondition_frequency", "1"}},
       32,
       32},
      {"soap", OptimizerKind::kSoap, {{"precondition_frequency", "2"}}, 32, 32},
  };
}

}  // namespace canzona::optim_test

#endif  // CANZONA_TESTS_UNIT_OPTIM_WELL_CONDITIONED_GRADIENTS_H_
