// The control-plane conversations of a job, over an in-memory store, with
// ranks as threads.
#include "server/engine/job_agreement.h"

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/control/kv_store.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::IsOk;
using ::canzona::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

absl::Time Soon() { return absl::Now() + absl::Seconds(10); }

JobAgreement Agreement(KvStore* kv, const std::string& job = "j1") {
  return JobAgreement(kv, job, [] { return absl::OkStatus(); });
}

// Runs f(rank) on `n` threads and returns their statuses.
std::vector<absl::Status> OnRanks(int n,
                                  const std::function<absl::Status(int)>& f) {
  std::vector<absl::Status> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { out[r] = f(r); });
  for (auto& t : threads) t.join();
  return out;
}

TEST(JobAgreementTest, SettingsThatDifferNameTheLine) {
  InMemoryKvStore kv;
  const JobAgreement a = Agreement(&kv);
  EXPECT_OK(a.CheckSettings("token=1\nlayout=1,2,1\nalpha=1", Soon()));
  EXPECT_OK(a.CheckSettings("token=1\nlayout=1,2,1\nalpha=1", Soon()));
  EXPECT_THAT(
      a.CheckSettings("token=1\nlayout=1,2,1\nalpha=0.5", Soon()),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("settings[2]: 'alpha=0.5' (this rank) vs 'alpha=1'")));
  EXPECT_THAT(a.CheckSettings("token=2\nlayout=1,2,1\nalpha=1", Soon()),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       HasSubstr("job_token does not match job 'j1'")));
}

TEST(JobAgreementTest, ParameterListsAndClaims) {
  InMemoryKvStore kv;
  const JobAgreement a = Agreement(&kv);
  EXPECT_OK(a.CheckParameterList(0, "w|4,4|0|muon", Soon()));
  EXPECT_OK(a.CheckParameterList(1, "v|4|-1|adamw", Soon()));
  EXPECT_THAT(a.CheckParameterList(0, "w|4,8|0|muon", Soon()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("parameters[0]: 'w|4,8|0|muon'")));
  canzona::v1::RankCoordinates coords;
  coords.set_dp_rank(1);
  EXPECT_OK(a.ClaimRank(1, coords));
  for (int attempt = 0; attempt < 2; ++attempt) {
    EXPECT_THAT(a.ClaimRank(1, coords),
                StatusIs(absl::StatusCode::kAlreadyExists,
                         HasSubstr("(global 1) of job 'j1'")));
  }
}

TEST(JobAgreementTest, EveryRankPassesTheBarrierTogether) {
  InMemoryKvStore kv;
  const JobAgreement a = Agreement(&kv);
  for (const absl::Status& s :
       OnRanks(3, [&](int) { return a.AwaitAllRanks(3, Soon()); })) {
    EXPECT_OK(s);
  }
  InMemoryKvStore lonely;
  EXPECT_THAT(Agreement(&lonely).AwaitAllRanks(
                  2, absl::Now() + absl::Milliseconds(300)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("all 2 ranks to register")));
}

TEST(JobAgreementTest, WaitsEndWhenInterrupted) {
  InMemoryKvStore kv;
  std::atomic<bool> failed{false};
  const JobAgreement a(&kv, "j1", [&]() -> absl::Status {
    if (failed) return absl::AbortedError("job failed: rank 3 died");
    return absl::OkStatus();
  });
  std::thread fail([&] {
    absl::SleepFor(absl::Milliseconds(200));
    failed = true;
  });
  const absl::Time start = absl::Now();
  EXPECT_THAT(
      a.WaitGet("canzona/job/j1/never", start + absl::Seconds(30), "a key"),
      StatusIs(absl::StatusCode::kAborted, HasSubstr("rank 3 died")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  fail.join();
}

TEST(JobAgreementTest, DigestsMustAgree) {
  InMemoryKvStore kv;
  const JobAgreement a = Agreement(&kv);
  std::vector<absl::Status> same =
      OnRanks(2, [&](int g) { return a.CheckDigest(g, 2, "abc", Soon()); });
  EXPECT_OK(same[0]);
  EXPECT_OK(same[1]);
  InMemoryKvStore kv2;
  const JobAgreement b = Agreement(&kv2);
  std::vector<absl::Status> differ = OnRanks(2, [&](int g) {
    return b.CheckDigest(g, 2, g == 0 ? "abc" : "abd", Soon());
  });
  EXPECT_THAT(differ[0], StatusIs(absl::StatusCode::kFailedPrecondition,
                                  HasSubstr("rank 1 planned abd")));
}

TEST(JobAgreementTest, RankZeroDecidesForEveryone) {
  InMemoryKvStore kv;
  const JobAgreement a = Agreement(&kv);
  std::vector<std::string> seen;
  std::vector<absl::Status> ok = OnRanks(3, [&](int g) {
    return a.Decide(g, 3, a.prefix() + "c/0/", absl::OkStatus(),
                    absl::StrCat("p", g), Soon(),
                    [&](const std::vector<std::string>& payloads) {
                      seen = payloads;
                      return absl::OkStatus();
                    });
  });
  for (const absl::Status& s : ok) EXPECT_OK(s);
  EXPECT_THAT(seen, ElementsAre("p0", "p1", "p2"));

  // One rank's failure reaches every rank, named, and nothing is decided.
  bool decided = false;
  std::vector<absl::Status> failed = OnRanks(3, [&](int g) {
    return a.Decide(
        g, 3, a.prefix() + "c/1/",
        g == 1 ? absl::DataLossError("disk full") : absl::OkStatus(), "",
        Soon(), [&](const std::vector<std::string>&) {
          decided = true;
          return absl::OkStatus();
        });
  });
  EXPECT_FALSE(decided);
  for (int g = 0; g < 3; ++g) {
    EXPECT_THAT(failed[g], StatusIs(absl::StatusCode::kDataLoss,
                                    HasSubstr("rank 1: disk full")))
        << g;
  }
}

TEST(JobAgreementTest, TheLastRankToLeaveDeletesTheJobsKeys) {
  InMemoryKvStore kv;
  const JobAgreement a = Agreement(&kv, "j1");
  ASSERT_OK(kv.Set("canzona/job/j2/meta", "other job"));
  ASSERT_OK(a.CheckSettings("token=1", Soon()));
  ASSERT_OK(a.AwaitAllRanks(1, Soon()));
  EXPECT_OK(a.RankLeft(2));
  EXPECT_TRUE(absl::c_any_of(kv.Keys(), [](const std::string& k) {
    return absl::StartsWith(k, "canzona/job/j1/");
  }));
  EXPECT_OK(a.RankLeft(2));
  EXPECT_THAT(kv.Keys(), ElementsAre("canzona/job/j2/meta"));
  EXPECT_OK(Agreement(&kv, "j2").DeleteKeys());
  EXPECT_THAT(kv.Keys(), IsEmpty());
}

TEST(JobAgreementTest, FirstDifferenceNamesLineAndSides) {
  EXPECT_EQ(FirstDifference("a\nb", "a\nc", "x"),
            "x[1]: 'b' (this rank) vs 'c' (the job's other ranks)");
  EXPECT_EQ(FirstDifference("a", "a\nc", "x"),
            "x[1]: '<none>' (this rank) vs 'c' (the job's other ranks)");
  EXPECT_EQ(JobKeyPrefix("abc"), "canzona/job/abc/");
}

}  // namespace
}  // namespace canzona
