// AllocationRegistry: the live allocations of one memory space (a backend's
// buffers and the foreign memory registered with it), so that every range a
// caller hands a backend, a stage copier or a communicator is checked
// against the allocation it claims to lie in.
//
// Why: a device's driver refuses a copy that runs past its allocation, but
// only on a GPU; the cpu backend's allocations used to be padded to their
// alignment, so the same overflow passed every test without one (the NCCL
// plane's world sum copied 5 floats into a 4-float buffer and failed at
// its first step on an H200). Checking every range here makes that class
// of defect fail on any machine, in every build.
//
//   AllocationRegistry registry;
//   CANZONA_RETURN_IF_ERROR(registry.Add(p, 16, "Allocate(4)"));
//   // [p, p + 20) ends past its allocation: INVALID_ARGUMENT
//   //   "CopyFromHost: dst [0x..., +20 bytes) runs 4 bytes past the end of
//   //    its allocation [0x..., +16 bytes) (Allocate(4))".
//   CANZONA_RETURN_IF_ERROR(registry.CheckInside("CopyFromHost", "dst", p,
//   20));
//
// Three rules, one per kind of argument:
//  - CheckInside: the range lies inside one live allocation (device
//    memory a kernel or a device copy touches);
//  - CheckOutside: the range overlaps no live allocation (host memory on
//    the other side of a host<->device copy);
//  - CheckContained: inside one allocation, or overlapping none (memory
//    that may be either, e.g. cudaMemcpyDefault, or host memory handed to
//    the cpu backend, whose memory space is the host's); a range that
//    starts in one allocation and leaves it, or runs into one, is the bug.
//
// Cost: one reader lock and one ordered-map lookup per range (measured by
// canzona_kernels_bench's BM_RangeCheck).
//
// Thread-safety: thread-safe. The owning backend adds and removes on its
// thread; copiers and communicators of the same rank check from theirs.
#ifndef CANZONA_KERNELS_ALLOCATION_REGISTRY_H_
#define CANZONA_KERNELS_ALLOCATION_REGISTRY_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace canzona {

class AllocationRegistry {
 public:
  struct Allocation {
    uintptr_t begin = 0;
    int64_t bytes = 0;
    std::string label;  // e.g. "Allocate(4)", "trainer buffer 'params'"
    // Where the host reaches these bytes, when not at `begin`: the cpu
    // backend standing in for a GPU hands out addresses the host cannot
    // dereference and works on the same bytes elsewhere (0: at begin).
    uintptr_t alias = 0;
  };

  AllocationRegistry() = default;
  AllocationRegistry(const AllocationRegistry&) = delete;
  AllocationRegistry& operator=(const AllocationRegistry&) = delete;

  // Records [begin, begin + bytes) (bytes > 0). INVALID_ARGUMENT when it
  // overlaps a live allocation (memory registered twice).
  absl::Status Add(const void* begin, int64_t bytes, absl::string_view label,
                   const void* alias = nullptr);
  // Forgets the allocation starting at `begin` (no-op when none does).
  void Remove(const void* begin);

  // See the rules above. `what` names the method, `arg` its argument; an
  // empty range (bytes <= 0) always passes. When `resolved` is set, it
  // receives where the host reaches `p` (its allocation's alias, else p).
  absl::Status CheckInside(absl::string_view what, absl::string_view arg,
                           const void* p, int64_t bytes,
                           const void** resolved = nullptr) const;
  absl::Status CheckOutside(absl::string_view what, absl::string_view arg,
                            const void* p, int64_t bytes) const;
  absl::Status CheckContained(absl::string_view what, absl::string_view arg,
                              const void* p, int64_t bytes,
                              const void** resolved = nullptr) const;

  // The live allocation containing byte `p`, if any.
  std::optional<Allocation> Find(const void* p) const;
  // Live allocations (tests).
  int64_t size() const;

 private:
  enum class Rule { kInside, kOutside, kContained };
  absl::Status Check(Rule rule, absl::string_view what, absl::string_view arg,
                     const void* p, int64_t bytes, const void** resolved) const;

  mutable absl::Mutex mu_;
  // By begin address; ranges never overlap.
  std::map<uintptr_t, Allocation> allocations_ ABSL_GUARDED_BY(mu_);
};

}  // namespace canzona

#endif  // CANZONA_KERNELS_ALLOCATION_REGISTRY_H_
