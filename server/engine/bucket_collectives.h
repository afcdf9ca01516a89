// BucketCollectives: the DP communication of one rank's buckets, the first
// and last phases of the step (server/DESIGN.md sections 4 and 5.1):
//  - Reduce(b): sum bucket b's gradients over DP (unscaled: the step
//    applies 1/DP and the loss scale) into the rank's owned fp32
//    gradients: my slice when bucket-sliced (reduce-scatter-v at parameter
//    boundaries inside the shard group, then the all-reduce of the slice
//    across groups), else the whole bucket (an even reduce-scatter +
//    all-gather: every element summed in DP rank order on one rank, so
//    every strategy gets the same bits). The collective runs in the
//    bucket's reduce dtype (the trainer's, or fp32) straight from the
//    trainer's gradient buffer when it holds the bucket in bucket order in
//    memory the data plane addresses, else from the bucket slot. Master
//    copies are read from the trainer here (fp32: every step; bf16 / fp16
//    master weights: until set);
//  - Gather(b): bring the updated parameters to every DP rank of the shard
//    group (all-gather-v in the bucket's dtype, in place in the trainer's
//    buffer or through the slot; layerwise plans gather every owned
//    parameter at once) and into the trainer's buffers, rounded once.
// A GPU trainer on the host (Gloo) plane is reached through the CUDA IPC
// layer, one synchronous copy per call: where the trainer lays a bucket
// out in bucket order, each of its copies is one per bucket (its
// gradients into the slot or the owned gradients, the master copies read,
// the parameters written back), else one per parameter.
// It owns the DP and cross-group communicators, the DP copier (whose stream
// they run on), the DP scratch buffers and the uneven calibration; the
// host scratch of conversions through the IPC layer is OwnedBuffers'.
//
//   DpLane lane(buckets,
//       [c](int64_t k, int b) { return c->Reduce(b, k); },
//       [c](int64_t, int b) { return c->Gather(b); });
//   c->CaptureGradients(k, buckets);  // at GradReady, before MarkReady
//
// Thread-safety: Reduce and Gather run on the rank's DP lane thread only.
// Between a step's reductions and its gathers the worker owns the owned
// buffers and the copier: after DpLane::WaitReduced it orders its work
// after the reductions (copier().HandTo: the reductions leave their copies
// in flight), and before DpLane::StartGathers the gathers after its work
// (RankRuntime::AfterReductions, BeforeGathers).
#ifndef CANZONA_SERVER_ENGINE_BUCKET_COLLECTIVES_H_
#define CANZONA_SERVER_ENGINE_BUCKET_COLLECTIVES_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "server/comm/communicator.h"
#include "server/engine/exported_events.h"
#include "server/engine/gradient_snapshots.h"
#include "server/engine/job_plan.h"
#include "server/engine/owned_buffers.h"
#include "server/engine/pinned_host_memory.h"
#include "server/engine/rank_layout.h"
#include "server/engine/staging_copier.h"
#include "server/engine/trainer_buffers.h"
#include "server/engine/uneven_calibration.h"

namespace canzona {

class BucketCollectives {
 public:
  struct Parts {
    std::unique_ptr<StagingCopier> copier;
    // dp: the DP ranks of my shard group (all of DP when flat); cross: the
    // ranks at my position in the other groups (hierarchical sharding).
    std::unique_ptr<Communicator> dp, cross;
    // The dp communicator's chooser reads it (created before dp).
    std::unique_ptr<UnevenCalibration> calibration;
    // The "parameters written" events, one per bucket, recorded after its
    // gather instead of a host wait (null: the gathers wait).
    std::unique_ptr<ExportedEvents> params_written;
    // A GPU trainer's gradients event as of each bucket's GradReady (NCCL
    // plane; null: the reductions wait for the event itself).
    std::unique_ptr<GradientSnapshots> snapshots;
    // Staging memory: the unsliced reduce-scatter's output (my largest
    // even part); the layerwise gather's packed send and receive buffers;
    // the calibration's all-reduce.
    DeviceBuffer part, packed, gathered, sums;
    // The calibration's sums on the host (SumThroughStaging).
    std::unique_ptr<PinnedHostFloats> host_sums;
  };
  // What the collectives read and write besides their own parts.
  struct Staging {
    std::shared_ptr<const JobPlan> plan;
    const RankLayout* layout = nullptr;
    const TrainerBuffers* trainer = nullptr;
    bool on_device = false;  // NCCL data plane: staging is device memory
    const OwnedBuffers* owned = nullptr;
    std::string who;  // the rank, for logs
  };

