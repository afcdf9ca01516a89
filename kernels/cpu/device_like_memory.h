// Device-like memory: host memory made to behave like a GPU's, so that the
// NCCL data plane's tests catch on a machine without a GPU what a GPU would
// refuse (the cpu backend's MemorySpace::kDevice uses it).
//
// Each buffer is two address ranges: the device address the backend hands
// out (DeviceBuffer::data()), a reservation the host cannot touch
// (PROT_NONE: a host-side load or store faults at once, as dereferencing a
// cudaMalloc pointer does), and the host alias, real memory where the
// backend's kernels, and the fakes of device APIs, do the work. A
// process-wide registry maps one to the other.
//
//   CANZONA_ASSIGN_OR_RETURN(void* device,
//                            device_like::Map(host, bytes, "Allocate(4)"));
//   // *static_cast<float*>(device) = 1;   // SIGSEGV, as on a GPU
//   CANZONA_ASSIGN_OR_RETURN(const void* at,
//       device_like::HostAddress(device, bytes, "cudaMemcpyAsync", "dst"));
//
// Thread-safety: thread-safe (the fakes resolve from their threads).
#ifndef CANZONA_KERNELS_CPU_DEVICE_LIKE_MEMORY_H_
#define CANZONA_KERNELS_CPU_DEVICE_LIKE_MEMORY_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace canzona::device_like {

// Reserves `bytes` (> 0) of device address space standing for the host
// memory at `host`; RESOURCE_EXHAUSTED when the address space runs out.
absl::StatusOr<void*> Map(void* host, int64_t bytes, absl::string_view label);
// Releases a reservation Map returned (its host memory stays the caller's).
void Unmap(void* device, int64_t bytes);
// Where the host reaches the byte at `device` (inside a mapping: its
// alias plus the offset), or null outside every mapping.
const void* HostAlias(const void* device);
// Where the host reaches [p, p + bytes): inside one device-like mapping,
// its alias; overlapping none, p itself (host memory, or device memory of
// another kind); leaving a mapping or running into one, INVALID_ARGUMENT
// naming `what` and `arg`, the range and the mapping.
absl::StatusOr<const void*> HostAddress(const void* p, int64_t bytes,
                                        absl::string_view what,
                                        absl::string_view arg);
// The same for memory a fake writes.
absl::StatusOr<void*> HostAddress(void* p, int64_t bytes,
                                  absl::string_view what,
                                  absl::string_view arg);

// Page-locked host memory, as cudaHostRegister leaves it: the fake CUDA
// runtimes of tests lock and unlock ranges here, and the cpu backend
// standing in for a GPU counts each copy whose host side lies outside them
// (kernels/pageable_copies.h), as a GPU's driver would stage it.
// INVALID_ARGUMENT for an empty range or one already locked.
absl::Status LockHost(const void* p, int64_t bytes, absl::string_view label);
void UnlockHost(const void* p);
// Whether [p, p + bytes) lies inside one locked range.
bool HostLocked(const void* p, int64_t bytes);

}  // namespace canzona::device_like

#endif  // CANZONA_KERNELS_CPU_DEVICE_LIKE_MEMORY_H_
