#include "server/plan/plan_metrics.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace canzona::plan::internal {
namespace {

// Bytes of one parameter's local shard, in its own dtype.
double ShardBytes(const Item& it) {
  return static_cast<double>(it.fragment_numel) * it.elem_bytes;
}

// Bytes of params [from, to) of bucket b.
double BucketBytes(const Context& ctx, int b, int from, int to) {
  double bytes = 0;
  const auto& params = ctx.buckets[b].params;
  for (int i = from; i < to; ++i) bytes += ShardBytes(ctx.items[params[i]]);
  return bytes;
}

double WholeBucketBytes(const Context& ctx, int b) {
  return BucketBytes(ctx, b, 0, static_cast<int>(ctx.buckets[b].params.size()));
}

// Shard bytes owned by each (stage, dp) row, row stage * R + dp.
std::vector<double> OwnedBytesByRow(const Context& ctx,
                                    const std::vector<int>& dp_owner) {
  std::vector<double> owned(static_cast<size_t>(ctx.P) * ctx.R, 0.0);
  for (size_t i = 0; i < ctx.items.size(); ++i) {
    owned[static_cast<size_t>(ctx.items[i].stage) * ctx.R + dp_owner[i]] +=
        ShardBytes(ctx.items[i]);
  }
  return owned;
}

// Makespan, mean and memory from the per-GPU loads; the bounds.
void SummarizeLoads(const Context& ctx, Plan* plan) {
  const size_t gpus = plan->per_gpu.size();
  double sum = 0;
  const GpuLoad* busiest = &plan->per_gpu[0];
  for (const GpuLoad& g : plan->per_gpu) {
    sum += g.objective;
    if (g.objective > busiest->objective) busiest = &g;
    plan->memory_max_bytes = std::max(plan->memory_max_bytes, g.state_bytes);
    plan->memory_mean_bytes += g.state_bytes;
  }
  plan->memory_mean_bytes /= static_cast<double>(gpus);
  plan->makespan = busiest->objective;
  plan->makespan_flops = busiest->flops;
  plan->makespan_seconds = busiest->seconds;
  plan->mean = sum / static_cast<double>(gpus);
  plan->lb = ctx.lb;
  plan->lb_binding = ctx.lb_binding;
  plan->lower_bound = ctx.lower_bound;
}

// Gradient reduce-scatter / all-reduce and parameter all-gather inside the
// shard group, and each bucket's slice imbalance.
void AddDpCollectives(const Context& ctx, const Assignment& a,
                      int64_t max_buckets, Plan* plan) {
  const int P = ctx.P, R = ctx.R;
  CommStats rs, ag, ar;
  plan->bucket_slice_imbalance.assign(ctx.buckets.size(), 1.0);
  if (R > 1) {
    if (a.comm == Assignment::Comm::kSliced) {
      rs.calls = ag.calls = max_buckets;
      std::vector<double> sent(static_cast<size_t>(P) * R, 0.0), padded(P, 0.0);
      for (size_t b = 0; b < ctx.buckets.size(); ++b) {
        const int s = ctx.buckets[b].stage;
        const double total = WholeBucketBytes(ctx, static_cast<int>(b));
        double largest = 0;
        for (int d = 0; d < R; ++d) {
          const double own = BucketBytes(ctx, static_cast<int>(b), a.cuts[b][d],
                                         a.cuts[b][d + 1]);
          sent[static_cast<size_t>(s) * R + d] += total - own;
          largest = std::max(largest, own);
        }
        padded[s] += (R - 1) * largest;
        plan->bucket_slice_imbalance[b] =
            SliceImbalance(ctx, static_cast<int>(b), a.cuts[b]);
      }
      rs.bytes = ag.bytes = *std::max_element(sent.begin(), sent.end());
      rs.padded_bytes = ag.padded_bytes =
          *std::max_element(padded.begin(), padded.end());
    } else {
      ar.calls = max_buckets;
      std::vector<double> per_stage(P, 0.0);
      for (size_t b = 0; b < ctx.buckets.size(); ++b) {
        per_stage[ctx.buckets[b].stage] +=
            2.0 * (R - 1) / R * WholeBucketBytes(ctx, static_cast<int>(b));
      }
      ar.bytes = ar.padded_bytes =
          *std::max_element(per_stage.begin(), per_stage.end());
      if (a.comm == Assignment::Comm::kLayerwise) {
        ag.calls = max_buckets;
        const std::vector<double> sent = OwnedBytesByRow(ctx, a.dp_owner);
        std::vector<double> stage_total(P, 0.0);
        for (const Item& it : ctx.items) {
          stage_total[it.stage] += ShardBytes(it);
        }
        double worst = 0;
        for (int s = 0; s < P; ++s) {
          for (int d = 0; d < R; ++d) {
            worst = std::max(
                worst, stage_total[s] - sent[static_cast<size_t>(s) * R + d]);
          }
        }
        ag.bytes = ag.padded_bytes = worst;
      }
    }
  }
  plan->comm["reduce_scatter"] = rs;
  plan->comm["all_gather"] = ag;
  plan->comm["all_reduce"] = ar;
  for (double x : plan->bucket_slice_imbalance) {
    plan->max_bucket_slice_imbalance =
        std::max(plan->max_bucket_slice_imbalance, x);
  }
}

// TP traffic: all-to-all of the micro-groups (TP-owned), or an all-gather of
// every matrix on every TP rank (duplicated mode).
void AddTpCollectives(const Context& ctx, const Assignment& a, Plan* plan) {
  const int P = ctx.P, R = ctx.R, T = ctx.T;
  CommStats a2a, tpag;
  if (T > 1) {
    if (a.comm == Assignment::Comm::kSliced) {
      std::vector<double> sent(plan->per_gpu.size(), 0.0);
      std::vector<int64_t> calls(static_cast<size_t>(P) * R, 0);
      for (const MicroGroup& g : plan->micro_groups) {
        calls[static_cast<size_t>(g.stage) * R + g.dp] += 2;
        for (int p : g.params) {
          const double bytes = ShardBytes(ctx.items[p]);
          for (int t = 0; t < T; ++t) {
            sent[(static_cast<size_t>(g.stage) * R + g.dp) * T + t] +=
                t == plan->tp_owner[p] ? (T - 1) * bytes : bytes;
          }
        }
      }
      a2a.calls = *std::max_element(calls.begin(), calls.end());
      a2a.bytes = a2a.padded_bytes =
          *std::max_element(sent.begin(), sent.end());
    } else {
      // Duplicated mode: every TP rank all-gathers each matrix it updates.
      std::vector<double> bytes(static_cast<size_t>(P) * R, 0.0);
      std::vector<int64_t> calls(static_cast<size_t>(P) * R, 0);
      for (size_t i = 0; i < ctx.items.size(); ++i) {
        if (!ctx.items[i].tp_owned) continue;
        const double b = ShardBytes(ctx.items[i]) * (T - 1);
        const int s = ctx.items[i].stage;
        const int d0 = a.dp_owner[i] < 0 ? 0 : a.dp_owner[i];
        const int d1 = a.dp_owner[i] < 0 ? R : a.dp_owner[i] + 1;
        for (int d = d0; d < d1; ++d) {
          bytes[static_cast<size_t>(s) * R + d] += b;
          ++calls[static_cast<size_t>(s) * R + d];
        }
      }
      tpag.calls = *std::max_element(calls.begin(), calls.end());
      tpag.bytes = tpag.padded_bytes =
          *std::max_element(bytes.begin(), bytes.end());
    }
  }
  plan->comm["tp_all_to_all"] = a2a;
  plan->comm["tp_all_gather"] = tpag;
}

// DP traffic per link tier (planner.h, TierTraffic). Hierarchical: the
// shard group is the link group and each position's shard is ring
// all-reduced over the G groups; flat: link groups of L consecutive ranks.
void AddDpTierTraffic(const Context& ctx, const Assignment& a,
                      int64_t max_buckets, Plan* plan) {
  const int P = ctx.P, R = ctx.R;
  const int G = ctx.D / R;
  const int link = G > 1 ? R : ctx.L;
  std::vector<double> intra(static_cast<size_t>(P) * R, 0.0),
      inter(static_cast<size_t>(P) * R, 0.0),
      cross(static_cast<size_t>(P) * R, 0.0);
  if (a.comm == Assignment::Comm::kSliced) {
    std::vector<double> own(R), link_sum(R / link);
    for (size_t b = 0; b < ctx.buckets.size(); ++b) {
      const int s = ctx.buckets[b].stage;
      const double total = WholeBucketBytes(ctx, static_cast<int>(b));
      std::fill(link_sum.begin(), link_sum.end(), 0.0);
      for (int d = 0; d < R; ++d) {
        own[d] = BucketBytes(ctx, static_cast<int>(b), a.cuts[b][d],
                             a.cuts[b][d + 1]);
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
      stage_total[ctx.buckets[b].stage] +=
          WholeBucketBytes(ctx, static_cast<int>(b));
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
      const std::vector<double> owned = OwnedBytesByRow(ctx, a.dp_owner);
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
    plan->dp_traffic.intra_group_bytes =
        std::max(plan->dp_traffic.intra_group_bytes, intra[row]);
    plan->dp_traffic.inter_group_bytes =
        std::max(plan->dp_traffic.inter_group_bytes, inter[row] + cross[row]);
  }
  if (G > 1) {
    CommStats xar;
    xar.calls = max_buckets;
    xar.bytes = xar.padded_bytes =
        *std::max_element(cross.begin(), cross.end());
    plan->comm["cross_group_all_reduce"] = xar;
  }
}

// Micro-groups: count per TP group, largest per-TP-owner load in a group, and
// the pipelined TP time (sum over groups of their fullest TP owner).
void AddMicroGroupFigures(const Context& ctx, Plan* plan) {
  const int P = ctx.P, R = ctx.R, T = ctx.T;
  std::vector<int> count(static_cast<size_t>(P) * R, 0);
  std::vector<double> pipeline(static_cast<size_t>(P) * R, 0.0);
  for (const MicroGroup& g : plan->micro_groups) {
    const size_t row = static_cast<size_t>(g.stage) * R + g.dp;
    ++count[row];
    std::vector<double> load_per_tp_rank(T, 0.0);
    for (int p : g.params)
      load_per_tp_rank[plan->tp_owner[p]] += ctx.items[p].cost;
    const double mx =
        *std::max_element(load_per_tp_rank.begin(), load_per_tp_rank.end());
    plan->largest_group_owner_load =
        std::max(plan->largest_group_owner_load, mx);
    pipeline[row] += mx;
  }
  plan->max_micro_groups_per_tp_group =
      count.empty() ? 0 : *std::max_element(count.begin(), count.end());
  plan->tp_pipeline_makespan =
      pipeline.empty() ? 0
                       : *std::max_element(pipeline.begin(), pipeline.end());
}

}  // namespace

std::vector<GpuLoad> PerGpuLoads(const Context& ctx,
                                 const std::vector<int>& dp_owner,
                                 const std::vector<int>& tp_owner) {
  const int P = ctx.P, R = ctx.R, T = ctx.T;
  std::vector<GpuLoad> per_gpu(static_cast<size_t>(P) * R * T);
  auto gpu = [&](int s, int d, int t) -> GpuLoad& {
    return per_gpu[(static_cast<size_t>(s) * R + d) * T + t];
  };
  for (int s = 0; s < P; ++s) {
    for (int d = 0; d < R; ++d) {
      for (int t = 0; t < T; ++t) {
        GpuLoad& g = gpu(s, d, t);
        g.stage = s;
        g.dp = d;
        g.tp = t;
      }
    }
  }
  for (size_t i = 0; i < ctx.items.size(); ++i) {
    const Item& it = ctx.items[i];
    const int owner = dp_owner[i];
    const int owner_t = tp_owner[i];
    const int d0 = owner < 0 ? 0 : owner;
    const int d1 = owner < 0 ? R : owner + 1;
    for (int d = d0; d < d1; ++d) {
      const int t0 = owner_t < 0 ? 0 : owner_t;
      const int t1 = owner_t < 0 ? T : owner_t + 1;
      for (int t = t0; t < t1; ++t) {
        GpuLoad& g = gpu(it.stage, d, t);
        g.objective += it.cost;
        g.flops += it.flops;
        g.seconds += it.seconds;
        g.state_bytes += it.state;
      }
    }
  }
  return per_gpu;
}

Plan FinalizePlan(const Context& ctx, Strategy strategy, Assignment a) {
  const PlanRequest& req = *ctx.req;
  Plan plan;
  plan.strategy = strategy;
  plan.layout = req.layout;
  plan.calibrated = req.cost_model.calibrated();
  plan.alpha = req.alpha;
  plan.alpha_accepted = strategy == Strategy::kAlpha && a.alpha_accepted;
  for (const ParamSpec& p : req.parameters) plan.param_names.push_back(p.name);
  plan.dp_owner = a.dp_owner;
  plan.tp_owner = a.tp_owner;
  plan.buckets = ctx.buckets;
  if (!a.cuts.empty()) {
    for (size_t b = 0; b < plan.buckets.size(); ++b) {
      plan.buckets[b].cuts = a.cuts[b];
    }
  }
  plan.micro_groups = std::move(a.groups);
  plan.shard_group_size = ctx.R;
  plan.link_group_size = ctx.L;

  plan.per_gpu = PerGpuLoads(ctx, plan.dp_owner, plan.tp_owner);
  SummarizeLoads(ctx, &plan);

  // Communication per GPU per step (busiest GPU's bytes).
  std::vector<int64_t> stage_buckets(ctx.P, 0);
  for (const BucketPlan& b : ctx.buckets) ++stage_buckets[b.stage];
  const int64_t max_buckets =
      ctx.P > 0 ? *std::max_element(stage_buckets.begin(), stage_buckets.end())
                : 0;
  AddDpCollectives(ctx, a, max_buckets, &plan);
  AddTpCollectives(ctx, a, &plan);
  AddDpTierTraffic(ctx, a, max_buckets, &plan);
  AddMicroGroupFigures(ctx, &plan);
  plan.digest = Fnv1a64Hex(CanonicalAssignment(plan));
  return plan;
}

}  // namespace canzona::plan::internal
