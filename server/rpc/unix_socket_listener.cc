#include "server/rpc/unix_socket_listener.h"

#include <fcntl.h>
#include <grp.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace canzona {
namespace {

constexpr absl::string_view kFdPeerPrefix = "fd:";

std::string ErrnoText(int err) { return std::strerror(err); }

// Everything Create() made so far, undone unless released.
struct Cleanup {
  int fd = -1;
  int dir_fd = -1;
  std::string socket_file;
  std::string dir;
  ~Cleanup() {
    if (!socket_file.empty()) ::unlink(socket_file.c_str());
    if (dir_fd >= 0) ::close(dir_fd);
    if (!dir.empty()) ::rmdir(dir.c_str());
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

absl::StatusOr<PeerCredentials> ReadPeerCredentials(int fd) {
  struct ucred cred {};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return absl::InternalError(
        absl::StrCat("getsockopt(SO_PEERCRED): ", ErrnoText(errno)));
  }
  PeerCredentials out;
  out.uid = cred.uid;
  out.gid = cred.gid;
  out.pid = cred.pid;
  return out;
}

absl::StatusOr<gid_t> LookupGroup(absl::string_view name) {
  if (name.empty()) return absl::InvalidArgumentError("empty group name");
  const std::string group_name(name);
  std::vector<char> buffer(1024);
  struct group entry {};
  struct group* result = nullptr;
  while (true) {
    const int err = ::getgrnam_r(group_name.c_str(), &entry, buffer.data(),
                                 buffer.size(), &result);
    if (err == ERANGE && buffer.size() < (1u << 20)) {
      buffer.resize(buffer.size() * 2);
      continue;
    }
    if (err != 0) {
      return absl::InternalError(
          absl::StrCat("looking up group '", name, "': ", ErrnoText(err)));
    }
    break;
  }
  if (result == nullptr) {
    return absl::NotFoundError(absl::StrCat("no group named '", name, "'"));
  }
  return result->gr_gid;
}

// ---------------------------------------------------------------------------
// PeerCredentialsRegistry

void PeerCredentialsRegistry::Record(int fd,
                                     const PeerCredentials& credentials) {
  Entry entry;
  entry.credentials = credentials;
  struct stat st {};
  if (::fstat(fd, &st) == 0) {
    entry.device = st.st_dev;
    entry.inode = st.st_ino;
  }
  absl::MutexLock lock(&mu_);
  entries_[fd] = entry;
}

bool PeerCredentialsRegistry::IsUnixPeer(absl::string_view peer) {
  return absl::StartsWith(peer, kFdPeerPrefix);
}

std::optional<PeerCredentials> PeerCredentialsRegistry::Lookup(
    absl::string_view peer) const {
  if (!absl::ConsumePrefix(&peer, kFdPeerPrefix)) return std::nullopt;
  int fd = -1;
  if (!absl::SimpleAtoi(peer, &fd) || fd < 0) return std::nullopt;
  Entry entry;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(fd);
    if (it == entries_.end()) return std::nullopt;
    entry = it->second;
  }
  // The fd must still be the socket that was recorded: after gRPC closed
  // the connection its number may belong to any other file.
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode) ||
      st.st_dev != entry.device || st.st_ino != entry.inode) {
    return std::nullopt;
  }
  return entry.credentials;
}

// ---------------------------------------------------------------------------
// UnixSocketListener

