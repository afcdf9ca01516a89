// The cuda backend's dense linear algebra (cuBLAS, cuSOLVER) and matrix
// helpers.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "kernels/backend_checks.h"
#include "kernels/base/cuda_status.h"
#include "kernels/base/status_macros.h"
#include "kernels/cuda/cuda_backend_impl.h"
#include "kernels/cuda/cuda_kernels.h"

namespace canzona {
namespace cuda_internal {
namespace {

namespace checks = backend_checks;
using cuda_kernels::LaunchConfig;

// Sizes handed to cuSOLVER's 32-bit legacy API must fit in an int. This
// limit is the cuda backend's own (cuBLAS calls use the 64-bit API; LAPACK
// on cpu has its own), hence checked here rather than in Backend's entry
// points.
absl::Status FitsInt(absl::string_view what, absl::string_view field,
                     int64_t value) {
  return checks::Int32Index(what, field, value, "cuSOLVER");
}

// The bytes of a cuSOLVER workspace of `lwork` elements of `element_bytes`,
// rounded up to 256. `lwork` comes from the 32-bit `query`, which reports a
// size that does not fit an int as a negative one (syevd's 1 + 6n + 2n^2
// past n = 32767): RESOURCE_EXHAUSTED naming it, not a huge reservation.
absl::StatusOr<size_t> WorkBytes(absl::string_view what,
                                 absl::string_view query, int lwork,
                                 size_t element_bytes) {
  if (lwork < 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": ", query, " reported a work size of ", lwork,
        " elements: the matrix is too large for cuSOLVER's 32-bit sizes"));
  }
  return (static_cast<size_t>(lwork) * element_bytes + 255) / 256 * 256;
}

cublasOperation_t ToCublas(Transpose t) {
  return t == Transpose::kYes ? CUBLAS_OP_T : CUBLAS_OP_N;
}

}  // namespace

// ---- Dense linear algebra -------------------------------------------------
//
// cuBLAS is column-major. A row-major matrix with leading dimension ld read
// column-major is its transpose, so the row-major C = op(A) op(B) is the
// column-major C^T = op(B)^T op(A)^T: swap the operands and m/n, keep the
// transpose flags.

