// The planner's working view of one request (internal to server/plan).
//
// MakeContext turns a validated PlanRequest into what every strategy reads:
// per-parameter costs where they land (Item), the per-stage parameter lists,
// the gradient buckets with their element offsets, and the lower bounds the
// plan is graded against. An Assignment is a strategy's answer before the
// metrics (plan_metrics.h) turn it into a Plan.
//
// Owns: Context owns its items, buckets and bounds; it points at the request
// it was made from, which must outlive it.
// Thread-safety: Validate and MakeContext are pure functions; a Context is
// immutable after MakeContext, so concurrent const use is safe.
// Why separate: the strategies (baseline_strategies.h, cost_strategy.h), the
// cost solver and the metrics all read the same context; keeping it apart
// lets each of them, and the cost solver's unit tests, include only it.
#ifndef CANZONA_SERVER_PLAN_PLANNING_CONTEXT_H_
#define CANZONA_SERVER_PLAN_PLANNING_CONTEXT_H_

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/plan/planner.h"

namespace canzona::plan::internal {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

// What one parameter costs where it lands.
struct Item {
  int stage = 0;
  bool tp_owned = false;  // whole update on one TP rank of its owner
  bool split = false;     // split over TP (local shard = numel / TP)
  double cost = 0;        // objective: full if TP-owned, else per TP rank
  double full_cost = 0;   // objective of the whole update
  double flops = 0;       // per GPU where it lands (TP-owned: on the TP owner)
  double seconds = 0;
  double full_flops = 0;
  double full_seconds = 0;
  double state = 0;       // state bytes per GPU where it lands
  double full_state = 0;  // state bytes of the whole parameter
  int64_t fragment_numel = 0;
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
  std::vector<int> tp_owner;
  std::vector<std::vector<int>> cuts;  // per bucket; empty: no slicing
  std::vector<MicroGroup> groups;
  enum class Comm { kSliced, kAllReduce, kLayerwise } comm = Comm::kSliced;
  bool alpha_accepted = false;
};

// Checks the request; errors name the field.
absl::Status Validate(const PlanRequest& req);

// The context of a request that passed Validate.
Context MakeContext(const PlanRequest& req);

// Nobody owns anything yet (every entry -1).
Assignment NewAssignment(const Context& ctx);

// TP-owned parameters owned by each (stage, dp), in request order; row
// stage * R + dp.
std::vector<std::vector<int>> TpOwnedByRow(const Context& ctx,
                                           const std::vector<int>& owner);

// Largest DP slice of `bucket` under `cuts` (R + 1 positions), in local
// elements, over the mean slice; 1 for an empty bucket.
double SliceImbalance(const Context& ctx, int bucket,
                      const std::vector<int>& cuts);

// LPT order on cost: costlier parameters first, ties by name, so every
// strategy that balances cost is deterministic.
struct CostlierFirst {
  const Context& ctx;
  bool operator()(int a, int b) const {
    const Item &x = ctx.items[a], &y = ctx.items[b];
    if (x.cost != y.cost) return x.cost > y.cost;
    return x.name_rank < y.name_rank;
  }
};

}  // namespace canzona::plan::internal

#endif  // CANZONA_SERVER_PLAN_PLANNING_CONTEXT_H_
