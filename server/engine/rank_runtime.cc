#include "server/engine/rank_runtime.h"

#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"

namespace canzona {

UpdateRule* RankRuntime::FindRule(int i) {
  auto it = rules_.find(i);
  return it == rules_.end() ? nullptr : it->second.get();
}

void RankRuntime::ReleaseRules() {
  dp_owned_batches_.clear();
  rules_.clear();
}

absl::Status RankRuntime::UpdateWhole(absl::Span<const WholeUpdate> updates) {
  int64_t elements = 0;
  for (const WholeUpdate& u : updates) {
    if (u.offset != elements) {
      return absl::InternalError(absl::StrCat(
          "UpdateWhole: parameter ", u.param, " at offset ", u.offset,
          " where the matrices before it end at ", elements));
    }
    elements += NumElements(rule(u.param).shape());
  }
  if (elements > whole_capacity()) {
    return absl::InternalError(
        absl::StrCat("UpdateWhole: ", elements, " elements of whole matrices ",
                     "in buffers of ", whole_capacity()));
  }
  if (backends_.updates_in_place()) {
    for (const WholeUpdate& u : updates) {
      CANZONA_RETURN_IF_ERROR(rule(u.param).Step(
          whole_param() + u.offset, whole_grad() + u.offset, u.options));
    }
    return absl::OkStatus();
  }
  if (updates.empty()) return absl::OkStatus();
  Backend& backend = compute();
  float* p = device_param_.data();
  float* g = device_grad_.data();
  // Enqueued from page-locked staging (RankBuilder::PinStaging): one wait
  // for all of them, not one per matrix or per copy.
  CANZONA_RETURN_IF_ERROR(
      backend.EnqueueCopyFromHost(whole_grad(), elements, g));
  CANZONA_RETURN_IF_ERROR(
      backend.EnqueueCopyFromHost(whole_param(), elements, p));
  for (const WholeUpdate& u : updates) {
    CANZONA_RETURN_IF_ERROR(
        rule(u.param).Step(p + u.offset, g + u.offset, u.options));
  }
  CANZONA_RETURN_IF_ERROR(
      backend.EnqueueCopyToHost(p, elements, whole_param()));
  return backend.Synchronize();
}

absl::Status RankRuntime::ScaleGradients(float factor) {
  if (device_copy_ != nullptr) {
    return device_copy_->ScaleGradients(factor, backends_.staging());
  }
  return backends_.staging().Scale(layout_.owned_elements, factor,
                                   owned_.grads);
}

absl::Status RankRuntime::SumGradients(std::vector<double>& sums) {
  const std::vector<int>& params = held_grads_;
  // Gradients summed on one backend, with one wait, into their places.
  struct On {
    std::vector<size_t> at;
    std::vector<const float*> grads;
    std::vector<int64_t> counts;
    absl::Status Sum(Backend& backend, std::vector<double>& sums) const {
      if (at.empty()) return absl::OkStatus();
      std::vector<double> mine(at.size());
      CANZONA_RETURN_IF_ERROR(
          backend.SumSquaresMany(grads, counts, absl::MakeSpan(mine)));
      for (size_t j = 0; j < at.size(); ++j) sums[at[j]] = mine[j];
      return absl::OkStatus();
    }
  } on_staging, on_compute;
  sums.assign(params.size(), 0);
  for (size_t k = 0; k < params.size(); ++k) {
    const int i = params[k];
    const float* copied =
        device_copy_ != nullptr ? device_copy_->view().grad_at[i] : nullptr;
    On& on = copied != nullptr ? on_compute : on_staging;
    on.at.push_back(k);
    on.grads.push_back(copied != nullptr ? copied : owned_.grad_at[i]);
    on.counts.push_back(plan_->params[i].fragment_numel);
  }
  CANZONA_RETURN_IF_ERROR(on_staging.Sum(staging(), sums));
  return on_compute.Sum(compute(), sums);
}

RankRuntime::~RankRuntime() {
  // The layerwise gather's buffer is the DP collectives' and page-locked
  // with the rest of staging (RankBuilder::PinStaging), but they are
  // declared after pinned_staging_ and would go first, freeing it while
  // still registered: their copies end, then the pages are unlocked, then
  // the members go in reverse order.
  tp_.reset();
  if (buckets_ != nullptr) (void)buckets_->FinishAtTeardown();
  pinned_staging_.reset();
}

bool RankRuntime::DeviceWorkFinished() {
  if (buckets_ != nullptr && !buckets_->FinishAtTeardown().ok()) return false;
  return !compute().stalled();
}

absl::Status RankRuntime::AfterReductions(absl::Span<const int> reload) {
  CANZONA_RETURN_IF_ERROR(buckets_->AfterTrainer());
  CANZONA_RETURN_IF_ERROR(buckets_->ReloadMasters(reload));
  return buckets_->copier().HandTo(
      static_cast<NcclStream>(staging().native_stream()));
}

absl::Status RankRuntime::BeforeGathers() {
  auto* stream = static_cast<NcclStream>(staging().native_stream());
  if (!resident() || stream == nullptr) return staging().Synchronize();
  return buckets_->copier().TakeFrom(stream);
}

int64_t RankRuntime::host_waits() {
  // Host staging beside a GPU is the host's own memory: its calls finish
  // on return, none waits for the device.
  return compute().host_waits() + buckets_->copier().host_waits() +
         world_copier_->host_waits();
}

int64_t RankRuntime::pageable_host_bytes() const {
  int64_t bytes = buckets_->pageable_host_bytes();
  if (host_scalars_ != nullptr) bytes += host_scalars_->refused_bytes();
  if (pinned_staging_ != nullptr) bytes += pinned_staging_->refused_bytes();
  return bytes + backends_.pageable_trainer_bytes();
}

int64_t RankRuntime::TakePageableCopies() {
  // Staging is the compute backend where it is on the GPU, else host
  // memory, which copies nothing to a GPU itself. The TP lane copies only
  // between staging buffers today; counted so that a copy it adds is seen.
  const int64_t total =
      compute().pageable_copies() + buckets_->copier().pageable_copies() +
      world_copier_->pageable_copies() + tp_->pageable_copies();
  const int64_t since = total - pageable_copies_taken_;
  pageable_copies_taken_ = total;
  return since;
}

absl::Status RankRuntime::WorldSum(WorldValues& values) {
  // One rank's sums are its values: no trip through the device.
  if (world_->size() == 1) return absl::OkStatus();
  // On the world communicator's own stream (its copier's): the copy in, the
  // all-reduce and the copy out in order, one wait at the end (was one per
  // call on the compute stream, and one between the streams).
  return SumThroughStaging(*world_copier_, *world_, scalars_.data(),
                           *host_scalars_, absl::MakeSpan(values));
}

}  // namespace canzona
