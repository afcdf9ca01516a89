#include "server/engine/job_registry.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/names/rank_names.h"
#include "server/engine/job_agreement.h"
#include "spdlog/spdlog.h"

namespace canzona {

JobRegistry::JobRegistry(Options options) : options_(std::move(options)) {}

absl::Status JobRegistry::Unavailable() {
  return absl::UnavailableError("canzonad is shutting down");
}

absl::StatusOr<std::shared_ptr<Job>> JobRegistry::Admit(
    const v1::RegisterRequest& request, const RankSpec& spec,
    const std::shared_ptr<LocalRank>& rank) {
  absl::MutexLock lock(&mu_);
  if (closed_) return Unavailable();
  std::shared_ptr<Job>& slot = jobs_[request.job_id()];
  const bool created = slot == nullptr;
  if (created) {
    if (static_cast<int>(jobs_.size()) > options_.max_jobs) {
      jobs_.erase(request.job_id());
      return absl::ResourceExhaustedError(absl::StrCat(
          "job_id '", request.job_id(), "': this daemon serves at most ",
          options_.max_jobs, " jobs"));
    }
    slot = std::make_shared<Job>(request.job_id(), request.job_token(),
                                 spec.settings);
  }
  std::shared_ptr<Job> job = slot;
  const int stage = rank->coords.pp_rank();
  const int64_t bytes = rank->buffers->mapped_bytes();
  {
    absl::MutexLock job_lock(&job->mu);
    if (!created) {
      if (request.job_token() != job->token) {
        return absl::UnauthenticatedError(
            absl::StrCat("job_token does not match job '", job->id, "'"));
      }
      if (job->state == JobState::kFailed) {
        return absl::FailedPreconditionError(
            absl::StrCat("job failed: ", job->failure));
      }
      if (spec.settings.meta != job->settings.meta) {
        return absl::FailedPreconditionError(
            absl::StrCat("job settings disagree: ",
                         FirstDifference(spec.settings.meta, job->settings.meta,
                                         "settings")));
      }
      auto plist = job->stage_plist.find(stage);
      if (plist != job->stage_plist.end() && plist->second != spec.plist) {
        return absl::FailedPreconditionError(absl::StrCat(
            "parameter list disagrees with the job's other ranks: ",
            FirstDifference(spec.plist, plist->second, "parameters")));
      }
      if (job->ranks.count(rank->global)) {
        return absl::AlreadyExistsError(absl::StrCat(
            "rank ", RankString(rank->coords), " (global ", rank->global,
            ") of job '", job->id, "' is already registered"));
      }
      if (job->barrier_passed) {
        return absl::AlreadyExistsError(absl::StrCat(
            "job '", job->id, "' is complete: all ", job->settings.world,
            " ranks registered; rank ", RankString(rank->coords),
            " is already registered elsewhere"));
      }
      if (job->mapped_bytes + bytes > options_.max_bytes_per_job) {
        return absl::ResourceExhaustedError(
            absl::StrCat("job '", job->id, "': mapped bytes would exceed ",
                         options_.max_bytes_per_job));
      }
    }
    // The worker exists before any other thread can find the rank.
    rank->worker = std::make_unique<Worker>();
    job->stage_plist.emplace(stage, spec.plist);
    job->mapped_bytes += bytes;
    job->ranks[rank->global] = rank;
  }
  return job;
}

absl::StatusOr<std::shared_ptr<Job>> JobRegistry::FindJob(
    const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(
        absl::StrCat("job_id '", job_id, "' is not registered here"));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<Job>> JobRegistry::FindJobOrRecord(
    const std::string& job_id) {
  absl::StatusOr<std::shared_ptr<Job>> found = FindJob(job_id);
  if (found.ok()) return found;
  absl::MutexLock lock(&mu_);
  for (const auto& failed : failed_jobs_) {
    if (failed->id == job_id) found = failed;
  }
  return found;
}

absl::StatusOr<std::pair<std::shared_ptr<Job>, std::shared_ptr<LocalRank>>>
JobRegistry::FindReadyRank(const std::string& job_id,
                           const v1::RankCoordinates& r, bool after_failure) {
  absl::StatusOr<std::shared_ptr<Job>> found = FindJob(job_id);
  if (!found.ok()) return found.status();
  std::shared_ptr<Job> job = *std::move(found);
  const v1::WorldLayout& l = job->settings.layout;
  if (absl::Status s = CheckRankInLayout(l, r); !s.ok()) return s;
  const int global = GlobalRank(l, r);
  absl::MutexLock lock(&job->mu);
  auto it = job->ranks.find(global);
  const bool whole =
      it != job->ranks.end() && job->progress(*it->second).whole();
  if (job->state == JobState::kFailed && !(after_failure && whole)) {
    return absl::FailedPreconditionError(
        absl::StrCat("job failed: ", job->failure));
  }
  if (job->state == JobState::kRegistering) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job->id, "' is not ready: ranks are still registering"));
  }
  if (it == job->ranks.end()) {
    return absl::NotFoundError(
        absl::StrCat("rank ", RankString(r), " of job '", job->id,
                     "' is not registered with this daemon"));
  }
  return std::make_pair(job, it->second);
}

