// One rank's optimizer step once every local rank has called Step(k), in
// named phases (server/DESIGN.md section 4):
//   1. the DP gradient sums (the DP lane started them at GradReady or
//      Step) in the owned gradients, averaged and unscaled;
//   2. the step's one world sum: the non-finite check, the squared
//      gradient norm, the previous step's squared update (update_rms) and
//      the clip norm;
//   3. clipping by the global norm;
//   4. the DP-owned updates of owned parameters;
//   5. the TP micro-group pipeline (TP-owned matrices), or every TP rank
//      gathering whole matrices and updating them redundantly (sc,
//      layerwise); each update counted once job-wide adds its squared size
//      to the next step's update RMS;
//   6. the DP gathers queued on the DP lane (awaited unless async_params).
//
//   CANZONA_RETURN_IF_ERROR(RunRankStep(rank, rank.rt->plan(), context,
//                                       request, &result));
//
// Thread-safety: the rank's worker only.
#ifndef CANZONA_SERVER_ENGINE_RANK_STEP_H_
#define CANZONA_SERVER_ENGINE_RANK_STEP_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/engine/job.h"
#include "server/engine/job_plan.h"
#include "server/engine/rank_step_messages.h"

namespace canzona {

struct StepContext {
  std::string job_id;        // for logs
  int dp_size = 1;           // the job's DP degree (the gradient average)
  int world = 1;             // the job's ranks (the world reduction)
  double max_grad_norm = 0;  // the job's clipping (a Step may override)
  absl::Duration timeout = absl::Seconds(60);
};

absl::Status RunRankStep(LocalRank& rank, const JobPlan& jp,
                         const StepContext& context,
                         const RankStepRequest& request,
                         RankStepResult* result);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_RANK_STEP_H_
