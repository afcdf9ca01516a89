// FakeCudaIpc (engine_test_util.h): CUDA IPC handles over host memory.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona::engine_test {
namespace {

// The daemon broke one of CUDA's IPC rules, which a GPU would answer with
// an error the daemon ignores (a close) or a hang or worse (a wait on a
// closed event): fatal here, so that no test passes over it (the benches
// share this fake and have no gtest).
[[noreturn]] void Violation(const char* what) {
  std::fprintf(stderr, "FakeCudaIpc: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

}  // namespace

std::string FakeCudaIpc::Handle(void* base, uint64_t size) {
  std::string h(kCudaIpcHandleBytes, '\0');
  std::memcpy(h.data(), &base, sizeof(base));
  std::memcpy(h.data() + sizeof(base), &size, sizeof(size));
  return h;
}

std::string FakeCudaIpc::EventHandle(int id) {
  std::string h(kCudaIpcHandleBytes, 'e');
  std::memcpy(h.data(), &id, sizeof(id));
  return h;
}

absl::StatusOr<CudaIpcOpened> FakeCudaIpc::Open(const std::string& handle,
                                                int device) {
  if (handle.size() != kCudaIpcHandleBytes || device < 0 || device >= devices) {
    return absl::InvalidArgumentError("fake: bad handle or device");
  }
  CudaIpcOpened opened;
  std::memcpy(&opened.base, handle.data(), sizeof(opened.base));
  std::memcpy(&opened.size, handle.data() + sizeof(opened.base),
              sizeof(opened.size));
  absl::MutexLock lock(&mu_);
  if (!open_memory_.emplace(device, opened.base).second) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fake: cudaIpcOpenMemHandle of an allocation already open on device ",
        device, " in this process (CUDA maps each once)"));
  }
  last_open_device = device;
  ++opens;
  opened_.emplace_back(static_cast<const char*>(opened.base), opened.size);
  return opened;
}

void FakeCudaIpc::Close(const CudaIpcOpened& opened, int device) {
  absl::MutexLock lock(&mu_);
  if (open_memory_.erase({device, opened.base}) == 0) {
    Violation("cudaIpcCloseMemHandle of an allocation not open on its device");
  }
  ++closes;
}

bool FakeCudaIpc::InsideOpened(const void* p, size_t bytes) const {
  const auto* begin = static_cast<const char*>(p);
  absl::MutexLock lock(&mu_);
  for (const auto& [base, size] : opened_) {
    if (begin >= base && begin + bytes <= base + size) return true;
  }
  return false;
}

std::string FakeCudaIpc::BusId(int device) {
  return absl::StrFormat("0000:%02x:00.0", device);
}

absl::StatusOr<int> FakeCudaIpc::DeviceOfPciBusId(
    const std::string& pci_bus_id) {
  for (int d = 0; d < devices; ++d) {
    if (BusId(d) == pci_bus_id) return d;
  }
  return absl::NotFoundError(
      absl::StrCat("fake: no GPU with PCI bus id ", pci_bus_id));
}

absl::StatusOr<std::string> FakeCudaIpc::PciBusIdOf(int device) {
  if (device < 0 || device >= devices) {
    return absl::InvalidArgumentError("fake: bad device");
  }
  return BusId(device);
}

absl::StatusOr<void*> FakeCudaIpc::OpenEvent(const std::string& handle, int) {
  if (handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError("fake: bad event handle");
  }
  absl::MutexLock lock(&mu_);
  const void* event = reinterpret_cast<const void*>(next_event_++);
  open_events_.insert(event);
  ++events_open;
  return const_cast<void*>(event);
}

absl::Status FakeCudaIpc::WaitEvent(void* event, int, absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    if (!open_events_.contains(event)) {
      Violation("a wait on an event that is not open");
    }
  }
  ++event_waits;
  if (!events_complete) {
    // A trainer that died before its GPU reached the record.
    absl::SleepFor(deadline - absl::Now());
    return absl::DeadlineExceededError("fake: the event never completes");
  }
  return absl::OkStatus();
}

bool FakeCudaIpc::IsOpenEvent(const void* event) const {
  absl::MutexLock lock(&mu_);
  return open_events_.contains(event);
}

void FakeCudaIpc::CloseEvent(void* event, int) {
  absl::MutexLock lock(&mu_);
  if (open_events_.erase(event) == 0) {
    Violation("cudaEventDestroy of an event that is not open");
  }
  --events_open;
}

absl::Status FakeCudaIpc::CopyToHost(int device, const void* src,
                                     size_t bytes, void* dst) {
  std::memcpy(dst, src, bytes);
  if (HostPageable(device, dst, bytes)) ++pageable_copies;
  copied_bytes += static_cast<int64_t>(bytes);
  ++to_host;
  to_host_bytes += static_cast<int64_t>(bytes);
  return absl::OkStatus();
}

absl::Status FakeCudaIpc::CopyFromHost(int device, const void* src,
                                       size_t bytes, void* dst) {
  std::memcpy(dst, src, bytes);
  if (HostPageable(device, src, bytes)) ++pageable_copies;
  copied_bytes += static_cast<int64_t>(bytes);
  ++from_host;
  from_host_bytes += static_cast<int64_t>(bytes);
  return absl::OkStatus();
}

}  // namespace canzona::engine_test
