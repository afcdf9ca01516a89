#include "server/control/kv_store.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace canzona {

absl::Status InMemoryKvStore::Set(const std::string& key,
                                  const std::string& value) {
  absl::MutexLock lock(&mu_);
  values_[key] = value;
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
  absl::MutexLock lock(&mu_);
  int64_t current = 0;
  auto it = values_.find(key);
  if (it != values_.end() && !absl::SimpleAtoi(it->second, &current)) {
    return absl::InvalidArgumentError(
        absl::StrCat("key \"", key, "\" does not hold an integer"));
  }
  current += delta;
  values_[key] = absl::StrCat(current);
  return current;
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
