#include "server/plan/planning_context.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/plan/lower_bound.h"

namespace canzona::plan::internal {
namespace {

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(message);
}

}  // namespace

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
    const std::string where =
        absl::StrCat("parameters[", i, "] '", p.name, "'");
    if (p.name.empty()) return Invalid(absl::StrCat(where, ": empty name"));
    if (!names.insert(p.name).second) {
      return Invalid(absl::StrCat(where, ": duplicate name"));
    }
    if (p.shape.empty()) return Invalid(absl::StrCat(where, ": empty shape"));
    for (int64_t d : p.shape) {
      if (d <= 0) {
        return Invalid(
            absl::StrCat(where, ": shape has a zero or negative dim"));
      }
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
                                  p.tp_split_dim, " (", p.shape[p.tp_split_dim],
                                  ")"));
    }
    if (p.pp_stage < 0 || p.pp_stage >= l.pp) {
      return Invalid(absl::StrCat(where, ": pp_stage ", p.pp_stage,
                                  " outside [0, ", l.pp, ")"));
    }
  }
  return absl::OkStatus();
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
    it.tp_owned = IsMatrixOptimizer(p.optimizer) && it.split;
    const ParamWork work = WorkOf(model, p);
    it.full_cost = model.Objective(work);
    it.full_flops = work.flops;
    it.full_seconds = work.seconds;
    it.full_state = StateBytesOf(model, p);
    it.fragment_numel = LocalNumel(p, ctx.T);
    it.elem_bytes = DTypeBytes(p.dtype);
    // Split AdamW shards are updated where they lie: 1/T per TP rank.
    const double share = (it.split && !it.tp_owned) ? 1.0 / ctx.T : 1.0;
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
      current.elements += ctx.items[*it].fragment_numel;
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
      off[i + 1] = off[i] + ctx.items[b.params[i]].fragment_numel;
    }
    ctx.offsets.push_back(std::move(off));
  }
  // LB (server/DESIGN.md section 4.4) and the proven lower bound.
  double total = 0, largest = 0;
  for (const Item& it : ctx.items) {
    total += it.tp_owned ? it.cost : it.cost * ctx.T;
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
      // A non-TP-owned item puts `cost` on each of the T GPUs of one DP rank:
      // relaxing "same DP rank" leaves T whole items.
      const int copies = it.tp_owned ? 1 : ctx.T;
      for (int c = 0; c < copies; ++c) whole.push_back(it.cost);
    }
    ctx.stage_lower_bound[s] = MakespanLowerBound(whole, 0, ctx.R * ctx.T);
    ctx.lower_bound = std::max(ctx.lower_bound, ctx.stage_lower_bound[s]);
  }
  return ctx;
}

Assignment NewAssignment(const Context& ctx) {
  Assignment a;
  a.dp_owner.assign(ctx.items.size(), -1);
  a.tp_owner.assign(ctx.items.size(), -1);
  return a;
}

std::vector<std::vector<int>> TpOwnedByRow(const Context& ctx,
                                           const std::vector<int>& owner) {
  std::vector<std::vector<int>> rows(static_cast<size_t>(ctx.P) * ctx.R);
  for (size_t i = 0; i < ctx.items.size(); ++i) {
    if (!ctx.items[i].tp_owned) continue;
    rows[static_cast<size_t>(ctx.items[i].stage) * ctx.R + owner[i]].push_back(
        static_cast<int>(i));
  }
  return rows;
}

double SliceImbalance(const Context& ctx, int bucket,
                      const std::vector<int>& cuts) {
  const auto& off = ctx.offsets[bucket];
  const double mean = static_cast<double>(off.back()) / ctx.R;
  if (mean <= 0) return 1.0;
  int64_t largest = 0;
  for (int d = 0; d < ctx.R; ++d) {
    largest = std::max(largest, off[cuts[d + 1]] - off[cuts[d]]);
  }
  return static_cast<double>(largest) / mean;
}

}  // namespace canzona::plan::internal
