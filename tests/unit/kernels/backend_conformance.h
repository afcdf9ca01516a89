// The conformance suite every Backend implementation must pass, written once
// and instantiated per backend: argument validation (codes and messages),
// memory operations, every kernel against float64 references on fresh
// random data (odd, square, tall, wide and single-row shapes; unaligned
// pointers for the elementwise kernels), aliasing rules and zero-size calls.
// The suite lives in backend_conformance_*.cc; a test binary instantiates it
// with its backend:
//
//   INSTANTIATE_TEST_SUITE_P(Cpu, BackendConformanceTest,
//                            ::testing::Values(CpuUnderTest()),
//                            BackendUnderTestName);
//
// Tests that only make sense for one backend (bitwise agreement with
// PyTorch's float formulas on cpu, bf16 and CUDA graphs on cuda) live in that
// backend's own test file.
//
// Thread-safety: test fixtures, one per test, on gtest's thread.
#ifndef CANZONA_TESTS_UNIT_KERNELS_BACKEND_CONFORMANCE_H_
#define CANZONA_TESTS_UNIT_KERNELS_BACKEND_CONFORMANCE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace canzona {

// Accuracy a backend promises where no order-independent bound exists: the
// iterative and factorizing solvers, whose rounding depends on the library's
// algorithm. Everything else is held to bounds any correct float32
// implementation meets in any summation order (e.g. GEMM within
// (k + 4) * 2^-24 of the sum of |terms|), the same for every backend.
struct BackendTolerances {
  // SymmetricEigen kFloat32: ||A Q - Q diag(lam)||_F / ||A||_F, and
  // ||Q^T Q - I||_F / sqrt(n). (kFloat64 solves in double: 2e-6 for all.)
  double eigen_float32;
  // QrOrthonormalize: |Q^T Q - I| and |R - R_householder| / ||A||_F per
  // element.
  double qr;
  // NewtonSchulz kNsFloat32: ||X - X_float64||_F / ||X_float64||_F.
  double newton_schulz;
};

// One backend, as a test parameter.
struct BackendUnderTest {
  std::string name;  // "cpu", "cuda": the instantiated tests' suffix
  std::function<absl::StatusOr<std::unique_ptr<Backend>>()> create;
  // Why this backend cannot run here (every test then skips), or "".
  std::function<std::string()> unavailable = [] { return std::string(); };
  BackendTolerances tolerances;
};

// gtest prints parameters in failure messages: the name, not the bytes.
inline void PrintTo(const BackendUnderTest& backend, std::ostream* os) {
  *os << backend.name;
}
inline std::string BackendUnderTestName(
    const ::testing::TestParamInfo<BackendUnderTest>& info) {
  return info.param.name;
}

class BackendConformanceTest
    : public ::testing::TestWithParam<BackendUnderTest> {
 protected:
  void SetUp() override;

  // A fresh buffer holding `host`.
  DeviceBuffer Upload(const std::vector<float>& host);
  DeviceBuffer Zeros(int64_t count);
  std::vector<float> Download(const DeviceBuffer& buffer);
  // `count` elements from `data` (a pointer into a backend buffer).
  std::vector<float> Download(const float* data, int64_t count);

  const BackendTolerances& tolerances() const { return GetParam().tolerances; }

  std::unique_ptr<Backend> backend_;
};

}  // namespace canzona

#endif  // CANZONA_TESTS_UNIT_KERNELS_BACKEND_CONFORMANCE_H_
