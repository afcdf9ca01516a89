#include "server/plan/sim/step_simulator.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "kernels/base/status_macros.h"
#include "server/plan/planning_context.h"
#include "server/plan/sim/dp_collectives.h"
#include "server/plan/sim/simulated_gpus.h"
#include "server/plan/sim/step_inputs.h"
#include "server/plan/sim/trainer_iteration.h"
#include "server/plan/sim/update_phases.h"
#include "server/plan/sim/world_reduction.h"

namespace canzona::plan::sim {
namespace {

using internal::DpCollectives;
using internal::GpuState;
using internal::SimulatedGpus;
using internal::StepInputs;
using internal::UpdatePhases;
using internal::WorldReduction;

// One StepSimulator::Simulate call: the step's phases (step_simulator.h,
// 1 to 5) in the engine's order over one set of simulated GPUs, then the
// result.
//
// Owns: the step's inputs, the simulated GPUs and the phases; it points at
// Simulate's arguments and the simulator's members, which outlive it.
// Thread-safety: not thread-safe; made, run once and dropped by the thread
// that calls StepSimulator::Simulate.
class SimulatedStep {
 public:
  SimulatedStep(const plan::internal::Context& ctx,
                const HardwareProfile& profile,
                const std::vector<double>& update_s, const Plan& plan,
                const SimOptions& options)
      : in_(ctx, profile, update_s, plan, options),
        gpus_(in_),
        dp_(in_, gpus_),
        world_(in_, gpus_),
        updates_(in_, gpus_) {}

  // Each phase starts from the clocks the previous one left on every GPU
  // (gpus_ was set up when made).
  StepSimulation Simulate() {
    dp_.ReduceBuckets();
    world_.Reduce();
    updates_.DpOwnedUpdates();
    updates_.TpPipelines();
    updates_.RedundantUpdates();
    world_.UpdateSizePass();
    dp_.GatherBuckets();
    return Finish();
  }

 private:
  StepSimulation Finish() {
    StepSimulation sim;
    sim.strategy = in_.plan.strategy;
    sim.profile = in_.profile.name;
    sim.nodes = in_.place.nodes();
    size_t slowest = 0;
    for (size_t i = 0; i < gpus_.size(); ++i) {
      const PhaseSeconds& p = gpus_[i].out.phases;
      for (const PhaseField& f : PhaseFields()) {
        sim.slowest_per_phase.*f.member =
            std::max(sim.slowest_per_phase.*f.member, p.*f.member);
      }
      if (p.total > gpus_[slowest].out.phases.total) slowest = i;
    }
    sim.slowest = static_cast<int>(slowest);
    sim.step_s = gpus_[slowest].out.phases.total;
    const GpuState& g = gpus_[slowest];
    sim.overlap =
        SimulateIteration({g.reduce_b, g.gather_b,
                           g.gathers_from - g.reduced_at, g.out.phases.total},
                          in_.options);
    sim.buckets = dp_.TakeBuckets();
    for (GpuState& g : gpus_) sim.per_gpu.push_back(std::move(g.out));
    return sim;
  }

  const StepInputs in_;
  SimulatedGpus gpus_;
  DpCollectives dp_;
  WorldReduction world_;
  UpdatePhases updates_;
};

}  // namespace

const std::vector<PhaseField>& PhaseFields() {
  static const std::vector<PhaseField> fields = [] {
    std::vector<PhaseField> modelled;
    for (const StepPhase& phase : kStepPhases) {
      if (phase.value == &PhaseSeconds::wait) continue;
      modelled.push_back({phase.name, phase.value});
    }
    return modelled;
  }();
  return fields;
}

const char* LaneName(Lane lane) {
  switch (lane) {
    case Lane::kWorker:
      return "worker";
    case Lane::kDp:
      return "dp";
    case Lane::kTp:
      return "tp";
  }
  return "worker";
}

StepSimulator::~StepSimulator() = default;
StepSimulator::StepSimulator(StepSimulator&&) noexcept = default;
StepSimulator& StepSimulator::operator=(StepSimulator&&) noexcept = default;

absl::StatusOr<StepSimulator> StepSimulator::Create(
    const PlanRequest& request, const HardwareProfile& profile) {
  CANZONA_RETURN_IF_ERROR(plan::internal::Validate(request));
  StepSimulator sim;
  sim.request_ = std::make_unique<PlanRequest>(request);
  sim.context_ = std::make_unique<plan::internal::Context>(
      plan::internal::MakeContext(*sim.request_));
  sim.profile_ = profile;
  // The planner's cost model, timed at the profile's rates.
  const CostModel timed(request.cost_model.options(), profile.rates);
  for (const ParamSpec& p : request.parameters) {
    sim.update_s_.push_back(WorkOf(timed, p).seconds);
  }
  return sim;
}

absl::StatusOr<StepSimulation> StepSimulator::Simulate(
    const Plan& plan, const SimOptions& options) const {
  const plan::internal::Context& ctx = *context_;
  if (plan.param_names.size() != ctx.items.size() || plan.layout.pp != ctx.P ||
      plan.layout.dp != ctx.D || plan.layout.tp != ctx.T ||
      plan.shard_group_size != ctx.R ||
      plan.buckets.size() != ctx.buckets.size() ||
      plan.per_gpu.size() != static_cast<size_t>(ctx.P) * ctx.R * ctx.T) {
    return absl::InvalidArgumentError(
        "plan: not a plan of the simulator's request (parameters, layout or "
        "shard groups differ)");
  }
  if (!(options.forward_s >= 0) || !(options.backward_s >= 0)) {
    return absl::InvalidArgumentError(
        "forward and backward times must be >= 0");
  }
  return SimulatedStep(ctx, profile_, update_s_, plan, options).Simulate();
}

}  // namespace canzona::plan::sim
