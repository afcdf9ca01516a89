// RankRuntime: what setup fixes for one local rank's worker to run the
// step: its backends (RankBackends), the update rules of what the rank
// owns, the owned (ZeRO-1) buffers, the scratch and exchange buffers, the
// world communicator, and the two lanes (BucketCollectives, run by the
// rank's DP lane thread; TpLane). SetupRank (rank_setup.h) builds it in
// named steps at registration; nothing in it is allocated in a step, and
// nothing is sized by the stage except under the redundant baselines. Also
// the one thing a step leaves for the next: the pending update
// (PendingUpdate). What one step uses and drops is the step's own
// (rank_step.cc).
//
// Staging is where the communicators read and write. The Gloo data plane
// stages in host memory (`staging()` is a cpu backend); the NCCL data plane
// (`resident()`) stages in the rank's GPU memory (`staging()` is the
// compute backend itself), so trainer buffers, collectives and updates
// never pass through the host. The step code is the same for both: the
// worker moves staging data through `staging()` (Backend calls), the lanes
// through their StagingCopier.
//
//   RankRuntime& rt = *rank.rt;
//   CANZONA_RETURN_IF_ERROR(rt.Update(i, rt.owned().param_at[i],
//                                     rt.owned().grad_at[i], options));
//
// Thread-safety: the rank's worker thread, except what the lanes own (see
// BucketCollectives and TpLane) and the communicators, which another thread
// may Abort() (LocalRank::AbortComms).
#ifndef CANZONA_SERVER_ENGINE_RANK_RUNTIME_H_
#define CANZONA_SERVER_ENGINE_RANK_RUNTIME_H_

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "server/comm/communicator.h"
#include "server/engine/bucket_collectives.h"
#include "server/engine/job_plan.h"
#include "server/engine/owned_buffers.h"
#include "server/engine/owned_device_copy.h"
#include "server/engine/pending_update.h"
#include "server/engine/pinned_host_memory.h"
#include "server/engine/rank_backends.h"
#include "server/engine/rank_layout.h"
#include "server/engine/rank_metrics.h"
#include "server/engine/staging_copier.h"
#include "server/engine/tp_lane.h"
#include "server/engine/update_batches.h"
#include "server/optim/shared_scratch.h"
#include "server/optim/update_rule.h"

namespace canzona {

class RankRuntime {
 public:
  // The step's one world reduction: [non-finite flag, the gradient's and
  // the previous update's sums of squares, the clip norm, how many ranks
  // clip]. The scalars buffer holds exactly these (the type keeps the two
  // in step: a fifth value once overran a 4-float buffer on the GPU).
  static constexpr int kWorldValues = 5;
  using WorldValues = std::array<float, kWorldValues>;

  RankRuntime(const RankRuntime&) = delete;
  ~RankRuntime();
  RankRuntime& operator=(const RankRuntime&) = delete;

  // The backends (RankBackends).
  Backend& compute() { return backends_.compute(); }
  Backend& host() { return backends_.host(); }
  Backend& staging() { return backends_.staging(); }
  bool resident() const { return backends_.resident(); }
  int device() const { return backends_.device(); }
  const std::string& pci_bus_id() const { return backends_.pci_bus_id(); }

  const JobPlan& plan() const { return *plan_; }
  const RankLayout& layout() const { return layout_; }

  // Parameter i's update rule, where the rank keeps its state (by plan
  // index): FindRule is null elsewhere; rule(i) must exist.
  bool has_rule(int i) const { return rules_.count(i) > 0; }
  UpdateRule* FindRule(int i);
  UpdateRule& rule(int i) { return *rules_.at(i); }
  // The DP-owned updates (not TP-owned), same-shape Muon
  // matrices batched (update_batches.h). They run in place on the compute
  // backend: in staging, or (cuda compute, host staging) on the GPU's copy
  // of the owned buffers, which LoadDpOwned fills once the step's sums are
  // in (the step then scales, checks and clips those gradients there) and
  // StoreDpOwned writes back (OwnedDeviceCopy; no-ops elsewhere).
  const std::vector<UpdateBatch>& dp_owned_batches() const {
    return dp_owned_batches_;
  }
  absl::Status LoadDpOwned() {
    return device_copy_ == nullptr ? absl::OkStatus() : device_copy_->Load();
  }
  absl::Status StoreDpOwned() {
    return device_copy_ == nullptr ? absl::OkStatus() : device_copy_->Store();
  }
  // Null unless the compute backend is not staging's.
  const OwnedDeviceCopy* device_copy() const { return device_copy_.get(); }
  // Every held gradient times `factor` (the 1 / DP average, clipping),
  // wherever the step reads it (after LoadDpOwned).
  absl::Status ScaleGradients(float factor);
  // The parameters of the rank's stage it holds a gradient of (plan
  // indices, trainer order).
  const std::vector<int>& held_grads() const { return held_grads_; }
  // The squared sum of each of held_grads() into `sums`, in double,
  // wherever the step reads them: one SumSquaresMany, one wait, per backend
  // (under OwnedDeviceCopy the DP-owned ones on the GPU, the others in
  // host staging). Setup runs it once too, so that step 1 allocates
  // nothing for it.
  absl::Status SumGradients(std::vector<double>& sums);
  // Drops the rules and their state (a rank removed gracefully: its worker
  // has stopped); the batches pointing at them go too.
  void ReleaseRules();

