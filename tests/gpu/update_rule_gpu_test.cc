// The update rules on the cuda backend against a float64 reference of each
// rule (tests/unit/optim/reference.h, independent of both backends) and
// against the cpu backend, on well-conditioned gradients
// (tests/unit/optim/well_conditioned_gradients.h): G_t = U diag(s_t) V^T +
// 0.05 N_t with fixed random orthogonal U, V, singular values spread over
// [1, 2] and a small dense noise N_t, so the Shampoo and SOAP factors have
// well-separated eigenvalues and their eigenbases are determined to ~1e-5 in
// fp32 (cuSOLVER and LAPACK may differ only by that and by column signs,
// which the rules' results do not depend on), and no entry of SOAP's
// projected gradient is rounding noise (without N_t all but the diagonal
// are, and SOAP's Adam turns their signs into +-lr updates: 0.039 cuda
// against cpu on an H200). Tolerance 1e-4 of the parameter's magnitude
// after four steps. The cpu counterpart,
// tests/unit/optim/rounding_sensitivity_test.cc, checks the same cases on
// the cpu backend against the reference and against what two correct
// backends may differ in. Skips without a CUDA device.
#include <algorithm>
#include <cmath>
#include <memory>
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
#include "tests/unit/optim/well_conditioned_gradients.h"

namespace canzona {
namespace {

using optim_test::RuleCase;
using optim_test::WellConditionedInitial;

// The parameters after the steps of `kind` on `backend`.
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
  for (int64_t i = 0; i < n; ++i) host[i] = WellConditionedInitial(i);
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
  for (int64_t i = 0; i < n; ++i) initial[i] = WellConditionedInitial(i);
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

class UpdateRuleGpuTest : public ::testing::TestWithParam<RuleCase> {};

TEST_P(UpdateRuleGpuTest, CudaMatchesCpuOnWellConditionedGradients) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const RuleCase& c = GetParam();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> cuda,
                       CreateBackend(BackendKind::kCuda, 0));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> cpu,
                       CreateBackend(BackendKind::kCpu));
  const auto grads =
      optim_test::WellConditionedGradients(c.rows, c.cols, /*seed=*/7);
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
    moved =
        std::max(moved, std::fabs(reference[i] - WellConditionedInitial(i)));
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

INSTANTIATE_TEST_SUITE_P(Rules, UpdateRuleGpuTest,
                         ::testing::ValuesIn(optim_test::GpuRuleCases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace canzona
