// The NCCL communicator without a GPU: its plan-to-call translation, its
// waits on non-blocking NCCL calls and on the stream, failures, abort,
// rendezvous and teardown against FakeNcclApi (record-only for the call
// sequences, data mode for results against float64 references), and the
// uneven-count chooser.
#include "server/comm/nccl_communicator.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/comm/fake_communicator.h"
#include "server/comm/nccl_api.h"
#include "server/control/kv_store.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/comm_test_util.h"
#include "tests/unit/comm/fake_nccl_api.h"

namespace canzona {

// Test names and failure messages print the strategy's name.
inline void PrintTo(NcclUneven strategy, std::ostream* os) {
  *os << NcclUnevenName(strategy);
}

namespace testing {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

// Scratch for every padded or staged collective of these tests (the
// largest: 4 ranks x 40 floats).
constexpr int64_t kScratchFloats = 4096;

constexpr NcclCommState kReady = NcclCommState::kReady;
constexpr NcclCommState kInProgress = NcclCommState::kInProgress;
constexpr NcclDataType kF32 = NcclDataType::kFloat32;

NcclOptions Options(absl::Duration timeout = absl::Seconds(10)) {
  NcclOptions options;
  options.timeout = timeout;
  options.scratch_floats = kScratchFloats;
  return options;
}

NcclOptions Forced(NcclUneven strategy) {
  NcclOptions options = Options();
  options.chooser = [strategy](absl::Span<const int64_t>) { return strategy; };
  return options;
}

// `rank`'s non-blocking NCCL communicator of a group of `size` whose other
// ranks joined too (on a record-only fake they never take part in anything
// else), so that its initialization can finish.
NcclComm InitRank(FakeNcclApi& api, int rank, int size) {
  absl::StatusOr<NcclUniqueId> id = api.GetUniqueId();
  EXPECT_OK(id);
  NcclComm mine = nullptr;
  for (int r = 0; r < size; ++r) {
    EXPECT_OK(api.SetDevice(r));  // a GPU per rank, as NCCL needs
    absl::StatusOr<NcclComm> comm =
        api.CommInitRank(size, *id, r, /*blocking=*/false);
    EXPECT_OK(comm);
    if (r == rank) mine = *comm;
  }
  EXPECT_OK(api.SetDevice(rank));
  return mine;
}

// One rank of a nominal group, alone on a record-only fake.
std::unique_ptr<NcclCommunicator> Solo(FakeNcclApi& api, int rank, int size,
                                       const NcclOptions& options) {
  auto c = NcclCommunicator::Create(
      &api, InitRank(api, rank, size),
      {.rank = rank, .device = rank, .stream = FakeNcclApi::Stream(0)}, size,
      options);
  EXPECT_OK(c);
  api.ClearCalls();
  return std::move(*c);
}

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

// --- Waits and failures -----------------------------------------------------

TEST(NcclCommunicatorTest, NeverCompletingOpTimesOutAbortsAndBreaks) {
  FakeNcclApi api;
  auto comm = Solo(api, 0, 2, Options(absl::Milliseconds(100)));
  std::vector<float> data(4);
  api.SetHang(true);
  const absl::Time start = absl::Now();
  EXPECT_THAT(
      comm->AllReduce(data.data(), 4),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("AllReduce")));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_THAT(api.calls_named("ncclCommAbort"), SizeIs(1));
  EXPECT_THAT(comm->Barrier(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                        HasSubstr("AllReduce")));
  comm.reset();
  // An aborted NCCL communicator is not destroyed again; memory is freed.
  EXPECT_THAT(api.calls_named("ncclCommDestroy"), IsEmpty());
  EXPECT_EQ(api.live_allocations(), 0);
}

TEST(NcclCommunicatorTest, AsyncErrorIsUnavailableWithNcclsMessage) {
  FakeNcclApi api;
  auto comm = Solo(api, 0, 2, Options());
  std::vector<float> send(4), recv(2);
  api.SetHang(true);
  api.SetAsyncError(absl::InternalError("NCCL WARN peer 1 closed connection"));
  EXPECT_THAT(comm->ReduceScatterV(send.data(), {2, 2}, recv.data()),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("ReduceScatterV"),
                             HasSubstr("peer 1 closed connection"))));
  EXPECT_THAT(api.calls_named("ncclCommAbort"), SizeIs(1));
  EXPECT_THAT(comm->AllReduce(recv.data(), 2),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(NcclCommunicatorTest, FailedEnqueueBreaksTheCommunicator) {
  FakeNcclApi api;
  auto comm = Solo(api, 0, 2, Options());
  std::vector<float> data(4);
  api.FailNext("ncclAllReduce", absl::InternalError("ncclAllReduce: boom"));
  EXPECT_THAT(comm->AllReduce(data.data(), 4),
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(HasSubstr("AllReduce"), HasSubstr("boom"))));
  EXPECT_THAT(comm->AllReduce(data.data(), 4),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(NcclCommunicatorTest, AfterAbortEveryCallIsFailedPrecondition) {
  FakeNcclApi api;
  auto comm = Solo(api, 1, 2, Options());
  comm->Abort();
  comm->Abort();  // idempotent
  EXPECT_THAT(api.calls_named("ncclCommAbort"), SizeIs(1));
  std::vector<float> buf(8);
  float* p = buf.data();
  const auto kFp = absl::StatusCode::kFailedPrecondition;
  EXPECT_THAT(comm->ReduceScatterV(p, {1, 1}, p + 4), StatusIs(kFp));
  EXPECT_THAT(comm->AllGatherV(p, {1, 1}, p + 4), StatusIs(kFp));
  EXPECT_THAT(comm->AllToAllV(p, {1, 1}, p + 4, {1, 1}), StatusIs(kFp));
  EXPECT_THAT(comm->AllReduce(p, 2), StatusIs(kFp));
  EXPECT_THAT(comm->AllReduce(p, 0), StatusIs(kFp));
  EXPECT_THAT(comm->Broadcast(p, 2, 0), StatusIs(kFp));
  EXPECT_THAT(comm->Barrier(), StatusIs(kFp, HasSubstr("aborted")));
  EXPECT_THAT(api.nccl_calls(), IsEmpty());
}

TEST(NcclCommunicatorTest, AbortFromAnotherThreadEndsAWaitingCall) {
  FakeNcclApi api;
  auto comm = Solo(api, 0, 2, Options(absl::Seconds(30)));
  std::vector<float> data(4);
  api.SetHang(true);
  const absl::Time start = absl::Now();
  std::thread aborter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    comm->Abort();
  });
  EXPECT_THAT(comm->AllReduce(data.data(), 4),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("AllReduce"), HasSubstr("aborted"))));
  aborter.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_THAT(comm->AllReduce(data.data(), 4),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(NcclCommunicatorTest, ACallThatStaysInProgressTimesOutAndAborts) {
  FakeNcclApi api;
  auto comm = Solo(api, 0, 2, Options(absl::Milliseconds(100)));
  std::vector<float> data(4);
  // The first collective connects to a peer that never arrives.
  api.SetNeverReady(true);
  const absl::Time start = absl::Now();
  EXPECT_THAT(comm->AllReduce(data.data(), 4),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("AllReduce"), HasSubstr("launch"),
                             HasSubstr("100ms"))));
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(100));
  EXPECT_LT(took, absl::Seconds(10));
  EXPECT_THAT(api.calls_named("ncclCommAbort"), SizeIs(1));
  // Nothing reached the stream: no event was recorded behind the work.
  EXPECT_THAT(api.calls_named("cudaEventRecord"), IsEmpty());
  EXPECT_THAT(comm->Barrier(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                        HasSubstr("AllReduce")));
}

