// ExportedEvents: interprocess CUDA events this daemon records and a
// trainer process waits on, one per bucket of a rank: the "parameters
// written" events (RegisterRequest.params_events). The daemon records
// bucket b's on its DP copier's stream after writing the bucket's
// parameters and answers at once; the trainer opens the handles
// (RegisterResponse Bucket.params_event_handle) and its stream waits for
// them, as a stream waits for an in-process collective. The daemon owns
// them, so it never records an event of a process that may be gone.
//
//   CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<ExportedEvents> written,
//                            ExportedEvents::Create(api, device, buckets));
//   response->mutable_buckets(b)->set_params_event_handle(written->handle(b));
//   CANZONA_RETURN_IF_ERROR(copier.RecordEvent(written->event(b)));
//
// Thread-safety: immutable after Create; recorded on the rank's DP lane.
#ifndef CANZONA_SERVER_ENGINE_EXPORTED_EVENTS_H_
#define CANZONA_SERVER_ENGINE_EXPORTED_EVENTS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/comm/nccl_api.h"

namespace canzona {

class ExportedEvents {
 public:
  // `count` events on `device`; `api` must outlive the result.
  static absl::StatusOr<std::unique_ptr<ExportedEvents>> Create(NcclApi* api,
                                                                int device,
                                                                int count);
  ~ExportedEvents();
  ExportedEvents(const ExportedEvents&) = delete;
  ExportedEvents& operator=(const ExportedEvents&) = delete;

  NcclEvent event(int i) const { return events_[i]; }
  // The cudaIpcEventHandle_t (64 bytes) another process opens it with.
  const std::string& handle(int i) const { return handles_[i]; }

 private:
  ExportedEvents(NcclApi* api, int device) : api_(api), device_(device) {}

  NcclApi* const api_;
  const int device_;
  std::vector<NcclEvent> events_;
  std::vector<std::string> handles_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_EXPORTED_EVENTS_H_
