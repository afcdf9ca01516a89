#include "proto/shared_memory/step_doorbell.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace canzona {

// The object: this header, then the request area, then the response area.
// The sequence words are futexes shared between processes (no
// FUTEX_PRIVATE_FLAG).
struct StepDoorbell::Header {
  uint32_t magic;
  uint32_t version;
  // Trainer: bumped (release) after the request area and request_bytes
  // are written.
  std::atomic<uint32_t> request_seq;
  // Daemon: set to the answered request's seq (release) after the response
  // area, response_bytes and status_code are written.
  std::atomic<uint32_t> response_seq;
  // Daemon: counts up while it serves the doorbell (liveness for Call).
  std::atomic<uint32_t> heartbeat;
  uint32_t request_bytes;
  uint32_t response_bytes;
  int32_t status_code;
  // Trainer: the request's Method, written with request_bytes.
  uint32_t request_method;
};

namespace {

constexpr uint32_t kMagic = 0x42445a43;  // "CZDB"
// 2: the daemon holds the serving lock (a version 1 daemon would not, and
// a trainer would take it for gone), and a request carries its Method.
constexpr uint32_t kVersion = 2;
constexpr uint64_t kHeaderBytes = 4096;
static_assert(std::atomic<uint32_t>::is_always_lock_free);

// How often a waiting trainer looks at the deadline and the heartbeat.
constexpr absl::Duration kCallTick = absl::Milliseconds(50);

uint32_t* Word(std::atomic<uint32_t>& word) {
  return reinterpret_cast<uint32_t*>(&word);
}

// Sleeps while `word` holds `expected`, at most `timeout`. Spurious and
// early returns are fine: every caller re-reads the word.
void FutexWait(std::atomic<uint32_t>& word, uint32_t expected,
               absl::Duration timeout) {
  const timespec ts = absl::ToTimespec(std::max(timeout, absl::ZeroDuration()));
  syscall(SYS_futex, Word(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, Word(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// The object `name` opened again, for flock(2) only.
absl::StatusOr<int> OpenForLock(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) {
    return ErrnoStatus("shm_open (serving lock)", name, errno);
  }
  return fd;
}

}  // namespace

uint64_t StepDoorbell::ObjectBytes() {
  return kHeaderBytes + 2 * static_cast<uint64_t>(kMaxPayloadBytes);
}

StepDoorbell& StepDoorbell::operator=(StepDoorbell&& other) noexcept {
  if (this != &other) {
    if (lock_fd_ >= 0) ::close(lock_fd_);
    shm_ = std::move(other.shm_);
    lock_fd_ = std::exchange(other.lock_fd_, -1);
    last_request_ = other.last_request_;
  }
  return *this;
}

StepDoorbell::~StepDoorbell() {
  // Closing the last descriptor of the daemon's open file drops its lock.
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

StepDoorbell::Header& StepDoorbell::header() const {
  return *static_cast<Header*>(shm_.data());
}

char* StepDoorbell::request_area() const {
  return static_cast<char*>(shm_.data()) + kHeaderBytes;
}

char* StepDoorbell::response_area() const {
  return request_area() + kMaxPayloadBytes;
}

absl::StatusOr<StepDoorbell> StepDoorbell::Create(const std::string& name) {
  absl::StatusOr<SharedMemory> shm = SharedMemory::Create(name, ObjectBytes());
  if (!shm.ok()) return shm.status();
  absl::StatusOr<int> lock_fd = OpenForLock(name);
  if (!lock_fd.ok()) return lock_fd.status();
  StepDoorbell bell(*std::move(shm), *lock_fd);
  // The object is zero-filled: the atomics start at 0.
  Header& h = bell.header();
  h.magic = kMagic;
  h.version = kVersion;
  return bell;
}

absl::StatusOr<StepDoorbell> StepDoorbell::Attach(SharedMemory shm) {
  if (shm.size() != ObjectBytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory '", shm.name(), "' is ", shm.size(),
                     " bytes, not a step doorbell (", ObjectBytes(), ")"));
  }
  const Header& h = *static_cast<const Header*>(shm.data());
  if (h.magic != kMagic || h.version != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory '", shm.name(),
        "' is not a step doorbell of protocol version ", kVersion));
  }
  absl::StatusOr<int> lock_fd = OpenForLock(shm.name());
  if (!lock_fd.ok()) return lock_fd.status();
  StepDoorbell bell(std::move(shm), *lock_fd);
  // Shared: a new daemon-side doorbell for the same object (a replaced
  // attachment) takes it while the old one still holds it.
  if (::flock(bell.lock_fd_, LOCK_SH | LOCK_NB) != 0) {
    return ErrnoStatus("flock (serving lock)", bell.name(), errno);
  }
  // Requests the trainer sent before attaching are not answered.
  bell.last_request_ =
      bell.header().request_seq.load(std::memory_order_acquire);
  return bell;
}

