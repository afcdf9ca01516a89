// The NCCL communicator without a GPU, against FakeNcclApi (record-only):
// the uneven-count chooser, the fake's model of non-blocking NCCL, and the
// translation of each collective into NCCL calls. Creation, waits,
// failures and teardown are in nccl_communicator_lifetime_test.cc, results
// on simulated data against float64 references in
// nccl_communicator_data_test.cc.
#include "server/comm/nccl_communicator.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/comm/nccl_api.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/fake_nccl_api.h"
#include "tests/unit/comm/nccl_communicator_test_util.h"

namespace canzona::testing {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

constexpr NcclCommState kReady = NcclCommState::kReady;
constexpr NcclCommState kInProgress = NcclCommState::kInProgress;
constexpr NcclDataType kF32 = NcclDataType::kFloat32;

// --- ChooseUneven -----------------------------------------------------------

TEST(ChooseUnevenTest, PaddingWinsWhenItsBytesCostLessThanTheSavedLaunches) {
  // pad = 4 * (3 * 1001 - 3000) = 12 bytes: nothing against 2 launches.
  const NcclCostModel cost{.launch_us = 15, .bytes_per_us = 25000};
  EXPECT_EQ(ChooseUneven({1000, 1001, 999}, cost), NcclUneven::kPadded);
  // Huge imbalance: pad = 4 * (3 * 2^24 - 2^24 - 16) ~ 134 MB ~ 5.4 ms.
  EXPECT_EQ(ChooseUneven({1 << 24, 0, 16}, cost), NcclUneven::kPerRoot);
}

TEST(ChooseUnevenTest, ExactThreshold) {
  // P = 3 nonzero, pad = 4 * (4 * 10 - 25) = 60 bytes; saved = 2 launches.
  const std::vector<int64_t> counts = {10, 5, 10, 0};
  // 60 / 2 = 30 us of padding vs 2 * 15 = 30 us saved: a tie is per-root.
  EXPECT_EQ(ChooseUneven(counts, {.launch_us = 15, .bytes_per_us = 2}),
            NcclUneven::kPerRoot);
  EXPECT_EQ(ChooseUneven(counts, {.launch_us = 15.01, .bytes_per_us = 2}),
            NcclUneven::kPadded);
  EXPECT_EQ(ChooseUneven(counts, {.launch_us = 14.99, .bytes_per_us = 2}),
            NcclUneven::kPerRoot);
}

TEST(ChooseUnevenTest, DegenerateInputsArePerRoot) {
  const NcclCostModel cheap_bytes{.launch_us = 1000, .bytes_per_us = 1e12};
  EXPECT_EQ(ChooseUneven({0, 0, 0}, cheap_bytes), NcclUneven::kPerRoot);
  EXPECT_EQ(ChooseUneven({0, 7, 0}, cheap_bytes), NcclUneven::kPerRoot);
  EXPECT_EQ(ChooseUneven({}, cheap_bytes), NcclUneven::kPerRoot);
  EXPECT_EQ(ChooseUneven({3, 4}, {.launch_us = 1000, .bytes_per_us = 0}),
            NcclUneven::kPerRoot);
  EXPECT_EQ(ChooseUneven({3, 4}, cheap_bytes), NcclUneven::kPadded);
  EXPECT_STREQ(NcclUnevenName(NcclUneven::kPadded), "padded");
}

TEST(NcclUniqueIdTest, HexRoundTripAndRejects) {
  NcclUniqueId id;
  for (size_t i = 0; i < id.bytes.size(); ++i) id.bytes[i] = char(i * 7);
  std::string hex = id.ToHex();
  EXPECT_THAT(hex, SizeIs(256));
  ASSERT_OK_AND_ASSIGN(NcclUniqueId back, NcclUniqueId::FromHex(hex));
  EXPECT_EQ(back.bytes, id.bytes);
  EXPECT_THAT(NcclUniqueId::FromHex("abc"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(NcclUniqueId::FromHex(std::string(256, 'g')),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// --- The fake's model of non-blocking NCCL ----------------------------------

// What CommGetAsyncError says (an error fails the test).
NcclCommState Poll(FakeNcclApi& api, NcclComm comm) {
  absl::StatusOr<NcclCommState> state = api.CommGetAsyncError(comm);
  EXPECT_OK(state);
  return state.ok() ? *state : NcclCommState::kReady;
}

TEST(FakeNcclApiTest, NonBlockingCallsStayInProgressUntilPolled) {
  FakeNcclApi api;
  ASSERT_OK_AND_ASSIGN(NcclUniqueId id, api.GetUniqueId());
  ASSERT_OK_AND_ASSIGN(NcclComm a, api.CommInitRank(2, id, 0, false));
  // Rank 1 has not arrived: the initialization cannot finish, and the
  // communicator may not be used meanwhile.
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(Poll(api, a), kInProgress);
  }
  float x = 0;
  const NcclStream s = FakeNcclApi::Stream(0);
  EXPECT_THAT(api.AllReduce(&x, &x, 1, kF32, a, s),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("still in progress")));
  ASSERT_OK(api.SetDevice(1));  // one GPU per rank
  ASSERT_OK_AND_ASSIGN(NcclComm b, api.CommInitRank(2, id, 1, false));
  EXPECT_EQ(Poll(api, a), kInProgress);  // launch
  EXPECT_EQ(Poll(api, a), kReady);
  EXPECT_EQ(Poll(api, b), kInProgress);
  EXPECT_EQ(Poll(api, b), kReady);

  // A collective is in progress until the next poll launches it; a second
  // call before that is rejected.
  ASSERT_OK(api.AllReduce(&x, &x, 1, kF32, a, s));
  EXPECT_THAT(api.AllReduce(&x, &x, 1, kF32, a, s),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(Poll(api, a), kInProgress);
  EXPECT_EQ(Poll(api, a), kReady);

  // A peer that never connects: in progress for good, until aborted.
  api.SetNeverReady(true);
  ASSERT_OK(api.AllReduce(&x, &x, 1, kF32, a, s));
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(Poll(api, a), kInProgress);
  }
  EXPECT_OK(api.CommAbort(a));

  // Blocking communicators are never in progress.
  ASSERT_OK_AND_ASSIGN(NcclUniqueId solo, api.GetUniqueId());
  ASSERT_OK_AND_ASSIGN(NcclComm c, api.CommInitRank(3, solo, 0, true));
  EXPECT_EQ(Poll(api, c), kReady);
}

// What a node of many GPUs enforces and a one-GPU machine never shows: the
// device each stream, event and communicator was created on.
TEST(FakeNcclApiTest, KeepsCudaAndNcclRulesAboutDevices) {
  FakeNcclApi api;
  float x = 1, y = 0;
  ASSERT_OK(api.SetDevice(1));
  ASSERT_OK_AND_ASSIGN(NcclStream on1, api.StreamCreate());
  ASSERT_OK_AND_ASSIGN(NcclEvent event1, api.EventCreate());
  ASSERT_OK(api.SetDevice(0));
  ASSERT_OK_AND_ASSIGN(NcclStream on0, api.StreamCreate());
  ASSERT_OK_AND_ASSIGN(NcclEvent event0, api.EventCreate());
  // Copies and waits may cross devices; a kernel goes to a stream of the
  // current device, an event to a stream of its own.
  EXPECT_OK(api.MemcpyAsync(&y, &x, sizeof(x), on1));
  EXPECT_OK(api.StreamWaitEvent(on1, event0));
  EXPECT_THAT(
      api.ConvertAsync(DType::kFloat32, &x, DType::kFloat32, &y, 1, on1),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("a stream of device 1 used with the current device "
                         "on device 0")));
  EXPECT_THAT(api.EventRecord(event0, on1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("cudaEventRecord")));
  EXPECT_OK(api.EventRecord(event1, on1));
  EXPECT_OK(api.ConvertAsync(DType::kFloat32, &x, DType::kFloat32, &y, 1, on0));
  // An NCCL operation runs on a stream of its communicator's device.
  ASSERT_OK_AND_ASSIGN(NcclUniqueId solo, api.GetUniqueId());
  ASSERT_OK_AND_ASSIGN(NcclComm comm0, api.CommInitRank(1, solo, 0, true));
  EXPECT_THAT(api.AllReduce(&x, &x, 1, kF32, comm0, on1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("ncclAllReduce: a stream of device 1")));
  EXPECT_OK(api.AllReduce(&x, &x, 1, kF32, comm0, on0));
  // Two ranks of one communicator on one GPU: every rank's initialization
  // fails, as NCCL's "Duplicate GPU detected".
  ASSERT_OK_AND_ASSIGN(NcclUniqueId id, api.GetUniqueId());
  ASSERT_OK_AND_ASSIGN(NcclComm a, api.CommInitRank(2, id, 0, false));
  ASSERT_OK_AND_ASSIGN(NcclComm b, api.CommInitRank(2, id, 1, false));
  for (NcclComm c : {a, b}) {
    EXPECT_THAT(api.CommGetAsyncError(c),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("Duplicate GPU detected: rank 0 and rank 1 "
                                   "both on CUDA device 0")));
  }
}

// NCCL's in place is its own layouts only; another overlap of send and
// recv is undefined on a GPU (its ranks' kernels read and write at once),
// which the fake, summing before it writes, would otherwise let pass.
TEST(FakeNcclApiTest, SendAndRecvOverlapOnlyInNcclsInPlaceLayouts) {
  FakeNcclApi api;
  std::vector<float> buf(16);
  float* p = buf.data();
  ASSERT_OK_AND_ASSIGN(NcclStream stream, api.StreamCreate());
  ASSERT_OK_AND_ASSIGN(NcclUniqueId solo, api.GetUniqueId());
  ASSERT_OK_AND_ASSIGN(NcclComm comm, api.CommInitRank(1, solo, 0, true));
  const auto overlap = [](const char* name) {
    return StatusIs(absl::StatusCode::kInvalidArgument,
                    AllOf(HasSubstr(name), HasSubstr("overlap other than in "
                                                     "NCCL's in-place")));
  };
  EXPECT_THAT(api.AllReduce(p, p + 1, 4, kF32, comm, stream),
              overlap("ncclAllReduce"));
  EXPECT_THAT(api.ReduceScatter(p, p + 1, 4, kF32, comm, stream),
              overlap("ncclReduceScatter"));
  EXPECT_THAT(api.AllGather(p + 2, p, 4, kF32, comm, stream),
              overlap("ncclAllGather"));
  // In place (rank 0 of 1: at offset 0), and disjoint.
  EXPECT_OK(api.AllReduce(p, p, 4, kF32, comm, stream));
  EXPECT_OK(api.ReduceScatter(p, p, 4, kF32, comm, stream));
  EXPECT_OK(api.AllGather(p, p, 4, kF32, comm, stream));
  EXPECT_OK(api.ReduceScatter(p, p + 8, 4, kF32, comm, stream));
}

// --- Plan-to-call translation (record-only) ---------------------------------

TEST(NcclCommunicatorTest, UnevenReduceScatterPerRootIsGroupedReduces) {
  FakeNcclApi api;
  // Launches cheap, bytes dear: the padding of {5, 0, 3} is not worth it.
  NcclOptions options = Options();
  options.cost = {.launch_us = 1, .bytes_per_us = 1};
  ASSERT_EQ(ChooseUneven({5, 0, 3}, options.cost), NcclUneven::kPerRoot);
  auto comm = Solo(api, 0, 3, options);
  std::vector<float> send(8), recv(5);
  ASSERT_OK(comm->ReduceScatterV(send.data(), {5, 0, 3}, recv.data()));

  EXPECT_THAT(api.nccl_ops(), ElementsAre("ncclGroupStart", "ncclReduce",
                                          "ncclReduce", "ncclGroupEnd"));
  std::vector<FakeNcclCall> calls = api.nccl_calls();
  const int64_t group = calls[0].group;
  EXPECT_NE(group, 0);
  for (const FakeNcclCall& c : calls) EXPECT_EQ(c.group, group) << c.op;
  EXPECT_EQ(calls[1].root, 0);
  EXPECT_EQ(calls[1].count, 5);
  EXPECT_EQ(calls[1].send, send.data());
  EXPECT_EQ(calls[1].recv, recv.data());  // this rank is the root
  EXPECT_EQ(calls[1].group_depth, 1);
  EXPECT_EQ(calls[1].dtype, "float32");
  EXPECT_EQ(calls[2].root, 2);
  EXPECT_EQ(calls[2].count, 3);
  EXPECT_EQ(calls[2].send, send.data() + 5);
  EXPECT_EQ(calls[2].comm_rank, 0);
  // No staging: nothing allocated or copied.
  EXPECT_THAT(api.calls_named("cudaMalloc"), IsEmpty());
  EXPECT_THAT(api.calls_named("cudaMemcpyAsync"), IsEmpty());
  // Completion is awaited through the event.
  EXPECT_THAT(api.calls_named("cudaEventRecord"), SizeIs(1));
  EXPECT_GT(api.poll_count(), 0);
}

TEST(NcclCommunicatorTest, EvenCountsUseOneNativeCollective) {
  FakeNcclApi api;
  auto comm = Solo(api, 1, 3, Forced(NcclUneven::kPerRoot));
  std::vector<float> send(12), recv(4);
  ASSERT_OK(comm->ReduceScatterV(send.data(), {4, 4, 4}, recv.data()));
  std::vector<FakeNcclCall> calls = api.nccl_calls();
  ASSERT_THAT(calls, SizeIs(1));
  EXPECT_EQ(calls[0].op, "ncclReduceScatter");
  EXPECT_EQ(calls[0].count, 4);
  EXPECT_EQ(calls[0].send, send.data());
  EXPECT_EQ(calls[0].recv, recv.data());
  EXPECT_EQ(calls[0].group_depth, 0);

  api.ClearCalls();
  std::vector<float> gathered(12);
  ASSERT_OK(comm->AllGatherV(recv.data(), {4, 4, 4}, gathered.data()));
  calls = api.nccl_calls();
  ASSERT_THAT(calls, SizeIs(1));
  EXPECT_EQ(calls[0].op, "ncclAllGather");
  EXPECT_EQ(calls[0].count, 4);
  EXPECT_EQ(calls[0].send, recv.data());
  EXPECT_EQ(calls[0].recv, gathered.data());
}

TEST(NcclCommunicatorTest, NearlyEvenCountsWithDearLaunchesArePadded) {
  FakeNcclApi api;
  NcclOptions options = Options();
  options.cost = {.launch_us = 20, .bytes_per_us = 25000};
  const std::vector<int64_t> counts = {1000, 1001, 999};
  ASSERT_EQ(ChooseUneven(counts, options.cost), NcclUneven::kPadded);
  auto comm = Solo(api, 1, 3, options);
  std::vector<float> send(3000), recv(1001);
  ASSERT_OK(comm->ReduceScatterV(send.data(), counts, recv.data()));

  std::vector<FakeNcclCall> rs = api.calls_named("ncclReduceScatter");
  ASSERT_THAT(rs, SizeIs(1));
  EXPECT_EQ(rs[0].count, 1001);  // max(counts)
  EXPECT_THAT(api.nccl_ops(), ElementsAre("ncclReduceScatter"));
  // The staging is the scratch reserved at creation.
  EXPECT_THAT(api.calls_named("cudaMalloc"), IsEmpty());
  EXPECT_GE(comm->scratch_bytes(), 3 * 1001 * 4);
  auto* staging = static_cast<const float*>(rs[0].send);
  EXPECT_EQ(rs[0].recv, staging + 1 * 1001);  // in place in the staging
  std::vector<FakeNcclCall> copies = api.calls_named("cudaMemcpyAsync");
  ASSERT_THAT(copies, SizeIs(4));  // three slices in, this rank's out
  EXPECT_EQ(copies[0].recv, staging);
  EXPECT_EQ(copies[1].send, send.data() + 1000);
  EXPECT_EQ(copies[1].recv, staging + 1001);
  EXPECT_EQ(copies[1].count, 1001 * 4);
  EXPECT_EQ(copies[2].recv, staging + 2 * 1001);
  EXPECT_EQ(copies[3].send, staging + 1001);
  EXPECT_EQ(copies[3].recv, recv.data());
  // The copy out waits until NCCL has launched the reduce-scatter (polls
  // between them): before, it would run ahead of NCCL's kernel.
  EXPECT_GT(copies[3].polls, rs[0].polls);
  EXPECT_EQ(copies[2].polls, rs[0].polls);  // the copies in do not wait

  // Steady state: the staging buffer is reused, never reallocated.
  api.ClearCalls();
  ASSERT_OK(comm->ReduceScatterV(send.data(), counts, recv.data()));
  std::vector<float> gathered(3000);
  ASSERT_OK(comm->AllGatherV(recv.data(), counts, gathered.data()));
  EXPECT_THAT(api.calls_named("cudaMalloc"), IsEmpty());
  EXPECT_THAT(api.calls_named("cudaFree"), IsEmpty());
  std::vector<FakeNcclCall> ag = api.calls_named("ncclAllGather");
  ASSERT_THAT(ag, SizeIs(1));
  EXPECT_EQ(ag[0].count, 1001);
}

TEST(NcclCommunicatorTest, ScratchReservedAtCreationServesEveryPaddedCall) {
  FakeNcclApi api;
  NcclOptions options = Options();
  options.chooser = [](absl::Span<const int64_t>) {
    return NcclUneven::kPadded;
  };
  options.scratch_floats = 3 * 1001;
  ASSERT_OK_AND_ASSIGN(
      auto comm, NcclCommunicator::Create(
                     &api, InitRank(api, 0, 3),
                     {.rank = 0, .device = 0, .stream = FakeNcclApi::Stream(0)},
                     3, options));
  EXPECT_THAT(api.calls_named("cudaMalloc"), SizeIs(1));
  EXPECT_GE(comm->scratch_bytes(), 3 * 1001 * 4);
  api.ClearCalls();
  const std::vector<int64_t> counts = {1000, 1001, 999};
  std::vector<float> send(3000), recv(1001), gathered(3000);
  ASSERT_OK(comm->ReduceScatterV(send.data(), counts, recv.data()));
  ASSERT_OK(comm->AllGatherV(recv.data(), counts, gathered.data()));
  EXPECT_THAT(api.calls_named("ncclReduceScatter"), SizeIs(1));
  EXPECT_THAT(api.calls_named("cudaMalloc"), IsEmpty());
}

TEST(NcclCommunicatorTest, NoOperationAllocatesOrFreesAfterCreation) {
  FakeNcclApi api;
  NcclOptions options = Options();
  bool padded = false;
  options.chooser = [&padded](absl::Span<const int64_t>) {
    return padded ? NcclUneven::kPadded : NcclUneven::kPerRoot;
  };
  options.scratch_floats = 3 * 1001;  // exactly the largest need below
  auto comm = Solo(api, 1, 3, options);
  const std::vector<int64_t> uneven = {1000, 1001, 999};
  const std::vector<int64_t> even = {1000, 1000, 1000};
  std::vector<float> a(3000), b(3000);
  for (bool p : {false, true}) {
    padded = p;
    ASSERT_OK(comm->ReduceScatterV(a.data(), uneven, b.data()));
    ASSERT_OK(comm->ReduceScatterV(a.data(), uneven, a.data()));  // staged
    ASSERT_OK(comm->AllGatherV(b.data(), uneven, a.data()));
    ASSERT_OK(comm->AllGatherV(a.data(), uneven, a.data()));  // staged
  }
  ASSERT_OK(comm->ReduceScatterV(a.data(), even, b.data()));
  ASSERT_OK(comm->AllGatherV(b.data(), even, a.data()));
  ASSERT_OK(comm->AllToAllV(a.data(), {5, 6, 7}, b.data(), {7, 6, 5}));
  ASSERT_OK(comm->EnqueueAllToAll(a.data(), {5, 6, 7}, b.data(), {7, 6, 5}));
  ASSERT_OK(comm->Flush());
  ASSERT_OK(comm->AllReduce(a.data(), 3000));
  ASSERT_OK(comm->Broadcast(a.data(), 3000, 2));
  ASSERT_OK(comm->Barrier());
  EXPECT_THAT(api.calls_named("ncclReduceScatter"), SizeIs(3));
  EXPECT_THAT(api.calls_named("cudaMalloc"), IsEmpty());
  EXPECT_THAT(api.calls_named("cudaFree"), IsEmpty());
}

TEST(NcclCommunicatorTest,
     NeedingMoreScratchThanReservedFailsWithoutAllocating) {
  FakeNcclApi api;
  NcclOptions options = Forced(NcclUneven::kPadded);
  options.scratch_floats = 100;
  auto comm = Solo(api, 0, 3, options);
  EXPECT_EQ(comm->scratch_bytes(), 400);
  std::vector<float> send(3000), recv(1001);
  EXPECT_THAT(comm->ReduceScatterV(send.data(), {1000, 1001, 999}, recv.data()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("ReduceScatterV"), HasSubstr("3003"),
                             HasSubstr("100 were reserved"))));
  EXPECT_THAT(api.calls_named("cudaMalloc"), IsEmpty());
  EXPECT_THAT(api.calls_named("cudaFree"), IsEmpty());
  EXPECT_THAT(api.nccl_calls(), IsEmpty());
  // Peers may have entered the collective this rank skipped: the
  // communicator cannot stay in step with them.
  EXPECT_THAT(api.calls_named("ncclCommAbort"), SizeIs(1));
  EXPECT_THAT(comm->Barrier(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                        HasSubstr("scratch")));
}

