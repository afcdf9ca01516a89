// Plan metrics: turns a strategy's Assignment into the public Plan, with
// the per-GPU loads and optimizer state, the load summary against the lower
// bounds, the DP and TP communication per GPU per step (CommStats), the DP
// traffic per link tier (TierTraffic), the micro-group figures and the
// digest (plan_digest.cc).
//
// Owns: nothing; the Plan it returns owns everything it holds.
// Thread-safety: pure function of its arguments.
// Why separate: every strategy is graded by the same accounting; keeping it
// apart from the strategies means no strategy can bend its own figures.
#ifndef CANZONA_SERVER_PLAN_PLAN_METRICS_H_
#define CANZONA_SERVER_PLAN_PLAN_METRICS_H_

#include <vector>

#include "server/plan/planner.h"
#include "server/plan/planning_context.h"

namespace canzona::plan::internal {

// The Plan of assignment `a` made by `strategy`.
Plan FinalizePlan(const Context& ctx, Strategy strategy, Assignment a);

// Per-GPU loads and state of an assignment (dp_owner -1: on every DP rank;
// tp_owner -1: on every TP rank), indexed as Plan::per_gpu. The cost
// strategy compares its candidates by this same accounting.
std::vector<GpuLoad> PerGpuLoads(const Context& ctx,
                                 const std::vector<int>& dp_owner,
                                 const std::vector<int>& tp_owner);

}  // namespace canzona::plan::internal

#endif  // CANZONA_SERVER_PLAN_PLAN_METRICS_H_
