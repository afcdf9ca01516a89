// JSON form of a step simulation (`canzonactl simulate --json`).
//
// Keys (seconds throughout):
//   strategy, profile, nodes, step_s, slowest (index into per_gpu),
//   slowest_per_phase {reduce_scatter, world, local_compute, tp_gather,
//     tp_compute, tp_scatter, all_gather, total} (each phase's max over
//     GPUs: what `canzonactl bench step` reports per phase),
//   per_gpu [{stage, dp, tp, node, update_s, memory_bytes, phases {...},
//     timeline [{lane, phase, start, end}] (with include_timeline)}],
//   buckets [{stage, elements, slice_imbalance, algorithm, reduce_s,
//     gather_s, cross_s, nccl {reduce|gather: {per_root_s, padded_s,
//     cost_model_choice, measured_choice}} (NCCL sliced buckets)}],
//   overlap {forward_s, backward_s, dp_comm_s, update_span_s,
//     plain_iteration_s,
//     plain_exposed_s, overlap_iteration_s, overlap_exposed_s,
//     overlap_wait_params_s}.
//
// Thread-safety: pure functions.
#ifndef CANZONA_SERVER_PLAN_SIM_SIMULATION_JSON_H_
#define CANZONA_SERVER_PLAN_SIM_SIMULATION_JSON_H_

#include "nlohmann/json.hpp"
#include "server/plan/sim/step_simulator.h"

namespace canzona::plan::sim {

nlohmann::json PhasesToJson(const PhaseSeconds& phases);
nlohmann::json SimulationToJson(const StepSimulation& sim,
                                bool include_timeline);

}  // namespace canzona::plan::sim

#endif  // CANZONA_SERVER_PLAN_SIM_SIMULATION_JSON_H_