std::vector<std::shared_ptr<Job>> JobRegistry::Jobs() {
  std::vector<std::shared_ptr<Job>> jobs;
  absl::MutexLock lock(&mu_);
  for (auto& [id, job] : jobs_) jobs.push_back(job);
  for (auto& job : failed_jobs_) jobs.push_back(job);
  return jobs;
}

void JobRegistry::FailJob(Job& job, const absl::Status& status) {
  Job::Failure failure;
  {
    absl::MutexLock lock(&job.mu);
    failure = job.Fail(status.ToString());
    if (!failure.first) return;
  }
  spdlog::error("job failed: job={} daemon={}: {}", job.id, options_.daemon_id,
                status.ToString());
  // Breaks the groups so that peers blocked with these ranks fail promptly.
  for (auto& r : failure.ranks) r->AbortComms();
  for (auto& r : failure.ranks) {
    r->FailLane(
        absl::AbortedError(absl::StrCat("job failed: ", status.message())));
  }
  for (auto& done : failure.register_done) {
    done(absl::Status(status.code(),
                      absl::StrCat("job failed: ", status.message())));
  }
}

void JobRegistry::RemoveRefused(const std::shared_ptr<Job>& job,
                                const std::shared_ptr<LocalRank>& rank) {
  absl::MutexLock lock(&mu_);
  bool empty = false;
  {
    absl::MutexLock job_lock(&job->mu);
    job->ranks.erase(rank->global);
    job->mapped_bytes -= rank->buffers->mapped_bytes();
    const int stage = rank->coords.pp_rank();
    bool stage_left = false;
    for (const auto& [g, r] : job->ranks) {
      if (r->coords.pp_rank() == stage) stage_left = true;
    }
    if (!stage_left) job->stage_plist.erase(stage);
    empty = job->ranks.empty();
  }
  if (empty) DropJobLocked(job, /*remember=*/false);
  // Called from the rank's own worker: it cannot join itself.
  if (rank->worker) retired_.push_back(std::move(rank->worker));
}

void JobRegistry::DropJobLocked(const std::shared_ptr<Job>& job,
                                bool remember) {
  auto it = jobs_.find(job->id);
  if (it == jobs_.end() || it->second != job) return;
  jobs_.erase(it);
  gone_[job->id] = absl::Now();
  if (!remember) return;
  failed_jobs_.push_back(job);
  if (failed_jobs_.size() > 16) {
    dropped_.push_back(failed_jobs_.front()->id);
    failed_jobs_.pop_front();
  }
}

