#include "server/control/kv_store.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

TEST(InMemoryKvStoreTest, GetWaitsForSetFromAnotherThread) {
  InMemoryKvStore store;
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_OK(store.Set("a", "1"));
  });
  ASSERT_OK_AND_ASSIGN(std::string value, store.Get("a", absl::Seconds(10)));
  EXPECT_EQ(value, "1");
  setter.join();
}

TEST(InMemoryKvStoreTest, GetTimesOutNamingTheKey) {
  InMemoryKvStore store;
  const absl::Time start = absl::Now();
  EXPECT_THAT(
      store.Get("missing", absl::Milliseconds(50)),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("missing")));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  EXPECT_THAT(store.Wait({"x", "y"}, absl::Milliseconds(10)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("x")));
}

TEST(InMemoryKvStoreTest, AddIsAtomicAndRejectsNonIntegers) {
  InMemoryKvStore store;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) ASSERT_OK(store.Add("n", 1).status());
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_OK_AND_ASSIGN(int64_t total, store.Add("n", 0));
  EXPECT_EQ(total, 8000);
  ASSERT_OK(store.Set("s", "abc"));
  EXPECT_THAT(store.Add("s", 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"s\"")));
  ASSERT_OK_AND_ASSIGN(std::string s, store.Get("s", absl::ZeroDuration()));
  EXPECT_EQ(s, "abc");  // the failed Add changed nothing
}

TEST(InMemoryKvStoreTest, DeletePrefixRemovesOnlyThatPrefix) {
  InMemoryKvStore store;
  ASSERT_OK(store.Set("job/a/1", "x"));
  ASSERT_OK(store.Set("job/a/2", "x"));
  ASSERT_OK(store.Set("job/b/1", "y"));
  ASSERT_OK(store.DeletePrefix("job/a/"));
  EXPECT_THAT(
      store.Get("job/a/1", absl::ZeroDuration()),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("job/a/1")));
  EXPECT_OK(store.Get("job/b/1", absl::ZeroDuration()).status());
}

TEST(InMemoryKvStoreTest, AsyncGetRunsOnSetAddAndTimeout) {
  InMemoryKvStore store;
  absl::Notification by_set, by_add, by_timeout;
  std::string set_value, add_value;
  absl::Status timeout_status;
  store.GetAsync("k", absl::Seconds(10), [&](absl::StatusOr<std::string> v) {
    set_value = v.ok() ? *v : "error";
    by_set.Notify();
  });
  store.GetAsync("counter", absl::Seconds(10),
                 [&](absl::StatusOr<std::string> v) {
                   add_value = v.ok() ? *v : "error";
                   by_add.Notify();
                 });
  store.GetAsync("never", absl::Milliseconds(30),
                 [&](absl::StatusOr<std::string> v) {
                   timeout_status = v.status();
                   by_timeout.Notify();
                 });
  EXPECT_FALSE(by_set.HasBeenNotified());
  ASSERT_OK(store.Set("k", "v"));
  ASSERT_OK(store.Add("counter", 5).status());
  ASSERT_TRUE(by_set.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(by_add.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(by_timeout.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(set_value, "v");
  EXPECT_EQ(add_value, "5");
  EXPECT_THAT(timeout_status, StatusIs(absl::StatusCode::kDeadlineExceeded,
                                       HasSubstr("never")));
}

TEST(InMemoryKvStoreTest, AsyncWaitNeedsEveryKey) {
  InMemoryKvStore store;
  absl::Notification done;
  absl::Status result = absl::UnknownError("not called");
  store.WaitAsync({"a", "b", "c"}, absl::Seconds(10), [&](absl::Status s) {
    result = s;
    done.Notify();
  });
  ASSERT_OK(store.Set("c", "1"));
  ASSERT_OK(store.Set("a", "1"));
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(done.HasBeenNotified());
  ASSERT_OK(store.Set("b", "1"));
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_OK(result);
}

TEST(InMemoryKvStoreTest, PendingWaitsAreBoundedAndCancellable) {
  InMemoryKvStore store(/*max_pending_waits=*/2);
  std::atomic<int> cancelled{0};
  auto count_cancel = [&](absl::StatusOr<std::string> v) {
    if (absl::IsCancelled(v.status())) ++cancelled;
  };
  store.GetAsync("a", absl::Seconds(60), count_cancel);
  store.GetAsync("b", absl::Seconds(60), count_cancel);
  absl::Status third;
  store.GetAsync("c", absl::Seconds(60),
                 [&](absl::StatusOr<std::string> v) { third = v.status(); });
  EXPECT_THAT(third, StatusIs(absl::StatusCode::kResourceExhausted,
                              HasSubstr("\"c\"")));
  store.CancelWaits();
  EXPECT_EQ(cancelled.load(), 2);
}

}  // namespace
}  // namespace canzona
