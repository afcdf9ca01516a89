// The cost strategy (ours): per stage, the CostSolver's cuts and TP owners;
// the alpha and start_anchored plans, their TP owners re-assigned with LPT on
// the true cost, as candidates; the best of them by makespan, then slice
// balance; and micro-groups balanced across TP owners so the TP pipeline stays
// short.
//
// Owns: nothing; PlanCost returns a fresh Assignment.
// Thread-safety: pure function of the context.
// Why separate: the solver (cost_solver.h) optimizes one stage; choosing
// among candidates and forming micro-groups is the strategy around it.
#ifndef CANZONA_SERVER_PLAN_COST_STRATEGY_H_
#define CANZONA_SERVER_PLAN_COST_STRATEGY_H_

#include "server/plan/planning_context.h"

namespace canzona::plan::internal {

// Never worse in makespan than the alpha and start_anchored plans.
Assignment PlanCost(const Context& ctx);

}  // namespace canzona::plan::internal

#endif  // CANZONA_SERVER_PLAN_COST_STRATEGY_H_
