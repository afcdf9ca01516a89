// JobRegistry: the jobs this daemon hosts and the life of their local
// ranks: admitting a validated rank into its job (creating the job), finding
// a job or a ready rank for a call, failing a job, removing a rank (a
// refused registration, Deregister, a dead trainer), keeping a gracefully
// departed rank's communicators up for a while (the linger), remembering
// failed jobs for GetStatus and GetPlan, and deleting a job's control-plane
// keys once it is over. The watcher thread calls Tick() to reap what waits
// and to release ranks whose trainer exited.
//
//   JobRegistry registry(options);
//   CANZONA_ASSIGN_OR_RETURN(std::shared_ptr<Job> job,
//                            registry.Admit(request, spec, rank));
//   ...
//   registry.RemoveLocalRank(job, global, "rank (0,0,0) deregistered",
//                            /*graceful=*/true);
//
// Thread-safety: thread-safe. Lock order: the registry's mutex before any
// Job::mu. Removal and shutdown join worker threads: never call them from
// the worker being joined.
#ifndef CANZONA_SERVER_ENGINE_JOB_REGISTRY_H_
#define CANZONA_SERVER_ENGINE_JOB_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "server/control/kv_store.h"
#include "server/engine/job.h"
#include "server/engine/register_request.h"
#include "server/metrics/registry.h"

namespace canzona {

class JobRegistry {
 public:
  struct Options {
    std::string daemon_id = "canzonad";
    KvStore* control = nullptr;  // not owned
    int max_jobs = 64;
    int64_t max_bytes_per_job = int64_t{1} << 40;
    // How long a gracefully departed rank keeps its communicators.
    absl::Duration linger = absl::Seconds(5);
    // Where the jobs' series are (not owned; null: none), and how long
    // they stay after a job left (EngineOptions::metrics_retention).
    MetricsRegistry* metrics = nullptr;
    absl::Duration metrics_retention = absl::Minutes(5);
  };

  explicit JobRegistry(Options options);
  JobRegistry(const JobRegistry&) = delete;
  JobRegistry& operator=(const JobRegistry&) = delete;

  // UNAVAILABLE "canzonad is shutting down".
  static absl::Status Unavailable();
  bool closed() const { return closed_; }
  const std::atomic<bool>& closed_flag() const { return closed_; }

  // Adds `rank` to its job (created from `spec` if new) and gives it a
  // worker. Conflicts with the job's other local ranks: UNAUTHENTICATED
  // (token), FAILED_PRECONDITION (failed job, settings or parameter list),
  // ALREADY_EXISTS (rank or complete job), RESOURCE_EXHAUSTED (limits).
  absl::StatusOr<std::shared_ptr<Job>> Admit(
      const canzona::v1::RegisterRequest& request, const RankSpec& spec,
      const std::shared_ptr<LocalRank>& rank) ABSL_LOCKS_EXCLUDED(mu_);

