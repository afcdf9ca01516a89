#include "kernels/cpu/device_like_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "kernels/allocation_registry.h"
#include "kernels/base/status_macros.h"

namespace canzona::device_like {
namespace {

AllocationRegistry& Mappings() {
  static auto* mappings = new AllocationRegistry();  // never destroyed
  return *mappings;
}

AllocationRegistry& Locked() {
  static auto* locked = new AllocationRegistry();  // never destroyed
  return *locked;
}

size_t Reserved(int64_t bytes) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (static_cast<size_t>(bytes) + page - 1) / page * page;
}

}  // namespace

absl::StatusOr<void*> Map(void* host, int64_t bytes, absl::string_view label) {
  void* device = mmap(nullptr, Reserved(bytes), PROT_NONE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (device == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "device-like memory: cannot reserve ", bytes, " bytes for ", label));
  }
  absl::Status added = Mappings().Add(device, bytes, label, host);
  if (!added.ok()) {
    munmap(device, Reserved(bytes));
    return added;
  }
  return device;
}

void Unmap(void* device, int64_t bytes) {
  Mappings().Remove(device);
  munmap(device, Reserved(bytes));
}

const void* HostAlias(const void* device) {
  std::optional<AllocationRegistry::Allocation> a = Mappings().Find(device);
  if (!a.has_value()) return nullptr;
  return reinterpret_cast<const void*>(
      a->alias + (reinterpret_cast<uintptr_t>(device) - a->begin));
}

absl::StatusOr<const void*> HostAddress(const void* p, int64_t bytes,
                                        absl::string_view what,
                                        absl::string_view arg) {
  const void* resolved = p;
  CANZONA_RETURN_IF_ERROR(
      Mappings().CheckContained(what, arg, p, bytes, &resolved));
  return resolved;
}

absl::StatusOr<void*> HostAddress(void* p, int64_t bytes,
                                  absl::string_view what,
                                  absl::string_view arg) {
  CANZONA_ASSIGN_OR_RETURN(
      const void* resolved,
      HostAddress(static_cast<const void*>(p), bytes, what, arg));
  return const_cast<void*>(resolved);
}

absl::Status LockHost(const void* p, int64_t bytes, absl::string_view label) {
  if (p == nullptr || bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device-like memory: cannot lock an empty range (", label, ")"));
  }
  return Locked().Add(p, bytes, label);
}

void UnlockHost(const void* p) { Locked().Remove(p); }

bool HostLocked(const void* p, int64_t bytes) {
  return Locked().CheckInside("HostLocked", "p", p, bytes).ok();
}

}  // namespace canzona::device_like
