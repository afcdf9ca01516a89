// DpLane: one rank's DP gradient and parameter communication on a
// dedicated thread, so it overlaps the trainer's backward and forward
// (AsyncHZP, arXiv 2510.20111). The lane owns that thread and the order of
// the work; what a bucket's reduce and gather do is given as functions
// (BucketCollectives in the engine, fakes in tests).
//
// Per step k the thread runs, strictly in this order:
//   reduce(k, 0), reduce(k, 1), ..., reduce(k, B-1)   as buckets get ready
//   gather(k, order[0]), gather(k, order[1]), ...      after the update
// The order is the same on every DP rank whatever order the trainer reports
// buckets in (a bucket reported early waits for the ones before it), and
// step k+1's reductions start only after step k's gathers are queued (the
// worker is then done with the staging buffers), so collectives on the DP
// communicators always match across ranks.
//
//   lane.MarkReady(k, {2});          // GradReady: nothing before 0..1
//   lane.MarkAllReady(k);            // Step(k)
//   lane.WaitReduced(k, deadline);   // worker: then norm, update
//   lane.StartGathers(k, {2, 1, 0}, true);
//   lane.WhenGathered(k, 0, done);   // WaitParams, never blocks
//
// Failure is sticky: the first error of a reduce or gather (or Fail()) is
// returned by every later wait and given to every pending callback.
//
// Thread-safety: every method is thread-safe; `reduce` and `gather` run on
// the lane's own thread, one at a time. Callbacks run on that thread or
// on the caller's, never under the lane's lock.
#ifndef CANZONA_SERVER_ENGINE_DP_LANE_H_
#define CANZONA_SERVER_ENGINE_DP_LANE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace canzona {

class DpLane {
 public:
  using BucketFn = std::function<absl::Status(int64_t step, int bucket)>;
  using Done = std::function<void(absl::Status status, double waited_s)>;

  // `first_step`: the first step it will see (later: Reset).
  DpLane(int buckets, BucketFn reduce, BucketFn gather, int64_t first_step = 1);
  ~DpLane();
  DpLane(const DpLane&) = delete;
  DpLane& operator=(const DpLane&) = delete;

  int buckets() const { return buckets_; }

  // Backward finished these buckets of step k. Buckets must be in range
  // (the caller validates); repeats and steps already reduced are ignored.
  void MarkReady(int64_t k, absl::Span<const int> buckets);
  void MarkAllReady(int64_t k);

  // Blocks until every bucket of step k is reduced; `waited_s` gets the
  // blocked time (counted as exposed communication).
  absl::Status WaitReduced(int64_t k, absl::Time deadline, double* waited_s);

  // Queues step k's gathers in `order` (every bucket once). With
  // communicate = false (a skipped step: nothing changed) the buckets are
  // marked in place without calling `gather`.
  void StartGathers(int64_t k, std::vector<int> order, bool communicate);

  // Blocks until every bucket of step k is gathered.
  absl::Status WaitGathered(int64_t k, absl::Time deadline, double* waited_s);

  // Calls done once bucket b (-1: every bucket) holds step k's parameters,
  // at once when it already does; the wait counts as exposed.
  void WhenGathered(int64_t k, int bucket, Done done);

  // The last step whose gathers were queued (0 before the first).
  int64_t gathers_started() const;

  // Blocks until nothing is queued or running; the worker calls it before
  // work that must not race the communication thread (checkpoints).
  void WaitIdle();
  // Nothing queued or running now.
  bool Idle() const;

  // Runs `fn` on the lane's thread after what is queued now, between two
  // collectives, and returns its status; also on a failed lane. For work
  // on what only the lane's thread may drive (the DP copier, one thread's
  // at a time) while the trainer may already report the next step's
  // buckets: WaitIdle does not keep those from starting. Not from the
  // lane's own thread (a Done callback): it would wait for itself.
  // UNAVAILABLE, without running `fn`, once the lane stops.
  absl::Status RunOnLane(const std::function<absl::Status()>& fn);

  // After a checkpoint load or state import moved the job to step
  // `last_step`: every bucket counts as gathered at it, nothing is ready.
  // Call only when idle.
  void Reset(int64_t last_step);

  // Makes the lane fail with `status` (first error wins): pending and
  // later waits and callbacks get it; queued collectives are dropped
  // (RunOnLane's work still runs).
  void Fail(absl::Status status);

  // Communication seconds completed and exposed seconds waited since the
  // last call, then zeroes both.
  void TakeTimes(double* comm_s, double* exposed_s);

 private:
  struct Task {
    int64_t step = 0;
    int bucket = 0;
    bool reduce = false;
    bool communicate = true;
    // RunOnLane's: runs instead of a collective, then its status goes to
    // *result and *ran is set (under mu_); kept when a failure drops the
    // collectives.
    std::function<absl::Status()> run;
    absl::Status* result = nullptr;
    bool* ran = nullptr;
  };
  struct Waiter {
    int64_t step = 0;
    int bucket = 0;
    absl::Time since;
    Done done;
  };

  void Loop();
  void PostReadyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A failure drops the queued collectives (RunOnLane's work stays).
  void DropCollectivesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool GatheredLocked(int64_t k, int bucket) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Removes the waiters that can finish now; the caller runs them unlocked.
  std::vector<std::pair<Waiter, absl::Status>> TakeFinishedLocked()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void Finish(std::vector<std::pair<Waiter, absl::Status>> finished);

  const int buckets_;
  const BucketFn reduce_;
  const BucketFn gather_;

  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  // Buckets the trainer reported, per step not yet fully queued; the step
  // being queued and how many of its buckets (a prefix) are; the last
  // step whose reductions all finished.
  std::map<int64_t, std::vector<char>> ready_ ABSL_GUARDED_BY(mu_);
  int64_t posting_step_ ABSL_GUARDED_BY(mu_);
  int posted_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t reduced_through_ ABSL_GUARDED_BY(mu_);
  int64_t gathers_started_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> gathered_ ABSL_GUARDED_BY(mu_);  // per bucket
  std::vector<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  double comm_s_ ABSL_GUARDED_BY(mu_) = 0;
  double exposed_s_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_DP_LANE_H_
