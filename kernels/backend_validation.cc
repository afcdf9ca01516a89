// Backend's public entry points (the Non-Virtual Interface of backend.h):
// each validates its arguments once for every implementation, returns early
// from calls that touch no element, and dispatches to the implementation's
// Do-method. Checks run in argument order, so the first bad argument is the
// one reported.
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/backend_checks.h"
#include "kernels/backend_ranges.h"
#include "kernels/base/status_macros.h"

namespace canzona {
namespace {

namespace checks = backend_checks;
using checks::SatMul;

// A time mark's index (Backend::Mark).
absl::Status CheckMark(absl::string_view what, int mark) {
  if (mark >= 0 && mark < Backend::kTimeMarks) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": mark ", mark, " is not in [0, ", Backend::kTimeMarks, ")"));
}

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

using backend_ranges::CheckDisjoint;
using backend_ranges::CheckGemmRanges;
using backend_ranges::CheckRanges;
using backend_ranges::CheckReorder;
using backend_ranges::CheckSameOrDisjoint;
using backend_ranges::RowsOverlap;
using backend_ranges::Side;
using backend_ranges::Spanned;

// A copy between host memory and the backend's, waiting or enqueued: the
// arguments, then both ranges (`host` and the backend side may be
// redirected, see Range). False: nothing to copy.
absl::StatusOr<bool> CheckFromHost(const Backend& backend,
                                   absl::string_view what, const float*& host,
                                   int64_t count, float*& dst) {
  CANZONA_RETURN_IF_ERROR(CheckCopy(what, "host", host, count, "dst", dst));
  if (count == 0) return false;
  CANZONA_RETURN_IF_ERROR(
      CheckRanges(backend, what,
                  {{"host", host, count, Side::kHost}, {"dst", dst, count}}));
  return true;
}

absl::StatusOr<bool> CheckToHost(const Backend& backend, absl::string_view what,
                                 const float*& src, int64_t count,
                                 float*& host) {
  CANZONA_RETURN_IF_ERROR(CheckCopy(what, "src", src, count, "host", host));
  if (count == 0) return false;
  CANZONA_RETURN_IF_ERROR(
      CheckRanges(backend, what,
                  {{"src", src, count}, {"host", host, count, Side::kHost}}));
  return true;
}

}  // namespace

absl::StatusOr<RegisteredMemory> Backend::RegisterMemory(
    const void* begin, int64_t bytes, absl::string_view label) {
  CANZONA_RETURN_IF_ERROR(allocations_.Add(
      begin, bytes, label, HostAlias(static_cast<const float*>(begin))));
  return RegisteredMemory(&allocations_, begin);
}

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
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer buffer, DoAllocate(count));
  // A forwarding backend (a test's counting wrapper) returns its inner
  // backend's buffer, which that backend has registered.
  if (buffer.owner() == this) {
    CANZONA_RETURN_IF_ERROR(allocations_.Add(
        buffer.data(), SatMul(count, sizeof(float)),
        absl::StrCat("Allocate(", count, ")"), HostAlias(buffer.data())));
  }
  return buffer;
}

absl::Status Backend::CopyFromHost(const float* host, int64_t count,
                                   float* dst) {
  CANZONA_ASSIGN_OR_RETURN(
      bool any, CheckFromHost(*this, "CopyFromHost", host, count, dst));
  if (!any) return absl::OkStatus();
  return RunWaiting<absl::Status>(
      "CopyFromHost", [&] { return DoCopyFromHost(host, count, dst); });
}

absl::Status Backend::CopyToHost(const float* src, int64_t count, float* host) {
  CANZONA_ASSIGN_OR_RETURN(bool any,
                           CheckToHost(*this, "CopyToHost", src, count, host));
  if (!any) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(BeginHostWait("CopyToHost"));
  return RunWaiting<absl::Status>(
      "CopyToHost", [&] { return DoCopyToHost(src, count, host); });
}

absl::Status Backend::EnqueueCopyFromHost(const float* host, int64_t count,
                                          float* dst) {
  CANZONA_ASSIGN_OR_RETURN(
      bool any, CheckFromHost(*this, "EnqueueCopyFromHost", host, count, dst));
  return any ? DoEnqueueCopyFromHost(host, count, dst) : absl::OkStatus();
}

