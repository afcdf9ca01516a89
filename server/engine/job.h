// A job as this daemon hosts it, and its local ranks.
//
// Job: the settings every rank agreed on, and under its mutex the job's
// life (registering, ready, failed and why), its local ranks, their step
// counters, the step arrivals the local ranks wait for together, and the
// plan once built. LocalRank: one trainer rank registered here: its trainer
// process and buffers, its worker thread, the runtime the worker owns, its
// DP lane, and the communicators that another thread may have to abort.
//
//   absl::MutexLock lock(&job->mu);
//   RankProgress& progress = job->progress(*rank);   // needs job->mu
//   if (request.step() != progress.next_step) return ...;
//
// Thread-safety: Job's mutable state is guarded by Job::mu (a rank's
// RankProgress too: reachable only through Job::progress, which requires
// it). LocalRank: see each member.
#ifndef CANZONA_SERVER_ENGINE_JOB_H_
#define CANZONA_SERVER_ENGINE_JOB_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "server/comm/communicator.h"
#include "server/engine/dp_lane.h"
#include "server/engine/engine.h"
#include "server/engine/job_plan.h"
#include "server/engine/job_settings.h"
#include "server/engine/rank_runtime.h"
#include "server/engine/state_transfer.h"
#include "server/engine/trainer_buffers.h"
#include "server/engine/trainer_watcher.h"
#include "server/engine/worker.h"

namespace canzona {

enum class JobState { kRegistering, kReady, kFailed };

// One local rank's step counters and what waits on them.
struct RankProgress {
  int64_t next_step = 1;  // the next step number Step accepts
  int64_t steps_done = 0;
  // The step Step last accepted (next_step - 1, or 0: none since a
  // checkpoint load or import moved the rank, nothing to answer again).
  int64_t last_accepted = 0;
  // Work to run on the worker right after step N (checkpoints at_step).
  std::map<int64_t, std::vector<Worker::Task>> after_step;
  canzona::v1::PhaseTimes last;
  // The answer to step `steps_done`, kept for a Step that names it again
  // (a trainer whose call was interrupted, or whose answer was lost): that
  // call gets this instead of the step running twice.
  canzona::v1::StepResponse last_response;
  // The GPU the rank's updates run on once set up (-1, "": cpu).
  int device = -1;
  std::string pci_bus_id;
  // RankStatus.pageable_host_bytes and pageable_copies.
  int64_t pageable_host_bytes = 0;
  int64_t pageable_copies = 0;
  bool setup_done = false;
  // Holds its place in the job on the control plane (claimed at
  // registration): its departure counts towards deleting the job's keys.
  bool claimed = false;
  // Register's callback, held until every local rank is set up.
  Callback<canzona::v1::RegisterResponse> register_done;

  // Set up, and its last accepted step completed: its state is whole.
  bool whole() const { return setup_done && steps_done + 1 == next_step; }
};

class LocalRank {
 public:
  LocalRank(canzona::v1::RankCoordinates coords, int global,
            TrainerProcess trainer, std::unique_ptr<TrainerBuffers> buffers);
  ~LocalRank();
  LocalRank(const LocalRank&) = delete;
  LocalRank& operator=(const LocalRank&) = delete;

  const canzona::v1::RankCoordinates coords;
  const int global;
  const TrainerProcess trainer;
  const std::unique_ptr<TrainerBuffers> buffers;

  // Breaks every communicator of the rank, now and as they are created
  // (another thread on failure or shutdown).
  void AddComm(Communicator* comm) ABSL_LOCKS_EXCLUDED(comm_mu_);
  void AbortComms() ABSL_LOCKS_EXCLUDED(comm_mu_);
  // Drops the communicators AddComm recorded (a failed setup is about to
  // destroy them); an abort from then on has none to break.
  void ForgetComms() ABSL_LOCKS_EXCLUDED(comm_mu_);
  // The DP lane: set once at setup, before the job is ready, and kept until
  // the rank is destroyed, so RPC threads may use lane() once they saw the
  // job ready; FailLane reaches it from any thread.
  void SetLane(std::unique_ptr<DpLane> lane) ABSL_LOCKS_EXCLUDED(comm_mu_);
  void FailLane(const absl::Status& status) ABSL_LOCKS_EXCLUDED(comm_mu_);
  // No DP lane, or one with nothing queued or running.
  bool LaneIdle() ABSL_LOCKS_EXCLUDED(comm_mu_);
  DpLane& lane() { return *lane_; }

