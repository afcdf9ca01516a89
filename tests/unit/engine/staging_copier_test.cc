// The staging copiers' hand-overs between a thread's copier stream and
// another stream (the compute backend's): on a device, events the other
// stream waits for, never a host wait; without a stream, Finish's wait;
// and the host waits each copier counts (StepResponse.host_waits).
#include "server/engine/staging_copier.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/base/dtype.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/fake_nccl_api.h"

namespace canzona {
namespace {

using ::canzona::testing::FakeNcclApi;
using ::canzona::testing::FakeNcclCall;
using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// No staging allocation: every range is host memory outside them.
const AllocationRegistry empty_staging;

TEST(StagingCopierTest, HandOversAreEventsNotHostWaits) {
  FakeNcclApi nccl;
  ASSERT_OK_AND_ASSIGN(
      auto copier,
      CreateDeviceStagingCopier(&nccl, 0, absl::Seconds(5), &empty_staging));
  const NcclStream compute = FakeNcclApi::Stream(7);
  std::vector<float> a(4, 1.0f), b(4);
  ASSERT_OK(copier->Copy(b.data(), a.data(), 16));
  nccl.ClearCalls();
  const int64_t polls = nccl.poll_count();
  ASSERT_OK(copier->HandTo(compute));
  ASSERT_OK(copier->TakeFrom(compute));
  // Recorded on the copier's stream, waited for by the compute stream;
  // then recorded on the compute stream, waited for by the copier's.
  std::vector<FakeNcclCall> calls;
  for (const FakeNcclCall& c : nccl.calls()) {
    if (c.op != "cudaSetDevice") calls.push_back(c);
  }
  ASSERT_EQ(calls.size(), 4u);
  EXPECT_EQ(calls[0].op, "cudaEventRecord");
  EXPECT_EQ(calls[0].stream, copier->stream());
  EXPECT_EQ(calls[1].op, "cudaStreamWaitEvent");
  EXPECT_EQ(calls[1].stream, compute);
  EXPECT_EQ(calls[2].op, "cudaEventRecord");
  EXPECT_EQ(calls[2].stream, compute);
  EXPECT_EQ(calls[3].op, "cudaStreamWaitEvent");
  EXPECT_EQ(calls[3].stream, copier->stream());
  EXPECT_NE(calls[1].send, calls[3].send) << "one event each way";
  EXPECT_EQ(nccl.poll_count(), polls);
  EXPECT_EQ(copier->host_waits(), 0);

  // A backend without a stream gets the host wait.
  ASSERT_OK(copier->HandTo(nullptr));
  EXPECT_GT(nccl.poll_count(), polls);
  EXPECT_EQ(copier->host_waits(), 1);
  ASSERT_OK(copier->Finish());
  EXPECT_EQ(copier->host_waits(), 2);
  EXPECT_THAT(copier->TakeFrom(nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(StagingCopierTest, HostCopiersHaveNothingInFlight) {
  auto copier = CreateHostStagingCopier(&empty_staging);
  std::vector<float> a(4, 2.0f), b(4);
  ASSERT_OK(copier->Copy(b.data(), a.data(), 16));
  EXPECT_EQ(b[3], 2.0f);  // done on return
  ASSERT_OK(copier->HandTo(nullptr));
  ASSERT_OK(copier->Finish());
  EXPECT_EQ(copier->host_waits(), 0);
  EXPECT_THAT(copier->TakeFrom(FakeNcclApi::Stream(1)),
              StatusIs(absl::StatusCode::kInternal));
}

// ReloadMasters on both copiers (the device one through the fake's
// kernel, on host memory standing in): a master that rounds to the
// trainer's bf16 value keeps its bits, one that does not takes the value;
// a masters range past its staging allocation is refused naming the
// method and the side, before anything runs.
TEST(StagingCopierTest, ReloadMastersKeepsWhatRoundsAndChecksItsRanges) {
  FakeNcclApi nccl({.simulate_data = true});
  AllocationRegistry staging;
  std::vector<float> masters(4);
  ASSERT_OK(staging.Add(masters.data(), 4 * sizeof(float), "masters"));
  std::vector<uint16_t> values(4);
  ASSERT_OK_AND_ASSIGN(auto device, CreateDeviceStagingCopier(
                                        &nccl, 0, absl::Seconds(5), &staging));
  const auto host = CreateHostStagingCopier(&staging);
  for (StagingCopier* copier : {device.get(), host.get()}) {
    masters = {1.0001f, -2.0003f, 0.50002f, 3.0f};
    const std::vector<float> before = masters;
    for (int i = 0; i < 4; ++i) values[i] = FloatToBFloat16(masters[i]);
    values[2] = FloatToBFloat16(0.75f);  // the trainer changed this one
    // The device copier's kernel reads device memory only: the values
    // lie in staging there (a trainer's IPC buffer is registered).
    AllocationRegistry* registry = &staging;
    if (copier == device.get()) {
      ASSERT_OK(registry->Add(values.data(), 8, "trainer values"));
    }
    ASSERT_OK(copier->ReloadMasters(DType::kBFloat16, values.data(),
                                    masters.data(), 4));
    ASSERT_OK(copier->Finish());
    EXPECT_EQ(masters[0], before[0]);
    EXPECT_EQ(masters[1], before[1]);
    EXPECT_EQ(masters[2], 0.75f);
    EXPECT_EQ(masters[3], before[3]);
    EXPECT_THAT(copier->ReloadMasters(DType::kBFloat16, values.data(),
                                      masters.data() + 1, 4),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("StagingCopier::ReloadMasters"),
                               HasSubstr("dst"))));
    if (copier == device.get()) registry->Remove(values.data());
  }
}

}  // namespace
}  // namespace canzona