TEST(NcclCommunicatorTest, WithoutAReservationScratchHoldsBarriersFloat) {
  FakeNcclApi api;
  NcclOptions options = Options();
  options.scratch_floats = 0;
  auto comm = Solo(api, 0, 2, options);
  EXPECT_EQ(comm->scratch_bytes(), 4);
  ASSERT_OK(comm->Barrier());
  EXPECT_THAT(api.calls_named("cudaMalloc"), IsEmpty());
  options.scratch_floats = -1;
  EXPECT_THAT(
      NcclCommunicator::Create(&api, InitRank(api, 0, 2),
                               {.stream = FakeNcclApi::Stream(0)}, 2, options),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("scratch_floats")));
}

TEST(NcclCommunicatorTest, UnevenAllGatherPerRootIsGroupedBroadcasts) {
  FakeNcclApi api;
  auto comm = Solo(api, 2, 3, Forced(NcclUneven::kPerRoot));
  std::vector<float> send(3), recv(8);
  ASSERT_OK(comm->AllGatherV(send.data(), {5, 0, 3}, recv.data()));
  EXPECT_THAT(api.nccl_ops(), ElementsAre("ncclGroupStart", "ncclBroadcast",
                                          "ncclBroadcast", "ncclGroupEnd"));
  std::vector<FakeNcclCall> calls = api.nccl_calls();
  EXPECT_EQ(calls[1].root, 0);
  EXPECT_EQ(calls[1].count, 5);
  EXPECT_EQ(calls[1].recv, recv.data());
  EXPECT_EQ(calls[2].root, 2);
  EXPECT_EQ(calls[2].count, 3);
  EXPECT_EQ(calls[2].send, send.data());  // this rank is the root
  EXPECT_EQ(calls[2].recv, recv.data() + 5);
  EXPECT_EQ(calls[1].group, calls[2].group);
}