TEST(NcclCommunicatorTest,
     AbortIsPromptWhileAnotherThreadPollsAnInProgressCall) {
  FakeNcclApi api;
  const absl::Duration timeout = absl::Seconds(60);
  auto comm = Solo(api, 0, 2, Options(timeout));
  std::vector<float> data(4);
  api.SetNeverReady(true);
  const absl::Time start = absl::Now();
  absl::Status result;
  std::thread worker([&] { result = comm->AllReduce(data.data(), 4); });
  // Abort only once the worker is in its polling loop.
  const int64_t polls = api.poll_count();
  while (api.poll_count() < polls + 20 && absl::Now() - start < timeout) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_GE(api.poll_count(), polls + 20);
  const absl::Time abort_start = absl::Now();
  comm->Abort();
  const absl::Duration abort_took = absl::Now() - abort_start;
  worker.join();
  EXPECT_LT(abort_took, absl::Seconds(2));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_THAT(result,
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("AllReduce"), HasSubstr("aborted"))));
  EXPECT_THAT(api.calls_named("ncclCommAbort"), SizeIs(1));
  EXPECT_THAT(comm->AllReduce(data.data(), 4),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(NcclCommunicatorTest, EnqueueAllToAllReturnsOnceLaunchedWithoutWaiting) {
  FakeNcclApi api;
  auto comm = Solo(api, 1, 3, Options());
  std::vector<float> send(5), recv(8);
  api.SetHang(true);  // the work never completes on the stream
  ASSERT_OK(
      comm->EnqueueAllToAll(send.data(), {2, 3, 0}, recv.data(), {4, 3, 1}));
  EXPECT_THAT(api.nccl_ops(),
              ElementsAre("ncclGroupStart", "ncclSend", "ncclRecv", "ncclRecv",
                          "ncclGroupEnd"));
  EXPECT_THAT(api.calls_named("cudaEventRecord"), IsEmpty());
  // NCCL has launched the group: the next call on the communicator is
  // accepted (the fake rejects calls while one is in progress).
  std::vector<float> more(2);
  api.SetHang(false);
  ASSERT_OK(
      comm->EnqueueAllToAll(more.data(), {0, 0, 2}, recv.data(), {0, 0, 2}));
  EXPECT_THAT(api.calls_named("ncclSend"), SizeIs(2));
}

TEST(NcclCommunicatorTest, DestructionFinalizesThenDestroysAndFreesScratch) {
  FakeNcclApi api;
  auto comm = Solo(api, 0, 2, Options());
  ASSERT_OK(comm->Barrier());
  EXPECT_EQ(api.live_allocations(), 1);
  api.ClearCalls();
  comm.reset();
  std::vector<std::string> ops;
  for (const FakeNcclCall& c : api.calls()) ops.push_back(c.op);
  EXPECT_THAT(ops,
              ElementsAre("cudaSetDevice", "ncclCommFinalize", "cudaSetDevice",
                          "ncclCommDestroy", "cudaSetDevice", "cudaFree",
                          "cudaEventDestroy"));
  // Alone: no group. The fake rejects ncclCommDestroy while the
  // finalization is in progress, so the polls in between are what let it
  // through.
  const std::vector<FakeNcclCall> calls = api.calls();
  EXPECT_EQ(calls[1].group_depth, 0);
  EXPECT_GE(calls[3].polls - calls[1].polls, 2);
  EXPECT_EQ(api.live_allocations(), 0);
}

// --- Creation ---------------------------------------------------------------

TEST(CreateNcclCommunicatorTest, RendezvousThroughTheKvStore) {
  FakeNcclApi api;
  InMemoryKvStore store;
  constexpr int kSize = 4;
  std::vector<std::unique_ptr<Communicator>> comms(kSize);
  RunOnRanks(kSize, [&](int r) {
    if (r == 0) absl::SleepFor(absl::Milliseconds(20));  // others wait
    auto c = CreateNcclCommunicator(
        &store, "job/a/gen/0/dp/0", &api,
        {.rank = r, .device = r, .stream = FakeNcclApi::Stream(r)}, kSize,
        Options());
    ASSERT_OK(c);
    comms[r] = *std::move(c);
  });
  EXPECT_THAT(api.calls_named("ncclGetUniqueId"), SizeIs(1));
  std::vector<FakeNcclCall> inits = api.calls_named("ncclCommInitRank");
  ASSERT_THAT(inits, SizeIs(kSize));
  for (const FakeNcclCall& c : inits) {
    EXPECT_EQ(c.count, kSize);
    EXPECT_EQ(c.group_depth, 0);  // one rank per thread: no group
    EXPECT_TRUE(c.nonblocking);
  }
  ASSERT_OK_AND_ASSIGN(
      std::string hex,
      store.Get(NcclUniqueIdKey("job/a/gen/0/dp/0"), absl::Seconds(1)));
  EXPECT_THAT(hex, SizeIs(256));
  for (int r = 0; r < kSize; ++r) {
    EXPECT_EQ(comms[r]->rank(), r);
    EXPECT_EQ(comms[r]->size(), kSize);
  }
}

TEST(CreateNcclCommunicatorTest, APeerThatNeverArrivesBoundsInitialization) {
  FakeNcclApi api;
  InMemoryKvStore store;
  const absl::Time start = absl::Now();
  // Rank 0 publishes the id and initializes; rank 1 never comes.
  auto c = CreateNcclCommunicator(&store, "job/d/dp/0", &api,
                                  {.rank = 0, .stream = FakeNcclApi::Stream(0)},
                                  2, Options(absl::Milliseconds(200)));
  const absl::Duration took = absl::Now() - start;
  EXPECT_THAT(
      c, StatusIs(absl::StatusCode::kDeadlineExceeded,
                  AllOf(HasSubstr("rank 0 of 2"), HasSubstr("initialization"),
                        HasSubstr("did not arrive"))));
  EXPECT_GE(took, absl::Milliseconds(200));
  EXPECT_LT(took, absl::Seconds(10));
  EXPECT_THAT(api.calls_named("ncclCommInitRank"), SizeIs(1));
  EXPECT_THAT(api.calls_named("ncclCommAbort"), SizeIs(1));
  EXPECT_THAT(api.calls_named("cudaMalloc"), IsEmpty());
  EXPECT_THAT(api.calls_named("cudaEventCreate"), IsEmpty());
}

TEST(CreateNcclCommunicatorTest, MissingRootIsDeadlineExceededNamingTheKey) {
  FakeNcclApi api;
  InMemoryKvStore store;
  auto c = CreateNcclCommunicator(&store, "job/b/dp/1", &api,
                                  {.rank = 1, .stream = FakeNcclApi::Stream(1)},
                                  2, Options(absl::Milliseconds(50)));
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kDeadlineExceeded,
                          HasSubstr("job/b/dp/1/nccl_unique_id")));
  EXPECT_THAT(api.calls_named("ncclCommInitRank"), IsEmpty());
}

