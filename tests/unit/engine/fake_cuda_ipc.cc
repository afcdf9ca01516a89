// FakeCudaIpc (engine_test_util.h): CUDA IPC handles over host memory.
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona::engine_test {

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
  last_open_device = device;
  CudaIpcOpened opened;
  std::memcpy(&opened.base, handle.data(), sizeof(opened.base));
  std::memcpy(&opened.size, handle.data() + sizeof(opened.base),
              sizeof(opened.size));
  ++opens;
  absl::MutexLock lock(&mu_);
  opened_.emplace_back(static_cast<const char*>(opened.base), opened.size);
  return opened;
}

void FakeCudaIpc::Close(const CudaIpcOpened&, int) { ++closes; }

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
  ++events_open;
  return static_cast<void*>(this);
}

absl::Status FakeCudaIpc::WaitEvent(void*, int, absl::Time deadline) {
  ++event_waits;
  if (!events_complete) {
    // A trainer that died before its GPU reached the record.
    absl::SleepFor(deadline - absl::Now());
    return absl::DeadlineExceededError("fake: the event never completes");
  }
  return absl::OkStatus();
}

void FakeCudaIpc::CloseEvent(void*, int) { --events_open; }

absl::Status FakeCudaIpc::CopyToHost(int, const void* src, size_t bytes,
                                     void* dst) {
  std::memcpy(dst, src, bytes);
  if (HostPageable(dst, bytes)) ++pageable_copies;
  copied_bytes += static_cast<int64_t>(bytes);
  ++to_host;
  to_host_bytes += static_cast<int64_t>(bytes);
  return absl::OkStatus();
}

absl::Status FakeCudaIpc::CopyFromHost(int, const void* src, size_t bytes,
                                       void* dst) {
  std::memcpy(dst, src, bytes);
  if (HostPageable(src, bytes)) ++pageable_copies;
  copied_bytes += static_cast<int64_t>(bytes);
  ++from_host;
  from_host_bytes += static_cast<int64_t>(bytes);
  return absl::OkStatus();
}

}  // namespace canzona::engine_test
