// The world reduction of one simulated step (internal to the step
// simulator): the passes over the owned gradients before the step's one
// world all-reduce, and after the updates the pass that sizes the update
// for the next step's (step_simulator.h, phase 2). Both run on the worker
// and count as `world_reduce`.
//
// Owns: nothing; it points at the step's inputs and advances the
// simulated GPUs' worker clocks, both of which must outlive it.
// Thread-safety: not thread-safe; used by the thread that runs one
// StepSimulator::Simulate.
#ifndef CANZONA_SERVER_PLAN_SIM_WORLD_REDUCTION_H_
#define CANZONA_SERVER_PLAN_SIM_WORLD_REDUCTION_H_

#include "server/plan/sim/simulated_gpus.h"
#include "server/plan/sim/step_inputs.h"

namespace canzona::plan::sim::internal {

class WorldReduction {
 public:
  WorldReduction(const StepInputs& in, SimulatedGpus& gpus)
      : in_(in), gpus_(gpus) {}

  // 2. Finiteness and sum-of-squares passes over the owned gradients (8 B
  // read per element), then the step's one world all-reduce of five floats
  // (non-finite flag, squared norm, the previous update's squared size,
  // the clip norm and how many ranks clip).
  void Reduce();

  // The update's size for the next step's reduction: each counted
  // parameter's old values copied aside (8 B per element), the difference
  // (12 B) and its sum of squares (4 B): 24 B per owned element, no
  // collective (it rides on the next step's world all-reduce).
  void UpdateSizePass();

 private:
  const StepInputs& in_;
  SimulatedGpus& gpus_;
};

}  // namespace canzona::plan::sim::internal

#endif  // CANZONA_SERVER_PLAN_SIM_WORLD_REDUCTION_H_