absl::StatusOr<std::unique_ptr<UnixSocketListener>> UnixSocketListener::Create(
    Options options) {
  if (!options.read_credentials) options.read_credentials = ReadPeerCredentials;
  const std::string& path = options.path;
  sockaddr_un address{};
  if (path.empty()) return absl::InvalidArgumentError("empty socket path");
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": longer than ", sizeof(address.sun_path) - 1,
                     " bytes (the unix socket path limit)"));
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : path.substr(0, slash);

  // A private directory (mkdtemp: 0700) next to the socket: the socket is
  // bound, chmod-ed and chown-ed in there, where nobody else can reach it,
  // then renamed into place. rename() also atomically replaces a stale
  // socket left by a crashed daemon.
  Cleanup cleanup;
  std::string dir_template =
      absl::StrCat(dir == "/" ? "" : dir, "/.canzonad-XXXXXX");
  if (::mkdtemp(dir_template.data()) == nullptr) {
    const int err = errno;
    return absl::Status(
        err == EACCES || err == EPERM ? absl::StatusCode::kPermissionDenied
                                      : absl::StatusCode::kInvalidArgument,
        absl::StrCat(path, ": cannot create a private directory in ", dir, ": ",
                     ErrnoText(err)));
  }
  cleanup.dir = dir_template;
  const std::string temp_socket = absl::StrCat(dir_template, "/s");
  std::string bind_path = temp_socket;
  if (bind_path.size() >= sizeof(address.sun_path)) {
    // The private directory made the path too long for sun_path: reach the
    // directory through its fd instead (same file, shorter name).
    cleanup.dir_fd =
        ::open(dir_template.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (cleanup.dir_fd < 0) {
      return absl::InternalError(absl::StrCat(
          path, ": cannot open ", dir_template, ": ", ErrnoText(errno)));
    }
    bind_path = absl::StrCat("/proc/self/fd/", cleanup.dir_fd, "/s");
  }

  cleanup.fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (cleanup.fd < 0) {
    return absl::InternalError(
        absl::StrCat(path, ": socket(): ", ErrnoText(errno)));
  }
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, bind_path.c_str(), bind_path.size() + 1);
  if (::bind(cleanup.fd, reinterpret_cast<const sockaddr*>(&address),
             sizeof(address)) != 0) {
    return absl::InternalError(
        absl::StrCat(path, ": bind(", bind_path, "): ", ErrnoText(errno)));
  }
  cleanup.socket_file = temp_socket;
  if (options.group.has_value() &&
      ::chown(temp_socket.c_str(), static_cast<uid_t>(-1), *options.group) !=
          0) {
    const int err = errno;
    return absl::Status(
        err == EPERM ? absl::StatusCode::kPermissionDenied
                     : absl::StatusCode::kInternal,
        absl::StrCat(
            path, ": cannot give the socket to group ", *options.group, ": ",
            ErrnoText(err),
            err == EPERM ? " (the daemon's user must be a member)" : ""));
  }
  if (::chmod(temp_socket.c_str(), options.mode) != 0) {
    return absl::InternalError(
        absl::StrCat(path, ": chmod: ", ErrnoText(errno)));
  }
  if (::listen(cleanup.fd, SOMAXCONN) != 0) {
    return absl::InternalError(
        absl::StrCat(path, ": listen: ", ErrnoText(errno)));
  }
  struct stat st {};
  if (::stat(temp_socket.c_str(), &st) != 0) {
    return absl::InternalError(
        absl::StrCat(path, ": stat: ", ErrnoText(errno)));
  }
  if (::rename(temp_socket.c_str(), path.c_str()) != 0) {
    const int err = errno;
    return absl::Status(
        err == EACCES || err == EPERM ? absl::StatusCode::kPermissionDenied
                                      : absl::StatusCode::kInvalidArgument,
        absl::StrCat(path,
                     ": cannot move the socket into place: ", ErrnoText(err)));
  }
  cleanup.socket_file.clear();  // now at `path`

  const int wake_fd = ::eventfd(0, EFD_CLOEXEC);
  if (wake_fd < 0) {
    const int err = errno;
    ::unlink(path.c_str());
    return absl::InternalError(absl::StrCat("eventfd: ", ErrnoText(err)));
  }
  auto listener = std::unique_ptr<UnixSocketListener>(
      new UnixSocketListener(std::move(options), cleanup.fd, wake_fd));
  listener->socket_device_ = st.st_dev;
  listener->socket_inode_ = st.st_ino;
  cleanup.fd = -1;  // the listener owns it now
  return listener;
}

UnixSocketListener::UnixSocketListener(Options options, int listen_fd,
                                       int wake_fd)
    : options_(std::move(options)), listen_fd_(listen_fd), wake_fd_(wake_fd) {}

UnixSocketListener::~UnixSocketListener() { Stop(); }

void UnixSocketListener::Start(grpc::Server* server) {
  if (accept_thread_.joinable() || listen_fd_ < 0) return;
  accept_thread_ = std::thread([this, server] { AcceptLoop(server); });
}

void UnixSocketListener::Stop() {
  if (accept_thread_.joinable()) {
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
    accept_thread_.join();
  }
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
    // Remove the socket file only if it is still ours: a newer daemon may
    // have taken the path over.
    struct stat st {};
    if (::stat(options_.path.c_str(), &st) == 0 &&
        st.st_dev == socket_device_ && st.st_ino == socket_inode_) {
      ::unlink(options_.path.c_str());
    }
  }
  if (wake_fd_ >= 0) {
    ::close(wake_fd_);
    wake_fd_ = -1;
  }
}

int UnixSocketListener::SpreadFd(int fd) {
  if (fd_limit_ == 0) {
    struct rlimit limit {};
    rlim_t soft = 1024;
    if (::getrlimit(RLIMIT_NOFILE, &limit) == 0) soft = limit.rlim_cur;
    fd_limit_ = static_cast<int>(std::min<rlim_t>(soft, 1 << 16));
    first_fd_ = std::max(64, fd_limit_ / 4);
    next_fd_ = first_fd_;
  }
  if (fd_limit_ - first_fd_ < 16) return fd;  // too few numbers to spread
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (next_fd_ >= fd_limit_) next_fd_ = first_fd_;
    const int moved = ::fcntl(fd, F_DUPFD_CLOEXEC, next_fd_);
    if (moved >= 0) {
      ::close(fd);
      next_fd_ = moved + 1;
      return moved;
    }
    next_fd_ = fd_limit_;  // none free above: wrap around once
  }
  return fd;
}

void UnixSocketListener::AcceptLoop(grpc::Server* server) {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("unix socket {}: poll: {}", options_.path,
                    ErrnoText(errno));
      return;
    }
    if (fds[1].revents != 0) return;  // Stop()
    if ((fds[0].revents & POLLIN) == 0) continue;
    // gRPC needs a non-blocking fd (a blocking one stalls its transport).
    int fd =
        ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == EAGAIN || err == ECONNABORTED) continue;
      spdlog::warn("unix socket {}: accept: {}", options_.path, ErrnoText(err));
      // EMFILE and friends: do not spin while descriptors are short.
      absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    absl::StatusOr<PeerCredentials> credentials = options_.read_credentials(fd);
    if (!credentials.ok()) {
      spdlog::warn("unix socket {}: connection refused: {}", options_.path,
                   credentials.status().ToString());
      ::close(fd);
      continue;
    }
    fd = SpreadFd(fd);
    // Recorded before gRPC can read the connection's first call.
    peers_.Record(fd, *credentials);
    spdlog::debug("unix socket {}: fd {} uid {} pid {}", options_.path, fd,
                  credentials->uid, credentials->pid);
    grpc::AddInsecureChannelFromFd(server, fd);
  }
}

}  // namespace canzona
