// Hierarchical sharding in the planner (PlanRequest::shard_group_size):
// the flat plan is unchanged at S == dp, a hierarchical plan is one shard
// group's plan (positions in [0, S)), and the per-tier DP traffic follows the
// accounting documented in planner.h (TierTraffic).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/plan/model_config.h"
#include "server/plan/plan_json.h"
#include "server/plan/planner.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/plan/models_dir.h"

namespace canzona::plan {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr Strategy kSliced[] = {Strategy::kStartAnchored, Strategy::kAlpha,
                                Strategy::kCost};

// Real Qwen3 parameters (megatron layout, Muon) at the given layout.
PlanRequest QwenRequest(const std::string& model, ParallelLayout layout,
                        Strategy strategy) {
  PlanRequest req;
  req.layout = layout;
  req.strategy = strategy;
  absl::StatusOr<ModelConfig> config = LoadModelConfig(ModelsDir(), model);
  EXPECT_OK(config.status());
  if (!config.ok()) return req;
  absl::StatusOr<std::vector<ParamSpec>> params = BuildModelParameters(
      *config, ModelLayout::kMegatron, OptimizerKind::kMuon, layout);
  EXPECT_OK(params.status());
  if (params.ok()) req.parameters = *std::move(params);
  return req;
}

// Local bytes of parameter i (what the DP collectives move per TP rank).
double LocalBytes(const PlanRequest& req, int i) {
  const ParamSpec& p = req.parameters[i];
  int64_t numel = 1;
  for (int64_t d : p.shape) numel *= d;
  if (p.tp_split_dim >= 0 && req.layout.tp > 1) numel /= req.layout.tp;
  return static_cast<double>(numel) * DTypeBytes(p.dtype);
}

// Bytes of positions [cuts[d], cuts[d+1]) of bucket b.
double SliceBytes(const PlanRequest& req, const BucketPlan& b, int d) {
  double bytes = 0;
  for (int i = b.cuts[d]; i < b.cuts[d + 1]; ++i)
    bytes += LocalBytes(req, b.params[i]);
  return bytes;
}

// dp_traffic recomputed from the plan's cuts (planner.h, TierTraffic).
TierTraffic ExpectedTraffic(const PlanRequest& req, const Plan& plan) {
  const int S = plan.shard_group_size, P = req.layout.pp;
  const int G = req.layout.dp / S;
  const int L = G > 1 ? S : plan.link_group_size;
  std::vector<double> intra(P * S, 0.0), inter(P * S, 0.0);
  for (const BucketPlan& b : plan.buckets) {
    double total = 0;
    std::vector<double> own(S);
    for (int d = 0; d < S; ++d) {
      own[d] = SliceBytes(req, b, d);
      total += own[d];
    }
    for (int d = 0; d < S; ++d) {
      double link = 0;
      for (int e = d / L * L; e < (d / L + 1) * L; ++e) link += own[e];
      intra[b.stage * S + d] += 2 * (link - own[d]);
      inter[b.stage * S + d] += 2 * (total - link);
      if (G > 1) inter[b.stage * S + d] += 2.0 * (G - 1) / G * own[d];
    }
  }
  return {*std::max_element(intra.begin(), intra.end()),
          *std::max_element(inter.begin(), inter.end())};
}

double Rel(double a, double b) {
  const double scale = std::max(std::fabs(a), std::fabs(b));
  return scale == 0 ? 0 : std::fabs(a - b) / scale;
}

TEST(HierarchicalPlanTest, ShardGroupEqualToDpIsTheFlatPlan) {
  for (Strategy s :
       {Strategy::kSc, Strategy::kLayerwise, Strategy::kStartAnchored,
        Strategy::kAlpha, Strategy::kCost}) {
    PlanRequest req = QwenRequest("qwen3-1.7b", {2, 8, 2}, s);
    ASSERT_OK_AND_ASSIGN(Plan flat, BuildPlan(req));
    req.shard_group_size = 8;
    ASSERT_OK_AND_ASSIGN(Plan same, BuildPlan(req));
    req.link_group_size = 8;
    ASSERT_OK_AND_ASSIGN(Plan linked, BuildPlan(req));
    for (const Plan* p : {&same, &linked}) {
      EXPECT_EQ(p->digest, flat.digest) << StrategyName(s);
      EXPECT_EQ(CanonicalAssignment(*p), CanonicalAssignment(flat));
      EXPECT_EQ(PlanToJson(*p, true).dump(), PlanToJson(flat, true).dump())
          << StrategyName(s);
    }
    EXPECT_FALSE(flat.hierarchical());
    EXPECT_EQ(flat.shard_group_size, 8);
    EXPECT_EQ(flat.link_group_size, 8);
    EXPECT_EQ(flat.per_gpu.size(), 2u * 8 * 2);
    EXPECT_EQ(flat.comm.count("cross_group_all_reduce"), 0u);
    EXPECT_EQ(CanonicalAssignment(flat).find("shard_group"), std::string::npos);
    // One link group: everything is intra-group; it is the RS + AG volume.
    EXPECT_EQ(flat.dp_traffic.inter_group_bytes, 0);
    const double dp_bytes = flat.comm.at("reduce_scatter").bytes +
                            flat.comm.at("all_gather").bytes +
                            flat.comm.at("all_reduce").bytes;
    if (s != Strategy::kLayerwise) {
      EXPECT_LT(Rel(flat.dp_traffic.intra_group_bytes, dp_bytes), 1e-12)
          << StrategyName(s);
    }
  }
}

TEST(HierarchicalPlanTest, OneShardGroupIndexedByPosition) {
  for (Strategy s : kSliced) {
    for (int S : {1, 2, 4}) {
      PlanRequest req = QwenRequest("qwen3-1.7b", {2, 8, 2}, s);
      req.shard_group_size = S;
      ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(req));
      SCOPED_TRACE(absl::StrCat(StrategyName(s), " S=", S));
      EXPECT_TRUE(plan.hierarchical());
      EXPECT_EQ(plan.shard_group_size, S);
      EXPECT_EQ(plan.link_group_size, S);
      EXPECT_EQ(plan.layout.dp, 8);
      ASSERT_EQ(plan.per_gpu.size(), static_cast<size_t>(2 * S * 2));
      for (int st = 0; st < 2; ++st) {
        for (int d = 0; d < S; ++d) {
          for (int t = 0; t < 2; ++t) {
            const GpuLoad& g = plan.per_gpu[(st * S + d) * 2 + t];
            EXPECT_EQ(g.stage, st);
            EXPECT_EQ(g.dp, d);
            EXPECT_EQ(g.tp, t);
          }
        }
      }
      std::vector<int> seen(req.parameters.size(), 0);
      for (const BucketPlan& b : plan.buckets) {
        ASSERT_EQ(b.cuts.size(), static_cast<size_t>(S + 1));
        EXPECT_EQ(b.cuts.front(), 0);
        EXPECT_EQ(b.cuts.back(), static_cast<int>(b.params.size()));
        for (int d = 0; d < S; ++d) {
          ASSERT_LE(b.cuts[d], b.cuts[d + 1]);
          for (int i = b.cuts[d]; i < b.cuts[d + 1]; ++i) {
            EXPECT_EQ(plan.dp_owner[b.params[i]], d);
            ++seen[b.params[i]];
          }
        }
      }
      for (size_t i = 0; i < req.parameters.size(); ++i) {
        EXPECT_EQ(seen[i], 1) << req.parameters[i].name;
        EXPECT_GE(plan.dp_owner[i], 0);
        EXPECT_LT(plan.dp_owner[i], S);
      }
      for (const MicroGroup& g : plan.micro_groups) {
        EXPECT_GE(g.dp, 0);
        EXPECT_LT(g.dp, S);
      }
      EXPECT_NE(CanonicalAssignment(plan).find(
                    absl::StrCat(" shard_group=", S, "\n")),
                std::string::npos);
      ASSERT_EQ(plan.comm.count("cross_group_all_reduce"), 1u);
      const CommStats& xar = plan.comm.at("cross_group_all_reduce");
      EXPECT_GT(xar.calls, 0);
      EXPECT_EQ(xar.bytes, plan.dp_traffic.inter_group_bytes);
      if (S == 1) {
        EXPECT_EQ(plan.dp_traffic.intra_group_bytes, 0);
        EXPECT_EQ(plan.comm.at("reduce_scatter").calls, 0);
      }
      // The traffic matches the documented accounting on this plan's cuts.
      const TierTraffic want = ExpectedTraffic(req, plan);
      EXPECT_LT(Rel(plan.dp_traffic.intra_group_bytes, want.intra_group_bytes),
                1e-12);
      EXPECT_LT(Rel(plan.dp_traffic.inter_group_bytes, want.inter_group_bytes),
                1e-12);
      // Intra-group is the in-group reduce-scatter + all-gather.
      EXPECT_LT(Rel(plan.dp_traffic.intra_group_bytes,
                    plan.comm.at("reduce_scatter").bytes +
                        plan.comm.at("all_gather").bytes),
                1e-12);
    }
  }
}