TEST(CreateNcclCommunicatorTest, InvalidArguments) {
  FakeNcclApi api;
  InMemoryKvStore store;
  const NcclLocalRank a{.rank = 0, .device = 0};
  const NcclLocalRank b{.rank = 0, .device = 1};
  const NcclLocalRank far{.rank = 2, .device = 1};
  EXPECT_THAT(CreateNcclCommunicator(nullptr, "g", &api, a, 2, Options()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("store")));
  EXPECT_THAT(CreateNcclCommunicator(&store, "g", nullptr, a, 2, Options()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("api")));
  EXPECT_THAT(CreateNcclCommunicator(&store, "g", &api, far, 2, Options()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("locals[0].rank 2")));
  const std::vector<NcclLocalRank> twice = {a, b};
  EXPECT_THAT(CreateNcclCommunicators(&store, "g", &api, twice, 2, Options()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("locals[1].rank 0 appears twice")));
  EXPECT_THAT(api.calls(), IsEmpty());
}

TEST(CreateNcclCommunicatorTest, SeveralLocalRanksInitInsideOneGroup) {
  FakeNcclApi api({.simulate_data = true});
  InMemoryKvStore store;
  const std::vector<NcclLocalRank> locals = {
      {.rank = 0, .device = 0, .stream = FakeNcclApi::Stream(0)},
      {.rank = 1, .device = 1, .stream = FakeNcclApi::Stream(1)}};
  ASSERT_OK_AND_ASSIGN(std::vector<std::unique_ptr<Communicator>> comms,
                       CreateNcclCommunicators(&store, "job/c/tp/0", &api,
                                               locals, 2, Options()));
  ASSERT_THAT(comms, SizeIs(2));
  std::vector<std::string> ops;
  std::vector<FakeNcclCall> calls = api.calls();
  for (const FakeNcclCall& c : calls) {
    ops.push_back(c.op);
    if (c.op == "ncclGroupEnd") break;
  }
  EXPECT_THAT(
      ops, ElementsAre("ncclGetUniqueId", "ncclGroupStart", "cudaSetDevice",
                       "ncclCommInitRank", "cudaSetDevice", "ncclCommInitRank",
                       "ncclGroupEnd"));
  EXPECT_EQ(calls[2].root, 0);  // device 0
  EXPECT_EQ(calls[3].root, 0);  // rank 0
  EXPECT_EQ(calls[3].group_depth, 1);
  EXPECT_EQ(calls[4].root, 1);
  EXPECT_EQ(calls[5].root, 1);
  EXPECT_EQ(calls[5].group_depth, 1);
  // They work together (one thread per rank).
  std::vector<std::vector<float>> data = {{1, 2, 3}, {10, 20, 30}};
  RunOnRanks(2,
             [&](int r) { EXPECT_OK(comms[r]->AllReduce(data[r].data(), 3)); });
  EXPECT_THAT(data[0], ElementsAre(11, 22, 33));
  EXPECT_THAT(data[1], ElementsAre(11, 22, 33));
}

