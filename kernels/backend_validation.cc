// Backend's public entry points (the Non-Virtual Interface of backend.h):
// each validates its arguments once for every implementation, returns early
// from calls that touch no element, and dispatches to the implementation's
// Do-method. Checks run in argument order, so the first bad argument is the
// one reported.
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/backend_checks.h"
#include "kernels/base/status_macros.h"

namespace canzona {
namespace {

namespace checks = backend_checks;
using checks::SatMul;

// A stored row-major operand of `count` elements (0 when none is read) whose
// rows hold `stored_cols` elements `ld` apart.
absl::Status CheckMatrix(absl::string_view what, absl::string_view name,
                         absl::string_view ld_name, const void* p,
                         int64_t count, int64_t ld, int64_t stored_cols) {
  CANZONA_RETURN_IF_ERROR(checks::Pointer(what, name, p, count));
  return checks::LeadingDim(what, ld_name, ld, stored_cols);
}

// `batch` GEMMs of one shape (Gemm is batch 1): sizes, then each operand.
absl::Status CheckGemm(absl::string_view what, Transpose trans_a,
                       Transpose trans_b, int64_t m, int64_t n, int64_t k,
                       const float* a, int64_t lda, const float* b, int64_t ldb,
                       const float* c, int64_t ldc, int64_t batch) {
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(what, "m", m));
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(what, "n", n));
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(what, "k", k));
  // op(A) is m x k and op(B) k x n; a transposed operand is stored the
  // other way round, so its rows are m (resp. k) long.
  CANZONA_RETURN_IF_ERROR(CheckMatrix(what, "a", "lda", a,
                                      SatMul(batch, SatMul(m, k)), lda,
                                      trans_a == Transpose::kYes ? m : k));
  CANZONA_RETURN_IF_ERROR(CheckMatrix(what, "b", "ldb", b,
                                      SatMul(batch, SatMul(k, n)), ldb,
                                      trans_b == Transpose::kYes ? k : n));
  return CheckMatrix(what, "c", "ldc", c, SatMul(batch, SatMul(m, n)), ldc, n);
}

// The spec's algorithm is one of the enum's values (a cast from a wire
// integer could be anything).
absl::Status CheckNsAlgorithm(absl::string_view what,
                              const NewtonSchulzSpec& spec) {
  switch (spec.algorithm) {
    case NsAlgorithm::kStandard:
    case NsAlgorithm::kGram:
    case NsAlgorithm::kAuto:
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": spec.algorithm = ", static_cast<int>(spec.algorithm),
      " is not standard, gram or auto"));
}

// Checks an elementwise kernel's size and its operands: each named pointer
// addresses n elements.
absl::Status CheckVectors(
    absl::string_view what, int64_t n,
    std::initializer_list<std::pair<absl::string_view, const void*>> vectors) {
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(what, "n", n));
  for (const auto& [name, p] : vectors) {
    CANZONA_RETURN_IF_ERROR(checks::Pointer(what, name, p, n));
  }
  return absl::OkStatus();
}

// A rows x cols matrix method's sizes and operands, each rows * cols long.
absl::Status CheckMatrices(
    absl::string_view what, int64_t rows, int64_t cols,
    std::initializer_list<std::pair<absl::string_view, const void*>> matrices) {
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(what, "rows", rows));
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(what, "cols", cols));
  const int64_t count = SatMul(rows, cols);
  for (const auto& [name, p] : matrices) {
    CANZONA_RETURN_IF_ERROR(checks::Pointer(what, name, p, count));
  }
  return absl::OkStatus();
}

// The three host/device copies share their checks; names differ per method.
absl::Status CheckCopy(absl::string_view what, absl::string_view src_name,
                       const float* src, int64_t count,
                       absl::string_view dst_name, const float* dst) {
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(what, "count", count));
  CANZONA_RETURN_IF_ERROR(checks::Pointer(what, src_name, src, count));
  return checks::Pointer(what, dst_name, dst, count);
}

}  // namespace

// ---- Memory -----------------------------------------------------------------

absl::StatusOr<DeviceBuffer> Backend::Allocate(int64_t count) {
  CANZONA_RETURN_IF_ERROR(checks::NonNegative("Allocate", "count", count));
  if (count == 0) return DeviceBuffer();
  // A byte count that wraps would allocate a small block for a huge request.
  constexpr int64_t kMaxCount =
      std::numeric_limits<int64_t>::max() / static_cast<int64_t>(sizeof(float));
  if (count > kMaxCount) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Allocate: ", count, " floats exceed the addressable size"));
  }
  backend_internal::NoteAllocationSize(count);
  return DoAllocate(count);
}

