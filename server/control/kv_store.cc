#include "server/control/kv_store.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace canzona {

InMemoryKvStore::InMemoryKvStore(int64_t max_pending_waits)
    : max_pending_waits_(max_pending_waits), timer_([this] { TimerLoop(); }) {}

InMemoryKvStore::~InMemoryKvStore() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    timer_cv_.Signal();
  }
  timer_.join();
  CancelWaits();
}

void InMemoryKvStore::CancelWaits() {
  std::list<Waiter> cancelled;
  {
    absl::MutexLock lock(&mu_);
    cancelled.swap(waiters_);
  }
  for (Waiter& waiter : cancelled) {
    waiter.done(absl::CancelledError(absl::StrCat(
        "key \"", waiter.key, "\": the wait was cancelled (shutdown)")));
  }
}

void InMemoryKvStore::TimerLoop() {
  mu_.Lock();
  while (!stopping_) {
    absl::Time next = absl::InfiniteFuture();
    for (const Waiter& waiter : waiters_)
      next = std::min(next, waiter.deadline);
    timer_cv_.WaitWithDeadline(&mu_, next);
    const absl::Time now = absl::Now();
    std::list<Waiter> expired;
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      auto current = it++;
      if (current->deadline <= now) {
        expired.splice(expired.end(), waiters_, current);
      }
    }
    if (expired.empty()) continue;
    mu_.Unlock();
    for (Waiter& waiter : expired) {
      waiter.done(absl::DeadlineExceededError(
          absl::StrCat("key \"", waiter.key, "\" not set in time")));
    }
    mu_.Lock();
  }
  mu_.Unlock();
}

void InMemoryKvStore::GetAsync(const std::string& key, absl::Duration timeout,
                               GetCallback done) {
  absl::StatusOr<std::string> ready = absl::UnknownError("");
  {
    absl::MutexLock lock(&mu_);
    auto it = values_.find(key);
    if (it != values_.end()) {
      ready = it->second;
    } else if (stopping_) {
      ready = absl::CancelledError("the store is shutting down");
    } else if (timeout <= absl::ZeroDuration()) {
      ready = absl::DeadlineExceededError(
          absl::StrCat("key \"", key, "\" is not set"));
    } else if (static_cast<int64_t>(waiters_.size()) >= max_pending_waits_) {
      ready = absl::ResourceExhaustedError(
          absl::StrCat("too many pending waits (", max_pending_waits_,
                       ") for key \"", key, "\""));
    } else {
      waiters_.push_back({key, absl::Now() + timeout, std::move(done)});
      timer_cv_.Signal();
      return;
    }
  }
  done(std::move(ready));
}

void InMemoryKvStore::WaitAsync(std::vector<std::string> keys,
                                absl::Duration timeout, WaitCallback done) {
  if (keys.empty()) {
    done(absl::OkStatus());
    return;
  }
  // Wait for the last key, then for the rest with what is left of the
  // timeout: each step is one GetAsync, so no thread ever blocks.
  const absl::Time deadline = absl::Now() + timeout;
  std::string key = std::move(keys.back());
  keys.pop_back();
  GetAsync(key, timeout,
           [this, keys = std::move(keys), deadline,
            done = std::move(done)](absl::StatusOr<std::string> value) mutable {
             if (!value.ok()) {
               done(value.status());
               return;
             }
             WaitAsync(std::move(keys), deadline - absl::Now(),
                       std::move(done));
           });
}

std::list<InMemoryKvStore::Waiter> InMemoryKvStore::TakeWaitersLocked(
    const std::string& key) {
  std::list<Waiter> ready;
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    auto current = it++;
    if (current->key == key) ready.splice(ready.end(), waiters_, current);
  }
  return ready;
}

absl::Status InMemoryKvStore::Set(const std::string& key,
                                  const std::string& value) {
  std::list<Waiter> ready;
  {
    absl::MutexLock lock(&mu_);
    values_[key] = value;
    ready = TakeWaitersLocked(key);
  }
  for (Waiter& waiter : ready) waiter.done(value);
  return absl::OkStatus();
}

absl::StatusOr<std::string> InMemoryKvStore::Get(const std::string& key,
                                                 absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto present = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return values_.count(key) > 0;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&present), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "key \"", key, "\" not set within ", absl::FormatDuration(timeout)));
  }
  return values_[key];
}

absl::Status InMemoryKvStore::Wait(absl::Span<const std::string> keys,
                                   absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (const std::string& key : keys) {
    absl::StatusOr<std::string> value =
        Get(key, std::max(absl::ZeroDuration(), deadline - absl::Now()));
    if (!value.ok()) return value.status();
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> InMemoryKvStore::Add(const std::string& key,
                                             int64_t delta) {
  int64_t current = 0;
  std::string value;
  std::list<Waiter> ready;
  {
    absl::MutexLock lock(&mu_);
    auto it = values_.find(key);
    if (it != values_.end() && !absl::SimpleAtoi(it->second, &current)) {
      return absl::InvalidArgumentError(
          absl::StrCat("key \"", key, "\" does not hold an integer"));
    }
    current += delta;
    value = absl::StrCat(current);
    values_[key] = value;
    ready = TakeWaitersLocked(key);
  }
  for (Waiter& waiter : ready) waiter.done(value);
  return current;
}

std::vector<std::string> InMemoryKvStore::Keys() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> keys;
  for (const auto& [key, value] : values_) keys.push_back(key);
  return keys;
}

absl::Status InMemoryKvStore::DeletePrefix(const std::string& prefix) {
  absl::MutexLock lock(&mu_);
  auto it = values_.lower_bound(prefix);
  while (it != values_.end() && absl::StartsWith(it->first, prefix)) {
    it = values_.erase(it);
  }
  return absl::OkStatus();
}

}  // namespace canzona
