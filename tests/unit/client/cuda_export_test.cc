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
  if (event.ok()) GTEST_SKIP() << "this machine has a CUDA device";
  EXPECT_EQ(event.status().code(), absl::StatusCode::kFailedPrecondition)
      << event.status();
  EXPECT_THAT(std::string(event.status().message()),
              ::testing::HasSubstr("no usable CUDA device"));
}

// The daemon's "parameters written" events, opened in the trainer: a bad
// handle is refused before CUDA is asked; without a device, the reason.
TEST(CudaExportTest, OpenedEventNeedsAHandleAndADevice) {
  const auto short_handle = CudaOpenedEvent::Open("abc", 0);
  ASSERT_FALSE(short_handle.ok());
  EXPECT_EQ(short_handle.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(short_handle.status().message()),
              ::testing::HasSubstr("3 bytes, not 64"));
  if (CudaExportEvent::Create(0).ok()) {
    GTEST_SKIP() << "this machine has a CUDA device";
  }
  const auto opened = CudaOpenedEvent::Open(std::string(64, 'x'), 0);
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition)
      << opened.status();
}

}  // namespace
}  // namespace canzona