  BucketCollectives(Staging staging, Parts parts);
  // Waits for the DP copier's work unless FinishAtTeardown already did.
  ~BucketCollectives();
  // Teardown (nothing is queued after it): waits, up to the copier's
  // timeout, for the DP copier's work to end; later calls return the first
  // answer without waiting again, so a stuck stream costs one timeout.
  absl::Status FinishAtTeardown();
  BucketCollectives(const BucketCollectives&) = delete;
  BucketCollectives& operator=(const BucketCollectives&) = delete;

  // Reduce bucket b of step `step` (0: a step without GradReady
  // snapshots).
  absl::Status Reduce(int b, int64_t step = 0);
  absl::Status Gather(int b);
  // At GradReady, before the lane may take them: what the trainer's
  // gradients event means now, for `buckets` of `step` (GradientSnapshots;
  // nothing without one). Any thread; a failure is logged and those
  // buckets wait for the event itself.
  void CaptureGradients(int64_t step, absl::Span<const int> buckets);
  // The job moved to another step: no snapshot taken so far applies.
  void ForgetSnapshots() {
    if (parts_.snapshots != nullptr) parts_.snapshots->Forget();
  }

  // Whether the staged fp32 master weights of bf16 / fp16 parameters are
  // set (a checkpoint or import wrote them: true), or must be read from the
  // trainer's parameters at the next Reduce (false). The worker calls it
  // while the lane is idle.
  void MastersSet(bool set);
  // Stages parameter i's master weights from the trainer's parameter now,
  // unless its bucket's are set already (a step or a load set them): a
  // parameter a checkpoint has no record of keeps its current value. The
  // worker calls it while the lane is idle.
  absl::Status ReadMasterUnlessSet(int i);
  // Stages again, from the trainer, the master weights held here of the
  // trainer's parameters `params` (its indices), which it changed since
  // its last step (bf16 / fp16 ones: fp32 values are read every step):
  // each element whose master no longer rounds to the trainer's value
  // takes it, the others keep their fp32 bits.
  // RankRuntime::AfterReductions calls it after the step's reductions and
  // the trainer's last event, before their hand-over.
  absl::Status ReloadMasters(absl::Span<const int> params);

  // The bytes of bucket staging the buckets need (0: every collective
  // works on trainer memory in place); the owner allocates OwnedBuffers'
  // slot of this size before the first Reduce.
  int64_t slot_bytes() const { return slot_bytes_; }
  // The bytes of host scratch copies through the IPC layer need (0: none
  // converts there); the owner allocates OwnedBuffers' scratch of this
  // size before the first Reduce.
  int64_t scratch_bytes() const { return scratch_bytes_; }
  // The bytes of its own parts (part, packed, gathered, sums).
  int64_t buffer_bytes() const;
  // The bytes of its host memory the driver refused to page-lock (the
  // calibration's host sums).
  int64_t pageable_host_bytes() const {
    return parts_.host_sums != nullptr ? parts_.host_sums->refused_bytes() : 0;
  }

  Communicator& dp() { return *parts_.dp; }
  Communicator& cross() { return *parts_.cross; }
  // The DP copier (its stream runs the reductions and the gathers).
  StagingCopier& copier() { return *parts_.copier; }
  // The layerwise gather's receive buffer, from which a GPU trainer's
  // parameters are written (empty for other strategies).
  const DeviceBuffer& gathered() const { return parts_.gathered; }
  // Work enqueued from here on (the step's updates, after HandTo) waits for
  // the trainer's last "gradients written" event, the one Step reports
  // too: trainer work queued after its last GradReady (on parameters or
  // gradients) comes before the daemon's writes.
  absl::Status AfterTrainer() { return WaitForTrainer(nullptr); }
  // The "parameters written" events (null when the gathers wait).
  const ExportedEvents* params_written() const {
    return parts_.params_written.get();
  }

