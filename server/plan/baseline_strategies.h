// The baseline strategies: sc, layerwise, start_anchored and alpha
// (planner.h describes each). They are the reference points the cost
// strategy is measured against, and start_anchored and alpha are also the
// cost strategy's fallback candidates (cost_strategy.h).
//
// Owns: nothing; each function returns a fresh Assignment.
// Thread-safety: pure functions of the context.
// Why separate: they reproduce published or released behaviour (Megatron's
// equal slices, Canzona's alpha-greedy cuts and greedy-rollback
// micro-groups) and must stay faithful to it, while the cost strategy is
// ours and changes freely.
#ifndef CANZONA_SERVER_PLAN_BASELINE_STRATEGIES_H_
#define CANZONA_SERVER_PLAN_BASELINE_STRATEGIES_H_

#include "server/plan/planning_context.h"

namespace canzona::plan::internal {

// Every DP and TP rank updates everything; gradients all-reduced.
Assignment PlanSc(const Context& ctx);
// Whole parameters dealt to DP ranks by LPT on cost, buckets ignored.
Assignment PlanLayerwise(const Context& ctx);
// Megatron's equal bucket slices; TP micro-groups of TP consecutive TP-owned
// matrices, TP owners round-robin.
Assignment PlanStartAnchored(const Context& ctx);
// Canzona's alpha-balanced greedy cuts, kept per stage only where they beat
// start_anchored's DP balance; greedy-rollback micro-groups.
Assignment PlanAlpha(const Context& ctx, double alpha);

}  // namespace canzona::plan::internal

#endif  // CANZONA_SERVER_PLAN_BASELINE_STRATEGIES_H_
