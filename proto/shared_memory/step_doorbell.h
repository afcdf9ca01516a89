// StepDoorbell: a one-slot request/response channel in a shared-memory
// object, woken with futexes, that carries a local trainer's step calls
// (Step, and the overlap mode's GradReady and WaitParams) to its daemon
// without gRPC. A unary gRPC call completed from the daemon's
// worker thread costs ~0.2 ms on a small VM (gRPC's floor plus a
// cross-thread completion); the doorbell costs two futex wake-ups. Like the
// tensor buffers, it is part of the trainer <-> daemon protocol, so both
// sides link this one implementation.
//
// The bytes are the call's serialized canzona.v1 request (StepRequest,
// GradReadyRequest, WaitParamsRequest: the Method word says which) one way
// and a status plus its serialized response the other: the daemon parses
// what it reads exactly as the gRPC adapter does, so there is one path
// behind both.
//
//   // trainer (creates the object; attaches it with AttachStepDoorbell)
//   CANZONA_ASSIGN_OR_RETURN(StepDoorbell bell, StepDoorbell::Create(name));
//   CANZONA_ASSIGN_OR_RETURN(std::string reply,
//       bell.Call(request_bytes, deadline, /*daemon_gone=*/...));
//   // daemon (maps the trainer's object; one thread serves it)
//   CANZONA_ASSIGN_OR_RETURN(StepDoorbell bell, StepDoorbell::Attach(shm));
//   if (auto request = bell.WaitRequest(absl::Milliseconds(100))) {
//     ... bell.Respond(request->seq, status, response_bytes);
//   }
//
// Everything the daemon reads from the object is untrusted: sizes are
// bounded and the bytes are copied out before they are parsed.
//
// Liveness: while a daemon serves the doorbell it holds a shared flock(2)
// on the object, which the kernel drops the moment the daemon exits,
// however it exits, and which works across PID namespaces (a trainer pod
// and a DaemonSet pod share only the file). A waiting trainer that can take
// the lock exclusively knows nobody serves it and fails within a tick, not
// after the heartbeat's silence; the heartbeat still catches a daemon
// that is alive but stuck.
//
// Thread-safety: one trainer thread calls Call at a time; one daemon thread
// calls WaitRequest and Respond, Heartbeat may come from any daemon thread.
// The object's words are atomics; the payload areas are handed over by the
// sequence numbers (release / acquire).
#ifndef CANZONA_PROTO_SHARED_MEMORY_STEP_DOORBELL_H_
#define CANZONA_PROTO_SHARED_MEMORY_STEP_DOORBELL_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/shared_memory/shared_memory.h"

namespace canzona {

class StepDoorbell {
 public:
  // The largest request / response payload (a StepRequest with a few
  // hundred per-group learning rates fits many times over).
  static constexpr uint32_t kMaxPayloadBytes = 64 * 1024;
  // How long the trainer waits without a daemon heartbeat before it gives
  // up (the daemon beats every WaitRequest tick and while a step runs).
  static constexpr absl::Duration kDaemonSilence = absl::Seconds(10);

  // Which call a request is (its word in the object; values are
  // protocol).
  enum class Method : uint32_t { kStep = 0, kGradReady = 1, kWaitParams = 2 };

  struct Request {
    uint32_t seq;
    // Untrusted: any value the trainer wrote, named or not.
    uint32_t method;
    std::string bytes;
  };

  // Trainer: creates and initializes the object (SharedMemory::Create:
  // mode 0600, unlinked when the doorbell is destroyed).
  static absl::StatusOr<StepDoorbell> Create(const std::string& name);
  // Daemon: takes a mapped object; INVALID_ARGUMENT unless it is a
  // doorbell of this protocol version and size. Holds the serving lock
  // until the returned doorbell is destroyed.
  static absl::StatusOr<StepDoorbell> Attach(SharedMemory shm);
  // The object's size (what Create sizes and Attach requires).
  static uint64_t ObjectBytes();

  StepDoorbell(StepDoorbell&& other) noexcept
      : shm_(std::move(other.shm_)),
        lock_fd_(std::exchange(other.lock_fd_, -1)),
        last_request_(other.last_request_) {}
  StepDoorbell& operator=(StepDoorbell&& other) noexcept;
  StepDoorbell(const StepDoorbell&) = delete;
  StepDoorbell& operator=(const StepDoorbell&) = delete;
  ~StepDoorbell();

  const std::string& name() const { return shm_.name(); }
  // Daemon, once the trainer died: SharedMemory::RemoveNameIfOurs.
  absl::Status RemoveNameIfOurs() const { return shm_.RemoveNameIfOurs(); }

  // Trainer: sends `request` and waits for the daemon's answer: its
  // response bytes, or the status it answered with. DEADLINE_EXCEEDED past
  // `deadline`; UNAVAILABLE as soon as no daemon holds the serving lock
  // (it exited or detached the doorbell), or when its heartbeat stops for
  // `daemon_silence` (it hangs).
  absl::StatusOr<std::string> Call(
      Method method, absl::string_view request, absl::Time deadline,
      absl::Duration daemon_silence = kDaemonSilence);
  // A Step call.
  absl::StatusOr<std::string> Call(
      absl::string_view request, absl::Time deadline,
      absl::Duration daemon_silence = kDaemonSilence) {
    return Call(Method::kStep, request, deadline, daemon_silence);
  }

  // Daemon: the next request, or nullopt after `tick` without one (the
  // caller checks whether to go on). Beats the heartbeat.
  std::optional<Request> WaitRequest(absl::Duration tick);
  // Daemon: answers request `seq` (a status that is not OK carries no
  // bytes) and wakes the trainer.
  void Respond(uint32_t seq, const absl::Status& status,
               absl::string_view response);
  // Daemon: tells the waiting trainer the daemon is still working on it.
  void Heartbeat();
  // Daemon: wakes a thread sleeping in WaitRequest (to stop it).
  void WakeWaiter();

 private:
  struct Header;
  StepDoorbell(SharedMemory shm, int lock_fd)
      : shm_(std::move(shm)), lock_fd_(lock_fd) {}
  Header& header() const;
  // Trainer: whether some process holds the serving lock.
  bool DaemonHoldsLock() const;
  char* request_area() const;
  char* response_area() const;

  SharedMemory shm_;
  // The object opened once more for flock(2): the daemon's holds the shared
  // serving lock, the trainer's probes it. -1 once moved from.
  int lock_fd_ = -1;
  uint32_t last_request_ = 0;  // daemon: the last request it took
};

}  // namespace canzona

#endif  // CANZONA_PROTO_SHARED_MEMORY_STEP_DOORBELL_H_
