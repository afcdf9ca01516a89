// JSON form of a plan (`canzonactl plan --json`, the daemon's plan report).
//
// Keys (objective units are flops, or seconds when `calibrated`):
//   strategy, alpha, alpha_accepted, calibrated, objective_units,
//   layout {pp, dp, tp} (true dp), gpus (of one shard group),
//   shard_group_size (S; = dp when flat), link_group_size,
//   makespan, makespan_flops, makespan_seconds, mean,
//   lb, lb_binding ("max_matrix" | "average"), lower_bound,
//   makespan_over_lb, lower_bound_over_lb, makespan_over_lower_bound,
//   max_over_mean,
//   per_gpu: [{stage, dp, tp, flops, seconds, state_bytes}] (dp: position
//     in the shard group),
//   memory {max_bytes, mean_bytes},
//   comm {reduce_scatter|all_gather|all_reduce|tp_all_to_all|tp_all_gather
//         [|cross_group_all_reduce when S < dp]:
//         {calls, bytes, padded_bytes}, buckets, bucket_slice_imbalance:
//         [per bucket max/mean slice], max_bucket_slice_imbalance},
//   dp_traffic {intra_group_bytes, inter_group_bytes} (planner.h TierTraffic),
//   micro_groups {count, max_per_tp_group, largest_host_load,
//                 tp_pipeline_makespan},
//   digest (FNV-1a 64 of CanonicalAssignment, planner.h).
// With `include_assignment`, also `assignment`: [{name, dp, tp}].
//
// Thread-safety: pure function.
#ifndef CANZONA_SERVER_PLAN_PLAN_JSON_H_
#define CANZONA_SERVER_PLAN_PLAN_JSON_H_

#include "nlohmann/json.hpp"
#include "server/plan/planner.h"

namespace canzona::plan {

nlohmann::json PlanToJson(const Plan& plan, bool include_assignment = false);

}  // namespace canzona::plan

#endif  // CANZONA_SERVER_PLAN_PLAN_JSON_H_
