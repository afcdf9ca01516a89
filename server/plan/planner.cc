#include "server/plan/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <queue>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"
#include "server/plan/lower_bound.h"

namespace canzona::plan {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// What one parameter costs where it lands.
struct Item {
  int stage = 0;
  bool hosted = false;  // whole update on one TP rank of its owner
  bool split = false;   // split over TP (local shard = numel / TP)
  double cost = 0;      // objective: full if hosted, else per TP rank
  double full_cost = 0; // objective of the whole update
  double flops = 0;     // per GPU where it lands (hosted: on the host)
  double seconds = 0;
  double full_flops = 0;
  double full_seconds = 0;
  double state = 0;       // state bytes per GPU where it lands
  double full_state = 0;  // state bytes of the whole parameter
  int64_t local_numel = 0;
  int elem_bytes = 2;
  int name_rank = 0;  // position of the name in sorted order: tie-breaks
};

struct Context {
  const PlanRequest* req = nullptr;
  // R is the shard group size S (= dp when flat): the partitioners balance
  // one shard group. D is the true DP size, L the link-group size of the
  // dp_traffic tiers.
  int P = 1, R = 1, T = 1, D = 1, L = 1;
  std::vector<Item> items;
  std::vector<std::vector<int>> stage_params;   // request order per stage
  std::vector<BucketPlan> buckets;              // structure, no cuts
  std::vector<std::vector<int>> stage_buckets;  // bucket ids per stage
  // Bucket-local element offsets: offsets[b][i] = start of params[i].
  std::vector<std::vector<int64_t>> offsets;
  double lb = 0;
  std::string lb_binding;
  double lower_bound = 0;
  std::vector<double> stage_lower_bound;
};

// An assignment before metrics.
struct Assignment {
  std::vector<int> dp_owner;
  std::vector<int> tp_host;
  std::vector<std::vector<int>> cuts;  // per bucket; empty: no slicing
  std::vector<MicroGroup> groups;
  enum class Comm { kSliced, kAllReduce, kLayerwise } comm = Comm::kSliced;
  bool alpha_accepted = false;
};

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(message);
}

absl::Status Validate(const PlanRequest& req) {
  const ParallelLayout& l = req.layout;
  if (l.pp <= 0) return Invalid("layout.pp must be positive");
  if (l.dp <= 0) return Invalid("layout.dp must be positive");
  if (l.tp <= 0) return Invalid("layout.tp must be positive");
  if (req.bucket_size <= 0) return Invalid("bucket_size must be positive");
  if (req.fuse_space <= 0) return Invalid("fuse_space must be positive");
  if (!(req.alpha >= 0.0 && req.alpha <= 1.0)) {
    return Invalid("alpha must be in [0, 1]");
  }
  const int S = req.shard_group_size == 0 ? l.dp : req.shard_group_size;
  if (req.shard_group_size < 0 || S > l.dp || l.dp % S != 0) {
    return Invalid(absl::StrCat("shard_group_size ", req.shard_group_size,
                                " must divide layout.dp ", l.dp,
                                " and lie in [1, ", l.dp, "] (0 = flat)"));
  }
  if (S < l.dp &&
      (req.strategy == Strategy::kSc || req.strategy == Strategy::kLayerwise)) {
    return Invalid(absl::StrCat(
        "shard_group_size ", S, " < layout.dp ", l.dp,
        " requires a bucket-sliced strategy (start_anchored, alpha, cost), "
        "not ",
        StrategyName(req.strategy)));
  }
  const int L = req.link_group_size == 0 ? S : req.link_group_size;
  if (req.link_group_size < 0 || L > l.dp || l.dp % L != 0) {
    return Invalid(absl::StrCat(
        "link_group_size ", req.link_group_size, " must divide layout.dp ",
        l.dp, " and lie in [1, ", l.dp, "] (0 = shard_group_size)"));
  }
  if (S < l.dp && L != S) {
    return Invalid(absl::StrCat("link_group_size ", L,
                                " must be 0 or shard_group_size ", S,
                                " when shard_group_size < layout.dp"));
  }
  if (req.parameters.empty()) return Invalid("parameters: empty list");
  std::set<std::string> names;
  for (size_t i = 0; i < req.parameters.size(); ++i) {
    const ParamSpec& p = req.parameters[i];
    const std::string where = absl::StrCat("parameters[", i, "] '", p.name, "'");
    if (p.name.empty()) return Invalid(absl::StrCat(where, ": empty name"));
    if (!names.insert(p.name).second) {
      return Invalid(absl::StrCat(where, ": duplicate name"));
    }
    if (p.shape.empty()) return Invalid(absl::StrCat(where, ": empty shape"));
    for (int64_t d : p.shape) {
      if (d <= 0) return Invalid(absl::StrCat(where, ": shape has a zero or negative dim"));
    }
    if (IsMatrixOptimizer(p.optimizer) && p.shape.size() < 2) {
      return Invalid(absl::StrCat(where, ": optimizer ",
                                  OptimizerKindName(p.optimizer),
                                  " needs a 2-D shape"));
    }
    if (p.tp_split_dim < -1 ||
        p.tp_split_dim >= static_cast<int>(p.shape.size())) {
      return Invalid(absl::StrCat(where, ": tp_split_dim ", p.tp_split_dim,
                                  " out of range"));
    }
    if (p.tp_split_dim >= 0 && p.shape[p.tp_split_dim] % l.tp != 0) {
      return Invalid(absl::StrCat(where, ": tp ", l.tp, " does not divide dim ",
                                  p.tp_split_dim, " (",
                                  p.shape[p.tp_split_dim], ")"));
    }
    if (p.pp_stage < 0 || p.pp_stage >= l.pp) {
      return Invalid(absl::StrCat(where, ": pp_stage ", p.pp_stage,
                                  " outside [0, ", l.pp, ")"));
    }
  }
  return absl::OkStatus();
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Context MakeContext(const PlanRequest& req) {
  Context ctx;
  ctx.req = &req;
  ctx.P = req.layout.pp;
  ctx.D = req.layout.dp;
  ctx.R = req.shard_group_size == 0 ? ctx.D : req.shard_group_size;
  ctx.T = req.layout.tp;
  ctx.L = req.link_group_size == 0 ? ctx.R : req.link_group_size;
  const int n = static_cast<int>(req.parameters.size());
  std::vector<int> by_name(n);
  std::iota(by_name.begin(), by_name.end(), 0);
  std::sort(by_name.begin(), by_name.end(), [&](int a, int b) {
    return req.parameters[a].name < req.parameters[b].name;
  });
  ctx.items.resize(n);
  for (int r = 0; r < n; ++r) ctx.items[by_name[r]].name_rank = r;
  const CostModel& model = req.cost_model;
  for (int i = 0; i < n; ++i) {
    const ParamSpec& p = req.parameters[i];
    Item& it = ctx.items[i];
    it.stage = p.pp_stage;
    it.split = p.tp_split_dim >= 0 && ctx.T > 1;
    it.hosted = IsMatrixOptimizer(p.optimizer) && it.split;
    const ParamWork work = model.Work(p.optimizer, p.shape);
    it.full_cost = model.Objective(work);
    it.full_flops = work.flops;
    it.full_seconds = work.seconds;
    it.full_state = model.StateBytes(p.optimizer, p.shape, p.dtype);
    const int64_t numel = Numel(p.shape);
    it.local_numel = it.split ? numel / ctx.T : numel;
    it.elem_bytes = DTypeBytes(p.dtype);
    // Split AdamW shards are updated where they lie: 1/T per TP rank.
    const double share = (it.split && !it.hosted) ? 1.0 / ctx.T : 1.0;
    it.cost = it.full_cost * share;
    it.flops = it.full_flops * share;
    it.seconds = it.full_seconds * share;
    it.state = it.full_state * share;
  }
  ctx.stage_params.assign(ctx.P, {});
  for (int i = 0; i < n; ++i) ctx.stage_params[ctx.items[i].stage].push_back(i);
  // Buckets: reverse parameter order, closed once they reach bucket_size.
  ctx.stage_buckets.assign(ctx.P, {});
  for (int s = 0; s < ctx.P; ++s) {
    const auto& params = ctx.stage_params[s];
    BucketPlan current;
    current.stage = s;
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      current.params.push_back(*it);
      current.elements += ctx.items[*it].local_numel;
      if (current.elements >= req.bucket_size) {
        ctx.stage_buckets[s].push_back(static_cast<int>(ctx.buckets.size()));
        ctx.buckets.push_back(std::move(current));
        current = BucketPlan();
        current.stage = s;
      }
    }
    if (!current.params.empty()) {
      ctx.stage_buckets[s].push_back(static_cast<int>(ctx.buckets.size()));
      ctx.buckets.push_back(std::move(current));
    }
  }
  for (const BucketPlan& b : ctx.buckets) {
    std::vector<int64_t> off(b.params.size() + 1, 0);
    for (size_t i = 0; i < b.params.size(); ++i) {
      off[i + 1] = off[i] + ctx.items[b.params[i]].local_numel;
    }
    ctx.offsets.push_back(std::move(off));
  }
  // LB of the issue and the proven lower bound.
  double total = 0, largest = 0;
  for (const Item& it : ctx.items) {
    total += it.hosted ? it.cost : it.cost * ctx.T;
    largest = std::max(largest, it.cost);
  }
  const double gpus = static_cast<double>(ctx.P) * ctx.R * ctx.T;
  ctx.lb = std::max(largest, total / gpus);
  ctx.lb_binding = largest >= total / gpus ? "max_matrix" : "average";
  ctx.lower_bound = ctx.lb;
  ctx.stage_lower_bound.assign(ctx.P, 0);
  for (int s = 0; s < ctx.P; ++s) {
    std::vector<double> whole;
    for (int i : ctx.stage_params[s]) {
      const Item& it = ctx.items[i];
      // A non-hosted item puts `cost` on each of the T GPUs of one DP rank:
      // relaxing "same DP rank" leaves T whole items.
      const int copies = it.hosted ? 1 : ctx.T;
      for (int c = 0; c < copies; ++c) whole.push_back(it.cost);
    }
    ctx.stage_lower_bound[s] = MakespanLowerBound(whole, 0, ctx.R * ctx.T);
    ctx.lower_bound = std::max(ctx.lower_bound, ctx.stage_lower_bound[s]);
  }
  return ctx;
}