// --- Teardown ---------------------------------------------------------------

std::vector<NcclLocalRank> ThreeLocalRanks() {
  return {{.rank = 0, .device = 0, .stream = FakeNcclApi::Stream(0)},
          {.rank = 1, .device = 1, .stream = FakeNcclApi::Stream(1)},
          {.rank = 2, .device = 2, .stream = FakeNcclApi::Stream(2)}};
}

// The NCCL calls of `calls` (group brackets included), by name.
std::vector<std::string> NcclOpsOf(const std::vector<FakeNcclCall>& calls) {
  std::vector<std::string> ops;
  for (const FakeNcclCall& c : calls) {
    if (c.op.rfind("nccl", 0) == 0) ops.push_back(c.op);
  }
  return ops;
}

TEST(DestroyNcclCommunicatorsTest, FinalizesTogetherWaitsThenDestroysEach) {
  FakeNcclApi api;
  InMemoryKvStore store;
  ASSERT_OK_AND_ASSIGN(
      std::vector<std::unique_ptr<Communicator>> comms,
      CreateNcclCommunicators(&store, "job/e/dp/0", &api, ThreeLocalRanks(), 3,
                              Options()));
  api.ClearCalls();
  ASSERT_OK(DestroyNcclCommunicators(std::move(comms)));
  const std::vector<FakeNcclCall> calls = api.calls();
  EXPECT_THAT(
      NcclOpsOf(calls),
      ElementsAre("ncclGroupStart", "ncclCommFinalize", "ncclCommFinalize",
                  "ncclCommFinalize", "ncclGroupEnd", "ncclCommDestroy",
                  "ncclCommDestroy", "ncclCommDestroy"));
  std::vector<const FakeNcclCall*> finalizes, destroys;
  const FakeNcclCall* group_end = nullptr;
  for (const FakeNcclCall& c : calls) {
    if (c.op == "ncclCommFinalize") finalizes.push_back(&c);
    if (c.op == "ncclCommDestroy") destroys.push_back(&c);
    if (c.op == "ncclGroupEnd") group_end = &c;
  }
  ASSERT_THAT(finalizes, SizeIs(3));
  ASSERT_THAT(destroys, SizeIs(3));
  ASSERT_NE(group_end, nullptr);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(finalizes[r]->comm_rank, r);
    EXPECT_EQ(finalizes[r]->group_depth, 1);
    EXPECT_EQ(finalizes[r]->group, finalizes[0]->group);
    EXPECT_EQ(destroys[r]->comm_rank, r);
    EXPECT_EQ(destroys[r]->group_depth, 0);
  }
  // Every finalization was polled until finished before the first destroy
  // (which the fake would otherwise reject): one poll launches the group's
  // work, then one finds each communicator ready.
  EXPECT_GE(destroys[0]->polls - group_end->polls, 1 + 3);
  EXPECT_THAT(api.calls_named("cudaEventDestroy"), SizeIs(3));
  EXPECT_EQ(api.live_allocations(), 0);
}

