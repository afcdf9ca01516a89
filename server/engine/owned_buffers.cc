#include "server/engine/owned_buffers.h"

#include <algorithm>

#include "kernels/base/status_macros.h"

namespace canzona {

absl::Status AllocateOwned(const JobPlan& jp, const RankLayout& layout,
                           const TrainerBuffers& trainer, bool device_staging,
                           Backend& staging, OwnedMemory* memory,
                           OwnedBuffers* view) {
  const size_t n = jp.params.size();
  view->param_at.assign(n, nullptr);
  view->grad_at.assign(n, nullptr);
  view->master.assign(n, 0);
  // fp32 parameters in trainer memory the data plane addresses are
  // updated where they lie; the others get a master copy.
  const bool in_place = trainer.Addressable(device_staging);
  int64_t master_elements = 0;
  std::vector<int64_t> master_offset(n, -1);
  // In the owned gradients' order, so that a run of held parameters is one
  // range in both (one copy each to the GPU: OwnedDeviceCopy).
  std::vector<int> held;
  for (int i : layout.stage_params) {
    if (layout.owned_offset[i] >= 0) held.push_back(i);
  }
  std::stable_sort(held.begin(), held.end(), [&](int a, int b) {
    return layout.owned_offset[a] < layout.owned_offset[b];
  });
  for (int i : held) {
    if (in_place && trainer.dtype(i - layout.first) == DType::kFloat32) {
      continue;
    }
    master_offset[i] = master_elements;
    master_elements += jp.params[i].fragment_numel;
  }
  CANZONA_ASSIGN_OR_RETURN(memory->grads,
                           staging.Allocate(layout.owned_elements));
  CANZONA_ASSIGN_OR_RETURN(memory->masters, staging.Allocate(master_elements));
  view->grads = memory->grads.data();
  view->masters = memory->masters.data();
  for (int i : layout.stage_params) {
    if (layout.owned_offset[i] < 0) continue;
    view->grad_at[i] = memory->grads.data() + layout.owned_offset[i];
    if (master_offset[i] >= 0) {
      view->param_at[i] = memory->masters.data() + master_offset[i];
      view->master[i] = 1;
    } else {
      view->param_at[i] = static_cast<float*>(trainer.param(i - layout.first));
    }
  }
  // A 16-bit reduce-scatter's output (my slice), widened into the owned
  // gradients (a DP group of one reduces nothing).
  int64_t reduced = 0;
  for (const BucketLayout& b : layout.buckets) {
    if (layout.sliced && layout.shard_size > 1 &&
        b.reduce_dtype != DType::kFloat32) {
      reduced = std::max(reduced, b.counts[layout.shard_pos]);
    }
  }
  CANZONA_ASSIGN_OR_RETURN(memory->reduced,
                           staging.Allocate((reduced + 1) / 2));
  view->reduced = memory->reduced.data();
  return absl::OkStatus();
}

absl::Status AllocateBucketStaging(int64_t slot_bytes, int64_t scratch_bytes,
                                   Backend& staging, OwnedMemory* memory,
                                   OwnedBuffers* view) {
  constexpr int64_t kFloat = sizeof(float);
  CANZONA_ASSIGN_OR_RETURN(memory->slot,
                           staging.Allocate((slot_bytes + kFloat - 1) / kFloat));
  CANZONA_ASSIGN_OR_RETURN(
      memory->scratch, staging.Allocate((scratch_bytes + kFloat - 1) / kFloat));
  view->slot = memory->slot.data();
  view->scratch = reinterpret_cast<char*>(memory->scratch.data());
  view->scratch_bytes = scratch_bytes;
  return absl::OkStatus();
}

}  // namespace canzona