TEST(HierarchicalPlanTest, FlatTrafficSplitByLinkGroups) {
  for (Strategy s : kSliced) {
    PlanRequest req = QwenRequest("qwen3-8b", {1, 8, 2}, s);
    req.link_group_size = 2;
    ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(req));
    EXPECT_FALSE(plan.hierarchical());
    EXPECT_EQ(plan.link_group_size, 2);
    const TierTraffic want = ExpectedTraffic(req, plan);
    EXPECT_LT(Rel(plan.dp_traffic.intra_group_bytes, want.intra_group_bytes),
              1e-12);
    EXPECT_LT(Rel(plan.dp_traffic.inter_group_bytes, want.inter_group_bytes),
              1e-12);
    EXPECT_GT(plan.dp_traffic.inter_group_bytes,
              plan.dp_traffic.intra_group_bytes);
  }
}

// 64 copies of Qwen3-8B's linear_fc2 in one bucket, start_anchored: every
// slice is exactly even (flat dp 8: 8 matrices each; S = 2: 32 each), so the
// hierarchical inter-group bytes are the flat (link groups of S) ones / S.
TEST(HierarchicalPlanTest, InterGroupBytesShrinkBySWithEvenSlices) {
  const PlanRequest qwen =
      QwenRequest("qwen3-8b", {1, 8, 2}, Strategy::kStartAnchored);
  const ParamSpec* fc2 = nullptr;
  for (const ParamSpec& p : qwen.parameters) {
    if (p.name.find("linear_fc2") != std::string::npos) {
      fc2 = &p;
      break;
    }
  }
  ASSERT_NE(fc2, nullptr);
  PlanRequest req;
  req.layout = {1, 8, 2};
  req.strategy = Strategy::kStartAnchored;
  req.bucket_size = int64_t{1} << 60;  // one bucket
  for (int i = 0; i < 64; ++i) {
    ParamSpec p = *fc2;
    p.name = absl::StrCat("m", i / 10, i % 10);
    req.parameters.push_back(p);
  }
  const double each = LocalBytes(req, 0);
  for (int S : {1, 2, 4}) {
    PlanRequest flat_req = req;
    flat_req.link_group_size = S;
    ASSERT_OK_AND_ASSIGN(Plan flat, BuildPlan(flat_req));
    PlanRequest hier_req = req;
    hier_req.shard_group_size = S;
    ASSERT_OK_AND_ASSIGN(Plan hier, BuildPlan(hier_req));
    ASSERT_EQ(hier.buckets.size(), 1u);
    SCOPED_TRACE(absl::StrCat("S=", S));
    // flat: 2 * (64 - 8S) matrices to other link groups.
    EXPECT_LT(Rel(flat.dp_traffic.inter_group_bytes, 2.0 * (64 - 8 * S) * each),
              1e-12);
    EXPECT_LT(Rel(hier.dp_traffic.inter_group_bytes,
                  flat.dp_traffic.inter_group_bytes / S),
              1e-9);
    // In the group: RS + AG of the other S - 1 positions' 64 / S matrices.
    EXPECT_LT(Rel(hier.dp_traffic.intra_group_bytes,
                  2.0 * (S - 1) * (64.0 / S) * each),
              1e-12);
    EXPECT_LT(Rel(hier.memory_max_bytes, flat.memory_max_bytes * 8 / S), 1e-12);
  }
}

