// The DP collectives of one simulated step (internal to the step
// simulator): on each DP group's lane, every bucket's reduce-scatter (and
// all-reduce across shard groups) before the updates, and every bucket's
// all-gather after them (step_simulator.h, phases 1 and 5).
//
// Owns: the per-bucket figures (BucketSimulation) until TakeBuckets; it
// points at the step's inputs and advances the simulated GPUs' DP lanes,
// both of which must outlive it.
// Thread-safety: not thread-safe; used by the thread that runs one
// StepSimulator::Simulate.
#ifndef CANZONA_SERVER_PLAN_SIM_DP_COLLECTIVES_H_
#define CANZONA_SERVER_PLAN_SIM_DP_COLLECTIVES_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "server/plan/sim/link_model.h"
#include "server/plan/sim/simulated_gpus.h"
#include "server/plan/sim/step_inputs.h"
#include "server/plan/sim/step_simulator.h"

namespace canzona::plan::sim::internal {

class DpCollectives {
 public:
  DpCollectives(const StepInputs& in, SimulatedGpus& gpus)
      : in_(in), gpus_(gpus) {}

  // 1. Every bucket's reduction, in bucket order, per DP group (s, t).
  void ReduceBuckets();
  // 5. Gathers, last bucket first, per DP group; the copy back.
  void GatherBuckets();

  std::vector<BucketSimulation> TakeBuckets() { return std::move(buckets_); }

 private:
  int ElemBytes(int i) const { return in_.ctx.items[i].elem_bytes; }
  // Slice sizes (local elements) of bucket b over the shard group.
  std::vector<int64_t> Counts(int b) const;
  int64_t OwnedSlices(const GpuState& g) const;
  // Layerwise: one all-gather-v of every rank's owned parameters, packed.
  double LayerwiseGather(int s, int t, const Link& link);

  const StepInputs& in_;
  SimulatedGpus& gpus_;
  std::vector<BucketSimulation> buckets_;
};

}  // namespace canzona::plan::sim::internal

#endif  // CANZONA_SERVER_PLAN_SIM_DP_COLLECTIVES_H_
