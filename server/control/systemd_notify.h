// sd_notify(3) for canzonad under systemd (Type=notify, WatchdogSec=).
//
// Every function is a no-op when the process was not started by systemd
// (no NOTIFY_SOCKET in the environment), so the daemon calls them
// unconditionally.
//
//   NotifyReady();                       // after the server listens
//   std::optional<WatchdogPinger> pinger;
//   if (auto interval = WatchdogInterval()) pinger.emplace(*interval);
//   ...                                  // serve
//   NotifyStopping();                    // first thing on shutdown
//
// Thread-safety: the free functions are thread-safe (sd_notify sends one
// datagram per call). A WatchdogPinger owns one thread; construct and destroy
// it from the same thread.
#ifndef CANZONA_SERVER_CONTROL_SYSTEMD_NOTIFY_H_
#define CANZONA_SERVER_CONTROL_SYSTEMD_NOTIFY_H_

#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace canzona {

// Sends `state` (e.g. "READY=1\nSTATUS=serving") to the service manager.
// OK without NOTIFY_SOCKET; an error only when the socket exists and the
// send failed.
absl::Status SystemdNotify(absl::string_view state);

// READY=1 with a STATUS= line: the unit leaves "activating".
absl::Status NotifyReady(absl::string_view status = "serving");
// STOPPING=1: systemd knows the stop is ours, not a crash.
absl::Status NotifyStopping();
// WATCHDOG=1: resets the unit's WatchdogSec timer.
absl::Status NotifyWatchdog();

// The watchdog interval systemd expects pings within (WATCHDOG_USEC, checked
// against WATCHDOG_PID by sd_watchdog_enabled), or nullopt when the unit has
// no WatchdogSec or this process is not the one being watched.
std::optional<absl::Duration> WatchdogInterval();

// Sends WATCHDOG=1 every interval/2 on its own thread until destroyed.
// The first ping goes out at once.
class WatchdogPinger {
 public:
  explicit WatchdogPinger(absl::Duration interval);
  ~WatchdogPinger();
  WatchdogPinger(const WatchdogPinger&) = delete;
  WatchdogPinger& operator=(const WatchdogPinger&) = delete;

 private:
  void Run();

  const absl::Duration period_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_CONTROL_SYSTEMD_NOTIFY_H_