// ---------------------------------------------------------------------------
// Cuts shared by several strategies.

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

void OwnersFromCuts(const Context& ctx, const std::vector<std::vector<int>>& cuts,
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
  for (int id : ids) total_global += static_cast<double>(ctx.buckets[id].elements);
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

// Hosted parameters owned by each (stage, dp), in request order.
std::vector<std::vector<int>> HostedByRow(const Context& ctx,
                                          const std::vector<int>& owner) {
  std::vector<std::vector<int>> rows(static_cast<size_t>(ctx.P) * ctx.R);
  for (size_t i = 0; i < ctx.items.size(); ++i) {
    if (!ctx.items[i].hosted) continue;
    rows[static_cast<size_t>(ctx.items[i].stage) * ctx.R + owner[i]].push_back(
        static_cast<int>(i));
  }
  return rows;
}

// Canzona's get_globally_optimized_micro_groups ("greedy rollback"): sort by
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
    const int64_t cx = ctx.items[x].local_numel, cy = ctx.items[y].local_numel;
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
    const double c = static_cast<double>(ctx.items[p].local_numel);
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
    a->tp_host[p] = min_slot;
    group.params.push_back(p);
    ++idx;
    if (overflow) close();
  }
  close();
}

// ---------------------------------------------------------------------------
// Loads.

struct Loads {
  int R = 1, T = 1;
  std::vector<double> v;  // (stage * R + d) * T + t
  double& at(int s, int d, int t) {
    return v[(static_cast<size_t>(s) * R + d) * T + t];
  }
};

// Adds item i's objective for (owner, host) into `loads` (sc: owner -1).
void AddItem(const Context& ctx, int i, int owner, int host, Loads* loads,
             double sign = 1.0) {
  const Item& it = ctx.items[i];
  const int d0 = owner < 0 ? 0 : owner;
  const int d1 = owner < 0 ? ctx.R : owner + 1;
  for (int d = d0; d < d1; ++d) {
    if (host >= 0) {
      loads->at(it.stage, d, host) += sign * it.cost;
    } else {
      for (int t = 0; t < ctx.T; ++t) loads->at(it.stage, d, t) += sign * it.cost;
    }
  }
}

// ---------------------------------------------------------------------------
// The cost strategy, one stage at a time.

class CostSolver {
 public:
  CostSolver(const Context& ctx, int stage)
      : ctx_(ctx), stage_(stage), ids_(ctx.stage_buckets[stage]),
        R_(ctx.R), T_(ctx.T) {
    for (int i : ctx.stage_params[stage]) {
      const Item& it = ctx.items[i];
      total_ += it.hosted ? it.cost : it.cost * T_;
    }
  }

  struct Solution {
    std::vector<std::vector<int>> cuts;  // per stage bucket
    std::vector<int> owner;              // global param index -> d
    std::vector<int> host;               // global param index -> t or -1
    std::vector<std::vector<double>> load;  // [d][t]
    double makespan = kInf;
    double imbalance = kInf;  // max over buckets of max slice / mean slice
  };

