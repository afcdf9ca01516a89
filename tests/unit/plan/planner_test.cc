#include "server/plan/planner.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/plan/plan_json.h"
#include "tests/matchers/status_matchers.h"

namespace canzona::plan {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

ParamSpec AdamW(const std::string& name, int64_t n) {
  return {name, {n}, DType::kFloat32, OptimizerKind::kAdamW, -1, 0};
}
ParamSpec Muon(const std::string& name, int64_t rows, int64_t cols, int split) {
  return {name, {rows, cols}, DType::kBFloat16, OptimizerKind::kMuon, split, 0};
}

int OwnerOf(const Plan& plan, const std::string& name) {
  for (size_t i = 0; i < plan.param_names.size(); ++i) {
    if (plan.param_names[i] == name) return plan.dp_owner[i];
  }
  return -2;
}
int HostOf(const Plan& plan, const std::string& name) {
  for (size_t i = 0; i < plan.param_names.size(); ++i) {
    if (plan.param_names[i] == name) return plan.tp_owner[i];
  }
  return -2;
}

// Deterministic pseudo-random generator (the test must not depend on the
// standard library's distributions, which differ between implementations).
class Lcg {
 public:
  explicit Lcg(uint64_t seed) : state_(seed) {}
  int Next(int bound) {
    state_ = state_ * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int>((state_ >> 33) % static_cast<uint64_t>(bound));
  }

 private:
  uint64_t state_;
};

PlanRequest RandomRequest(uint64_t seed) {
  Lcg rng(seed);
  PlanRequest req;
  const int tps[] = {1, 2, 4};
  req.layout = {1 + rng.Next(2), 1 + rng.Next(6), tps[rng.Next(3)]};
  const int n = 5 + rng.Next(60);
  for (int i = 0; i < n; ++i) {
    const int stage = rng.Next(req.layout.pp);
    const std::string name = absl::StrCat("p", i);
    ParamSpec p;
    switch (rng.Next(4)) {
      case 0:
        p = AdamW(name, 16 * (1 + rng.Next(64)));
        break;
      case 1:
        p = {name,
             {4L * (1 + rng.Next(64)), 64},
             DType::kBFloat16,
             OptimizerKind::kAdamW,
             0,
             0};
        break;
      default: {
        const int64_t rows = 4 * (1 + rng.Next(48));
        const int64_t cols = 4 * (1 + rng.Next(48));
        const OptimizerKind kinds[] = {OptimizerKind::kMuon,
                                       OptimizerKind::kShampoo,
                                       OptimizerKind::kSoap};
        p = {name,
             {rows, cols},
             DType::kBFloat16,
             kinds[rng.Next(3)],
             rng.Next(3) - 1,
             0};
      }
    }
    p.pp_stage = stage;
    req.parameters.push_back(p);
  }
  req.bucket_size = 200 + rng.Next(4000);
  req.alpha = rng.Next(5) / 4.0;
  req.fuse_space = 500 + rng.Next(5000);
  return req;
}

// Checks the structural invariants of a sliced plan.
void CheckSlicedPlan(const PlanRequest& req, const Plan& plan) {
  const int R = req.layout.dp, T = req.layout.tp;
  std::vector<int> seen(req.parameters.size(), 0);
  for (const BucketPlan& b : plan.buckets) {
    ASSERT_EQ(b.cuts.size(), static_cast<size_t>(R + 1));
    EXPECT_EQ(b.cuts.front(), 0);
    EXPECT_EQ(b.cuts.back(), static_cast<int>(b.params.size()));
    for (int d = 0; d < R; ++d) {
      ASSERT_LE(b.cuts[d], b.cuts[d + 1]) << "slices in order";
      // Cuts are indices into the parameter list: slices hold whole
      // parameters, contiguously.
      for (int i = b.cuts[d]; i < b.cuts[d + 1]; ++i) {
        EXPECT_EQ(plan.dp_owner[b.params[i]], d);
        ++seen[b.params[i]];
      }
    }
  }
  for (size_t i = 0; i < req.parameters.size(); ++i) {
    const ParamSpec& p = req.parameters[i];
    EXPECT_EQ(seen[i], 1) << p.name << " in exactly one slice";
    EXPECT_GE(plan.dp_owner[i], 0);
    EXPECT_LT(plan.dp_owner[i], R);
    const bool tp_owned =
        IsMatrixOptimizer(p.optimizer) && p.tp_split_dim >= 0 && T > 1;
    if (tp_owned) {
      EXPECT_GE(plan.tp_owner[i], 0) << p.name;
      EXPECT_LT(plan.tp_owner[i], T) << p.name;
    } else {
      EXPECT_EQ(plan.tp_owner[i], -1) << p.name;
    }
  }
  // Every TP-owned parameter is in exactly one micro-group of its owner.
  std::vector<int> grouped(req.parameters.size(), 0);
  for (const MicroGroup& g : plan.micro_groups) {
    for (int p : g.params) {
      ++grouped[p];
      EXPECT_EQ(plan.dp_owner[p], g.dp);
    }
  }
  for (size_t i = 0; i < req.parameters.size(); ++i) {
    EXPECT_EQ(grouped[i], plan.tp_owner[i] >= 0 ? 1 : 0);
  }
}

TEST(PlannerPropertyTest, RandomListsAndLayouts) {
  for (uint64_t seed = 1; seed <= 120; ++seed) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    PlanRequest req = RandomRequest(seed);
    double alpha_makespan = 0, anchored_makespan = 0;
    for (Strategy s : AllStrategies()) {
      SCOPED_TRACE(StrategyName(s));
      req.strategy = s;
      ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(req));
      ASSERT_OK_AND_ASSIGN(Plan again, BuildPlan(req));
      EXPECT_EQ(plan.digest, again.digest);
      EXPECT_EQ(plan.per_gpu.size(), static_cast<size_t>(req.layout.pp) *
                                         req.layout.dp * req.layout.tp);
      EXPECT_GE(plan.makespan, plan.lb * (1 - 1e-9));
      EXPECT_GE(plan.makespan, plan.lower_bound * (1 - 1e-9));
      EXPECT_GE(plan.lower_bound, plan.lb * (1 - 1e-12));
      EXPECT_GE(plan.max_over_mean(), 1 - 1e-12);
      if (s == Strategy::kStartAnchored || s == Strategy::kAlpha ||
          s == Strategy::kCost) {
        CheckSlicedPlan(req, plan);
      }
      if (s == Strategy::kAlpha) alpha_makespan = plan.makespan;
      if (s == Strategy::kStartAnchored) anchored_makespan = plan.makespan;
      if (s == Strategy::kCost) {
        EXPECT_LE(plan.makespan, alpha_makespan * (1 + 1e-9));
        EXPECT_LE(plan.makespan, anchored_makespan * (1 + 1e-9));
      }
    }
  }
}