absl::Status Backend::EnqueueCopyToHost(const float* src, int64_t count,
                                        float* host) {
  CANZONA_ASSIGN_OR_RETURN(
      bool any, CheckToHost(*this, "EnqueueCopyToHost", src, count, host));
  return any ? DoEnqueueCopyToHost(src, count, host) : absl::OkStatus();
}

absl::Status Backend::Copy(const float* src, int64_t count, float* dst) {
  CANZONA_RETURN_IF_ERROR(CheckCopy("Copy", "src", src, count, "dst", dst));
  if (count == 0 || src == dst) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(CheckDisjoint("Copy", "src", src, count, "dst", dst,
                                        count,
                                        "cudaMemcpy's result is undefined"));
  CANZONA_RETURN_IF_ERROR(
      CheckRanges(*this, "Copy", {{"src", src, count}, {"dst", dst, count}}));
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
  if (src == dst && src_ld == dst_ld) return absl::OkStatus();
  if (RowsOverlap(rows, cols, src, src_ld, dst, dst_ld)) {
    return absl::InvalidArgumentError(absl::StrCat(
        kWhat, ": src [", absl::Hex(reinterpret_cast<uintptr_t>(src)), ", ",
        rows, " x ", cols, ", ld ", src_ld, "] and dst [",
        absl::Hex(reinterpret_cast<uintptr_t>(dst)), ", ld ", dst_ld,
        "] overlap (cudaMemcpy2D's result is undefined)"));
  }
  CANZONA_RETURN_IF_ERROR(
      CheckRanges(*this, kWhat,
                  {{"src", src, Spanned(rows, cols, src_ld)},
                   {"dst", dst, Spanned(rows, cols, dst_ld)}}));
  return DoCopy2D(rows, cols, src, src_ld, dst, dst_ld);
}

absl::Status Backend::Fill(float value, int64_t count, float* dst) {
  CANZONA_RETURN_IF_ERROR(checks::NonNegative("Fill", "count", count));
  CANZONA_RETURN_IF_ERROR(checks::Pointer("Fill", "dst", dst, count));
  if (count == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(CheckRanges(*this, "Fill", {{"dst", dst, count}}));
  return DoFill(value, count, dst);
}

absl::Status Backend::Synchronize() {
  CANZONA_RETURN_IF_ERROR(BeginHostWait("Synchronize"));
  return RunWaiting<absl::Status>("Synchronize",
                                  [&] { return DoSynchronize(); });
}

// ---- Dense linear algebra ---------------------------------------------------

absl::Status Backend::Gemm(Transpose trans_a, Transpose trans_b, int64_t m,
                           int64_t n, int64_t k, float alpha, const float* a,
                           int64_t lda, const float* b, int64_t ldb, float beta,
                           float* c, int64_t ldc) {
  CANZONA_RETURN_IF_ERROR(CheckGemm("Gemm", trans_a, trans_b, m, n, k, a, lda,
                                    b, ldb, c, ldc, /*batch=*/1));
  if (m == 0 || n == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(CheckGemmRanges(*this, "Gemm", trans_a, trans_b, m, n,
                                          k, a, lda, 0, b, ldb, 0, c, ldc, 0,
                                          /*batch=*/1));
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
  CANZONA_RETURN_IF_ERROR(CheckGemmRanges(*this, kWhat, trans_a, trans_b, m, n,
                                          k, a, lda, stride_a, b, ldb, stride_b,
                                          c, ldc, stride_c, batch));
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
  CANZONA_RETURN_IF_ERROR(CheckRanges(
      *this, kWhat,
      {{"a", a,
        trans == Transpose::kYes ? Spanned(k, n, lda) : Spanned(n, k, lda)},
       {"c", c, Spanned(n, n, ldc)}}));
  return DoSyrk(trans, n, k, alpha, a, lda, beta, c, ldc);
}

absl::Status Backend::NonFiniteEigenvalue() {
  return absl::InternalError(
      "SymmetricEigen: an eigenvalue is not finite (the matrix holds a NaN "
      "or an infinity)");
}

absl::Status Backend::SymmetricEigen(int64_t n, float* a, float* eigenvalues,
                                     EigenPrecision precision) {
  constexpr absl::string_view kWhat = "SymmetricEigen";
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "n", n));
  CANZONA_RETURN_IF_ERROR(checks::Pointer(kWhat, "a", a, SatMul(n, n)));
  CANZONA_RETURN_IF_ERROR(
      checks::Pointer(kWhat, "eigenvalues", eigenvalues, n));
  if (n == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(CheckRanges(
      *this, kWhat, {{"a", a, SatMul(n, n)}, {"eigenvalues", eigenvalues, n}}));
  CANZONA_RETURN_IF_ERROR(BeginHostWait(kWhat));
  return RunWaiting<absl::Status>(
      kWhat, [&] { return DoSymmetricEigen(n, a, eigenvalues, precision); });
}

absl::Status Backend::QrOrthonormalize(int64_t rows, int64_t cols, float* a) {
  constexpr absl::string_view kWhat = "QrOrthonormalize";
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "rows", rows));
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "cols", cols));
  CANZONA_RETURN_IF_ERROR(checks::ThinQrShape(kWhat, rows, cols));
  CANZONA_RETURN_IF_ERROR(checks::Pointer(kWhat, "a", a, SatMul(rows, cols)));
  if (cols == 0) return absl::OkStatus();  // rows >= cols: nothing to do
  CANZONA_RETURN_IF_ERROR(
      CheckRanges(*this, kWhat, {{"a", a, SatMul(rows, cols)}}));
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
  CANZONA_RETURN_IF_ERROR(CheckRanges(
      *this, kWhat, {{"input", input, total}, {"output", output, total}}));
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
  CANZONA_RETURN_IF_ERROR(
      CheckRanges(*this, "Lerp", {{"a", a, n}, {"b", b, n}, {"out", out, n}}));
  CANZONA_RETURN_IF_ERROR(CheckSameOrDisjoint(
      "Lerp", n, {{"a", a, false}, {"b", b, false}, {"out", out, true}}));
  return DoLerp(n, a, b, weight, out);
}

