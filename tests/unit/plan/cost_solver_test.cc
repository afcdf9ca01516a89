// The cost strategy's per-stage solver (server/plan/cost_solver.h), tested
// through its internal header on hand-built contexts with exact integer
// costs, so loads and makespans compare exactly, and on contexts that
// MakeContext builds from random parameter lists.
#include "server/plan/cost_solver.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/plan/lower_bound.h"
#include "server/plan/planning_context.h"

namespace canzona::plan::internal {
namespace {

// One parameter of a hand-built context. `cost` lands on its TP owner when
// TP-owned, else on every TP rank of its owner.
struct Spec {
  std::string name;
  double cost = 0;
  bool tp_owned = true;
  int64_t numel = 1;
};

// A context of `stages` stages (every parameter in stage 0) with R DP and T
// TP ranks; `buckets` lists indices into `specs` in bucket order. The bound
// is computed as MakeContext does. The solver reads no request, so `req`
// stays null.
Context HandBuilt(int R, int T, const std::vector<Spec>& specs,
                  const std::vector<std::vector<int>>& buckets,
                  int stages = 1) {
  Context ctx;
  ctx.P = stages;
  ctx.R = ctx.D = ctx.L = R;
  ctx.T = T;
  const int n = static_cast<int>(specs.size());
  std::vector<int> by_name(n);
  std::iota(by_name.begin(), by_name.end(), 0);
  std::sort(by_name.begin(), by_name.end(),
            [&](int a, int b) { return specs[a].name < specs[b].name; });
  ctx.items.resize(n);
  for (int r = 0; r < n; ++r) ctx.items[by_name[r]].name_rank = r;
  ctx.stage_params.assign(stages, {});
  ctx.stage_buckets.assign(stages, {});
  std::vector<double> whole;
  for (int i = 0; i < n; ++i) {
    Item& it = ctx.items[i];
    it.tp_owned = specs[i].tp_owned;
    it.split = specs[i].tp_owned;
    it.cost = it.full_cost = specs[i].cost;
    it.fragment_numel = specs[i].numel;
    ctx.stage_params[0].push_back(i);
    for (int c = 0; c < (it.tp_owned ? 1 : T); ++c) whole.push_back(it.cost);
  }
  for (const std::vector<int>& params : buckets) {
    BucketPlan b;
    b.params = params;
    std::vector<int64_t> off(params.size() + 1, 0);
    for (size_t i = 0; i < params.size(); ++i) {
      off[i + 1] = off[i] + specs[params[i]].numel;
    }
    b.elements = off.back();
    ctx.stage_buckets[0].push_back(static_cast<int>(ctx.buckets.size()));
    ctx.buckets.push_back(std::move(b));
    ctx.offsets.push_back(std::move(off));
  }
  ctx.stage_lower_bound.assign(stages, 0);
  ctx.stage_lower_bound[0] = MakespanLowerBound(whole, 0, R * T);
  ctx.lb = ctx.lower_bound = ctx.stage_lower_bound[0];
  return ctx;
}

std::vector<std::vector<int>> OneBucket(int n) {
  std::vector<int> all(n);
  std::iota(all.begin(), all.end(), 0);
  return {all};
}

double Total(const Context& ctx, int stage) {
  double total = 0;
  for (int i : ctx.stage_params[stage]) {
    const Item& it = ctx.items[i];
    total += it.tp_owned ? it.cost : it.cost * ctx.T;
  }
  return total;
}

// The solver's contract, recomputed from scratch: per bucket R + 1
// non-decreasing cuts from 0 to the bucket's size; every parameter of the
// stage in exactly one slice, owned by that slice's rank, TP-owned parameters
// on one TP rank and the others on none; parameters of other stages
// untouched; loads, makespan and slice imbalance as the assignment implies;
// the makespan never below the proven bound nor above the stage's total.
void ExpectValid(const Context& ctx, int stage,
                 const CostSolver::Solution& sol) {
  const int R = ctx.R, T = ctx.T;
  const auto& ids = ctx.stage_buckets[stage];
  ASSERT_EQ(sol.cuts.size(), ids.size());
  ASSERT_EQ(sol.owner.size(), ctx.items.size());
  ASSERT_EQ(sol.tp_owner.size(), ctx.items.size());
  std::vector<int> slices(ctx.items.size(), 0), slice_owner(ctx.items.size());
  double imbalance = 1.0;
  for (size_t k = 0; k < ids.size(); ++k) {
    const auto& params = ctx.buckets[ids[k]].params;
    const auto& cuts = sol.cuts[k];
    ASSERT_EQ(cuts.size(), static_cast<size_t>(R + 1)) << "bucket " << k;
    EXPECT_EQ(cuts.front(), 0) << "bucket " << k;
    EXPECT_EQ(cuts.back(), static_cast<int>(params.size())) << "bucket " << k;
    int64_t largest = 0, elements = 0;
    for (int d = 0; d < R; ++d) {
      ASSERT_LE(cuts[d], cuts[d + 1]) << "bucket " << k << " rank " << d;
      int64_t slice = 0;
      for (int i = cuts[d]; i < cuts[d + 1]; ++i) {
        ++slices[params[i]];
        slice_owner[params[i]] = d;
        slice += ctx.items[params[i]].fragment_numel;
      }
      largest = std::max(largest, slice);
      elements += slice;
    }
    if (elements > 0) {
      imbalance = std::max(imbalance, static_cast<double>(largest) /
                                          (static_cast<double>(elements) / R));
    }
  }
  std::vector<std::vector<double>> load(R, std::vector<double>(T, 0.0));
  std::vector<bool> in_stage(ctx.items.size(), false);
  for (int p : ctx.stage_params[stage]) {
    in_stage[p] = true;
    const Item& it = ctx.items[p];
    ASSERT_EQ(slices[p], 1)
        << "parameter " << p << " in " << slices[p] << " slices";
    ASSERT_EQ(sol.owner[p], slice_owner[p]) << "parameter " << p;
    if (it.tp_owned) {
      ASSERT_GE(sol.tp_owner[p], 0) << "parameter " << p;
      ASSERT_LT(sol.tp_owner[p], T) << "parameter " << p;
      load[sol.owner[p]][sol.tp_owner[p]] += it.cost;
    } else {
      ASSERT_EQ(sol.tp_owner[p], -1) << "parameter " << p;
      for (double& x : load[sol.owner[p]]) x += it.cost;
    }
  }
  for (size_t p = 0; p < ctx.items.size(); ++p) {
    if (in_stage[p]) continue;
    EXPECT_EQ(sol.owner[p], -1) << "parameter " << p << " of another stage";
    EXPECT_EQ(sol.tp_owner[p], -1) << "parameter " << p << " of another stage";
  }
  double makespan = 0;
  const double tol = 1e-9 * std::max(1.0, sol.makespan);
  ASSERT_EQ(sol.load.size(), static_cast<size_t>(R));
  for (int d = 0; d < R; ++d) {
    ASSERT_EQ(sol.load[d].size(), static_cast<size_t>(T));
    for (int t = 0; t < T; ++t) {
      EXPECT_NEAR(sol.load[d][t], load[d][t], tol) << "GPU " << d << "," << t;
      makespan = std::max(makespan, load[d][t]);
    }
  }
  EXPECT_NEAR(sol.makespan, makespan, tol);
  EXPECT_NEAR(sol.imbalance, imbalance, 1e-12);
  EXPECT_GE(sol.makespan, ctx.stage_lower_bound[stage] * (1 - 1e-12));
  EXPECT_LE(sol.makespan, Total(ctx, stage) * (1 + 1e-12));
}

// Deterministic generator (no standard-library distributions: they differ
// between implementations).
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

// Random one-stage instance: integer costs, mixed TP-owned / not, 1-3
// buckets that partition the parameters in order.
Context RandomHandBuilt(uint64_t seed, int max_params, int max_r, int max_t) {
  Lcg rng(seed);
  const int R = 1 + rng.Next(max_r), T = 1 + rng.Next(max_t);
  const int n = 1 + rng.Next(max_params);
  std::vector<Spec> specs;
  for (int i = 0; i < n; ++i) {
    const bool tp_owned = rng.Next(4) != 0;
    specs.push_back({absl::StrCat("p", rng.Next(1000), "_", i),
                     static_cast<double>(1 + rng.Next(tp_owned ? 40 : 10)),
                     tp_owned, 1 + rng.Next(100)});
  }
  std::vector<std::vector<int>> buckets(1);
  for (int i = 0; i < n; ++i) {
    if (!buckets.back().empty() && buckets.size() < 3 && rng.Next(4) == 0) {
      buckets.emplace_back();
    }
    buckets.back().push_back(i);
  }
  return HandBuilt(R, T, specs, buckets);
}

// The best makespan over every contiguous cut of every bucket and every
// TP owner choice, by enumeration (tiny instances only).
double BruteForceOptimum(const Context& ctx) {
  const int R = ctx.R, T = ctx.T, n = static_cast<int>(ctx.items.size());
  // Best per-row makespan of each parameter subset.
  std::vector<double> row_best(1u << n);
  for (uint32_t mask = 0; mask < (1u << n); ++mask) {
    double spread = 0;
    std::vector<int> tp_owned;
    for (int i = 0; i < n; ++i) {
      if (!(mask >> i & 1)) continue;
      if (ctx.items[i].tp_owned) {
        tp_owned.push_back(i);
      } else {
        spread += ctx.items[i].cost;
      }
    }
    int choices = 1;
    for (size_t j = 0; j < tp_owned.size(); ++j) choices *= T;
    double best = 1e300;
    for (int c = 0; c < choices; ++c) {
      std::vector<double> load(T, spread);
      int x = c;
      for (int p : tp_owned) {
        load[x % T] += ctx.items[p].cost;
        x /= T;
      }
      best = std::min(best, *std::max_element(load.begin(), load.end()));
    }
    row_best[mask] = best;
  }
  // Every combination of cuts, bucket by bucket.
  const size_t nb = ctx.buckets.size();
  std::vector<std::vector<int>> cuts(nb);
  for (size_t k = 0; k < nb; ++k) {
    cuts[k].assign(R + 1, 0);
    cuts[k][R] = static_cast<int>(ctx.buckets[k].params.size());
  }
  double best = 1e300;
  // Advances the inner cuts of bucket k like an odometer; false on wrap.
  auto next = [&](size_t k) {
    const int size = static_cast<int>(ctx.buckets[k].params.size());
    for (int d = R - 1; d >= 1; --d) {
      if (cuts[k][d] < size) {
        ++cuts[k][d];
        for (int e = d + 1; e < R; ++e) cuts[k][e] = cuts[k][d];
        return true;
      }
    }
    for (int d = 1; d < R; ++d) cuts[k][d] = 0;
    return false;
  };
  while (true) {
    std::vector<uint32_t> rows(R, 0);
    for (size_t k = 0; k < nb; ++k) {
      for (int d = 0; d < R; ++d) {
        for (int i = cuts[k][d]; i < cuts[k][d + 1]; ++i) {
          rows[d] |= 1u << ctx.buckets[k].params[i];
        }
      }
    }
    double makespan = 0;
    for (uint32_t row : rows) makespan = std::max(makespan, row_best[row]);
    best = std::min(best, makespan);
    size_t k = 0;
    while (k < nb && !next(k)) ++k;
    if (k == nb) break;
  }
  return best;
}

void ExpectSameSolution(const CostSolver::Solution& a,
                        const CostSolver::Solution& b) {
  EXPECT_EQ(a.cuts, b.cuts);
  EXPECT_EQ(a.owner, b.owner);
  EXPECT_EQ(a.tp_owner, b.tp_owner);
  EXPECT_EQ(a.load, b.load);  // bitwise: same operations in the same order
  EXPECT_EQ(a.makespan, b.makespan);
  EXPECT_EQ(a.imbalance, b.imbalance);
}

TEST(CostSolverTest, PerfectPackingMeetsTheLowerBound) {
  // Two matrices per GPU that sum to 10, interleaved in bucket order: the
  // average (10) is reachable, so the solver must reach it.
  for (const auto& [R, T] : {std::pair{2, 2}, {3, 2}, {2, 4}, {4, 1}, {1, 3}}) {
    Lcg rng(R * 10 + T);
    std::vector<Spec> specs;
    for (int g = 0; g < R * T; ++g) {
      const double a = 1 + rng.Next(9);
      specs.push_back({absl::StrCat("a", g), a, true, 8});
      specs.push_back({absl::StrCat("b", g), 10 - a, true, 8});
    }
    const Context ctx = HandBuilt(R, T, specs, OneBucket(2 * R * T));
    ASSERT_DOUBLE_EQ(ctx.stage_lower_bound[0], 10) << R << "x" << T;
    const CostSolver::Solution sol = CostSolver(ctx, 0).Solve(kInf);
    ExpectValid(ctx, 0, sol);
    // Documented tolerance: within the ladder's first step (1e-9).
    EXPECT_LE(sol.makespan, ctx.stage_lower_bound[0] * (1 + 1e-9))
        << R << "x" << T;
  }
}

TEST(CostSolverTest, SingleHugeMatrixDominates) {
  // One matrix of 1000 among small TP-owned ones (10) and non-TP-owned ones (5
  // on every TP rank), which come before it in bucket order. The bound is
  // the huge matrix; reaching it means nothing shares its GPU.
  std::vector<Spec> specs;
  for (int i = 0; i < 6; ++i) specs.push_back({absl::StrCat("s", i), 10});
  for (int i = 0; i < 2; ++i) {
    specs.push_back({absl::StrCat("norm", i), 5, false, 4});
  }
  specs.push_back({"huge", 1000, true, 4096});
  for (int i = 6; i < 12; ++i) specs.push_back({absl::StrCat("s", i), 10});
  const int huge = 8;
  const Context ctx = HandBuilt(2, 2, specs, OneBucket(specs.size()));
  ASSERT_DOUBLE_EQ(ctx.stage_lower_bound[0], 1000);
  const CostSolver::Solution sol = CostSolver(ctx, 0).Solve(kInf);
  ExpectValid(ctx, 0, sol);
  EXPECT_DOUBLE_EQ(sol.makespan, 1000);
  EXPECT_DOUBLE_EQ(sol.load[sol.owner[huge]][sol.tp_owner[huge]], 1000);
}

TEST(CostSolverTest, RandomContextsKeepTheContract) {
  // Every matrix on exactly one (owner, TP owner), contiguous cuts at parameter
  // boundaries, loads as assigned, makespan within [bound, total].
  for (uint64_t seed = 1; seed <= 300; ++seed) {
    SCOPED_TRACE(seed);
    const Context ctx = RandomHandBuilt(seed, 40, 6, 4);
    ExpectValid(ctx, 0, CostSolver(ctx, 0).Solve(kInf));
  }
}

TEST(CostSolverTest, ContextsFromRandomParameterListsKeepTheContract) {
  // Real costs (the flop model) through MakeContext, several stages and
  // bucket sizes: each stage's solution touches only that stage.
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    SCOPED_TRACE(seed);
    Lcg rng(seed);
    PlanRequest req;
    const int tps[] = {1, 2, 4};
    req.layout = {1 + rng.Next(3), 1 + rng.Next(6), tps[rng.Next(3)]};
    req.bucket_size = 2000 + rng.Next(20000);
    const int n = 3 + rng.Next(50);
    for (int i = 0; i < n; ++i) {
      ParamSpec p;
      p.name = absl::StrCat("w", i);
      p.pp_stage = rng.Next(req.layout.pp);
      if (rng.Next(4) == 0) {
        p.shape = {8L * (1 + rng.Next(64))};
      } else {
        p.shape = {8L * (1 + rng.Next(48)), 8L * (1 + rng.Next(48))};
        const OptimizerKind kinds[] = {OptimizerKind::kMuon,
                                       OptimizerKind::kShampoo,
                                       OptimizerKind::kAdamW};
        p.optimizer = kinds[rng.Next(3)];
        p.tp_split_dim = rng.Next(3) - 1;
      }
      req.parameters.push_back(p);
    }
    ASSERT_TRUE(Validate(req).ok()) << Validate(req);
    const Context ctx = MakeContext(req);
    for (int s = 0; s < ctx.P; ++s) {
      SCOPED_TRACE(absl::StrCat("stage ", s));
      ExpectValid(ctx, s, CostSolver(ctx, s).Solve(kInf));
    }
  }
}

TEST(CostSolverTest, NearOptimalOnTinyInstances) {
  // Small enough to enumerate every cut and TP owner choice. The solver's
  // makespan is never below the optimum (that would be misreporting). It is
  // a heuristic, not exact: when this test was written it reached the
  // optimum on 387 of these 400 instances and was at worst 1.23x above it
  // (R = T = 2, buckets [h25 n1] [h12 n10 h23 n5] [n8]: 38 against 31, the
  // optimum giving rank 0 none of the first bucket). The bounds below guard
  // against regressions.
  int optimal = 0;
  double worst = 1;
  for (uint64_t seed = 1; seed <= 400; ++seed) {
    SCOPED_TRACE(seed);
    const Context ctx = RandomHandBuilt(seed, 8, 3, 3);
    const CostSolver::Solution sol = CostSolver(ctx, 0).Solve(kInf);
    ExpectValid(ctx, 0, sol);
    const double optimum = BruteForceOptimum(ctx);
    EXPECT_GE(sol.makespan, optimum);
    if (sol.makespan == optimum) ++optimal;
    worst = std::max(worst, sol.makespan / optimum);
  }
  EXPECT_GE(optimal, 380);
  EXPECT_LE(worst, 1.25);
}

TEST(CostSolverTest, SameInputSameSolution) {
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE(seed);
    const Context ctx = RandomHandBuilt(seed, 40, 6, 4);
    const Context copy = RandomHandBuilt(seed, 40, 6, 4);
    const CostSolver::Solution first = CostSolver(ctx, 0).Solve(kInf);
    ExpectSameSolution(first, CostSolver(ctx, 0).Solve(kInf));
    ExpectSameSolution(first, CostSolver(copy, 0).Solve(kInf));
  }
}