bool StepDoorbell::DaemonHoldsLock() const {
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) == 0) {
    ::flock(lock_fd_, LOCK_UN);
    return false;
  }
  // EWOULDBLOCK: held. Any other error says nothing about the daemon, so
  // the heartbeat decides.
  return true;
}

absl::StatusOr<std::string> StepDoorbell::Call(Method method,
                                               absl::string_view request,
                                               absl::Time deadline,
                                               absl::Duration daemon_silence) {
  if (request.size() > kMaxPayloadBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("doorbell request of ", request.size(),
                     " bytes exceeds the doorbell's ", kMaxPayloadBytes));
  }
  Header& h = header();
  std::memcpy(request_area(), request.data(), request.size());
  h.request_bytes = static_cast<uint32_t>(request.size());
  h.request_method = static_cast<uint32_t>(method);
  const uint32_t seq = h.request_seq.load(std::memory_order_relaxed) + 1;
  h.request_seq.store(seq, std::memory_order_release);
  FutexWakeAll(h.request_seq);

  uint32_t beat = h.heartbeat.load(std::memory_order_relaxed);
  absl::Time beat_seen = absl::Now();
  // The lock is probed only once a wait did not bring the answer, so a
  // prompt step costs no extra system call.
  bool waited = false;
  while (true) {
    const uint32_t answered = h.response_seq.load(std::memory_order_acquire);
    if (answered == seq) break;
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          "the daemon did not answer the step doorbell before the deadline");
    }
    if (waited && !DaemonHoldsLock()) {
      return absl::UnavailableError(
          absl::StrCat("canzonad no longer serves the step doorbell '", name(),
                       "' (it exited or detached the doorbell)"));
    }
    if (const uint32_t b = h.heartbeat.load(std::memory_order_relaxed);
        b != beat) {
      beat = b;
      beat_seen = now;
    } else if (now - beat_seen > daemon_silence) {
      return absl::UnavailableError(absl::StrCat(
          "canzonad stopped serving the step doorbell '", name(),
          "' (no heartbeat for ", absl::FormatDuration(daemon_silence), ")"));
    }
    FutexWait(h.response_seq, answered, std::min(kCallTick, deadline - now));
    waited = true;
  }
  const uint32_t bytes = std::min(h.response_bytes, kMaxPayloadBytes);
  std::string payload(response_area(), bytes);
  const int32_t code = h.status_code;
  if (code == 0) return payload;
  if (code < 0 ||
      code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::UnknownError(
        absl::StrCat("doorbell status ", code, ": ", payload));
  }
  return absl::Status(static_cast<absl::StatusCode>(code), payload);
}

std::optional<StepDoorbell::Request> StepDoorbell::WaitRequest(
    absl::Duration tick) {
  Header& h = header();
  Heartbeat();
  uint32_t seq = h.request_seq.load(std::memory_order_acquire);
  if (seq == last_request_) {
    FutexWait(h.request_seq, seq, tick);
    seq = h.request_seq.load(std::memory_order_acquire);
    if (seq == last_request_) return std::nullopt;
  }
  last_request_ = seq;
  // Untrusted: a size past the area is cut to it (the parse then fails).
  const uint32_t bytes = std::min(h.request_bytes, kMaxPayloadBytes);
  return Request{seq, h.request_method, std::string(request_area(), bytes)};
}

void StepDoorbell::Respond(uint32_t seq, const absl::Status& status,
                           absl::string_view response) {
  Header& h = header();
  absl::string_view payload = status.ok() ? response : status.message();
  payload = payload.substr(0, kMaxPayloadBytes);
  std::memcpy(response_area(), payload.data(), payload.size());
  h.response_bytes = static_cast<uint32_t>(payload.size());
  h.status_code = static_cast<int32_t>(status.code());
  h.response_seq.store(seq, std::memory_order_release);
  FutexWakeAll(h.response_seq);
}

void StepDoorbell::WakeWaiter() { FutexWakeAll(header().request_seq); }

void StepDoorbell::Heartbeat() {
  header().heartbeat.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace canzona
