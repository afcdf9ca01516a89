// The NCCL communicator's lifetime against FakeNcclApi: rendezvous through
// the KV store, waits on non-blocking calls and on the stream, timeouts,
// asynchronous errors, abort from another thread, and teardown
// (finalize together, then destroy, abort what never finishes).
#include <cstdint>
#include <cstdlib>
#include <memory>
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
#include "server/comm/nccl_communicator.h"
#include "server/control/kv_store.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/comm_test_util.h"
#include "tests/unit/comm/fake_nccl_api.h"
#include "tests/unit/comm/nccl_communicator_test_util.h"

namespace canzona::testing {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

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

// NCCL_COMM_BLOCKING=1 (a site's or launcher's environment) would turn
// the communicators blocking behind the config's back, and with them
// every bound on initialization, connects and Abort: refused, naming it,
// before anything reaches NCCL. 0 is NCCL's own default here.
TEST(CreateNcclCommunicatorTest, NcclCommBlockingInTheEnvironmentIsRefused) {
  FakeNcclApi api;
  InMemoryKvStore store;
  const NcclLocalRank solo{.rank = 0, .stream = FakeNcclApi::Stream(0)};
  ASSERT_EQ(setenv("NCCL_COMM_BLOCKING", "1", 1), 0);
  EXPECT_THAT(
      CreateNcclCommunicator(&store, "job/g/dp/0", &api, solo, 1, Options()),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("NCCL_COMM_BLOCKING=1")));
  EXPECT_THAT(api.calls(), IsEmpty());
  ASSERT_EQ(setenv("NCCL_COMM_BLOCKING", "0", 1), 0);
  EXPECT_OK(
      CreateNcclCommunicator(&store, "job/g/dp/0", &api, solo, 1, Options()));
  ASSERT_EQ(unsetenv("NCCL_COMM_BLOCKING"), 0);
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

}  // namespace
}  // namespace canzona::testing
