#include "server/plan/baseline_strategies.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

namespace canzona::plan::internal {
namespace {

// Megatron's equal slices; each parameter goes to the rank whose slice holds
// its first element.
std::vector<int> StartAnchoredCuts(const Context& ctx, int bucket) {
  const auto& off = ctx.offsets[bucket];
  const int n = static_cast<int>(ctx.buckets[bucket].params.size());
  const int64_t total = off[n];
  std::vector<int> cuts(ctx.R + 1, n);
  int i = 0;
  for (int r = 0; r <= ctx.R; ++r) {
    const int64_t boundary = total * r / ctx.R;
    while (i < n && off[i] < boundary) ++i;
    cuts[r] = (r == ctx.R) ? n : i;
  }
  cuts[0] = 0;
  return cuts;
}

void OwnersFromCuts(const Context& ctx,
                    const std::vector<std::vector<int>>& cuts,
                    std::vector<int>* owner) {
  for (size_t b = 0; b < ctx.buckets.size(); ++b) {
    const auto& params = ctx.buckets[b].params;
    for (int d = 0; d < ctx.R; ++d) {
      for (int i = cuts[b][d]; i < cuts[b][d + 1]; ++i) (*owner)[params[i]] = d;
    }
  }
}

// Canzona's greedy_lpt_with_ranges, per stage, in local elements.
std::vector<std::vector<int>> AlphaGreedyCuts(const Context& ctx, int stage,
                                              double alpha) {
  const auto& ids = ctx.stage_buckets[stage];
  const int R = ctx.R;
  std::vector<std::vector<int>> result(ids.size());
  std::vector<int> order(ids.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return ctx.buckets[ids[a]].elements > ctx.buckets[ids[b]].elements;
  });
  double total_global = 0;
  for (int id : ids) {
    total_global += static_cast<double>(ctx.buckets[id].elements);
  }
  const double global_target = total_global / R;
  std::vector<double> loads(R, 0.0);
  for (int k : order) {
    const int id = ids[k];
    const auto& bounds = ctx.offsets[id];  // boundaries 0 .. total
    const int n = static_cast<int>(bounds.size()) - 1;
    const double b_total = static_cast<double>(bounds[n]);
    const double even = b_total / R;
    std::vector<double> deficits(R);
    double total_deficit = 0;
    for (int r = 0; r < R; ++r) {
      deficits[r] = std::max(0.0, global_target - loads[r]);
      total_deficit += deficits[r];
    }
    std::vector<double> target(R);
    for (int r = 0; r < R; ++r) {
      const double greedy =
          total_deficit <= 1e-9 ? even : deficits[r] / total_deficit * b_total;
      target[r] = (1 - alpha) * even + alpha * greedy;
    }
    std::vector<int> pos(R + 1, 0);  // boundary indices
    pos[R] = n;
    double cumulative = 0;
    for (int r = 0; r < R - 1; ++r) {
      cumulative += target[r];
      // Nearest boundary at or after the previous cut; ties keep the lower
      // one; the scan starts from boundary 0 as the released code does.
      int best = 0;
      double min_diff = std::fabs(cumulative - static_cast<double>(bounds[0]));
      for (int j = pos[r]; j <= n; ++j) {
        const double val = static_cast<double>(bounds[j]);
        const double diff = std::fabs(cumulative - val);
        if (diff < min_diff) {
          min_diff = diff;
          best = j;
        } else if (val > cumulative) {
          break;
        }
      }
      pos[r + 1] = std::max(best, pos[r]);  // never backwards (cannot happen)
      loads[r] += static_cast<double>(bounds[pos[r + 1]] - bounds[pos[r]]);
    }
    loads[R - 1] += static_cast<double>(bounds[n] - bounds[pos[R - 1]]);
    result[k] = std::move(pos);
  }
  return result;
}

// Max/mean of per-DP-rank local numel owned, over the stage's buckets.
double DpBalanceRatio(const Context& ctx, int stage,
                      const std::vector<std::vector<int>>& stage_cuts) {
  const auto& ids = ctx.stage_buckets[stage];
  std::vector<double> loads(ctx.R, 0.0);
  for (size_t k = 0; k < ids.size(); ++k) {
    const auto& off = ctx.offsets[ids[k]];
    for (int d = 0; d < ctx.R; ++d) {
      loads[d] += static_cast<double>(off[stage_cuts[k][d + 1]] -
                                      off[stage_cuts[k][d]]);
    }
  }
  const double sum = std::accumulate(loads.begin(), loads.end(), 0.0);
  if (sum == 0) return 1.0;
  return *std::max_element(loads.begin(), loads.end()) / (sum / ctx.R);
}

// (local numel, index) descending, grow the candidate set with LPT onto the
// T slots, close the group when a slot passes the fuse space. LPT over a
// list sorted descending is incremental, so each step is O(T).
void GreedyRollbackGroups(const Context& ctx, int stage, int dp,
                          const std::vector<int>& params, Assignment* a) {
  if (params.empty()) return;
  const int T = ctx.T;
  const double cap = static_cast<double>(ctx.req->fuse_space);
  std::vector<int> sorted = params;
  std::sort(sorted.begin(), sorted.end(), [&](int x, int y) {
    const int64_t cx = ctx.items[x].fragment_numel,
                  cy = ctx.items[y].fragment_numel;
    if (cx != cy) return cx > cy;
    return x > y;
  });
  std::vector<double> slot(T, 0.0);
  std::vector<int> hosts_of_group;
  MicroGroup group{stage, dp, {}};
  double sum = 0;
  auto close = [&]() {
    if (!group.params.empty()) a->groups.push_back(std::move(group));
    group = MicroGroup{stage, dp, {}};
    std::fill(slot.begin(), slot.end(), 0.0);
    sum = 0;
  };
  for (size_t idx = 0; idx < sorted.size();) {
    const int p = sorted[idx];
    const double c = static_cast<double>(ctx.items[p].fragment_numel);
    int min_slot = 0;
    for (int t = 1; t < T; ++t) {
      if (slot[t] < slot[min_slot]) min_slot = t;
    }
    const double new_load = slot[min_slot] + c;
    double max_load = new_load;
    for (int t = 0; t < T; ++t) {
      if (t != min_slot) max_load = std::max(max_load, slot[t]);
    }
    const bool overflow = (sum + c) / T > cap || max_load > cap;
    if (overflow && !group.params.empty()) {
      close();  // retry this parameter in a fresh group
      continue;
    }
    // Fits, or a single parameter larger than the cap: the released code
    // raises there; we give it a group of its own instead.
    slot[min_slot] = new_load;
    sum += c;
    a->tp_owner[p] = min_slot;
    group.params.push_back(p);
    ++idx;
    if (overflow) close();
  }
  close();
}

}  // namespace