TEST(HierarchicalPlanTest, StatePerGpuGrowsByDpOverS) {
  for (Strategy s : kSliced) {
    PlanRequest req = QwenRequest("qwen3-8b", {1, 8, 2}, s);
    req.link_group_size = 2;
    ASSERT_OK_AND_ASSIGN(Plan flat, BuildPlan(req));
    req.link_group_size = 0;
    req.shard_group_size = 2;
    ASSERT_OK_AND_ASSIGN(Plan hier, BuildPlan(req));
    SCOPED_TRACE(StrategyName(s));
    EXPECT_GE(hier.memory_max_bytes, flat.memory_max_bytes);
    // One group holds the whole state once: the mean grows by exactly dp/S.
    EXPECT_LT(Rel(hier.memory_mean_bytes, flat.memory_mean_bytes * 4), 1e-12);
    EXPECT_LT(hier.dp_traffic.inter_group_bytes,
              flat.dp_traffic.inter_group_bytes);
    EXPECT_GE(hier.makespan, flat.makespan);
    EXPECT_GE(hier.makespan, hier.lower_bound * (1 - 1e-12));
  }
}

TEST(HierarchicalPlanTest, Deterministic) {
  for (Strategy s : kSliced) {
    PlanRequest req = QwenRequest("qwen3-14b", {1, 8, 4}, s);
    req.shard_group_size = 2;
    ASSERT_OK_AND_ASSIGN(Plan a, BuildPlan(req));
    ASSERT_OK_AND_ASSIGN(Plan b, BuildPlan(req));
    EXPECT_EQ(a.digest, b.digest);
    EXPECT_EQ(PlanToJson(a, true).dump(), PlanToJson(b, true).dump());
    req.shard_group_size = 0;
    ASSERT_OK_AND_ASSIGN(Plan flat, BuildPlan(req));
    EXPECT_NE(a.digest, flat.digest);
  }
}

