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

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
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
  // Bytes (whole pages) the driver refused to pin: they stay pageable
  // (RegisterResponse.pageable_host_bytes).
  int64_t refused_bytes() const { return refused_bytes_; }

 private:
  PinnedHostMemory(NcclApi* api, int device) : api_(api), device_(device) {}

  NcclApi* const api_;
  const int device_;
  std::vector<void*> pinned_;
  int64_t refused_bytes_ = 0;
};

// PinnedHostFloats: `count` floats of host memory on pages of their own,
// page-locked for a rank's GPU while this lives: the host side of the few
// floats a staging copier sums over a communicator through the device
// (SumThroughStaging: a step's world sums, the uneven calibration's). A
// pageable side there costs more than a slow copy: cudaMemcpyAsync into
// pageable memory returns only once the copy, and the all-reduce queued
// before it, finished, a wait outside the copier's timeout that a peer
// hung in that all-reduce would hold forever. Without an `api` (the Gloo
// plane's host staging), or where the driver refuses, the floats stay
// pageable (PinnedHostMemory's warning).
//
// Thread-safety: owned by one rank's runtime; used on its worker.
class PinnedHostFloats {
 public:
  static absl::StatusOr<std::unique_ptr<PinnedHostFloats>> Create(
      NcclApi* api, int device, int64_t count);
  ~PinnedHostFloats();
  PinnedHostFloats(const PinnedHostFloats&) = delete;
  PinnedHostFloats& operator=(const PinnedHostFloats&) = delete;

  float* data() const { return data_; }
  int64_t size() const { return count_; }
  // Bytes the driver refused to pin (PinnedHostMemory::refused_bytes).
  int64_t refused_bytes() const {
    return pinned_ != nullptr ? pinned_->refused_bytes() : 0;
  }

  // Leaves the floats, locked, to the process when this goes: a copy into
  // them may still be queued behind a collective that did not finish (the
  // wait for it timed out), and the device would write into freed memory
  // once the collective's abort lets it run.
  void Abandon() { abandoned_ = true; }

 private:
  PinnedHostFloats(float* data, int64_t count) : data_(data), count_(count) {}

  float* const data_;  // page-aligned, whole pages
  const int64_t count_;
  std::unique_ptr<PinnedHostMemory> pinned_;
  bool abandoned_ = false;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_PINNED_HOST_MEMORY_H_
