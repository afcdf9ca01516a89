// PollUntilDone's schedule (kernels/base/poll.h), with its pauses recorded
// instead of slept: no test here depends on time.
#include "kernels/base/poll.h"

#include <algorithm>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

// Work that runs 20 ms (in pauses taken): the waiter pauses at most
// kMaxPollPause between polls, so it sees the end at most that late.
// Before, pauses doubled to 1 ms.
TEST(PollUntilDoneTest, PausesNeverExceedTheCapSoTheEndIsSeenPromptly) {
  std::vector<absl::Duration> pauses;
  absl::Duration paused;
  const absl::Duration runs = absl::Milliseconds(20);
  ASSERT_OK(PollUntilDone(
      [&]() -> absl::StatusOr<bool> { return paused >= runs; },
      [&](absl::Duration d) {
        pauses.push_back(d);
        paused += d;
      }));
  ASSERT_THAT(pauses, Not(IsEmpty()));
  EXPECT_EQ(pauses.front(), absl::Microseconds(10));
  EXPECT_EQ(*std::max_element(pauses.begin(), pauses.end()), kMaxPollPause);
  EXPECT_LE(kMaxPollPause, absl::Microseconds(100));
  EXPECT_LT(paused - runs, kMaxPollPause);
}

TEST(PollUntilDoneTest, AnErrorEndsTheWait) {
  int polls = 0;
  EXPECT_THAT(PollUntilDone(
                  [&]() -> absl::StatusOr<bool> {
                    if (++polls < 3) return false;
                    return absl::UnavailableError("peer gone");
                  },
                  [](absl::Duration) {}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("peer gone")));
  EXPECT_EQ(polls, 3);
}

}  // namespace
}  // namespace canzona
