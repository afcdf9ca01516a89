// GradientSnapshots: what a GPU trainer's "gradients written" event meant
// when each bucket was reported, kept per bucket. The trainer has one
// interprocess event and records it again before every GradReady; a
// stream wait takes the record that is the latest when it is enqueued,
// and the DP lane enqueues bucket b's reduction only once the one before
// it finished (at DP > 1 it waits for each collective). A trainer's host
// runs ahead of its GPU, so by then it has recorded the event for later
// buckets, often the last: every reduction after the first would wait for
// nearly all of backward, and none would overlap it. So at GradReady the
// daemon takes a snapshot, on a stream of its own: that stream waits for
// the event's record as of now, and bucket b's own event is recorded
// after the wait; Reduce(b) waits for that event instead. Nothing in the
// protocol changes, and nothing waits on the host.
//
//   snapshots->Capture(step, {b});                  // at GradReady
//   NcclEvent e = snapshots->For(step, b);          // in Reduce(b)
//   CANZONA_RETURN_IF_ERROR(e != nullptr ? copier.WaitEvent(e)
//                                        : trainer.WaitGradients(...));
//
// Owns a stream and one event per bucket on the rank's GPU (either plane:
// on the Gloo plane the reductions' host waits poll the snapshot, Await).
// Thread-safety: Capture runs on RPC threads (GradReady), For on the DP
// lane; the steps they name are guarded.
#ifndef CANZONA_SERVER_ENGINE_GRADIENT_SNAPSHOTS_H_
#define CANZONA_SERVER_ENGINE_GRADIENT_SNAPSHOTS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/comm/nccl_api.h"

namespace canzona {

class GradientSnapshots {
 public:
  // Of `trainer_event` (opened, on `device`) for `buckets` buckets; `api`
  // must outlive the result.
  static absl::StatusOr<std::unique_ptr<GradientSnapshots>> Create(
      NcclApi* api, int device, NcclEvent trainer_event, int buckets);
  ~GradientSnapshots();
  GradientSnapshots(const GradientSnapshots&) = delete;
  GradientSnapshots& operator=(const GradientSnapshots&) = delete;

  // Snapshots the trainer's event for `buckets` of `step` (valid indices).
  // On failure those buckets keep no snapshot: Reduce waits for the
  // trainer's event itself, later but correct.
  absl::Status Capture(int64_t step, absl::Span<const int> buckets)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Bucket b's snapshot event if Capture took one for `step`, else null.
  NcclEvent For(int64_t step, int b) const ABSL_LOCKS_EXCLUDED(mu_);
  // Returns once `snapshot` (a For result) completed, polled on the host:
  // on the Gloo plane, whose copier cannot wait on the device. Past
  // `deadline` DEADLINE_EXCEEDED: a trainer that died before its GPU
  // reached the record leaves the snapshot pending for good.
  absl::Status Await(NcclEvent snapshot, absl::Time deadline) const;
  // Forgets every snapshot: the job moved to another step (a checkpoint
  // loaded, state imported), and a step number seen before must not find
  // an old snapshot, long complete, for a bucket not reported again.
  void Forget() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  GradientSnapshots(NcclApi* api, int device, NcclEvent trainer_event)
      : api_(api), device_(device), trainer_event_(trainer_event) {}

  NcclApi* const api_;
  const int device_;
  const NcclEvent trainer_event_;
  NcclStream stream_ = nullptr;
  std::vector<NcclEvent> events_;
  mutable absl::Mutex mu_;
  // The step each bucket's event was last recorded for (0: none).
  std::vector<int64_t> step_ ABSL_GUARDED_BY(mu_);
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_GRADIENT_SNAPSHOTS_H_
