#include "server/rpc/control_plane_service.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"
#include "server/rpc/status_conversion.h"

namespace canzona {
namespace {

grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* context,
                                    const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

absl::Status ControlPlaneService::CheckCaller(
    const grpc::CallbackServerContext& context) const {
  const std::string peer = context.peer();
  if (unix_peers_ == nullptr || !PeerCredentialsRegistry::IsUnixPeer(peer)) {
    return absl::OkStatus();
  }
  const std::optional<PeerCredentials> caller = unix_peers_->Lookup(peer);
  const uid_t self = ::geteuid();
  if (caller.has_value() && (caller->uid == self || caller->uid == 0)) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "control plane: on the unix socket only the daemon's user (uid ", self,
      ") may call it",
      caller.has_value() ? absl::StrCat(", not uid ", caller->uid)
                         : std::string(" (caller unknown)")));
}

absl::Status ControlPlaneService::CheckKey(const std::string& key,
                                           const char* field) const {
  if (key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": must not be empty"));
  }
  if (static_cast<int64_t>(key.size()) > limits_.max_key_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat(field, ": ", key.size(), " bytes exceeds the limit of ",
                     limits_.max_key_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::Duration> ControlPlaneService::WaitTimeout(
    const grpc::CallbackServerContext& context, int64_t timeout_ms) const {
  if (timeout_ms < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms: must be >= 0, got ", timeout_ms));
  }
  absl::Duration timeout =
      std::min(absl::Milliseconds(timeout_ms), limits_.max_wait);
  // No point waiting past the client's own deadline.
  const auto client_deadline = context.deadline();
  if (client_deadline != std::chrono::system_clock::time_point::max()) {
    timeout =
        std::min(timeout, absl::FromChrono(client_deadline) - absl::Now());
  }
  return std::max(timeout, absl::ZeroDuration());
}

grpc::ServerUnaryReactor* ControlPlaneService::Set(
    grpc::CallbackServerContext* context,
    const canzona::v1::SetRequest* request,
    canzona::v1::SetResponse* /*response*/) {
  if (absl::Status caller = CheckCaller(*context); !caller.ok()) {
    return FinishNow(context, caller);
  }
  absl::Status status = CheckKey(request->key(), "key");
  if (status.ok() &&
      static_cast<int64_t>(request->value().size()) > limits_.max_value_bytes) {
    status = absl::ResourceExhaustedError(
        absl::StrCat("value: ", request->value().size(),
                     " bytes exceeds the limit of ", limits_.max_value_bytes));
  }
  if (status.ok()) status = store_->Set(request->key(), request->value());
  return FinishNow(context, status);
}

grpc::ServerUnaryReactor* ControlPlaneService::Get(
    grpc::CallbackServerContext* context,
    const canzona::v1::GetRequest* request,
    canzona::v1::GetResponse* response) {
  if (absl::Status caller = CheckCaller(*context); !caller.ok()) {
    return FinishNow(context, caller);
  }
  absl::Status status = CheckKey(request->key(), "key");
  absl::StatusOr<absl::Duration> timeout =
      WaitTimeout(*context, request->timeout_ms());
  if (status.ok()) status = timeout.status();
  if (!status.ok()) return FinishNow(context, status);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  store_->GetAsync(request->key(), *timeout,
                   [reactor, response](absl::StatusOr<std::string> value) {
                     if (value.ok()) response->set_value(*std::move(value));
                     reactor->Finish(ToGrpcStatus(value.status()));
                   });
  return reactor;
}

grpc::ServerUnaryReactor* ControlPlaneService::Wait(
    grpc::CallbackServerContext* context,
    const canzona::v1::WaitRequest* request,
    canzona::v1::WaitResponse* /*response*/) {
  if (absl::Status caller = CheckCaller(*context); !caller.ok()) {
    return FinishNow(context, caller);
  }
  absl::Status status;
  if (request->keys_size() > limits_.max_keys_per_wait) {
    status = absl::ResourceExhaustedError(
        absl::StrCat("keys: ", request->keys_size(),
                     " keys exceeds the limit of ", limits_.max_keys_per_wait));
  }
  for (const std::string& key : request->keys()) {
    if (!status.ok()) break;
    status = CheckKey(key, "keys");
  }
  absl::StatusOr<absl::Duration> timeout =
      WaitTimeout(*context, request->timeout_ms());
  if (status.ok()) status = timeout.status();
  if (!status.ok()) return FinishNow(context, status);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  std::vector<std::string> keys(request->keys().begin(), request->keys().end());
  store_->WaitAsync(std::move(keys), *timeout, [reactor](absl::Status result) {
    reactor->Finish(ToGrpcStatus(result));
  });
  return reactor;
}

grpc::ServerUnaryReactor* ControlPlaneService::Add(
    grpc::CallbackServerContext* context,
    const canzona::v1::AddRequest* request,
    canzona::v1::AddResponse* response) {
  if (absl::Status caller = CheckCaller(*context); !caller.ok()) {
    return FinishNow(context, caller);
  }
  absl::Status status = CheckKey(request->key(), "key");
  if (status.ok()) {
    absl::StatusOr<int64_t> value =
        store_->Add(request->key(), request->delta());
    status = value.status();
    if (value.ok()) response->set_value(*value);
  }
  return FinishNow(context, status);
}

grpc::ServerUnaryReactor* ControlPlaneService::DeletePrefix(
    grpc::CallbackServerContext* context,
    const canzona::v1::DeletePrefixRequest* request,
    canzona::v1::DeletePrefixResponse* /*response*/) {
  if (absl::Status caller = CheckCaller(*context); !caller.ok()) {
    return FinishNow(context, caller);
  }
  // An empty prefix would wipe every job's keys: refuse it.
  absl::Status status = CheckKey(request->prefix(), "prefix");
  if (status.ok()) status = store_->DeletePrefix(request->prefix());
  return FinishNow(context, status);
}

}  // namespace canzona
