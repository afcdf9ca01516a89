// What the update-rule tests share (update_rule_test.cc: against the
// float64 references; update_rule_contract_test.cc: the rules' contracts):
// random data, the cpu backend, configs, and a parameter and gradient on
// the backend to step a rule over.
#ifndef CANZONA_TESTS_UNIT_OPTIM_UPDATE_RULE_TEST_UTIL_H_
#define CANZONA_TESTS_UNIT_OPTIM_UPDATE_RULE_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/optim/optimizer_config.h"
#include "server/optim/update_rule.h"
#include "tests/matchers/status_matchers.h"

namespace canzona::optim_test {

using Settings = std::vector<std::pair<std::string, std::string>>;

inline constexpr OptimizerKind kMuon = OptimizerKind::kMuon;
inline constexpr OptimizerKind kAdamW = OptimizerKind::kAdamW;
inline constexpr OptimizerKind kShampoo = OptimizerKind::kShampoo;
inline constexpr OptimizerKind kSoap = OptimizerKind::kSoap;

// Normal values, never zero (a zero would make sign-like Adam steps and
// relative errors degenerate).
inline std::vector<float> RandomNormal(int64_t n, std::mt19937_64& rng,
                                       double stddev) {
  std::normal_distribution<double> dist(0.0, stddev);
  std::vector<float> out(n);
  for (float& x : out) {
    do {
      x = static_cast<float>(dist(rng));
    } while (std::fabs(x) < 1e-6 * stddev);
  }
  return out;
}

inline std::unique_ptr<Backend> CpuBackend() {
  auto backend = CreateCpuBackend();
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

inline OptimizerConfig Config(OptimizerKind kind, const Settings& settings) {
  auto config = MakeOptimizerConfig(kind, settings);
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

// Parameter, gradient and a rule on the cpu backend.
struct Harness {
  std::unique_ptr<Backend> backend = CpuBackend();
  DeviceBuffer param, grad;
  int64_t numel = 0;

  void Init(int64_t n) {
    numel = n;
    param = *backend->Allocate(n);
    grad = *backend->Allocate(n);
  }
  void SetParam(const std::vector<float>& p) {
    ASSERT_OK(backend->CopyFromHost(p.data(), numel, param.data()));
  }
  std::vector<float> Param() {
    std::vector<float> p(numel);
    EXPECT_OK(backend->CopyToHost(param.data(), numel, p.data()));
    return p;
  }
  absl::Status Step(UpdateRule& rule, const std::vector<float>& g,
                    const StepOptions& options = {}) {
    absl::Status s = backend->CopyFromHost(g.data(), numel, grad.data());
    if (!s.ok()) return s;
    return rule.Step(param.data(), grad.data(), options);
  }
};

}  // namespace canzona::optim_test

#endif  // CANZONA_TESTS_UNIT_OPTIM_UPDATE_RULE_TEST_UTIL_H_