bool JobRegistry::RemoveLocalRank(const std::shared_ptr<Job>& job, int global,
                                  const std::string& reason, bool graceful) {
  std::shared_ptr<LocalRank> rank;
  Job::Failure failure;
  Callback<v1::RegisterResponse> pending;
  {
    absl::MutexLock lock(&mu_);
    absl::MutexLock job_lock(&job->mu);
    auto rit = job->ranks.find(global);
    if (rit == job->ranks.end()) return false;
    rank = rit->second;
    RankProgress& progress = job->progress(*rank);
    // Only between steps, on a set-up rank (whole() implies its runtime
    // exists: setup_done is set after it): a step in flight fails now.
    graceful = graceful && progress.whole();
    pending = std::move(progress.register_done);
    progress.register_done = nullptr;
    if (progress.claimed)
      departures_.emplace_back(job->id, job->settings.world);
    job->ranks.erase(rit);
    job->mapped_bytes -= rank->buffers->mapped_bytes();
    // The job cannot step without this rank any more; failing it also
    // ends a registration still waiting on the control plane.
    failure = job->Fail(reason);
    if (job->ranks.empty()) {
      DropJobLocked(job, !absl::EndsWith(job->failure, " deregistered"));
    }
  }
  spdlog::info("rank removed: job={} rank={} daemon={}: {}", job->id,
               RankString(rank->coords), options_.daemon_id, reason);
  // The other local ranks' registrations cannot complete any more.
  for (auto& done : failure.register_done) done(absl::AbortedError(reason));
  if (graceful) {
    // The worker is idle between steps; the DP lane finishes what it has
    // queued (the last all-gathers) while the rank lingers.
    if (rank->worker) rank->worker->StopAndJoin();
    job->CancelAfterStep(*rank);
    rank->rt->ReleaseRules();
    if (pending) pending(absl::AbortedError(reason));
    // Long enough for peers to drain what was already sent to them (at
    // most a few socket buffers) and for the queued all-gathers; short
    // enough that peers stepping on without this rank fail soon.
    absl::MutexLock lock(&mu_);
    lingering_.push_back({absl::Now() + options_.linger, job, std::move(rank)});
    return true;
  }
  // Unblocks a step still running on the rank, then joins its worker (which
  // cancels its queued calls) and unmaps its buffers when `rank` goes.
  rank->AbortComms();
  rank->FailLane(absl::AbortedError(reason));
  if (rank->worker) rank->worker->StopAndJoin();
  job->CancelAfterStep(*rank);
  if (pending) pending(absl::AbortedError(reason));
  return true;
}

bool JobRegistry::Drained(Job& job) {
  // With every rank of the job here and gone, only the lingering ranks'
  // own queued all-gathers may still need the communicators: once every
  // one of their lanes is idle, each collective has ended on every
  // participant, so no data is left unread in a connection that closes.
  // Early in single-node jobs, which is where a daemon's memory is wanted
  // back at once (a next job on the same GPU); across daemons the linger
  // stays (a peer elsewhere may still be reading).
  {
    absl::MutexLock job_lock(&job.mu);
    if (!job.ranks.empty() || job.setup_done < job.settings.world) {
      return false;
    }
  }
  for (const Lingering& l : lingering_) {
    if (l.job.get() == &job && !l.rank->LaneIdle()) return false;
  }
  return true;
}

void JobRegistry::Tick() {
  // The rank pointer keeps its trainer's pidfd open while it is polled.
  std::vector<std::tuple<std::shared_ptr<Job>, int, std::shared_ptr<LocalRank>>>
      watched;
  std::vector<std::unique_ptr<Worker>> retired;
  std::vector<std::shared_ptr<LocalRank>> expired;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return;
    retired.swap(retired_);
    const absl::Time now = absl::Now();
    for (size_t i = 0; i < lingering_.size();) {
      if (lingering_[i].until <= now || Drained(*lingering_[i].job)) {
        expired.push_back(std::move(lingering_[i].rank));
        lingering_[i] = std::move(lingering_.back());
        lingering_.pop_back();
      } else {
        ++i;
      }
    }
    for (auto& [id, job] : jobs_) {
      absl::MutexLock job_lock(&job->mu);
      for (auto& [g, r] : job->ranks) {
        if (r->trainer.pid().has_value()) watched.emplace_back(job, g, r);
      }
    }
    DropExpiredSeriesLocked(now);
  }
  for (auto& worker : retired) worker->StopAndJoin();
  for (auto& rank : expired) {
    rank->AbortComms();
    rank->FailLane(absl::AbortedError("the rank left"));
  }
  expired.clear();  // joins their DP lanes, unmaps buffers
  for (auto& [job, global, rank] : watched) {
    if (!rank->trainer.Exited()) continue;
    std::string coords;
    {
      absl::MutexLock lock(&job->mu);
      auto it = job->ranks.find(global);
      if (it == job->ranks.end()) continue;
      coords = RankString(it->second->coords);
    }
    // Its shared-memory objects too: killed (SIGKILL, the OOM killer), it
    // could not remove their names, and /dev/shm would hold them (the
    // model's size, per rank) until the node reboots.
    if (absl::Status s = rank->buffers->RemoveShmNames(); !s.ok()) {
      spdlog::warn("rank {}: its trainer's shared memory: {}", coords,
                   s.ToString());
    }
    RemoveLocalRank(
        job, global,
        absl::StrCat("the trainer of rank ", coords, " (pid ",
                     *rank->trainer.pid(), ") exited without deregistering"));
  }
  FlushDepartures();
}

