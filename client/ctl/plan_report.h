// The HTML plan report (`canzonactl plan --html`, `canzonactl simulate
// --html`): one self-contained file (inline SVG, CSS and a few lines of
// script; nothing fetched) that shows a plan as pictures:
//   - a summary table of every strategy (makespan against the bounds,
//     balance, memory, and the simulated step when simulated);
//   - per-GPU load bars for every strategy side by side, each against the
//     proven lower bound;
//   - the simulated step per strategy (stacked phases of the slowest GPU)
//     and the detailed strategy's timeline as a Gantt chart, one row of
//     worker / DP-lane / TP-lane bars per GPU;
//   - the detailed strategy's buckets: every parameter as a segment sized
//     by its elements and coloured by its DP owner, the slice cuts drawn;
//   - its micro-groups per TP owner, as the pipeline runs them;
//   - memory per GPU (optimizer state, plus the daemon's staging when
//     simulated).
//
// Thread-safety: pure function of its input.
#ifndef CANZONA_CLIENT_CTL_PLAN_REPORT_H_
#define CANZONA_CLIENT_CTL_PLAN_REPORT_H_

#include <string>
#include <vector>

#include "server/plan/planner.h"
#include "server/plan/sim/step_simulator.h"

namespace canzona::ctl {

struct ReportStrategy {
  const plan::Plan* plan = nullptr;
  // Null when the report has no hardware profile.
  const plan::sim::StepSimulation* simulation = nullptr;
};

struct ReportInput {
  std::string title;
  std::vector<std::string> context;            // lines under the title
  const plan::PlanRequest* request = nullptr;  // the plans' request
  std::vector<ReportStrategy> strategies;      // side by side
  size_t detail = 0;  // the strategy whose cuts, groups, timeline are shown
};

std::string RenderPlanReport(const ReportInput& input);

}  // namespace canzona::ctl

#endif  // CANZONA_CLIENT_CTL_PLAN_REPORT_H_
