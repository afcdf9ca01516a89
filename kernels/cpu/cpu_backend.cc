#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>
#include <sanitizer/asan_interface.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend_impl.h"
#include "kernels/cpu/device_like_memory.h"

namespace canzona {
namespace cpu_internal {
namespace {

// Allocations are 64-byte aligned so that every buffer starts on a cache
// line and the widest vector loads (AVX-512) never straddle one.
constexpr size_t kAlignment = 64;

// SetDeviceLikeWorkBlocked's flag, read by every device-like backend's waits.
std::atomic<bool> device_like_work_blocked{false};

}  // namespace

CpuBackend::CpuBackend(MemorySpace space, bool page_aligned)
    : space_(space),
      alignment_(page_aligned ? static_cast<size_t>(::sysconf(_SC_PAGESIZE))
                              : kAlignment) {}

std::string CpuBackend::description() const {
  const char* config = openblas_get_config();
  return absl::StrCat("cpu (", config != nullptr ? config : "OpenBLAS", ", ",
                      openblas_get_num_threads(), " threads)");
}

void CpuBackend::Free(float* data, int64_t size) {
  if (space_ == MemorySpace::kDevice) {
    float* host =
        const_cast<float*>(static_cast<const float*>(HostAlias(data)));
    device_like::Unmap(data, Bytes(size));
    data = host;
  }
  ASAN_UNPOISON_MEMORY_REGION(data + size, Padded(size) - Bytes(size));
  std::free(data);
}

const void* CpuBackend::HostAlias(const float* p) const {
  return space_ == MemorySpace::kDevice ? device_like::HostAlias(p) : nullptr;
}

absl::Status CpuBackend::CheckSupported(const NewtonSchulzSpec& spec) const {
  if (spec.precision == NsPrecision::kFloat32) return absl::OkStatus();
  return absl::UnimplementedError(
      "cpu backend: Newton-Schulz supports only float32");
}

absl::StatusOr<DeviceBuffer> CpuBackend::DoAllocate(int64_t count) {
  const size_t bytes = Padded(count);
  void* p = std::aligned_alloc(alignment_, bytes);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Allocate: cannot allocate ", count, " floats (", bytes, " bytes)"));
  }
  // The buffer is exactly `count` floats, as on a device: the range
  // checks use that size, and AddressSanitizer sees any access to the
  // alignment padding.
  std::memset(p, 0, Bytes(count));
  ASAN_POISON_MEMORY_REGION(static_cast<char*>(p) + Bytes(count),
                            bytes - Bytes(count));
  if (space_ == MemorySpace::kDevice) {
    // Standing in for a GPU: hand out an address the host cannot touch;
    // the entry points pass this memory's alias to the kernels below.
    absl::StatusOr<void*> device = device_like::Map(
        p, static_cast<int64_t>(Bytes(count)), "cpu backend as a device");
    if (!device.ok()) {
      std::free(p);
      return device.status();
    }
    p = *device;
  }
  backend_internal::CountAllocation();
  return DeviceBuffer(this, static_cast<float*>(p), count);
}

absl::Status CpuBackend::DoCopyFromHost(const float* host, int64_t count,
                                        float* dst) {
  CANZONA_RETURN_IF_ERROR(BeforeHostCopy("CopyFromHost", host, count));
  return Move(host, count, dst);
}

absl::Status CpuBackend::DoCopyToHost(const float* src, int64_t count,
                                      float* host) {
  CANZONA_RETURN_IF_ERROR(BeforeHostCopy("CopyToHost", host, count));
  CANZONA_RETURN_IF_ERROR(Deliver());
  return Move(src, count, host);
}

absl::Status CpuBackend::DoEnqueueCopyFromHost(const float* host, int64_t count,
                                               float* dst) {
  if (space_ == MemorySpace::kDevice) {
    CANZONA_RETURN_IF_ERROR(BeforeHostCopy("EnqueueCopyFromHost", host, count));
    sources_.push_back({host, std::vector<float>(host, host + count)});
  }
  return Move(host, count, dst);
}

absl::Status CpuBackend::DoEnqueueCopyToHost(const float* src, int64_t count,
                                             float* host) {
  if (space_ == MemorySpace::kHost) return Move(src, count, host);
  CANZONA_RETURN_IF_ERROR(BeforeHostCopy("EnqueueCopyToHost", host, count));
  pending_.push_back({host, std::vector<float>(src, src + count)});
  return absl::OkStatus();
}

absl::Status CpuBackend::BeforeHostCopy(absl::string_view what,
                                        const float* host, int64_t count) {
  const auto bytes = static_cast<int64_t>(Bytes(count));
  if (space_ != MemorySpace::kDevice || count == 0 ||
      device_like::HostLocked(host, bytes)) {
    return absl::OkStatus();
  }
  NotePageableCopy(what, host, bytes);
  return DoBeginHostWait(what);
}

absl::Status CpuBackend::DoCopy(const float* src, int64_t count, float* dst) {
  return Move(src, count, dst);
}

absl::Status CpuBackend::DoCopy2D(int64_t rows, int64_t cols, const float* src,
                                  int64_t src_ld, float* dst, int64_t dst_ld) {
  if (src == dst) return absl::OkStatus();
  if (src_ld == cols && dst_ld == cols) return Move(src, rows * cols, dst);
  for (int64_t i = 0; i < rows; ++i) {
    std::memmove(dst + i * dst_ld, src + i * src_ld,
                 static_cast<size_t>(cols) * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DoFill(float value, int64_t count, float* dst) {
  std::fill(dst, dst + count, value);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoSynchronize() { return Deliver(); }

absl::Status CpuBackend::DoBeginHostWait(absl::string_view method) {
  if (space_ != MemorySpace::kDevice) return absl::OkStatus();
  auto finished = []() -> absl::StatusOr<bool> {
    return !device_like_work_blocked.load();
  };
  return AwaitWork(method, finished, [&]() -> absl::Status {
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (device_like_work_blocked.load() && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    if (!device_like_work_blocked.load()) return absl::OkStatus();
    return absl::InternalError(
        absl::StrCat(method,
                     ": a wait without a timeout on work that never "
                     "finishes; on a GPU it would never return"));
  });
}

absl::Status CpuBackend::Deliver() {
  absl::Status status;
  for (const SourceCopy& c : sources_) {
    if (status.ok() && std::memcmp(c.host, c.values.data(),
                                   c.values.size() * sizeof(float)) != 0) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "EnqueueCopyFromHost: its host source (", c.values.size(),
          " floats at ", absl::Hex(reinterpret_cast<uintptr_t>(c.host)),
          ") changed before the wait that releases it; a GPU may copy "
          "the new bytes"));
    }
  }
  sources_.clear();
  for (const PendingCopy& c : pending_) {
    std::memcpy(c.host, c.values.data(), c.values.size() * sizeof(float));
  }
  pending_.clear();
  return status;
}

absl::Status CpuBackend::Move(const float* src, int64_t count, float* dst) {
  std::memmove(dst, src, static_cast<size_t>(count) * sizeof(float));
  return absl::OkStatus();
}

}  // namespace cpu_internal

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(MemorySpace space,
                                                          bool page_aligned) {
  return std::unique_ptr<Backend>(
      std::make_unique<cpu_internal::CpuBackend>(space, page_aligned));
}

void SetDeviceLikeWorkBlocked(bool blocked) {
  cpu_internal::device_like_work_blocked.store(blocked);
}

void SetCpuBlasThreads(int threads) {
  openblas_set_num_threads(threads < 1 ? 1 : threads);
}

}  // namespace canzona