absl::Status CudaBackend::DoGemm(Transpose trans_a, Transpose trans_b,
                                 int64_t m, int64_t n, int64_t k, float alpha,
                                 const float* a, int64_t lda, const float* b,
                                 int64_t ldb, float beta, float* c,
                                 int64_t ldc) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cublasSgemm_64(cublas_, ToCublas(trans_b), ToCublas(trans_a), n, m, k,
                     &alpha, b, ldb, a, lda, &beta, c, ldc));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoGemmStridedBatched(
    Transpose trans_a, Transpose trans_b, int64_t m, int64_t n, int64_t k,
    float alpha, const float* a, int64_t lda, int64_t stride_a, const float* b,
    int64_t ldb, int64_t stride_b, float beta, float* c, int64_t ldc,
    int64_t stride_c, int64_t batch) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(cublasSgemmStridedBatched_64(
      cublas_, ToCublas(trans_b), ToCublas(trans_a), n, m, k, &alpha, b, ldb,
      stride_b, a, lda, stride_a, &beta, c, ldc, stride_c, batch));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoSyrk(Transpose trans, int64_t n, int64_t k,
                                 float alpha, const float* a, int64_t lda,
                                 float beta, float* c, int64_t ldc) {
  CANZONA_RETURN_IF_ERROR(Activate());
  // Row-major A (n x k) is column-major A' = A^T (k x n), so A A^T = A'^T A'
  // (CUBLAS_OP_T); symmetrically A^T A = A' A'^T (CUBLAS_OP_N). cuBLAS fills
  // the column-major lower triangle, i.e. the row-major upper one; beta
  // therefore scales (and reads) only that triangle of C.
  const cublasOperation_t op =
      trans == Transpose::kNo ? CUBLAS_OP_T : CUBLAS_OP_N;
  CANZONA_CUDA_RETURN_IF_ERROR(cublasSsyrk_64(cublas_, CUBLAS_FILL_MODE_LOWER,
                                              op, n, k, &alpha, a, lda, &beta,
                                              c, ldc));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::MirrorUpperToLower(Cfg(), 1, n, c, ldc, 0));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoSymmetricEigen(int64_t n, float* a,
                                           float* eigenvalues,
                                           EigenPrecision precision) {
  constexpr absl::string_view kWhat = "SymmetricEigen";
  // syevd's work, 1 + 6n + 2n^2 elements, is an int too.
  CANZONA_RETURN_IF_ERROR(
      FitsInt(kWhat, "1 + 6n + 2n^2 (syevd's work size)",
              checks::SatAdd(checks::SatMul(2, checks::SatMul(n, n)),
                             checks::SatAdd(checks::SatMul(6, n), 1))));
  CANZONA_RETURN_IF_ERROR(Activate());
  // syevd may wait for the stream inside cuSOLVER (its host stage reads the
  // tridiagonal form), without a bound: the bounded wait first.
  CANZONA_RETURN_IF_ERROR(AwaitStream(kWhat));
  const int ni = static_cast<int>(n);
  const size_t nn = static_cast<size_t>(n) * static_cast<size_t>(n);
  const LaunchConfig cfg = Cfg();
  // The input is symmetric, so its row-major and column-major views agree
  // and syevd reads it as is (lower column-major == upper row-major
  // triangle). syevd runs on a copy in the workspace: on failure `a` keeps
  // the input, so the caller can retry with kFloat64.
  int* info = nullptr;
  if (precision == EigenPrecision::kFloat32) {
    int lwork = 0;
    CANZONA_CUDA_RETURN_IF_ERROR(cusolverDnSsyevd_bufferSize(
        cusolver_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, ni, a, ni,
        eigenvalues, &lwork));
    const size_t v_off = 0;
    const size_t w_off = v_off + (nn * sizeof(float) + 255) / 256 * 256;
    CANZONA_ASSIGN_OR_RETURN(
        const size_t work_bytes,
        WorkBytes(kWhat, "cusolverDnSsyevd_bufferSize", lwork, sizeof(float)));
    const size_t info_off = w_off + work_bytes;
    CANZONA_ASSIGN_OR_RETURN(
        void* ws,
        Reserve(solver_ws_, info_off + sizeof(pinned_->eigen_report)));
    char* base = static_cast<char*>(ws);
    auto* v = reinterpret_cast<float*>(base + v_off);
    auto* work = reinterpret_cast<float*>(base + w_off);
    info = reinterpret_cast<int*>(base + info_off);
    CANZONA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        v, a, nn * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    CANZONA_CUDA_RETURN_IF_ERROR(cusolverDnSsyevd(
        cusolver_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, ni, v, ni,
        eigenvalues, work, lwork, info));
    CANZONA_RETURN_IF_ERROR(
        FetchEigenReport(n, eigenvalues, info, "cusolverDnSsyevd"));
    // Column-major eigenvectors-as-columns == row-major eigenvectors-as-rows;
    // the interface wants them as row-major columns: transpose.
    CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::Transpose(cfg, 1, n, n, v, a));
    return absl::OkStatus();
  }

  // kFloat64: solve in double, round the results to float32.
  const size_t v_off = 0;
  const size_t ev_off = v_off + (nn * sizeof(double) + 255) / 256 * 256;
  const size_t w_off =
      ev_off + (static_cast<size_t>(n) * sizeof(double) + 255) / 256 * 256;
  // Query with placeholder pointers: bufferSize reads no data.
  int lwork = 0;
  CANZONA_CUDA_RETURN_IF_ERROR(cusolverDnDsyevd_bufferSize(
      cusolver_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, ni,
      reinterpret_cast<const double*>(a), ni,
      reinterpret_cast<const double*>(eigenvalues), &lwork));
  CANZONA_ASSIGN_OR_RETURN(
      const size_t work_bytes,
      WorkBytes(kWhat, "cusolverDnDsyevd_bufferSize", lwork, sizeof(double)));
  const size_t info_off = w_off + work_bytes;
  CANZONA_ASSIGN_OR_RETURN(
      void* ws, Reserve(solver_ws_, info_off + sizeof(pinned_->eigen_report)));
  char* base = static_cast<char*>(ws);
  auto* v = reinterpret_cast<double*>(base + v_off);
  auto* w = reinterpret_cast<double*>(base + ev_off);
  auto* work = reinterpret_cast<double*>(base + w_off);
  info = reinterpret_cast<int*>(base + info_off);
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::FloatToDouble(cfg, static_cast<int64_t>(nn), a, v));
  CANZONA_CUDA_RETURN_IF_ERROR(cusolverDnDsyevd(
      cusolver_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, ni, v, ni, w,
      work, lwork, info));
  // Rounded before the report, so that one too large for float32 counts as
  // not finite; `a` is written only after it (a failure leaves the input).
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::DoubleToFloat(cfg, n, w, eigenvalues));
  CANZONA_RETURN_IF_ERROR(
      FetchEigenReport(n, eigenvalues, info, "cusolverDnDsyevd"));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::TransposeDoubleToFloat(cfg, n, n, v, a));
  return absl::OkStatus();
}

absl::Status CudaBackend::FetchEigenReport(int64_t n, const float* eigenvalues,
                                           int* report,
                                           absl::string_view solver) {
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(report + 1, 0, sizeof(int), stream_));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::FlagNonFinite(Cfg(), n, eigenvalues, report + 1));
  CANZONA_RETURN_IF_ERROR(FetchToPinned(report, sizeof(pinned_->eigen_report),
                                        pinned_->eigen_report,
                                        "SymmetricEigen"));
  const int info = pinned_->eigen_report[0];
  if (info != 0) {
    return absl::InternalError(
        absl::StrCat("SymmetricEigen: ", solver, " failed (info = ", info,
                     info > 0 ? ", did not converge)" : ", bad argument)"));
  }
  if (pinned_->eigen_report[1] != 0) return NonFiniteEigenvalue();
  return absl::OkStatus();
}

