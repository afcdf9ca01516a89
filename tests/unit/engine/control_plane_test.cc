// Control-plane hygiene through the Engine: a job's keys leave the
// coordinator's store when the job ends, and a failed job's when its record
// is dropped.
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::testing::IsEmpty;

// Keys of the store under `prefix` once the daemons' watchers have had
// time to act (they delete asynchronously, off the RPC threads).
std::vector<std::string> KeysAfterCleanup(InMemoryKvStore& kv,
                                          const std::string& prefix,
                                          bool expect_empty) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::vector<std::string> keys;
  do {
    keys.clear();
    for (const std::string& k : kv.Keys()) {
      if (absl::StartsWith(k, prefix)) keys.push_back(k);
    }
    if (keys.empty() == expect_empty) break;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < deadline);
  return keys;
}

TEST(ControlPlaneTest, TheStoreIsEmptyAfterFiftyJobs) {
  Cluster cluster;
  for (int j = 0; j < 50; ++j) {
    JobRun run(MakeJobConfig("hygiene", /*dp=*/2, /*tp=*/1, "cost"));
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RunAll(cluster, /*steps=*/1));
    ASSERT_OK(run.Deregister(cluster));
  }
  EXPECT_THAT(KeysAfterCleanup(cluster.kv, "", /*expect_empty=*/true),
              IsEmpty());
}

TEST(ControlPlaneTest, AFailedJobsKeysGoWithItsRecord) {
  // Jobs of two ranks where only rank 0 ever registers: the barrier times
  // out, the job fails, its trainer leaves; the other rank never claimed
  // its place, so only dropping the failed job's record frees its keys.
  Cluster cluster(absl::Seconds(20),
                  /*register_timeout=*/absl::Milliseconds(200));
  std::vector<std::string> ids;
  for (int j = 0; j < 17; ++j) {
    JobConfig config = MakeJobConfig("orphan", /*dp=*/2, /*tp=*/1, "cost");
    ids.push_back(config.job_id);
    TrainerRank rank(config, 0);
    ASSERT_OK(rank.Init());
    Result<v1::RegisterResponse> reg;
    cluster.engines[0]->Register(rank.MakeRegister(), PeerInfo{},
                                 reg.callback());
    EXPECT_THAT(reg.Get(), ::canzona::testing::StatusIs(
                               absl::StatusCode::kDeadlineExceeded));
    v1::DeregisterRequest dr;
    dr.set_job_id(config.job_id);
    dr.set_job_token(config.token);
    *dr.mutable_rank() = rank.MakeRegister().rank();
    ASSERT_OK(cluster.engines[0]->Deregister(dr));
  }
  // The oldest record fell out of the 16 kept: its keys are gone; the
  // newest job is still explained by GetStatus, and its keys remain.
  EXPECT_THAT(
      KeysAfterCleanup(cluster.kv, absl::StrCat("canzona/job/", ids[0], "/"),
                       /*expect_empty=*/true),
      IsEmpty());
  EXPECT_THAT(KeysAfterCleanup(cluster.kv,
                               absl::StrCat("canzona/job/", ids.back(), "/"),
                               /*expect_empty=*/false),
              ::testing::Not(IsEmpty()));
  const v1::GetStatusResponse status = cluster.engines[0]->GetStatus();
  EXPECT_TRUE(absl::c_any_of(status.jobs(), [&](const v1::JobStatus& js) {
    return js.job_id() == ids.back();
  }));
}

}  // namespace
}  // namespace canzona::engine_test
