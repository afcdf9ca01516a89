#include "server/comm/nccl_polling.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/base/status_macros.h"

namespace canzona::nccl_internal {

absl::Status Prefixed(const absl::Status& status, absl::string_view prefix) {
  return absl::Status(status.code(),
                      absl::StrCat(prefix, ": ", status.message()));
}

absl::StatusOr<NcclCommState> PollState(NcclApi* api, NcclComm comm) {
  absl::StatusOr<NcclCommState> state = api->CommGetAsyncError(comm);
  if (!state.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "NCCL reported an asynchronous error: ", state.status().message()));
  }
  return state;
}

absl::StatusOr<bool> FinishedBy(NcclApi* api, NcclComm comm,
                                absl::Time deadline, absl::Duration timeout,
                                absl::string_view what,
                                absl::string_view consequence) {
  CANZONA_ASSIGN_OR_RETURN(NcclCommState state, PollState(api, comm));
  if (state == NcclCommState::kReady) return true;
  if (absl::Now() < deadline) return false;
  return absl::DeadlineExceededError(
      absl::StrCat(what, " did not finish within ",
                   absl::FormatDuration(timeout), consequence));
}

absl::Status AbortedDuringTheOperation() {
  return absl::UnavailableError(
      "the NCCL communicator was aborted during the operation");
}

}  // namespace canzona::nccl_internal
