// Failure behaviour of the Gloo communicator, in one process: a peer that
// never arrives (at creation or in a collective), Abort, the broken state
// after a failure, and that the process can build a working group after.
#include "server/comm/gloo_communicator.h"

#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/control/kv_store.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/comm_test_util.h"
#include "tests/unit/comm/group_factory.h"

namespace canzona::testing {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr absl::Duration kMargin = absl::Milliseconds(1500);

::testing::Matcher<absl::Status> PeerFailure(const char* op) {
  return AnyOf(StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr(op)),
               StatusIs(absl::StatusCode::kUnavailable, HasSubstr(op)));
}

void ExpectGroupWorks(KvStore* store, int size) {
  ASSERT_OK_AND_ASSIGN(auto comms, MakeGlooGroup(store, UniquePrefix("after"),
                                                 size, absl::Seconds(10)));
  std::vector<std::vector<float>> data(size, std::vector<float>(5, 1.0f));
  RunOnRanks(size,
             [&](int r) { EXPECT_OK(comms[r]->AllReduce(data[r].data(), 5)); });
  for (int r = 0; r < size; ++r) {
    EXPECT_EQ(data[r], std::vector<float>(5, static_cast<float>(size)));
  }
}

TEST(GlooCommunicatorTest, RejectsBadCreationArguments) {
  InMemoryKvStore store;
  EXPECT_THAT(CreateGlooCommunicator(nullptr, "g", 0, 1, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("store")));
  EXPECT_THAT(
      CreateGlooCommunicator(&store, "", 0, 1, {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("group_prefix")));
  EXPECT_THAT(CreateGlooCommunicator(&store, "g", 2, 2, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank")));
  GlooOptions zero;
  zero.timeout = absl::ZeroDuration();
  EXPECT_THAT(
      CreateGlooCommunicator(&store, "g", 0, 1, zero),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout")));
  GlooOptions bad_host;
  bad_host.hostname = "no-such-host.invalid";
  EXPECT_THAT(
      CreateGlooCommunicator(&store, "g", 0, 1, bad_host),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hostname")));
}

TEST(GlooCommunicatorTest, PeerThatNeverJoinsTimesOutTheRendezvous) {
  InMemoryKvStore store;
  GlooOptions options;
  options.timeout = absl::Milliseconds(500);
  const absl::Time start = absl::Now();
  EXPECT_THAT(
      CreateGlooCommunicator(&store, "lonely", 0, 2, options),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("lonely/1")));
  EXPECT_LT(absl::Now() - start, options.timeout + kMargin);
}

TEST(GlooCommunicatorTest, PeerThatSkipsACollectiveFailsTheOthersInTime) {
  InMemoryKvStore store;
  constexpr absl::Duration kTimeout = absl::Seconds(1);
  ASSERT_OK_AND_ASSIGN(auto comms, MakeGlooGroup(&store, "skip", 3, kTimeout));
  std::vector<absl::Status> status(2);
  std::vector<absl::Duration> elapsed(2);
  // Rank 2 stays alive (its communicator exists) but never calls.
  RunOnRanks(2, [&](int r) {
    std::vector<float> data(100, 1.0f);
    const absl::Time start = absl::Now();
    status[r] = comms[r]->AllReduce(data.data(), 100);
    elapsed[r] = absl::Now() - start;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(status[r], PeerFailure("AllReduce")) << "rank " << r;
    EXPECT_LT(elapsed[r], kTimeout + kMargin) << "rank " << r;
    // Broken for good: the next call says so instead of hanging.
    EXPECT_THAT(
        comms[r]->Barrier(),
        StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("unusable")));
  }
  comms.clear();
  ExpectGroupWorks(&store, 3);
}

TEST(GlooCommunicatorTest, AbortFailsBlockedPeersPromptly) {
  InMemoryKvStore store;
  ASSERT_OK_AND_ASSIGN(auto comms,
                       MakeGlooGroup(&store, "abort", 2, absl::Seconds(10)));
  absl::Status status;
  absl::Duration elapsed;
  std::thread waiter([&] {
    std::vector<float> data(8, 1.0f);
    const absl::Time start = absl::Now();
    status = comms[0]->AllReduce(data.data(), 8);
    elapsed = absl::Now() - start;
  });
  absl::SleepFor(absl::Milliseconds(100));
  comms[1]->Abort();
  comms[1]->Abort();  // idempotent
  waiter.join();
  EXPECT_THAT(status,
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("AllReduce")));
  EXPECT_LT(elapsed, absl::Seconds(3));  // not the 10 s timeout
  EXPECT_THAT(
      comms[1]->Barrier(),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("aborted")));
}

TEST(GlooCommunicatorTest, AbortFromAnotherThreadEndsOwnBlockedCallInTime) {
  InMemoryKvStore store;
  constexpr absl::Duration kTimeout = absl::Seconds(1);
  ASSERT_OK_AND_ASSIGN(auto comms, MakeGlooGroup(&store, "self", 2, kTimeout));
  absl::Status status;
  const absl::Time start = absl::Now();
  std::thread worker([&] { status = comms[0]->Barrier(); });
  absl::SleepFor(absl::Milliseconds(100));
  comms[0]->Abort();
  worker.join();
  EXPECT_FALSE(status.ok());
  EXPECT_LT(absl::Now() - start, kTimeout + kMargin);
}

}  // namespace
}  // namespace canzona::testing