TEST(NcclCommunicatorTest, AllToAllVIsGroupedSendRecvSkippingZeros) {
  FakeNcclApi api;
  auto comm = Solo(api, 1, 3, Options());
  // Rank 1 sends {2, 3, 0} and receives {4, 3, 1}.
  std::vector<float> send(5), recv(8);
  ASSERT_OK(comm->AllToAllV(send.data(), {2, 3, 0}, recv.data(), {4, 3, 1}));
  EXPECT_THAT(api.nccl_ops(),
              ElementsAre("ncclGroupStart", "ncclSend", "ncclRecv", "ncclRecv",
                          "ncclGroupEnd"));
  std::vector<FakeNcclCall> calls = api.nccl_calls();
  EXPECT_EQ(calls[1].root, 0);
  EXPECT_EQ(calls[1].count, 2);
  EXPECT_EQ(calls[1].send, send.data());
  EXPECT_EQ(calls[2].root, 0);
  EXPECT_EQ(calls[2].count, 4);
  EXPECT_EQ(calls[2].recv, recv.data());
  EXPECT_EQ(calls[3].root, 2);
  EXPECT_EQ(calls[3].count, 1);
  EXPECT_EQ(calls[3].recv, recv.data() + 7);
  for (int i = 1; i <= 3; ++i) EXPECT_EQ(calls[i].group_depth, 1);
  // The own slice is a device copy.
  std::vector<FakeNcclCall> copies = api.calls_named("cudaMemcpyAsync");
  ASSERT_THAT(copies, SizeIs(1));
  EXPECT_EQ(copies[0].send, send.data() + 2);
  EXPECT_EQ(copies[0].recv, recv.data() + 4);
  EXPECT_EQ(copies[0].count, 3 * 4);
}

