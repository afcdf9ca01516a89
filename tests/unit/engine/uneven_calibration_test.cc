// The measured choice of uneven DP collectives, round by round.
#include "server/engine/uneven_calibration.h"

#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::testing::ElementsAre;

const std::vector<int64_t> kCounts = {1000, 10, 10, 10};

TEST(UnevenCalibrationTest, DisabledFollowsTheCostModel) {
  UnevenCalibration disabled;
  NcclCostModel cost;
  const NcclUneven model = ChooseUneven(kCounts, cost);
  for (int round = 0; round < 5; ++round) {
    EXPECT_OK(disabled.Run(0, [&] {
      EXPECT_EQ(disabled.Choose(kCounts, cost), model);
      return absl::OkStatus();
    }));
    EXPECT_OK(disabled.EndRound(
        [](absl::Span<float>) -> absl::Status {
          ADD_FAILURE() << "a disabled calibration never sums";
          return absl::OkStatus();
        },
        "rank 0"));
  }
  EXPECT_EQ(disabled.round(), 0);
}

TEST(UnevenCalibrationTest, MeasuresBothWaysThenKeepsTheFasterPerBucket) {
  UnevenCalibration c(/*buckets=*/2);
  NcclCostModel cost;
  // Bucket 0 is slow per-root, bucket 1 slow padded.
  auto step = [&](int round) {
    for (int b = 0; b < 2; ++b) {
      EXPECT_OK(c.Run(b, [&] {
        const NcclUneven now = c.Choose(kCounts, cost);
        if (round == 0) EXPECT_EQ(now, ChooseUneven(kCounts, cost));
        if (round == 1) EXPECT_EQ(now, NcclUneven::kPerRoot);
        if (round == 2) EXPECT_EQ(now, NcclUneven::kPadded);
        const bool slow = (b == 0) == (now == NcclUneven::kPerRoot);
        if (round == 1 || round == 2) {
          absl::SleepFor(absl::Milliseconds(slow ? 30 : 1));
        }
        return absl::OkStatus();
      }));
    }
  };
  std::vector<float> summed;
  auto sum = [&](absl::Span<float> values) {
    summed.assign(values.begin(), values.end());
    for (float& v : values) v *= 2;  // "the other DP rank" measured the same
    return absl::OkStatus();
  };
  for (int round = 0; round < 3; ++round) {
    step(round);
    EXPECT_OK(c.EndRound(sum, "rank 0"));
    EXPECT_EQ(summed.empty(), round < 2) << round;
  }
  // [per-root, padded] per bucket, in bucket order.
  ASSERT_EQ(summed.size(), 4u);
  EXPECT_GT(summed[0], summed[1]);
  EXPECT_LT(summed[2], summed[3]);
  EXPECT_EQ(c.chosen(0), NcclUneven::kPadded);
  EXPECT_EQ(c.chosen(1), NcclUneven::kPerRoot);
  // From round 3 on, every call of a bucket runs its choice.
  for (int b = 0; b < 2; ++b) {
    EXPECT_OK(c.Run(b, [&] {
      EXPECT_EQ(c.Choose(kCounts, cost), c.chosen(b));
      return absl::OkStatus();
    }));
  }
}

TEST(UnevenCalibrationTest, ACollectiveErrorIsReturned) {
  UnevenCalibration c(1);
  EXPECT_THAT(c.Run(0, [] { return absl::UnavailableError("peer gone"); }),
              ::canzona::testing::StatusIs(absl::StatusCode::kUnavailable));
}

}  // namespace
}  // namespace canzona
