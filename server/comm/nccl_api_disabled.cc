// Stand-in for builds without CUDA: no NCCL, ever.
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/comm/nccl_api.h"

namespace canzona {

absl::StatusOr<NcclApi*> RealNcclApi() {
  return absl::FailedPreconditionError(
      "NCCL is not available: this build has no CUDA support "
      "(CANZONA_ENABLE_CUDA=OFF)");
}

}  // namespace canzona
