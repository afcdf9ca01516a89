// The daemon's core: jobs, registration, plans and the distributed step,
// behind an interface the gRPC layer (server/rpc) adapts and tests drive
// directly without gRPC.
//
// Calls never block the caller's thread on work or on peers: Register and
// Step hand the request to the job's per-rank worker threads and return;
// `done` runs on a worker thread when the result is known (an rpc reactor
// finishes the RPC from there). Validation failures call `done` inline.
//
//   std::unique_ptr<Engine> engine = ...;
//   engine->Step(request, [reactor, response](auto result) {
//     if (result.ok()) *response = *std::move(result);
//     reactor->Finish(ToGrpcStatus(result.status()));
//   });
//
// Thread-safety: implementations are thread-safe.
#ifndef CANZONA_SERVER_ENGINE_ENGINE_H_
#define CANZONA_SERVER_ENGINE_ENGINE_H_

#include <sys/types.h>

#include <functional>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "canzona/v1/optimizer_service.pb.h"

namespace canzona {

// Who is calling, as the transport knows it.
struct PeerInfo {
  // The trainer's uid from SO_PEERCRED on the unix socket; unset on TCP
  // (where the job token authenticates instead).
  std::optional<uid_t> uid;
  // The trainer's pid (SO_PEERCRED), when on this machine: the engine
  // watches it and releases the rank when the process exits without
  // deregistering.
  std::optional<pid_t> pid;
  std::string address;  // for logs
};

template <typename T>
using Callback = std::function<void(absl::StatusOr<T>)>;

class Engine {
 public:
  virtual ~Engine() = default;

  virtual void Register(const canzona::v1::RegisterRequest& request,
                        const PeerInfo& peer,
                        Callback<canzona::v1::RegisterResponse> done) = 0;
  virtual void Step(const canzona::v1::StepRequest& request,
                    Callback<canzona::v1::StepResponse> done) = 0;
  virtual absl::StatusOr<canzona::v1::GetPlanResponse> GetPlan(
      const canzona::v1::GetPlanRequest& request) = 0;
  virtual absl::Status Deregister(
      const canzona::v1::DeregisterRequest& request) = 0;
  virtual canzona::v1::GetStatusResponse GetStatus() = 0;

  // Checkpoints (collective over the job's ranks) and one rank's state
  // view (not collective); see optimizer_service.proto.
  virtual void SaveCheckpoint(
      const canzona::v1::SaveCheckpointRequest& request,
      Callback<canzona::v1::SaveCheckpointResponse> done) = 0;
  virtual void LoadCheckpoint(
      const canzona::v1::LoadCheckpointRequest& request,
      Callback<canzona::v1::LoadCheckpointResponse> done) = 0;
  virtual void ExportState(const canzona::v1::ExportStateRequest& request,
                           Callback<canzona::v1::ExportStateResponse> done) = 0;
  virtual void ImportState(const canzona::v1::ImportStateRequest& request,
                           Callback<canzona::v1::ImportStateResponse> done) = 0;

  // Overlap with the trainer (optimizer_service.proto): GradReady finishes
  // once the buckets are queued on the rank's communication thread;
  // WaitParams once the bucket's parameters hold the step's update.
  virtual void GradReady(const canzona::v1::GradReadyRequest& request,
                         Callback<canzona::v1::GradReadyResponse> done) = 0;
  virtual void WaitParams(const canzona::v1::WaitParamsRequest& request,
                          Callback<canzona::v1::WaitParamsResponse> done) = 0;

  // Fails every in-flight call with UNAVAILABLE and stops the workers
  // (SIGTERM); later calls get UNAVAILABLE.
  virtual void Shutdown() = 0;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_ENGINE_H_
