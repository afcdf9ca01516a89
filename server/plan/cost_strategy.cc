#include "server/plan/cost_strategy.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "server/plan/baseline_strategies.h"
#include "server/plan/cost_solver.h"
#include "server/plan/plan_metrics.h"

namespace canzona::plan::internal {
namespace {

// Micro-groups for the cost strategy: per TP group, each TP owner's matrices go
// (largest first) to the group where that TP owner has the least work and fuse
// room, with as many groups as the fullest TP owner's fuse volume needs, so
// each group is balanced across TP owners and the pipeline stays short.
void CostMicroGroups(const Context& ctx, int stage, int dp,
                     const std::vector<int>& params, Assignment* a) {
  if (params.empty()) return;
  const int T = ctx.T;
  const double cap = static_cast<double>(ctx.req->fuse_space);
  std::vector<std::vector<int>> per_host(T);
  std::vector<double> fuse(T, 0.0);
  for (int p : params) {
    per_host[a->tp_owner[p]].push_back(p);
    fuse[a->tp_owner[p]] += static_cast<double>(ctx.items[p].fragment_numel);
  }
  int groups = 1;
  for (int t = 0; t < T; ++t) {
    groups = std::max(groups, static_cast<int>(std::ceil(fuse[t] / cap)));
  }
  std::vector<MicroGroup> out(groups, MicroGroup{stage, dp, {}});
  for (int t = 0; t < T; ++t) {
    auto& list = per_host[t];
    std::sort(list.begin(), list.end(), CostlierFirst{ctx});
    std::vector<double> work(groups, 0.0), room(groups, cap);
    for (int p : list) {
      const double e = static_cast<double>(ctx.items[p].fragment_numel);
      int best = -1;
      for (int g = 0; g < groups; ++g) {
        if (room[g] < e && !(room[g] == cap)) continue;
        if (best < 0 || work[g] < work[best]) best = g;
      }
      if (best < 0) {
        best = static_cast<int>(std::min_element(work.begin(), work.end()) -
                                work.begin());
      }
      work[best] += ctx.items[p].cost;
      room[best] -= e;
      out[best].params.push_back(p);
    }
  }
  for (auto& g : out) {
    if (g.params.empty()) continue;
    std::sort(g.params.begin(), g.params.end());
    a->groups.push_back(std::move(g));
  }
}

// The largest per-GPU objective, by the metrics' own accounting.
double AssignmentMakespan(const Context& ctx, const Assignment& a) {
  const std::vector<GpuLoad> loads = PerGpuLoads(ctx, a.dp_owner, a.tp_owner);
  if (loads.empty()) return 0;
  return std::max_element(loads.begin(), loads.end(),
                          [](const GpuLoad& x, const GpuLoad& y) {
                            return x.objective < y.objective;
                          })
      ->objective;
}

// Re-assigns the TP owners of an assignment's rows with LPT on the true cost
// (used to make the baselines' DP cuts candidates of the cost strategy).
Assignment RehostLpt(const Context& ctx, Assignment a) {
  a.groups.clear();
  std::fill(a.tp_owner.begin(), a.tp_owner.end(), -1);
  a.alpha_accepted = false;
  for (int s = 0; s < ctx.P; ++s) {
    CostSolver solver(ctx, s);
    CostSolver::Solution sol;
    sol.owner = a.dp_owner;
    sol.tp_owner.assign(ctx.items.size(), -1);
    sol.load.assign(ctx.R, std::vector<double>(ctx.T, 0.0));
    std::vector<std::vector<int>> rows(ctx.R);
    for (int i : ctx.stage_params[s]) rows[a.dp_owner[i]].push_back(i);
    for (int d = 0; d < ctx.R; ++d) solver.PackRow(rows[d], d, &sol);
    for (int i : ctx.stage_params[s]) a.tp_owner[i] = sol.tp_owner[i];
  }
  return a;
}

void CostGroupsForAll(const Context& ctx, Assignment* a) {
  a->groups.clear();
  const auto rows = TpOwnedByRow(ctx, a->dp_owner);
  for (int s = 0; s < ctx.P; ++s) {
    for (int d = 0; d < ctx.R; ++d) {
      CostMicroGroups(ctx, s, d, rows[static_cast<size_t>(s) * ctx.R + d], a);
    }
  }
}

double MaxSliceImbalance(const Context& ctx, const Assignment& a) {
  double imb = 1.0;
  if (a.cuts.empty()) return imb;
  for (size_t b = 0; b < ctx.buckets.size(); ++b) {
    imb = std::max(imb, SliceImbalance(ctx, static_cast<int>(b), a.cuts[b]));
  }
  return imb;
}

}  // namespace

Assignment PlanCost(const Context& ctx) {
  // Baselines first: their makespans bound the bisection and are fallbacks,
  // so cost is never worse than alpha or start_anchored.
  std::vector<Assignment> candidates;
  candidates.push_back(PlanAlpha(ctx, ctx.req->alpha));
  candidates.push_back(RehostLpt(ctx, candidates.back()));
  candidates.push_back(RehostLpt(ctx, PlanStartAnchored(ctx)));
  double upper = kInf;
  for (const auto& c : candidates) {
    upper = std::min(upper, AssignmentMakespan(ctx, c));
  }

  Assignment ours = NewAssignment(ctx);
  ours.cuts.resize(ctx.buckets.size());
  for (int s = 0; s < ctx.P; ++s) {
    CostSolver solver(ctx, s);
    CostSolver::Solution sol = solver.Solve(upper);
    const auto& ids = ctx.stage_buckets[s];
    for (size_t k = 0; k < ids.size(); ++k) ours.cuts[ids[k]] = sol.cuts[k];
    for (int i : ctx.stage_params[s]) {
      ours.dp_owner[i] = sol.owner[i];
      ours.tp_owner[i] = sol.tp_owner[i];
    }
  }
  CostGroupsForAll(ctx, &ours);
  for (size_t i = 1; i < candidates.size(); ++i) {
    CostGroupsForAll(ctx, &candidates[i]);
  }
  // Ours first: it wins ties on makespan unless a baseline has better
  // slice balance at the same makespan.
  Assignment* best = &ours;
  double best_ms = AssignmentMakespan(ctx, ours);
  double best_imb = MaxSliceImbalance(ctx, ours);
  for (auto& c : candidates) {
    const double ms = AssignmentMakespan(ctx, c);
    const double imb = MaxSliceImbalance(ctx, c);
    const double tol = 1e-12 * std::max(1.0, best_ms);
    if (ms < best_ms - tol || (ms <= best_ms + tol && imb < best_imb)) {
      best = &c;
      best_ms = ms;
      best_imb = imb;
    }
  }
  Assignment out = std::move(*best);
  out.alpha_accepted = false;
  return out;
}

}  // namespace canzona::plan::internal
