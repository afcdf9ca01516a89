#include "server/engine/exported_events.h"

#include <utility>

#include "kernels/base/status_macros.h"

namespace canzona {

absl::StatusOr<std::unique_ptr<ExportedEvents>> ExportedEvents::Create(
    NcclApi* api, int device, int count) {
  std::unique_ptr<ExportedEvents> out(new ExportedEvents(api, device));
  CANZONA_RETURN_IF_ERROR(api->SetDevice(device));
  for (int i = 0; i < count; ++i) {
    CANZONA_ASSIGN_OR_RETURN(NcclEvent event, api->EventCreateExported());
    out->events_.push_back(event);
    CANZONA_ASSIGN_OR_RETURN(std::string handle, api->EventIpcHandle(event));
    out->handles_.push_back(std::move(handle));
  }
  return out;
}

ExportedEvents::~ExportedEvents() {
  // Recorded work still in flight completes on its own: destroying an
  // event does not wait for it, and the trainer's opened handles are
  // closed with its rank (it deregistered, or died).
  (void)api_->SetDevice(device_);
  for (NcclEvent event : events_) (void)api_->EventDestroy(event);
}

}  // namespace canzona
