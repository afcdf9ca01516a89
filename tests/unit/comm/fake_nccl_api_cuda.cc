// FakeNcclApi's CUDA runtime half (fake_nccl_api.h): devices, streams,
// events (exported ones too), device memory, asynchronous copies,
// conversions and fills, and page-locked host memory.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/base/dtype.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/device_like_memory.h"
#include "tests/unit/comm/fake_nccl_api.h"

namespace canzona::testing {

namespace {

template <typename T>
T FakeHandle(int64_t n) {
  return reinterpret_cast<T>(static_cast<uintptr_t>(0x10000 + 64 * n));
}

}  // namespace

NcclStream FakeNcclApi::Stream(int n) { return FakeHandle<NcclStream>(n + 1); }

absl::Status FakeNcclApi::SetDevice(int device) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaSetDevice";
  call.root = device;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  ThreadLocked().device = device;
  return absl::OkStatus();
}

absl::StatusOr<NcclEvent> FakeNcclApi::EventCreate() {
  return CreateEvent("cudaEventCreate", /*exported=*/false);
}

absl::StatusOr<NcclEvent> FakeNcclApi::EventCreateExported() {
  return CreateEvent("cudaEventCreateInterprocess", /*exported=*/true);
}

absl::StatusOr<NcclEvent> FakeNcclApi::CreateEvent(const char* op,
                                                   bool exported) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = op;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  NcclEvent event = FakeHandle<NcclEvent>(++next_event_);
  events_[event] =
      EventState{.device = ThreadLocked().device, .exported = exported};
  return event;
}

absl::StatusOr<std::string> FakeNcclApi::EventIpcHandle(NcclEvent event) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaIpcGetEventHandle";
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  auto it = events_.find(event);
  if (it == events_.end() || !it->second.exported) {
    return absl::InvalidArgumentError(
        "cudaIpcGetEventHandle: not an interprocess event");
  }
  std::string handle(64, '\0');
  std::memcpy(handle.data(), &event, sizeof(event));
  return handle;
}

absl::StatusOr<NcclEvent> FakeNcclApi::OpenEventHandle(
    const std::string& handle) const {
  absl::MutexLock lock(&mu_);
  NcclEvent event = nullptr;
  if (handle.size() == 64) std::memcpy(&event, handle.data(), sizeof(event));
  auto it = events_.find(event);
  if (it == events_.end() || !it->second.exported) {
    return absl::NotFoundError("cudaIpcOpenEventHandle: no such event");
  }
  return event;
}

int FakeNcclApi::exported_events() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [event, state] : events_) n += state.exported ? 1 : 0;
  return n;
}

absl::Status FakeNcclApi::EventDestroy(NcclEvent event) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaEventDestroy";
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  if (events_.erase(event) == 0) {
    return absl::InvalidArgumentError("cudaEventDestroy: unknown event");
  }
  return absl::OkStatus();
}

absl::Status FakeNcclApi::EventRecord(NcclEvent event, NcclStream stream) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaEventRecord";
  call.stream = stream;
  call.send = event;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  auto it = events_.find(event);
  if (it == events_.end()) {
    return absl::InvalidArgumentError("cudaEventRecord: unknown event");
  }
  CANZONA_RETURN_IF_ERROR(StreamOnDeviceLocked(stream, it->second.device,
                                               "cudaEventRecord", "an event"));
  it->second.stream = stream;
  it->second.target = streams_[stream].enqueued;
  return absl::OkStatus();
}

absl::StatusOr<bool> FakeNcclApi::EventQuery(NcclEvent event) {
  absl::MutexLock lock(&mu_);
  ++polls_;
  auto it = events_.find(event);
  if (it == events_.end()) {
    return absl::InvalidArgumentError("cudaEventQuery: unknown event");
  }
  if (it->second.exported && options_.defer_copies) {
    ProgressStreamLocked(it->second.stream, it->second.target);
  } else {
    ProgressLocked();
  }
  return streams_[it->second.stream].completed >= it->second.target;
}

absl::StatusOr<void*> FakeNcclApi::Malloc(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaMalloc";
  call.count = bytes;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  const size_t size = static_cast<size_t>((bytes + 255) / 256 * 256 + 256);
  void* p = std::aligned_alloc(256, size);
  if (p == nullptr) return absl::ResourceExhaustedError("cudaMalloc");
  std::memset(p, 0xff, size);  // NaN floats: unwritten lanes show up
  allocations_[p] = bytes;
  return p;
}

