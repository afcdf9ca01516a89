// One rank's optimizer step once every local rank has called Step(k), in
// named phases (server/DESIGN.md section 4):
//   1. the DP gradient sums (the DP lane started them at GradReady or
//      Step), averaged and unscaled: my slice, or the whole bucket;
//   2. the non-finite check and the squared gradient norm, one world sum;
//   3. the local updates of owned parameters;
//   4. the TP micro-group pipeline (hosted matrices), or every TP rank
//      gathering whole matrices and updating them redundantly (sc,
//      layerwise);
//   5. the update RMS over every element once, one world sum;
//   6. the DP gathers queued on the DP lane (awaited unless async_params).
//
//   CANZONA_RETURN_IF_ERROR(RunRankStep(rank, *plan, context, request,
//                                       &response));
//
// Thread-safety: the rank's worker only.
#ifndef CANZONA_SERVER_ENGINE_RANK_STEP_H_
#define CANZONA_SERVER_ENGINE_RANK_STEP_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "server/engine/job.h"
#include "server/engine/job_plan.h"

namespace canzona {

struct StepContext {
  std::string job_id;  // for logs
  int dp_size = 1;     // the job's DP degree (the gradient average)
  absl::Duration timeout = absl::Seconds(60);
};

absl::Status RunRankStep(LocalRank& rank, const JobPlan& jp,
                         const StepContext& context,
                         const canzona::v1::StepRequest& request,
                         canzona::v1::StepResponse* response);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_RANK_STEP_H_
