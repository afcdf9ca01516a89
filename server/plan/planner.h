// The planner: which GPU computes each whole matrix's update, how each
// gradient bucket is cut over the DP ranks, and which TP micro-groups run.
//
//   PlanRequest request;
//   request.parameters = params;            // trainer order
//   request.layout = {.pp = 1, .dp = 32, .tp = 8};
//   request.strategy = Strategy::kCost;
//   CANZONA_ASSIGN_OR_RETURN(Plan plan, BuildPlan(request));
//   nlohmann::json report = PlanToJson(plan);   // plan_json.h
//
// Model of the step (server/DESIGN.md section 4): for each pipeline stage
// independently, gradients sit in buckets (filled in reverse parameter
// order, closed when they reach `bucket_size` local elements, as Megatron
// DDP does; padding is not modelled). Every TP rank has the same bucket
// structure over its local shards, so one set of DP cuts serves the whole
// TP group. The work of a
// parameter owned by DP rank d lands on the GPUs (d, t):
//   - a matrix-optimizer parameter split over TP (TP > 1) is *TP-owned*: its
//     whole update runs on one TP rank, the TP owner;
//   - everything else runs where its bytes are: an AdamW parameter split over
//     TP costs 1/TP on every TP rank of d, a replicated one (norms, router)
//     costs its full update on every TP rank of d.
// The makespan is the largest per-GPU load, in flops, or in seconds when the
// cost model is calibrated.
//
// Strategies (same output structure):
//   sc             every DP and TP rank updates everything (no partitioning);
//   layerwise      whole parameters dealt to DP ranks by LPT on cost,
//                  ignoring buckets (all-reduce + all-gather; TP duplicated);
//   start_anchored each parameter owned by the DP rank whose equal slice of
//                  its bucket holds its first element; TP micro-groups of TP
//                  consecutive matrices, TP owners round-robin;
//   alpha          reproduction of Canzona's released algorithm: alpha-
//                  balanced greedy on local numel over buckets in decreasing
//                  size, kept only if its DP max/mean beats start_anchored;
//                  greedy-rollback micro-groups (LPT on numel, fuse cap);
//   cost           ours: contiguous order-preserving cuts chosen by a
//                  bisection on the makespan with a greedy best-fit
//                  feasibility test over GPUs (DP owner x TP owner), then LPT
//                  and local search inside TP groups and boundary moves across
//                  DP ranks; never worse than the alpha and start_anchored
//                  plans, which it also evaluates.
// Ties are broken by parameter name, so plans are deterministic.
//
// Hierarchical sharding (AsyncHZP style), `shard_group_size` S: the DP ranks
// form dp/S groups of S consecutive ranks (group g = d / S, position
// p = d % S). Optimizer state is sharded over the S positions of a group and
// replicated across groups. Per step and bucket: reduce-scatter-v inside the
// group, all-reduce of each shard across the dp/S groups (same position),
// update by the owner position, all-gather-v inside the group. All groups
// are identical, so the plan is computed for ONE group: every per-DP-rank
// field (dp_owner, BucketPlan::cuts, MicroGroup::dp, per_gpu, GpuLoad::dp)
// is a POSITION in [0, S), while `layout` keeps the true dp. The load
// balancing is "within each group" (the partitioners run with dp = S), and
// makespan, lower bounds and memory are per GPU of one group; state per GPU
// grows by dp/S against the flat plan, DP traffic on the slow links shrinks.
// S == dp (the default, flat) gives exactly the flat plan and digest.
// Only the bucket-sliced strategies (start_anchored, alpha, cost) allow
// S < dp.
//
// Thread-safety: BuildPlan is a pure function of its request; it may run
// concurrently on different requests.
#ifndef CANZONA_SERVER_PLAN_PLANNER_H_
#define CANZONA_SERVER_PLAN_PLANNER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/plan/cost_model.h"
#include "server/plan/parameter.h"

