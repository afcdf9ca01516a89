// RankRuntime: everything one local rank's worker owns to run the step:
// the compute backend (and a host backend for host staging), the update
// rules of what the rank owns, the owned (ZeRO-1) buffers, the world
// communicator, and the two lanes (BucketCollectives, run by the rank's DP
// lane thread; TpLane). SetupRank builds it in named steps at
// registration; nothing in it is allocated in a step, and nothing is sized
// by the stage except under the redundant baselines.
//
// Staging is where the communicators read and write. The Gloo data plane
// stages in host memory (`staging` is a cpu backend); the NCCL data plane
// (`resident()`) stages in the rank's GPU memory (`staging` is the compute
// backend itself), so trainer buffers, collectives and updates never pass
// through the host. The step code is the same for both: the worker moves
// staging data through `staging` (Backend calls), the lanes through their
// StageCopier.
//
// Thread-safety: the rank's worker thread, except what the lanes own (see
// BucketCollectives and TpLane) and the communicators, which another thread
// may Abort() (LocalRank::AbortComms).
#ifndef CANZONA_SERVER_ENGINE_RANK_RUNTIME_H_
#define CANZONA_SERVER_ENGINE_RANK_RUNTIME_H_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "kernels/backend.h"
#include "server/comm/communicator.h"
#include "server/comm/nccl_api.h"
#include "server/control/kv_store.h"
#include "server/engine/bucket_collectives.h"
#include "server/engine/job_plan.h"
#include "server/engine/job_settings.h"
#include "server/engine/owned_buffers.h"
#include "server/engine/pending_update.h"
#include "server/engine/pinned_host_memory.h"
#include "server/engine/rank_layout.h"
#include "server/engine/rank_metrics.h"
#include "server/engine/stage_copier.h"
#include "server/engine/tp_lane.h"
#include "server/engine/trainer_buffers.h"
#include "server/engine/update_batches.h"
#include "server/metrics/registry.h"
#include "server/optim/shared_scratch.h"
#include "server/optim/update_rule.h"

namespace canzona {

struct RankRuntime {
  std::unique_ptr<Backend> backend;       // compute
  std::unique_ptr<Backend> host_backend;  // cpu, when `backend` is not
  Backend* host = nullptr;                // a cpu backend
  Backend* staging = nullptr;             // host, or backend when resident
  // The trainer's buffers, registered with `staging` where its
  // collectives and kernels address them in place (range checks).
  std::vector<RegisteredMemory> trainer_memory;
  NcclApi* nccl_api = nullptr;  // set exactly on the NCCL plane
  // The NCCL plane's trainer shared memory, page-locked while the rank
  // lives (destroyed after everything that copies from it).
  std::unique_ptr<PinnedHostMemory> pinned_trainer_memory;
  // The rank's GPU: where its updates run (cuda) or its trainer's buffers
  // live (CUDA IPC), and its PCI bus id (empty: no GPU involved).
  int device = 0;
  std::string pci_bus_id;
  std::shared_ptr<const JobPlan> plan;
  RankLayout layout;

  // The rules' scratch, shared by all of them (declared first: it outlives
  // them).
  std::unique_ptr<SharedScratch> rule_scratch;
  // Where blocked rules gather blocks whose rows are not contiguous (q of
  // every query group) while they step; shared like rule_scratch.
  std::unique_ptr<SharedScratch> block_gather;
  std::map<int, std::unique_ptr<UpdateRule>> rules;  // by plan index
  // The local updates (DP-owned, not TP-hosted), same-shape Muon
  // matrices batched (update_batches.h).
  std::vector<UpdateBatch> local_batches;
  int owned_params = 0;  // parameters whose update rule (state) is here
  int64_t state_bytes = 0;
  // cuda compute with host (Gloo) staging: each update copies its
  // parameter and gradient through these device buffers, sized for the
  // largest rule.
  DeviceBuffer device_param, device_grad;

  // ZeRO-1 (owned_buffers.h), in staging memory: the fp32 gradients of
  // what the rank holds, the master copies, the bucket slot and a 16-bit
  // reduce-scatter's output; `owned` points into them (and into the
  // trainer's buffers). `before`: an update's previous values (the update
  // RMS).
  OwnedMemory owned_memory;
  OwnedBuffers owned;
  DeviceBuffer before;
  // The redundant updates' exchange buffers, the whole matrices the TP
  // host and the redundant updates assemble, and the world reduction's
  // values.
  DeviceBuffer redundant_send, redundant_recv, whole_grad, whole_param;
  DeviceBuffer scalars;
  // The daemon's memory for this rank by kind (RegisterResponse, metrics):
  // master copies, and working buffers (owned gradients, slot, TP and
  // whole-matrix buffers, communicator scratch); state is state_bytes.
  int64_t master_bytes = 0;
  int64_t buffer_bytes = 0;
  // The last step's update sum of squares (counted once job-wide), summed
  // over the world with the next step's gradient norm.
  PendingUpdate pending_update;
  // The world reductions' copier (stream), declared before the
  // communicator, which is destroyed first.
  std::unique_ptr<StageCopier> world_copier;
  std::unique_ptr<Communicator> world;
  std::unique_ptr<RankMetrics> metrics;  // null without a registry

  // Declared last: destroyed first, before the staging they read.
  std::unique_ptr<TpLane> tp;
  std::unique_ptr<BucketCollectives> buckets;

  bool resident() const { return nccl_api != nullptr; }

  // Parameter i's update on `param` / `grad` in staging memory: in place
  // when staging is the compute backend's memory (cpu, or the NCCL data
  // plane); else (cuda compute, host staging) through the device buffers
  // (the copy back synchronizes, so `param` is final on return).
  absl::Status Update(int i, float* param, const float* grad,
                      const StepOptions& options);
  // The step's one world reduction: [non-finite flag, the gradient's and
  // the previous update's sums of squares, the clip norm, how many ranks
  // clip]. `scalars` holds exactly these (the type keeps the two in step:
  // a fifth value once overran a 4-float buffer on the GPU).
  static constexpr int kWorldValues = 5;
  using WorldValues = std::array<float, kWorldValues>;
  // Sums `values` over the job's ranks (through staging memory).
  absl::Status WorldSum(WorldValues& values);
  // The fp32 bytes of `buffer`.
  static int64_t Bytes(const DeviceBuffer& buffer) {
    return buffer.size() * static_cast<int64_t>(sizeof(float));
  }
};

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
  bool nccl = false;            // comm "nccl"
  NcclApi* nccl_api = nullptr;  // null: the real library
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

// Builds the rank's runtime and fills `response` (plan digest, owned
// parameters, state bytes, buckets). Collective with the job's other ranks
// (communicator rendezvous).
absl::StatusOr<std::unique_ptr<RankRuntime>> SetupRank(
    const RankSetup& setup, canzona::v1::RegisterResponse* response);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_RANK_RUNTIME_H_
