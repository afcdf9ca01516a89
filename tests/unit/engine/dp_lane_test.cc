// DpLane on its own: the order its thread runs reductions and
// gathers in (the same on every rank whatever order buckets are reported
// in), the waits, and failure.
#include "server/engine/dp_lane.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::ElementsAre;

// Records "r<step>.<bucket>" / "g<step>.<bucket>" in the order run.
class Recorder {
 public:
  DpLane::BucketFn Fn(char kind) {
    return [this, kind](int64_t step, int bucket) {
      absl::MutexLock lock(&mu_);
      events_.push_back(absl::StrCat(std::string(1, kind), step, ".", bucket));
      return fail_at_ == events_.back() ? absl::UnavailableError("peer died")
                                        : absl::OkStatus();
    };
  }
  std::vector<std::string> events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  void FailAt(std::string event) {
    absl::MutexLock lock(&mu_);
    fail_at_ = std::move(event);
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
  std::string fail_at_ ABSL_GUARDED_BY(mu_);
};

absl::Time Soon() { return absl::Now() + absl::Seconds(10); }

TEST(DpLaneTest, ReducesInBucketOrderWhateverTheReportOrder) {
  Recorder rec;
  DpLane p(3, rec.Fn('r'), rec.Fn('g'));
  p.MarkReady(1, {2});  // waits for 0 and 1
  p.MarkReady(1, {1, 1});
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(rec.events().empty());
  p.MarkReady(1, {0});
  ASSERT_OK(p.WaitReduced(1, Soon(), nullptr));
  EXPECT_THAT(rec.events(), ElementsAre("r1.0", "r1.1", "r1.2"));
}

TEST(DpLaneTest, NextStepReducesOnlyAfterThisStepsGathersAreQueued) {
  Recorder rec;
  DpLane p(2, rec.Fn('r'), rec.Fn('g'));
  p.MarkAllReady(1);
  ASSERT_OK(p.WaitReduced(1, Soon(), nullptr));
  p.MarkAllReady(2);  // early: the worker still uses step 1's staging
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(rec.events().size(), 2u);
  p.StartGathers(1, {1, 0}, true);
  ASSERT_OK(p.WaitReduced(2, Soon(), nullptr));
  EXPECT_THAT(rec.events(),
              ElementsAre("r1.0", "r1.1", "g1.1", "g1.0", "r2.0", "r2.1"));
  EXPECT_EQ(p.gathers_started(), 1);
}

TEST(DpLaneTest, WhenGatheredCallsBackPerBucket) {
  Recorder rec;
  DpLane p(2, rec.Fn('r'), rec.Fn('g'));
  std::atomic<int> calls{0};
  absl::Notification all;
  p.WhenGathered(1, 0, [&](absl::Status s, double waited) {
    EXPECT_OK(s);
    EXPECT_GE(waited, 0);
    ++calls;
  });
  p.WhenGathered(1, -1, [&](absl::Status s, double) {
    EXPECT_OK(s);
    all.Notify();
  });
  EXPECT_EQ(calls.load(), 0);
  p.MarkAllReady(1);
  ASSERT_OK(p.WaitReduced(1, Soon(), nullptr));
  p.StartGathers(1, {1, 0}, true);
  ASSERT_TRUE(all.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(calls.load(), 1);
  // Already there: at once.
  bool now = false;
  p.WhenGathered(1, 1, [&](absl::Status s, double) { now = s.ok(); });
  EXPECT_TRUE(now);
  double comm = -1, exposed = -1;
  p.TakeTimes(&comm, &exposed);
  EXPECT_GE(comm, 0);
  EXPECT_GE(exposed, 0);
}

TEST(DpLaneTest, SkippedStepMarksWithoutGathering) {
  Recorder rec;
  DpLane p(2, rec.Fn('r'), rec.Fn('g'));
  p.MarkAllReady(1);
  ASSERT_OK(p.WaitReduced(1, Soon(), nullptr));
  p.StartGathers(1, {1, 0}, false);
  ASSERT_OK(p.WaitGathered(1, Soon(), nullptr));
  EXPECT_THAT(rec.events(), ElementsAre("r1.0", "r1.1"));
}

TEST(DpLaneTest, FailureIsStickyAndReachesEveryWaiter) {
  Recorder rec;
  rec.FailAt("r1.1");
  DpLane p(3, rec.Fn('r'), rec.Fn('g'));
  absl::Status waiter;
  absl::Notification called;
  p.WhenGathered(1, 2, [&](absl::Status s, double) {
    waiter = s;
    called.Notify();
  });
  p.MarkAllReady(1);
  EXPECT_THAT(p.WaitReduced(1, Soon(), nullptr),
              StatusIs(absl::StatusCode::kUnavailable));
  ASSERT_TRUE(called.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_THAT(waiter, StatusIs(absl::StatusCode::kUnavailable));
  // Bucket 2 was never reduced; later calls fail at once.
  EXPECT_THAT(rec.events(), ElementsAre("r1.0", "r1.1"));
  EXPECT_THAT(p.WaitGathered(1, Soon(), nullptr),
              StatusIs(absl::StatusCode::kUnavailable));
  p.WaitIdle();
}

// The DP copier is one thread's at a time: work on it from elsewhere (a
// checkpoint's hand-over while the trainer already reports the next
// step's buckets) runs on the lane's thread, after what is queued, and
// on a failed lane too.
TEST(DpLaneTest, RunOnLaneRunsOnItsThreadAfterWhatIsQueued) {
  Recorder rec;
  std::atomic<std::thread::id> reduced_on;
  DpLane::BucketFn reduce = [&](int64_t step, int bucket) {
    reduced_on = std::this_thread::get_id();
    return rec.Fn('r')(step, bucket);
  };
  DpLane p(2, reduce, rec.Fn('g'));
  p.MarkAllReady(1);
  std::thread::id ran_on;
  ASSERT_OK(p.RunOnLane([&] {
    ran_on = std::this_thread::get_id();
    return rec.Fn('x')(0, 0);
  }));
  EXPECT_THAT(rec.events(), ElementsAre("r1.0", "r1.1", "x0.0"));
  EXPECT_EQ(ran_on, reduced_on.load());
  EXPECT_NE(ran_on, std::this_thread::get_id());
  p.Fail(absl::UnavailableError("peer died"));
  EXPECT_THAT(p.RunOnLane([] { return absl::InternalError("mine"); }),
              StatusIs(absl::StatusCode::kInternal));
}

TEST(DpLaneTest, WaitTimesOutAndResetMovesTheStep) {
  Recorder rec;
  DpLane p(2, rec.Fn('r'), rec.Fn('g'));
  p.MarkReady(1, {1});  // bucket 0 never comes
  EXPECT_THAT(p.WaitReduced(1, absl::Now() + absl::Milliseconds(30), nullptr),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  // A checkpoint load moved the job to step 7.
  p.Reset(7);
  ASSERT_OK(p.WaitGathered(7, Soon(), nullptr));
  p.MarkAllReady(8);
  ASSERT_OK(p.WaitReduced(8, Soon(), nullptr));
  EXPECT_THAT(rec.events(), ElementsAre("r8.0", "r8.1"));
}

TEST(DpLaneTest, DestructionFailsPendingCallbacks) {
  Recorder rec;
  absl::Status status;
  {
    DpLane p(1, rec.Fn('r'), rec.Fn('g'));
    p.WhenGathered(1, 0, [&](absl::Status s, double) { status = s; });
  }
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kUnavailable));
}

}  // namespace
}  // namespace canzona
