// The memory a local daemon process holds, as the benchmarks measure it:
// its pid found through the peer credentials of its unix socket
// (SO_PEERCRED), and its private bytes from /proc/<pid>/smaps_rollup
// (Private_Dirty: the memory the process alone has written, so neither the
// trainers' shared buffers it maps nor the library code it has paged in
// count).
//
//   CANZONA_ASSIGN_OR_RETURN(pid_t pid, DaemonPid("unix:/run/canzona.sock"));
//   CANZONA_ASSIGN_OR_RETURN(int64_t bytes, PrivateBytes(pid));
//
// Thread-safety: pure functions over the kernel's view.
#ifndef CANZONA_CLIENT_CTL_DAEMON_MEMORY_H_
#define CANZONA_CLIENT_CTL_DAEMON_MEMORY_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace canzona::ctl {

// FAILED_PRECONDITION unless `target` is "unix:<path>" of a listening
// socket whose peer credentials name a process.
absl::StatusOr<pid_t> DaemonPid(const std::string& target);

// NOT_FOUND when the process is gone; UNAVAILABLE when the kernel has no
// smaps_rollup (before Linux 4.14).
absl::StatusOr<int64_t> PrivateBytes(pid_t pid);

// Samples the daemons' private memory once every rank of a benchmark mode
// has stepped and before any deregisters: the last rank to Arrive reads
// it, the others wait for that.
// Thread-safety: Arrive from the ranks' threads; Read, after from any.
class DaemonMemoryProbe {
 public:
  DaemonMemoryProbe(int ranks, std::vector<pid_t> pids)
      : ranks_(ranks), pids_(std::move(pids)) {}

  // The daemons' private bytes now (-1 when none is readable).
  int64_t Read() const;
  void Arrive() ABSL_LOCKS_EXCLUDED(mu_);
  // What the last arrival read (-1 before, or when unreadable).
  int64_t after() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const int ranks_;
  const std::vector<pid_t> pids_;
  absl::Mutex mu_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t after_ ABSL_GUARDED_BY(mu_) = -1;
};

}  // namespace canzona::ctl

#endif  // CANZONA_CLIENT_CTL_DAEMON_MEMORY_H_
