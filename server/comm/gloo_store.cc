#include "server/comm/gloo_store.h"

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gloo/common/error.h"

namespace canzona {

GlooStore::GlooStore(KvStore* store, std::string prefix, absl::Duration timeout)
    : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}

void GlooStore::Fail(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (first_error_.ok()) first_error_ = status;
  }
  throw gloo::IoException(absl::StrCat("canzona KvStore: ", status.ToString()));
}

void GlooStore::set(const std::string& key, const std::vector<char>& data) {
  absl::Status status =
      store_->Set(Key(key), std::string(data.begin(), data.end()));
  if (!status.ok()) Fail(status);
}

std::vector<char> GlooStore::get(const std::string& key) {
  absl::StatusOr<std::string> value = store_->Get(Key(key), timeout_);
  if (!value.ok()) Fail(value.status());
  return std::vector<char>(value->begin(), value->end());
}

void GlooStore::wait(const std::vector<std::string>& keys) {
  wait(keys, absl::ToChronoMilliseconds(timeout_));
}

void GlooStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const std::string& key : keys) full.push_back(Key(key));
  // Gloo passes zero for "no timeout" (gloo::kNoTimeout); ours is bounded.
  absl::Duration d = timeout.count() > 0 ? absl::FromChrono(timeout) : timeout_;
  absl::Status status = store_->Wait(full, d);
  if (!status.ok()) Fail(status);
}

absl::Status GlooStore::first_error() const {
  absl::MutexLock lock(&mu_);
  return first_error_;
}

}  // namespace canzona
