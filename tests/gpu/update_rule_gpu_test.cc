// The update rules on the cuda backend against a float64 reference of each
// rule (tests/unit/optim/reference.h, independent of both backends) and
// against the cpu backend, on well-conditioned gradients: G_t = U diag(s_t)
// V^T with fixed random orthogonal U, V and singular values spread over
// [1, 2], so the Shampoo and SOAP factors have eigenvalue gaps of about
// 1.5% of their norm and their eigenbases are determined to ~1e-5 in fp32
// (cuSOLVER and LAPACK may differ only by that and by column signs, which
// the rules' results do not depend on). Tolerance 1e-4 of the parameter's
// magnitude after four steps: four steps of at most lr each, moved by
// fp32 bases good to ~1e-5 (the cpu backend meets it, checked here too, so
// a failure says which backend left the reference). Skips without a CUDA
// device.
#include <algorithm>
#include <cmath>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/base/status_macros.h"
#include "kernels/cuda/cuda_backend.h"
#include "server/optim/optimizer_config.h"
#include "server/optim/update_rule.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/optim/reference.h"

namespace canzona {
namespace {

constexpr int kSteps = 4;

// A random n x n orthogonal matrix (modified Gram-Schmidt in double).
std::vector<double> Orthogonal(int n, std::mt19937_64& rng) {
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

// rows x cols gradients U diag(s_t) V^T (U: rows x r, V: cols x r, r =
// min(rows, cols)), one per step.
std::vector<std::vector<float>> Gradients(int rows, int cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<double> u = Orthogonal(rows, rng);
  const std::vector<double> v = Orthogonal(cols, rng);
  const int r = std::min(rows, cols);
  std::uniform_real_distribution<double> jitter(-0.01, 0.01);
  std::vector<std::vector<float>> out;
  for (int t = 0; t < kSteps; ++t) {
    std::vector<float> g(static_cast<size_t>(rows) * cols, 0.0f);
    for (int k = 0; k < r; ++k) {
      const double s = 1.0 + static_cast<double>(k) / r + jitter(rng);
      for (int i = 0; i < rows; ++i) {
        for (int j = 0; j < cols; ++j) {
          g[i * cols + j] +=
              static_cast<float>(s * u[i * rows + k] * v[j * cols + k]);
        }
      }
    }
    out.push_back(std::move(g));
  }
  return out;
}

float Initial(int64_t i) { return std::sin(0.37f * static_cast<float>(i)); }

// The parameters after kSteps steps of `kind` on `backend`.
absl::StatusOr<std::vector<float>> RunRule(
    Backend& backend, OptimizerKind kind,
    const std::vector<std::pair<std::string, std::string>>& settings, int rows,
    int cols, const std::vector<std::vector<float>>& grads) {
  CANZONA_ASSIGN_OR_RETURN(OptimizerConfig config,
                           MakeOptimizerConfig(kind, settings));
  CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<UpdateRule> rule,
                           UpdateRule::Create(config, {rows, cols}, &backend));
  const int64_t n = static_cast<int64_t>(rows) * cols;
  std::vector<float> host(n);
  for (int64_t i = 0; i < n; ++i) host[i] = Initial(i);
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer p, backend.Allocate(n));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer g, backend.Allocate(n));
  CANZONA_RETURN_IF_ERROR(backend.CopyFromHost(host.data(), n, p.data()));
  for (const std::vector<float>& grad : grads) {
    CANZONA_RETURN_IF_ERROR(backend.CopyFromHost(grad.data(), n, g.data()));
    CANZONA_RETURN_IF_ERROR(rule->Step(p.data(), g.data(), {}));
  }
  CANZONA_RETURN_IF_ERROR(backend.CopyToHost(p.data(), n, host.data()));
  return host;
}

