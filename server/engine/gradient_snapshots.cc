#include "server/engine/gradient_snapshots.h"

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/base/status_macros.h"

namespace canzona {

absl::StatusOr<std::unique_ptr<GradientSnapshots>> GradientSnapshots::Create(
    NcclApi* api, int device, NcclEvent trainer_event, int buckets) {
  std::unique_ptr<GradientSnapshots> out(
      new GradientSnapshots(api, device, trainer_event));
  CANZONA_RETURN_IF_ERROR(api->SetDevice(device));
  CANZONA_ASSIGN_OR_RETURN(out->stream_, api->StreamCreate());
  for (int b = 0; b < buckets; ++b) {
    CANZONA_ASSIGN_OR_RETURN(NcclEvent event, api->EventCreate());
    out->events_.push_back(event);
  }
  {
    absl::MutexLock lock(&out->mu_);
    out->step_.assign(buckets, 0);
  }
  return out;
}

GradientSnapshots::~GradientSnapshots() {
  // Work in flight completes on its own: destroying a stream or an event
  // does not wait for it.
  (void)api_->SetDevice(device_);
  for (NcclEvent event : events_) (void)api_->EventDestroy(event);
  if (stream_ != nullptr) (void)api_->StreamDestroy(stream_);
}

absl::Status GradientSnapshots::Capture(int64_t step,
                                        absl::Span<const int> buckets) {
  absl::MutexLock lock(&mu_);
  for (int b : buckets) step_[b] = 0;
  CANZONA_RETURN_IF_ERROR(api_->SetDevice(device_));
  CANZONA_RETURN_IF_ERROR(api_->StreamWaitEvent(stream_, trainer_event_));
  for (int b : buckets) {
    CANZONA_RETURN_IF_ERROR(api_->EventRecord(events_[b], stream_));
    step_[b] = step;
  }
  return absl::OkStatus();
}

absl::Status GradientSnapshots::Await(NcclEvent snapshot,
                                      absl::Time deadline) const {
  CANZONA_RETURN_IF_ERROR(api_->SetDevice(device_));
  CANZONA_ASSIGN_OR_RETURN(bool done, EventDoneBy(*api_, snapshot, deadline));
  if (done) return absl::OkStatus();
  return absl::DeadlineExceededError(
      "the trainer's gradients-written event (as of GradReady) did not "
      "complete by its deadline; did the trainer die or hang before its "
      "GPU reached the record?");
}

void GradientSnapshots::Forget() {
  absl::MutexLock lock(&mu_);
  step_.assign(step_.size(), 0);
}

NcclEvent GradientSnapshots::For(int64_t step, int b) const {
  absl::MutexLock lock(&mu_);
  return step > 0 && step_[b] == step ? events_[b] : nullptr;
}

}  // namespace canzona
