#include "tests/unit/comm/file_kv_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace canzona::testing {
namespace {

constexpr absl::Duration kPoll = absl::Milliseconds(1);

}  // namespace

FileKvStore::FileKvStore(std::string dir) : dir_(std::move(dir)) {}

std::string FileKvStore::PathOf(const std::string& key) const {
  // Hex keeps '/' and friends out of file names.
  return absl::StrCat(dir_, "/k_", absl::BytesToHexString(key));
}

absl::StatusOr<std::string> FileKvStore::TryRead(const std::string& key) const {
  std::ifstream in(PathOf(key), std::ios::binary);
  if (!in) return absl::NotFoundError(key);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

absl::Status FileKvStore::Set(const std::string& key,
                              const std::string& value) {
  static std::atomic<int> counter{0};
  const std::string tmp =
      absl::StrCat(dir_, "/tmp_", getpid(), "_", counter.fetch_add(1));
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << value;
    if (!out.flush()) {
      return absl::InternalError(absl::StrCat("FileKvStore: write ", tmp));
    }
  }
  if (std::rename(tmp.c_str(), PathOf(key).c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("FileKvStore: rename: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> FileKvStore::Get(const std::string& key,
                                             absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<std::string> value = TryRead(key);
    if (value.ok()) return value;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("FileKvStore: key '", key, "' not set within ",
                       absl::FormatDuration(timeout)));
    }
    absl::SleepFor(kPoll);
  }
}

absl::Status FileKvStore::Wait(absl::Span<const std::string> keys,
                               absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (const std::string& key : keys) {
    absl::StatusOr<std::string> value =
        Get(key, std::max(absl::ZeroDuration(), deadline - absl::Now()));
    if (!value.ok()) return value.status();
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> FileKvStore::Add(const std::string& key,
                                         int64_t delta) {
  const std::string lock_path = dir_ + "/lock";
  int fd = open(lock_path.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0) return absl::InternalError("FileKvStore: open lock");
  flock(fd, LOCK_EX);
  int64_t value = 0;
  absl::StatusOr<std::string> old = TryRead(key);
  absl::Status status;
  if (old.ok() && !absl::SimpleAtoi(*old, &value)) {
    status = absl::InvalidArgumentError(
        absl::StrCat("FileKvStore: value of '", key, "' is not an integer"));
  } else {
    value += delta;
    status = Set(key, absl::StrCat(value));
  }
  flock(fd, LOCK_UN);
  close(fd);
  if (!status.ok()) return status;
  return value;
}

absl::Status FileKvStore::DeletePrefix(const std::string& prefix) {
  const std::string hex_prefix = "k_" + absl::BytesToHexString(prefix);
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    if (absl::StartsWith(entry.path().filename().string(), hex_prefix)) {
      std::filesystem::remove(entry.path(), ec);
    }
  }
  return absl::OkStatus();
}

}  // namespace canzona::testing
