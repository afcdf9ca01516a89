// The step simulator: a plan (planner.h) on a machine (hardware_profile.h)
// -> the optimizer step, phase by phase, per GPU.
//
//   CANZONA_ASSIGN_OR_RETURN(StepSimulator sim,
//                            StepSimulator::Create(request, profile));
//   CANZONA_ASSIGN_OR_RETURN(Plan plan, BuildPlan(request));
//   CANZONA_ASSIGN_OR_RETURN(StepSimulation s, sim.Simulate(plan, {}));
//
// The step is the engine's (server/DESIGN.md section 4), every phase timed
// with the planner's own pieces: the per-parameter work of its CostModel at
// the profile's rates, its buckets, cuts, owners, TP owners and micro-groups,
// and the NCCL cost model's per-root vs padded choice (link_model.h). Per
// GPU, in order:
//   1. DP lane, each bucket in order: the staging copy, the reduce-scatter-v
//      in the shard group (per-root or padded on NCCL, all-to-all-v on
//      Gloo; sc / layerwise: reduce-scatter + all-gather of even slices),
//      and with S < dp the all-reduce of the slice across the groups.
//      Then the average (`reduce_scatter`, as PhaseTimes counts it).
//   2. The world reduction: finiteness and norm passes, one world
//      all-reduce of five floats; after the updates, the pass that sizes
//      the update for the next step's reduction (`world`: PhaseTimes has
//      no field for them, they are in its total).
//   3. DP-owned updates of owned, not TP-owned parameters (`local_compute`).
//   4. The TP micro-group pipeline (tp_pipeline.h), or for sc / layerwise
//      every TP rank gathering each TP-split matrix and updating it whole
//      (`tp_gather`, `tp_compute`, `tp_scatter`).
//   5. DP lane, last bucket first: the all-gather-v and the copy back
//      (`all_gather`).
// Collectives start when the last member of their group reaches them;
// ranks of a node share its compute units (compute_sharing.h) and a capped
// tier's bandwidth. Traffic counts the parameters' dtype on the DP
// collectives and the daemon's fp32 staging inside it (TP exchanges,
// copies). With SimOptions::overlap the reductions run under backward and
// the gathers under forward (GradReady / WaitParams), and the result says
// what the trainer still waits for.
//
// What it leaves out: the trainer-side arrival skew (PhaseTimes.wait),
// gRPC and other per-call service overhead, contention between the DP
// lane, the TP lane and the updates beyond the node-wide caps, and NCCL's
// protocol switches (LL / LL128 / Simple) beyond the per-hop latency.
//
// Thread-safety: a StepSimulator is immutable after Create; Simulate may
// run concurrently.
#ifndef CANZONA_SERVER_PLAN_SIM_STEP_SIMULATOR_H_
#define CANZONA_SERVER_PLAN_SIM_STEP_SIMULATOR_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/names/step_phases.h"
#include "server/plan/planner.h"
#include "server/plan/sim/hardware_profile.h"
#include "server/plan/sim/link_model.h"

namespace canzona::plan::internal {
struct Context;
}

namespace canzona::plan::sim {

struct SimOptions {
  // The trainer's compute around the step, per iteration (seconds).
  double forward_s = 0;
  double backward_s = 0;
  // Also model GradReady / async Step / WaitParams (SimOverlap).
  bool overlap = false;
};

// The daemon's phases (proto/names/step_phases.h); the simulator models
// all but "wait" (and the DP communication fields), which stay 0.
using ::canzona::PhaseSeconds;

// The names and members of PhaseSeconds the simulator models, in step
// order (reports, JSON): kStepPhases without "wait".
struct PhaseField {
  const char* name;
  double PhaseSeconds::*member;
};
const std::vector<PhaseField>& PhaseFields();

// Where a segment of a GPU's timeline runs.
enum class Lane { kWorker, kDp, kTp };
const char* LaneName(Lane lane);

// One bar of the Gantt chart.
struct Segment {
  Lane lane = Lane::kWorker;
  std::string phase;  // a PhaseFields() name, or "cross_all_reduce"
  double start = 0;
  double end = 0;
};

struct GpuSimulation {
  int stage = 0;
  int dp = 0;  // position in the shard group
  int tp = 0;
  int node = 0;
  PhaseSeconds phases;
  double update_s = 0;      // optimizer compute at full rate (plan's seconds)
  double memory_bytes = 0;  // optimizer state + owned fp32 buffers
  std::vector<Segment> timeline;
};

// One bucket's DP collectives (the busiest position's figures).
struct BucketSimulation {
  int stage = 0;
  int64_t elements = 0;
  double slice_imbalance = 1;  // max / mean slice (1: unsliced)
  std::string algorithm;       // "per_root" | "padded" | "alltoallv" | ...
  UnevenTime reduce;           // NCCL sliced buckets only
  UnevenTime gather;
  double reduce_s = 0;  // the collective alone
  double gather_s = 0;
  double cross_s = 0;  // all-reduce across shard groups (S < dp)
};

// The trainer's iteration around the step (the slowest GPU's schedule).
struct SimOverlap {
  double forward_s = 0;
  double backward_s = 0;
  double dp_comm_s = 0;  // reductions + gathers, on the DP lane
  // From the last reduction to the first gather (world reductions, the
  // updates, the TP pipeline): what overlap cannot hide.
  double update_span_s = 0;
  double plain_iteration_s = 0;  // backward + step + forward
  double plain_exposed_s = 0;    // DP communication the trainer waits for
  double overlap_iteration_s = 0;
  double overlap_exposed_s = 0;
  double overlap_wait_params_s = 0;  // of which in WaitParams
};

struct StepSimulation {
  Strategy strategy = Strategy::kCost;
  std::string profile;
  int nodes = 1;
  std::vector<GpuSimulation> per_gpu;  // Plan::per_gpu order
  int slowest = 0;                     // index of the largest total
  PhaseSeconds slowest_per_phase;      // each phase's max over GPUs
  std::vector<BucketSimulation> buckets;
  SimOverlap overlap;
  double step_s = 0;  // the slowest GPU's total
};

class StepSimulator {
 public:
  // The request the plans are built from (its parameters and layout; its
  // cost model only plans, the profile's rates time the work).
  static absl::StatusOr<StepSimulator> Create(const PlanRequest& request,
                                              const HardwareProfile& profile);
  ~StepSimulator();
  StepSimulator(StepSimulator&&) noexcept;
  StepSimulator& operator=(StepSimulator&&) noexcept;

  // `plan` must come from a request with the same parameters and layout.
  absl::StatusOr<StepSimulation> Simulate(const Plan& plan,
                                          const SimOptions& options) const;

  const HardwareProfile& profile() const { return profile_; }

 private:
  StepSimulator() = default;

  std::unique_ptr<PlanRequest> request_;  // the context points into it
  std::unique_ptr<plan::internal::Context> context_;
  HardwareProfile profile_;
  std::vector<double> update_s_;  // per parameter, whole update, full rate
};

}  // namespace canzona::plan::sim

#endif  // CANZONA_SERVER_PLAN_SIM_STEP_SIMULATOR_H_
