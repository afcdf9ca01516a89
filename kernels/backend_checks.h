// Argument checks for Backend's entry points (kernels/backend_validation.cc),
// so every implementation rejects the same bad calls with the same
// INVALID_ARGUMENT messages, and Int32Index for the limits that are one
// library's own (BLAS/LAPACK on cpu, cuSOLVER's legacy API on cuda).
//
// Thread-safety: stateless inline functions.
#ifndef CANZONA_KERNELS_BACKEND_CHECKS_H_
#define CANZONA_KERNELS_BACKEND_CHECKS_H_

#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace canzona::backend_checks {

// Product of non-negative sizes, saturating instead of overflowing so that a
// huge request is reported rather than wrapped into a small one.
inline int64_t SatMul(int64_t a, int64_t b) {
  if (a == 0 || b == 0) return 0;
  if (a > std::numeric_limits<int64_t>::max() / b) {
    return std::numeric_limits<int64_t>::max();
  }
  return a * b;
}

// Sum of non-negative sizes, saturating like SatMul.
inline int64_t SatAdd(int64_t a, int64_t b) {
  if (a > std::numeric_limits<int64_t>::max() - b) {
    return std::numeric_limits<int64_t>::max();
  }
  return a + b;
}

// `what` names the method, e.g. "Gemm"; `field` the argument, e.g. "m".
inline absl::Status NonNegative(absl::string_view what, absl::string_view field,
                                int64_t value) {
  if (value >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": ", field, " must be >= 0, got ", value));
}

// A pointer must be set whenever it addresses at least one element.
inline absl::Status Pointer(absl::string_view what, absl::string_view field,
                            const void* pointer, int64_t count) {
  if (count == 0 || pointer != nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": ", field, " is null for ", count, " elements"));
}

// Leading dimension of a row-major matrix with `cols` columns.
inline absl::Status LeadingDim(absl::string_view what, absl::string_view field,
                               int64_t ld, int64_t cols) {
  if (ld >= (cols > 0 ? cols : 1)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": ", field, " = ", ld, " is smaller than the row length ", cols));
}

// value >= minimum, e.g. AdamW's step count (bias corrections divide by
// 1 - beta^step, zero at step 0).
inline absl::Status AtLeast(absl::string_view what, absl::string_view field,
                            int64_t value, int64_t minimum) {
  if (value >= minimum) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": ", field, " must be >= ", minimum, ", got ", value));
}

// A thin QR needs at least as many rows as columns.
inline absl::Status ThinQrShape(absl::string_view what, int64_t rows,
                                int64_t cols) {
  if (rows >= cols) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": rows must be >= cols for a thin Q, got ", rows, " x ", cols));
}

// BLAS, LAPACK and cuSOLVER's legacy API index with 32-bit integers; a
// larger size would silently wrap. `library` names the limit's owner.
inline absl::Status Int32Index(absl::string_view what, absl::string_view field,
                               int64_t value, absl::string_view library) {
  if (value <= std::numeric_limits<int32_t>::max()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", field, " = ",
                                                 value, " exceeds the 32-bit ",
                                                 library, " index range"));
}

}  // namespace canzona::backend_checks

#endif  // CANZONA_KERNELS_BACKEND_CHECKS_H_