TEST(DestroyNcclCommunicatorsTest, AFinalizationThatNeverEndsIsAborted) {
  FakeNcclApi api;
  InMemoryKvStore store;
  ASSERT_OK_AND_ASSIGN(
      std::vector<std::unique_ptr<Communicator>> comms,
      CreateNcclCommunicators(&store, "job/f/dp/0", &api, ThreeLocalRanks(), 3,
                              Options(absl::Milliseconds(100))));
  comms[1]->Abort();  // aborted ones are only freed
  api.ClearCalls();
  api.SetNeverReady(true);
  const absl::Time start = absl::Now();
  EXPECT_THAT(
      DestroyNcclCommunicators(std::move(comms)),
      StatusIs(absl::StatusCode::kDeadlineExceeded,
               AllOf(HasSubstr("ncclCommFinalize"), HasSubstr("rank 0 of 3"))));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_THAT(
      NcclOpsOf(api.calls()),
      ElementsAre("ncclGroupStart", "ncclCommFinalize", "ncclCommFinalize",
                  "ncclGroupEnd", "ncclCommAbort", "ncclCommAbort"));
  EXPECT_EQ(api.live_allocations(), 0);
}

TEST(DestroyNcclCommunicatorsTest, RejectsOtherCommunicatorsButFreesAll) {
  FakeNcclApi api;
  InMemoryKvStore store;
  ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<Communicator> nccl,
      CreateNcclCommunicator(&store, "job/g/dp/0", &api,
                             {.stream = FakeNcclApi::Stream(0)}, 1, Options()));
  FakeCommunicatorGroup other(1);
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.push_back(std::move(nccl));
  comms.push_back(nullptr);
  comms.push_back(other.TakeCommunicator(0));
  EXPECT_THAT(DestroyNcclCommunicators(std::move(comms)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("comms[2] is not an NcclCommunicator")));
  // Each destroyed on its own.
  EXPECT_THAT(api.calls_named("ncclCommDestroy"), SizeIs(1));
  EXPECT_EQ(api.live_allocations(), 0);
}