absl::Status Backend::CopyFromHost(const float* host, int64_t count,
                                   float* dst) {
  CANZONA_RETURN_IF_ERROR(
      CheckCopy("CopyFromHost", "host", host, count, "dst", dst));
  if (count == 0) return absl::OkStatus();
  return DoCopyFromHost(host, count, dst);
}

absl::Status Backend::CopyToHost(const float* src, int64_t count, float* host) {
  CANZONA_RETURN_IF_ERROR(
      CheckCopy("CopyToHost", "src", src, count, "host", host));
  if (count == 0) return absl::OkStatus();
  return DoCopyToHost(src, count, host);
}

absl::Status Backend::Copy(const float* src, int64_t count, float* dst) {
  CANZONA_RETURN_IF_ERROR(CheckCopy("Copy", "src", src, count, "dst", dst));
  if (count == 0 || src == dst) return absl::OkStatus();
  return DoCopy(src, count, dst);
}

absl::Status Backend::Copy2D(int64_t rows, int64_t cols, const float* src,
                             int64_t src_ld, float* dst, int64_t dst_ld) {
  constexpr absl::string_view kWhat = "Copy2D";
  CANZONA_RETURN_IF_ERROR(
      CheckMatrices(kWhat, rows, cols, {{"src", src}, {"dst", dst}}));
  CANZONA_RETURN_IF_ERROR(checks::LeadingDim(kWhat, "src_ld", src_ld, cols));
  CANZONA_RETURN_IF_ERROR(checks::LeadingDim(kWhat, "dst_ld", dst_ld, cols));
  if (rows == 0 || cols == 0) return absl::OkStatus();
  return DoCopy2D(rows, cols, src, src_ld, dst, dst_ld);
}

absl::Status Backend::Fill(float value, int64_t count, float* dst) {
  CANZONA_RETURN_IF_ERROR(checks::NonNegative("Fill", "count", count));
  CANZONA_RETURN_IF_ERROR(checks::Pointer("Fill", "dst", dst, count));
  if (count == 0) return absl::OkStatus();
  return DoFill(value, count, dst);
}

absl::Status Backend::Synchronize() { return DoSynchronize(); }

// ---- Dense linear algebra ---------------------------------------------------

absl::Status Backend::Gemm(Transpose trans_a, Transpose trans_b, int64_t m,
                           int64_t n, int64_t k, float alpha, const float* a,
                           int64_t lda, const float* b, int64_t ldb, float beta,
                           float* c, int64_t ldc) {
  CANZONA_RETURN_IF_ERROR(CheckGemm("Gemm", trans_a, trans_b, m, n, k, a, lda,
                                    b, ldb, c, ldc, /*batch=*/1));
  if (m == 0 || n == 0) return absl::OkStatus();
  return DoGemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

absl::Status Backend::GemmStridedBatched(
    Transpose trans_a, Transpose trans_b, int64_t m, int64_t n, int64_t k,
    float alpha, const float* a, int64_t lda, int64_t stride_a, const float* b,
    int64_t ldb, int64_t stride_b, float beta, float* c, int64_t ldc,
    int64_t stride_c, int64_t batch) {
  constexpr absl::string_view kWhat = "GemmStridedBatched";
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "batch", batch));
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "stride_a", stride_a));
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "stride_b", stride_b));
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "stride_c", stride_c));
  // With batch == 0 no matrix is addressed, so null pointers are fine.
  CANZONA_RETURN_IF_ERROR(CheckGemm(kWhat, trans_a, trans_b, m, n, k, a, lda, b,
                                    ldb, c, ldc, batch));
  if (m == 0 || n == 0 || batch == 0) return absl::OkStatus();
  return DoGemmStridedBatched(trans_a, trans_b, m, n, k, alpha, a, lda,
                              stride_a, b, ldb, stride_b, beta, c, ldc,
                              stride_c, batch);
}

absl::Status Backend::Syrk(Transpose trans, int64_t n, int64_t k, float alpha,
                           const float* a, int64_t lda, float beta, float* c,
                           int64_t ldc) {
  constexpr absl::string_view kWhat = "Syrk";
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "n", n));
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "k", k));
  // A is n x k, or k x n when transposed.
  CANZONA_RETURN_IF_ERROR(CheckMatrix(kWhat, "a", "lda", a, SatMul(n, k), lda,
                                      trans == Transpose::kYes ? n : k));
  CANZONA_RETURN_IF_ERROR(
      CheckMatrix(kWhat, "c", "ldc", c, SatMul(n, n), ldc, n));
  if (n == 0) return absl::OkStatus();
  return DoSyrk(trans, n, k, alpha, a, lda, beta, c, ldc);
}

