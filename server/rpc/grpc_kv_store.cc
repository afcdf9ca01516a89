#include "server/rpc/grpc_kv_store.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/rpc/status_conversion.h"
#include "server/rpc/transport_security.h"

namespace canzona {
namespace {

// Slack on top of a server-side wait for the round trip, so that the
// server's DEADLINE_EXCEEDED (naming the key) arrives before the client's.
constexpr absl::Duration kRpcSlack = absl::Seconds(5);

int64_t ToMillis(absl::Duration d) {
  return std::max<int64_t>(0, absl::ToInt64Milliseconds(d));
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcKvStore>> GrpcKvStore::Connect(
    const std::string& target,
    std::shared_ptr<grpc::ChannelCredentials> credentials,
    absl::Duration connect_timeout, std::string bearer_token) {
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(target, std::move(credentials));
  if (!channel->WaitForConnected(
          absl::ToChronoTime(absl::Now() + connect_timeout))) {
    return absl::UnavailableError(
        absl::StrCat("control plane at ", target, " is not reachable within ",
                     absl::FormatDuration(connect_timeout)));
  }
  return std::unique_ptr<GrpcKvStore>(
      new GrpcKvStore(target, std::move(bearer_token),
                      canzona::v1::ControlPlane::NewStub(channel)));
}

void GrpcKvStore::Prepare(grpc::ClientContext& context,
                          absl::Duration wait) const {
  context.set_deadline(absl::ToChronoTime(absl::Now() + wait + kRpcSlack));
  AddBearerToken(context, bearer_token_);
}

absl::Status GrpcKvStore::Annotate(const grpc::Status& status) const {
  absl::Status converted = FromGrpcStatus(status);
  if (converted.ok()) return converted;
  return absl::Status(
      converted.code(),
      absl::StrCat("control plane ", target_, ": ", converted.message()));
}

absl::Status GrpcKvStore::Set(const std::string& key,
                              const std::string& value) {
  grpc::ClientContext context;
  Prepare(context, absl::ZeroDuration());
  canzona::v1::SetRequest request;
  request.set_key(key);
  request.set_value(value);
  canzona::v1::SetResponse response;
  return Annotate(stub_->Set(&context, request, &response));
}

absl::StatusOr<std::string> GrpcKvStore::Get(const std::string& key,
                                             absl::Duration timeout) {
  grpc::ClientContext context;
  Prepare(context, timeout);
  canzona::v1::GetRequest request;
  request.set_key(key);
  request.set_timeout_ms(ToMillis(timeout));
  canzona::v1::GetResponse response;
  grpc::Status status = stub_->Get(&context, request, &response);
  if (!status.ok()) return Annotate(status);
  return std::move(*response.mutable_value());
}

absl::Status GrpcKvStore::Wait(absl::Span<const std::string> keys,
                               absl::Duration timeout) {
  grpc::ClientContext context;
  Prepare(context, timeout);
  canzona::v1::WaitRequest request;
  for (const std::string& key : keys) request.add_keys(key);
  request.set_timeout_ms(ToMillis(timeout));
  canzona::v1::WaitResponse response;
  return Annotate(stub_->Wait(&context, request, &response));
}

absl::StatusOr<int64_t> GrpcKvStore::Add(const std::string& key,
                                         int64_t delta) {
  grpc::ClientContext context;
  Prepare(context, absl::ZeroDuration());
  canzona::v1::AddRequest request;
  request.set_key(key);
  request.set_delta(delta);
  canzona::v1::AddResponse response;
  grpc::Status status = stub_->Add(&context, request, &response);
  if (!status.ok()) return Annotate(status);
  return response.value();
}

absl::Status GrpcKvStore::DeletePrefix(const std::string& prefix) {
  grpc::ClientContext context;
  Prepare(context, absl::ZeroDuration());
  canzona::v1::DeletePrefixRequest request;
  request.set_prefix(prefix);
  canzona::v1::DeletePrefixResponse response;
  return Annotate(stub_->DeletePrefix(&context, request, &response));
}

}  // namespace canzona
