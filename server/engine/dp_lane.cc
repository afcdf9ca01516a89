#include "server/engine/dp_lane.h"

#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/engine/phase_seconds.h"

namespace canzona {
DpLane::DpLane(int buckets, BucketFn reduce, BucketFn gather,
               int64_t first_step)
    : buckets_(buckets),
      reduce_(std::move(reduce)),
      gather_(std::move(gather)),
      posting_step_(first_step),
      reduced_through_(first_step - 1),
      gathers_started_(first_step - 1),
      gathered_(buckets, first_step - 1) {
  thread_ = std::thread([this] { Loop(); });
}

DpLane::~DpLane() {
  Fail(absl::UnavailableError("the rank's communication thread stopped"));
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    cv_.SignalAll();
  }
  if (!thread_.joinable()) return;
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();  // the last owner let go inside a reduce or gather
  } else {
    thread_.join();
  }
}

void DpLane::MarkReady(int64_t k, absl::Span<const int> buckets) {
  absl::MutexLock lock(&mu_);
  if (k < posting_step_ || !error_.ok()) return;
  std::vector<char>& ready = ready_[k];
  ready.resize(buckets_, 0);
  for (int b : buckets) {
    if (b >= 0 && b < buckets_) ready[b] = 1;
  }
  PostReadyLocked();
}

void DpLane::MarkAllReady(int64_t k) {
  absl::MutexLock lock(&mu_);
  if (k < posting_step_ || !error_.ok()) return;
  ready_[k].assign(buckets_, 1);
  PostReadyLocked();
}

void DpLane::PostReadyLocked() {
  // Wakes the thread for whatever the caller queued too.
  cv_.SignalAll();
  while (error_.ok() && gathers_started_ >= posting_step_ - 1) {
    auto it = ready_.find(posting_step_);
    if (it == ready_.end()) return;
    const std::vector<char>& ready = it->second;
    while (posted_ < buckets_ && ready[posted_]) {
      queue_.push_back({posting_step_, posted_, true, true});
      ++posted_;
    }
    if (posted_ < buckets_) break;
    if (buckets_ == 0) reduced_through_ = posting_step_;
    ready_.erase(it);
    ++posting_step_;
    posted_ = 0;
  }
}

absl::Status DpLane::WaitReduced(int64_t k, absl::Time deadline,
                                 double* waited_s) {
  const absl::Time start = absl::Now();
  absl::MutexLock lock(&mu_);
  while (reduced_through_ < k && error_.ok()) {
    if (cv_.WaitWithDeadline(&mu_, deadline)) break;
  }
  const double waited = Seconds(start, absl::Now());
  exposed_s_ += waited;
  if (waited_s != nullptr) *waited_s = waited;
  if (!error_.ok()) return error_;
  if (reduced_through_ < k) {
    return absl::DeadlineExceededError(
        absl::StrCat("step ", k, ": the DP gradient reduction did not finish ",
                     "in time (", reduced_through_, " steps reduced)"));
  }
  return absl::OkStatus();
}

void DpLane::StartGathers(int64_t k, std::vector<int> order, bool communicate) {
  absl::MutexLock lock(&mu_);
  if (!error_.ok() || k <= gathers_started_) return;
  gathers_started_ = k;
  for (int b : order) queue_.push_back({k, b, false, communicate});
  PostReadyLocked();
}

bool DpLane::GatheredLocked(int64_t k, int bucket) const {
  if (bucket >= 0) return gathered_[bucket] >= k;
  for (int64_t g : gathered_) {
    if (g < k) return false;
  }
  return true;
}

absl::Status DpLane::WaitGathered(int64_t k, absl::Time deadline,
                                  double* waited_s) {
  const absl::Time start = absl::Now();
  absl::MutexLock lock(&mu_);
  while (!GatheredLocked(k, -1) && error_.ok()) {
    if (cv_.WaitWithDeadline(&mu_, deadline)) break;
  }
  const double waited = Seconds(start, absl::Now());
  exposed_s_ += waited;
  if (waited_s != nullptr) *waited_s = waited;
  if (!error_.ok()) return error_;
  if (!GatheredLocked(k, -1)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "step ", k, ": the DP parameter all-gather did not finish in time"));
  }
  return absl::OkStatus();
}

void DpLane::WhenGathered(int64_t k, int bucket, Done done) {
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (error_.ok() && !GatheredLocked(k, bucket)) {
      waiters_.push_back({k, bucket, absl::Now(), std::move(done)});
      return;
    }
    status = error_;
  }
  done(std::move(status), 0.0);
}

int64_t DpLane::gathers_started() const {
  absl::MutexLock lock(&mu_);
  return gathers_started_;
}