// --- Results on simulated data ----------------------------------------------

// A group of `size` communicators over one data-mode fake.
class SimGroup {
 public:
  SimGroup(int size, const NcclOptions& options)
      : api_({.simulate_data = true}), comms_(size) {
    RunOnRanks(size, [&](int r) {
      auto c = CreateNcclCommunicator(
          &store_, "sim", &api_,
          {.rank = r, .device = r, .stream = FakeNcclApi::Stream(r)}, size,
          options);
      ASSERT_OK(c);
      comms_[r] = *std::move(c);
    });
  }
  Communicator* comm(int r) { return comms_[r].get(); }
  FakeNcclApi& api() { return api_; }

 private:
  FakeNcclApi api_;
  InMemoryKvStore store_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

std::vector<double> RefReduceScatterV64(const Buffers& send,
                                        const std::vector<int64_t>& counts,
                                        int rank) {
  int64_t off = 0;
  for (int q = 0; q < rank; ++q) off += counts[q];
  std::vector<double> out(counts[rank], 0.0);
  for (const auto& buf : send) {
    for (int64_t i = 0; i < counts[rank]; ++i) out[i] += buf[off + i];
  }
  return out;
}

void ExpectEqualTo64(const float* got, const std::vector<double>& want,
                     const std::string& what) {
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i], static_cast<float>(want[i])) << what << " at " << i;
  }
}