  // Greedy feasibility test at per-GPU capacity `cap`. Ranks are filled in
  // order; each takes the next parameter of the bucket it has advanced least
  // in (so every bucket is cut roughly proportionally, which keeps slices
  // even), places a hosted matrix on the fullest TP host it fits on
  // (best fit) and a non-hosted one on all its TP ranks, and skips a bucket
  // whose next parameter does not fit. `balanced` also stops a rank once it
  // holds its share of the remaining work. The last rank takes the rest
  // (LPT + local search) and must fit.
  bool Greedy(double cap, bool balanced, Solution* out,
              int order = 0) const {
    const double eps = cap * 1e-12;
    const size_t nb = ids_.size();
    Solution sol;
    sol.cuts.assign(nb, std::vector<int>(R_ + 1, 0));
    sol.owner.assign(ctx_.items.size(), -1);
    sol.host.assign(ctx_.items.size(), -1);
    sol.load.assign(R_, std::vector<double>(T_, 0.0));
    std::vector<int> frontier(nb, 0);
    double remaining = total_;
    for (int d = 0; d < R_; ++d) {
      auto& load = sol.load[d];
      if (d == R_ - 1) {
        std::vector<int> rest;
        for (size_t k = 0; k < nb; ++k) {
          const auto& params = ctx_.buckets[ids_[k]].params;
          for (size_t i = frontier[k]; i < params.size(); ++i) {
            rest.push_back(params[i]);
          }
          frontier[k] = static_cast<int>(params.size());
        }
        PackRow(rest, d, &sol);
        if (*std::max_element(load.begin(), load.end()) > cap + eps) {
          return false;
        }
      } else {
        const double target = balanced ? remaining / (R_ - d) : kInf;
        double row = 0;
        std::vector<int> row_items;
        int repacks = 0;
        using Entry = std::pair<double, int>;
        std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> pq;
        for (size_t k = 0; k < nb; ++k) {
          if (frontier[k] < static_cast<int>(ctx_.buckets[ids_[k]].params.size())) {
            pq.push({Priority(k, frontier[k], order),
                     static_cast<int>(k)});
          }
        }
        while (!pq.empty() && row < target) {
          const int k = pq.top().second;
          pq.pop();
          const auto& params = ctx_.buckets[ids_[k]].params;
          const int p = params[frontier[k]];
          const Item& it = ctx_.items[p];
          if (it.hosted) {
            int best = -1;
            for (int t = 0; t < T_; ++t) {
              if (load[t] + it.cost <= cap + eps &&
                  (best < 0 || load[t] > load[best])) {
                best = t;
              }
            }
            if (best >= 0) {
              load[best] += it.cost;
              sol.host[p] = best;
            } else if (row_items.size() > 64 || ++repacks > 32 ||
                       !Repack(row_items, p, d, cap + eps, &sol)) {
              // Repacking is for the tight dense cases; large rows (MoE)
              // pack well online and would make it quadratic.
              continue;  // bucket stuck for this rank
            }
            row += it.cost;
          } else {
            const double mx = *std::max_element(load.begin(), load.end());
            if (mx + it.cost > cap + eps) continue;
            for (double& x : load) x += it.cost;
            row += it.cost * T_;
          }
          sol.owner[p] = d;
          row_items.push_back(p);
          ++frontier[k];
          if (frontier[k] < static_cast<int>(params.size())) {
            pq.push({Priority(k, frontier[k], order), k});
          }
        }
        remaining -= row;
      }
      for (size_t k = 0; k < nb; ++k) sol.cuts[k][d + 1] = frontier[k];
    }
    Score(&sol);
    *out = std::move(sol);
    return true;
  }

  // Offline repack of row d's items plus `extra` (LPT + local search);
  // adopted only if every host stays within `cap`.
  bool Repack(const std::vector<int>& items, int extra, int d, double cap,
              Solution* sol) const {
    if (T_ < 2) return false;
    std::vector<int> all = items;
    all.push_back(extra);
    const std::vector<double> saved_load = sol->load[d];
    std::vector<int> saved_host;
    for (int p : all) saved_host.push_back(sol->host[p]);
    PackRow(all, d, sol);
    if (*std::max_element(sol->load[d].begin(), sol->load[d].end()) <= cap) {
      return true;
    }
    sol->load[d] = saved_load;
    for (size_t i = 0; i < all.size(); ++i) sol->host[all[i]] = saved_host[i];
    sol->owner[extra] = -1;
    return false;
  }

  // Places `params` (all owned by row d) with LPT on cost (ties by name),
  // non-hosted first, then local search.
  void PackRow(const std::vector<int>& params, int d, Solution* sol) const {
    auto& load = sol->load[d];
    std::fill(load.begin(), load.end(), 0.0);
    std::vector<int> hosted;
    for (int p : params) {
      sol->owner[p] = d;
      const Item& it = ctx_.items[p];
      if (it.hosted) {
        hosted.push_back(p);
      } else {
        sol->host[p] = -1;
        for (double& x : load) x += it.cost;
      }
    }
    std::sort(hosted.begin(), hosted.end(), [&](int a, int b) {
      const Item &x = ctx_.items[a], &y = ctx_.items[b];
      if (x.cost != y.cost) return x.cost > y.cost;
      return x.name_rank < y.name_rank;
    });
    for (int p : hosted) {
      const int t = static_cast<int>(
          std::min_element(load.begin(), load.end()) - load.begin());
      load[t] += ctx_.items[p].cost;
      sol->host[p] = t;
    }
    RowLocalSearch(d, hosted, sol);
  }

  // Moves and swaps between the fullest TP host and the others while the
  // fullest host's load strictly drops below the old maximum.
  void RowLocalSearch(int d, const std::vector<int>& hosted,
                      Solution* sol) const {
    auto& load = sol->load[d];
    if (T_ < 2 || hosted.empty()) return;
    for (int iter = 0; iter < 200; ++iter) {
      const int hm = static_cast<int>(
          std::max_element(load.begin(), load.end()) - load.begin());
      const double M = load[hm];
      const double eps = M * 1e-12;
      double best_score = M - eps;
      int best_p = -1, best_q = -1, best_t = -1;
      for (int p : hosted) {
        if (sol->host[p] != hm) continue;
        const double cp = ctx_.items[p].cost;
        for (int t = 0; t < T_; ++t) {
          if (t == hm) continue;
          const double score = std::max(M - cp, load[t] + cp);
          if (score < best_score) {
            best_score = score;
            best_p = p;
            best_q = -1;
            best_t = t;
          }
        }
        for (int q : hosted) {
          const int t = sol->host[q];
          if (t == hm) continue;
          const double cq = ctx_.items[q].cost;
          if (cq >= cp) continue;
          const double score = std::max(M - cp + cq, load[t] + cp - cq);
          if (score < best_score) {
            best_score = score;
            best_p = p;
            best_q = q;
            best_t = t;
          }
        }
      }
      if (best_p < 0) return;
      const double cp = ctx_.items[best_p].cost;
      load[hm] -= cp;
      load[best_t] += cp;
      sol->host[best_p] = best_t;
      if (best_q >= 0) {
        const double cq = ctx_.items[best_q].cost;
        load[best_t] -= cq;
        load[hm] += cq;
        sol->host[best_q] = hm;
      }
    }
  }