TEST(CostSolverTest, EqualCostsAreHostedInNameOrder) {
  // Four equal matrices on one DP rank with two TP owners: LPT deals them in
  // name order (a, b, c, d -> TP owners 0, 1, 0, 1), whatever the request
  // order.
  for (const std::vector<std::string>& order :
       {std::vector<std::string>{"d", "c", "b", "a"},
        std::vector<std::string>{"a", "b", "c", "d"},
        std::vector<std::string>{"c", "a", "d", "b"}}) {
    std::vector<Spec> specs;
    for (const std::string& name : order) specs.push_back({name, 7});
    const Context ctx = HandBuilt(1, 2, specs, OneBucket(4));
    const CostSolver::Solution sol = CostSolver(ctx, 0).Solve(kInf);
    ExpectValid(ctx, 0, sol);
    for (int i = 0; i < 4; ++i) {
      const int expected = (order[i] == "a" || order[i] == "c") ? 0 : 1;
      EXPECT_EQ(sol.tp_owner[i], expected) << order[i];
    }
  }
}

TEST(CostSolverTest, PackRowSearchesBeyondLpt) {
  // LPT puts 3+2+2 against 3+2 (7); one swap gives 3+3 against 2+2+2 (6).
  std::vector<Spec> specs = {{"a", 3}, {"b", 3}, {"c", 2},
                             {"d", 2}, {"e", 2}, {"norm", 1, false}};
  const Context ctx = HandBuilt(1, 2, specs, OneBucket(6));
  const CostSolver solver(ctx, 0);
  CostSolver::Solution sol;
  sol.owner.assign(6, -1);
  sol.tp_owner.assign(6, -1);
  sol.load.assign(1, std::vector<double>(2, 0.0));
  solver.PackRow({0, 1, 2, 3, 4, 5}, 0, &sol);
  EXPECT_EQ(sol.load[0], (std::vector<double>{7, 7}));  // 6 + the norm
  EXPECT_EQ(sol.tp_owner[5], -1);
  EXPECT_EQ(sol.tp_owner[0], sol.tp_owner[1]);  // the two 3s together
  for (int p = 0; p < 6; ++p) EXPECT_EQ(sol.owner[p], 0);
}

