#include "server/plan/lower_bound.h"

#include <vector>

#include "gtest/gtest.h"

namespace canzona::plan {
namespace {

TEST(LowerBoundTest, AverageAndLargest) {
  EXPECT_DOUBLE_EQ(MakespanLowerBound({4, 4, 4, 4}, 0, 2), 8);
  EXPECT_DOUBLE_EQ(MakespanLowerBound({10, 1, 1}, 0, 3), 10);
  EXPECT_DOUBLE_EQ(MakespanLowerBound({}, 6, 3), 2);
}

TEST(LowerBoundTest, PigeonholeBeatsAverage) {
  // Three items of 5 on two machines: two share one, so >= 10.
  EXPECT_NEAR(MakespanLowerBound({5, 5, 5}, 0, 2), 10, 1e-6);
}

TEST(LowerBoundTest, CapacityArgument) {
  // Two big items (9) each leave room < 3 beside them: the three 3s need
  // the remaining machine: 9.
  const double lb = MakespanLowerBound({9, 9, 3, 3, 3}, 0, 3);
  EXPECT_GE(lb, 9 - 1e-9);
  EXPECT_LE(lb, 9 + 1e-9);
  // With two machines: optimum is 9+3+3=15 vs 9+3 = 12 -> 15; bound >= 12.
  EXPECT_GE(MakespanLowerBound({9, 9, 3, 3, 3}, 0, 2), 13.5 - 1e-9);
}

TEST(LowerBoundTest, NeverAboveBruteForceOptimum) {
  // Random small instances: the bound never exceeds the exact optimum.
  uint64_t seed = 12345;
  auto next = [&]() {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int>((seed >> 33) % 20) + 1;
  };
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 2 + trial % 7;
    const int m = 1 + trial % 3;
    std::vector<double> items;
    for (int i = 0; i < n; ++i) items.push_back(next());
    double best = 1e18;
    int combos = 1;
    for (int i = 0; i < n; ++i) combos *= m;
    for (int c = 0; c < combos; ++c) {
      std::vector<double> load(m, 0);
      int x = c;
      for (int i = 0; i < n; ++i) {
        load[x % m] += items[i];
        x /= m;
      }
      double mx = 0;
      for (double l : load) mx = std::max(mx, l);
      best = std::min(best, mx);
    }
    EXPECT_LE(MakespanLowerBound(items, 0, m), best + 1e-9) << trial;
  }
}

}  // namespace
}  // namespace canzona::plan
