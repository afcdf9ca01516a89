// The one place where a Step's protocol messages meet the rank step's own
// types: v1::StepRequest into a RankStepRequest, a RankStepResult into
// v1::StepResponse (and its PhaseSeconds into v1::PhaseTimes). The engine
// converts (and so checks) the request before a rank accepts the step
// (EngineImpl::AcceptStep) and the result where it runs it
// (EngineImpl::RunStep); nothing below it sees the protos.
//
//   CANZONA_ASSIGN_OR_RETURN(RankStepRequest request,
//                            ToRankStepRequest(proto_request, configs));
//   ...
//   done(ToStepResponse(result));
//
// Thread-safety: pure functions.
#ifndef CANZONA_SERVER_ENGINE_STEP_MESSAGES_H_
#define CANZONA_SERVER_ENGINE_STEP_MESSAGES_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "server/engine/phase_seconds.h"
#include "server/engine/rank_step_messages.h"
#include "server/optim/optimizer_config.h"

namespace canzona {

// The fields the step reads (job_id and rank found the rank already), the
// scheduled settings resolved against `configs` (the job's, by group).
// INVALID_ARGUMENT naming the field for an unknown group, a learning rate
// that is negative or not finite, or a setting ScheduleSettings refuses.
absl::StatusOr<RankStepRequest> ToRankStepRequest(
    const canzona::v1::StepRequest& request,
    const std::map<std::string, OptimizerConfig>& configs);
canzona::v1::PhaseTimes ToPhaseTimes(const PhaseSeconds& seconds);
canzona::v1::StepResponse ToStepResponse(const RankStepResult& result);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_STEP_MESSAGES_H_