TEST(PlannerTest, ScAndLayerwise) {
  PlanRequest req;
  req.layout = {1, 2, 2};
  req.parameters = {Muon("a", 64, 64, 0), Muon("b", 32, 64, 1), AdamW("n", 64)};
  req.strategy = Strategy::kSc;
  ASSERT_OK_AND_ASSIGN(Plan sc, BuildPlan(req));
  for (const GpuLoad& g : sc.per_gpu) {
    EXPECT_DOUBLE_EQ(g.objective, sc.per_gpu[0].objective);
  }
  EXPECT_EQ(sc.comm.at("all_reduce").calls, 1);
  EXPECT_EQ(sc.comm.at("reduce_scatter").calls, 0);
  req.strategy = Strategy::kLayerwise;
  ASSERT_OK_AND_ASSIGN(Plan lw, BuildPlan(req));
  // LPT on cost: the largest matrix alone on one rank.
  EXPECT_NE(OwnerOf(lw, "a"), OwnerOf(lw, "b"));
  EXPECT_GT(lw.comm.at("all_gather").calls, 0);
}

// Hand-checked reproduction of Canzona's alpha-balanced greedy.
// Trainer order A(10) B(30) C(20) D(40) E(40), bucket size 50, two ranks:
// buckets (reverse order) [E, D] (80), [C, B] (50), [A] (10); G = 70.
//   bucket [E,D]: targets 40/40 -> cut at 40: E -> 0, D -> 1 (loads 40 40)
//   bucket [C,B]: targets 25/25 -> nearest boundary to 25 is 20: C -> 0,
//                 B -> 1 (loads 60 70)
//   bucket [A]:   alpha 1: deficits 10/0 -> target 10 -> A -> 0 (70 70);
//                 alpha 0: target 5, boundaries 0 and 10 tie -> the lower
//                 one -> A -> 1 (60 80).
// start_anchored: loads 100/40, so both greedy plans are accepted.
PlanRequest GoldenAlphaRequest(double alpha) {
  PlanRequest req;
  req.layout = {1, 2, 1};
  req.parameters = {AdamW("A", 10), AdamW("B", 30), AdamW("C", 20),
                    AdamW("D", 40), AdamW("E", 40)};
  req.bucket_size = 50;
  req.strategy = Strategy::kAlpha;
  req.alpha = alpha;
  return req;
}

