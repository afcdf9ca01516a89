// Backend factory: name parsing, cpu creation, and the cuda fallback error
// the server relies on to choose the cpu backend.
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(BackendFactoryTest, CreatesCpuBackend) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> backend,
                       CreateBackend(BackendKind::kCpu));
  EXPECT_EQ(backend->kind(), BackendKind::kCpu);
  EXPECT_THAT(backend->description(), StartsWith("cpu ("));
  EXPECT_THAT(backend->description(), HasSubstr("threads)"));
}

TEST(BackendFactoryTest, CreateCpuBackendDirectly) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> backend, CreateCpuBackend());
  EXPECT_EQ(backend->kind(), BackendKind::kCpu);
}

TEST(BackendFactoryTest, CreatesByName) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> backend,
                       CreateBackendByName("cpu"));
  EXPECT_EQ(backend->kind(), BackendKind::kCpu);
}

TEST(BackendFactoryTest, RejectsUnknownNameNamingTheValue) {
  EXPECT_THAT(CreateBackendByName("bogus"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bogus")));
  EXPECT_THAT(ParseBackendKind("tpu"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tpu")));
}

TEST(BackendFactoryTest, KindNamesRoundTrip) {
  for (BackendKind kind : {BackendKind::kCpu, BackendKind::kCuda}) {
    ASSERT_OK_AND_ASSIGN(BackendKind parsed,
                         ParseBackendKind(BackendKindName(kind)));
    EXPECT_EQ(parsed, kind);
  }
  EXPECT_EQ(BackendKindName(BackendKind::kCpu), "cpu");
  EXPECT_EQ(BackendKindName(BackendKind::kCuda), "cuda");
}

TEST(BackendFactoryTest, CudaWithoutDeviceIsFailedPrecondition) {
  if (CudaDeviceCount() > 0) {
    GTEST_SKIP() << "a CUDA device is present; tests/gpu covers creation";
  }
  EXPECT_THAT(CreateBackend(BackendKind::kCuda),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       StartsWith("no usable CUDA device")));
}

TEST(BackendFactoryTest, AutoFallsBackToCpuWithoutDevice) {
  if (CudaDeviceCount() > 0) {
    GTEST_SKIP() << "a CUDA device is present; auto picks cuda";
  }
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> backend,
                       CreateBackendByName("auto"));
  EXPECT_EQ(backend->kind(), BackendKind::kCpu);
}

}  // namespace
}  // namespace canzona
