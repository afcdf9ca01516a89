#include "server/control/systemd_notify.h"

#include <systemd/sd-daemon.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace canzona {

absl::Status SystemdNotify(absl::string_view state) {
  const char* socket = std::getenv("NOTIFY_SOCKET");
  if (socket == nullptr || *socket == '\0') return absl::OkStatus();
  // unset_environment = 0: the watchdog pinger and STOPPING=1 need it later.
  const int rc = sd_notify(0, std::string(state).c_str());
  if (rc < 0) {
    return absl::UnavailableError(absl::StrCat(
        "sd_notify(", state, ") to ", socket, ": ", std::strerror(-rc)));
  }
  return absl::OkStatus();
}

absl::Status NotifyReady(absl::string_view status) {
  return SystemdNotify(absl::StrCat("READY=1\nSTATUS=", status));
}

absl::Status NotifyStopping() {
  return SystemdNotify("STOPPING=1\nSTATUS=shutting down");
}

absl::Status NotifyWatchdog() { return SystemdNotify("WATCHDOG=1"); }

std::optional<absl::Duration> WatchdogInterval() {
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) <= 0 || usec == 0) return std::nullopt;
  return absl::Microseconds(static_cast<int64_t>(usec));
}

WatchdogPinger::WatchdogPinger(absl::Duration interval)
    : period_(interval / 2), thread_([this] { Run(); }) {}

WatchdogPinger::~WatchdogPinger() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void WatchdogPinger::Run() {
  while (true) {
    (void)NotifyWatchdog();  // a lost ping shows up as a watchdog timeout
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&stop_), period_)) return;
  }
}

}  // namespace canzona
