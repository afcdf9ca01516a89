// A KvStore that lives on another daemon: the client side of the
// ControlPlane service, so code written against KvStore (the Gloo store
// adapter, NCCL id exchange, plan-digest agreement) works unchanged on any
// daemon of the job.
//
//   CANZONA_ASSIGN_OR_RETURN(auto store,
//                            GrpcKvStore::Connect("coordinator:7070"));
//   CANZONA_ASSIGN_OR_RETURN(std::string id,
//                            store->Get("job/a/nccl_id", absl::Seconds(60)));
//
// Against a coordinator that requires the job token on TCP, pass it as
// `bearer_token`: every call then carries "authorization: Bearer <token>";
// with TLS, pass TcpChannelCredentials(ca_pem) as `credentials`.
//
// Calls block the calling thread (a device worker or the control thread,
// never a gRPC server thread).
//
// Thread-safety: thread-safe (the gRPC stub is).
#ifndef CANZONA_SERVER_RPC_GRPC_KV_STORE_H_
#define CANZONA_SERVER_RPC_GRPC_KV_STORE_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "canzona/v1/control_plane.grpc.pb.h"
#include "server/control/kv_store.h"

namespace canzona {

class GrpcKvStore : public KvStore {
 public:
  // `target` is a gRPC target ("127.0.0.1:7070", "unix:/run/canzona.sock").
  // Waits up to `connect_timeout` for the channel (TLS handshake included);
  // UNAVAILABLE naming the target otherwise. A non-empty `bearer_token` is
  // sent with every call.
  static absl::StatusOr<std::unique_ptr<GrpcKvStore>> Connect(
      const std::string& target,
      std::shared_ptr<grpc::ChannelCredentials> credentials =
          grpc::InsecureChannelCredentials(),
      absl::Duration connect_timeout = absl::Seconds(10),
      std::string bearer_token = "");

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys,
                    absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override;
  absl::Status DeletePrefix(const std::string& prefix) override;

 private:
  GrpcKvStore(std::string target, std::string bearer_token,
              std::unique_ptr<canzona::v1::ControlPlane::Stub> stub)
      : target_(std::move(target)),
        bearer_token_(std::move(bearer_token)),
        stub_(std::move(stub)) {}

  // Every call's context: the deadline of a call that itself waits `wait`
  // on the server, and the bearer token.
  void Prepare(grpc::ClientContext& context, absl::Duration wait) const;
  absl::Status Annotate(const grpc::Status& status) const;

  const std::string target_;
  const std::string bearer_token_;
  std::unique_ptr<canzona::v1::ControlPlane::Stub> stub_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_RPC_GRPC_KV_STORE_H_
