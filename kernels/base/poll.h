// How Canzona waits on the host for work it cannot block on with a bound
// (a GPU stream or event, a non-blocking NCCL communicator): it polls,
// spinning for the first 50 us (launches and short work finish within
// that), then pausing 10 us, doubling up to kMaxPollPause, between polls.
// The cap bounds how late a finished wait is seen: the DP lane enqueues a
// bucket's collective only once the one before it finished, and a 1 ms cap
// saw a long collective finish 0.5 ms late on average, some 10 ms a step
// over 20 buckets reduced and gathered. At 100 us the lateness is 50 us on
// average, for a poll 10,000 times a second while the work runs.
//
//   CANZONA_RETURN_IF_ERROR(PollUntilDone([&]() -> absl::StatusOr<bool> {
//     if (finished()) return true;
//     if (absl::Now() >= deadline) return absl::DeadlineExceededError(...);
//     return false;
//   }));
//
// Thread-safety: stateless; `poll` and `sleep` run on the calling thread.
#ifndef CANZONA_KERNELS_BASE_POLL_H_
#define CANZONA_KERNELS_BASE_POLL_H_

#include <algorithm>
#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/base/status_macros.h"

namespace canzona {

inline constexpr absl::Duration kMaxPollPause = absl::Microseconds(100);

// Calls `poll` until it returns true (OK) or an error (that error),
// pausing with `sleep` between calls as above.
inline absl::Status PollUntilDone(
    const std::function<absl::StatusOr<bool>()>& poll,
    const std::function<void(absl::Duration)>& sleep = absl::SleepFor) {
  absl::Duration pause = absl::Microseconds(10);
  const absl::Time spin_until = absl::Now() + absl::Microseconds(50);
  while (true) {
    CANZONA_ASSIGN_OR_RETURN(bool done, poll());
    if (done) return absl::OkStatus();
    if (absl::Now() < spin_until) continue;
    sleep(pause);
    pause = std::min(pause * 2, kMaxPollPause);
  }
}

}  // namespace canzona

#endif  // CANZONA_KERNELS_BASE_POLL_H_
