#include "server/engine/cuda_ipc_registry.h"

#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"

namespace canzona {

CudaIpcRegistry::~CudaIpcRegistry() {
  absl::MutexLock lock(&mu_);
  for (auto& [key, entry] : open_) opener_->Close(entry.opened, key.first);
  open_.clear();
}

CudaIpcRegistry::Mapping& CudaIpcRegistry::Mapping::operator=(
    Mapping&& other) noexcept {
  if (this != &other) {
    Reset();
    registry_ = other.registry_;
    key_ = std::move(other.key_);
    data_ = other.data_;
    device_ = other.device_;
    other.registry_ = nullptr;
    other.data_ = nullptr;
  }
  return *this;
}

void CudaIpcRegistry::Mapping::Reset() {
  if (registry_ != nullptr) registry_->Release(key_);
  registry_ = nullptr;
  data_ = nullptr;
}

absl::StatusOr<CudaIpcRegistry::Mapping> CudaIpcRegistry::Map(
    const std::string& field, const canzona::v1::CudaIpcBufferRef& ref,
    uint64_t expected_bytes, int element_bytes, int device, int devices) {
  if (ref.mem_handle().size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".cuda_ipc.mem_handle: ", ref.mem_handle().size(),
                     " bytes, expected ", kCudaIpcHandleBytes));
  }
  if (device < 0 || device >= devices) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".cuda_ipc.device: ", device, " outside [0, ",
                     devices, ") on this node"));
  }
  if (element_bytes <= 0 || ref.offset() % element_bytes != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".cuda_ipc.offset: ", ref.offset(), " is not ",
                     element_bytes, "-byte aligned"));
  }
  if (ref.bytes() != expected_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".cuda_ipc.bytes: ", ref.bytes(),
                     ", the parameter's local shard needs ", expected_bytes));
  }
  std::pair<int, std::string> key(device, ref.mem_handle());
  absl::MutexLock lock(&mu_);
  auto it = open_.find(key);
  if (it == open_.end()) {
    absl::StatusOr<CudaIpcOpened> opened =
        opener_->Open(ref.mem_handle(), device);
    if (!opened.ok()) {
      return absl::Status(
          opened.status().code(),
          absl::StrCat(field, ".cuda_ipc: ", opened.status().message()));
    }
    it = open_.emplace(key, Entry{*opened, 0}).first;
  }
  const CudaIpcOpened a = it->second.opened;  // a copy: `it` may go
  if (ref.offset() > a.size || ref.bytes() > a.size - ref.offset()) {
    if (it->second.refs == 0) {
      opener_->Close(a, device);
      open_.erase(it);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".cuda_ipc: [", ref.offset(), ", ", ref.offset() + ref.bytes(),
        ") leaves the exported allocation of ", a.size, " bytes"));
  }
  ++it->second.refs;
  Mapping m;
  m.registry_ = this;
  m.key_ = std::move(key);
  m.data_ = reinterpret_cast<float*>(static_cast<char*>(a.base) + ref.offset());
  m.device_ = device;
  return m;
}

void CudaIpcRegistry::Release(const std::pair<int, std::string>& key) {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(key);
  if (it == open_.end()) return;
  if (--it->second.refs > 0) return;
  opener_->Close(it->second.opened, key.first);
  open_.erase(it);
}

int CudaIpcRegistry::open_allocations() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(open_.size());
}

}  // namespace canzona