  // Offline repack of every row (LPT + local search) where it helps, then
  // boundary moves across neighbouring DP ranks: the first or last
  // parameter of a slice of the fullest GPU's rank moves to the previous or
  // next rank when that lowers the maximum of the two.
  void Improve(Solution* sol) const {
    std::vector<std::vector<int>> rows(R_);
    for (size_t k = 0; k < ids_.size(); ++k) {
      const auto& params = ctx_.buckets[ids_[k]].params;
      for (int d = 0; d < R_; ++d) {
        for (int i = sol->cuts[k][d]; i < sol->cuts[k][d + 1]; ++i) {
          rows[d].push_back(params[i]);
        }
      }
    }
    for (int d = 0; d < R_; ++d) {
      Solution trial = *sol;  // cheap enough: rows are small
      PackRow(rows[d], d, &trial);
      const double before =
          *std::max_element(sol->load[d].begin(), sol->load[d].end());
      const double after =
          *std::max_element(trial.load[d].begin(), trial.load[d].end());
      if (after < before) {
        sol->load[d] = trial.load[d];
        for (int p : rows[d]) sol->host[p] = trial.host[p];
      } else {
        std::vector<int> hosted;
        for (int p : rows[d]) {
          if (ctx_.items[p].hosted) hosted.push_back(p);
        }
        RowLocalSearch(d, hosted, sol);
      }
    }
    if (R_ < 2) {
      Score(sol);
      return;
    }
    const int max_iters = 20000;
    for (int iter = 0; iter < max_iters; ++iter) {
      int dm = 0, tm = 0;
      for (int d = 0; d < R_; ++d) {
        for (int t = 0; t < T_; ++t) {
          if (sol->load[d][t] > sol->load[dm][tm]) {
            dm = d;
            tm = t;
          }
        }
      }
      const double M = sol->load[dm][tm];
      const double eps = M * 1e-12;
      double best_score = M - eps;
      int best_k = -1, best_dir = 0, best_t = -1;
      for (size_t k = 0; k < ids_.size(); ++k) {
        const auto& params = ctx_.buckets[ids_[k]].params;
        const int lo = sol->cuts[k][dm], hi = sol->cuts[k][dm + 1];
        if (lo == hi) continue;
        for (int dir : {-1, +1}) {
          const int r = dm + dir;
          if (r < 0 || r >= R_) continue;
          const int p = dir < 0 ? params[lo] : params[hi - 1];
          const Item& it = ctx_.items[p];
          if (it.hosted && sol->host[p] != tm) continue;
          const auto& rl = sol->load[r];
          double donor = M - it.cost, recv;
          int t_to = -1;
          if (it.hosted) {
            t_to = static_cast<int>(std::min_element(rl.begin(), rl.end()) -
                                    rl.begin());
            recv = rl[t_to] + it.cost;
          } else {
            recv = *std::max_element(rl.begin(), rl.end()) + it.cost;
          }
          const double score = std::max(donor, recv);
          if (score < best_score) {
            best_score = score;
            best_k = static_cast<int>(k);
            best_dir = dir;
            best_t = t_to;
          }
        }
      }
      if (best_k < 0) break;
      const auto& params = ctx_.buckets[ids_[best_k]].params;
      const int r = dm + best_dir;
      int p;
      if (best_dir < 0) {
        p = params[sol->cuts[best_k][dm]];
        ++sol->cuts[best_k][dm];
      } else {
        p = params[sol->cuts[best_k][dm + 1] - 1];
        --sol->cuts[best_k][dm + 1];
      }
      const Item& it = ctx_.items[p];
      sol->owner[p] = r;
      if (it.hosted) {
        sol->load[dm][tm] -= it.cost;
        sol->load[r][best_t] += it.cost;
        sol->host[p] = best_t;
      } else {
        for (double& x : sol->load[dm]) x -= it.cost;
        for (double& x : sol->load[r]) x += it.cost;
      }
    }
    Score(sol);
  }

  // Runs the four greedy variants at `cap`; true if any fits.
  template <typename Consider>
  bool TryAll(double cap, Consider& consider) const {
    bool ok = false;
    for (int order : {0, 1, 2}) {
      for (bool balanced : {true, false}) {
        Solution s;
        if (Greedy(cap, balanced, &s, order)) {
          ok = true;
          consider(std::move(s));
        }
      }
    }
    return ok;
  }

  // Bisection on the capacity between the stage's proven lower bound and a
  // known feasible value; keeps the best solution seen (makespan, then slice
  // imbalance).
  Solution Solve(double upper_hint) const {
    Solution best;
    auto consider = [&](Solution&& s) {
      const double tol = 1e-12 * std::max(1.0, s.makespan);
      if (s.makespan < best.makespan - tol ||
          (s.makespan <= best.makespan + tol && s.imbalance < best.imbalance)) {
        best = std::move(s);
      }
    };
    if (ids_.empty()) {
      best.load.assign(R_, std::vector<double>(T_, 0.0));
      best.owner.assign(ctx_.items.size(), -1);
      best.host.assign(ctx_.items.size(), -1);
      best.makespan = 0;
      best.imbalance = 1;
      return best;
    }
    double lo = ctx_.stage_lower_bound[stage_];
    double hi = std::min(upper_hint, total_);
    {
      Solution s;
      // With the capacity at the total, the packed greedy always succeeds.
      Greedy(total_ * (1 + 1e-9), false, &s);
      consider(std::move(s));
      if (Greedy(std::max(hi, lo), true, &s)) consider(std::move(s));
      if (Greedy(std::max(hi, lo), false, &s)) consider(std::move(s));
      hi = std::min(hi, best.makespan);
    }
    // The greedy test is not monotone in the capacity, so walk a geometric
    // ladder up from the lower bound first: the first feasible rung is
    // within its step of the bound.
    double last_infeasible = lo;
    for (double step = 1e-9; lo * (1 + step) < hi; step *= 1.6) {
      const double cap = lo * (1 + step);
      if (TryAll(cap, consider)) {
        hi = std::min(cap, best.makespan);
        break;
      }
      last_infeasible = cap;
    }
    lo = last_infeasible;
    for (int iter = 0; iter < 60 && hi > lo * (1 + 1e-7); ++iter) {
      const double mid = 0.5 * (lo + hi);
      if (TryAll(mid, consider)) {
        hi = std::min(mid, best.makespan);
      } else {
        lo = mid;
      }
    }
    Improve(&best);
    return best;
  }