  // Whole matrices assembled side by side in whole_param() / whole_grad()
  // (the TP owner's and the redundant updates'): parameter `param`'s at
  // `offset` elements, each right after the one before, the first at 0.
  struct WholeUpdate {
    int param = -1;
    int64_t offset = 0;
    StepOptions options;
  };
  // Elements whole_param() / whole_grad() hold: the largest matrix, and
  // with host staging beside a GPU the largest micro group's matrices
  // hosted here (RankLayout::max_group_whole), so that a group's updates
  // cross to the GPU together.
  int64_t whole_capacity() const { return whole_param_.size(); }
  // Runs `updates`: in place when staging is the compute backend's memory
  // (cpu, or the NCCL data plane); else (cuda compute, host staging)
  // through the device buffers, one copy each way for all of them and one
  // wait, so the parameters are final in whole_param() on return.
  // INTERNAL if they are not laid out as WholeUpdate says or overrun
  // whole_capacity() (a layout bug).
  absl::Status UpdateWhole(absl::Span<const WholeUpdate> updates);

  // ZeRO-1 (owned_buffers.h): where the step finds the fp32 gradients and
  // values of what the rank holds.
  OwnedBuffers& owned() { return owned_; }
  // An update's previous values (the update RMS), on the compute backend:
  // room for the largest batch that counts its updates from a copy
  // (UpdateBatch::Counting::kFromCopy; Muon and AdamW need none).
  float* update_before() { return before_.data(); }
  // The redundant updates' exchange buffers ([grad, param] of the rank's
  // fragment; of every TP rank's), and the whole matrices the TP owner and
  // the redundant updates assemble, in staging memory.
  float* redundant_send() { return redundant_send_.data(); }
  float* redundant_recv() { return redundant_recv_.data(); }
  float* whole_grad() { return whole_grad_.data(); }
  float* whole_param() { return whole_param_.data(); }

  // The step's hand-overs with the DP lane, which neither waits on the
  // host for the other on a GPU (events between the lane's copier stream
  // and the compute stream): the step's work on staging from here on runs
  // after the lane's reductions (after DpLane::WaitReduced); the lane's
  // gathers after the step's work so far (before DpLane::StartGathers).
  // A backend without a stream waits on the host instead. In between, the
  // masters of the trainer's parameters `reload` (changed since its last
  // step) are read again, after the trainer's last event: its edit may
  // come after the records the reductions waited for (each bucket's
  // GradReady).
  absl::Status AfterReductions(absl::Span<const int> reload = {});
  // Whether the rank's device work has ended: the DP copier's stream
  // finished (BucketCollectives::FinishAtTeardown, one wait up to its
  // timeout for the whole teardown) and the compute backend is not
  // stalled. Teardown asks before the trainer's mappings go.
  bool DeviceWorkFinished();
  absl::Status BeforeGathers();

  // Sums `values` over the job's ranks (through staging memory).
  absl::Status WorldSum(WorldValues& values);
  // Host round trips so far (StepResponse.host_waits): the compute
  // backend's waits and the DP and world copiers'.
  int64_t host_waits();
  // Copies between the host and the GPU whose host side was pageable since
  // the last call (StepResponse.pageable_copies): the compute backend's,
  // and the DP and world copiers' (theirs and the trainer's CUDA IPC
  // copies counted there). Beside a GPU every such side is page-locked
  // (RankBuilder::PinStaging, PinnedHostMemory) unless the driver refused.
  int64_t TakePageableCopies();
  // What the last step left for this step's world reduction.
  PendingUpdate& pending_update() { return pending_update_; }
  // The device time of the latest DP-owned updates the device finished
  // (negative before any): what local_compute reports while a step's own
  // are still running at its answer.
  double& finished_compute_seconds() { return finished_compute_seconds_; }

