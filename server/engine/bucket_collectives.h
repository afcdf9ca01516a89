// BucketCollectives: the DP communication of one rank's buckets, the first
// and last phases of the step (server/DESIGN.md section 4):
//  - Reduce(b): stage bucket b's gradients and parameters from the
//    trainer's buffers and sum the gradients over DP (unscaled: the step
//    applies 1/DP and the loss scale): my slice when bucket-sliced
//    (reduce-scatter-v at parameter boundaries inside the shard group, then
//    the all-reduce of the slice across groups), else the whole bucket (an
//    even reduce-scatter + all-gather: every element summed in DP rank
//    order on one rank, so every strategy gets the same bits);
//  - Gather(b): bring the updated parameters to every DP rank of the shard
//    group (all-gather-v; layerwise plans gather every owned parameter at
//    once) and publish them into the trainer's buffers.
// It owns the DP and cross-group communicators, the DP copier (whose stream
// they run on), the DP scratch buffers and the uneven calibration.
// Staging is fp32 whatever the trainer's dtype: for bf16 / fp16 parameters
// the staged values the rank updates are its fp32 master weights, read from
// the trainer once and rounded into the trainer's buffers at each Gather.
//
//   DpLane lane(buckets,
//       [c](int64_t, int b) { return c->Reduce(b); },
//       [c](int64_t, int b) { return c->Gather(b); });
//
// Thread-safety: Reduce and Gather run on the rank's DP lane thread only.
// Between a step's reductions and its gathers the worker owns the staging
// buffers (it reads them after DpLane::WaitReduced and writes them before
// DpLane::StartGathers, synchronizing its staging backend first).
#ifndef CANZONA_SERVER_ENGINE_BUCKET_COLLECTIVES_H_
#define CANZONA_SERVER_ENGINE_BUCKET_COLLECTIVES_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "server/comm/communicator.h"
#include "server/engine/job_plan.h"
#include "server/engine/rank_layout.h"
#include "server/engine/stage_copier.h"
#include "server/engine/trainer_buffers.h"
#include "server/engine/uneven_calibration.h"

namespace canzona {

class BucketCollectives {
 public:
  struct Parts {
    std::unique_ptr<StageCopier> copier;
    // dp: the DP ranks of my shard group (all of DP when flat); cross: the
    // ranks at my position in the other groups (hierarchical sharding).
    std::unique_ptr<Communicator> dp, cross;
    // The dp communicator's chooser reads it (created before dp).
    std::unique_ptr<UnevenCalibration> calibration;
    // Staging memory: the reduce-scatter's output (my largest slice); the
    // layerwise gather's packed send and receive buffers; the
    // calibration's all-reduce.
    DeviceBuffer slice, packed, gathered, sums;
  };
  // What the collectives read and write besides their own parts.
  struct Staging {
    std::shared_ptr<const JobPlan> plan;
    const RankLayout* layout = nullptr;
    const TrainerBuffers* trainer = nullptr;
    bool on_device = false;   // NCCL data plane: staging is device memory
    float* grads = nullptr;   // the stage's gradients
    float* params = nullptr;  // the stage's parameters
    std::string who;          // the rank, for logs
  };

  BucketCollectives(Staging staging, Parts parts);

  absl::Status Reduce(int b);
  absl::Status Gather(int b);

  // Whether the staged fp32 master weights of bf16 / fp16 parameters are
  // set (a checkpoint or import wrote them: true), or must be read from the
  // trainer's parameters at the next Reduce (false). The worker calls it
  // while the lane is idle.
  void MastersSet(bool set);

  Communicator& dp() { return *parts_.dp; }
  Communicator& cross() { return *parts_.cross; }

 private:
  // Layerwise: each rank's owned parameters packed in stage order, one
  // all-gather, unpacked into every parameter's slot.
  absl::Status GatherLayerwise();

  const Staging staging_;
  Parts parts_;
  absl::Mutex master_mu_;
  // Per bucket: its master weights are staged (see MastersSet).
  std::vector<bool> master_set_ ABSL_GUARDED_BY(master_mu_);
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_BUCKET_COLLECTIVES_H_
