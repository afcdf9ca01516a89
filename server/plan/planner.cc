// The planner's public entry points (planner.h): strategy names and
// BuildPlan, which validates the request, builds the planning context, runs
// the chosen strategy and measures the result. The parts live in
//   planning_context.h     request validation, costs, buckets, bounds;
//   baseline_strategies.h  sc, layerwise, start_anchored, alpha;
//   cost_strategy.h        cost (per-stage solver: cost_solver.h);
//   plan_metrics.h         loads, communication, traffic, memory;
//   plan_digest.cc         the canonical assignment and its digest.
#include "server/plan/planner.h"

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"
#include "server/plan/baseline_strategies.h"
#include "server/plan/cost_strategy.h"
#include "server/plan/plan_metrics.h"
#include "server/plan/planning_context.h"

namespace canzona::plan {

absl::StatusOr<Strategy> ParseStrategy(absl::string_view name) {
  if (name == "sc") return Strategy::kSc;
  if (name == "layerwise") return Strategy::kLayerwise;
  if (name == "start_anchored") return Strategy::kStartAnchored;
  if (name == "alpha") return Strategy::kAlpha;
  if (name == "cost") return Strategy::kCost;
  return absl::InvalidArgumentError(
      absl::StrCat("strategy: unknown strategy '", name,
                   "' (sc, layerwise, start_anchored, alpha, cost)"));
}

const char* StrategyName(Strategy strategy) {
  switch (strategy) {
    case Strategy::kSc:
      return "sc";
    case Strategy::kLayerwise:
      return "layerwise";
    case Strategy::kStartAnchored:
      return "start_anchored";
    case Strategy::kAlpha:
      return "alpha";
    case Strategy::kCost:
      return "cost";
  }
  return "unknown";
}

std::vector<Strategy> AllStrategies() {
  return {Strategy::kSc, Strategy::kLayerwise, Strategy::kStartAnchored,
          Strategy::kAlpha, Strategy::kCost};
}

absl::StatusOr<Plan> BuildPlan(const PlanRequest& request) {
  CANZONA_RETURN_IF_ERROR(internal::Validate(request));
  const internal::Context ctx = internal::MakeContext(request);
  internal::Assignment a;
  switch (request.strategy) {
    case Strategy::kSc:
      a = internal::PlanSc(ctx);
      break;
    case Strategy::kLayerwise:
      a = internal::PlanLayerwise(ctx);
      break;
    case Strategy::kStartAnchored:
      a = internal::PlanStartAnchored(ctx);
      break;
    case Strategy::kAlpha:
      a = internal::PlanAlpha(ctx, request.alpha);
      break;
    case Strategy::kCost:
      a = internal::PlanCost(ctx);
      break;
  }
  return internal::FinalizePlan(ctx, request.strategy, std::move(a));
}

}  // namespace canzona::plan
