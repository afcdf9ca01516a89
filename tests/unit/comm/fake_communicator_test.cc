// The fake's own features (call record, failure injection, cross-rank
// agreement checks, timeout, Abort) and that it computes exactly what the
// Gloo communicator computes on the same inputs.
#include "server/comm/fake_communicator.h"

#include <cstdint>
#include <memory>
#include <random>
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

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(FakeCommunicatorTest, RecordsEveryCallInOrder) {
  FakeCommunicatorGroup group(2, absl::Seconds(5));
  const std::vector<int64_t> counts = {3, 0};
  RunOnRanks(2, [&](int r) {
    Communicator* c = group.communicator(r);
    std::vector<float> buf(8, 1.0f);
    EXPECT_OK(c->ReduceScatterV(buf.data(), counts, buf.data()));
    EXPECT_OK(c->AllGatherV(buf.data(), counts, buf.data() + 4));
    EXPECT_OK(c->Broadcast(buf.data(), 2, 1));
    EXPECT_OK(c->Barrier());
  });
  // A rejected call is recorded too, with its status.
  EXPECT_THAT(group.communicator(0)->AllReduce(nullptr, 3),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("data")));
  std::vector<FakeCommCall> calls = group.calls(0);
  ASSERT_EQ(calls.size(), 5u);
  EXPECT_EQ(calls[0].op, "ReduceScatterV");
  EXPECT_THAT(calls[0].counts, ElementsAre(3, 0));
  EXPECT_EQ(calls[1].op, "AllGatherV");
  EXPECT_EQ(calls[2].op, "Broadcast");
  EXPECT_THAT(calls[2].counts, ElementsAre(2));
  EXPECT_EQ(calls[2].root, 1);
  EXPECT_EQ(calls[3].op, "Barrier");
  EXPECT_EQ(calls[4].op, "AllReduce");
  EXPECT_EQ(calls[4].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(group.calls(1).size(), 4u);
}

TEST(FakeCommunicatorTest, InjectedFailureFailsTheCallOnEveryRankThenBreaks) {
  FakeCommunicatorGroup group(3, absl::Seconds(5));
  group.InjectFailure(1, "AllGatherV", absl::DataLossError("link down"));
  const std::vector<int64_t> counts = {1, 2, 0};
  std::vector<absl::Status> first(3), second(3);
  RunOnRanks(3, [&](int r) {
    Communicator* c = group.communicator(r);
    std::vector<float> buf(6, 1.0f), out(6);
    EXPECT_OK(c->ReduceScatterV(buf.data(), counts, out.data()));  // not hit
    first[r] = c->AllGatherV(buf.data(), counts, out.data());
    second[r] = c->Barrier();
  });
  EXPECT_THAT(first[1],
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("link down")));
  for (int r : {0, 2}) {
    EXPECT_THAT(first[r], StatusIs(absl::StatusCode::kUnavailable,
                                   HasSubstr("rank 1 failed in AllGatherV")));
  }
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(second[r], StatusIs(absl::StatusCode::kFailedPrecondition,
                                    HasSubstr("unusable")));
  }
  EXPECT_EQ(group.calls(1)[1].status.code(), absl::StatusCode::kDataLoss);
}