void DpLane::WaitIdle() {
  absl::MutexLock lock(&mu_);
  while (!queue_.empty() || running_) cv_.Wait(&mu_);
}

bool DpLane::Idle() const {
  absl::MutexLock lock(&mu_);
  return queue_.empty() && !running_;
}

absl::Status DpLane::RunOnLane(const std::function<absl::Status()>& fn) {
  absl::Status status;
  bool ran = false;
  Task task;
  task.run = fn;
  task.result = &status;
  task.ran = &ran;
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    return absl::UnavailableError("the rank's communication thread stopped");
  }
  queue_.push_back(std::move(task));
  cv_.SignalAll();
  while (!ran) cv_.Wait(&mu_);
  return status;
}

void DpLane::DropCollectivesLocked() {
  std::erase_if(queue_, [](const Task& t) { return !t.run; });
}

void DpLane::Reset(int64_t last_step) {
  std::vector<std::pair<Waiter, absl::Status>> finished;
  {
    absl::MutexLock lock(&mu_);
    ready_.clear();
    posting_step_ = last_step + 1;
    posted_ = 0;
    reduced_through_ = last_step;
    gathers_started_ = last_step;
    gathered_.assign(buckets_, last_step);
    finished = TakeFinishedLocked();
    cv_.SignalAll();
  }
  Finish(std::move(finished));
}

void DpLane::Fail(absl::Status status) {
  std::vector<std::pair<Waiter, absl::Status>> finished;
  {
    absl::MutexLock lock(&mu_);
    if (error_.ok()) error_ = std::move(status);
    DropCollectivesLocked();
    ready_.clear();
    finished = TakeFinishedLocked();
    cv_.SignalAll();
  }
  Finish(std::move(finished));
}

void DpLane::TakeTimes(double* comm_s, double* exposed_s) {
  absl::MutexLock lock(&mu_);
  *comm_s = comm_s_;
  *exposed_s = exposed_s_;
  comm_s_ = exposed_s_ = 0;
}

std::vector<std::pair<DpLane::Waiter, absl::Status>>
DpLane::TakeFinishedLocked() {
  std::vector<std::pair<Waiter, absl::Status>> finished;
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < waiters_.size();) {
    if (!error_.ok() || GatheredLocked(waiters_[i].step, waiters_[i].bucket)) {
      exposed_s_ += Seconds(waiters_[i].since, now);
      finished.emplace_back(std::move(waiters_[i]), error_);
      waiters_[i] = std::move(waiters_.back());
      waiters_.pop_back();
    } else {
      ++i;
    }
  }
  return finished;
}

void DpLane::Finish(std::vector<std::pair<Waiter, absl::Status>> finished) {
  const absl::Time now = absl::Now();
  for (auto& [waiter, status] : finished) {
    waiter.done(std::move(status), Seconds(waiter.since, now));
  }
}

void DpLane::Loop() {
  while (true) {
    Task task;
    {
      absl::MutexLock lock(&mu_);
      while (queue_.empty() && !stopping_) cv_.Wait(&mu_);
      if (stopping_) {
        // RunOnLane's waiters get an answer, not a hang.
        for (const Task& t : queue_) {
          if (!t.run) continue;
          *t.result =
              absl::UnavailableError("the rank's communication thread stopped");
          *t.ran = true;
        }
        queue_.clear();
        cv_.SignalAll();
        return;
      }
      task = queue_.front();
      queue_.pop_front();
      running_ = true;
    }
    if (task.run) {
      absl::Status result = task.run();
      absl::MutexLock lock(&mu_);
      running_ = false;
      *task.result = std::move(result);
      *task.ran = true;
      cv_.SignalAll();
      continue;
    }
    const absl::Time start = absl::Now();
    absl::Status status;
    if (task.communicate) {
      status = task.reduce ? reduce_(task.step, task.bucket)
                           : gather_(task.step, task.bucket);
    }
    const double took = Seconds(start, absl::Now());
    std::vector<std::pair<Waiter, absl::Status>> finished;
    {
      absl::MutexLock lock(&mu_);
      running_ = false;
      if (task.communicate) comm_s_ += took;
      if (!status.ok()) {
        if (error_.ok()) error_ = std::move(status);
        DropCollectivesLocked();
        ready_.clear();
      } else if (error_.ok()) {
        if (task.reduce) {
          if (task.bucket == buckets_ - 1) reduced_through_ = task.step;
        } else {
          gathered_[task.bucket] = task.step;
        }
      }
      finished = TakeFinishedLocked();
      cv_.SignalAll();
    }
    Finish(std::move(finished));
  }
}

}  // namespace canzona