class NcclSimulatedDataTest : public ::testing::TestWithParam<NcclUneven> {};

TEST_P(NcclSimulatedDataTest, CollectivesMatchFloat64References) {
  constexpr int kSize = 4;
  SimGroup group(kSize, Forced(GetParam()));
  std::mt19937 rng(1234 + static_cast<int>(GetParam()));
  for (int trial = 0; trial < 6; ++trial) {
    // Uneven with a zero, then even.
    std::vector<int64_t> counts = trial < 4 ? RandomCounts(rng, kSize, 40)
                                            : std::vector<int64_t>(kSize, 9);
    const int64_t total = Sum(counts);
    Buffers send(kSize), rs_out(kSize), ag_out(kSize);
    for (int r = 0; r < kSize; ++r) send[r] = ExactRandom(rng, total);
    // AllToAllV: send_counts[i][j] random; recv mirrored.
    std::vector<std::vector<int64_t>> a2a(kSize);
    for (int i = 0; i < kSize; ++i) a2a[i] = RandomCounts(rng, kSize, 7);
    Buffers a2a_send(kSize), a2a_out(kSize);
    for (int i = 0; i < kSize; ++i) a2a_send[i] = ExactRandom(rng, Sum(a2a[i]));
    Buffers ar(kSize);
    for (int r = 0; r < kSize; ++r) ar[r] = ExactRandom(rng, 33);
    const Buffers ar_in = ar;
    Buffers inplace = send;  // ReduceScatterV with recv == send

    RunOnRanks(kSize, [&](int r) {
      Communicator* c = group.comm(r);
      rs_out[r].assign(counts[r], -1.0f);
      ASSERT_OK(c->ReduceScatterV(send[r].data(), counts, rs_out[r].data()));
      ASSERT_OK(
          c->ReduceScatterV(inplace[r].data(), counts, inplace[r].data()));
      ag_out[r].assign(total, -1.0f);
      ASSERT_OK(c->AllGatherV(rs_out[r].data(), counts, ag_out[r].data()));
      std::vector<int64_t> recv_counts(kSize);
      for (int i = 0; i < kSize; ++i) recv_counts[i] = a2a[i][r];
      a2a_out[r].assign(Sum(recv_counts), -1.0f);
      ASSERT_OK(c->AllToAllV(a2a_send[r].data(), a2a[r], a2a_out[r].data(),
                             recv_counts));
      ASSERT_OK(c->AllReduce(ar[r].data(), 33));
      ASSERT_OK(c->Barrier());
    });

    std::vector<double> full;
    for (int r = 0; r < kSize; ++r) {
      std::vector<double> want = RefReduceScatterV64(send, counts, r);
      ExpectEqualTo64(rs_out[r].data(), want, "ReduceScatterV");
      ExpectEqualTo64(inplace[r].data(), want, "in-place ReduceScatterV");
      full.insert(full.end(), want.begin(), want.end());
    }
    for (int r = 0; r < kSize; ++r) {
      ExpectEqualTo64(ag_out[r].data(), full, "AllGatherV");
      EXPECT_EQ(a2a_out[r], RefAllToAllV(a2a_send, a2a, r));
      std::vector<double> sum(33, 0.0);
      for (int q = 0; q < kSize; ++q) {
        for (int i = 0; i < 33; ++i) sum[i] += ar_in[q][i];
      }
      ExpectEqualTo64(ar[r].data(), sum, "AllReduce");
    }
  }
}

