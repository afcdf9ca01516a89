// The trainer's iteration around one simulated optimizer step: backward,
// the step, forward; without overlap everything in sequence, with overlap
// (GradReady / async Step / WaitParams, server/DESIGN.md 4.5) the DP lane
// reduces each bucket as backward finishes it (buckets equally spaced over
// backward) and gathers them after the update while forward consumes
// them, last bucket first, each bucket's share of forward waiting for its
// gather.
//
// Thread-safety: pure function.
#ifndef CANZONA_SERVER_PLAN_SIM_TRAINER_ITERATION_H_
#define CANZONA_SERVER_PLAN_SIM_TRAINER_ITERATION_H_

#include <vector>

#include "server/plan/sim/step_simulator.h"

namespace canzona::plan::sim {

// One GPU's step as the DP lane sees it.
struct LaneSteps {
  std::vector<double> reduce_s;  // per bucket, in reduction order
  std::vector<double> gather_s;  // per bucket, in gather order
  double update_span_s = 0;      // last reduction to first gather
  double step_s = 0;             // the whole step without overlap
};

SimOverlap SimulateIteration(const LaneSteps& lane, const SimOptions& options);

}  // namespace canzona::plan::sim

#endif  // CANZONA_SERVER_PLAN_SIM_TRAINER_ITERATION_H_