TEST(NcclCommunicatorTest, AllReduceBroadcastBarrierMapping) {
  FakeNcclApi api;
  auto comm = Solo(api, 0, 2, Options());
  std::vector<float> data(6);
  ASSERT_OK(comm->AllReduce(data.data(), 6));
  ASSERT_OK(comm->Broadcast(data.data(), 4, 1));
  ASSERT_OK(comm->Barrier());
  ASSERT_OK(comm->AllReduce(nullptr, 0));  // nothing to move: no NCCL call
  std::vector<FakeNcclCall> calls = api.nccl_calls();
  ASSERT_THAT(calls, SizeIs(3));
  EXPECT_EQ(calls[0].op, "ncclAllReduce");
  EXPECT_EQ(calls[0].send, data.data());
  EXPECT_EQ(calls[0].recv, data.data());
  EXPECT_EQ(calls[0].count, 6);
  EXPECT_EQ(calls[1].op, "ncclBroadcast");
  EXPECT_EQ(calls[1].root, 1);
  EXPECT_EQ(calls[1].count, 4);
  EXPECT_EQ(calls[2].op, "ncclAllReduce");
  EXPECT_EQ(calls[2].count, 1);
  EXPECT_NE(calls[2].recv, data.data());  // the scratch float
}

TEST(NcclCommunicatorTest, InPlaceReduceScatterStagesThroughScratch) {
  FakeNcclApi api;
  auto comm = Solo(api, 1, 2, Forced(NcclUneven::kPerRoot));
  std::vector<float> buf(7);
  // recv == send is not NCCL's in-place layout for rank 1 (send + 3).
  ASSERT_OK(comm->ReduceScatterV(buf.data(), {3, 4}, buf.data()));
  std::vector<FakeNcclCall> reduces = api.calls_named("ncclReduce");
  ASSERT_THAT(reduces, SizeIs(2));
  EXPECT_NE(reduces[1].recv, buf.data());
  std::vector<FakeNcclCall> copies = api.calls_named("cudaMemcpyAsync");
  ASSERT_THAT(copies, SizeIs(1));
  EXPECT_EQ(copies[0].send, reduces[1].recv);
  EXPECT_EQ(copies[0].recv, buf.data());
  // NCCL's own in-place layout needs no staging.
  api.ClearCalls();
  ASSERT_OK(comm->ReduceScatterV(buf.data(), {3, 4}, buf.data() + 3));
  EXPECT_THAT(api.calls_named("cudaMemcpyAsync"), IsEmpty());
  EXPECT_EQ(api.calls_named("ncclReduce")[1].recv, buf.data() + 3);
}

TEST(NcclCommunicatorTest, InvalidArgumentsMakeNoCallAndKeepItUsable) {
  FakeNcclApi api;
  auto comm = Solo(api, 0, 3, Options());
  std::vector<float> buf(16);
  float* p = buf.data();
  EXPECT_THAT(comm->ReduceScatterV(p, {1, -2, 3}, p),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("counts[1] is negative")));
  EXPECT_THAT(comm->ReduceScatterV(p, {1, 2}, p),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("counts has 2 entries")));
  EXPECT_THAT(comm->ReduceScatterV(nullptr, {1, 2, 3}, p),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("send")));
  EXPECT_THAT(comm->AllGatherV(p, {1, 2, 3}, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("recv")));
  EXPECT_THAT(comm->AllToAllV(p, {1, 0, 0}, p, {2, 0, 0}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("send_counts[0]")));
  EXPECT_THAT(comm->AllReduce(p, -1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("count")));
  EXPECT_THAT(comm->Broadcast(p, 1, 3),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("root")));
  EXPECT_THAT(api.calls(), IsEmpty());
  EXPECT_OK(comm->AllReduce(p, 4));
}

}  // namespace
}  // namespace canzona::testing
