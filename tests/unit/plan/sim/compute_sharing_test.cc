#include "server/plan/sim/compute_sharing.h"

#include "gtest/gtest.h"

namespace canzona::plan::sim {
namespace {

TEST(ComputeSharingTest, EnoughUnitsRunAtFullRate) {
  const std::vector<double> f = SharedFinishTimes({1, 3}, 2);
  EXPECT_DOUBLE_EQ(f[0], 1);
  EXPECT_DOUBLE_EQ(f[1], 3);
}

TEST(ComputeSharingTest, FourRanksOnTwoUnitsTakeTwiceAsLong) {
  for (double t : SharedFinishTimes({1, 1, 1, 1}, 2)) EXPECT_DOUBLE_EQ(t, 2);
}

TEST(ComputeSharingTest, ProcessorSharingSpeedsUpWhenJobsFinish) {
  // One unit: both run at half rate until the short job is done at 2; the
  // long one then runs alone: 2 + (3 - 1) = 4.
  const std::vector<double> f = SharedFinishTimes({3, 1}, 1);
  EXPECT_DOUBLE_EQ(f[1], 2);
  EXPECT_DOUBLE_EQ(f[0], 4);
  // Zero work finishes at once and takes no share.
  const std::vector<double> g = SharedFinishTimes({0, 2}, 1);
  EXPECT_DOUBLE_EQ(g[0], 0);
  EXPECT_DOUBLE_EQ(g[1], 2);
}

TEST(ComputeSharingTest, BackgroundThreadsTakeTheirShare) {
  // Two ranks and one other busy thread on two units: 2/3 of a unit each.
  for (double t : SharedFinishTimes({2, 2}, 2, 1.0)) EXPECT_DOUBLE_EQ(t, 3);
  // One rank and one other thread fit two units.
  EXPECT_DOUBLE_EQ(SharedFinishTimes({2}, 2, 1.0)[0], 2);
  EXPECT_DOUBLE_EQ(SharingSlowdown(2, 2, 1.0), 1.5);
  EXPECT_DOUBLE_EQ(SharingSlowdown(1, 2, 0.5), 1);
}

TEST(ComputeSharingTest, Slowdown) {
  EXPECT_DOUBLE_EQ(SharingSlowdown(4, 2), 2);
  EXPECT_DOUBLE_EQ(SharingSlowdown(8, 8), 1);
  EXPECT_DOUBLE_EQ(SharingSlowdown(1, 2), 1);
}

}  // namespace
}  // namespace canzona::plan::sim