TEST(HierarchicalPlanTest, JsonKeys) {
  PlanRequest req = QwenRequest("qwen3-8b", {1, 8, 2}, Strategy::kCost);
  req.shard_group_size = 4;
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(req));
  const nlohmann::json j = PlanToJson(plan);
  EXPECT_EQ(j["shard_group_size"], 4);
  EXPECT_EQ(j["link_group_size"], 4);
  EXPECT_EQ(j["layout"]["dp"], 8);
  EXPECT_EQ(j["gpus"], 8);
  EXPECT_EQ(j["dp_traffic"]["intra_group_bytes"].get<double>(),
            plan.dp_traffic.intra_group_bytes);
  EXPECT_EQ(j["dp_traffic"]["inter_group_bytes"].get<double>(),
            plan.dp_traffic.inter_group_bytes);
  EXPECT_TRUE(j["comm"].contains("cross_group_all_reduce"));
  EXPECT_TRUE(j["comm"].contains("reduce_scatter"));
  EXPECT_TRUE(j.contains("digest"));
}

TEST(HierarchicalPlanTest, InvalidShardGroupSize) {
  PlanRequest req = QwenRequest("qwen3-8b", {1, 8, 2}, Strategy::kCost);
  for (int S : {3, -1, -8, 16, 5}) {
    req.shard_group_size = S;
    EXPECT_THAT(BuildPlan(req), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("shard_group_size")))
        << S;
  }
  for (Strategy s : {Strategy::kSc, Strategy::kLayerwise}) {
    req.strategy = s;
    req.shard_group_size = 4;
    EXPECT_THAT(
        BuildPlan(req),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 AllOf(HasSubstr("shard_group_size"),
                       HasSubstr("requires a bucket-sliced strategy"))));
    req.shard_group_size = 8;  // flat: fine
    EXPECT_OK(BuildPlan(req).status());
  }
  req.strategy = Strategy::kCost;
  req.shard_group_size = 0;
  for (int L : {3, -2, 16}) {
    req.link_group_size = L;
    EXPECT_THAT(BuildPlan(req), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("link_group_size")))
        << L;
  }
  req.shard_group_size = 4;
  req.link_group_size = 2;  // hierarchical: the link group is the shard group
  EXPECT_THAT(BuildPlan(req), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("link_group_size")));
  req.link_group_size = 4;
  EXPECT_OK(BuildPlan(req).status());
}

}  // namespace
}  // namespace canzona::plan
