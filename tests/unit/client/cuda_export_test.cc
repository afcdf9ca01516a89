// The client's CUDA IPC export without a GPU: every call fails with a
// clear status and never crashes, whether the CUDA runtime is installed
// (this machine: libcudart without a driver) or not. On a GPU machine a
// host pointer is not device memory. The success path is
// tests/gpu/cuda_ipc_gpu_test.cc.
#include "client/lib/cuda_export.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::testing::AnyOf;
using ::testing::Eq;

TEST(CudaExportTest, HostMemoryIsRefused) {
  std::vector<float> host(64);
  const auto ref = CudaBufferRef(host.data(), host.size() * sizeof(float));
  ASSERT_FALSE(ref.ok());
  EXPECT_THAT(ref.status().code(),
              AnyOf(Eq(absl::StatusCode::kFailedPrecondition),
                    Eq(absl::StatusCode::kInvalidArgument)))
      << ref.status();
  EXPECT_FALSE(CudaBufferRef(nullptr, 4).ok());
}

TEST(CudaExportTest, EventNeedsADevice) {
  const auto event = CudaExportEvent::Create(0);
  if (event.ok()) {
    // A GPU: recorded, then waited for, on the legacy default stream.
    EXPECT_TRUE((*event)->Record(nullptr).ok());
    EXPECT_TRUE((*event)->Wait(nullptr).ok());
    return;
  }
  EXPECT_EQ(event.status().code(), absl::StatusCode::kFailedPrecondition)
      << event.status();
  EXPECT_THAT(std::string(event.status().message()),
              ::testing::HasSubstr("no usable CUDA device"));
}

}  // namespace
}  // namespace canzona
