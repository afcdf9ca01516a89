#include "kernels/allocation_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace canzona {
namespace {

std::string FormatRange(uintptr_t begin, int64_t bytes) {
  return absl::StrFormat("[0x%x, +%d bytes)", begin, bytes);
}

std::string Describe(const AllocationRegistry::Allocation& a) {
  return absl::StrCat(FormatRange(a.begin, a.bytes), " (", a.label, ")");
}

}  // namespace

absl::Status AllocationRegistry::Add(const void* begin, int64_t bytes,
                                     absl::string_view label,
                                     const void* alias) {
  const auto b = reinterpret_cast<uintptr_t>(begin);
  if (begin == nullptr || bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot register ", FormatRange(b, bytes), " (", label, "): empty"));
  }
  absl::MutexLock lock(&mu_);
  auto next = allocations_.lower_bound(b);
  if (next != allocations_.end() &&
      next->first < b + static_cast<uintptr_t>(bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot register ", FormatRange(b, bytes), " (", label,
                     "): it overlaps ", Describe(next->second)));
  }
  if (next != allocations_.begin()) {
    const Allocation& before = std::prev(next)->second;
    if (before.begin + static_cast<uintptr_t>(before.bytes) > b) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot register ", FormatRange(b, bytes), " (", label,
                       "): it overlaps ", Describe(before)));
    }
  }
  allocations_.emplace_hint(next, b,
                            Allocation{b, bytes, std::string(label),
                                       reinterpret_cast<uintptr_t>(alias)});
  return absl::OkStatus();
}

void AllocationRegistry::Remove(const void* begin) {
  absl::MutexLock lock(&mu_);
  allocations_.erase(reinterpret_cast<uintptr_t>(begin));
}

std::optional<AllocationRegistry::Allocation> AllocationRegistry::Find(
    const void* p) const {
  const auto at = reinterpret_cast<uintptr_t>(p);
  absl::ReaderMutexLock lock(&mu_);
  auto it = allocations_.upper_bound(at);
  if (it == allocations_.begin()) return std::nullopt;
  --it;
  if (at >= it->first + static_cast<uintptr_t>(it->second.bytes)) {
    return std::nullopt;
  }
  return it->second;
}

int64_t AllocationRegistry::size() const {
  absl::ReaderMutexLock lock(&mu_);
  return static_cast<int64_t>(allocations_.size());
}

absl::Status AllocationRegistry::CheckInside(absl::string_view what,
                                             absl::string_view arg,
                                             const void* p, int64_t bytes,
                                             const void** resolved) const {
  return Check(Rule::kInside, what, arg, p, bytes, resolved);
}

absl::Status AllocationRegistry::CheckOutside(absl::string_view what,
                                              absl::string_view arg,
                                              const void* p,
                                              int64_t bytes) const {
  return Check(Rule::kOutside, what, arg, p, bytes, nullptr);
}

absl::Status AllocationRegistry::CheckContained(absl::string_view what,
                                                absl::string_view arg,
                                                const void* p, int64_t bytes,
                                                const void** resolved) const {
  return Check(Rule::kContained, what, arg, p, bytes, resolved);
}

absl::Status AllocationRegistry::Check(Rule rule, absl::string_view what,
                                       absl::string_view arg, const void* p,
                                       int64_t bytes,
                                       const void** resolved) const {
  if (resolved != nullptr) *resolved = p;
  if (bytes <= 0) return absl::OkStatus();
  const auto b = reinterpret_cast<uintptr_t>(p);
  const auto e = b + static_cast<uintptr_t>(bytes);
  absl::ReaderMutexLock lock(&mu_);
  // The allocation holding the first byte, if any, and the first one
  // starting after it.
  auto next = allocations_.upper_bound(b);
  const Allocation* holder = nullptr;
  if (next != allocations_.begin()) {
    const Allocation& before = std::prev(next)->second;
    if (b < before.begin + static_cast<uintptr_t>(before.bytes)) {
      holder = &before;
    }
  }
  if (holder != nullptr) {
    const uintptr_t end = holder->begin + static_cast<uintptr_t>(holder->bytes);
    if (rule == Rule::kOutside) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", arg, " ", FormatRange(b, bytes),
          " must be memory outside the backend, but lies in its allocation ",
          Describe(*holder)));
    }
    if (e > end) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", arg, " ", FormatRange(b, bytes), " runs ", e - end,
          " bytes past the end of its allocation ", Describe(*holder)));
    }
    if (resolved != nullptr && holder->alias != 0) {
      *resolved =
          reinterpret_cast<const void*>(holder->alias + (b - holder->begin));
    }
    return absl::OkStatus();
  }
  if (rule == Rule::kInside) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", arg, " ", FormatRange(b, bytes),
                     " lies in no live allocation of the backend"));
  }
  if (next != allocations_.end() && next->first < e) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", arg, " ", FormatRange(b, bytes),
                     " runs into the allocation ", Describe(next->second)));
  }
  return absl::OkStatus();
}

}  // namespace canzona