absl::Status FakeNcclApi::Free(void* ptr) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaFree";
  call.recv = ptr;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  if (ptr == nullptr) return absl::OkStatus();
  if (allocations_.erase(ptr) == 0) {
    return absl::InvalidArgumentError("cudaFree: not an allocation");
  }
  std::free(ptr);
  return absl::OkStatus();
}

absl::StatusOr<NcclStream> FakeNcclApi::StreamCreate() {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaStreamCreate";
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  // Far from the handles Stream(n) gives tests.
  NcclStream stream =
      FakeHandle<NcclStream>((int64_t{1} << 24) + ++next_stream_);
  stream_devices_[stream] = ThreadLocked().device;
  return stream;
}

absl::Status FakeNcclApi::StreamDestroy(NcclStream stream) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaStreamDestroy";
  call.stream = stream;
  return RecordLocked(std::move(call));
}

absl::Status FakeNcclApi::StreamWaitEvent(NcclStream stream, NcclEvent event) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaStreamWaitEvent";
  call.stream = stream;
  call.send = event;
  return RecordLocked(std::move(call));
}

absl::Status FakeNcclApi::MemcpyAsync(void* dst, const void* src, int64_t bytes,
                                      NcclStream stream) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaMemcpyAsync";
  call.count = bytes;
  call.send = src;
  call.recv = dst;
  call.stream = stream;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  if (options_.simulate_data) {
    CANZONA_ASSIGN_OR_RETURN(
        dst, device_like::HostAddress(dst, bytes, "cudaMemcpyAsync", "dst"));
    CANZONA_ASSIGN_OR_RETURN(
        src, device_like::HostAddress(src, bytes, "cudaMemcpyAsync", "src"));
  }
  std::unique_ptr<Entry> entry = NewEntryLocked();
  entry->local = [dst, src, bytes]() {
    if (bytes > 0) std::memmove(dst, src, static_cast<size_t>(bytes));
  };
  PushLocked(stream, std::move(entry));
  if (!options_.defer_copies) ProgressLocked();
  return absl::OkStatus();
}

absl::Status FakeNcclApi::ConvertAsync(DType from, const void* src, DType to,
                                       void* dst, int64_t n,
                                       NcclStream stream) {
  FakeNcclCall call;
  call.op = "ConvertDTypeAsync";
  call.count = n;
  call.dtype = absl::StrCat(DTypeName(from), "->", DTypeName(to));
  call.send = src;
  call.recv = dst;
  call.stream = stream;
  return EnqueueKernel(std::move(call), n * DTypeBytes(from),
                       n * DTypeBytes(to),
                       [from, to, n](const void* in, void* out) {
                         // Host memory stands in for device memory (data mode):
                         // the host conversions, through fp32.
                         std::vector<float> wide(static_cast<size_t>(n));
                         WidenToFloat(from, in, n, wide.data());
                         RoundFromFloat(wide.data(), n, to, out);
                       });
}

absl::Status FakeNcclApi::ReloadMastersAsync(DType dtype, const void* values,
                                             float* masters, int64_t n,
                                             NcclStream stream) {
  FakeNcclCall call;
  call.op = "ReloadMastersAsync";
  call.count = n;
  call.dtype = DTypeName(dtype);
  call.send = values;
  call.recv = masters;
  call.stream = stream;
  return EnqueueKernel(std::move(call), n * DTypeBytes(dtype),
                       n * static_cast<int64_t>(sizeof(float)),
                       [dtype, n](const void* in, void* out) {
                         ReloadMasters(dtype, in, n, static_cast<float*>(out));
                       });
}

absl::Status FakeNcclApi::EnqueueKernel(
    FakeNcclCall call, int64_t src_bytes, int64_t dst_bytes,
    std::function<void(const void* src, void* dst)> run) {
  absl::MutexLock lock(&mu_);
  const std::string op = call.op;
  const void* src = call.send;
  void* dst = const_cast<void*>(call.recv);
  const NcclStream stream = call.stream;
  const int64_t n = call.count;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  // A kernel launch: on a stream of the current device.
  CANZONA_RETURN_IF_ERROR(StreamOnDeviceLocked(
      stream, ThreadLocked().device, op.c_str(), "the current device"));
  if (options_.simulate_data && n > 0) {
    CANZONA_ASSIGN_OR_RETURN(
        src, device_like::HostAddress(src, src_bytes, op, "src"));
    CANZONA_ASSIGN_OR_RETURN(
        dst, device_like::HostAddress(dst, dst_bytes, op, "dst"));
  }
  std::unique_ptr<Entry> entry = NewEntryLocked();
  entry->local = [run = std::move(run), src, dst, n]() {
    if (n > 0) run(src, dst);
  };
  PushLocked(stream, std::move(entry));
  if (!options_.defer_copies) ProgressLocked();
  return absl::OkStatus();
}

