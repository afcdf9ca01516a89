// Authentication and encryption of the daemon's TCP traffic: the trainer
// API on --listen and the control plane the coordinator serves there.
//
// Every RPC on a TCP listener must carry "authorization: Bearer <token>"
// metadata when a job token is configured; the check runs in gRPC's server
// auth filter (an auth metadata processor on the port's credentials), so it
// covers every method of every service on the port before any handler runs
// (UNAUTHENTICATED "missing or wrong bearer token" otherwise), except the
// grpc.health.v1 health check that Kubernetes probes call without metadata.
// Unix-socket connections do not go through it: SO_PEERCRED authenticates
// them (unix_socket_listener.h).
//
//   TcpSecurity security{.bearer_token = token, .tls_cert_pem = cert,
//                        .tls_key_pem = key};
//   builder.AddListeningPort("0.0.0.0:7070", TcpServerCredentials(security));
//   // a client (the coordinator's GrpcKvStore):
//   auto channel = grpc::CreateChannel(target, TcpChannelCredentials(ca));
//   grpc::ClientContext context;
//   AddBearerToken(context, token);
//
// Thread-safety: stateless functions; the credentials are immutable.
#ifndef CANZONA_SERVER_RPC_TRANSPORT_SECURITY_H_
#define CANZONA_SERVER_RPC_TRANSPORT_SECURITY_H_

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace grpc {
class ClientContext;
}  // namespace grpc

namespace canzona {

// The metadata key and the message of a failed check.
inline constexpr absl::string_view kAuthorizationKey = "authorization";
inline constexpr absl::string_view kBadTokenMessage =
    "missing or wrong bearer token";

struct TcpSecurity {
  // When non-empty, every call (but the health check) needs it as
  // "authorization: Bearer <token>".
  std::string bearer_token;
  // PEM certificate chain and private key: TLS when both are set.
  std::string tls_cert_pem;
  std::string tls_key_pem;
};

// Compares in time that depends only on the length of `expected` (the
// secret), not on where `given` first differs.
bool ConstantTimeEquals(absl::string_view given, absl::string_view expected);

// OK when one of `authorization_values` is "Bearer <token>" (scheme case
// insensitive); UNAUTHENTICATED kBadTokenMessage otherwise. OK for any
// input when `token` is empty.
absl::Status CheckBearerToken(
    const std::vector<absl::string_view>& authorization_values,
    absl::string_view token);

// True for the methods served without a token (":path" of the call).
bool IsExemptFromToken(absl::string_view method_path);

// Credentials for a TCP listening port: TLS when a certificate and key are
// set (plaintext otherwise), with the bearer-token check when a token is
// set.
std::shared_ptr<grpc::ServerCredentials> TcpServerCredentials(
    const TcpSecurity& security);

// Credentials to reach a daemon's TCP port: TLS verified against
// `tls_ca_pem` when it is non-empty, plaintext otherwise.
std::shared_ptr<grpc::ChannelCredentials> TcpChannelCredentials(
    const std::string& tls_ca_pem);

// Adds "authorization: Bearer <token>" unless `token` is empty.
void AddBearerToken(grpc::ClientContext& context, absl::string_view token);

// A PEM file's contents; INVALID_ARGUMENT naming `flag` and the path when
// it cannot be read or holds no PEM block.
absl::StatusOr<std::string> ReadPemFile(absl::string_view flag,
                                        const std::string& path);

}  // namespace canzona

#endif  // CANZONA_SERVER_RPC_TRANSPORT_SECURITY_H_
