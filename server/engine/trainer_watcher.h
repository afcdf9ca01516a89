// Noticing trainers that die without deregistering (a crash, kill -9, an
// OOM kill), so that their ranks are released instead of holding a job, its
// buffers and its peers until a timeout.
//
// TrainerProcess is the trainer as the daemon knows it from SO_PEERCRED: a
// pid and, where the kernel has pidfd_open, a pidfd that becomes readable
// when the process exits (no pid reuse race). TrainerWatcher is the thread
// that looks: every `period` it calls `poll` (the engine's: check each
// rank's TrainerProcess, reap what waits to be reaped); it stops and joins
// in its destructor or Stop().
//
//   TrainerProcess trainer = TrainerProcess::Watch(peer.pid);
//   TrainerWatcher watcher(absl::Milliseconds(200), [&] { ... });
//   if (trainer.Exited()) ReleaseRank(...);
//
// Thread-safety: TrainerProcess::Exited is const and thread-safe;
// TrainerWatcher owns its thread; Stop is thread-safe.
#ifndef CANZONA_SERVER_ENGINE_TRAINER_WATCHER_H_
#define CANZONA_SERVER_ENGINE_TRAINER_WATCHER_H_

#include <sys/types.h>

#include <functional>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace canzona {

class TrainerProcess {
 public:
  TrainerProcess() = default;
  // Watches `pid` when it names a process (else an unwatched trainer).
  static TrainerProcess Watch(std::optional<pid_t> pid);
  TrainerProcess(TrainerProcess&& other) noexcept { *this = std::move(other); }
  TrainerProcess& operator=(TrainerProcess&& other) noexcept;
  TrainerProcess(const TrainerProcess&) = delete;
  TrainerProcess& operator=(const TrainerProcess&) = delete;
  ~TrainerProcess();

  std::optional<pid_t> pid() const { return pid_; }
  // True once the process has exited (false when unwatched).
  bool Exited() const;

 private:
  std::optional<pid_t> pid_;
  int pidfd_ = -1;  // -1: none, or a kernel without pidfd_open
};

class TrainerWatcher {
 public:
  TrainerWatcher(absl::Duration period, std::function<void()> poll);
  ~TrainerWatcher() { Stop(); }
  TrainerWatcher(const TrainerWatcher&) = delete;
  TrainerWatcher& operator=(const TrainerWatcher&) = delete;

  // Stops polling and joins the thread (a poll in progress finishes).
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);

  const absl::Duration period_;
  const std::function<void()> poll_;
  absl::Mutex mu_;
  absl::CondVar cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_TRAINER_WATCHER_H_