  // NOT_FOUND naming the job.
  absl::StatusOr<std::shared_ptr<Job>> FindJob(const std::string& job_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A hosted or recently failed job (GetPlan explains failed ones).
  absl::StatusOr<std::shared_ptr<Job>> FindJobOrRecord(
      const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);
  // The ready job and this daemon's rank `coords` of it, or the status a
  // call naming them gets. With `after_failure`, a failed job's rank is
  // returned too when its state is whole (exporting the state of a job
  // another rank has already left).
  absl::StatusOr<std::pair<std::shared_ptr<Job>, std::shared_ptr<LocalRank>>>
  FindReadyRank(const std::string& job_id,
                const canzona::v1::RankCoordinates& coords,
                bool after_failure = false) ABSL_LOCKS_EXCLUDED(mu_);
  // Hosted jobs, then the failed ones remembered (GetStatus).
  std::vector<std::shared_ptr<Job>> Jobs() ABSL_LOCKS_EXCLUDED(mu_);

  // Fails the job with `status` (first reason wins): breaks its ranks'
  // communicators and DP lanes, fails pending Register calls.
  void FailJob(Job& job, const absl::Status& status);

  // Undoes the admission of `rank` whose registration was refused; called
  // from the rank's own worker (kept to be joined later).
  void RemoveRefused(const std::shared_ptr<Job>& job,
                     const std::shared_ptr<LocalRank>& rank)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Takes local rank `global` out of `job` (the job fails with `reason`):
  // unblocks and joins its worker, fails what it had pending, and unmaps
  // its buffers. False when the rank is not (any more) registered here.
  //
  // `graceful` (Deregister between steps): the rank's communicators and DP
  // lane stay up for the linger instead of being aborted, because peers may
  // still be receiving the last collective's data from them: a fast rank
  // that leaves right after its last all-gather must not cut off a slower
  // peer's (closing a Gloo pair drops what that peer has not read yet).
  // Its optimizer state is freed at once.
  bool RemoveLocalRank(const std::shared_ptr<Job>& job, int global,
                       const std::string& reason, bool graceful = false)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The watcher's round: joins refused ranks' workers, ends expired
  // lingers (early for a job whose every rank was local and left), releases
  // ranks whose trainer exited without deregistering, deletes the control-plane
  // keys of jobs that are over and drops the series of jobs gone for the
  // metrics retention.
  void Tick() ABSL_LOCKS_EXCLUDED(mu_);

  // Counts on the control plane the departures queued so far and deletes
  // the keys of the jobs they end (and of dropped records), waiting for a
  // round the watcher has under way. Registration calls it before agreeing
  // on a job, so that a job id whose every local rank has left registers
  // again at once: Deregister answered OK, and the rank must not find its
  // own claim still standing until the watcher's next round.
  void FlushDepartures() ABSL_LOCKS_EXCLUDED(mu_, flush_mu_);

  // Fails every job and in-flight call with UNAVAILABLE, stops every
  // worker, and refuses what comes later. Idempotent.
  void Close() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // A job that lost its last local rank: remembered if it failed, and its
  // keys deleted when the record goes.
  void DropJobLocked(const std::shared_ptr<Job>& job, bool remember)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the lingering ranks of `job` may go before their time (Tick).
  bool Drained(Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the series of the jobs gone for the retention. Under mu_, so
  // that a job Admit brings back meanwhile keeps its new series.
  void DropExpiredSeriesLocked(absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  std::atomic<bool> closed_{false};
  // Held through a flush's control-plane calls (taken before mu_): a
  // flush that finds the queues empty has waited for one in flight.
  absl::Mutex flush_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  // Workers of ranks removed from their own thread: joined by Tick.
  std::vector<std::unique_ptr<Worker>> retired_ ABSL_GUARDED_BY(mu_);
  // A rank that left gracefully, kept (communicators open) until `until`,
  // or until no peer can still be reading from it: every rank of its job
  // lived on this daemon and has left, and its lane has drained.
  struct Lingering {
    absl::Time until;
    std::shared_ptr<Job> job;
    std::shared_ptr<LocalRank> rank;
  };
  std::vector<Lingering> lingering_ ABSL_GUARDED_BY(mu_);
  // Jobs that failed and lost their last local rank (a dead trainer), kept
  // so that GetStatus and GetPlan still explain them; the newest 16.
  std::deque<std::shared_ptr<Job>> failed_jobs_ ABSL_GUARDED_BY(mu_);
  // Control-plane work for Tick: a claimed rank left its job (job id,
  // world); a job's keys to delete.
  std::vector<std::pair<std::string, int>> departures_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> dropped_ ABSL_GUARDED_BY(mu_);
  // Jobs that left this daemon (their last local rank gone), and when:
  // their series go after the metrics retention, unless they came back.
  std::map<std::string, absl::Time> gone_ ABSL_GUARDED_BY(mu_);
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_JOB_REGISTRY_H_
