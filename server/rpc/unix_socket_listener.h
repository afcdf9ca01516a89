// The daemon's trainer socket: a unix socket canzonad owns itself (rather
// than letting gRPC bind it) so that it can (1) create it with mode 0660 and
// a chosen group without ever being reachable with wider permissions, and
// (2) read every connection's SO_PEERCRED (uid, gid, pid) before handing
// the connection to gRPC. gRPC 1.51 exposes neither: its calls on such a
// connection only know the peer as "fd:<n>", which PeerCredentialsRegistry
// maps back to the recorded credentials.
//
//   CANZONA_ASSIGN_OR_RETURN(auto listener, UnixSocketListener::Create(
//       {.path = "/run/canzona/canzonad.sock", .group = gid}));
//   std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
//   listener->Start(server.get());
//   OptimizerServiceImpl service(engine, metrics, &listener->peers());
//   ...
//   listener->Stop();            // before server->Shutdown()
//
// Thread-safety: Create/Start/Stop from one thread; peers() is thread-safe
// and may be used from gRPC threads while the accept thread records.
#ifndef CANZONA_SERVER_RPC_UNIX_SOCKET_LISTENER_H_
#define CANZONA_SERVER_RPC_UNIX_SOCKET_LISTENER_H_

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace canzona {

// Who is at the other end of a unix-socket connection (SO_PEERCRED: the
// credentials of the process that called connect(), fixed at that moment).
struct PeerCredentials {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
};

// SO_PEERCRED of a connected unix socket; INTERNAL naming errno otherwise.
absl::StatusOr<PeerCredentials> ReadPeerCredentials(int fd);

// The gid of group `name`; NOT_FOUND "no group named ..." when there is
// none.
absl::StatusOr<gid_t> LookupGroup(absl::string_view name);

// Credentials of the connections accepted on the trainer socket, keyed by
// the fd gRPC serves each one on (its peer string is "fd:<n>").
//
// A closed connection's fd number can be reused by a later one: Record
// replaces the entry, and Lookup checks that the fd still refers to the
// socket that was recorded (same inode), so a reused number never yields
// another connection's credentials unless that connection was itself
// recorded under it. UnixSocketListener also spreads accepted connections
// over a wide range of fd numbers so that a number comes back only after
// hundreds of other connections (a call still in flight on a closed
// connection would otherwise race a new connection on the same number).
//
// Thread-safety: thread-safe.
class PeerCredentialsRegistry {
 public:
  // Remembers `credentials` for the connection now open on `fd`.
  void Record(int fd, const PeerCredentials& credentials);
  // The credentials of the call whose ServerContext::peer() is `peer`;
  // nullopt when `peer` is not an "fd:<n>" peer of a recorded connection
  // that is still open.
  std::optional<PeerCredentials> Lookup(absl::string_view peer) const;
  // True when `peer` names a connection accepted on a unix socket ("fd:"),
  // recorded or not.
  static bool IsUnixPeer(absl::string_view peer);

 private:
  struct Entry {
    PeerCredentials credentials;
    dev_t device = 0;
    ino_t inode = 0;
  };
  mutable absl::Mutex mu_;
  std::map<int, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

class UnixSocketListener {
 public:
  // Reads a connection's credentials; tests inject other uids through it.
  using CredentialsReader =
      std::function<absl::StatusOr<PeerCredentials>(int fd)>;

  struct Options {
    // Where the socket appears. Its directory must exist.
    std::string path;
    // The socket file's mode (applied before anyone can connect).
    mode_t mode = 0660;
    // When set, the socket file's group (the daemon's user must be a
    // member, or root).
    std::optional<gid_t> group;
    // Default: ReadPeerCredentials.
    CredentialsReader read_credentials;
  };

  // Binds and listens. The socket is bound inside a fresh mode-0700
  // directory next to `path`, given `mode` and `group` there, and only then
  // renamed onto `path` (replacing a stale socket of a crashed daemon): no
  // other user can connect while its permissions are still the umask's.
  // INVALID_ARGUMENT / PERMISSION_DENIED / INTERNAL naming the path and the
  // failing step; nothing is left behind on failure.
  static absl::StatusOr<std::unique_ptr<UnixSocketListener>> Create(
      Options options);
  ~UnixSocketListener();  // Stop()

  UnixSocketListener(const UnixSocketListener&) = delete;
  UnixSocketListener& operator=(const UnixSocketListener&) = delete;

  // Starts the accept thread: every connection's credentials are recorded
  // in peers(), then the connection is served by `server` (started; must
  // outlive Stop()). Connections whose credentials cannot be read are
  // closed.
  void Start(grpc::Server* server);
  // Stops accepting, closes the listening socket and removes the socket
  // file (if it is still ours). Connections already handed to gRPC stay
  // with it. Idempotent.
  void Stop();

  const std::string& path() const { return options_.path; }
  const PeerCredentialsRegistry& peers() const { return peers_; }

 private:
  UnixSocketListener(Options options, int listen_fd, int wake_fd);
  void AcceptLoop(grpc::Server* server);
  // Moves an accepted fd to a number not used recently (see
  // PeerCredentialsRegistry); returns the fd to use.
  int SpreadFd(int fd);

  const Options options_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: Stop() wakes the accept thread
  dev_t socket_device_ = 0;
  ino_t socket_inode_ = 0;
  std::thread accept_thread_;
  PeerCredentialsRegistry peers_;
  // Accept-thread state of SpreadFd.
  int next_fd_ = 0;
  int first_fd_ = 0;
  int fd_limit_ = 0;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_RPC_UNIX_SOCKET_LISTENER_H_
