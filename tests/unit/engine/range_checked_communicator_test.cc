// RangeCheckedCommunicator alone: every collective's buffers against the
// staging backend's allocations, device rules (inside one allocation) and
// host rules (never leaving or running into one); a violation names the
// collective, the buffer and the range, and the inner communicator is not
// called. CheckAllToAll (the NCCL TP lane's enqueued all-to-alls) checks
// what AllToAllV checks.
#include "server/engine/range_checked_communicator.h"

#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// Two ranks' worth of counts; records whether a collective got through.
class RecordingCommunicator final : public Communicator {
 public:
  explicit RecordingCommunicator(int* calls) : calls_(calls) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  absl::Status ReduceScatterVTyped(DType, const void*,
                                   absl::Span<const int64_t>, void*) override {
    return Called();
  }
  absl::Status AllGatherVTyped(DType, const void*, absl::Span<const int64_t>,
                               void*) override {
    return Called();
  }
  absl::Status AllToAllV(const float*, absl::Span<const int64_t>, float*,
                         absl::Span<const int64_t>) override {
    return Called();
  }
  absl::Status AllReduce(float*, int64_t) override { return Called(); }
  absl::Status Broadcast(float*, int64_t, int) override { return Called(); }
  absl::Status Barrier() override { return Called(); }
  void Abort() override {}

 private:
  absl::Status Called() {
    ++*calls_;
    return absl::OkStatus();
  }
  int* const calls_;
};

class RangeCheckedCommunicatorTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    const bool device = GetParam();
    ASSERT_OK_AND_ASSIGN(
        backend_,
        CreateCpuBackend(device ? MemorySpace::kDevice : MemorySpace::kHost));
    ASSERT_OK_AND_ASSIGN(a_, backend_->Allocate(16));
    ASSERT_OK_AND_ASSIGN(b_, backend_->Allocate(16));
    comm_ = std::make_unique<RangeCheckedCommunicator>(
        std::make_unique<RecordingCommunicator>(&calls_),
        &backend_->allocations(), device);
  }

  std::unique_ptr<Backend> backend_;
  DeviceBuffer a_, b_;
  int calls_ = 0;
  std::unique_ptr<RangeCheckedCommunicator> comm_;
};

TEST_P(RangeCheckedCommunicatorTest, RangesInsideTheirBuffersGoThrough) {
  const std::vector<int64_t> counts = {8, 8};
  ASSERT_OK(comm_->AllReduce(a_.data(), 16));
  ASSERT_OK(comm_->ReduceScatterV(a_.data(), counts, b_.data()));
  ASSERT_OK(comm_->AllGatherV(a_.data() + 8, counts, b_.data()));
  ASSERT_OK(comm_->AllToAllV(a_.data(), counts, b_.data(), counts));
  ASSERT_OK(comm_->CheckAllToAll(a_.data(), counts, b_.data(), counts));
  EXPECT_EQ(calls_, 4);
}

TEST_P(RangeCheckedCommunicatorTest, OverrunsAreRefusedBeforeTheCollective) {
  const std::vector<int64_t> counts = {8, 8}, more = {8, 9};
  EXPECT_THAT(
      comm_->AllReduce(a_.data() + 1, 16),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("AllReduce: data"), HasSubstr("past the end"))));
  EXPECT_THAT(comm_->ReduceScatterV(a_.data(), more, b_.data()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("ReduceScatterV: send")));
  EXPECT_THAT(comm_->AllGatherV(a_.data() + 8, more, b_.data()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("AllGatherV: recv")));
  EXPECT_THAT(comm_->AllToAllV(a_.data(), counts, b_.data() + 1, counts),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("AllToAllV: recv")));
  EXPECT_THAT(comm_->CheckAllToAll(a_.data() + 1, counts, b_.data(), counts),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("AllToAllV: send")));
  EXPECT_EQ(calls_, 0);
}

// Host memory outside every allocation: a device communicator refuses it
// (it is not the GPU's), a host one takes it.
TEST_P(RangeCheckedCommunicatorTest, MemoryOutsideTheAllocations) {
  std::vector<float> host(16);
  const absl::Status s = comm_->AllReduce(host.data(), 16);
  if (GetParam()) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument,
                            HasSubstr("AllReduce: data")));
    EXPECT_EQ(calls_, 0);
  } else {
    EXPECT_OK(s);
    EXPECT_EQ(calls_, 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Rules, RangeCheckedCommunicatorTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "device" : "host";
                         });

}  // namespace
}  // namespace canzona
