// The simulated GPUs of one step (internal to the step simulator): one
// shard group's worth of ranks, (stage, dp, tp), each with its clocks,
// what it owns and its timeline so far; and how the ranks of a node share
// its compute units. The phases (dp_collectives.h, world_reduction.h,
// update_phases.h) advance the clocks and record the timelines.
//
// Owns: the per-GPU state (GpuState, GpuSimulation), in Plan::per_gpu
// order; it points at the step's inputs, which must outlive it.
// Thread-safety: not thread-safe; made, advanced and read by the thread
// that runs one StepSimulator::Simulate.
#ifndef CANZONA_SERVER_PLAN_SIM_SIMULATED_GPUS_H_
#define CANZONA_SERVER_PLAN_SIM_SIMULATED_GPUS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "server/plan/sim/step_inputs.h"
#include "server/plan/sim/step_simulator.h"

namespace canzona::plan::sim::internal {

// One GPU's clocks and counters while the step is simulated.
struct GpuState {
  int rank = 0;         // global rank
  double worker = 0;    // the worker thread's clock
  double dp_lane = 0;   // the DP lane's clock
  double slowdown = 1;  // sharing of the node's units by all its ranks
  int64_t stage_elements = 0;
  int64_t owned_elements = 0;    // owned parameters' local elements
  int64_t master_elements = 0;   // of those, 16-bit ones (fp32 masters)
  int64_t largest_owned = 0;     // the largest owned parameter's elements
  double dp_owned_s = 0;         // DP-owned updates at full rate
  std::vector<double> reduce_b;  // per bucket of its stage, lane seconds
  std::vector<double> gather_b;  // in gather order
  double reduced_at = 0;         // DP lane done with the reductions
  double gathers_from = 0;       // the gathers were queued
  GpuSimulation out;
};

// Adds the bar [start, end) of `phase` on `lane` to the GPU's timeline.
void AddSegment(GpuSimulation& g, Lane lane, const std::string& phase,
                double start, double end);

class SimulatedGpus {
 public:
  // Every GPU placed, with what it owns, its share of the node, its update
  // seconds and its memory; every clock at 0.
  explicit SimulatedGpus(const StepInputs& in);

  int Index(int s, int d, int t) const {
    return (s * in_.ctx.R + d) * in_.ctx.T + t;
  }
  GpuState& At(int s, int d, int t) { return gpus_[Index(s, d, t)]; }
  const GpuState& At(int s, int d, int t) const {
    return gpus_[Index(s, d, t)];
  }
  size_t size() const { return gpus_.size(); }
  GpuState& operator[](size_t i) { return gpus_[i]; }
  const GpuState& operator[](size_t i) const { return gpus_[i]; }
  std::vector<GpuState>::iterator begin() { return gpus_.begin(); }
  std::vector<GpuState>::iterator end() { return gpus_.end(); }
  std::vector<GpuState>::const_iterator begin() const { return gpus_.begin(); }
  std::vector<GpuState>::const_iterator end() const { return gpus_.end(); }

  // Bytes read + written by copying `bytes`, as seconds on this GPU.
  double Copy(const GpuState& g, double bytes) const {
    return 2 * bytes / in_.memory_bps * g.slowdown;
  }

  // Finish times of `work[k]`, run by global rank `ranks[k]`, when the
  // ranks of each node (and their mirrors in the other shard groups) all
  // start it at once and share the node's compute units.
  std::vector<double> ShareNodes(const std::vector<int>& ranks,
                                 const std::vector<double>& work) const;

 private:
  // How many ranks of a node mirror each simulated GPU on it (the other
  // shard groups run the same work at the same time).
  int Mirrors(int rank) const;

  const StepInputs& in_;
  std::vector<GpuState> gpus_;
};

}  // namespace canzona::plan::sim::internal

#endif  // CANZONA_SERVER_PLAN_SIM_SIMULATED_GPUS_H_
