#include "client/ctl/daemon_memory.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace canzona::ctl {

absl::StatusOr<pid_t> DaemonPid(const std::string& target) {
  constexpr char kUnix[] = "unix:";
  if (!absl::StartsWith(target, kUnix)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "target ", target, " is not a local unix socket (unix:<path>)"));
  }
  std::string path = target.substr(sizeof(kUnix) - 1);
  // unix:///abs/path and unix:/abs/path both name /abs/path.
  while (absl::StartsWith(path, "//")) path.erase(0, 1);
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::FailedPreconditionError(
        absl::StrCat("socket path ", path, " is too long"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("socket: ", std::strerror(errno)));
  }
  ucred cred{};
  socklen_t len = sizeof(cred);
  absl::Status status;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    status = absl::FailedPreconditionError(
        absl::StrCat("connect ", path, ": ", std::strerror(errno)));
  } else if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
             cred.pid <= 0) {
    status = absl::FailedPreconditionError(
        absl::StrCat("no peer credentials on ", path));
  }
  ::close(fd);
  if (!status.ok()) return status;
  return cred.pid;
}

absl::StatusOr<int64_t> PrivateBytes(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) {
    return absl::NotFoundError(absl::StrCat("no process ", pid));
  }
  std::ifstream in(absl::StrCat("/proc/", pid, "/smaps_rollup"));
  if (!in) {
    return absl::UnavailableError(
        absl::StrCat("/proc/", pid, "/smaps_rollup is not readable"));
  }
  int64_t kib = 0;
  std::string line;
  while (std::getline(in, line)) {
    if (!absl::StartsWith(line, "Private_Dirty:")) continue;
    std::istringstream fields(line.substr(line.find(':') + 1));
    int64_t value = 0;
    fields >> value;
    kib += value;
  }
  return kib * 1024;
}

int64_t DaemonMemoryProbe::Read() const {
  int64_t total = -1;
  for (pid_t pid : pids_) {
    absl::StatusOr<int64_t> bytes = PrivateBytes(pid);
    if (bytes.ok()) total = std::max<int64_t>(total, 0) + *bytes;
  }
  return total;
}

void DaemonMemoryProbe::Arrive() {
  absl::MutexLock lock(&mu_);
  if (++arrived_ == ranks_) {
    after_ = Read();
    return;
  }
  mu_.Await(absl::Condition(
      +[](DaemonMemoryProbe* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
        return p->arrived_ == p->ranks_;
      },
      this));
}

int64_t DaemonMemoryProbe::after() {
  absl::MutexLock lock(&mu_);
  return after_;
}

}  // namespace canzona::ctl
