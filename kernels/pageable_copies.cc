#include "kernels/pageable_copies.h"

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace canzona {
namespace {

struct Counted {
  absl::Mutex mu;
  int64_t copies ABSL_GUARDED_BY(mu) = 0;
  std::string last ABSL_GUARDED_BY(mu);
};

Counted& Pageable() {
  static auto* counted = new Counted();  // never destroyed
  return *counted;
}

}  // namespace

void CountPageableCopy(absl::string_view what, const void* host,
                       int64_t bytes) {
  Counted& counted = Pageable();
  absl::MutexLock lock(&counted.mu);
  ++counted.copies;
  counted.last = absl::StrCat(what, " of ", bytes, " bytes at 0x",
                              absl::Hex(reinterpret_cast<uintptr_t>(host)));
}

int64_t PageableCopies() {
  Counted& counted = Pageable();
  absl::MutexLock lock(&counted.mu);
  return counted.copies;
}

std::string LastPageableCopy() {
  Counted& counted = Pageable();
  absl::MutexLock lock(&counted.mu);
  return counted.last;
}

}  // namespace canzona