namespace canzona::plan {

enum class Strategy { kSc, kLayerwise, kStartAnchored, kAlpha, kCost };

absl::StatusOr<Strategy> ParseStrategy(absl::string_view name);
const char* StrategyName(Strategy strategy);
// All strategies, in the order `--compare` prints them.
std::vector<Strategy> AllStrategies();

struct PlanRequest {
  std::vector<ParamSpec> parameters;  // trainer order
  ParallelLayout layout;
  int64_t bucket_size = 400000000;  // local elements per bucket
  Strategy strategy = Strategy::kCost;
  double alpha = 1.0;  // alpha strategy only: 0 comm balance .. 1 compute
  // Micro-group fuse space: max local elements per TP owner slot per group
  // (Canzona's tp_balanced_opt_fuse_space, 400 Mi).
  int64_t fuse_space = 400LL * 1024 * 1024;
  CostModel cost_model;
  // Hierarchical sharding: DP ranks per shard group. 0 = flat (layout.dp).
  // Must divide layout.dp; S < dp needs a bucket-sliced strategy.
  int shard_group_size = 0;
  // Link tiers for Plan::dp_traffic only (never changes the assignment):
  // DP ranks in the same run of `link_group_size` consecutive ranks share
  // fast links ("intra_group"), others talk over slow links ("inter_group").
  // 0 = the effective shard_group_size. Must divide layout.dp; with
  // S < dp it must be 0 or S (the shard group is the fast-link group).
  int link_group_size = 0;
};

// One gradient bucket of one stage and its DP cuts.
struct BucketPlan {
  int stage = 0;
  std::vector<int> params;  // parameter indices, bucket (reverse) order
  int64_t elements = 0;     // local elements
  // S + 1 positions into `params` (S = shard group size, dp when flat);
  // group position d owns [cuts[d], cuts[d+1]) in every shard group.
  // Empty for strategies that ignore buckets (sc, layerwise).
  std::vector<int> cuts;
};

// One TP micro-group of one (stage, DP rank): gathered, updated on the TP
// owners (tp_owner of each parameter) and scattered together.
struct MicroGroup {
  int stage = 0;
  int dp = 0;  // position in the shard group, [0, S)
  std::vector<int> params;
};

struct GpuLoad {
  int stage = 0;
  int dp = 0;  // position in the shard group, [0, S)
  int tp = 0;
  double objective = 0;  // flops, or seconds when calibrated
  double flops = 0;
  double seconds = 0;
  double state_bytes = 0;  // optimizer state held
};

// Per-GPU, per-step communication of one kind.
struct CommStats {
  int64_t calls = 0;        // collective calls per GPU per step
  double bytes = 0;         // bytes sent by the busiest GPU
  double padded_bytes = 0;  // reduce-scatter/all-gather padded to max slice
};

// DP gradient/parameter collective bytes SENT per GPU per step, split by
// link tier (intra_group: to DP ranks of the same link group; inter_group:
// to other link groups). Each tier is its own busiest GPU's figure. The
// accounting follows CommStats: a reduce-scatter-v or all-gather-v moves, to
// each peer, that peer's slice (direct exchange; the flat reduce_scatter /
// all_gather `bytes` are sum of the other ranks' slices), so
//   flat, link group L:  intra = 2 * (slices of the L-1 peers in my link
//                        group), inter = 2 * (slices of the dp-L others);
//   hierarchical, S:     intra = 2 * (group bucket - my slice) (RS + AG in
//                        the group), inter = 2 (G-1)/G * my slice (ring
//                        all-reduce of my shard over the G = dp/S groups);
// summed over buckets. An all-reduce (sc, layerwise) is counted as its
// reduce-scatter + all-gather with equal slices; the layerwise all-gather
// as the parameters owned by peers. With even slices the hierarchical
// inter_group bytes are the flat (L = S) inter_group bytes / S.
struct TierTraffic {
  double intra_group_bytes = 0;
  double inter_group_bytes = 0;
};

struct Plan {
  Strategy strategy = Strategy::kCost;
  ParallelLayout layout;
  bool calibrated = false;  // objective in seconds (else flops)
  double alpha = 1.0;
  bool alpha_accepted = false;  // alpha: greedy plan beat start_anchored

  std::vector<std::string> param_names;  // request order
  // Per parameter: owning DP rank, -1 when every DP rank updates it (sc).
  std::vector<int> dp_owner;
  // Per parameter: TP owner, -1 when it runs on every TP rank of its
  // owner (not TP-owned: AdamW, replicated, sc/layerwise duplicated mode).
  std::vector<int> tp_owner;
  std::vector<BucketPlan> buckets;
  std::vector<MicroGroup> micro_groups;
  // pp * S * tp entries (one shard group), index (stage * S + d) * tp + t.
  std::vector<GpuLoad> per_gpu;
  // S: DP ranks per shard group (layout.dp when flat); per-DP fields above
  // are positions in [0, S).
  int shard_group_size = 0;
  int link_group_size = 0;  // tiers of dp_traffic (S when hierarchical)

  // Load summary (objective units).
  double makespan = 0;
  double mean = 0;
  double lb = 0;           // max(largest item, total / GPUs)
  std::string lb_binding;  // "max_matrix" or "average"
  double lower_bound = 0;  // proven (lower_bound.h)
  double makespan_flops = 0;
  double makespan_seconds = 0;

  double memory_max_bytes = 0;
  double memory_mean_bytes = 0;
  // By kind: reduce_scatter, all_gather (inside the shard group), all_reduce,
  // tp_all_to_all, tp_all_gather, and cross_group_all_reduce when S < dp
  // (ring all-reduce of each position's shard over the dp/S groups).
  std::map<std::string, CommStats> comm;
  TierTraffic dp_traffic;                      // see TierTraffic
  double max_bucket_slice_imbalance = 1.0;     // max over buckets of max/mean
  std::vector<double> bucket_slice_imbalance;  // per bucket
  int max_micro_groups_per_tp_group = 0;
  double largest_group_owner_load = 0;  // objective units
  double tp_pipeline_makespan = 0;  // max over TP groups of sum of group max
  std::string digest;  // FNV-1a 64 of the canonical assignment, hex

  bool hierarchical() const {
    return shard_group_size > 0 && shard_group_size != layout.dp;
  }
  double max_over_mean() const { return mean > 0 ? makespan / mean : 1.0; }
  double makespan_over_lb() const { return lb > 0 ? makespan / lb : 1.0; }
  double lower_bound_over_lb() const { return lb > 0 ? lower_bound / lb : 1.0; }
  double makespan_over_lower_bound() const {
    return lower_bound > 0 ? makespan / lower_bound : 1.0;
  }
};

// Validates the request (errors name the field) and plans it.
absl::StatusOr<Plan> BuildPlan(const PlanRequest& request);

// The canonical serialization the digest hashes (format: plan_digest.cc).
std::string CanonicalAssignment(const Plan& plan);
std::string Fnv1a64Hex(absl::string_view data);

}  // namespace canzona::plan

#endif  // CANZONA_SERVER_PLAN_PLANNER_H_
