// The ControlPlane gRPC service (canzona.v1.ControlPlane): a thin callback
// adapter over the coordinator's InMemoryKvStore. Get and Wait never hold a
// gRPC thread while waiting: they register a store callback that finishes
// the RPC when the key arrives or the deadline passes.
//
//   InMemoryKvStore store;
//   ControlPlaneService service(&store);
//   grpc::ServerBuilder builder;
//   builder.RegisterService(&service);
//   ...
//   service.CancelPendingWaits();  // before server->Shutdown()
//
// Callers: on TCP the port's bearer-token check (transport_security.h)
// authenticates them. With `unix_peers` (the daemon's unix socket), calls
// arriving on that socket are served only for the daemon's own uid (and
// root): trainers share the socket but have no business in the control
// plane, where they could forge other jobs' rendezvous data
// (PERMISSION_DENIED).
//
// Thread-safety: thread-safe; gRPC calls it from its own threads.
#ifndef CANZONA_SERVER_RPC_CONTROL_PLANE_SERVICE_H_
#define CANZONA_SERVER_RPC_CONTROL_PLANE_SERVICE_H_

#include <cstdint>

#include "absl/time/time.h"
#include "canzona/v1/control_plane.grpc.pb.h"
#include "server/control/kv_store.h"
#include "server/rpc/unix_socket_listener.h"

namespace canzona {

class ControlPlaneService final
    : public canzona::v1::ControlPlane::CallbackService {
 public:
  // Request size limits: beyond them RESOURCE_EXHAUSTED naming the field.
  struct Limits {
    int64_t max_key_bytes = 1024;
    int64_t max_value_bytes = 1 << 20;
    int64_t max_keys_per_wait = 4096;
    absl::Duration max_wait = absl::Hours(1);
  };

  explicit ControlPlaneService(InMemoryKvStore* store)
      : ControlPlaneService(store, Limits()) {}
  ControlPlaneService(InMemoryKvStore* store, Limits limits,
                      const PeerCredentialsRegistry* unix_peers = nullptr)
      : store_(store), limits_(limits), unix_peers_(unix_peers) {}

  // Fails every pending Get/Wait with CANCELLED so that a server shutdown
  // does not wait for their timeouts.
  void CancelPendingWaits() { store_->CancelWaits(); }

  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* context,
                                const canzona::v1::SetRequest* request,
                                canzona::v1::SetResponse* response) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* context,
                                const canzona::v1::GetRequest* request,
                                canzona::v1::GetResponse* response) override;
  grpc::ServerUnaryReactor* Wait(grpc::CallbackServerContext* context,
                                 const canzona::v1::WaitRequest* request,
                                 canzona::v1::WaitResponse* response) override;
  grpc::ServerUnaryReactor* Add(grpc::CallbackServerContext* context,
                                const canzona::v1::AddRequest* request,
                                canzona::v1::AddResponse* response) override;
  grpc::ServerUnaryReactor* DeletePrefix(
      grpc::CallbackServerContext* context,
      const canzona::v1::DeletePrefixRequest* request,
      canzona::v1::DeletePrefixResponse* response) override;

 private:
  // PERMISSION_DENIED for unix-socket callers other than the daemon's
  // user (or root).
  absl::Status CheckCaller(const grpc::CallbackServerContext& context) const;
  absl::Status CheckKey(const std::string& key, const char* field) const;
  // The request's timeout, bounded by the limit and the client's deadline.
  absl::StatusOr<absl::Duration> WaitTimeout(
      const grpc::CallbackServerContext& context, int64_t timeout_ms) const;

  InMemoryKvStore* store_;
  const Limits limits_;
  const PeerCredentialsRegistry* const unix_peers_;  // not owned; may be null
};

}  // namespace canzona

#endif  // CANZONA_SERVER_RPC_CONTROL_PLANE_SERVICE_H_
