#include "server/engine/pinned_host_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace canzona {

namespace {

// The pages under `ranges`, overlapping ones merged: the driver locks whole
// pages and refuses a page locked twice (two small buffers may share one).
std::vector<TrainerBuffers::MemoryRange> Pages(
    const std::vector<TrainerBuffers::MemoryRange>& ranges) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (const TrainerBuffers::MemoryRange& r : ranges) {
    if (r.begin == nullptr || r.bytes <= 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(r.begin);
    const uintptr_t end = begin + static_cast<uintptr_t>(r.bytes);
    spans.emplace_back(begin / page * page, (end + page - 1) / page * page);
  }
  std::sort(spans.begin(), spans.end());
  std::vector<TrainerBuffers::MemoryRange> merged;
  for (size_t k = 0; k < spans.size();) {
    auto [begin, end] = spans[k];
    for (++k; k < spans.size() && spans[k].first < end; ++k) {
      end = std::max(end, spans[k].second);
    }
    merged.push_back({reinterpret_cast<const void*>(begin),
                      static_cast<int64_t>(end - begin)});
  }
  return merged;
}

}  // namespace

std::unique_ptr<PinnedHostMemory> PinnedHostMemory::Pin(
    NcclApi* api, int device,
    const std::vector<TrainerBuffers::MemoryRange>& buffers) {
  std::unique_ptr<PinnedHostMemory> pinned(new PinnedHostMemory(api, device));
  const std::vector<TrainerBuffers::MemoryRange> ranges = Pages(buffers);
  if (!ranges.empty()) {
    if (absl::Status s = api->SetDevice(device); !s.ok()) {
      spdlog::warn("host buffers stay pageable: {}", std::string(s.message()));
      for (const TrainerBuffers::MemoryRange& r : ranges) {
        pinned->refused_bytes_ += r.bytes;
      }
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
      pinned->refused_bytes_ += r.bytes;
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

PinnedHostFloats::~PinnedHostFloats() {
  if (abandoned_) {
    (void)pinned_.release();
    return;
  }
  pinned_.reset();  // unlocked before freed
  std::free(data_);
}

absl::StatusOr<std::unique_ptr<PinnedHostFloats>> PinnedHostFloats::Create(
    NcclApi* api, int device, int64_t count) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t wanted =
      static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(float);
  const size_t bytes = (wanted + page - 1) / page * page;  // whole pages
  auto* data = static_cast<float*>(std::aligned_alloc(page, bytes));
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host staging of ", count, " floats: out of host memory"));
  }
  std::memset(data, 0, bytes);
  std::unique_ptr<PinnedHostFloats> floats(new PinnedHostFloats(data, count));
  if (api != nullptr) {
    floats->pinned_ = PinnedHostMemory::Pin(
        api, device, {{data, static_cast<int64_t>(bytes)}});
  }
  return floats;
}

}  // namespace canzona