TEST(CostSolverTest, InfeasibleHintIsNotTrusted) {
  // A hint below the proven bound cannot be met: the solver still returns
  // a valid solution, and on a perfectly packable instance the optimum.
  std::vector<Spec> specs;
  for (int g = 0; g < 4; ++g) {
    specs.push_back({absl::StrCat("a", g), 6});
    specs.push_back({absl::StrCat("b", g), 4});
  }
  const Context ctx = HandBuilt(2, 2, specs, OneBucket(8));
  const CostSolver::Solution sol = CostSolver(ctx, 0).Solve(1.0);
  ExpectValid(ctx, 0, sol);
  EXPECT_DOUBLE_EQ(sol.makespan, 10);
}

TEST(CostSolverTest, StageWithoutParameters) {
  // Stage 1 holds nothing: no cuts, nobody owns anything, zero loads.
  const Context ctx = HandBuilt(3, 2, {{"a", 5}, {"b", 5}}, OneBucket(2), 2);
  const CostSolver::Solution sol = CostSolver(ctx, 1).Solve(kInf);
  EXPECT_TRUE(sol.cuts.empty());
  EXPECT_EQ(sol.owner, (std::vector<int>{-1, -1}));
  EXPECT_EQ(sol.tp_owner, (std::vector<int>{-1, -1}));
  EXPECT_EQ(sol.load, std::vector<std::vector<double>>(3, {0.0, 0.0}));
  EXPECT_EQ(sol.makespan, 0);
  EXPECT_EQ(sol.imbalance, 1);
}

TEST(CostSolverTest, MoreRanksThanParameters) {
  // Five DP ranks, two matrices: empty slices are fine, and each matrix
  // gets a GPU of its own.
  const Context ctx = HandBuilt(5, 1, {{"a", 3}, {"b", 5}}, OneBucket(2));
  const CostSolver::Solution sol = CostSolver(ctx, 0).Solve(kInf);
  ExpectValid(ctx, 0, sol);
  EXPECT_DOUBLE_EQ(sol.makespan, 5);
  EXPECT_NE(sol.owner[0], sol.owner[1]);
}

}  // namespace
}  // namespace canzona::plan::internal
