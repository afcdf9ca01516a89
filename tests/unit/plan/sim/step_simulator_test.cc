#include "server/plan/sim/step_simulator.h"

#include <algorithm>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/plan/sim/simulation_json.h"
#include "tests/matchers/status_matchers.h"

namespace canzona::plan::sim {
namespace {

using ::canzona::testing::StatusIs;

// A small decoder-like model: TP-split matrices both ways, a replicated
// matrix, and AdamW vectors.
PlanRequest Request(int dp, int tp, int shard_group = 0) {
  PlanRequest r;
  r.layout = {1, dp, tp};
  const DType f32 = DType::kFloat32;
  for (int layer = 0; layer < 4; ++layer) {
    const std::string l = std::to_string(layer);
    r.parameters.push_back(
        {"w_in." + l, {512, 256}, f32, OptimizerKind::kMuon, 0, 0});
    r.parameters.push_back(
        {"w_out." + l, {256, 512}, f32, OptimizerKind::kMuon, 1, 0});
    r.parameters.push_back(
        {"w_mix." + l, {128, 128}, f32, OptimizerKind::kMuon, -1, 0});
    r.parameters.push_back(
        {"norm." + l, {256}, f32, OptimizerKind::kAdamW, -1, 0});
  }
  r.bucket_size = 200000;
  r.shard_group_size = shard_group;
  return r;
}

HardwareProfile Profile(CommPlane comm, int ranks_per_node, int units) {
  HardwareProfile p;
  p.name = "test";
  p.comm = comm;
  p.ranks_per_node = ranks_per_node;
  p.compute_units_per_node = units;
  p.collective_launch_us = 10;
  p.memory_gbps = 100;
  p.intra_node = {2, 50, 0, 0};
  p.inter_node = {8, 5, 0, 0};
  p.rates.gemm_gflops = 100;
  p.rates.ns_gflops = 50;
  p.rates.eigh_gflops = 10;
  p.rates.adamw_gbps = 20;
  return p;
}

StepSimulation Simulate(const PlanRequest& request, Strategy strategy,
                        const HardwareProfile& profile,
                        SimOptions options = {}) {
  PlanRequest r = request;
  r.strategy = strategy;
  auto plan = BuildPlan(r);
  EXPECT_TRUE(plan.ok()) << plan.status();
  auto sim = StepSimulator::Create(r, profile);
  EXPECT_TRUE(sim.ok()) << sim.status();
  auto out = sim->Simulate(*plan, options);
  EXPECT_TRUE(out.ok()) << out.status();
  return *out;
}

double UpdateSeconds(const PlanRequest& r, const Rates& rates) {
  const CostModel model(CostModelOptions{}, rates);
  double total = 0;
  for (const ParamSpec& p : r.parameters) {
    total += model.Work(p.optimizer, p.shape).seconds;
  }
  return total;
}

TEST(StepSimulatorTest, OneRankRunsTheCostModelsWork) {
  HardwareProfile p = Profile(CommPlane::kGloo, 0, 1);
  const PlanRequest r = Request(1, 1);
  const StepSimulation s = Simulate(r, Strategy::kCost, p);
  ASSERT_EQ(s.per_gpu.size(), 1u);
  // Every update locally, at the profile's rates.
  EXPECT_NEAR(s.slowest_per_phase.local_compute, UpdateSeconds(r, p.rates),
              1e-12);
  EXPECT_DOUBLE_EQ(s.per_gpu[0].update_s, s.slowest_per_phase.local_compute);
  // No peers: no exchange, only copies and passes around the update.
  EXPECT_EQ(s.slowest_per_phase.tp_gather, 0);
  EXPECT_GT(s.step_s, s.slowest_per_phase.local_compute);
  const PhaseSeconds& ph = s.per_gpu[0].phases;
  EXPECT_NEAR(
      ph.total,
      ph.reduce_scatter + ph.world_reduce + ph.local_compute + ph.all_gather,
      1e-12);
}

TEST(StepSimulatorTest, RanksShareTheNodesComputeUnits) {
  const PlanRequest r = Request(4, 1);
  const StepSimulation four =
      Simulate(r, Strategy::kCost, Profile(CommPlane::kGloo, 0, 4));
  const StepSimulation two =
      Simulate(r, Strategy::kCost, Profile(CommPlane::kGloo, 0, 2));
  // Four ranks on two units: the updates take about twice as long.
  EXPECT_GT(two.slowest_per_phase.local_compute,
            1.5 * four.slowest_per_phase.local_compute);
  EXPECT_LT(two.slowest_per_phase.local_compute,
            2.5 * four.slowest_per_phase.local_compute);
}

TEST(StepSimulatorTest, ScDuplicatesWhatCostPartitions) {
  const PlanRequest r = Request(2, 2);
  const HardwareProfile p = Profile(CommPlane::kNccl, 4, 4);
  const StepSimulation sc = Simulate(r, Strategy::kSc, p);
  const StepSimulation cost = Simulate(r, Strategy::kCost, p);
  EXPECT_GT(sc.step_s, cost.step_s);
  // sc: every TP rank gathers and updates every split matrix whole; no
  // micro-group pipeline.
  EXPECT_GT(sc.slowest_per_phase.tp_compute, cost.slowest_per_phase.tp_compute);
  EXPECT_EQ(sc.slowest_per_phase.tp_scatter, 0);
  EXPECT_GT(cost.slowest_per_phase.tp_scatter, 0);
  // sc's redundant compute is every split matrix's whole update.
  const CostModel model(CostModelOptions{}, p.rates);
  double split = 0;
  for (const ParamSpec& q : r.parameters) {
    if (q.tp_split_dim >= 0) split += model.Work(q.optimizer, q.shape).seconds;
  }
  EXPECT_GE(sc.slowest_per_phase.tp_compute, split);
}

TEST(StepSimulatorTest, BucketsCarryThePerRootOrPaddedChoice) {
  const PlanRequest r = Request(4, 1);
  const StepSimulation s =
      Simulate(r, Strategy::kCost, Profile(CommPlane::kNccl, 8, 8));
  ASSERT_FALSE(s.buckets.empty());
  for (const BucketSimulation& b : s.buckets) {
    EXPECT_EQ(b.algorithm, NcclUnevenName(b.reduce.measured_choice));
    EXPECT_DOUBLE_EQ(b.reduce_s, b.reduce.seconds);
    EXPECT_DOUBLE_EQ(b.reduce_s,
                     std::min(b.reduce.per_root_s, b.reduce.padded_s));
  }
  const nlohmann::json j = SimulationToJson(s, false);
  EXPECT_TRUE(j["buckets"][0].contains("nccl"));
}

TEST(StepSimulatorTest, SlowerLinksAcrossNodes) {
  const PlanRequest r = Request(4, 1);
  // DP4 on one node vs one rank per node (the slow tier).
  const StepSimulation one =
      Simulate(r, Strategy::kCost, Profile(CommPlane::kNccl, 4, 4));
  const StepSimulation spread =
      Simulate(r, Strategy::kCost, Profile(CommPlane::kNccl, 1, 1));
  EXPECT_EQ(one.nodes, 1);
  EXPECT_EQ(spread.nodes, 4);
  EXPECT_GT(spread.slowest_per_phase.reduce_scatter,
            2 * one.slowest_per_phase.reduce_scatter);
}

TEST(StepSimulatorTest, ShardGroupsAllReduceAcrossGroups) {
  const PlanRequest r = Request(4, 1, /*shard_group=*/2);
  const StepSimulation s =
      Simulate(r, Strategy::kCost, Profile(CommPlane::kNccl, 2, 2));
  EXPECT_EQ(s.per_gpu.size(), 2u);  // one group's positions
  double cross = 0;
  for (const BucketSimulation& b : s.buckets) cross += b.cross_s;
  EXPECT_GT(cross, 0);
}

TEST(StepSimulatorTest, OverlapHidesCommunicationUnderTheTrainer) {
  const PlanRequest r = Request(4, 1);
  SimOptions options;
  options.forward_s = 0.5;
  options.backward_s = 1.0;
  options.overlap = true;
  const StepSimulation s =
      Simulate(r, Strategy::kCost, Profile(CommPlane::kGloo, 0, 4), options);
  const SimOverlap& o = s.overlap;
  EXPECT_GT(o.dp_comm_s, 0);
  EXPECT_DOUBLE_EQ(o.plain_iteration_s, 1.5 + s.step_s);
  EXPECT_LT(o.overlap_exposed_s, o.plain_exposed_s);
  EXPECT_LT(o.overlap_iteration_s, o.plain_iteration_s);
}

TEST(StepSimulatorTest, TimelinesStayInsideTheStep) {
  const StepSimulation s =
      Simulate(Request(2, 2), Strategy::kCost, Profile(CommPlane::kGloo, 0, 2));
  for (const GpuSimulation& g : s.per_gpu) {
    ASSERT_FALSE(g.timeline.empty());
    double last = 0;
    for (const Segment& seg : g.timeline) {
      EXPECT_LE(seg.start, seg.end);
      EXPECT_GE(seg.start, 0);
      EXPECT_LE(seg.end, g.phases.total + 1e-12);
      last = std::max(last, seg.end);
    }
    EXPECT_DOUBLE_EQ(last, g.phases.total);
  }
}

TEST(StepSimulatorTest, RejectsAPlanOfAnotherRequest) {
  PlanRequest r = Request(2, 1);
  auto sim = StepSimulator::Create(r, Profile(CommPlane::kGloo, 0, 2));
  ASSERT_TRUE(sim.ok());
  PlanRequest other = Request(4, 1);
  auto plan = BuildPlan(other);
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(sim->Simulate(*plan, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  SimOptions bad;
  bad.forward_s = -1;
  auto own = BuildPlan(r);
  ASSERT_TRUE(own.ok());
  EXPECT_THAT(sim->Simulate(*own, bad).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace canzona::plan::sim