  void Score(Solution* sol) const {
    double mx = 0;
    for (const auto& row : sol->load) {
      for (double x : row) mx = std::max(mx, x);
    }
    sol->makespan = mx;
    double imb = 1.0;
    for (size_t k = 0; k < ids_.size(); ++k) {
      const auto& off = ctx_.offsets[ids_[k]];
      const double mean = static_cast<double>(off.back()) / R_;
      if (mean <= 0) continue;
      int64_t largest = 0;
      for (int d = 0; d < R_; ++d) {
        largest = std::max(largest, off[sol->cuts[k][d + 1]] - off[sol->cuts[k][d]]);
      }
      imb = std::max(imb, static_cast<double>(largest) / mean);
    }
    sol->imbalance = imb;
  }

 private:
  // Bucket order of the greedy: 0, least advanced first (even slices);
  // 1, the bucket whose next parameter is largest (decreasing-size
  // packing); 2, lowest bucket first (a linear partition of the whole
  // stage: ranks own runs of whole layers, slices are uneven).
  double Priority(size_t k, int frontier, int order) const {
    if (order == 1) {
      return -ctx_.items[ctx_.buckets[ids_[k]].params[frontier]].cost;
    }
    if (order == 2) return static_cast<double>(k);
    return Progress(k, frontier);
  }
  double Progress(size_t k, int frontier) const {
    const auto& off = ctx_.offsets[ids_[k]];
    return static_cast<double>(off[frontier]) / static_cast<double>(off.back());
  }

  const Context& ctx_;
  int stage_;
  const std::vector<int>& ids_;
  int R_, T_;
  double total_ = 0;
};

