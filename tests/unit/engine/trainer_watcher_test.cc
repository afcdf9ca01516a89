// Noticing a dead trainer, and the watcher thread's period and stop.
#include "server/engine/trainer_watcher.h"

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace canzona {
namespace {

TEST(TrainerProcessTest, TellsWhenTheProcessExits) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    char c;
    (void)::read(pipe_fds[0], &c, 1);  // until the parent says so
    ::_exit(0);
  }
  TrainerProcess trainer = TrainerProcess::Watch(child);
  ASSERT_EQ(trainer.pid(), child);
  EXPECT_FALSE(trainer.Exited());
  ASSERT_EQ(::write(pipe_fds[1], "x", 1), 1);
  // pidfd readability (or ESRCH once reaped) within a second.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (!trainer.Exited() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(trainer.Exited());
  ::waitpid(child, nullptr, 0);
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);

  // Moving keeps watching; an unwatched trainer never "exits".
  TrainerProcess moved = std::move(trainer);
  EXPECT_TRUE(moved.Exited());
  EXPECT_FALSE(TrainerProcess::Watch(std::nullopt).Exited());
  EXPECT_FALSE(TrainerProcess::Watch(0).pid().has_value());
  EXPECT_FALSE(TrainerProcess::Watch(::getpid()).Exited());
}

TEST(TrainerWatcherTest, PollsEveryPeriodUntilStopped) {
  std::atomic<int> polls{0};
  TrainerWatcher watcher(absl::Milliseconds(20), [&] { ++polls; });
  absl::SleepFor(absl::Milliseconds(300));
  watcher.Stop();
  const int seen = polls;
  EXPECT_GE(seen, 3);
  EXPECT_LE(seen, 30);
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(polls, seen);  // nothing after Stop
}

TEST(TrainerWatcherTest, StopDoesNotWaitForThePeriod) {
  TrainerWatcher watcher(absl::Hours(1), [] {});
  const absl::Time start = absl::Now();
  watcher.Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

}  // namespace
}  // namespace canzona
