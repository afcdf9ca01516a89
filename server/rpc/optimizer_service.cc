#include "server/rpc/optimizer_service.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/metrics/canzona_metrics.h"
#include "server/rpc/status_conversion.h"

namespace canzona {
namespace {

// Counts one finished RPC: canzona_rpc_requests_total{method, code}.
void Count(Family<Counter>* requests, const char* method,
           const absl::Status& status) {
  if (requests == nullptr) return;
  requests->WithLabels({method, absl::StatusCodeToString(status.code())})
      ->Increment();
}

// A completion that moves the engine's result into the RPC's response,
// counts it and finishes the RPC; runs on whichever thread the engine
// completes on.
template <typename Response>
Callback<Response> Completion(grpc::ServerUnaryReactor* reactor,
                              Response* response, Family<Counter>* requests,
                              const char* method) {
  return
      [reactor, response, requests, method](absl::StatusOr<Response> result) {
        Count(requests, method, result.status());
        if (result.ok()) *response = *std::move(result);
        reactor->Finish(ToGrpcStatus(result.status()));
      };
}

}  // namespace

absl::StatusOr<PeerInfo> PeerOf(absl::string_view grpc_peer,
                                const PeerCredentialsRegistry* unix_peers) {
  PeerInfo peer;
  peer.address = std::string(grpc_peer);
  if (unix_peers == nullptr ||
      !PeerCredentialsRegistry::IsUnixPeer(grpc_peer)) {
    // TCP (the bearer token authenticated the call) or a server without
    // a daemon-owned unix socket (tests).
    return peer;
  }
  std::optional<PeerCredentials> credentials = unix_peers->Lookup(grpc_peer);
  if (!credentials.has_value()) {
    // Fail closed: without a uid the engine would map any object.
    return absl::PermissionDeniedError(absl::StrCat(
        "cannot establish the caller's credentials (SO_PEERCRED) for ",
        grpc_peer, "; reconnect"));
  }
  peer.uid = credentials->uid;
  peer.pid = credentials->pid;
  absl::StrAppend(&peer.address, " (uid ", credentials->uid, " pid ",
                  credentials->pid, ")");
  return peer;
}

OptimizerServiceImpl::OptimizerServiceImpl(
    Engine* engine, MetricsRegistry* metrics,
    const PeerCredentialsRegistry* unix_peers, StepDoorbells* doorbells)
    : engine_(engine), unix_peers_(unix_peers), doorbells_(doorbells) {
  if (metrics != nullptr) {
    requests_ = CanzonaMetrics::Register(metrics).rpc_requests_total;
  }
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::Register(
    grpc::CallbackServerContext* context,
    const canzona::v1::RegisterRequest* request,
    canzona::v1::RegisterResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Callback<canzona::v1::RegisterResponse> done =
      Completion(reactor, response, requests_, "Register");
  absl::StatusOr<PeerInfo> peer = PeerOf(context->peer(), unix_peers_);
  if (!peer.ok()) {
    done(peer.status());
    return reactor;
  }
  engine_->Register(*request, *peer, std::move(done));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::Step(
    grpc::CallbackServerContext* context,
    const canzona::v1::StepRequest* request,
    canzona::v1::StepResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  engine_->Step(*request, Completion(reactor, response, requests_, "Step"));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::GetPlan(
    grpc::CallbackServerContext* context,
    const canzona::v1::GetPlanRequest* request,
    canzona::v1::GetPlanResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Completion(reactor, response, requests_,
             "GetPlan")(engine_->GetPlan(*request));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::Deregister(
    grpc::CallbackServerContext* context,
    const canzona::v1::DeregisterRequest* request,
    canzona::v1::DeregisterResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Status status = engine_->Deregister(*request);
  if (status.ok() && doorbells_ != nullptr) {
    doorbells_->Detach(request->job_id(), request->rank());
  }
  Count(requests_, "Deregister", status);
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::GetStatus(
    grpc::CallbackServerContext* context,
    const canzona::v1::GetStatusRequest* /*request*/,
    canzona::v1::GetStatusResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  *response = engine_->GetStatus();
  Count(requests_, "GetStatus", absl::OkStatus());
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::SaveCheckpoint(
    grpc::CallbackServerContext* context,
    const canzona::v1::SaveCheckpointRequest* request,
    canzona::v1::SaveCheckpointResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  engine_->SaveCheckpoint(
      *request, Completion(reactor, response, requests_, "SaveCheckpoint"));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::LoadCheckpoint(
    grpc::CallbackServerContext* context,
    const canzona::v1::LoadCheckpointRequest* request,
    canzona::v1::LoadCheckpointResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  engine_->LoadCheckpoint(
      *request, Completion(reactor, response, requests_, "LoadCheckpoint"));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::ExportState(
    grpc::CallbackServerContext* context,
    const canzona::v1::ExportStateRequest* request,
    canzona::v1::ExportStateResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  engine_->ExportState(*request,
                       Completion(reactor, response, requests_, "ExportState"));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::ImportState(
    grpc::CallbackServerContext* context,
    const canzona::v1::ImportStateRequest* request,
    canzona::v1::ImportStateResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  engine_->ImportState(*request,
                       Completion(reactor, response, requests_, "ImportState"));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::GradReady(
    grpc::CallbackServerContext* context,
    const canzona::v1::GradReadyRequest* request,
    canzona::v1::GradReadyResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  engine_->GradReady(*request,
                     Completion(reactor, response, requests_, "GradReady"));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::WaitParams(
    grpc::CallbackServerContext* context,
    const canzona::v1::WaitParamsRequest* request,
    canzona::v1::WaitParamsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  engine_->WaitParams(*request,
                      Completion(reactor, response, requests_, "WaitParams"));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::AttachStepDoorbell(
    grpc::CallbackServerContext* context,
    const canzona::v1::AttachStepDoorbellRequest* request,
    canzona::v1::AttachStepDoorbellResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status;
  if (doorbells_ == nullptr) {
    status = absl::UnimplementedError(
        "AttachStepDoorbell: this server serves no step doorbells");
  } else if (absl::StatusOr<PeerInfo> peer =
                 PeerOf(context->peer(), unix_peers_);
             !peer.ok()) {
    status = peer.status();
  } else {
    status = doorbells_->Attach(*request, *peer);
  }
  Count(requests_, "AttachStepDoorbell", status);
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace canzona
