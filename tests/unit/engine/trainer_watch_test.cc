// A trainer process that exits without deregistering (crash, kill -9) is
// noticed through its pid: its rank is released (buffers unmapped, job
// failed with a reason naming the trainer) and its peers' steps fail
// promptly instead of waiting for the step timeout.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::testing::AnyOf;
using ::testing::HasSubstr;

// How many mappings of this process name a shm object of `job`.
int MappingsOf(const std::string& job) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int n = 0;
  while (std::getline(maps, line)) {
    if (absl::StrContains(line, "canzona." + job + ".1.")) ++n;
  }
  return n;
}

// How many objects of `job`'s rank `rank` /dev/shm holds.
int ShmObjectsOf(const std::string& job, int rank) {
  const std::string prefix = absl::StrCat("canzona.", job, ".", rank, ".");
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    if (absl::StartsWith(entry.path().filename().string(), prefix)) ++n;
  }
  return n;
}

TEST(TrainerWatchTest, ExitedTrainerIsReleasedAndFailsItsPeers) {
  // A long step timeout: the failure must come from the watch, not it.
  Cluster cluster(/*step_timeout=*/absl::Seconds(60));
  JobConfig config;
  config.job_id = UniqueJobId("watch");
  config.dp = 2;
  config.params = HfModel();
  JobRun run(config);
  ASSERT_OK(run.Init());
  const pid_t trainer = ::fork();
  if (trainer == 0) {
    ::pause();
    ::_exit(0);
  }
  ASSERT_GT(trainer, 0);
  ASSERT_OK(run.ForAll(cluster, [&](TrainerRank& rank, Engine& engine) {
    PeerInfo peer;
    if (rank.global() == 1) peer.pid = trainer;
    Result<v1::RegisterResponse> reg;
    engine.Register(rank.MakeRegister(), peer, reg.callback());
    return reg.Get().status();
  }));
  ASSERT_OK(run.RunSteps(cluster, 1, 2));
  EXPECT_EQ(MappingsOf(config.job_id), 2);  // the trainer's and the daemon's

  ::kill(trainer, SIGKILL);
  ::waitpid(trainer, nullptr, 0);
  const auto start = std::chrono::steady_clock::now();
  TrainerRank& survivor = *run.ranks()[0];
  survivor.WriteGrads(3);
  Result<v1::StepResponse> step;
  cluster.engines[survivor.engine_index()]->Step(survivor.MakeStep(3),
                                                 step.callback());
  absl::Status status = step.Get().status();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  EXPECT_THAT(status.code(),
              AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kAborted))
      << status;
  EXPECT_LT(seconds, 5.0);

  // The dead trainer's daemon released the rank: buffers unmapped (only
  // the trainer side's mapping of this process remains), the job kept as
  // failed with the reason, its plan still served.
  for (int i = 0; i < 50 && MappingsOf(config.job_id) != 1; ++i) {
    ::usleep(20000);
  }
  EXPECT_EQ(MappingsOf(config.job_id), 1);
  // ... and removed the names the killed trainer could not: /dev/shm gets
  // the memory back with the last mapping. The live rank's stay.
  EXPECT_EQ(ShmObjectsOf(config.job_id, 1), 0);
  EXPECT_GT(ShmObjectsOf(config.job_id, 0), 0);
  const v1::GetStatusResponse dead = cluster.engines[1]->GetStatus();
  ASSERT_EQ(dead.jobs_size(), 1);
  EXPECT_THAT(dead.jobs(0).state(), HasSubstr("exited without deregistering"));
  EXPECT_EQ(dead.jobs(0).local_ranks_size(), 0);
  v1::GetPlanRequest plan;
  plan.set_job_id(config.job_id);
  EXPECT_OK(cluster.engines[1]->GetPlan(plan).status());
  const v1::GetStatusResponse survivor_status = cluster.engines[0]->GetStatus();
  ASSERT_EQ(survivor_status.jobs_size(), 1);
  EXPECT_THAT(survivor_status.jobs(0).state(), HasSubstr("failed"));
}

}  // namespace
}  // namespace canzona::engine_test
