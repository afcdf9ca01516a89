// OwnedDeviceCopy: where a rank's DP-owned updates run when its compute
// backend is a GPU and its staging is host memory (cuda compute on the Gloo
// data plane). The collectives leave the owned fp32 gradients and values in
// host staging (OwnedBuffers); the updates want them on the GPU. This owns
// the GPU's copy of them, laid out like the owned gradients (parameter i at
// RankLayout::owned_offset[i]), and moves them in as few copies as the
// layouts allow: host ranges back to back in both are one copy (the owned
// gradients are one range; the master weights, allocated in the same order,
// another), enqueued without waits from page-locked memory, and the values
// come back with one wait. Before, each update copied its matrix in and out
// and waited (two waits per matrix, from pageable memory).
//
//   CANZONA_RETURN_IF_ERROR(copy.Load());   // staging -> GPU, enqueued
//   ... updates on copy.view().param_at[i], copy.view().grad_at[i] ...
//   CANZONA_RETURN_IF_ERROR(copy.Store());  // GPU -> staging, waited for
//
// Owns the device buffers. Thread-safety: the rank's
// worker thread, between DpLane::WaitReduced and StartGathers (the
// collectives' thread does not touch the owned buffers then).
#ifndef CANZONA_SERVER_ENGINE_OWNED_DEVICE_COPY_H_
#define CANZONA_SERVER_ENGINE_OWNED_DEVICE_COPY_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/engine/job_plan.h"
#include "server/engine/owned_buffers.h"
#include "server/engine/rank_layout.h"

namespace canzona {

class OwnedDeviceCopy {
 public:
  // A device copy of `params`' gradients and values in `host` (staging
  // memory, page-locked by its owner: RankBuilder) on `compute`.
  static absl::StatusOr<std::unique_ptr<OwnedDeviceCopy>> Create(
      const JobPlan& jp, const RankLayout& layout, const OwnedBuffers& host,
      const std::vector<int>& params, Backend& compute);

  OwnedDeviceCopy(const OwnedDeviceCopy&) = delete;
  OwnedDeviceCopy& operator=(const OwnedDeviceCopy&) = delete;

  // Enqueues the gradients' and values' copies to the GPU (host staging
  // must not change until Store returns).
  absl::Status Load();
  // Copies the updated values back into host staging and waits for them.
  absl::Status Store();
  // After Load: every held gradient times `factor`, the copied ones on the
  // GPU, the others (TP-owned, redundant) in host staging on `staging`.
  absl::Status ScaleGradients(float factor, Backend& staging);

  // The params' gradients and values on the GPU (null for the others).
  const OwnedBuffers& view() const { return view_; }
  // Copies each way per step: gradients and values in, values out.
  int copies_in() const {
    return static_cast<int>(grad_runs_.size() + param_runs_.size());
  }
  int copies_out() const { return static_cast<int>(param_runs_.size()); }
  // Bytes held on the GPU.
  int64_t bytes() const;

 private:
  // Elements back to back on both sides.
  struct Run {
    float* host;
    float* device;
    int64_t count;
  };

  explicit OwnedDeviceCopy(Backend& compute) : compute_(compute) {}

  Backend& compute_;
  DeviceBuffer grads_, params_;
  OwnedBuffers view_;
  std::vector<Run> grad_runs_, param_runs_;
  // The held gradients not copied, in host staging (`device` unused).
  std::vector<Run> host_grad_runs_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_OWNED_DEVICE_COPY_H_
