// The canzonad metric families of server/metrics/README.md (the contract
// with the dashboards and rules): names, types, help and label names in one
// place. Registration is get-or-create, so the engine, the rpc layer and
// main() each call it on the shared registry.
//
//   MetricsRegistry registry;
//   const CanzonaMetrics m = CanzonaMetrics::Register(&registry);
//   m.steps_total->WithLabels({"job1", "0"})->Increment();
//
// Thread-safety: the struct is a set of pointers into the registry; see
// MetricsRegistry.
#ifndef CANZONA_SERVER_METRICS_CANZONA_METRICS_H_
#define CANZONA_SERVER_METRICS_CANZONA_METRICS_H_

#include <vector>

#include "server/metrics/registry.h"

namespace canzona {

struct CanzonaMetrics {
  // {job, rank, phase}; phases as in v1::PhaseTimes.
  Family<Histogram>* step_phase_seconds = nullptr;
  Family<Counter>* steps_total = nullptr;            // {job, rank}
  Family<Counter>* steps_skipped_total = nullptr;    // {job, rank}
  Family<Counter>* step_host_waits_total = nullptr;  // {job, rank}
  Family<Counter>* step_pageable_copies_total = nullptr;  // {job, rank}
  Family<Gauge>* rank_compute_flops = nullptr;       // {job, rank}
  Family<Gauge>* plan_max_over_mean = nullptr;       // {job}
  Family<Gauge>* plan_makespan_over_lb = nullptr;    // {job}
  Family<Counter>* comm_sent_bytes_total = nullptr;  // {job, rank, kind}
  Family<Gauge>* tp_overlap_ratio = nullptr;         // {job, rank}
  Family<Counter>* dp_comm_seconds_total = nullptr;  // {job, rank}
  Family<Counter>* dp_comm_exposed_seconds_total = nullptr;  // {job, rank}
  Family<Gauge>* registered_parameters = nullptr;            // {job}
  Family<Gauge>* optimizer_state_bytes = nullptr;            // {job, rank}
  Family<Gauge>* rank_memory_bytes = nullptr;  // {job, rank, kind}
  Family<Gauge>* rank_pageable_host_bytes = nullptr;  // {job, rank}
  Family<Gauge>* grad_norm = nullptr;          // {job, rank}
  Family<Gauge>* clip_factor = nullptr;        // {job, rank}
  // 1 per rank on a GPU: {job, rank, device, pci_bus_id}.
  Family<Gauge>* rank_device_info = nullptr;
  Family<Counter>* rpc_requests_total = nullptr;  // {method, code}
  Family<Gauge>* build_info = nullptr;            // {version, backend, comm}

  static CanzonaMetrics Register(MetricsRegistry* registry);
};

// Upper bounds of canzona_step_phase_seconds: 100 us .. 60 s.
std::vector<double> StepPhaseBuckets();

}  // namespace canzona

#endif  // CANZONA_SERVER_METRICS_CANZONA_METRICS_H_