absl::Status CudaBackend::DoQrOrthonormalize(int64_t rows, int64_t cols,
                                             float* a) {
  CANZONA_RETURN_IF_ERROR(
      FitsInt("QrOrthonormalize", "rows * cols", checks::SatMul(rows, cols)));
  CANZONA_RETURN_IF_ERROR(Activate());
  const int m = static_cast<int>(rows);
  const int k = static_cast<int>(cols);
  const size_t size = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  // Query with the caller's buffer as a placeholder for both arrays:
  // bufferSize reads no data.
  int lwork_geqrf = 0, lwork_orgqr = 0;
  CANZONA_CUDA_RETURN_IF_ERROR(
      cusolverDnSgeqrf_bufferSize(cusolver_, m, k, a, m, &lwork_geqrf));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cusolverDnSorgqr_bufferSize(cusolver_, m, k, k, a, m, a, &lwork_orgqr));
  const int lwork = lwork_geqrf > lwork_orgqr ? lwork_geqrf : lwork_orgqr;
  const size_t q_off = 0;
  const size_t tau_off = q_off + (size * sizeof(float) + 255) / 256 * 256;
  const size_t w_off =
      tau_off + (static_cast<size_t>(cols) * sizeof(float) + 255) / 256 * 256;
  CANZONA_ASSIGN_OR_RETURN(
      const size_t work_bytes,
      WorkBytes("QrOrthonormalize", "geqrf/orgqr_bufferSize", lwork,
                sizeof(float)));
  const size_t info_off = w_off + work_bytes;
  CANZONA_ASSIGN_OR_RETURN(void* ws,
                           Reserve(solver_ws_, info_off + sizeof(int)));
  char* base = static_cast<char*>(ws);
  auto* q = reinterpret_cast<float*>(base + q_off);
  auto* tau = reinterpret_cast<float*>(base + tau_off);
  auto* work = reinterpret_cast<float*>(base + w_off);
  auto* info = reinterpret_cast<int*>(base + info_off);
  const LaunchConfig cfg = Cfg();
  // Row-major rows x cols -> row-major cols x rows == column-major rows x
  // cols (ld = rows), which is what LAPACK factors. The same Householder
  // reflectors as the cpu backend's LAPACKE_sgeqrf result, hence the same
  // signs.
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::Transpose(cfg, 1, rows, cols, a, q));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cusolverDnSgeqrf(cusolver_, m, k, q, m, tau, work, lwork, info));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cusolverDnSorgqr(cusolver_, m, k, k, q, m, tau, work, lwork, info));
  // devInfo is only ever negative for an illegal argument, which Backend's
  // entry point and FitsInt rule out; not reading it keeps QR free of host
  // synchronization.
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::Transpose(cfg, 1, cols, rows, q, a));
  return absl::OkStatus();
}

// ---- Matrix helpers -------------------------------------------------------

absl::Status CudaBackend::DoAddIdentity(int64_t n, float alpha, float* a) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::AddIdentity(Cfg(), n, alpha, a));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoScaleColumns(int64_t rows, int64_t cols,
                                         const float* d, float* a) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::ScaleColumns(Cfg(), rows, cols, d, a));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoColumnDots(int64_t rows, int64_t cols,
                                       const float* a, const float* b,
                                       float* out) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::ColumnDots(Cfg(), rows, cols, a, b, out));
  return absl::OkStatus();
}

absl::StatusOr<const int64_t*> CudaBackend::DescendingOrder(int64_t n,
                                                            const float* keys) {
  CANZONA_ASSIGN_OR_RETURN(
      void* ws, Reserve(scratch_ws_, static_cast<size_t>(n) * sizeof(int64_t)));
  auto* order = static_cast<int64_t*>(ws);
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::DescendingOrder(Cfg(), n, keys, order));
  return order;
}

absl::Status CudaBackend::DoSortColumns(int64_t rows, int64_t cols,
                                        const float* keys, const float* src,
                                        float* dst) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_ASSIGN_OR_RETURN(const int64_t* order, DescendingOrder(cols, keys));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::GatherColumns(Cfg(), rows, cols, order, src, dst));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoSortRows(int64_t rows, int64_t cols,
                                     const float* keys, const float* src,
                                     float* dst) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_ASSIGN_OR_RETURN(const int64_t* order, DescendingOrder(rows, keys));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::GatherRows(Cfg(), rows, cols, order, src, dst));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoTranspose2D(int64_t rows, int64_t cols,
                                        const float* src, float* dst) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::Transpose(Cfg(), 1, rows, cols, src, dst));
  return absl::OkStatus();
}

}  // namespace cuda_internal
}  // namespace canzona
