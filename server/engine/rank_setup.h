// SetupRank: builds one local rank's RankRuntime at registration, in named
// steps (rank_setup.cc): the backends and the data plane, the layout, the
// communicators (collective with the job's other ranks), the owned and
// exchange buffers, the update rules, the batches, the two lanes, then the
// memory accounting, the metrics and the trainer's view of it.
//
//   CANZONA_ASSIGN_OR_RETURN(rank.rt, SetupRank(setup, &rank.response));
//
// Thread-safety: the rank's worker (on_communicator and on_failure are
// called there too).
#ifndef CANZONA_SERVER_ENGINE_RANK_SETUP_H_
#define CANZONA_SERVER_ENGINE_RANK_SETUP_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "server/comm/communicator.h"
#include "server/comm/nccl_api.h"
#include "server/control/kv_store.h"
#include "server/engine/job_plan.h"
#include "server/engine/job_settings.h"
#include "server/engine/rank_runtime.h"
#include "server/engine/trainer_buffers.h"
#include "server/metrics/registry.h"

namespace canzona {

// What SetupRank needs from the engine.
struct RankSetup {
  std::string job_id;
  const JobSettings* settings = nullptr;
  canzona::v1::RankCoordinates coords;
  int global = 0;
  std::shared_ptr<const JobPlan> plan;
  const TrainerBuffers* trainer = nullptr;
  int local_ranks = 1;  // ranks of the job on this daemon

  // The daemon's settings (EngineOptions).
  KvStore* control = nullptr;
  std::string backend = "cpu";
  bool nccl = false;             // comm "nccl"
  NcclApi* nccl_api = nullptr;   // null: the real library
  bool device_like_cpu = false;  // EngineOptions::device_like_cpu
  std::function<int()> cuda_devices;
  // The PCI bus id of one of this process's devices (GetStatus, metrics).
  std::function<absl::StatusOr<std::string>(int)> pci_bus_id;
  std::string comm_host = "127.0.0.1";
  absl::Duration step_timeout = absl::Seconds(60);
  MetricsRegistry* metrics = nullptr;
  // Same-shape Muon updates in one batched Newton-Schulz (false: one
  // call per matrix; EngineOptions::batch_updates).
  bool batch_updates = true;
  // Called with each communicator once the rank's groups exist, so that a
  // failure elsewhere can abort them even while setup still runs.
  std::function<void(Communicator*)> on_communicator;
  // Called when setup fails after on_communicator, before those
  // communicators are destroyed: whoever holds them forgets them (else an
  // abort of the failed job would use them after they are freed).
  std::function<void()> on_failure;
};

// The GPU rank `global` works on: its trainer's, for buffers in GPU memory
// (CUDA IPC); else its global rank modulo the node's `devices` (a node's
// trainers are its consecutive global ranks); 0 without devices.
int RankGpu(const TrainerBuffers* trainer, int global, int devices);

// Builds the rank's runtime and fills `response` (plan digest, owned
// parameters, state bytes, buckets). Collective with the job's other ranks
// (communicator rendezvous).
absl::StatusOr<std::unique_ptr<RankRuntime>> SetupRank(
    const RankSetup& setup, canzona::v1::RegisterResponse* response);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_RANK_SETUP_H_