TEST_P(NcclSimulatedDataTest, InPlaceAllGatherAndBroadcast) {
  constexpr int kSize = 3;
  SimGroup group(kSize, Forced(GetParam()));
  std::mt19937 rng(77);
  const std::vector<int64_t> counts = {6, 0, 11};
  Buffers slices = {ExactRandom(rng, 6), {}, ExactRandom(rng, 11)};
  Buffers bufs(kSize, std::vector<float>(17, -1.0f));
  Buffers bc(kSize);
  for (int r = 0; r < kSize; ++r) bc[r] = ExactRandom(rng, 5);
  const std::vector<float> root_data = bc[2];
  RunOnRanks(kSize, [&](int r) {
    int64_t off = 0;
    for (int q = 0; q < r; ++q) off += counts[q];
    std::copy(slices[r].begin(), slices[r].end(), bufs[r].begin() + off);
    ASSERT_OK(group.comm(r)->AllGatherV(bufs[r].data() + off, counts,
                                        bufs[r].data()));
    ASSERT_OK(group.comm(r)->Broadcast(bc[r].data(), 5, 2));
  });
  for (int r = 0; r < kSize; ++r) {
    EXPECT_EQ(bufs[r], RefAllGatherV(slices));
    EXPECT_EQ(bc[r], root_data);
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, NcclSimulatedDataTest,
                         ::testing::Values(NcclUneven::kPerRoot,
                                           NcclUneven::kPadded),
                         [](const auto& info) {
                           return std::string(NcclUnevenName(info.param));
                         });

TEST(NcclSimulatedDataTest, AMissingPeerTimesOutOnTheRanksThatCame) {
  FakeNcclApi api({.simulate_data = true});
  InMemoryKvStore store;
  std::vector<std::unique_ptr<Communicator>> comms(2);
  RunOnRanks(2, [&](int r) {
    auto c = CreateNcclCommunicator(
        &store, "late", &api,
        {.rank = r, .device = r, .stream = FakeNcclApi::Stream(r)}, 2,
        Options(absl::Milliseconds(100)));
    ASSERT_OK(c);
    comms[r] = *std::move(c);
  });
  std::vector<float> data(3, 1.0f);
  EXPECT_THAT(
      comms[0]->AllReduce(data.data(), 3),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("AllReduce")));
}

TEST(NcclSimulatedDataTest, APeerStuckInItsLaunchTimesOutTheOthers) {
  FakeNcclApi api({.simulate_data = true});
  InMemoryKvStore store;
  std::vector<std::unique_ptr<Communicator>> comms(2);
  RunOnRanks(2, [&](int r) {
    auto c = CreateNcclCommunicator(
        &store, "stuck", &api,
        {.rank = r, .device = r, .stream = FakeNcclApi::Stream(r)}, 2,
        Options(absl::Milliseconds(100)));
    ASSERT_OK(c);
    comms[r] = *std::move(c);
  });
  std::vector<float> a(3, 1.0f), b(3, 2.0f);
  // Rank 0's launch never finishes (it is aborted at its deadline); rank 1
  // then enters the same collective and cannot complete it either.
  api.SetNeverReady(true);
  EXPECT_THAT(comms[0]->AllReduce(a.data(), 3),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  api.SetNeverReady(false);
  EXPECT_THAT(comms[1]->AllReduce(b.data(), 3),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(b, ElementsAre(2, 2, 2));
  EXPECT_THAT(api.calls_named("ncclCommAbort"), SizeIs(2));
}

TEST(RealNcclApiTest, ExistsExactlyInCudaBuilds) {
#ifdef CANZONA_ENABLE_CUDA
  // Only the object: no call reaches the driver (tests/gpu runs it).
  ASSERT_OK_AND_ASSIGN(NcclApi * api, RealNcclApi());
  EXPECT_NE(api, nullptr);
#else
  EXPECT_THAT(RealNcclApi(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                      HasSubstr("CANZONA_ENABLE_CUDA=OFF")));
#endif
}

}  // namespace
}  // namespace testing
}  // namespace canzona
