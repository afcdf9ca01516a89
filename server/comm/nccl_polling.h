// How the NCCL communicator waits on a non-blocking NCCL communicator,
// shared by its operations (nccl_communicator.cc) and its creation and
// teardown (nccl_lifecycle.cc): the communicator's asynchronous state,
// deadlines, and error prefixes, polled with kernels/base/poll.h.
//
// Thread-safety: stateless functions; `api` as NcclApi.
#ifndef CANZONA_SERVER_COMM_NCCL_POLLING_H_
#define CANZONA_SERVER_COMM_NCCL_POLLING_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/comm/nccl_api.h"

namespace canzona::nccl_internal {

// "<prefix>: <message>" with the status's code.
absl::Status Prefixed(const absl::Status& status, absl::string_view prefix);

// ncclCommGetAsyncError with an error as UNAVAILABLE: the communicator (or a
// peer) failed while work was in flight.
absl::StatusOr<NcclCommState> PollState(NcclApi* api, NcclComm comm);

// One poll while waiting for NCCL to finish a non-blocking call on `comm`:
// true once it has, false while it is in progress before `deadline`,
// DEADLINE_EXCEEDED ("<what> did not finish within <timeout><consequence>")
// after it, UNAVAILABLE on an asynchronous error.
absl::StatusOr<bool> FinishedBy(NcclApi* api, NcclComm comm,
                                absl::Time deadline, absl::Duration timeout,
                                absl::string_view what,
                                absl::string_view consequence);

absl::Status AbortedDuringTheOperation();

inline constexpr char kPeerMissing[] =
    " (a peer did not take part); aborted the NCCL communicator";

}  // namespace canzona::nccl_internal

#endif  // CANZONA_SERVER_COMM_NCCL_POLLING_H_
