#include "server/plan/sim/step_inputs.h"

namespace canzona::plan::sim::internal {

StepInputs::StepInputs(const plan::internal::Context& ctx,
                       const HardwareProfile& profile,
                       const std::vector<double>& update_s, const Plan& plan,
                       const SimOptions& options)
    : ctx(ctx),
      profile(profile),
      update_s(update_s),
      plan(plan),
      options(options),
      place(plan.layout, profile),
      memory_bps(profile.memory_gbps * 1e9),
      sliced(!plan.buckets.empty() && !plan.buckets[0].cuts.empty()) {}

Link StepInputs::LinkOf(const std::vector<int>& ranks) const {
  int here = 0;
  for (int r : ranks) here += place.Node(r) == place.Node(ranks.front());
  return MakeLink(profile, place.Tier(ranks), here,
                  place.RanksOnNode(ranks.front()));
}

}  // namespace canzona::plan::sim::internal