Assignment PlanSc(const Context& ctx) {
  Assignment a = NewAssignment(ctx);
  a.comm = Assignment::Comm::kAllReduce;
  return a;
}

Assignment PlanLayerwise(const Context& ctx) {
  Assignment a = NewAssignment(ctx);
  a.comm = Assignment::Comm::kLayerwise;
  for (int s = 0; s < ctx.P; ++s) {
    std::vector<int> params = ctx.stage_params[s];
    std::sort(params.begin(), params.end(), CostlierFirst{ctx});
    std::vector<double> load(ctx.R, 0.0);
    for (int p : params) {
      const int d = static_cast<int>(
          std::min_element(load.begin(), load.end()) - load.begin());
      load[d] += ctx.items[p].cost;  // duplicated over TP: same on every t
      a.dp_owner[p] = d;
    }
  }
  return a;
}

Assignment PlanStartAnchored(const Context& ctx) {
  Assignment a = NewAssignment(ctx);
  for (size_t b = 0; b < ctx.buckets.size(); ++b) {
    a.cuts.push_back(StartAnchoredCuts(ctx, static_cast<int>(b)));
  }
  OwnersFromCuts(ctx, a.cuts, &a.dp_owner);
  const auto rows = TpOwnedByRow(ctx, a.dp_owner);
  for (int s = 0; s < ctx.P; ++s) {
    for (int d = 0; d < ctx.R; ++d) {
      const auto& row = rows[static_cast<size_t>(s) * ctx.R + d];
      for (size_t i = 0; i < row.size(); i += ctx.T) {
        MicroGroup g{s, d, {}};
        for (size_t j = i; j < std::min(row.size(), i + ctx.T); ++j) {
          a.tp_owner[row[j]] = static_cast<int>(j - i);
          g.params.push_back(row[j]);
        }
        a.groups.push_back(std::move(g));
      }
    }
  }
  return a;
}

Assignment PlanAlpha(const Context& ctx, double alpha) {
  Assignment a = NewAssignment(ctx);
  a.cuts.resize(ctx.buckets.size());
  a.alpha_accepted = true;
  for (int s = 0; s < ctx.P; ++s) {
    const auto& ids = ctx.stage_buckets[s];
    if (ids.empty()) continue;
    std::vector<std::vector<int>> anchored;
    for (int id : ids) anchored.push_back(StartAnchoredCuts(ctx, id));
    std::vector<std::vector<int>> greedy = AlphaGreedyCuts(ctx, s, alpha);
    // Keep the greedy plan only if strictly better balanced (max/mean).
    const bool accept =
        DpBalanceRatio(ctx, s, greedy) < DpBalanceRatio(ctx, s, anchored);
    if (!accept) a.alpha_accepted = false;
    for (size_t k = 0; k < ids.size(); ++k) {
      a.cuts[ids[k]] = accept ? greedy[k] : anchored[k];
    }
  }
  OwnersFromCuts(ctx, a.cuts, &a.dp_owner);
  const auto rows = TpOwnedByRow(ctx, a.dp_owner);
  for (int s = 0; s < ctx.P; ++s) {
    for (int d = 0; d < ctx.R; ++d) {
      GreedyRollbackGroups(ctx, s, d, rows[static_cast<size_t>(s) * ctx.R + d],
                           &a);
    }
  }
  return a;
}

}  // namespace canzona::plan::internal
