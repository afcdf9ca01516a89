// Copies between a backend's device memory and pageable host memory,
// counted process-wide. On a GPU such a copy goes through a bounce buffer
// and may wait for the stream inside cudaMemcpyAsync, a wait no count of
// host waits shows; the daemon page-locks every host range that meets the
// GPU during a step, so tests require none then (JobRun::RunSteps): on a
// GPU the cuda backend counts the copies whose host side the driver calls
// unregistered, without one the cpu backend standing in for a GPU counts
// those outside the fake runtime's cudaHostRegister ranges
// (kernels/cpu/device_like_memory.h).
//
//   const int64_t before = PageableCopies();
//   ... steps ...
//   if (PageableCopies() != before) LOG(...) << LastPageableCopy();
//
// Thread-safety: thread-safe.
#ifndef CANZONA_KERNELS_PAGEABLE_COPIES_H_
#define CANZONA_KERNELS_PAGEABLE_COPIES_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace canzona {

// Counts one copy by `what` (the method) of `bytes` with its host side at
// `host`, pageable.
void CountPageableCopy(absl::string_view what, const void* host, int64_t bytes);
// The copies counted so far, and the last one ("CopyToHost of 20 bytes at
// 0x...").
int64_t PageableCopies();
std::string LastPageableCopy();

}  // namespace canzona

#endif  // CANZONA_KERNELS_PAGEABLE_COPIES_H_
