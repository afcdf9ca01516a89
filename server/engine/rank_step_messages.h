// RankStepRequest / RankStepResult: what one local rank's step
// (RunRankStep, rank_step.h) reads and what it reports, in the engine's
// own terms. step_messages.h converts them from / to v1::StepRequest and
// v1::StepResponse, once, where the engine runs a Step.
//
//   RankStepResult result;
//   CANZONA_RETURN_IF_ERROR(RunRankStep(rank, jp, context, request, &result));
//   if (result.skipped_nonfinite) ...
//
// Thread-safety: plain values.
#ifndef CANZONA_SERVER_ENGINE_RANK_STEP_MESSAGES_H_
#define CANZONA_SERVER_ENGINE_RANK_STEP_MESSAGES_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "server/engine/phase_seconds.h"
#include "server/optim/optimizer_config.h"

namespace canzona {

struct RankStepRequest {
  int64_t step = 0;  // 1, 2, 3, ...
  // Per optimizer group, this step's learning rate (StepOptions::lr);
  // other groups keep theirs.
  std::map<std::string, float> lr;
  // Per optimizer group, this step's settings where the trainer scheduled
  // some (StepOptions::settings); other groups run with their registered
  // ones.
  std::map<std::string, OptimizerConfig> settings;
  // The gradients are multiplied by this before use (loss-scale undo);
  // 0 means 1.
  double grad_scale = 0;
  // Return once the update is done, the parameter all-gathers going on
  // (the trainer calls WaitParams); false: once every bucket is in place.
  bool async_params = false;
  // > 0: clip at this global gradient norm in this step instead of at the
  // job's.
  double max_grad_norm = 0;
  // Trainer parameter indices whose values the trainer changed since its
  // last step: their masters are read from it again (checked against the
  // rank's parameter count before the step is accepted).
  std::vector<int> reload_params;
};

struct RankStepResult {
  PhaseSeconds seconds;
  // The global L2 norm of the DP-averaged, unscaled gradient before
  // clipping (NaN when the step was skipped).
  double grad_norm = 0;
  // The RMS of the previous step's update over all parameters.
  double update_rms = 0;
  // A non-finite gradient made every rank skip the step.
  bool skipped_nonfinite = false;
  // What clipping multiplied the gradients by (1: no clipping; 0 when the
  // step was skipped before it).
  double clip_factor = 0;
  // Host round trips from the step's start to its answer
  // (StepResponse.host_waits).
  int64_t host_waits = 0;
  // Copies between the host and the GPU with a pageable host side since
  // the previous step's answer (StepResponse.pageable_copies).
  int64_t pageable_copies = 0;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_RANK_STEP_MESSAGES_H_
