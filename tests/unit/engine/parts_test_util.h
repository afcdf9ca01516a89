// Helpers for the unit tests of the engine's parts: the validated
// Register request of a rank of a JobConfig (engine_test_util's model and
// groups), and its job's plan, without any engine.
//
//   ASSERT_OK_AND_ASSIGN(RankSpec spec, SpecOf(config, /*global=*/1));
//   ASSERT_OK_AND_ASSIGN(auto plan, PlanOf(config));
//
// Thread-safety: pure functions.
#ifndef CANZONA_TESTS_UNIT_ENGINE_PARTS_TEST_UTIL_H_
#define CANZONA_TESTS_UNIT_ENGINE_PARTS_TEST_UTIL_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/base/status_macros.h"
#include "server/engine/job_plan.h"
#include "server/engine/register_request.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona::engine_test {

// The Register request rank `global` of `config` sends (its shm object
// made and released again: only the request is kept).
inline absl::StatusOr<canzona::v1::RegisterRequest> RequestOf(
    const JobConfig& config, int global) {
  TrainerRank rank(config, global);
  CANZONA_RETURN_IF_ERROR(rank.Init());
  return rank.MakeRegister();
}

inline absl::StatusOr<RankSpec> SpecOf(const JobConfig& config, int global) {
  CANZONA_ASSIGN_OR_RETURN(canzona::v1::RegisterRequest request,
                           RequestOf(config, global));
  return ValidateRegisterRequest(request, RegisterLimits{});
}

inline absl::StatusOr<std::shared_ptr<const JobPlan>> PlanOf(
    const JobConfig& config) {
  CANZONA_ASSIGN_OR_RETURN(RankSpec spec, SpecOf(config, 0));
  return BuildJobPlan(spec.settings, {spec.plist});
}

}  // namespace canzona::engine_test

#endif  // CANZONA_TESTS_UNIT_ENGINE_PARTS_TEST_UTIL_H_