  // Set at admission, before the first task; a rank whose registration
  // failed hands it to the engine from the worker itself (it cannot join
  // itself).
  std::unique_ptr<Worker> worker;
  // Worker-only from here on, but for the DP collectives' gradients-event
  // snapshots, which GradReady takes on RPC threads once the job is ready
  // (BucketCollectives::CaptureGradients is thread-safe).
  std::unique_ptr<RankRuntime> rt;
  // Checkpoint collectives run (names their control-plane keys, the same
  // on every rank of the job).
  int64_t collective_seq = 0;
  // The state ExportState and ImportState move in parts. Worker-only.
  StateTransfer transfer;
  // Written by the worker during setup, before progress.setup_done; read
  // under Job::mu after it.
  canzona::v1::RegisterResponse response;

 private:
  friend class Job;
  RankProgress progress_;  // Job::mu (Job::progress)
  absl::Mutex comm_mu_;
  bool aborted_ ABSL_GUARDED_BY(comm_mu_) = false;
  std::vector<Communicator*> comms_ ABSL_GUARDED_BY(comm_mu_);
  // Declared after rt: destroyed (and joined) first.
  std::unique_ptr<DpLane> lane_;
};

class Job {
 public:
  Job(std::string id, std::string token, JobSettings settings);
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  const std::string id;
  const std::string token;
  const JobSettings settings;

  absl::Mutex mu;
  absl::CondVar cv;  // arrivals, state changes
  JobState state ABSL_GUARDED_BY(mu) = JobState::kRegistering;
  std::string failure ABSL_GUARDED_BY(mu);
  bool barrier_passed ABSL_GUARDED_BY(mu) = false;
  std::map<int, std::string> stage_plist ABSL_GUARDED_BY(mu);
  std::map<int, std::shared_ptr<LocalRank>> ranks ABSL_GUARDED_BY(mu);
  int setup_done ABSL_GUARDED_BY(mu) = 0;
  std::map<int64_t, int> arrivals ABSL_GUARDED_BY(mu);
  std::map<int64_t, int> departures ABSL_GUARDED_BY(mu);
  int64_t mapped_bytes ABSL_GUARDED_BY(mu) = 0;
  std::shared_ptr<const JobPlan> plan ABSL_GUARDED_BY(mu);
  // Serializes building the plan (it waits on the control plane).
  absl::Mutex plan_mu;

  RankProgress& progress(LocalRank& rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return rank.progress_;
  }

  bool failed() ABSL_LOCKS_EXCLUDED(mu);
  // ABORTED "job failed: <why>".
  absl::Status FailedError() ABSL_LOCKS_EXCLUDED(mu);
  std::shared_ptr<const JobPlan> current_plan() ABSL_LOCKS_EXCLUDED(mu);
  // "registering", "ready" or "failed: <why>".
  std::string StateString() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // What Fail() leaves to the caller, outside the lock: callbacks to fail
  // and ranks whose communicators and lanes to break.
  struct Failure {
    bool first = false;  // this call failed the job
    std::vector<Callback<canzona::v1::RegisterResponse>> register_done;
    std::vector<std::shared_ptr<LocalRank>> ranks;
  };
  // Marks the job failed with `why` (the first reason wins: nothing to do
  // when it already failed) and wakes every waiter.
  Failure Fail(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Waits until every local rank has called Step(k) (or the deadline, the
  // job's failure, `stop`), then counts this rank's departure.
  // DEADLINE_EXCEEDED naming the missing ranks; ABORTED when the job
  // failed; UNAVAILABLE when `stop` is set.
  absl::Status AwaitLocalArrivals(int64_t k, absl::Time deadline,
                                  absl::Duration timeout,
                                  const std::atomic<bool>& stop)
      ABSL_LOCKS_EXCLUDED(mu);

  // The tasks waiting for `rank`'s steps up to k (all of them when k < 0,
  // after a failed step), taken out to run.
  std::vector<Worker::Task> TakeAfterStep(LocalRank& rank, int64_t k)
      ABSL_LOCKS_EXCLUDED(mu);
  // The answer `rank` got for its step k, which completed; ABORTED naming
  // the job's failure when it did not complete (nor will).
  absl::StatusOr<canzona::v1::StepResponse> CompletedStep(LocalRank& rank,
                                                          int64_t k)
      ABSL_LOCKS_EXCLUDED(mu);
  // Cancels what waited for a later step of a rank that is going away.
  void CancelAfterStep(LocalRank& rank) ABSL_LOCKS_EXCLUDED(mu);
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_JOB_H_
