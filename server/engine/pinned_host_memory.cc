#include "server/engine/pinned_host_memory.h"

#include <string>

#include "spdlog/spdlog.h"

namespace canzona {

std::unique_ptr<PinnedHostMemory> PinnedHostMemory::Pin(
    NcclApi* api, int device,
    const std::vector<TrainerBuffers::MemoryRange>& ranges) {
  std::unique_ptr<PinnedHostMemory> pinned(new PinnedHostMemory(api, device));
  if (!ranges.empty()) {
    if (absl::Status s = api->SetDevice(device); !s.ok()) {
      spdlog::warn("host buffers stay pageable: {}",
                   std::string(s.message()));
      return pinned;
    }
  }
  for (const TrainerBuffers::MemoryRange& r : ranges) {
    void* begin = const_cast<void*>(r.begin);
    if (absl::Status s = api->HostRegister(begin, r.bytes); !s.ok()) {
      spdlog::warn(
          "host buffer of {} bytes stays pageable (copies to the GPU wait "
          "on the host): {}",
          r.bytes, std::string(s.message()));
      continue;
    }
    pinned->pinned_.push_back(begin);
  }
  return pinned;
}

PinnedHostMemory::~PinnedHostMemory() {
  if (pinned_.empty()) return;
  (void)api_->SetDevice(device_);
  for (void* p : pinned_) {
    if (absl::Status s = api_->HostUnregister(p); !s.ok()) {
      spdlog::warn("unpinning a host buffer: {}", std::string(s.message()));
    }
  }
}

}  // namespace canzona
