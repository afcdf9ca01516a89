#include "server/plan/plan_json.h"

#include <string>

namespace canzona::plan {

nlohmann::json PlanToJson(const Plan& plan, bool include_assignment) {
  using nlohmann::json;
  json j;
  j["strategy"] = StrategyName(plan.strategy);
  j["alpha"] = plan.alpha;
  j["alpha_accepted"] = plan.alpha_accepted;
  j["calibrated"] = plan.calibrated;
  j["objective_units"] = plan.calibrated ? "seconds" : "flops";
  j["layout"] = {
      {"pp", plan.layout.pp}, {"dp", plan.layout.dp}, {"tp", plan.layout.tp}};
  j["gpus"] = plan.per_gpu.size();
  j["shard_group_size"] = plan.shard_group_size;
  j["link_group_size"] = plan.link_group_size;
  j["makespan"] = plan.makespan;
  j["makespan_flops"] = plan.makespan_flops;
  j["makespan_seconds"] = plan.makespan_seconds;
  j["mean"] = plan.mean;
  j["lb"] = plan.lb;
  j["lb_binding"] = plan.lb_binding;
  j["lower_bound"] = plan.lower_bound;
  j["makespan_over_lb"] = plan.makespan_over_lb();
  j["lower_bound_over_lb"] = plan.lower_bound_over_lb();
  j["makespan_over_lower_bound"] = plan.makespan_over_lower_bound();
  j["max_over_mean"] = plan.max_over_mean();
  json per_gpu = json::array();
  for (const GpuLoad& g : plan.per_gpu) {
    per_gpu.push_back({{"stage", g.stage},
                       {"dp", g.dp},
                       {"tp", g.tp},
                       {"flops", g.flops},
                       {"seconds", g.seconds},
                       {"state_bytes", g.state_bytes}});
  }
  j["per_gpu"] = std::move(per_gpu);
  j["memory"] = {{"max_bytes", plan.memory_max_bytes},
                 {"mean_bytes", plan.memory_mean_bytes}};
  json comm = json::object();
  for (const auto& [kind, stats] : plan.comm) {
    comm[kind] = {{"calls", stats.calls},
                  {"bytes", stats.bytes},
                  {"padded_bytes", stats.padded_bytes}};
  }
  comm["buckets"] = plan.buckets.size();
  comm["bucket_slice_imbalance"] = plan.bucket_slice_imbalance;
  comm["max_bucket_slice_imbalance"] = plan.max_bucket_slice_imbalance;
  j["comm"] = std::move(comm);
  j["dp_traffic"] = {{"intra_group_bytes", plan.dp_traffic.intra_group_bytes},
                     {"inter_group_bytes", plan.dp_traffic.inter_group_bytes}};
  j["micro_groups"] = {{"count", plan.micro_groups.size()},
                       {"max_per_tp_group", plan.max_micro_groups_per_tp_group},
                       {"largest_host_load", plan.largest_group_owner_load},
                       {"tp_pipeline_makespan", plan.tp_pipeline_makespan}};
  j["digest"] = plan.digest;
  if (include_assignment) {
    json assignment = json::array();
    for (size_t i = 0; i < plan.param_names.size(); ++i) {
      assignment.push_back({{"name", plan.param_names[i]},
                            {"dp", plan.dp_owner[i]},
                            {"tp", plan.tp_owner[i]}});
    }
    j["assignment"] = std::move(assignment);
  }
  return j;
}

}  // namespace canzona::plan
