#include "server/engine/trainer_watcher.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

namespace canzona {

TrainerProcess TrainerProcess::Watch(std::optional<pid_t> pid) {
  TrainerProcess out;
  if (!pid.has_value() || *pid <= 0) return out;
  out.pid_ = pid;
  out.pidfd_ = static_cast<int>(::syscall(SYS_pidfd_open, *pid, 0));
  return out;
}

TrainerProcess& TrainerProcess::operator=(TrainerProcess&& other) noexcept {
  if (this != &other) {
    if (pidfd_ >= 0) ::close(pidfd_);
    pid_ = std::exchange(other.pid_, std::nullopt);
    pidfd_ = std::exchange(other.pidfd_, -1);
  }
  return *this;
}

TrainerProcess::~TrainerProcess() {
  if (pidfd_ >= 0) ::close(pidfd_);
}

bool TrainerProcess::Exited() const {
  if (!pid_.has_value()) return false;
  if (pidfd_ >= 0) {
    pollfd fd{pidfd_, POLLIN, 0};
    return ::poll(&fd, 1, 0) > 0;
  }
  return ::kill(*pid_, 0) != 0 && errno == ESRCH;
}

TrainerWatcher::TrainerWatcher(absl::Duration period,
                               std::function<void()> poll)
    : period_(period), poll_(std::move(poll)) {
  thread_ = std::thread([this] { Loop(); });
}

void TrainerWatcher::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    cv_.SignalAll();
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
    thread_.join();
  }
}

void TrainerWatcher::Loop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (!stopping_) cv_.WaitWithTimeout(&mu_, period_);
      if (stopping_) return;
    }
    poll_();
  }
}

}  // namespace canzona
