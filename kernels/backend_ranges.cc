#include "kernels/backend_ranges.h"

#include <cstdint>
#include <initializer_list>
#include <iterator>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/allocation_registry.h"
#include "kernels/backend.h"
#include "kernels/backend_checks.h"
#include "kernels/base/status_macros.h"

namespace canzona::backend_ranges {

namespace checks = backend_checks;
using checks::SatMul;

int64_t Spanned(int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                int64_t stride) {
  if (rows == 0 || cols == 0 || batch == 0) return 0;
  const int64_t one = checks::SatAdd(SatMul(rows - 1, ld), cols);
  return checks::SatAdd(SatMul(batch - 1, stride), one);
}

absl::Status CheckRanges(const Backend& backend, absl::string_view what,
                         std::initializer_list<Range> ranges) {
  const AllocationRegistry& registry = backend.allocations();
  const bool device = backend.memory_space() == MemorySpace::kDevice;
  for (const Range& r : ranges) {
    const int64_t bytes = SatMul(r.elements, sizeof(float));
    const void* resolved = *r.slot;
    if (!device) {
      CANZONA_RETURN_IF_ERROR(
          registry.CheckContained(what, r.name, *r.slot, bytes, &resolved));
    } else if (r.side == Side::kBackend) {
      CANZONA_RETURN_IF_ERROR(
          registry.CheckInside(what, r.name, *r.slot, bytes, &resolved));
    } else {
      CANZONA_RETURN_IF_ERROR(
          registry.CheckOutside(what, r.name, *r.slot, bytes));
    }
    *r.slot = static_cast<const float*>(resolved);
  }
  return absl::OkStatus();
}

absl::Status CheckDisjoint(absl::string_view what, absl::string_view x_name,
                           const float* x, int64_t nx, absl::string_view y_name,
                           const float* y, int64_t ny, absl::string_view why) {
  const auto begin_x = reinterpret_cast<uintptr_t>(x);
  const auto begin_y = reinterpret_cast<uintptr_t>(y);
  const auto end_x = begin_x + static_cast<uintptr_t>(nx) * sizeof(float);
  const auto end_y = begin_y + static_cast<uintptr_t>(ny) * sizeof(float);
  if (nx == 0 || ny == 0 || end_x <= begin_y || end_y <= begin_x) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": ", x_name, " [", absl::Hex(begin_x), ", +", nx,
                   " floats) and ", y_name, " [", absl::Hex(begin_y), ", +", ny,
                   " floats) overlap (", why, ")"));
}

absl::Status CheckSameOrDisjoint(absl::string_view what, int64_t n,
                                 std::initializer_list<Operand> operands) {
  for (auto x = operands.begin(); x != operands.end(); ++x) {
    for (auto y = std::next(x); y != operands.end(); ++y) {
      if ((!x->written && !y->written) || x->data == y->data) continue;
      CANZONA_RETURN_IF_ERROR(CheckDisjoint(
          what, x->name, x->data, n, y->name, y->data, n,
          "an operand it writes may be another one, not overlap it"));
    }
  }
  return absl::OkStatus();
}

bool RowsOverlap(int64_t rows, int64_t cols, const float* src, int64_t src_ld,
                 const float* dst, int64_t dst_ld) {
  const auto s = reinterpret_cast<intptr_t>(src);
  const auto d = reinterpret_cast<intptr_t>(dst);
  if ((d - s) % static_cast<intptr_t>(sizeof(float)) != 0 || src_ld != dst_ld) {
    const intptr_t s_end =
        s + static_cast<intptr_t>(Spanned(rows, cols, src_ld) * 4);
    const intptr_t d_end =
        d + static_cast<intptr_t>(Spanned(rows, cols, dst_ld) * 4);
    return s < d_end && d < s_end;
  }
  const int64_t delta = static_cast<int64_t>((d - s) / 4);
  const int64_t ld = src_ld;
  // The k nearest -delta / ld, and its neighbours, within the rows.
  const int64_t nearest = ld > 0 ? -delta / ld : 0;
  for (int64_t k = nearest - 1; k <= nearest + 1; ++k) {
    if (k <= -rows || k >= rows) continue;
    const int64_t gap = delta + k * ld;
    if (gap > -cols && gap < cols) return true;
  }
  return false;
}

absl::Status CheckGemmRanges(const Backend& backend, absl::string_view what,
                             Transpose trans_a, Transpose trans_b, int64_t m,
                             int64_t n, int64_t k, const float*& a, int64_t lda,
                             int64_t stride_a, const float*& b, int64_t ldb,
                             int64_t stride_b, float*& c, int64_t ldc,
                             int64_t stride_c, int64_t batch) {
  const bool ta = trans_a == Transpose::kYes, tb = trans_b == Transpose::kYes;
  const int64_t span_a = Spanned(ta ? k : m, ta ? m : k, lda, batch, stride_a);
  const int64_t span_b = Spanned(tb ? n : k, tb ? k : n, ldb, batch, stride_b);
  const int64_t span_c = Spanned(m, n, ldc, batch, stride_c);
  if (batch > 1 && stride_c < Spanned(m, n, ldc)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": stride_c ", stride_c, " is less than one C's span (",
        Spanned(m, n, ldc), " floats): the batch's output spans overlap"));
  }
  constexpr absl::string_view kAlias =
      "a GEMM's output may not alias its inputs";
  CANZONA_RETURN_IF_ERROR(
      CheckDisjoint(what, "c", c, span_c, "a", a, span_a, kAlias));
  CANZONA_RETURN_IF_ERROR(
      CheckDisjoint(what, "c", c, span_c, "b", b, span_b, kAlias));
  return CheckRanges(backend, what,
                     {{"a", a, span_a}, {"b", b, span_b}, {"c", c, span_c}});
}

absl::Status CheckReorder(const Backend& backend, absl::string_view what,
                          int64_t rows, int64_t cols, const float*& src,
                          float*& dst) {
  const int64_t count = SatMul(rows, cols);
  CANZONA_RETURN_IF_ERROR(
      CheckDisjoint(what, "src", src, count, "dst", dst, count,
                    "a kernel reading src while writing dst races"));
  return CheckRanges(backend, what, {{"src", src, count}, {"dst", dst, count}});
}

}  // namespace canzona::backend_ranges