void JobRegistry::DropExpiredSeriesLocked(absl::Time now) {
  for (auto it = gone_.begin(); it != gone_.end();) {
    const auto& [job_id, left] = *it;
    if (jobs_.count(job_id) > 0) {
      // Back: its series are live again (recorded anew when it leaves).
      it = gone_.erase(it);
      continue;
    }
    if (now < left + options_.metrics_retention) {
      ++it;
      continue;
    }
    if (options_.metrics != nullptr) {
      const int dropped = options_.metrics->RemoveSeries("job", job_id);
      spdlog::debug("job={}: {} series dropped from /metrics", job_id, dropped);
    }
    it = gone_.erase(it);
  }
}

void JobRegistry::FlushDepartures() {
  absl::MutexLock flush_lock(&flush_mu_);
  std::vector<std::pair<std::string, int>> departures;
  std::vector<std::string> dropped;
  {
    absl::MutexLock lock(&mu_);
    departures.swap(departures_);
    dropped.swap(dropped_);
  }
  auto never = [] { return absl::OkStatus(); };
  for (const auto& [job_id, world] : departures) {
    absl::Status s =
        JobAgreement(options_.control, job_id, never).RankLeft(world);
    if (!s.ok()) {
      spdlog::warn("job={}: counting a departure on the control plane: {}",
                   job_id, s.ToString());
    }
  }
  for (const std::string& job_id : dropped) {
    absl::Status s = JobAgreement(options_.control, job_id, never).DeleteKeys();
    if (!s.ok()) {
      spdlog::warn("job={}: deleting its control-plane keys: {}", job_id,
                   s.ToString());
    }
  }
}

void JobRegistry::Close() {
  std::vector<std::shared_ptr<Job>> jobs;
  std::vector<std::unique_ptr<Worker>> retired;
  std::vector<std::shared_ptr<LocalRank>> lingered;
  {
    absl::MutexLock lock(&mu_);
    if (closed_.exchange(true)) return;
    for (auto& [id, job] : jobs_) jobs.push_back(job);
    jobs_.clear();
    retired.swap(retired_);
    for (Lingering& l : lingering_) lingered.push_back(std::move(l.rank));
    lingering_.clear();
  }
  spdlog::info("engine shutting down: daemon={} jobs={}", options_.daemon_id,
               jobs.size());
  std::vector<std::shared_ptr<LocalRank>> ranks;
  std::vector<Callback<v1::RegisterResponse>> pending;
  for (auto& job : jobs) {
    absl::MutexLock lock(&job->mu);
    if (job->state != JobState::kFailed) {
      job->state = JobState::kFailed;
      job->failure = "canzonad is shutting down";
    }
    for (auto& [g, r] : job->ranks) {
      ranks.push_back(r);
      RankProgress& progress = job->progress(*r);
      if (progress.register_done) {
        pending.push_back(std::move(progress.register_done));
      }
      progress.register_done = nullptr;
    }
    job->cv.SignalAll();
  }
  for (auto& r : lingered) ranks.push_back(r);
  for (auto& r : ranks) r->AbortComms();
  for (auto& r : ranks) r->FailLane(Unavailable());
  for (auto& r : ranks) {
    if (r->worker) r->worker->StopAndJoin();
  }
  for (auto& job : jobs) {
    std::vector<std::shared_ptr<LocalRank>> job_ranks;
    {
      absl::MutexLock lock(&job->mu);
      for (auto& [g, r] : job->ranks) job_ranks.push_back(r);
    }
    for (auto& r : job_ranks) job->CancelAfterStep(*r);
  }
  for (auto& w : retired) w->StopAndJoin();
  for (auto& done : pending) done(Unavailable());
}

}  // namespace canzona
