// Validation of a Register request, before it touches any engine state or
// maps any buffer: the job id and token, the layout and the rank's
// coordinates, the job settings, the optimizer groups and every parameter
// (name, shape, dtype, TP split, group). The result is the job's settings
// (JobSettings), the rank's place in the job and its stage's canonical
// parameter list, which the ranks later compare through the control plane.
//
//   RegisterLimits limits{.required_token = token, .max_parameters = 1 << 20};
//   CANZONA_ASSIGN_OR_RETURN(RankSpec spec,
//                            ValidateRegisterRequest(request, limits));
//
// Errors name the field: INVALID_ARGUMENT, UNAUTHENTICATED (token),
// RESOURCE_EXHAUSTED (limits).
//
// Thread-safety: pure functions.
#ifndef CANZONA_SERVER_ENGINE_REGISTER_REQUEST_H_
#define CANZONA_SERVER_ENGINE_REGISTER_REQUEST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "server/engine/job_settings.h"

namespace canzona {

struct RegisterLimits {
  // When non-empty, job_token must equal it.
  std::string required_token;
  int max_parameters = 1 << 20;
};

// A validated Register request.
struct RankSpec {
  JobSettings settings;
  canzona::v1::RankCoordinates coords;
  int global = 0;  // (pp * dp + dp_rank) * tp + tp_rank
  // Canonical parameter list of the rank's stage, one line per parameter.
  std::string plist;
  // Elements of each parameter's local shard (its TP fragment), in request
  // order: what the trainer's buffers must hold.
  std::vector<int64_t> fragment_numel;
};

absl::StatusOr<RankSpec> ValidateRegisterRequest(
    const canzona::v1::RegisterRequest& request, const RegisterLimits& limits);

// [A-Za-z0-9_-]{1,64}: job ids go into control-plane keys and shm names.
bool ValidJobId(absl::string_view id);

// INVALID_ARGUMENT "rank (...) outside the layout" unless every coordinate
// lies inside `layout`.
absl::Status CheckRankInLayout(const canzona::v1::WorldLayout& layout,
                               const canzona::v1::RankCoordinates& coords);

// The rank's index in the job: (pp_rank * dp + dp_rank) * tp + tp_rank.
int GlobalRank(const canzona::v1::WorldLayout& layout,
               const canzona::v1::RankCoordinates& coords);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_REGISTER_REQUEST_H_
