#include "server/plan/sim/simulation_json.h"

namespace canzona::plan::sim {
namespace {

nlohmann::json UnevenToJson(const UnevenTime& u) {
  return {{"per_root_s", u.per_root_s},
          {"padded_s", u.padded_s},
          {"cost_model_choice", NcclUnevenName(u.cost_model_choice)},
          {"measured_choice", NcclUnevenName(u.measured_choice)}};
}

}  // namespace

nlohmann::json PhasesToJson(const PhaseSeconds& phases) {
  nlohmann::json j = nlohmann::json::object();
  for (const PhaseField& f : PhaseFields()) j[f.name] = phases.*f.member;
  return j;
}

nlohmann::json SimulationToJson(const StepSimulation& sim,
                                bool include_timeline) {
  nlohmann::json j = {
      {"strategy", StrategyName(sim.strategy)},
      {"profile", sim.profile},
      {"nodes", sim.nodes},
      {"step_s", sim.step_s},
      {"slowest", sim.slowest},
      {"slowest_per_phase", PhasesToJson(sim.slowest_per_phase)}};
  nlohmann::json gpus = nlohmann::json::array();
  for (const GpuSimulation& g : sim.per_gpu) {
    nlohmann::json row = {{"stage", g.stage},
                          {"dp", g.dp},
                          {"tp", g.tp},
                          {"node", g.node},
                          {"update_s", g.update_s},
                          {"memory_bytes", g.memory_bytes},
                          {"phases", PhasesToJson(g.phases)}};
    if (include_timeline) {
      nlohmann::json bars = nlohmann::json::array();
      for (const Segment& s : g.timeline) {
        bars.push_back({{"lane", LaneName(s.lane)},
                        {"phase", s.phase},
                        {"start", s.start},
                        {"end", s.end}});
      }
      row["timeline"] = std::move(bars);
    }
    gpus.push_back(std::move(row));
  }
  j["per_gpu"] = std::move(gpus);
  nlohmann::json buckets = nlohmann::json::array();
  for (const BucketSimulation& b : sim.buckets) {
    nlohmann::json row = {{"stage", b.stage},
                          {"elements", b.elements},
                          {"slice_imbalance", b.slice_imbalance},
                          {"algorithm", b.algorithm},
                          {"reduce_s", b.reduce_s},
                          {"gather_s", b.gather_s},
                          {"cross_s", b.cross_s}};
    if (b.reduce.per_root_s > 0 || b.reduce.padded_s > 0) {
      row["nccl"] = {{"reduce", UnevenToJson(b.reduce)},
                     {"gather", UnevenToJson(b.gather)}};
    }
    buckets.push_back(std::move(row));
  }
  j["buckets"] = std::move(buckets);
  const SimOverlap& o = sim.overlap;
  j["overlap"] = {{"forward_s", o.forward_s},
                  {"backward_s", o.backward_s},
                  {"dp_comm_s", o.dp_comm_s},
                  {"update_span_s", o.update_span_s},
                  {"plain_iteration_s", o.plain_iteration_s},
                  {"plain_exposed_s", o.plain_exposed_s},
                  {"overlap_iteration_s", o.overlap_iteration_s},
                  {"overlap_exposed_s", o.overlap_exposed_s},
                  {"overlap_wait_params_s", o.overlap_wait_params_s}};
  return j;
}

}  // namespace canzona::plan::sim