// The same steps in float64 (tests/unit/optim/reference.h).
absl::StatusOr<std::vector<float>> RunReference(
    OptimizerKind kind,
    const std::vector<std::pair<std::string, std::string>>& settings, int rows,
    int cols, const std::vector<std::vector<float>>& grads) {
  CANZONA_ASSIGN_OR_RETURN(OptimizerConfig config,
                           MakeOptimizerConfig(kind, settings));
  std::unique_ptr<optim_test::RefRule> ref;
  switch (kind) {
    case OptimizerKind::kMuon:
      ref = std::make_unique<optim_test::MuonRef>(config.muon, rows, cols);
      break;
    case OptimizerKind::kAdamW:
      ref = std::make_unique<optim_test::AdamWRef>(config.adamw,
                                                   int64_t{rows} * cols);
      break;
    case OptimizerKind::kShampoo:
      ref =
          std::make_unique<optim_test::ShampooRef>(config.shampoo, rows, cols);
      break;
    case OptimizerKind::kSoap:
      ref = std::make_unique<optim_test::SoapRef>(config.soap, rows, cols);
      break;
  }
  const int64_t n = static_cast<int64_t>(rows) * cols;
  std::vector<float> initial(n);
  for (int64_t i = 0; i < n; ++i) initial[i] = Initial(i);
  optim_test::Mat p = optim_test::FromFloats(rows, cols, initial);
  for (const std::vector<float>& grad : grads) {
    ref->Step(p, optim_test::FromFloats(rows, cols, grad),
              ConfigLearningRate(config));
  }
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p.a[i]);
  return out;
}

// The largest difference between two parameter vectors.
float Worst(const std::vector<float>& a, const std::vector<float>& b) {
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::fabs(a[i] - b[i]));
  }
  return worst;
}

struct Case {
  std::string name;
  OptimizerKind kind;
  std::vector<std::pair<std::string, std::string>> settings;
  int rows, cols;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class UpdateRuleGpuTest : public ::testing::TestWithParam<Case> {};

TEST_P(UpdateRuleGpuTest, CudaMatchesCpuOnWellConditionedGradients) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const Case& c = GetParam();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> cuda,
                       CreateBackend(BackendKind::kCuda, 0));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> cpu,
                       CreateBackend(BackendKind::kCpu));
  const auto grads = Gradients(c.rows, c.cols, /*seed=*/7);
  ASSERT_OK_AND_ASSIGN(std::vector<float> reference,
                       RunReference(c.kind, c.settings, c.rows, c.cols, grads));
  ASSERT_OK_AND_ASSIGN(
      std::vector<float> want,
      RunRule(*cpu, c.kind, c.settings, c.rows, c.cols, grads));
  ASSERT_OK_AND_ASSIGN(
      std::vector<float> got,
      RunRule(*cuda, c.kind, c.settings, c.rows, c.cols, grads));
  float scale = 0, moved = 0;
  for (size_t i = 0; i < reference.size(); ++i) {
    scale = std::max(scale, std::fabs(reference[i]));
    moved = std::max(moved, std::fabs(reference[i] - Initial(i)));
  }
  const float cuda_error = Worst(got, reference);
  const float cpu_error = Worst(want, reference);
  EXPECT_LE(cuda_error, 1e-4f * scale)
      << c.name << ": cuda against float64 (cpu against float64: " << cpu_error
      << ")";
  EXPECT_LE(cpu_error, 1e-4f * scale) << c.name << ": cpu against float64";
  EXPECT_LE(Worst(got, want), 1e-4f * scale) << c.name << ": cuda against cpu";
  // The rule moved the parameters (a no-op would pass the comparison).
  EXPECT_GT(moved, 1e-3f * scale) << c.name;
}

INSTANTIATE_TEST_SUITE_P(
    Rules, UpdateRuleGpuTest,
    ::testing::Values(Case{"muon_fp32",
                           OptimizerKind::kMuon,
                           {{"ns_precision", "fp32"}},
                           48,
                           32},
                      Case{"adamw", OptimizerKind::kAdamW, {}, 48, 32},
                      Case{"shampoo",
                           OptimizerKind::kShampoo,
                           {{"precondition_frequency", "1"}},
                           32,
                           32},
                      Case{"soap",
                           OptimizerKind::kSoap,
                           {{"precondition_frequency", "2"}},
                           32,
                           32}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace canzona
