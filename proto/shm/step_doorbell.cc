#include "proto/shm/step_doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
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
};

namespace {

constexpr uint32_t kMagic = 0x42445a43;  // "CZDB"
constexpr uint32_t kVersion = 1;
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

}  // namespace

uint64_t StepDoorbell::ObjectBytes() {
  return kHeaderBytes + 2 * static_cast<uint64_t>(kMaxPayloadBytes);
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
  StepDoorbell bell(*std::move(shm));
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
  StepDoorbell bell(std::move(shm));
  const Header& h = bell.header();
  if (h.magic != kMagic || h.version != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory '", bell.name(),
        "' is not a step doorbell of protocol version ", kVersion));
  }
  // Requests the trainer sent before attaching are not answered.
  bell.last_request_ =
      bell.header().request_seq.load(std::memory_order_acquire);
  return bell;
}

absl::StatusOr<std::string> StepDoorbell::Call(absl::string_view request,
                                               absl::Time deadline,
                                               absl::Duration daemon_silence) {
  if (request.size() > kMaxPayloadBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("step request of ", request.size(),
                     " bytes exceeds the doorbell's ", kMaxPayloadBytes));
  }
  Header& h = header();
  std::memcpy(request_area(), request.data(), request.size());
  h.request_bytes = static_cast<uint32_t>(request.size());
  const uint32_t seq = h.request_seq.load(std::memory_order_relaxed) + 1;
  h.request_seq.store(seq, std::memory_order_release);
  FutexWakeAll(h.request_seq);

  uint32_t beat = h.heartbeat.load(std::memory_order_relaxed);
  absl::Time beat_seen = absl::Now();
  while (true) {
    const uint32_t answered = h.response_seq.load(std::memory_order_acquire);
    if (answered == seq) break;
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          "the daemon did not answer the step doorbell before the deadline");
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
  return Request{seq, std::string(request_area(), bytes)};
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
