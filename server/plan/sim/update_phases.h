// The update phases of one simulated step (internal to the step
// simulator), between the world reduction and the gathers
// (step_simulator.h, phases 3 and 4): the DP-owned updates, each TP
// group's micro-group pipeline, and for sc / layerwise the redundant
// updates of TP-split matrices. All of them run on the worker (the TP
// exchanges on the TP lane).
//
// Owns: nothing past a call; it points at the step's inputs and advances
// the simulated GPUs' worker clocks, both of which must outlive it.
// Thread-safety: not thread-safe; used by the thread that runs one
// StepSimulator::Simulate.
#ifndef CANZONA_SERVER_PLAN_SIM_UPDATE_PHASES_H_
#define CANZONA_SERVER_PLAN_SIM_UPDATE_PHASES_H_

#include <vector>

#include "server/plan/planner.h"
#include "server/plan/sim/simulated_gpus.h"
#include "server/plan/sim/step_inputs.h"
#include "server/plan/sim/tp_pipeline.h"

namespace canzona::plan::sim::internal {

class UpdatePhases {
 public:
  UpdatePhases(const StepInputs& in, SimulatedGpus& gpus)
      : in_(in), gpus_(gpus) {}

  // 3. DP-owned updates; the ranks of a node share its compute units.
  void DpOwnedUpdates();
  // 4a. Each TP group's micro-group pipeline.
  void TpPipelines();
  // 4b. sc / layerwise: every TP rank gathers each TP-split matrix it owns
  // and updates it whole, one matrix after the other.
  void RedundantUpdates();

 private:
  // One TP group's micro-groups: exchanges timed, compute at full rate.
  struct TpGroup {
    int stage = 0, dp = 0;
    std::vector<PipelineGroup> groups;
  };

  TpGroup Exchanges(int s, int d, const std::vector<const MicroGroup*>& mine);
  // The ranks of a node compute the same micro-group at about the same
  // time (the exchanges keep the TP groups in step): they share the node's
  // units for it, and a rank with less to do frees its share early.
  void ShareGroupCompute(std::vector<TpGroup>& tp_groups);
  void Schedule(const TpGroup& tp_group);

  const StepInputs& in_;
  SimulatedGpus& gpus_;
};

}  // namespace canzona::plan::sim::internal

#endif  // CANZONA_SERVER_PLAN_SIM_UPDATE_PHASES_H_