absl::Status Backend::SymmetricEigen(int64_t n, float* a, float* eigenvalues,
                                     EigenPrecision precision) {
  constexpr absl::string_view kWhat = "SymmetricEigen";
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "n", n));
  CANZONA_RETURN_IF_ERROR(checks::Pointer(kWhat, "a", a, SatMul(n, n)));
  CANZONA_RETURN_IF_ERROR(
      checks::Pointer(kWhat, "eigenvalues", eigenvalues, n));
  if (n == 0) return absl::OkStatus();
  return DoSymmetricEigen(n, a, eigenvalues, precision);
}

absl::Status Backend::QrOrthonormalize(int64_t rows, int64_t cols, float* a) {
  constexpr absl::string_view kWhat = "QrOrthonormalize";
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "rows", rows));
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "cols", cols));
  CANZONA_RETURN_IF_ERROR(checks::ThinQrShape(kWhat, rows, cols));
  CANZONA_RETURN_IF_ERROR(checks::Pointer(kWhat, "a", a, SatMul(rows, cols)));
  if (cols == 0) return absl::OkStatus();  // rows >= cols: nothing to do
  return DoQrOrthonormalize(rows, cols, a);
}

absl::Status Backend::NewtonSchulz(const NewtonSchulzSpec& spec, int64_t batch,
                                   int64_t rows, int64_t cols,
                                   const float* input, float* output) {
  constexpr absl::string_view kWhat = "NewtonSchulz";
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "batch", batch));
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "rows", rows));
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "cols", cols));
  const int64_t total = SatMul(batch, SatMul(rows, cols));
  CANZONA_RETURN_IF_ERROR(checks::Pointer(kWhat, "input", input, total));
  CANZONA_RETURN_IF_ERROR(checks::Pointer(kWhat, "output", output, total));
  CANZONA_RETURN_IF_ERROR(CheckNsAlgorithm(kWhat, spec));
  CANZONA_RETURN_IF_ERROR(CheckSupported(spec));
  if (total == 0) return absl::OkStatus();
  return DoNewtonSchulz(spec, batch, rows, cols, input, output);
}

absl::Status Backend::ReserveNewtonSchulz(const NewtonSchulzSpec& spec,
                                          int64_t batch, int64_t rows,
                                          int64_t cols) {
  constexpr absl::string_view kWhat = "ReserveNewtonSchulz";
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "batch", batch));
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "rows", rows));
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "cols", cols));
  CANZONA_RETURN_IF_ERROR(CheckNsAlgorithm(kWhat, spec));
  CANZONA_RETURN_IF_ERROR(CheckSupported(spec));
  if (SatMul(batch, SatMul(rows, cols)) == 0) return absl::OkStatus();
  return DoReserveNewtonSchulz(spec, batch, rows, cols);
}

// ---- Fused elementwise kernels ----------------------------------------------

absl::Status Backend::Lerp(int64_t n, const float* a, const float* b,
                           float weight, float* out) {
  CANZONA_RETURN_IF_ERROR(
      CheckVectors("Lerp", n, {{"a", a}, {"b", b}, {"out", out}}));
  if (n == 0) return absl::OkStatus();
  return DoLerp(n, a, b, weight, out);
}

absl::Status Backend::Axpby(int64_t n, float alpha, const float* x, float beta,
                            float* y) {
  CANZONA_RETURN_IF_ERROR(CheckVectors("Axpby", n, {{"x", x}, {"y", y}}));
  if (n == 0) return absl::OkStatus();
  return DoAxpby(n, alpha, x, beta, y);
}

absl::Status Backend::Scale(int64_t n, float alpha, float* x) {
  CANZONA_RETURN_IF_ERROR(CheckVectors("Scale", n, {{"x", x}}));
  if (n == 0) return absl::OkStatus();
  return DoScale(n, alpha, x);
}

absl::Status Backend::EmaSquare(int64_t n, float decay, float weight,
                                const float* g, float* v) {
  CANZONA_RETURN_IF_ERROR(CheckVectors("EmaSquare", n, {{"g", g}, {"v", v}}));
  if (n == 0) return absl::OkStatus();
  return DoEmaSquare(n, decay, weight, g, v);
}

absl::Status Backend::AdamDirection(int64_t n, const float* m, float m_scale,
                                    const float* v, float v_scale, float eps,
                                    float* out) {
  CANZONA_RETURN_IF_ERROR(
      CheckVectors("AdamDirection", n, {{"m", m}, {"v", v}, {"out", out}}));
  if (n == 0) return absl::OkStatus();
  return DoAdamDirection(n, m, m_scale, v, v_scale, eps, out);
}