// Micro-groups for the cost strategy: per TP group, each host's matrices go
// (largest first) to the group where that host has the least work and fuse
// room, with as many groups as the fullest host's fuse volume needs, so each
// group is balanced across hosts and the pipeline stays short.
void CostMicroGroups(const Context& ctx, int stage, int dp,
                     const std::vector<int>& params, Assignment* a) {
  if (params.empty()) return;
  const int T = ctx.T;
  const double cap = static_cast<double>(ctx.req->fuse_space);
  std::vector<std::vector<int>> per_host(T);
  std::vector<double> fuse(T, 0.0);
  for (int p : params) {
    per_host[a->tp_host[p]].push_back(p);
    fuse[a->tp_host[p]] += static_cast<double>(ctx.items[p].local_numel);
  }
  int groups = 1;
  for (int t = 0; t < T; ++t) {
    groups = std::max(groups, static_cast<int>(std::ceil(fuse[t] / cap)));
  }
  std::vector<MicroGroup> out(groups, MicroGroup{stage, dp, {}});
  for (int t = 0; t < T; ++t) {
    auto& list = per_host[t];
    std::sort(list.begin(), list.end(), [&](int x, int y) {
      const Item &a1 = ctx.items[x], &b1 = ctx.items[y];
      if (a1.cost != b1.cost) return a1.cost > b1.cost;
      return a1.name_rank < b1.name_rank;
    });
    std::vector<double> work(groups, 0.0), room(groups, cap);
    for (int p : list) {
      const double e = static_cast<double>(ctx.items[p].local_numel);
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

// ---------------------------------------------------------------------------
// Strategies.

Assignment NewAssignment(const Context& ctx) {
  Assignment a;
  a.dp_owner.assign(ctx.items.size(), -1);
  a.tp_host.assign(ctx.items.size(), -1);
  return a;
}

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
    std::sort(params.begin(), params.end(), [&](int x, int y) {
      const Item &a1 = ctx.items[x], &b1 = ctx.items[y];
      if (a1.cost != b1.cost) return a1.cost > b1.cost;
      return a1.name_rank < b1.name_rank;
    });
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
  const auto rows = HostedByRow(ctx, a.dp_owner);
  for (int s = 0; s < ctx.P; ++s) {
    for (int d = 0; d < ctx.R; ++d) {
      const auto& row = rows[static_cast<size_t>(s) * ctx.R + d];
      for (size_t i = 0; i < row.size(); i += ctx.T) {
        MicroGroup g{s, d, {}};
        for (size_t j = i; j < std::min(row.size(), i + ctx.T); ++j) {
          a.tp_host[row[j]] = static_cast<int>(j - i);
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
  const auto rows = HostedByRow(ctx, a.dp_owner);
  for (int s = 0; s < ctx.P; ++s) {
    for (int d = 0; d < ctx.R; ++d) {
      GreedyRollbackGroups(ctx, s, d, rows[static_cast<size_t>(s) * ctx.R + d],
                           &a);
    }
  }
  return a;
}

double AssignmentMakespan(const Context& ctx, const Assignment& a) {
  Loads loads{ctx.R, ctx.T,
              std::vector<double>(static_cast<size_t>(ctx.P) * ctx.R * ctx.T)};
  for (size_t i = 0; i < ctx.items.size(); ++i) {
    AddItem(ctx, static_cast<int>(i), a.dp_owner[i], a.tp_host[i], &loads);
  }
  return loads.v.empty() ? 0 : *std::max_element(loads.v.begin(), loads.v.end());
}

// Re-hosts an assignment's rows with LPT on the true cost (used to make the
// baselines' DP cuts candidates of the cost strategy).
Assignment RehostLpt(const Context& ctx, Assignment a) {
  a.groups.clear();
  std::fill(a.tp_host.begin(), a.tp_host.end(), -1);
  a.alpha_accepted = false;
  for (int s = 0; s < ctx.P; ++s) {
    CostSolver solver(ctx, s);
    CostSolver::Solution sol;
    sol.owner = a.dp_owner;
    sol.host.assign(ctx.items.size(), -1);
    sol.load.assign(ctx.R, std::vector<double>(ctx.T, 0.0));
    std::vector<std::vector<int>> rows(ctx.R);
    for (int i : ctx.stage_params[s]) rows[a.dp_owner[i]].push_back(i);
    for (int d = 0; d < ctx.R; ++d) solver.PackRow(rows[d], d, &sol);
    for (int i : ctx.stage_params[s]) a.tp_host[i] = sol.host[i];
  }
  return a;
}

void CostGroupsForAll(const Context& ctx, Assignment* a) {
  a->groups.clear();
  const auto rows = HostedByRow(ctx, a->dp_owner);
  for (int s = 0; s < ctx.P; ++s) {
    for (int d = 0; d < ctx.R; ++d) {
      CostMicroGroups(ctx, s, d, rows[static_cast<size_t>(s) * ctx.R + d], a);
    }
  }
}

double MaxSliceImbalance(const Context& ctx, const Assignment& a) {
  double imb = 1.0;
  for (size_t b = 0; b < ctx.buckets.size(); ++b) {
    if (a.cuts.empty()) break;
    const auto& off = ctx.offsets[b];
    const double mean = static_cast<double>(off.back()) / ctx.R;
    if (mean <= 0) continue;
    int64_t largest = 0;
    for (int d = 0; d < ctx.R; ++d) {
      largest = std::max(largest, off[a.cuts[b][d + 1]] - off[a.cuts[b][d]]);
    }
    imb = std::max(imb, static_cast<double>(largest) / mean);
  }
  return imb;
}

Assignment PlanCost(const Context& ctx) {
  // Baselines first: their makespans bound the bisection and are fallbacks,
  // so cost is never worse than alpha or start_anchored.
  std::vector<Assignment> candidates;
  candidates.push_back(PlanAlpha(ctx, ctx.req->alpha));
  candidates.push_back(RehostLpt(ctx, candidates.back()));
  candidates.push_back(RehostLpt(ctx, PlanStartAnchored(ctx)));
  double upper = kInf;
  for (const auto& c : candidates) upper = std::min(upper, AssignmentMakespan(ctx, c));

  Assignment ours = NewAssignment(ctx);
  ours.cuts.resize(ctx.buckets.size());
  for (int s = 0; s < ctx.P; ++s) {
    CostSolver solver(ctx, s);
    CostSolver::Solution sol = solver.Solve(upper);
    const auto& ids = ctx.stage_buckets[s];
    for (size_t k = 0; k < ids.size(); ++k) ours.cuts[ids[k]] = sol.cuts[k];
    for (int i : ctx.stage_params[s]) {
      ours.dp_owner[i] = sol.owner[i];
      ours.tp_host[i] = sol.host[i];
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

// ---------------------------------------------------------------------------
// Metrics.

Plan Finalize(const Context& ctx, Strategy strategy, Assignment a) {
  const PlanRequest& req = *ctx.req;
  Plan plan;
  plan.strategy = strategy;
  plan.layout = req.layout;
  plan.calibrated = req.cost_model.calibrated();
  plan.alpha = req.alpha;
  plan.alpha_accepted = strategy == Strategy::kAlpha && a.alpha_accepted;
  for (const ParamSpec& p : req.parameters) plan.param_names.push_back(p.name);
  plan.dp_owner = a.dp_owner;
  plan.tp_host = a.tp_host;
  plan.buckets = ctx.buckets;
  if (!a.cuts.empty()) {
    for (size_t b = 0; b < plan.buckets.size(); ++b) plan.buckets[b].cuts = a.cuts[b];
  }
  plan.micro_groups = std::move(a.groups);
  plan.shard_group_size = ctx.R;
  plan.link_group_size = ctx.L;

  const int P = ctx.P, R = ctx.R, T = ctx.T;
  const size_t gpus = static_cast<size_t>(P) * R * T;
  plan.per_gpu.resize(gpus);
  for (int s = 0; s < P; ++s) {
    for (int d = 0; d < R; ++d) {
      for (int t = 0; t < T; ++t) {
        GpuLoad& g = plan.per_gpu[(static_cast<size_t>(s) * R + d) * T + t];
        g.stage = s;
        g.dp = d;
        g.tp = t;
      }
    }
  }
  auto gpu = [&](int s, int d, int t) -> GpuLoad& {
    return plan.per_gpu[(static_cast<size_t>(s) * R + d) * T + t];
  };
  for (size_t i = 0; i < ctx.items.size(); ++i) {
    const Item& it = ctx.items[i];
    const int owner = plan.dp_owner[i];
    const int host = plan.tp_host[i];
    const int d0 = owner < 0 ? 0 : owner;
    const int d1 = owner < 0 ? R : owner + 1;
    for (int d = d0; d < d1; ++d) {
      const int t0 = host < 0 ? 0 : host;
      const int t1 = host < 0 ? T : host + 1;
      for (int t = t0; t < t1; ++t) {
        GpuLoad& g = gpu(it.stage, d, t);
        g.objective += it.cost;
        g.flops += it.flops;
        g.seconds += it.seconds;
        g.state_bytes += it.state;
      }
    }
  }
  double sum = 0;
  const GpuLoad* busiest = &plan.per_gpu[0];
  for (const GpuLoad& g : plan.per_gpu) {
    sum += g.objective;
    if (g.objective > busiest->objective) busiest = &g;
    plan.memory_max_bytes = std::max(plan.memory_max_bytes, g.state_bytes);
    plan.memory_mean_bytes += g.state_bytes;
  }
  plan.memory_mean_bytes /= static_cast<double>(gpus);
  plan.makespan = busiest->objective;
  plan.makespan_flops = busiest->flops;
  plan.makespan_seconds = busiest->seconds;
  plan.mean = sum / static_cast<double>(gpus);
  plan.lb = ctx.lb;
  plan.lb_binding = ctx.lb_binding;
  plan.lower_bound = ctx.lower_bound;

  // Communication per GPU per step (busiest GPU's bytes).
  auto bucket_bytes = [&](int b, int from, int to) {
    double bytes = 0;
    const auto& params = ctx.buckets[b].params;
    for (int i = from; i < to; ++i) {
      bytes += static_cast<double>(ctx.items[params[i]].local_numel) *
               ctx.items[params[i]].elem_bytes;
    }
    return bytes;
  };
  CommStats rs, ag, ar, a2a, tpag;
  std::vector<int64_t> stage_buckets(P, 0);
  for (const BucketPlan& b : ctx.buckets) ++stage_buckets[b.stage];
  const int64_t max_buckets =
      P > 0 ? *std::max_element(stage_buckets.begin(), stage_buckets.end()) : 0;
  plan.bucket_slice_imbalance.assign(ctx.buckets.size(), 1.0);
  if (R > 1) {
    if (a.comm == Assignment::Comm::kSliced) {
      rs.calls = ag.calls = max_buckets;
      std::vector<double> sent(static_cast<size_t>(P) * R, 0.0), padded(P, 0.0);
      for (size_t b = 0; b < ctx.buckets.size(); ++b) {
        const int s = ctx.buckets[b].stage;
        const int n = static_cast<int>(ctx.buckets[b].params.size());
        const double total = bucket_bytes(static_cast<int>(b), 0, n);
        double largest = 0;
        int64_t largest_elems = 0;
        for (int d = 0; d < R; ++d) {
          const double own =
              bucket_bytes(static_cast<int>(b), a.cuts[b][d], a.cuts[b][d + 1]);
          sent[static_cast<size_t>(s) * R + d] += total - own;
          largest = std::max(largest, own);
          largest_elems = std::max(
              largest_elems,
              ctx.offsets[b][a.cuts[b][d + 1]] - ctx.offsets[b][a.cuts[b][d]]);
        }
        padded[s] += (R - 1) * largest;
        const double mean = static_cast<double>(ctx.buckets[b].elements) / R;
        plan.bucket_slice_imbalance[b] =
            mean > 0 ? static_cast<double>(largest_elems) / mean : 1.0;
      }
      rs.bytes = ag.bytes = *std::max_element(sent.begin(), sent.end());
      rs.padded_bytes = ag.padded_bytes =
          *std::max_element(padded.begin(), padded.end());
    } else {
      ar.calls = max_buckets;
      std::vector<double> per_stage(P, 0.0);
      for (size_t b = 0; b < ctx.buckets.size(); ++b) {
        const int n = static_cast<int>(ctx.buckets[b].params.size());
        per_stage[ctx.buckets[b].stage] +=
            2.0 * (R - 1) / R * bucket_bytes(static_cast<int>(b), 0, n);
      }
      ar.bytes = ar.padded_bytes =
          *std::max_element(per_stage.begin(), per_stage.end());
      if (a.comm == Assignment::Comm::kLayerwise) {
        ag.calls = max_buckets;
        std::vector<double> sent(static_cast<size_t>(P) * R, 0.0),
            stage_total(P, 0.0);
        for (size_t i = 0; i < ctx.items.size(); ++i) {
          const double bytes =
              static_cast<double>(ctx.items[i].local_numel) * ctx.items[i].elem_bytes;
          stage_total[ctx.items[i].stage] += bytes;
          sent[static_cast<size_t>(ctx.items[i].stage) * R + plan.dp_owner[i]] += bytes;
        }
        double worst = 0;
        for (int s = 0; s < P; ++s) {
          for (int d = 0; d < R; ++d) {
            worst = std::max(worst, stage_total[s] - sent[static_cast<size_t>(s) * R + d]);
          }
        }
        ag.bytes = ag.padded_bytes = worst;
      }
    }
  }
  if (T > 1) {
    if (a.comm == Assignment::Comm::kSliced) {
      std::vector<double> sent(gpus, 0.0);
      std::vector<int64_t> calls(static_cast<size_t>(P) * R, 0);
      for (const MicroGroup& g : plan.micro_groups) {
        calls[static_cast<size_t>(g.stage) * R + g.dp] += 2;
        for (int p : g.params) {
          const double bytes =
              static_cast<double>(ctx.items[p].local_numel) * ctx.items[p].elem_bytes;
          for (int t = 0; t < T; ++t) {
            sent[(static_cast<size_t>(g.stage) * R + g.dp) * T + t] +=
                t == plan.tp_host[p] ? (T - 1) * bytes : bytes;
          }
        }
      }
      a2a.calls = *std::max_element(calls.begin(), calls.end());
      a2a.bytes = a2a.padded_bytes = *std::max_element(sent.begin(), sent.end());
    } else {
      // Duplicated mode: every TP rank all-gathers each matrix it updates.
      std::vector<double> bytes(static_cast<size_t>(P) * R, 0.0);
      std::vector<int64_t> calls(static_cast<size_t>(P) * R, 0);
      for (size_t i = 0; i < ctx.items.size(); ++i) {
        if (!ctx.items[i].hosted) continue;
        const double b = static_cast<double>(ctx.items[i].local_numel) *
                         ctx.items[i].elem_bytes * (T - 1);
        const int s = ctx.items[i].stage;
        const int d0 = plan.dp_owner[i] < 0 ? 0 : plan.dp_owner[i];
        const int d1 = plan.dp_owner[i] < 0 ? R : plan.dp_owner[i] + 1;
        for (int d = d0; d < d1; ++d) {
          bytes[static_cast<size_t>(s) * R + d] += b;
          ++calls[static_cast<size_t>(s) * R + d];
        }
      }
      tpag.calls = *std::max_element(calls.begin(), calls.end());
      tpag.bytes = tpag.padded_bytes = *std::max_element(bytes.begin(), bytes.end());
    }
  }
  plan.comm["reduce_scatter"] = rs;
  plan.comm["all_gather"] = ag;
  plan.comm["all_reduce"] = ar;
  plan.comm["tp_all_to_all"] = a2a;
  plan.comm["tp_all_gather"] = tpag;

  // DP traffic per link tier (planner.h, TierTraffic). Hierarchical: the
  // shard group is the link group and each position's shard is ring
  // all-reduced over the G groups; flat: link groups of L consecutive ranks.
  const int G = ctx.D / R;
  const int link = G > 1 ? R : ctx.L;
  std::vector<double> intra(static_cast<size_t>(P) * R, 0.0),
      inter(static_cast<size_t>(P) * R, 0.0),
      cross(static_cast<size_t>(P) * R, 0.0);
  if (a.comm == Assignment::Comm::kSliced) {
    std::vector<double> own(R), link_sum(R / link);
    for (size_t b = 0; b < ctx.buckets.size(); ++b) {
      const int s = ctx.buckets[b].stage;
      const int n = static_cast<int>(ctx.buckets[b].params.size());
      const double total = bucket_bytes(static_cast<int>(b), 0, n);
      std::fill(link_sum.begin(), link_sum.end(), 0.0);
      for (int d = 0; d < R; ++d) {
        own[d] =
            bucket_bytes(static_cast<int>(b), a.cuts[b][d], a.cuts[b][d + 1]);
        link_sum[d / link] += own[d];
      }
      for (int d = 0; d < R; ++d) {
        const size_t row = static_cast<size_t>(s) * R + d;
        intra[row] += 2.0 * (link_sum[d / link] - own[d]);
        inter[row] += 2.0 * (total - link_sum[d / link]);
        if (G > 1) cross[row] += 2.0 * (G - 1) / G * own[d];
      }
    }
  } else if (R > 1) {
    // All-reduce as reduce-scatter + all-gather of equal slices.
    std::vector<double> stage_total(P, 0.0);
    for (size_t b = 0; b < ctx.buckets.size(); ++b) {
      const int n = static_cast<int>(ctx.buckets[b].params.size());
      stage_total[ctx.buckets[b].stage] +=
          bucket_bytes(static_cast<int>(b), 0, n);
    }
    for (int s = 0; s < P; ++s) {
      for (int d = 0; d < R; ++d) {
        const size_t row = static_cast<size_t>(s) * R + d;
        intra[row] += 2.0 * (link - 1) * stage_total[s] / R;
        inter[row] += 2.0 * (R - link) * stage_total[s] / R;
      }
    }
    if (a.comm == Assignment::Comm::kLayerwise) {
      // Each rank all-gathers the parameters its peers own.
      std::vector<double> owned(static_cast<size_t>(P) * R, 0.0);
      for (size_t i = 0; i < ctx.items.size(); ++i) {
        owned[static_cast<size_t>(ctx.items[i].stage) * R + plan.dp_owner[i]] +=
            static_cast<double>(ctx.items[i].local_numel) *
            ctx.items[i].elem_bytes;
      }
      for (int s = 0; s < P; ++s) {
        for (int d = 0; d < R; ++d) {
          for (int e = 0; e < R; ++e) {
            if (e == d) continue;
            const double bytes = owned[static_cast<size_t>(s) * R + e];
            (e / link == d / link ? intra
                                  : inter)[static_cast<size_t>(s) * R + d] +=
                bytes;
          }
        }
      }
    }
  }
  for (size_t row = 0; row < intra.size(); ++row) {
    plan.dp_traffic.intra_group_bytes =
        std::max(plan.dp_traffic.intra_group_bytes, intra[row]);
    plan.dp_traffic.inter_group_bytes =
        std::max(plan.dp_traffic.inter_group_bytes, inter[row] + cross[row]);
  }
  if (G > 1) {
    CommStats xar;
    xar.calls = max_buckets;
    xar.bytes = xar.padded_bytes =
        *std::max_element(cross.begin(), cross.end());
    plan.comm["cross_group_all_reduce"] = xar;
  }
  for (double x : plan.bucket_slice_imbalance) {
    plan.max_bucket_slice_imbalance = std::max(plan.max_bucket_slice_imbalance, x);
  }

  // Micro-groups: count per TP group, largest per-host load in a group, and
  // the pipelined TP time (sum over groups of their fullest host).
  std::vector<int> count(static_cast<size_t>(P) * R, 0);
  std::vector<double> pipeline(static_cast<size_t>(P) * R, 0.0);
  for (const MicroGroup& g : plan.micro_groups) {
    const size_t row = static_cast<size_t>(g.stage) * R + g.dp;
    ++count[row];
    std::vector<double> host(T, 0.0);
    for (int p : g.params) host[plan.tp_host[p]] += ctx.items[p].cost;
    const double mx = *std::max_element(host.begin(), host.end());
    plan.largest_group_host_load = std::max(plan.largest_group_host_load, mx);
    pipeline[row] += mx;
  }
  plan.max_micro_groups_per_tp_group =
      count.empty() ? 0 : *std::max_element(count.begin(), count.end());
  plan.tp_pipeline_makespan =
      pipeline.empty() ? 0 : *std::max_element(pipeline.begin(), pipeline.end());
  plan.digest = Fnv1a64Hex(CanonicalAssignment(plan));
  return plan;
}

}  // namespace

absl::StatusOr<Strategy> ParseStrategy(absl::string_view name) {
  if (name == "sc") return Strategy::kSc;
  if (name == "layerwise") return Strategy::kLayerwise;
  if (name == "start_anchored") return Strategy::kStartAnchored;
  if (name == "alpha") return Strategy::kAlpha;
  if (name == "cost") return Strategy::kCost;
  return absl::InvalidArgumentError(absl::StrCat(
      "strategy: unknown strategy '", name,
      "' (sc, layerwise, start_anchored, alpha, cost)"));
}

const char* StrategyName(Strategy strategy) {
  switch (strategy) {
    case Strategy::kSc:
      return "sc";
    case Strategy::kLayerwise:
      return "layerwise";
    case Strategy::kStartAnchored:
      return "start_anchored";
    case Strategy::kAlpha:
      return "alpha";
    case Strategy::kCost:
      return "cost";
  }
  return "unknown";
}

std::vector<Strategy> AllStrategies() {
  return {Strategy::kSc, Strategy::kLayerwise, Strategy::kStartAnchored,
          Strategy::kAlpha, Strategy::kCost};
}

absl::StatusOr<Plan> BuildPlan(const PlanRequest& request) {
  CANZONA_RETURN_IF_ERROR(Validate(request));
  const Context ctx = MakeContext(request);
  Assignment a;
  switch (request.strategy) {
    case Strategy::kSc:
      a = PlanSc(ctx);
      break;
    case Strategy::kLayerwise:
      a = PlanLayerwise(ctx);
      break;
    case Strategy::kStartAnchored:
      a = PlanStartAnchored(ctx);
      break;
    case Strategy::kAlpha:
      a = PlanAlpha(ctx, request.alpha);
      break;
    case Strategy::kCost:
      a = PlanCost(ctx);
      break;
  }
  return Finalize(ctx, request.strategy, std::move(a));
}

// Canonical serialization (version 1), one line each:
//   "canzona-plan-v1 pp=<P> dp=<R> tp=<T>"       flat (S == dp), or
//   "canzona-plan-v1 pp=<P> dp=<R> tp=<T> shard_group=<S>"  when S < dp
//   (dp_owner, cuts and micro-group dp below are then positions in [0, S))
//   "p <name> <dp_owner> <tp_host>"              per parameter, request order
//   "b <stage> <first param name> <cut_0>,...,<cut_R>"   per bucket with cuts
//   "g <stage> <dp> <name>,<name>,..."           per micro-group, names in
//                                                request order, groups in plan
//                                                order
// Integers in decimal, lines joined with '\n'. The digest is FNV-1a 64
// (offset basis 0xcbf29ce484222325, prime 0x100000001b3) over its bytes,
// printed as 16 lower-case hex digits: identical on every machine.
std::string CanonicalAssignment(const Plan& plan) {
  std::string out =
      absl::StrCat("canzona-plan-v1 pp=", plan.layout.pp,
                   " dp=", plan.layout.dp, " tp=", plan.layout.tp);
  if (plan.hierarchical()) {
    absl::StrAppend(&out, " shard_group=", plan.shard_group_size);
  }
  out += "\n";
  for (size_t i = 0; i < plan.param_names.size(); ++i) {
    absl::StrAppend(&out, "p ", plan.param_names[i], " ", plan.dp_owner[i],
                    " ", plan.tp_host[i], "\n");
  }
  for (const BucketPlan& b : plan.buckets) {
    if (b.cuts.empty()) continue;
    absl::StrAppend(&out, "b ", b.stage, " ", plan.param_names[b.params[0]], " ");
    for (size_t d = 0; d < b.cuts.size(); ++d) {
      absl::StrAppend(&out, d ? "," : "", b.cuts[d]);
    }
    out += "\n";
  }
  for (const MicroGroup& g : plan.micro_groups) {
    std::vector<int> sorted = g.params;
    std::sort(sorted.begin(), sorted.end());
    absl::StrAppend(&out, "g ", g.stage, " ", g.dp, " ");
    for (size_t k = 0; k < sorted.size(); ++k) {
      absl::StrAppend(&out, k ? "," : "", plan.param_names[sorted[k]]);
    }
    out += "\n";
  }
  return out;
}

std::string Fnv1a64Hex(absl::string_view data) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : data) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  static const char kHex[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i) {
    out[i] = kHex[h & 0xf];
    h >>= 4;
  }
  return out;
}

}  // namespace canzona::plan
