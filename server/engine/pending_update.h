// PendingUpdate: what one local rank's step leaves for the next: the sum of
// squares of the update it applied (counted once job-wide), which the next
// step sums over the world with its gradient norm (StepResponse.update_rms).
// What the compute backend counts stays queued there (its EnqueueSumSquares
// queue) until the next step's first wait reads it with the gradients'
// sums, so the step itself never waits for it; what host staging counts
// (the TP owner's and the redundant updates' beside a GPU) is added on the
// host. A skipped
// step leaves nothing; a checkpoint load or state import clears it (no
// update of this run precedes the next step).
//
//   CANZONA_ASSIGN_OR_RETURN(double previous, pending.Take());  // world sum
//   ...
//   compute.EnqueueSquaredDistance(n, after, before);  // queued updates
//   pending.Add(host_sumsq);                           // host staging's
//
// Thread-safety: the rank's worker only (it drives `queue`).
#ifndef CANZONA_SERVER_ENGINE_PENDING_UPDATE_H_
#define CANZONA_SERVER_ENGINE_PENDING_UPDATE_H_

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/base/status_macros.h"

namespace canzona {

class PendingUpdate {
 public:
  // `queue`: the backend the DP-owned updates queue their sums on (null:
  // none; then only Add counts).
  explicit PendingUpdate(Backend* queue = nullptr) : queue_(queue) {}

  // Adds a sum of squares counted on the host.
  void Add(double sumsq) { host_sumsq_ += sumsq; }
  // The sum of squares for this step's world reduction (the queued sums in
  // their order, then the host's); nothing stays pending.
  absl::StatusOr<double> Take() {
    double queued = 0;
    if (queue_ != nullptr) {
      CANZONA_ASSIGN_OR_RETURN(queued, queue_->TakeSumSquares());
    }
    const double sumsq = queued + host_sumsq_;
    host_sumsq_ = 0;
    return sumsq;
  }
  // Forgets the pending update.
  absl::Status Clear() { return Take().status(); }

 private:
  Backend* queue_;
  double host_sumsq_ = 0;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_PENDING_UPDATE_H_
