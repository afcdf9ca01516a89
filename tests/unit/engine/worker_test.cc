// The device worker alone: order, cancellation, stopping twice at once.
#include "server/engine/worker.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace canzona {
namespace {

TEST(WorkerTest, RunsTasksInPostOrderOnOneThread) {
  Worker worker;
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  absl::Notification done;
  for (int i = 0; i < 20; ++i) {
    Worker::Task task;
    task.run = [&, i] {
      order.push_back(i);
      threads.push_back(std::this_thread::get_id());
      if (i == 19) done.Notify();
    };
    task.cancel = [] { ADD_FAILURE() << "cancelled"; };
    ASSERT_TRUE(worker.Post(task));
  }
  done.WaitForNotification();
  for (int i = 0; i < 20; ++i) EXPECT_EQ(order[i], i);
  for (const auto& id : threads) EXPECT_EQ(id, threads[0]);
  EXPECT_NE(threads[0], std::this_thread::get_id());
}

TEST(WorkerTest, StoppingCancelsWhatHasNotStarted) {
  Worker worker;
  absl::Notification started, release;
  std::atomic<int> ran{0}, cancelled{0};
  Worker::Task blocker;
  blocker.run = [&] {
    started.Notify();
    release.WaitForNotification();
    ++ran;
  };
  ASSERT_TRUE(worker.Post(blocker));
  started.WaitForNotification();
  for (int i = 0; i < 3; ++i) {
    Worker::Task task;
    task.run = [&] { ++ran; };
    task.cancel = [&] { ++cancelled; };
    ASSERT_TRUE(worker.Post(task));
  }
  std::thread stopper([&] { worker.StopAndJoin(); });
  absl::SleepFor(absl::Milliseconds(50));
  release.Notify();
  stopper.join();
  EXPECT_EQ(ran, 1);  // the running task finished
  EXPECT_EQ(cancelled, 3);
  Worker::Task late;
  late.run = [] {};
  EXPECT_FALSE(worker.Post(late));
}

TEST(WorkerTest, TwoStoppersBothReturnAfterTheThreadEnded) {
  Worker worker;
  std::atomic<bool> started{false}, finished{false};
  Worker::Task slow;
  slow.run = [&] {
    started = true;
    absl::SleepFor(absl::Milliseconds(100));
    finished = true;
  };
  ASSERT_TRUE(worker.Post(slow));
  // The stoppers come while the task runs (a loaded machine may start it
  // late: wait for it rather than for a fixed time).
  while (!started) absl::SleepFor(absl::Milliseconds(1));
  std::atomic<int> saw_finished{0};
  std::thread a([&] {
    worker.StopAndJoin();
    saw_finished += finished;
  });
  std::thread b([&] {
    worker.StopAndJoin();
    saw_finished += finished;
  });
  a.join();
  b.join();
  EXPECT_EQ(saw_finished, 2);
}

}  // namespace
}  // namespace canzona
