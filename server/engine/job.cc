#include "server/engine/job.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/names/rank_names.h"
#include "server/engine/register_request.h"
#include "spdlog/spdlog.h"

namespace canzona {

LocalRank::LocalRank(canzona::v1::RankCoordinates coords, int global,
                     TrainerProcess trainer,
                     std::unique_ptr<TrainerBuffers> buffers)
    : coords(std::move(coords)),
      global(global),
      trainer(std::move(trainer)),
      buffers(std::move(buffers)) {}

LocalRank::~LocalRank() {
  lane_.reset();  // joined first, as the declaration order had it
  // Device work of the rank still queued (a stream stuck behind the
  // trainer's event, the step that timed out) may read the trainer's IPC
  // mappings: they stay open rather than closed under it.
  if (rt != nullptr && buffers != nullptr && !rt->DeviceWorkFinished()) {
    spdlog::warn("rank {}: device work did not finish; the trainer's CUDA "
                 "IPC mappings stay open",
                 global);
    buffers->AbandonMappings();
  }
}

void LocalRank::AddComm(Communicator* comm) {
  absl::MutexLock lock(&comm_mu_);
  comms_.push_back(comm);
  if (aborted_) comm->Abort();
}

void LocalRank::AbortComms() {
  absl::MutexLock lock(&comm_mu_);
  aborted_ = true;
  for (Communicator* c : comms_) c->Abort();
}

void LocalRank::ForgetComms() {
  absl::MutexLock lock(&comm_mu_);
  comms_.clear();
}

void LocalRank::SetLane(std::unique_ptr<DpLane> lane) {
  absl::MutexLock lock(&comm_mu_);
  lane_ = std::move(lane);
  if (aborted_) lane_->Fail(absl::AbortedError("the rank was aborted"));
}

void LocalRank::FailLane(const absl::Status& status) {
  absl::MutexLock lock(&comm_mu_);
  if (lane_) lane_->Fail(status);
}

bool LocalRank::LaneIdle() {
  absl::MutexLock lock(&comm_mu_);
  return lane_ == nullptr || lane_->Idle();
}

Job::Job(std::string id, std::string token, JobSettings settings)
    : id(std::move(id)),
      token(std::move(token)),
      settings(std::move(settings)) {}

bool Job::failed() {
  absl::MutexLock lock(&mu);
  return state == JobState::kFailed;
}

absl::Status Job::FailedError() {
  absl::MutexLock lock(&mu);
  return absl::AbortedError(absl::StrCat("job failed: ", failure));
}

std::shared_ptr<const JobPlan> Job::current_plan() {
  absl::MutexLock lock(&mu);
  return plan;
}

std::string Job::StateString() {
  switch (state) {
    case JobState::kRegistering:
      return "registering";
    case JobState::kReady:
      return "ready";
    case JobState::kFailed:
      return absl::StrCat("failed: ", failure);
  }
  return "unknown";
}

Job::Failure Job::Fail(const std::string& why) {
  Failure out;
  if (state == JobState::kFailed) return out;
  out.first = true;
  state = JobState::kFailed;
  failure = why;
  for (auto& [g, r] : ranks) {
    out.ranks.push_back(r);
    RankProgress& p = progress(*r);
    if (p.register_done)
      out.register_done.push_back(std::move(p.register_done));
    p.register_done = nullptr;
  }
  cv.SignalAll();
  return out;
}

absl::Status Job::AwaitLocalArrivals(int64_t k, absl::Time deadline,
                                     absl::Duration timeout,
                                     const std::atomic<bool>& stop) {
  absl::MutexLock lock(&mu);
  const int local = static_cast<int>(ranks.size());
  while (arrivals[k] < local && state == JobState::kReady && !stop) {
    if (cv.WaitWithDeadline(&mu, deadline)) break;
  }
  const bool all = arrivals[k] >= local;
  if (++departures[k] >= local) {
    arrivals.erase(k);
    departures.erase(k);
  }
  if (stop) return absl::UnavailableError("canzonad is shutting down");
  if (state == JobState::kFailed) {
    return absl::AbortedError(
        absl::StrCat("step ", k, " aborted: job failed: ", failure));
  }
  if (!all) {
    std::vector<std::string> missing;
    for (const auto& [g, r] : ranks) {
      if (progress(*r).next_step <= k) missing.push_back(RankString(r->coords));
    }
    return absl::DeadlineExceededError(absl::StrCat(
        "step ", k, ": local rank(s) ", absl::StrJoin(missing, ", "),
        " did not call Step within ", absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

std::vector<Worker::Task> Job::TakeAfterStep(LocalRank& rank, int64_t k) {
  std::vector<Worker::Task> tasks;
  absl::MutexLock lock(&mu);
  auto& after = progress(rank).after_step;
  auto end = k < 0 ? after.end() : after.upper_bound(k);
  for (auto it = after.begin(); it != end; ++it) {
    for (Worker::Task& task : it->second) tasks.push_back(std::move(task));
  }
  after.erase(after.begin(), end);
  return tasks;
}

absl::StatusOr<canzona::v1::StepResponse> Job::CompletedStep(LocalRank& rank,
                                                             int64_t k) {
  absl::MutexLock lock(&mu);
  const RankProgress& p = progress(rank);
  if (p.steps_done != k) {
    return absl::AbortedError(
        absl::StrCat("step ", k, " did not complete: job failed: ", failure));
  }
  return p.last_response;
}

void Job::CancelAfterStep(LocalRank& rank) {
  for (Worker::Task& task : TakeAfterStep(rank, -1)) task.cancel();
}

}  // namespace canzona
