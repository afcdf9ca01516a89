// OwnedBuffers: where one rank's step finds the fp32 values it works on,
// ZeRO-1 style (server/DESIGN.md section 5.1): only what the rank holds
// (its slice of each bucket, or what its strategy gives it) has an fp32
// gradient and value here; nothing is sized by the whole model except
// under the redundant baselines (sc holds everything).
//
//  - grad_at[i]: the DP-summed fp32 gradient of held parameter i (its TP
//    fragment), in the owned gradients buffer;
//  - param_at[i]: the fp32 value the update changes in place: the
//    trainer's own buffer when it is fp32 memory the data plane addresses
//    (nothing copied), else a master copy in the masters buffer (bf16 /
//    fp16 parameters: the fp32 master weights, read from the trainer once;
//    fp32 trainer memory elsewhere, e.g. a GPU trainer on the Gloo plane:
//    read every step);
//  - slot: bucket staging for the DP collectives of buckets the trainer's
//    memory cannot take in place (parameters not laid out in bucket order,
//    dtypes to convert, memory the data plane cannot address), and for the
//    unsliced baselines' all-reduce; reduced: a 16-bit reduce-scatter's
//    output before it is widened; scratch: host staging for conversions
//    of copies through the IPC layer (a GPU trainer under host staging),
//    page-locked with the rest so those copies are DMA.
//
//   float* g = owned.grad_at[i];
//   if (owned.master[i]) ... the trainer's value must be read / written
//
// Thread-safety: a plain view, immutable after setup; the memory it points
// at is used as BucketCollectives and RankStep describe (the DP lane
// thread and the worker in turn).
#ifndef CANZONA_SERVER_ENGINE_OWNED_BUFFERS_H_
#define CANZONA_SERVER_ENGINE_OWNED_BUFFERS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "server/engine/job_plan.h"
#include "server/engine/rank_layout.h"
#include "server/engine/trainer_buffers.h"

namespace canzona {

struct OwnedBuffers {
  // The owned gradients (layout.owned_elements fp32, bucket by bucket at
  // BucketLayout::owned_base) and the master copies.
  float* grads = nullptr;
  float* masters = nullptr;
  // Per plan index; null (and false) for parameters the rank does not
  // hold.
  std::vector<float*> param_at, grad_at;
  std::vector<char> master;  // param_at is a master copy, not the trainer's
  void* slot = nullptr;
  void* reduced = nullptr;
  char* scratch = nullptr;
  int64_t scratch_bytes = 0;
};

// The memory behind an OwnedBuffers view (staging memory).
struct OwnedMemory {
  DeviceBuffer grads, masters, reduced, slot, scratch;
};

// Allocates the owned gradients, the master copies and the 16-bit
// reduce-scatter output for `layout`'s held parameters on `staging` and
// points `view` at them (and at `trainer`'s fp32 buffers where
// `device_staging` memory addresses them in place). The slot stays empty:
// its size comes from the buckets' collectives (BucketCollectives).
absl::Status AllocateOwned(const JobPlan& jp, const RankLayout& layout,
                           const TrainerBuffers& trainer, bool device_staging,
                           Backend& staging, OwnedMemory* memory,
                           OwnedBuffers* view);

// Allocates the slot and the scratch, in bytes as the buckets' collectives
// ask (BucketCollectives::slot_bytes, scratch_bytes), on `staging` and
// points `view` at them.
absl::Status AllocateBucketStaging(int64_t slot_bytes, int64_t scratch_bytes,
                                   Backend& staging, OwnedMemory* memory,
                                   OwnedBuffers* view);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_OWNED_BUFFERS_H_
