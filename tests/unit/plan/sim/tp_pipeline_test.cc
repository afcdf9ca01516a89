#include "server/plan/sim/tp_pipeline.h"

#include "gtest/gtest.h"

namespace canzona::plan::sim {
namespace {

TEST(TpPipelineTest, OneGroupRunsInSequence) {
  // G0 (1), then each rank's C0 (2 and 3), then S0 (1) once both are done.
  const PipelineSchedule p =
      ScheduleTpPipeline({{1.0, 1.0, {2.0, 3.0}}}, {0.0, 0.0});
  EXPECT_DOUBLE_EQ(p.gather[0].end, 1);
  EXPECT_DOUBLE_EQ(p.compute[0][0].end, 3);
  EXPECT_DOUBLE_EQ(p.compute[0][1].end, 4);
  EXPECT_DOUBLE_EQ(p.scatter[0].start, 4);
  EXPECT_DOUBLE_EQ(p.end[0], 5);
  EXPECT_DOUBLE_EQ(p.end[1], 5);
  // The faster rank counts waiting for its peer as scatter time.
  EXPECT_DOUBLE_EQ(p.scatter_s[0], 2);
  EXPECT_DOUBLE_EQ(p.scatter_s[1], 1);
  EXPECT_DOUBLE_EQ(p.gather_s[0], 1);
  EXPECT_DOUBLE_EQ(p.compute_s[1], 3);
}

TEST(TpPipelineTest, TwoDeepOverlapHidesTheMiddleExchanges) {
  // Compute-bound: 3 groups of gather 1, compute 5, scatter 1. Only the
  // first gather and the last scatter show: 1 + 3 * 5 + 1, not 3 * 7.
  const std::vector<PipelineGroup> groups(3, {1.0, 1.0, {5.0}});
  const PipelineSchedule p = ScheduleTpPipeline(groups, {0.0});
  EXPECT_DOUBLE_EQ(p.end[0], 17);
  // The lane order G0 G1 S0 G2 S1 S2.
  EXPECT_DOUBLE_EQ(p.gather[1].start, 1);
  EXPECT_DOUBLE_EQ(p.scatter[0].start, 6);
  EXPECT_DOUBLE_EQ(p.gather[2].start, 7);
  EXPECT_DOUBLE_EQ(p.scatter[1].start, 11);
  EXPECT_DOUBLE_EQ(p.compute[2][0].start, 11);
  EXPECT_DOUBLE_EQ(p.scatter[2].start, 16);
}

TEST(TpPipelineTest, CommunicationBoundRunsAtTheLanesPace) {
  // Gathers and scatters of 2 around tiny computes: the lane is the
  // bottleneck, G0 G1 S0 G2 S1 S2 back to back.
  const std::vector<PipelineGroup> groups(3, {2.0, 2.0, {0.1}});
  const PipelineSchedule p = ScheduleTpPipeline(groups, {0.0});
  EXPECT_DOUBLE_EQ(p.end[0], 12);
}

TEST(TpPipelineTest, FirstGatherWaitsForTheLastRankReady) {
  const PipelineSchedule p =
      ScheduleTpPipeline({{1.0, 1.0, {1.0, 1.0}}}, {0.0, 4.0});
  EXPECT_DOUBLE_EQ(p.gather[0].start, 4);
  // Rank 0 reached the gather at 0: it waited 4 inside it.
  EXPECT_DOUBLE_EQ(p.gather_s[0], 5);
  EXPECT_DOUBLE_EQ(p.gather_s[1], 1);
  EXPECT_DOUBLE_EQ(p.end[0], 7);
}

TEST(TpPipelineTest, NoGroupsIsNoTime) {
  const PipelineSchedule p = ScheduleTpPipeline({}, {3.0, 2.0});
  EXPECT_DOUBLE_EQ(p.end[0], 3);
  EXPECT_DOUBLE_EQ(p.end[1], 2);
}

}  // namespace
}  // namespace canzona::plan::sim