absl::Status Backend::NesterovMomentum(int64_t n, float beta, const float* grad,
                                       float* momentum, float* out) {
  constexpr absl::string_view kWhat = "NesterovMomentum";
  CANZONA_RETURN_IF_ERROR(CheckVectors(
      kWhat, n, {{"grad", grad}, {"momentum", momentum}, {"out", out}}));
  if (n == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(CheckRanges(
      *this, kWhat,
      {{"grad", grad, n}, {"momentum", momentum, n}, {"out", out, n}}));
  CANZONA_RETURN_IF_ERROR(CheckSameOrDisjoint(kWhat, n,
                                              {{"grad", grad, false},
                                               {"momentum", momentum, true},
                                               {"out", out, true}}));
  return DoNesterovMomentum(n, beta, grad, momentum, out);
}

absl::Status Backend::Axpby(int64_t n, float alpha, const float* x, float beta,
                            float* y, SquaredChange change) {
  CANZONA_RETURN_IF_ERROR(CheckVectors("Axpby", n, {{"x", x}, {"y", y}}));
  if (n == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(
      CheckRanges(*this, "Axpby", {{"x", x, n}, {"y", y, n}}));
  CANZONA_RETURN_IF_ERROR(
      CheckSameOrDisjoint("Axpby", n, {{"x", x, false}, {"y", y, true}}));
  if (change == SquaredChange::kQueue) queued_unread_ = true;
  return DoAxpby(n, alpha, x, beta, y, change);
}

absl::Status Backend::Scale(int64_t n, float alpha, float* x) {
  CANZONA_RETURN_IF_ERROR(CheckVectors("Scale", n, {{"x", x}}));
  if (n == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(CheckRanges(*this, "Scale", {{"x", x, n}}));
  return DoScale(n, alpha, x);
}

absl::Status Backend::EmaSquare(int64_t n, float decay, float weight,
                                const float* g, float* v) {
  CANZONA_RETURN_IF_ERROR(CheckVectors("EmaSquare", n, {{"g", g}, {"v", v}}));
  if (n == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(
      CheckRanges(*this, "EmaSquare", {{"g", g, n}, {"v", v, n}}));
  CANZONA_RETURN_IF_ERROR(
      CheckSameOrDisjoint("EmaSquare", n, {{"g", g, false}, {"v", v, true}}));
  return DoEmaSquare(n, decay, weight, g, v);
}

absl::Status Backend::AdamDirection(int64_t n, const float* m, float m_scale,
                                    const float* v, float v_scale, float eps,
                                    float* out) {
  CANZONA_RETURN_IF_ERROR(
      CheckVectors("AdamDirection", n, {{"m", m}, {"v", v}, {"out", out}}));
  if (n == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(CheckRanges(
      *this, "AdamDirection", {{"m", m, n}, {"v", v, n}, {"out", out, n}}));
  CANZONA_RETURN_IF_ERROR(CheckSameOrDisjoint(
      "AdamDirection", n,
      {{"m", m, false}, {"v", v, false}, {"out", out, true}}));
  return DoAdamDirection(n, m, m_scale, v, v_scale, eps, out);
}

absl::Status Backend::AdamWStep(int64_t n, float lr, float beta1, float beta2,
                                float eps, float weight_decay, int64_t step,
                                const float* g, float* p, float* m, float* v,
                                SquaredChange change) {
  constexpr absl::string_view kWhat = "AdamWStep";
  CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, "n", n));
  // The bias corrections divide by 1 - beta^step, zero at step 0.
  CANZONA_RETURN_IF_ERROR(checks::AtLeast(kWhat, "step", step, 1));
  CANZONA_RETURN_IF_ERROR(
      CheckVectors(kWhat, n, {{"g", g}, {"p", p}, {"m", m}, {"v", v}}));
  if (n == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(CheckRanges(
      *this, kWhat, {{"g", g, n}, {"p", p, n}, {"m", m, n}, {"v", v, n}}));
  CANZONA_RETURN_IF_ERROR(CheckSameOrDisjoint(
      kWhat, n,
      {{"g", g, false}, {"p", p, true}, {"m", m, true}, {"v", v, true}}));
  if (change == SquaredChange::kQueue) queued_unread_ = true;
  return DoAdamWStep(n, lr, beta1, beta2, eps, weight_decay, step, g, p, m, v,
                     change);
}

absl::Status Backend::AdamWStepMany(absl::Span<const AdamWTensor> tensors,
                                    float lr, float beta1, float beta2,
                                    float eps, float weight_decay, int64_t step,
                                    SquaredChange change) {
  constexpr absl::string_view kWhat = "AdamWStepMany";
  CANZONA_RETURN_IF_ERROR(checks::AtLeast(kWhat, "step", step, 1));
  std::vector<AdamWTensor> resolved;
  resolved.reserve(tensors.size());
  for (size_t k = 0; k < tensors.size(); ++k) {
    AdamWTensor t = tensors[k];
    const std::string at = absl::StrCat("tensors[", k, "].");
    const std::string n = at + "n", g = at + "g", p = at + "p", m = at + "m",
                      v = at + "v";
    CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, n, t.n));
    for (const auto& [name, ptr] :
         {std::pair<absl::string_view, const void*>{g, t.g},
          {p, t.p},
          {m, t.m},
          {v, t.v}}) {
      CANZONA_RETURN_IF_ERROR(checks::Pointer(kWhat, name, ptr, t.n));
    }
    if (t.n == 0) continue;
    CANZONA_RETURN_IF_ERROR(CheckRanges(
        *this, kWhat,
        {{g, t.g, t.n}, {p, t.p, t.n}, {m, t.m, t.n}, {v, t.v, t.n}}));
    CANZONA_RETURN_IF_ERROR(CheckSameOrDisjoint(
        kWhat, t.n,
        {{g, t.g, false}, {p, t.p, true}, {m, t.m, true}, {v, t.v, true}}));
    resolved.push_back(t);
  }
  if (resolved.empty()) return absl::OkStatus();
  if (change == SquaredChange::kQueue) queued_unread_ = true;
  return DoAdamWStepMany(resolved, lr, beta1, beta2, eps, weight_decay, step,
                         change);
}

absl::StatusOr<double> Backend::SumSquares(int64_t n, const float* x) {
  CANZONA_RETURN_IF_ERROR(CheckVectors("SumSquares", n, {{"x", x}}));
  if (n == 0) return 0.0;
  CANZONA_RETURN_IF_ERROR(CheckRanges(*this, "SumSquares", {{"x", x, n}}));
  CANZONA_RETURN_IF_ERROR(BeginHostWait("SumSquares"));
  return RunWaiting<absl::StatusOr<double>>("SumSquares",
                                            [&] { return DoSumSquares(n, x); });
}

absl::Status Backend::EnqueueSumSquares(int64_t n, const float* x) {
  CANZONA_RETURN_IF_ERROR(CheckVectors("EnqueueSumSquares", n, {{"x", x}}));
  if (n == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(
      CheckRanges(*this, "EnqueueSumSquares", {{"x", x, n}}));
  queued_unread_ = true;
  return DoEnqueueSumSquares(n, x);
}

absl::Status Backend::EnqueueSquaredDistance(int64_t n, const float* a,
                                             const float* b) {
  constexpr absl::string_view kWhat = "EnqueueSquaredDistance";
  CANZONA_RETURN_IF_ERROR(CheckVectors(kWhat, n, {{"a", a}, {"b", b}}));
  if (n == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(
      CheckRanges(*this, kWhat, {{"a", a, n}, {"b", b, n}}));
  queued_unread_ = true;
  return DoEnqueueSquaredDistance(n, a, b);
}

absl::StatusOr<double> Backend::TakeSumSquares() {
  if (queued_unread_) {
    CANZONA_RETURN_IF_ERROR(BeginHostWait("TakeSumSquares"));
  }
  queued_unread_ = false;
  return RunWaiting<absl::StatusOr<double>>("TakeSumSquares",
                                            [&] { return DoTakeSumSquares(); });
}

absl::Status Backend::Mark(int mark) {
  CANZONA_RETURN_IF_ERROR(CheckMark("Mark", mark));
  return DoMark(mark);
}

absl::StatusOr<double> Backend::SecondsBetween(int from, int to) {
  CANZONA_RETURN_IF_ERROR(CheckMark("SecondsBetween", from));
  CANZONA_RETURN_IF_ERROR(CheckMark("SecondsBetween", to));
  return DoSecondsBetween(from, to);
}

absl::Status Backend::SumSquaresMany(absl::Span<const float* const> xs,
                                     absl::Span<const int64_t> ns,
                                     absl::Span<double> out) {
  constexpr absl::string_view kWhat = "SumSquaresMany";
  if (ns.size() != xs.size() || out.size() != xs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": ns has ", ns.size(), " and out ", out.size(),
                     " entries for ", xs.size(), " vectors"));
  }
  std::vector<const float*> resolved(xs.begin(), xs.end());
  for (size_t k = 0; k < xs.size(); ++k) {
    const std::string n_name = absl::StrCat("ns[", k, "]");
    const std::string x_name = absl::StrCat("xs[", k, "]");
    CANZONA_RETURN_IF_ERROR(checks::NonNegative(kWhat, n_name, ns[k]));
    CANZONA_RETURN_IF_ERROR(checks::Pointer(kWhat, x_name, xs[k], ns[k]));
    CANZONA_RETURN_IF_ERROR(
        CheckRanges(*this, kWhat, {{x_name, resolved[k], ns[k]}}));
  }
  if (xs.empty()) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(BeginHostWait(kWhat));
  queued_unread_ = false;
  return RunWaiting<absl::Status>(
      kWhat, [&] { return DoSumSquaresMany(resolved, ns, out); });
}

absl::StatusOr<bool> Backend::AllFinite(int64_t n, const float* x) {
  CANZONA_RETURN_IF_ERROR(CheckVectors("AllFinite", n, {{"x", x}}));
  if (n == 0) return true;
  CANZONA_RETURN_IF_ERROR(CheckRanges(*this, "AllFinite", {{"x", x, n}}));
  CANZONA_RETURN_IF_ERROR(BeginHostWait("AllFinite"));
  return RunWaiting<absl::StatusOr<bool>>("AllFinite",
                                          [&] { return DoAllFinite(n, x); });
}

absl::Status Backend::ScaleToNorm(int64_t n, const float* reference, Norm norm,
                                  double eps, float* x) {
  constexpr absl::string_view kWhat = "ScaleToNorm";
  CANZONA_RETURN_IF_ERROR(CheckVectors(kWhat, n, {{"x", x}}));
  if (norm != Norm::kL2 && norm != Norm::kRms) {
    return absl::InvalidArgumentError(absl::StrCat(
        kWhat, ": norm = ", static_cast<int>(norm), " is not l2 or rms"));
  }
  if (!(eps >= 0) || !std::isfinite(eps)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": eps = ", eps, " must be finite and >= 0"));
  }
  if (n == 0) return absl::OkStatus();
  if (reference == nullptr) {
    CANZONA_RETURN_IF_ERROR(CheckRanges(*this, kWhat, {{"x", x, n}}));
  } else {
    CANZONA_RETURN_IF_ERROR(
        CheckRanges(*this, kWhat, {{"reference", reference, n}, {"x", x, n}}));
  }
  return DoScaleToNorm(n, reference, norm, eps, x);
}