  TpLane& tp_lane() { return *tp_; }
  BucketCollectives& buckets() { return *buckets_; }
  RankMetrics* metrics() { return metrics_.get(); }  // null without registry

  // Parameters whose update rule (state) is here, and the daemon's memory
  // for this rank by kind (RegisterResponse, metrics): state, master
  // copies, and working buffers (owned gradients, slot, TP and
  // whole-matrix buffers, communicator scratch).
  int owned_params() const { return owned_params_; }
  int64_t state_bytes() const { return state_bytes_; }
  // Bytes of host memory that meets the GPU which the driver refused to
  // page-lock (RegisterResponse.pageable_host_bytes): the trainer's shared
  // memory on the NCCL plane, host staging beside a GPU, the sums' floats.
  int64_t pageable_host_bytes() const;
  int64_t master_bytes() const { return master_bytes_; }
  int64_t buffer_bytes() const { return buffer_bytes_; }

 private:
  friend class RankBuilder;  // SetupRank
  RankRuntime() = default;

  // Declared first: destroyed last, after every buffer allocated from the
  // backends and everything that copies from the pinned trainer memory.
  RankBackends backends_;
  std::shared_ptr<const JobPlan> plan_;
  std::vector<int> held_grads_;
  RankLayout layout_;

  // The rules' scratch, shared by all of them (declared first: it outlives
  // them).
  std::unique_ptr<SharedScratch> rule_scratch_;
  // Where blocked rules gather blocks whose rows are not contiguous (q of
  // every query group) while they step; shared like rule_scratch_.
  std::unique_ptr<SharedScratch> block_gather_;
  std::map<int, std::unique_ptr<UpdateRule>> rules_;  // by plan index
  std::vector<UpdateBatch> dp_owned_batches_;
  int owned_params_ = 0;
  int64_t state_bytes_ = 0;
  // cuda compute with host (Gloo) staging: the TP-owned and redundant
  // updates copy their whole parameters and gradients through these
  // device buffers, sized like the whole matrices in staging.
  DeviceBuffer device_param_, device_grad_;

  // ZeRO-1 (owned_buffers.h), in staging memory: the fp32 gradients of
  // what the rank holds, the master copies, the bucket slot, a 16-bit
  // reduce-scatter's output and the conversions' host scratch; `owned_`
  // points into them (and into the
  // trainer's buffers). `before_`: an update's previous values (the update
  // RMS).
  OwnedMemory owned_memory_;
  OwnedBuffers owned_;
  std::unique_ptr<OwnedDeviceCopy> device_copy_;
  DeviceBuffer before_;
  // The redundant updates' exchange buffers, the whole matrices the TP
  // owner and the redundant updates assemble, and the world reduction's
  // values.
  DeviceBuffer redundant_send_, redundant_recv_, whole_grad_, whole_param_;
  DeviceBuffer scalars_;
  // Their host side (SumThroughStaging), page-locked beside a GPU.
  std::unique_ptr<PinnedHostFloats> host_scalars_;
  // Host staging page-locked for the GPU (RankBuilder::PinStaging): the
  // owned memory and the whole matrices above, declared after them so that
  // it is unlocked before they go.
  std::unique_ptr<PinnedHostMemory> pinned_staging_;
  int64_t master_bytes_ = 0;
  int64_t buffer_bytes_ = 0;
  // The last step's update sum of squares (counted once job-wide), summed
  // over the world with the next step's gradient norm.
  PendingUpdate pending_update_;
  int64_t pageable_copies_taken_ = 0;  // TakePageableCopies' total so far
  double finished_compute_seconds_ = -1;
  // The world reductions' copier (stream), declared before the
  // communicator, which is destroyed first.
  std::unique_ptr<StagingCopier> world_copier_;
  std::unique_ptr<Communicator> world_;
  std::unique_ptr<RankMetrics> metrics_;  // null without a registry

  // Declared last: destroyed first, before the staging they read.
  std::unique_ptr<TpLane> tp_;
  std::unique_ptr<BucketCollectives> buckets_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_RANK_RUNTIME_H_
