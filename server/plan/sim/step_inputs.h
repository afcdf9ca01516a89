// What one simulated step reads and never changes (internal to the step
// simulator): the planner's context, the plan, the machine and where the
// ranks sit on it, the updates' seconds at full rate, and the questions
// every phase asks of them (who owns a parameter, which link a group of
// ranks talks over).
//
// Owns: its Placement; it points at the context, profile, update times,
// plan and options it is made from (StepSimulator::Simulate's arguments
// and members), which must outlive it.
// Thread-safety: immutable after construction; made and read by the thread
// that runs one StepSimulator::Simulate.
// Why separate: every phase of the step (simulated_gpus.h,
// dp_collectives.h, world_reduction.h, update_phases.h) reads it.
#ifndef CANZONA_SERVER_PLAN_SIM_STEP_INPUTS_H_
#define CANZONA_SERVER_PLAN_SIM_STEP_INPUTS_H_

#include <vector>

#include "server/plan/planner.h"
#include "server/plan/planning_context.h"
#include "server/plan/sim/hardware_profile.h"
#include "server/plan/sim/link_model.h"
#include "server/plan/sim/placement.h"
#include "server/plan/sim/step_simulator.h"

namespace canzona::plan::sim::internal {

// The daemon stages and exchanges fp32 inside itself (TP fragments,
// copies); only the DP collectives travel in the parameters' dtype.
inline constexpr double kStagingBytes = 4;

struct StepInputs {
  StepInputs(const plan::internal::Context& ctx, const HardwareProfile& profile,
             const std::vector<double>& update_s, const Plan& plan,
             const SimOptions& options);

  // The link of a group whose every node's ranks all communicate at once.
  Link LinkOf(const std::vector<int>& ranks) const;
  // Owner of item i is (s, d): dp_owner -1 means every DP position.
  bool Owns(int i, int d) const {
    return plan.dp_owner[i] < 0 || plan.dp_owner[i] == d;
  }
  bool Redundant(int i) const {
    return ctx.items[i].tp_owned && plan.tp_owner[i] < 0;
  }

  const plan::internal::Context& ctx;
  const HardwareProfile& profile;
  const std::vector<double>& update_s;  // per parameter, whole, full rate
  const Plan& plan;
  const SimOptions& options;
  const Placement place;
  const double memory_bps;
  const bool sliced;  // the DP buckets are cut into per-owner slices
};

}  // namespace canzona::plan::sim::internal

#endif  // CANZONA_SERVER_PLAN_SIM_STEP_INPUTS_H_