TEST(AlphaReproductionTest, GoldenAlphaOne) {
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(GoldenAlphaRequest(1.0)));
  EXPECT_TRUE(plan.alpha_accepted);
  EXPECT_EQ(OwnerOf(plan, "E"), 0);
  EXPECT_EQ(OwnerOf(plan, "D"), 1);
  EXPECT_EQ(OwnerOf(plan, "C"), 0);
  EXPECT_EQ(OwnerOf(plan, "B"), 1);
  EXPECT_EQ(OwnerOf(plan, "A"), 0);
  ASSERT_EQ(plan.buckets.size(), 3u);
  EXPECT_EQ(plan.buckets[0].cuts, (std::vector<int>{0, 1, 2}));
}

TEST(AlphaReproductionTest, GoldenAlphaZero) {
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(GoldenAlphaRequest(0.0)));
  EXPECT_TRUE(plan.alpha_accepted);
  EXPECT_EQ(OwnerOf(plan, "C"), 0);
  EXPECT_EQ(OwnerOf(plan, "A"), 1);  // pure communication balance
}

TEST(AlphaReproductionTest, StartAnchoredGolden) {
  PlanRequest req = GoldenAlphaRequest(1.0);
  req.strategy = Strategy::kStartAnchored;
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(req));
  // Equal slices at 40, 25 and 5: C and B start before 25 -> rank 0.
  EXPECT_EQ(OwnerOf(plan, "E"), 0);
  EXPECT_EQ(OwnerOf(plan, "D"), 1);
  EXPECT_EQ(OwnerOf(plan, "C"), 0);
  EXPECT_EQ(OwnerOf(plan, "B"), 0);
  EXPECT_EQ(OwnerOf(plan, "A"), 0);
}

TEST(AlphaReproductionTest, AlphaZeroCutsAreNearestEqualBoundaries) {
  // With alpha = 0 every cut is the parameter boundary nearest to r|B|/R
  // (ties to the lower one), whenever the plan is accepted.
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    PlanRequest req = RandomRequest(seed);
    req.layout.tp = 1;
    for (auto& p : req.parameters) p.tp_split_dim = -1;
    req.alpha = 0;
    req.strategy = Strategy::kAlpha;
    ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(req));
    if (!plan.alpha_accepted) continue;
    const int R = req.layout.dp;
    for (const BucketPlan& b : plan.buckets) {
      std::vector<int64_t> bounds = {0};
      for (int p : b.params) {
        int64_t n = 1;
        for (int64_t d : req.parameters[p].shape) n *= d;
        bounds.push_back(bounds.back() + n);
      }
      for (int r = 1; r < R; ++r) {
        const double target = static_cast<double>(bounds.back()) * r / R;
        const double got = std::fabs(bounds[b.cuts[r]] - target);
        for (size_t j = b.cuts[r - 1]; j < bounds.size(); ++j) {
          EXPECT_GE(std::fabs(bounds[j] - target), got - 1e-9)
              << "seed " << seed << " cut " << r;
        }
      }
    }
  }
}

TEST(AlphaReproductionTest, RejectedWhenNotStrictlyBetter) {
  PlanRequest req;
  req.layout = {1, 2, 1};
  req.parameters = {AdamW("only", 10)};
  req.strategy = Strategy::kAlpha;
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(req));
  EXPECT_FALSE(plan.alpha_accepted);
  EXPECT_EQ(OwnerOf(plan, "only"), 0);  // start_anchored kept
}

// Greedy rollback micro-groups: local numels 16, 12, 8, 4 on T = 2.
TEST(AlphaReproductionTest, GreedyRollbackGolden) {
  PlanRequest req;
  req.layout = {1, 1, 2};
  req.parameters = {Muon("M1", 4, 8, 0), Muon("M2", 4, 6, 0),
                    Muon("M3", 4, 4, 0), Muon("M4", 2, 4, 0)};
  req.strategy = Strategy::kAlpha;
  req.fuse_space = 20;
  ASSERT_OK_AND_ASSIGN(Plan one, BuildPlan(req));
  ASSERT_EQ(one.micro_groups.size(), 1u);
  EXPECT_EQ(HostOf(one, "M1"), 0);
  EXPECT_EQ(HostOf(one, "M2"), 1);
  EXPECT_EQ(HostOf(one, "M3"), 1);
  EXPECT_EQ(HostOf(one, "M4"), 0);
  // Cap 15: M1 (16) alone; then M2 -> 0, M3 -> 1, M4 -> 1.
  req.fuse_space = 15;
  ASSERT_OK_AND_ASSIGN(Plan two, BuildPlan(req));
  ASSERT_EQ(two.micro_groups.size(), 2u);
  EXPECT_EQ(two.micro_groups[0].params, (std::vector<int>{0}));
  EXPECT_EQ(HostOf(two, "M2"), 0);
  EXPECT_EQ(HostOf(two, "M3"), 1);
  EXPECT_EQ(HostOf(two, "M4"), 1);
}