absl::Status Backend::LiftedPower(int64_t n, const float* x, double floor,
                                  double exponent, float* out) {
  constexpr absl::string_view kWhat = "LiftedPower";
  CANZONA_RETURN_IF_ERROR(CheckVectors(kWhat, n, {{"x", x}, {"out", out}}));
  if (!std::isfinite(floor)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": floor = ", floor, " must be finite"));
  }
  if (!std::isfinite(exponent)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": exponent = ", exponent, " must be finite"));
  }
  if (n == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(
      CheckRanges(*this, kWhat, {{"x", x, n}, {"out", out, n}}));
  CANZONA_RETURN_IF_ERROR(
      CheckSameOrDisjoint(kWhat, n, {{"x", x, false}, {"out", out, true}}));
  return DoLiftedPower(n, x, floor, exponent, out);
}

// ---- Matrix helpers ---------------------------------------------------------

absl::Status Backend::AddIdentity(int64_t n, float alpha, float* a) {
  CANZONA_RETURN_IF_ERROR(checks::NonNegative("AddIdentity", "n", n));
  CANZONA_RETURN_IF_ERROR(checks::Pointer("AddIdentity", "a", a, SatMul(n, n)));
  if (n == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(
      CheckRanges(*this, "AddIdentity", {{"a", a, SatMul(n, n)}}));
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
  CANZONA_RETURN_IF_ERROR(CheckRanges(
      *this, kWhat, {{"d", d, cols}, {"a", a, SatMul(rows, cols)}}));
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
  CANZONA_RETURN_IF_ERROR(CheckRanges(*this, kWhat,
                                      {{"a", a, SatMul(rows, cols)},
                                       {"b", b, SatMul(rows, cols)},
                                       {"out", out, cols}}));
  return DoColumnDots(rows, cols, a, b, out);
}

absl::Status Backend::SortColumns(int64_t rows, int64_t cols, const float* keys,
                                  const float* src, float* dst) {
  constexpr absl::string_view kWhat = "SortColumns";
  CANZONA_RETURN_IF_ERROR(
      CheckMatrices(kWhat, rows, cols, {{"src", src}, {"dst", dst}}));
  CANZONA_RETURN_IF_ERROR(checks::Pointer(kWhat, "keys", keys, cols));
  CANZONA_RETURN_IF_ERROR(checks::Int32Index(kWhat, "cols", cols, "sort"));
  if (rows == 0 || cols == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(CheckRanges(*this, kWhat, {{"keys", keys, cols}}));
  CANZONA_RETURN_IF_ERROR(CheckReorder(*this, kWhat, rows, cols, src, dst));
  return DoSortColumns(rows, cols, keys, src, dst);
}

absl::Status Backend::SortRows(int64_t rows, int64_t cols, const float* keys,
                               const float* src, float* dst) {
  constexpr absl::string_view kWhat = "SortRows";
  CANZONA_RETURN_IF_ERROR(
      CheckMatrices(kWhat, rows, cols, {{"src", src}, {"dst", dst}}));
  CANZONA_RETURN_IF_ERROR(checks::Pointer(kWhat, "keys", keys, rows));
  CANZONA_RETURN_IF_ERROR(checks::Int32Index(kWhat, "rows", rows, "sort"));
  if (rows == 0 || cols == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(CheckRanges(*this, kWhat, {{"keys", keys, rows}}));
  CANZONA_RETURN_IF_ERROR(CheckReorder(*this, kWhat, rows, cols, src, dst));
  return DoSortRows(rows, cols, keys, src, dst);
}

absl::Status Backend::Transpose2D(int64_t rows, int64_t cols, const float* src,
                                  float* dst) {
  CANZONA_RETURN_IF_ERROR(
      CheckMatrices("Transpose2D", rows, cols, {{"src", src}, {"dst", dst}}));
  if (rows == 0 || cols == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(
      CheckReorder(*this, "Transpose2D", rows, cols, src, dst));
  return DoTranspose2D(rows, cols, src, dst);
}

}  // namespace canzona