absl::Status Backend::AdamWStep(int64_t n, float lr, float beta1, float beta2,
                                float eps, float weight_decay, int64_t step,
                                const float* g, float* p, float* m, float* v) {
  constexpr absl::string_view kWhat = "AdamWStep";
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "n", n));
  // The bias corrections divide by 1 - beta^step, zero at step 0.
  CANZONA_RETURN_IF_ERROR(checks::AtLeast(kWhat, "step", step, 1));
  CANZONA_RETURN_IF_ERROR(
      CheckVectors(kWhat, n, {{"g", g}, {"p", p}, {"m", m}, {"v", v}}));
  if (n == 0) return absl::OkStatus();
  return DoAdamWStep(n, lr, beta1, beta2, eps, weight_decay, step, g, p, m, v);
}

absl::StatusOr<double> Backend::SumSquares(int64_t n, const float* x) {
  CANZONA_RETURN_IF_ERROR(CheckVectors("SumSquares", n, {{"x", x}}));
  if (n == 0) return 0.0;
  return DoSumSquares(n, x);
}

absl::StatusOr<bool> Backend::AllFinite(int64_t n, const float* x) {
  CANZONA_RETURN_IF_ERROR(CheckVectors("AllFinite", n, {{"x", x}}));
  if (n == 0) return true;
  return DoAllFinite(n, x);
}

// ---- Matrix helpers ---------------------------------------------------------

absl::Status Backend::AddIdentity(int64_t n, float alpha, float* a) {
  CANZONA_RETURN_IF_ERROR(checks::NonNegative("AddIdentity", "n", n));
  CANZONA_RETURN_IF_ERROR(checks::Pointer("AddIdentity", "a", a, SatMul(n, n)));
  if (n == 0) return absl::OkStatus();
  return DoAddIdentity(n, alpha, a);
}

absl::Status Backend::ScaleColumns(int64_t rows, int64_t cols, const float* d,
                                   float* a) {
  constexpr absl::string_view kWhat = "ScaleColumns";
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "rows", rows));
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "cols", cols));
  // d is read only when some row is scaled.
  CANZONA_RETURN_IF_ERROR(checks::Pointer(kWhat, "d", d, rows == 0 ? 0 : cols));
  CANZONA_RETURN_IF_ERROR(checks::Pointer(kWhat, "a", a, SatMul(rows, cols)));
  if (rows == 0 || cols == 0) return absl::OkStatus();
  return DoScaleColumns(rows, cols, d, a);
}

absl::Status Backend::ColumnDots(int64_t rows, int64_t cols, const float* a,
                                 const float* b, float* out) {
  constexpr absl::string_view kWhat = "ColumnDots";
  CANZONA_RETURN_IF_ERROR(
      CheckMatrices(kWhat, rows, cols, {{"a", a}, {"b", b}}));
  CANZONA_RETURN_IF_ERROR(checks::Pointer(kWhat, "out", out, cols));
  // Not empty when only rows == 0: the dots are then zeros to be written.
  if (cols == 0) return absl::OkStatus();
  return DoColumnDots(rows, cols, a, b, out);
}

absl::Status Backend::GatherColumns(int64_t rows, int64_t cols,
                                    absl::Span<const int64_t> perm,
                                    const float* src, float* dst) {
  constexpr absl::string_view kWhat = "GatherColumns";
  CANZONA_RETURN_IF_ERROR(
      CheckMatrices(kWhat, rows, cols, {{"src", src}, {"dst", dst}}));
  CANZONA_RETURN_IF_ERROR(checks::Permutation(kWhat, perm, cols));
  if (rows == 0 || cols == 0) return absl::OkStatus();
  return DoGatherColumns(rows, cols, perm, src, dst);
}

absl::Status Backend::GatherRows(int64_t rows, int64_t cols,
                                 absl::Span<const int64_t> perm,
                                 const float* src, float* dst) {
  constexpr absl::string_view kWhat = "GatherRows";
  CANZONA_RETURN_IF_ERROR(
      CheckMatrices(kWhat, rows, cols, {{"src", src}, {"dst", dst}}));
  CANZONA_RETURN_IF_ERROR(checks::Permutation(kWhat, perm, rows));
  if (rows == 0 || cols == 0) return absl::OkStatus();
  return DoGatherRows(rows, cols, perm, src, dst);
}

absl::Status Backend::Transpose2D(int64_t rows, int64_t cols, const float* src,
                                  float* dst) {
  CANZONA_RETURN_IF_ERROR(
      CheckMatrices("Transpose2D", rows, cols, {{"src", src}, {"dst", dst}}));
  if (rows == 0 || cols == 0) return absl::OkStatus();
  return DoTranspose2D(rows, cols, src, dst);
}

}  // namespace canzona