TEST(CostStrategyTest, AdamWDoesNotSitBesideTheLargestMatrix) {
  // One big matrix dominates; the big AdamW shard must go to the other DP
  // rank so the makespan is the matrix alone.
  PlanRequest req;
  req.layout = {1, 2, 2};
  req.parameters = {
      {"emb", {4096, 64}, DType::kBFloat16, OptimizerKind::kAdamW, 0, 0},
      Muon("big", 256, 256, 0),
      Muon("small", 32, 32, 1)};
  req.strategy = Strategy::kCost;
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(req));
  EXPECT_NE(OwnerOf(plan, "emb"), OwnerOf(plan, "big"));
  EXPECT_NEAR(plan.makespan_over_lb(), 1.0, 1e-12);
}

// A fixed plan's digest: stable across processes and machines (FNV-1a of a
// canonical text; no pointers, hashes of std types or floating output).
TEST(PlannerTest, GoldenDigest) {
  PlanRequest req;
  req.layout = {1, 2, 2};
  for (int l = 0; l < 4; ++l) {
    req.parameters.push_back(AdamW(absl::StrCat("l", l, ".norm"), 64));
    req.parameters.push_back(Muon(absl::StrCat("l", l, ".qkv"), 192, 64, 0));
    req.parameters.push_back(Muon(absl::StrCat("l", l, ".proj"), 64, 64, 1));
  }
  req.bucket_size = 20000;
  req.strategy = Strategy::kCost;
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(req));
  EXPECT_EQ(plan.digest, Fnv1a64Hex(CanonicalAssignment(plan)));
  EXPECT_EQ(plan.digest, "01d13d82552039af") << CanonicalAssignment(plan);
  EXPECT_EQ(Fnv1a64Hex(""), "cbf29ce484222325");
  EXPECT_EQ(Fnv1a64Hex("a"), "af63dc4c8601ec8c");
}

TEST(PlannerTest, JsonHasDocumentedKeys) {
  PlanRequest req = RandomRequest(7);
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(req));
  const nlohmann::json j = PlanToJson(plan);
  for (const char* key :
       {"strategy", "gpus", "makespan_over_lb", "lower_bound_over_lb",
        "max_over_mean", "lb_binding", "per_gpu", "comm", "memory",
        "micro_groups", "digest", "lower_bound"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["per_gpu"].size(), plan.per_gpu.size());
}

TEST(PlannerTest, BadRequestsNameTheField) {
  PlanRequest req;
  req.layout = {1, 2, 2};
  req.parameters = {Muon("w", 5, 8, 0)};
  EXPECT_THAT(BuildPlan(req), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("tp 2 does not divide")));
  req.parameters = {Muon("w", 8, 8, 0), Muon("w", 8, 8, 0)};
  EXPECT_THAT(BuildPlan(req), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("duplicate")));
  req.parameters = {Muon("v", 8, 8, 0)};
  req.layout.dp = 0;
  EXPECT_THAT(BuildPlan(req), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("layout.dp")));
  req.layout.dp = 2;
  req.bucket_size = 0;
  EXPECT_THAT(BuildPlan(req), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("bucket_size")));
  req.bucket_size = 100;
  req.alpha = 1.5;
  EXPECT_THAT(BuildPlan(req),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("alpha")));
  req.alpha = 1;
  req.parameters = {
      {"vec", {8}, DType::kBFloat16, OptimizerKind::kMuon, -1, 0}};
  EXPECT_THAT(BuildPlan(req),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2-D")));
  req.parameters = {
      {"z", {0, 8}, DType::kBFloat16, OptimizerKind::kAdamW, -1, 0}};
  EXPECT_THAT(BuildPlan(req),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("zero")));
  req.parameters = {
      {"s", {8, 8}, DType::kBFloat16, OptimizerKind::kAdamW, -1, 3}};
  EXPECT_THAT(BuildPlan(req), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("pp_stage")));
  EXPECT_THAT(ParseStrategy("best"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("best")));
}

}  // namespace
}  // namespace canzona::plan
