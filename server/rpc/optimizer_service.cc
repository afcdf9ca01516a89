#include "server/rpc/optimizer_service.h"

#include <utility>

#include "server/rpc/status_conversion.h"

namespace canzona {
namespace {

// A completion that moves the engine's result into the RPC's response and
// finishes the RPC; runs on whichever thread the engine completes on.
template <typename Response>
Callback<Response> Completion(grpc::ServerUnaryReactor* reactor,
                              Response* response) {
  return [reactor, response](absl::StatusOr<Response> result) {
    if (result.ok()) *response = *std::move(result);
    reactor->Finish(ToGrpcStatus(result.status()));
  };
}

PeerInfo PeerOf(const grpc::CallbackServerContext& context) {
  PeerInfo peer;
  peer.address = context.peer();
  return peer;
}

}  // namespace

grpc::ServerUnaryReactor* OptimizerServiceImpl::Register(
    grpc::CallbackServerContext* context,
    const canzona::v1::RegisterRequest* request,
    canzona::v1::RegisterResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  engine_->Register(*request, PeerOf(*context), Completion(reactor, response));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::Step(
    grpc::CallbackServerContext* context,
    const canzona::v1::StepRequest* request,
    canzona::v1::StepResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  engine_->Step(*request, Completion(reactor, response));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::GetPlan(
    grpc::CallbackServerContext* context,
    const canzona::v1::GetPlanRequest* request,
    canzona::v1::GetPlanResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Completion(reactor, response)(engine_->GetPlan(*request));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::Deregister(
    grpc::CallbackServerContext* context,
    const canzona::v1::DeregisterRequest* request,
    canzona::v1::DeregisterResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(engine_->Deregister(*request)));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::GetStatus(
    grpc::CallbackServerContext* context,
    const canzona::v1::GetStatusRequest* /*request*/,
    canzona::v1::GetStatusResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  *response = engine_->GetStatus();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace canzona
