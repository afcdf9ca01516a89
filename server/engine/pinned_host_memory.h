// PinnedHostMemory: host memory page-locked for a rank's GPU
// (NcclApi::HostRegister) for as long as this lives: on the NCCL plane, a
// trainer's shared-memory buffers, so that the staging copies to and from
// them are DMA on the copier's stream, asynchronous and at the link's
// rate, instead of pageable copies the driver stages and waits for; with
// cuda compute and host staging, the owned buffers the updates copy to the
// GPU and back (OwnedDeviceCopy). It must go before the memory it pins.
//
//   std::unique_ptr<PinnedHostMemory> pinned =
//       PinnedHostMemory::Pin(api, device, trainer->SharedMemoryMappings());
//
// Thread-safety: created by the rank's setup and destroyed with the rank;
// not shared.
#ifndef CANZONA_SERVER_ENGINE_PINNED_HOST_MEMORY_H_
#define CANZONA_SERVER_ENGINE_PINNED_HOST_MEMORY_H_

#include <memory>
#include <vector>

#include "server/comm/nccl_api.h"
#include "server/engine/trainer_buffers.h"

namespace canzona {

class PinnedHostMemory {
 public:
  // Pins the pages under the ranges on `device` (ranges sharing a page as
  // one). A range the driver refuses (the memlock limit, memory it
  // cannot lock) stays pageable with a warning: copies still work, only
  // slower and synchronous. `api` must outlive the result.
  static std::unique_ptr<PinnedHostMemory> Pin(
      NcclApi* api, int device,
      const std::vector<TrainerBuffers::MemoryRange>& ranges);

  ~PinnedHostMemory();
  PinnedHostMemory(const PinnedHostMemory&) = delete;
  PinnedHostMemory& operator=(const PinnedHostMemory&) = delete;

  // Ranges pinned now.
  int pinned() const { return static_cast<int>(pinned_.size()); }

 private:
  PinnedHostMemory(NcclApi* api, int device) : api_(api), device_(device) {}

  NcclApi* const api_;
  const int device_;
  std::vector<void*> pinned_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_PINNED_HOST_MEMORY_H_
