// The OptimizerService gRPC service (canzona.v1.OptimizerService): a thin
// callback adapter over the Engine. Handlers validate nothing themselves and
// never block: Register and Step hand the request to the engine and return;
// the engine's worker finishes the RPC through the reactor.
//
//   OptimizerServiceImpl service(engine.get(), &registry);  // or no registry
//   builder.RegisterService(&service);
//
// With `unix_peers` (the daemon's UnixSocketListener::peers()), calls that
// arrived on the daemon's unix socket carry the caller's SO_PEERCRED uid and
// pid into the engine (PeerInfo), which then maps only shared memory the
// caller owns; such a call whose credentials cannot be established fails
// with PERMISSION_DENIED. TCP calls carry no uid: the bearer token checked
// by the port's credentials (transport_security.h) authenticates them.
//
// With a registry, every RPC is counted at completion in
// canzona_rpc_requests_total{method, code} (code: the status code name,
// e.g. OK, INVALID_ARGUMENT).
//
// Thread-safety: thread-safe (the Engine is).
#ifndef CANZONA_SERVER_RPC_OPTIMIZER_SERVICE_H_
#define CANZONA_SERVER_RPC_OPTIMIZER_SERVICE_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "canzona/v1/optimizer_service.grpc.pb.h"
#include "server/engine/engine.h"
#include "server/metrics/registry.h"
#include "server/rpc/step_doorbells.h"
#include "server/rpc/unix_socket_listener.h"

namespace canzona {

// The engine's view of the caller of a call whose ServerContext::peer() is
// `grpc_peer`: uid and pid from `unix_peers` for unix-socket calls ("fd:<n>"
// peers; PERMISSION_DENIED when they are not recorded), the address alone
// otherwise.
absl::StatusOr<PeerInfo> PeerOf(absl::string_view grpc_peer,
                                const PeerCredentialsRegistry* unix_peers);

class OptimizerServiceImpl final
    : public canzona::v1::OptimizerService::CallbackService {
 public:
  // With `doorbells`, AttachStepDoorbell attaches there and Deregister
  // detaches the rank's doorbell; without, AttachStepDoorbell is
  // UNIMPLEMENTED.
  explicit OptimizerServiceImpl(
      Engine* engine, MetricsRegistry* metrics = nullptr,
      const PeerCredentialsRegistry* unix_peers = nullptr,
      StepDoorbells* doorbells = nullptr);

  grpc::ServerUnaryReactor* Register(
      grpc::CallbackServerContext* context,
      const canzona::v1::RegisterRequest* request,
      canzona::v1::RegisterResponse* response) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context,
                                 const canzona::v1::StepRequest* request,
                                 canzona::v1::StepResponse* response) override;
  grpc::ServerUnaryReactor* GetPlan(
      grpc::CallbackServerContext* context,
      const canzona::v1::GetPlanRequest* request,
      canzona::v1::GetPlanResponse* response) override;
  grpc::ServerUnaryReactor* Deregister(
      grpc::CallbackServerContext* context,
      const canzona::v1::DeregisterRequest* request,
      canzona::v1::DeregisterResponse* response) override;
  grpc::ServerUnaryReactor* GetStatus(
      grpc::CallbackServerContext* context,
      const canzona::v1::GetStatusRequest* request,
      canzona::v1::GetStatusResponse* response) override;
  grpc::ServerUnaryReactor* SaveCheckpoint(
      grpc::CallbackServerContext* context,
      const canzona::v1::SaveCheckpointRequest* request,
      canzona::v1::SaveCheckpointResponse* response) override;
  grpc::ServerUnaryReactor* LoadCheckpoint(
      grpc::CallbackServerContext* context,
      const canzona::v1::LoadCheckpointRequest* request,
      canzona::v1::LoadCheckpointResponse* response) override;
  grpc::ServerUnaryReactor* ExportState(
      grpc::CallbackServerContext* context,
      const canzona::v1::ExportStateRequest* request,
      canzona::v1::ExportStateResponse* response) override;
  grpc::ServerUnaryReactor* ImportState(
      grpc::CallbackServerContext* context,
      const canzona::v1::ImportStateRequest* request,
      canzona::v1::ImportStateResponse* response) override;
  grpc::ServerUnaryReactor* GradReady(
      grpc::CallbackServerContext* context,
      const canzona::v1::GradReadyRequest* request,
      canzona::v1::GradReadyResponse* response) override;
  grpc::ServerUnaryReactor* WaitParams(
      grpc::CallbackServerContext* context,
      const canzona::v1::WaitParamsRequest* request,
      canzona::v1::WaitParamsResponse* response) override;
  grpc::ServerUnaryReactor* AttachStepDoorbell(
      grpc::CallbackServerContext* context,
      const canzona::v1::AttachStepDoorbellRequest* request,
      canzona::v1::AttachStepDoorbellResponse* response) override;

 private:
  Engine* engine_;
  // Not owned; null: no daemon-owned unix socket.
  const PeerCredentialsRegistry* unix_peers_ = nullptr;
  StepDoorbells* doorbells_ = nullptr;  // not owned
  // canzona_rpc_requests_total{method, code}; null without a registry.
  Family<Counter>* requests_ = nullptr;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_RPC_OPTIMIZER_SERVICE_H_
