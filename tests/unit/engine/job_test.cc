// Job alone: failure (first reason wins), the local arrivals a step waits
// for, and the work parked after a step.
#include "server/engine/job.h"

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::shared_ptr<LocalRank> Rank(int dp) {
  v1::RankCoordinates coords;
  coords.set_dp_rank(dp);
  return std::make_shared<LocalRank>(coords, dp, TrainerProcess(), nullptr);
}

// A ready job with local ranks dp 0 and dp 1.
std::shared_ptr<Job> ReadyJob() {
  JobSettings settings;
  settings.layout.set_pp(1);
  settings.layout.set_dp(2);
  settings.layout.set_tp(1);
  settings.world = 2;
  auto job = std::make_shared<Job>("j", "t", settings);
  absl::MutexLock lock(&job->mu);
  job->ranks[0] = Rank(0);
  job->ranks[1] = Rank(1);
  job->state = JobState::kReady;
  return job;
}

TEST(JobTest, TheFirstFailureWinsAndHandsBackWhatWaits) {
  std::shared_ptr<Job> job = ReadyJob();
  int failed_calls = 0;
  {
    absl::MutexLock lock(&job->mu);
    job->progress(*job->ranks[1]).register_done =
        [&](absl::StatusOr<v1::RegisterResponse>) { ++failed_calls; };
    Job::Failure first = job->Fail("rank 3 died");
    EXPECT_TRUE(first.first);
    EXPECT_EQ(first.ranks.size(), 2u);
    ASSERT_EQ(first.register_done.size(), 1u);
    first.register_done[0](absl::AbortedError("x"));
    Job::Failure second = job->Fail("later");
    EXPECT_FALSE(second.first);
    EXPECT_TRUE(second.ranks.empty());
    EXPECT_EQ(job->StateString(), "failed: rank 3 died");
  }
  EXPECT_EQ(failed_calls, 1);
  EXPECT_TRUE(job->failed());
  EXPECT_THAT(job->FailedError(), StatusIs(absl::StatusCode::kAborted,
                                           HasSubstr("job failed: rank 3")));
}

TEST(JobTest, AStepWaitsForEveryLocalRank) {
  std::shared_ptr<Job> job = ReadyJob();
  const std::atomic<bool> stop{false};
  {
    absl::MutexLock lock(&job->mu);
    ++job->arrivals[1];
    job->progress(*job->ranks[0]).next_step = 2;
  }
  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(50));
    absl::MutexLock lock(&job->mu);
    ++job->arrivals[1];
    job->progress(*job->ranks[1]).next_step = 2;
    job->cv.SignalAll();
  });
  std::vector<absl::Status> results(2);
  std::thread other([&] {
    results[1] = job->AwaitLocalArrivals(1, absl::Now() + absl::Seconds(5),
                                         absl::Seconds(5), stop);
  });
  results[0] = job->AwaitLocalArrivals(1, absl::Now() + absl::Seconds(5),
                                       absl::Seconds(5), stop);
  late.join();
  other.join();
  EXPECT_OK(results[0]);
  EXPECT_OK(results[1]);
  absl::MutexLock lock(&job->mu);
  EXPECT_TRUE(job->arrivals.empty());  // both departed: forgotten
}

TEST(JobTest, AMissingRankIsNamedAtTheDeadline) {
  std::shared_ptr<Job> job = ReadyJob();
  const std::atomic<bool> stop{false};
  {
    absl::MutexLock lock(&job->mu);
    ++job->arrivals[1];
    job->progress(*job->ranks[0]).next_step = 2;
  }
  EXPECT_THAT(
      job->AwaitLocalArrivals(1, absl::Now() + absl::Milliseconds(100),
                              absl::Milliseconds(100), stop),
      StatusIs(
          absl::StatusCode::kDeadlineExceeded,
          HasSubstr("local rank(s) (pp 0, dp 1, tp 0) did not call Step")));
  const std::atomic<bool> stopping{true};
  EXPECT_THAT(job->AwaitLocalArrivals(2, absl::Now() + absl::Seconds(5),
                                      absl::Seconds(5), stopping),
              StatusIs(absl::StatusCode::kUnavailable));
}

TEST(JobTest, WorkParkedAfterAStepRunsInOrderOrIsCancelled) {
  std::shared_ptr<Job> job = ReadyJob();
  std::shared_ptr<LocalRank> first;
  {
    absl::MutexLock lock(&job->mu);
    first = job->ranks[0];
  }
  LocalRank& rank = *first;
  std::vector<int> ran;
  int cancelled = 0;
  {
    absl::MutexLock lock(&job->mu);
    for (int step : {3, 1, 2}) {
      Worker::Task task;
      task.run = [&ran, step] { ran.push_back(step); };
      task.cancel = [&cancelled] { ++cancelled; };
      job->progress(rank).after_step[step].push_back(std::move(task));
    }
  }
  for (Worker::Task& task : job->TakeAfterStep(rank, 2)) task.run();
  EXPECT_THAT(ran, ElementsAre(1, 2));
  job->CancelAfterStep(rank);
  EXPECT_EQ(cancelled, 1);
  EXPECT_TRUE(job->TakeAfterStep(rank, -1).empty());
}

}  // namespace
}  // namespace canzona