 private:
  // A bucket's runs in trainer memory on the far side of a copy, each
  // moved in one copy: a GPU trainer's CUDA IPC buffers under host staging
  // (one IPC copy), a trainer's shared memory under device staging (the
  // NCCL plane: one cudaMemcpyAsync on the copier's stream, from the
  // page-locked mapping); null where the trainer does not lay them out in
  // bucket order (then one copy per parameter).
  struct TrainerRuns {
    // The whole bucket's gradients and parameters: the slot's layout.
    const void* grads = nullptr;
    void* params = nullptr;
    // The parameters held here (plan indices, bucket order; all with
    // master copies, as trainer memory the data plane does not address
    // has no fp32 value to update in place), their elements, and their
    // gradients and parameters in the trainer when back to back (and the
    // owned gradients back to back too, as LayoutOwned puts them).
    std::vector<int> held;
    int64_t held_elements = 0;
    const void* held_grads = nullptr;
    void* held_params = nullptr;
    // The held parameters' master copies lie back to back in bucket
    // order: read and written straight, without the scratch.
    bool masters_in_order = false;
  };

  // Work enqueued on the copier from here on comes after the trainer's
  // gradients: `snapshot` (GradientSnapshots) where one was taken, else
  // the trainer's event; on the device, or on the host where NCCL work
  // follows on the copier's stream (WaitForTrainer's comment says why).
  absl::Status WaitForTrainer(NcclEvent snapshot);
  // Master copies of bucket b's held parameters from the trainer.
  absl::Status ReadMasters(int b);
  // Parameter i's gradient (`grad`) or master copy from the trainer into
  // its owned slot as fp32.
  absl::Status ReadOne(int i, bool grad);
  // The gradients of bucket b's held parameters into the owned gradients
  // as fp32 (one DP rank: no collective).
  absl::Status ReadHeldGrads(int b);
  // The held parameters' values of bucket b into the trainer (every
  // parameter of it held here: sc, or one DP rank).
  absl::Status WriteHeld(int b);
  // Bucket b's runs (parameters `js`, trainer indices in bucket order).
  TrainerRuns TrainerRunsOf(const BucketLayout& b,
                            absl::Span<const int> js) const;
  // `bytes` of the scratch (INTERNAL when setup sized it smaller).
  absl::StatusOr<char*> Scratch(int64_t bytes);
  // The runs of bucket b (null when the data plane's collectives work on
  // the trainer's memory in place: DP > 1 over addressable memory).
  const TrainerRuns* trainer_runs(int b) const {
    return trainer_runs_.empty() ? nullptr : &trainer_runs_[b];
  }
  absl::Span<char> scratch() const {
    return absl::MakeSpan(staging_.owned->scratch,
                          static_cast<size_t>(staging_.owned->scratch_bytes));
  }
  // The bucket's gradients into the slot in its reduce dtype (or the
  // trainer's own buffer when it holds them in place).
  absl::StatusOr<const void*> GradSource(int b);
  // Held parameter i's value into the trainer (rounded), unless the
  // update wrote it there in place.
  absl::Status WriteBack(int i);
  // Layerwise: each rank's owned parameters packed in stage order, one
  // all-gather, unpacked into every parameter's trainer buffer.
  absl::Status GatherLayerwise();
  absl::Status ReduceSliced(int b);
  absl::Status ReduceUnsliced(int b);
  absl::Status GatherSliced(int b);

  // Trainer index and position in bucket order of plan parameter i.
  int j(int i) const { return i - staging_.layout->first; }
  int64_t pos(int i, const BucketLayout& b) const {
    return staging_.layout->offset[i] - b.base;
  }

  const Staging staging_;
  Parts parts_;
  // Per bucket: the trainer's gradient / parameter run in bucket order
  // when the collectives may use it in place (else null: the slot).
  std::vector<const void*> grad_run_;
  std::vector<void*> param_run_;
  // Per bucket, when the trainer's memory is on the far side of a copy or
  // the rank is its DP group's only one; else empty.
  std::vector<TrainerRuns> trainer_runs_;
  // Host memory for the conversions of copies through the IPC layer (bf16
  // / fp16 trainers) and for master copies not in bucket order: the
  // largest such copy, reused by every copy on the DP lane thread.
  int64_t scratch_bytes_ = 0;
  int64_t slot_bytes_ = 0;
  absl::Mutex master_mu_;
  // Per bucket: its master weights are staged (see MastersSet).
  std::vector<bool> master_set_ ABSL_GUARDED_BY(master_mu_);
  std::optional<absl::Status> finished_at_teardown_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_BUCKET_COLLECTIVES_H_
