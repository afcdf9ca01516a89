#include "server/metrics/canzona_metrics.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/names/step_phases.h"

namespace canzona {
namespace {

// "Seconds per optimizer step phase (reduce_scatter, ..., total)." from the
// one list of phases.
std::string StepPhaseHelp() {
  return absl::StrCat(
      "Seconds per optimizer step phase (",
      absl::StrJoin(kStepPhases, ", ",
                    [](std::string* out, const StepPhase& phase) {
                      out->append(phase.name);
                    }),
      ").");
}

}  // namespace

std::vector<double> StepPhaseBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
}

CanzonaMetrics CanzonaMetrics::Register(MetricsRegistry* r) {
  CanzonaMetrics m;
  m.step_phase_seconds =
      r->AddHistogram("canzona_step_phase_seconds", StepPhaseHelp(),
                      {"job", "rank", "phase"}, StepPhaseBuckets());
  m.steps_total = r->AddCounter("canzona_steps_total",
                                "Optimizer steps finished (skipped included).",
                                {"job", "rank"});
  m.steps_skipped_total = r->AddCounter(
      "canzona_steps_skipped_total",
      "Optimizer steps skipped for non-finite gradients.", {"job", "rank"});
  m.step_host_waits_total = r->AddCounter(
      "canzona_step_host_waits_total",
      "Host round trips of the rank's steps: waits for its GPU between a "
      "step's start and its answer (StepResponse.host_waits).",
      {"job", "rank"});
  m.step_pageable_copies_total = r->AddCounter(
      "canzona_step_pageable_copies_total",
      "Copies between host memory and the rank's GPU whose host side was "
      "pageable, a bounce buffer and a wait in the driver each; 0 unless "
      "cudaHostRegister was refused (StepResponse.pageable_copies).",
      {"job", "rank"});
  m.rank_compute_flops =
      r->AddGauge("canzona_rank_compute_flops",
                  "The plan's optimizer flops per step on this rank's GPU.",
                  {"job", "rank"});
  m.plan_max_over_mean = r->AddGauge(
      "canzona_plan_max_over_mean",
      "The plan's load imbalance: max over mean per-GPU load.", {"job"});
  m.plan_makespan_over_lb =
      r->AddGauge("canzona_plan_makespan_over_lb",
                  "The plan's makespan over its lower bound.", {"job"});
  m.comm_sent_bytes_total = r->AddCounter(
      "canzona_comm_sent_bytes_total",
      "Bytes sent by this rank by collective kind (reduce_scatter, "
      "all_gather, all_reduce, tp_all_to_all).",
      {"job", "rank", "kind"});
  m.tp_overlap_ratio = r->AddGauge(
      "canzona_tp_overlap_ratio",
      "Last step's TP comm time hidden behind compute over TP comm time "
      "(micro-group pipeline; 0 without TP groups).",
      {"job", "rank"});
  m.dp_comm_seconds_total = r->AddCounter(
      "canzona_dp_comm_seconds_total",
      "Time the rank's communication thread spent in DP gradient and "
      "parameter collectives (reduce-scatter, cross-group all-reduce, "
      "all-gather).",
      {"job", "rank"});
  m.dp_comm_exposed_seconds_total = r->AddCounter(
      "canzona_dp_comm_exposed_seconds_total",
      "Part of the DP communication time the trainer waited for (in Step or "
      "WaitParams); the rest was hidden behind backward and forward.",
      {"job", "rank"});
  m.registered_parameters =
      r->AddGauge("canzona_registered_parameters",
                  "Parameters registered by the job.", {"job"});
  m.optimizer_state_bytes =
      r->AddGauge("canzona_optimizer_state_bytes",
                  "Optimizer state bytes held for this rank.", {"job", "rank"});
  m.rank_memory_bytes = r->AddGauge(
      "canzona_rank_memory_bytes",
      "The daemon's memory for this rank by kind: master (fp32 master "
      "weights of what it owns), state (optimizer state it owns), buffers "
      "(owned gradients, bucket staging, TP and whole-matrix buffers, "
      "communicator scratch).",
      {"job", "rank", "kind"});
  m.rank_pageable_host_bytes = r->AddGauge(
      "canzona_rank_pageable_host_bytes",
      "Host memory of this rank that copies to or from a GPU but that the "
      "driver refused to page-lock at registration, almost always the "
      "daemon's memlock limit (RegisterResponse.pageable_host_bytes); 0 "
      "where everything was locked or nothing copies to a GPU.",
      {"job", "rank"});
  m.grad_norm = r->AddGauge(
      "canzona_grad_norm",
      "Last step's global L2 norm of the averaged gradient, before clipping.",
      {"job", "rank"});
  m.clip_factor =
      r->AddGauge("canzona_clip_factor",
                  "Last step's gradient clipping factor (1: not clipped).",
                  {"job", "rank"});
  m.rank_device_info = r->AddGauge(
      "canzona_rank_device_info",
      "1 for each rank working with a GPU (cuda updates or CUDA IPC "
      "buffers): the daemon's CUDA device index and the GPU's PCI bus id.",
      {"job", "rank", "device", "pci_bus_id"});
  m.rpc_requests_total = r->AddCounter(
      "canzona_rpc_requests_total",
      "gRPC requests by method and status code name.", {"method", "code"});
  m.build_info =
      r->AddGauge("canzona_build_info", "Build and configuration (value 1).",
                  {"version", "backend", "comm"});
  return m;
}

}  // namespace canzona
