// The range checks of Backend's entry points (kernels/backend_validation.cc):
// every pointer argument's span against the backend's live allocations
// (AllocationRegistry, MemorySpace), and the overlaps a GPU leaves
// undefined (a copy's or a GEMM's output over its input), so the cpu backend
// refuses what a GPU would get wrong.
//
// Thread-safety: stateless functions; a check reads the backend's registry
// on the backend's owner thread.
#ifndef CANZONA_KERNELS_BACKEND_RANGES_H_
#define CANZONA_KERNELS_BACKEND_RANGES_H_

#include <cstdint>
#include <initializer_list>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"

namespace canzona::backend_ranges {

// Which side of the backend a pointer argument is on.
enum class Side { kBackend, kHost };

// One pointer argument of an entry point, bound to the entry point's own
// variable: the check may redirect it to where the host reaches the bytes
// (a cpu backend standing in for a GPU hands out addresses the host cannot
// dereference; AllocationRegistry::Allocation::alias).
struct Range {
  template <typename T>
  Range(absl::string_view name, T*& p, int64_t elements,
        Side side = Side::kBackend)
      : name(name),
        // float* and const float* are similar types: one may be accessed
        // through the other.
        slot(reinterpret_cast<const float**>(const_cast<const T**>(&p))),
        elements(elements),
        side(side) {}
  absl::string_view name;
  const float** slot;
  int64_t elements;  // floats spanned (0: none touched)
  Side side;
};

// Floats a rows x cols row-major operand with leading dimension ld spans,
// and `batch` of them `stride` apart.
int64_t Spanned(int64_t rows, int64_t cols, int64_t ld, int64_t batch = 1,
                int64_t stride = 0);

// Each range against the backend's allocations (see MemorySpace): on a
// device, backend arguments inside one allocation and host arguments
// outside all of them; on the host, neither may leave or run into one.
absl::Status CheckRanges(const Backend& backend, absl::string_view what,
                         std::initializer_list<Range> ranges);

// INVALID_ARGUMENT when `x` and `y` (floats) share an element: a device
// copy or GEMM gives undefined results there, where the cpu backend's
// loops happen to work, so the cpu refuses it too.
absl::Status CheckDisjoint(absl::string_view what, absl::string_view x_name,
                           const float* x, int64_t nx, absl::string_view y_name,
                           const float* y, int64_t ny, absl::string_view why);

// One of an elementwise kernel's n-float operands; `written` when the
// kernel writes it.
struct Operand {
  absl::string_view name;
  const float* data;
  bool written;
};

// INVALID_ARGUMENT when an operand the kernel writes partly overlaps
// another: an elementwise kernel may write over an input element for
// element (the same pointer), but over a shifted one a GPU thread reads an
// element another thread already wrote (the cpu's one loop happens to
// work, so the cpu refuses it too).
absl::Status CheckSameOrDisjoint(absl::string_view what, int64_t n,
                                 std::initializer_list<Operand> operands);

// Whether two rows x cols row-major blocks share an element. With one
// leading dimension the rows interleave exactly: some row offset k in
// (-rows, rows) has |dst - src + k ld| < cols; with two, their spans are
// compared (conservative).
bool RowsOverlap(int64_t rows, int64_t cols, const float* src, int64_t src_ld,
                 const float* dst, int64_t dst_ld);

// A (strided-batched) GEMM's three operands: op(A) is m x k, stored k x m
// when transposed; op(B) k x n likewise; C m x n. C may not overlap A or
// B, nor one batch entry's C another's (cuBLAS runs them concurrently).
// Conservative: spans are compared, not elements (no caller interleaves
// a GEMM's operands).
absl::Status CheckGemmRanges(const Backend& backend, absl::string_view what,
                             Transpose trans_a, Transpose trans_b, int64_t m,
                             int64_t n, int64_t k, const float*& a, int64_t lda,
                             int64_t stride_a, const float*& b, int64_t ldb,
                             int64_t stride_b, float*& c, int64_t ldc,
                             int64_t stride_c, int64_t batch);

// A kernel that reads all of `src` while it writes `dst` (a permutation, a
// transpose: rows x cols each): the two apart, and both where the backend
// may touch them (CheckRanges may redirect the caller's pointers).
absl::Status CheckReorder(const Backend& backend, absl::string_view what,
                          int64_t rows, int64_t cols, const float*& src,
                          float*& dst);

}  // namespace canzona::backend_ranges

#endif  // CANZONA_KERNELS_BACKEND_RANGES_H_
