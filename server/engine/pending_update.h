// PendingUpdate: what one local rank's step leaves for the next: the sum of
// squares of the update it applied (counted once job-wide), which the next
// step sums over the world with its gradient norm (StepResponse.update_rms).
// A skipped step leaves nothing; a checkpoint load or state import clears
// it (no update of this run precedes the next step).
//
//   const double previous = rt.pending_update().Take();  // world reduction
//   ...
//   rt.pending_update().Add(update_sumsq);  // the step's counted updates
//
// Thread-safety: the rank's worker only.
#ifndef CANZONA_SERVER_ENGINE_PENDING_UPDATE_H_
#define CANZONA_SERVER_ENGINE_PENDING_UPDATE_H_

namespace canzona {

class PendingUpdate {
 public:
  // Adds this step's update's sum of squares (its counted part).
  void Add(double sumsq) { sumsq_ += sumsq; }
  // The sum of squares for this step's world reduction; nothing stays
  // pending.
  double Take() {
    const double sumsq = sumsq_;
    sumsq_ = 0;
    return sumsq;
  }
  // Forgets the pending update.
  void Clear() { sumsq_ = 0; }

 private:
  double sumsq_ = 0;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_PENDING_UPDATE_H_
