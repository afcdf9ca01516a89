#include "server/engine/owned_device_copy.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "kernels/base/status_macros.h"

namespace canzona {
namespace {

// The runs of `at` (host) and `base` + offset (device) over `params` in
// owned order, merged where both sides continue the previous run.
template <typename Run>
std::vector<Run> Runs(const JobPlan& jp, const RankLayout& layout,
                      const std::vector<int>& params,
                      const std::vector<float*>& at, float* base) {
  std::vector<Run> runs;
  for (int i : params) {
    float* host = at[i];
    float* device = base + layout.owned_offset[i];
    const int64_t n = jp.params[i].fragment_numel;
    if (n == 0) continue;
    if (!runs.empty()) {
      Run& last = runs.back();
      if (last.host + last.count == host &&
          last.device + last.count == device) {
        last.count += n;
        continue;
      }
    }
    runs.push_back({host, device, n});
  }
  return runs;
}

}  // namespace

absl::StatusOr<std::unique_ptr<OwnedDeviceCopy>> OwnedDeviceCopy::Create(
    const JobPlan& jp, const RankLayout& layout, const OwnedBuffers& host,
    const std::vector<int>& params, Backend& compute) {
  std::unique_ptr<OwnedDeviceCopy> copy(new OwnedDeviceCopy(compute));
  auto in_owned_order = [&](std::vector<int>& v) {
    std::sort(v.begin(), v.end(), [&](int a, int b) {
      return layout.owned_offset[a] < layout.owned_offset[b];
    });
  };
  std::vector<int> owned = params;
  in_owned_order(owned);
  if (!owned.empty()) {
    CANZONA_ASSIGN_OR_RETURN(copy->grads_,
                             compute.Allocate(layout.owned_elements));
    CANZONA_ASSIGN_OR_RETURN(copy->params_,
                             compute.Allocate(layout.owned_elements));
  }
  OwnedBuffers& view = copy->view_;
  view.param_at.assign(jp.params.size(), nullptr);
  view.grad_at.assign(jp.params.size(), nullptr);
  view.master.assign(jp.params.size(), 0);
  view.grads = copy->grads_.data();
  for (int i : owned) {
    view.grad_at[i] = copy->grads_.data() + layout.owned_offset[i];
    view.param_at[i] = copy->params_.data() + layout.owned_offset[i];
  }
  copy->grad_runs_ =
      Runs<Run>(jp, layout, owned, host.grad_at, copy->grads_.data());
  std::vector<int> others;
  for (int i : layout.stage_params) {
    if (host.grad_at[i] != nullptr && view.grad_at[i] == nullptr) {
      others.push_back(i);
    }
  }
  in_owned_order(others);
  // Their "device" side is the host offset itself: runs merge where the
  // host ranges continue.
  copy->host_grad_runs_ =
      Runs<Run>(jp, layout, others, host.grad_at, host.grads);
  copy->param_runs_ =
      Runs<Run>(jp, layout, owned, host.param_at, copy->params_.data());
  return copy;
}

int64_t OwnedDeviceCopy::bytes() const {
  return (grads_.size() + params_.size()) * static_cast<int64_t>(sizeof(float));
}

absl::Status OwnedDeviceCopy::Load() {
  for (const Run& r : grad_runs_) {
    CANZONA_RETURN_IF_ERROR(
        compute_.EnqueueCopyFromHost(r.host, r.count, r.device));
  }
  for (const Run& r : param_runs_) {
    CANZONA_RETURN_IF_ERROR(
        compute_.EnqueueCopyFromHost(r.host, r.count, r.device));
  }
  return absl::OkStatus();
}

absl::Status OwnedDeviceCopy::ScaleGradients(float factor, Backend& staging) {
  if (grads_.size() > 0) {
    // Whole: the ranges of parameters not copied hold zeros.
    CANZONA_RETURN_IF_ERROR(
        compute_.Scale(grads_.size(), factor, grads_.data()));
  }
  for (const Run& r : host_grad_runs_) {
    CANZONA_RETURN_IF_ERROR(staging.Scale(r.count, factor, r.host));
  }
  return absl::OkStatus();
}

absl::Status OwnedDeviceCopy::Store() {
  for (const Run& r : param_runs_) {
    CANZONA_RETURN_IF_ERROR(
        compute_.EnqueueCopyToHost(r.device, r.count, r.host));
  }
  return compute_.Synchronize();
}

}  // namespace canzona
