// TpLane: one rank's TP micro-group pipeline (server/DESIGN.md section 4):
// per micro group, a fused all-to-all gathers the
// gradient and parameter fragments of each TP-split matrix to its host
// rank, the host updates whole matrices (Compute, on the worker), and a
// fused all-to-all returns the updated fragments, which each rank writes in
// place. Gathers of group i+1 and scatters of group i-1 overlap the compute
// of group i: each group has its own buffers.
//
// Two variants, one contract:
//  - host staging (Gloo): the lane's own long-lived thread issues
//    G0 G1 S0 G2 S1 ... on the TP communicator while the worker computes;
//  - device staging (NCCL): the worker enqueues everything in pipeline
//    order on two streams (the TP stream and the compute stream) ordered by
//    CUDA events, and waits once at the end.
// The lane owns the TP communicator, its copier (stream) and the groups'
// buffers; the worker uses the communicator between runs (redundant
// updates, checkpoints) through communicator().
//
//   CANZONA_RETURN_IF_ERROR(lane->Run(
//       [&](int i) { return ComputeGroup(i, lane->buffers(i)); }, &times));
//
// Thread-safety: Run, communicator() and buffers() on the rank's worker
// only; the host variant's thread touches the communicator, the copier and
// the buffers only inside Run.
#ifndef CANZONA_SERVER_ENGINE_TP_LANE_H_
#define CANZONA_SERVER_ENGINE_TP_LANE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "server/comm/nccl_api.h"
#include "server/engine/communicator_factory.h"
#include "server/engine/job_plan.h"
#include "server/engine/owned_buffers.h"
#include "server/engine/phase_seconds.h"
#include "server/engine/rank_layout.h"
#include "server/engine/staging_copier.h"

namespace canzona {

// One micro group's exchange buffers, in staging memory.
struct GroupBuffers {
  DeviceBuffer send;     // [grad, param] of every fragment, per host
  DeviceBuffer recv;     // on the host: [grad, param] per source rank
  DeviceBuffer back;     // on the host: updated fragments per rank
  DeviceBuffer back_in;  // my updated fragments, per host
};

class TpLane {
 public:
  // Group i's update on its host, on the worker: reads buffers(i).recv,
  // writes buffers(i).back.
  using Compute = std::function<absl::Status(int group)>;

  struct Parts {
    std::unique_ptr<StagingCopier> copier;
    MadeCommunicator tp;
    std::vector<GroupBuffers> buffers;  // one per layout group
  };
  struct Staging {
    std::shared_ptr<const JobPlan> plan;
    const RankLayout* layout = nullptr;
    const OwnedBuffers* owned = nullptr;
    // The worker's staging backend (host variant: synchronized before the
    // lane's thread reads what the worker wrote).
    Backend* backend = nullptr;
  };
  // The device variant's streams and events.
  struct Streams {
    NcclApi* api = nullptr;
    int device = 0;
    NcclStream compute = nullptr;  // the compute backend's stream
    absl::Duration timeout = absl::Seconds(60);
  };

  static std::unique_ptr<TpLane> CreateHost(Staging staging, Parts parts);
  static absl::StatusOr<std::unique_ptr<TpLane>> CreateDevice(
      Staging staging, Parts parts, const Streams& streams);

  virtual ~TpLane() = default;
  TpLane(const TpLane&) = delete;
  TpLane& operator=(const TpLane&) = delete;

  // Runs every micro group of the step and adds to the tp_* phase times.
  virtual absl::Status Run(const Compute& compute, PhaseSeconds* times) = 0;

  Communicator& communicator() { return *parts_.tp.comm; }
  GroupBuffers& buffers(int i) { return parts_.buffers[i]; }
  int groups() const { return static_cast<int>(parts_.buffers.size()); }
  // The lane's own copies between the host and a GPU from pageable memory.
  int64_t pageable_copies() const { return parts_.copier->pageable_copies(); }
  // The last run's TP communication seconds and the part of it hidden
  // behind compute (canzona_tp_overlap_ratio; 0 where not measured).
  double comm_seconds() const { return comm_s_; }
  double hidden_seconds() const { return hidden_s_; }

 protected:
  TpLane(Staging staging, Parts parts);

  // Packs group i's [grad, param] fragments per host (on the copier).
  absl::Status Pack(int i);
  // Writes group i's updated fragments in place (on the copier).
  absl::Status Unpack(int i);
  const GroupLayout& group(int i) const { return staging_.layout->groups[i]; }

  const Staging staging_;
  Parts parts_;
  double comm_s_ = 0, hidden_s_ = 0;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_TP_LANE_H_