TEST(FakeCommunicatorTest, RanksThatDisagreeGetFailedPrecondition) {
  FakeCommunicatorGroup group(2, absl::Seconds(5));
  std::vector<absl::Status> status(2);
  RunOnRanks(2, [&](int r) {
    std::vector<float> buf(4, 1.0f);
    status[r] = r == 0 ? group.communicator(r)->AllReduce(buf.data(), 4)
                       : group.communicator(r)->Broadcast(buf.data(), 4, 0);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(status[r], StatusIs(absl::StatusCode::kFailedPrecondition,
                                    HasSubstr("ranks disagree")));
  }
}

TEST(FakeCommunicatorTest, AllToAllVCountsMustMirror) {
  FakeCommunicatorGroup group(2, absl::Seconds(5));
  std::vector<absl::Status> status(2);
  RunOnRanks(2, [&](int r) {
    std::vector<float> buf(8, 1.0f), out(8);
    // Rank 0 sends 2 to rank 1, which expects 3.
    std::vector<int64_t> send =
        r == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{1, 1};
    std::vector<int64_t> recv =
        r == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{3, 1};
    status[r] =
        group.communicator(r)->AllToAllV(buf.data(), send, out.data(), recv);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(status[r], StatusIs(absl::StatusCode::kFailedPrecondition,
                                    HasSubstr("expects 3")));
  }
}

TEST(FakeCommunicatorTest, MissingPeerTimesOut) {
  FakeCommunicatorGroup group(2, absl::Milliseconds(200));
  const absl::Time start = absl::Now();
  EXPECT_THAT(
      group.communicator(0)->Barrier(),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("Barrier")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  // The late peer learns the group broke; afterwards both are unusable.
  EXPECT_THAT(group.communicator(1)->Barrier(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("timed out")));
  EXPECT_THAT(group.communicator(0)->Barrier(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("")));
}

TEST(FakeCommunicatorTest, AbortWakesBlockedPeers) {
  FakeCommunicatorGroup group(2, absl::Seconds(10));
  std::unique_ptr<Communicator> owned = group.TakeCommunicator(1);
  EXPECT_EQ(group.communicator(1), nullptr);
  absl::Status status;
  const absl::Time start = absl::Now();
  std::thread t([&] { status = group.communicator(0)->Barrier(); });
  absl::SleepFor(absl::Milliseconds(50));
  owned->Abort();
  t.join();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kUnavailable,
                               HasSubstr("rank 1 aborted")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_THAT(owned->Barrier(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("")));
}

// Same inputs through the fake and through Gloo give bitwise the same
// outputs. ReduceScatterV sums in rank order in both, so this holds even
// for inexact (arbitrary) floats; the others move data or use exact sums.
TEST(FakeCommunicatorTest, MatchesGlooOnTheSameInputs) {
  constexpr int kSize = 3;
  ASSERT_OK_AND_ASSIGN(auto fake,
                       MakeTestGroup(Backend::kFake, kSize, absl::Seconds(10)));
  ASSERT_OK_AND_ASSIGN(auto gloo,
                       MakeTestGroup(Backend::kGloo, kSize, absl::Seconds(10)));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> any(-1.0f, 1.0f);
  const std::vector<int64_t> counts = {13, 0, 29};
  Buffers rs_in(kSize), ar_in(kSize), ag_in(kSize);
  for (int r = 0; r < kSize; ++r) {
    for (int i = 0; i < Sum(counts); ++i) rs_in[r].push_back(any(rng));
    ar_in[r] = ExactRandom(rng, 50);
    ag_in[r] = ExactRandom(rng, counts[r]);
  }
  auto run = [&](TestGroup* g) {
    std::vector<Buffers> out(3, Buffers(kSize));
    RunOnRanks(kSize, [&](int r) {
      Communicator* c = g->comm(r);
      out[0][r].assign(counts[r], 0.0f);
      EXPECT_OK(c->ReduceScatterV(rs_in[r].data(), counts, out[0][r].data()));
      out[1][r] = ar_in[r];
      EXPECT_OK(c->AllReduce(out[1][r].data(), 50));
      out[2][r].assign(Sum(counts), 0.0f);
      EXPECT_OK(c->AllGatherV(ag_in[r].data(), counts, out[2][r].data()));
    });
    return out;
  };
  std::vector<Buffers> from_fake = run(fake.get());
  std::vector<Buffers> from_gloo = run(gloo.get());
  for (int op = 0; op < 3; ++op) {
    for (int r = 0; r < kSize; ++r) {
      EXPECT_EQ(from_fake[op][r], from_gloo[op][r])
          << "op " << op << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace canzona::testing