absl::Status FakeNcclApi::MemsetAsync(void* dst, int value, int64_t bytes,
                                      NcclStream stream) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaMemsetAsync";
  call.count = bytes;
  call.recv = dst;
  call.stream = stream;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  if (options_.simulate_data) {
    CANZONA_ASSIGN_OR_RETURN(
        dst, device_like::HostAddress(dst, bytes, "cudaMemsetAsync", "dst"));
  }
  std::unique_ptr<Entry> entry = NewEntryLocked();
  entry->local = [dst, value, bytes]() {
    if (bytes > 0) std::memset(dst, value, static_cast<size_t>(bytes));
  };
  PushLocked(stream, std::move(entry));
  if (!options_.defer_copies) ProgressLocked();
  return absl::OkStatus();
}

absl::Status FakeNcclApi::HostRegister(void* ptr, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaHostRegister";
  call.count = bytes;
  call.recv = ptr;
  CANZONA_RETURN_IF_ERROR(RecordLocked(std::move(call)));
  if (ptr == nullptr || bytes <= 0) {
    return absl::InvalidArgumentError("cudaHostRegister: empty range");
  }
  if (refuse_host_register_) {
    return absl::ResourceExhaustedError(
        "cudaHostRegister: cudaErrorMemoryAllocation (RLIMIT_MEMLOCK)");
  }
  const auto b = reinterpret_cast<uintptr_t>(ptr);
  for (const auto& [p, n] : host_registered_) {
    const auto q = reinterpret_cast<uintptr_t>(p);
    if (b < q + static_cast<uintptr_t>(n) &&
        q < b + static_cast<uintptr_t>(bytes)) {
      return absl::AlreadyExistsError(
          "cudaHostRegister: cudaErrorHostMemoryAlreadyRegistered");
    }
  }
  // Locked for the cpu backend standing in for a GPU too, which counts its
  // copies from and to pageable memory.
  CANZONA_RETURN_IF_ERROR(
      device_like::LockHost(ptr, bytes, "cudaHostRegister"));
  host_registered_[ptr] = bytes;
  return absl::OkStatus();
}

absl::Status FakeNcclApi::HostUnregister(void* ptr) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaHostUnregister";
  call.recv = ptr;
  CANZONA_RETURN_IF_ERROR(RecordLocked(std::move(call)));
  if (host_registered_.erase(ptr) == 0) {
    return absl::InvalidArgumentError(
        "cudaHostUnregister: cudaErrorHostMemoryNotRegistered");
  }
  device_like::UnlockHost(ptr);
  return absl::OkStatus();
}

int64_t FakeNcclApi::host_registered() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(host_registered_.size());
}

namespace {

// Whether [ptr, ptr + bytes) lies inside one of `ranges` (begin -> bytes).
bool InsideOne(const std::map<void*, int64_t>& ranges, const void* ptr,
               int64_t bytes) {
  const char* p = static_cast<const char*>(ptr);
  auto it = ranges.upper_bound(const_cast<char*>(p));
  if (it == ranges.begin()) return false;
  --it;
  const char* begin = static_cast<const char*>(it->first);
  return p >= begin && p + bytes <= begin + it->second;
}

}  // namespace

bool FakeNcclApi::HostRegistered(const void* ptr, int64_t bytes) const {
  absl::MutexLock lock(&mu_);
  return InsideOne(host_registered_, ptr, bytes);
}

bool FakeNcclApi::DeviceAllocated(const void* ptr, int64_t bytes) const {
  absl::MutexLock lock(&mu_);
  return InsideOne(allocations_, ptr, bytes);
}

bool FakeNcclApi::HostPageable(const void* ptr, int64_t bytes) const {
  if (device_like::HostAlias(ptr) != nullptr) return false;
  absl::MutexLock lock(&mu_);
  return !InsideOne(allocations_, ptr, bytes) &&
         !InsideOne(host_registered_, ptr, bytes) &&
         !(other_device_memory_ && other_device_memory_(ptr, bytes));
}

}  // namespace canzona::testing
